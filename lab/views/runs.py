"""Saved runs: list every results.json on disk, load any few, overlay them, diff their settings.

Like TensorBoard's or W&B's "compare runs", over the files the lab already writes. The user's
runs live under the lab home (the working directory, or $LAB_HOME when it is set:
`lab.views.home`), never in the package or its checkout:

    <home>/runs/<kind>/<run>/results.json  runs (notebooks, `precision-lab pair`, the panel)
    <sweep>/<run>/results.json             sweep runs (a folder holding sweep.csv)
    <home>/baselines/<name>.json           known-good baselines (lab.views.baselines)

    saved = list_runs()                          # the home's runs and baselines, newest first
    runs_table(saved)                            # one row per run: kind, family, metrics
    cmp = compare_runs(["runs/a", "baseline:flux_tiny"])
    cmp.settings_diff()                          # side fields and meta that differ
    cmp.plot_overlay("rel_max", backend="plotly")
    cmp.verdicts()                               # each later run against the first
    save_examples()                              # two example runs, when fewer are saved
    run_folder("quickstart", "", family="flux", preset="tiny")  # where a new run writes

A run is named by its folder relative to the root searched ("runs/quickstart/flux-tiny-...",
"runs/sweep/001_mode=local"), by its file when that is not results.json
("runs/param_overrides/without_rules.json"), or "baseline:<name>". Any of these, a path to
the JSON or its folder, or a unique part of a name finds it. A ratio-drift Trajectory's
results.json is listed (kind "trajectory") but has no layers to overlay.
"""

from __future__ import annotations

import difflib
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lab.base.arguments import checked_arguments
from lab.pairing.result import Result, partial_words
from lab.views.baselines import BaselineComparison, compare_to_baseline
from lab.views.home import baselines_home, lab_home, run_folder

__all__ = [
    "RunComparison",
    "SavedRun",
    "compare_runs",
    "find_run",
    "list_runs",
    "load_runs",
    "newest",
    "run_folder",
    "runs_table",
    "save_examples",
    "settings_diff",
]

if TYPE_CHECKING:
    import pandas as pd

    from lab.families import FamilyName

Kind = Literal["run", "sweep", "baseline", "trajectory"]
BASELINE_PREFIX = "baseline:"
# Meta that says nothing about what was compared: when the run happened, how long it took, and
# how the pair ran (its side threads' core, hand-overs, metric batches: the same numbers either
# way, and the core differs from run to run).
_VOLATILE_META: frozenset[str] = frozenset(
    {"timings_s", "timestamp", "created", "pair_core", "metric_batches"}
)
_SUMMARY_COLUMNS: tuple[str, ...] = (
    "partial", "pairs", "bitexact_pairs", "max_ulp", "first_divergent_module",
    "model_output_rel_max", "model_output_max_abs_diff",
)  # fmt: skip
# Folders never searched: environments and caches hold other projects' JSON.
_SKIP_DIRS: frozenset[str] = frozenset(
    {".venv", ".git", "node_modules", "__pycache__", ".ipynb_checkpoints", ".pytest_cache"}
)


@checked_arguments
@dataclass(frozen=True)
class SavedRun:
    """One results file on disk and the few facts `list_runs` read from it."""

    name: str
    """How the run is named in tables and found again ("runs/quickstart", "baseline:x")."""
    path: Path
    kind: Kind
    family: str | None
    preset: str | None
    mode: str | None
    """"propagated" / "local" for a Result; None for a trajectory."""
    sides: str
    """"rollout vs trainer": the reference side, then the candidate."""
    modified: float
    """The file's modification time (seconds since the epoch)."""
    summary: dict[str, Any] = field(default_factory=dict, repr=False)

    def load(self) -> Result:
        """The Result in the file.

        Raises:
            ValueError: For a trajectory (it has steps, not layers) or an unreadable file.
        """
        if self.kind == "trajectory":
            raise ValueError(
                f"saved run {self.name!r} is a ratio-drift Trajectory ({self.path}): it has "
                "steps, not layers, so it cannot be loaded as a Result or overlaid per layer. "
                "Open it with lab.Trajectory.from_json."
            )
        return Result.from_json(self.path)

    def row(self) -> dict[str, Any]:
        """One row of `runs_table`."""
        return {
            "name": self.name,
            "kind": self.kind,
            "family": self.family,
            "preset": self.preset,
            "mode": self.mode,
            "sides": self.sides,
            "modified": datetime.fromtimestamp(self.modified).strftime("%Y-%m-%d %H:%M:%S"),
            **{k: self.summary.get(k) for k in _SUMMARY_COLUMNS},
            "path": str(self.path),
        }


# ---- listing ----------------------------------------------------------------------------


@checked_arguments
def list_runs(
    root: str | Path | None = None,
    *,
    baselines: str | Path | None = "",
    include_trajectories: bool = True,
) -> list[SavedRun]:
    """Every saved result under `root` plus the baselines, newest first.

    Args:
        root: Folder searched recursively for `*.json` files holding a Result (schema
            precision-lab/result/...) or a Trajectory (`.venv`, `.git` and caches skipped).
            None: the user's runs, `runs/` of the lab home (the working directory or
            $LAB_HOME), named relative to the home ("runs/pair/flux-tiny-...").
        baselines: The baselines folder; "" (the default) is the home's `baselines/`
            (`lab.views.home.baselines_home`), None leaves them out.
        include_trajectories: Also list ratio-drift trajectories (kind "trajectory").

    Returns:
        SavedRun records; files that are not lab results are ignored, and a lab result that
        cannot be read (truncated, values no pair gives, a `results.json` that is not JSON) is
        left out with a warning naming the file and what is wrong.

    Raises:
        ValueError: `root` is given and is not a folder.
    """
    if root is None:
        name_root = lab_home()
        search = name_root / "runs"
    else:
        name_root = search = Path(root)
        if not search.is_dir():
            raise ValueError(
                f"saved runs: root {str(search)!r} is not a folder. Pass the folder your runs "
                "were written under (e.g. '.' or 'runs'), or None for the lab home's runs/."
            )
    if baselines is None:
        base_dir = None
    else:
        base_dir = (Path(baselines) if str(baselines) else baselines_home()).resolve()
    found: dict[Path, SavedRun] = {}
    for path in _json_files(search) if search.is_dir() else []:
        if base_dir is not None and path.resolve().parent == base_dir:
            continue  # listed below, under its baseline name
        run = _read_run(path, _name_in(name_root, path), _kind_of(path))
        if run is not None and (include_trajectories or run.kind != "trajectory"):
            found[path.resolve()] = run
    if base_dir is not None and base_dir.is_dir():
        for path in sorted(base_dir.glob("*.json")):
            if path.name.startswith("."):
                continue  # a save in progress (lab.views.baselines writes beside, then links)
            run = _read_run(path, BASELINE_PREFIX + path.stem, "baseline")
            if run is not None:
                found[path.resolve()] = run
    return sorted(found.values(), key=lambda r: (-r.modified, r.name))


@checked_arguments
def runs_table(runs: Sequence[SavedRun]) -> pd.DataFrame:
    """One row per saved run: name, kind, family, preset, mode, sides, when, headline metrics."""
    import pandas as pd

    names = [
        "name", "kind", "family", "preset", "mode", "sides", "modified",
        *_SUMMARY_COLUMNS, "path",
    ]  # fmt: skip
    return pd.DataFrame([r.row() for r in runs], columns=names)


@checked_arguments
def find_run(ref: str | Path | SavedRun, runs: Sequence[SavedRun] | None = None, *,
             root: str | Path | None = None) -> SavedRun:  # fmt: skip
    """The saved run `ref` names: a listed name, "baseline:<name>", a path, or a unique part.

    Args:
        ref: A run name from `list_runs`, a path to a results JSON or to its folder, a baseline
            name, or a part of exactly one run's name.
        runs: The runs to look in; None lists `root`.
        root: Where to list runs when `runs` is None, and what a relative path is taken from
            first; None: the lab home (its runs/ and baselines/), then the working directory.

    Raises:
        ValueError: Nothing matches (the nearest names are listed), several runs match a
            part of a name (they are listed), or the file is not a lab result.
    """
    if isinstance(ref, SavedRun):
        return ref
    text = str(ref)
    name_root = lab_home() if root is None else Path(root)
    given = Path(text)
    # A relative path names a run under the root (the lab home when root is None); the same
    # path from the working directory is tried next.
    candidates = [given] if given.is_absolute() else [name_root / given, given]
    for path in candidates:
        if path.is_dir() and (path / "results.json").is_file():
            path = path / "results.json"
        if not path.is_file():
            continue
        run = _read_run(path, _name_in(name_root, path), _kind_of(path), strict=True)
        if run is None:
            raise ValueError(
                f"saved run {text!r} is not a lab result (no precision-lab/result schema and "
                "no Trajectory fields). Pass a results.json written by Result.to_json."
            )
        return run
    runs = list_runs(root) if runs is None else list(runs)
    by_name = {r.name: r for r in runs}
    for key in (text, text.rstrip("/"), BASELINE_PREFIX + text):
        if key in by_name:
            return by_name[key]
    partial = [r for r in runs if text in r.name]
    if len(partial) == 1:
        return partial[0]
    if partial:
        listed = ", ".join(repr(r.name) for r in partial[:8])
        raise ValueError(
            f"saved run {text!r} matches {len(partial)} saved runs: {listed}. Give more of "
            "the name."
        )
    close = difflib.get_close_matches(text, list(by_name), n=3, cutoff=0.3)
    hint = f" Nearest: {', '.join(repr(c) for c in close)}." if close else ""
    where = f"under {str(Path(root))!r}" if root is not None else f"in {str(name_root / 'runs')!r}"
    raise ValueError(
        f"no saved run {text!r} {where} or in the baselines ({len(runs)} listed).{hint} "
        "`precision-lab compare` with no runs lists them; a path to a results.json works too."
    )


@checked_arguments
def load_runs(
    refs: Sequence[str | Path | SavedRun], *, root: str | Path | None = None
) -> dict[str, Result]:
    """Load each reference (see `find_run`): name -> Result, in the order given.

    Raises:
        ValueError: An unknown reference, a trajectory, or the same run given twice.
    """
    runs = list_runs(root) if any(not isinstance(r, SavedRun) for r in refs) else []
    out: dict[str, Result] = {}
    for ref in refs:
        run = find_run(ref, runs, root=root)
        if run.name in out:
            raise ValueError(f"compare: run {run.name!r} is given twice; name each run once.")
        out[run.name] = run.load()
    return out


# ---- comparing --------------------------------------------------------------------------


@checked_arguments
def settings_diff(results: Mapping[str, Result]) -> pd.DataFrame:
    """The settings that differ between runs: one row per setting, one column per run.

    Settings are the mode, every field of both sides (`side_a.autocast`,
    `side_b.param_dtype_rules`, ...) and the meta (`meta.family`, `meta.seed`,
    `meta.param_dtypes_b`, ...), timings left out. A setting a run lacks shows as None.

    Raises:
        ValueError: Fewer than two runs.
    """
    import pandas as pd

    if len(results) < 2:
        raise ValueError(f"settings diff: need two or more runs, got {len(results)}.")
    flat = {name: _settings(r) for name, r in results.items()}
    keys = list(dict.fromkeys(k for f in flat.values() for k in f))
    rows = {}
    for key in keys:
        values = [flat[name].get(key) for name in flat]
        if any(_json(v) != _json(values[0]) for v in values[1:]):
            rows[key] = [_cell(v) for v in values]
    return pd.DataFrame.from_dict(rows, orient="index", columns=list(flat)).rename_axis("setting")


@checked_arguments
@dataclass(frozen=True, eq=False)
class RunComparison:
    """Two or more saved Results side by side; the first is the one the others are held to."""

    runs: dict[str, Result]
    metric: str = "rel_max"

    def settings_diff(self) -> pd.DataFrame:
        """See `settings_diff`: what differs between the runs' sides and meta."""
        return settings_diff(self.runs)

    def summary(self) -> pd.DataFrame:
        """One row per run: family, preset, mode, sides and the headline numbers."""
        import pandas as pd

        rows = []
        for name, r in self.runs.items():
            s = r.summary()
            rows.append(
                {
                    "run": name,
                    "family": s.get("family"),
                    "preset": s.get("preset"),
                    "mode": r.mode,
                    "sides": f"{r.side_a.get('name')} vs {r.side_b.get('name')}",
                    **{k: s.get(k) for k in _SUMMARY_COLUMNS},
                }
            )
        return pd.DataFrame(rows).set_index("run")

    def comparisons(self) -> dict[str, BaselineComparison]:
        """Each later run against the first, module output by module output (lab.views.baselines).

        Raises:
            ValueError: Runs of different models (no module output in common, or another
                model class): they cannot be compared row by row.
        """
        (first_name, first), *rest = self.runs.items()
        out = {}
        for name, result in rest:
            try:
                cmp = compare_to_baseline(
                    result, first, metric=self.metric, baseline_name=first_name
                )
            except ValueError as err:
                raise ValueError(
                    f"compare: {name!r} cannot be held against {first_name!r}: {err}"
                ) from None
            out[name] = cmp
        return out

    def verdicts(self) -> pd.DataFrame:
        """One row per later run: how many module outputs got worse / better than the first.

        A run of another model gets the verdict "not comparable" and the reason. Where either
        run is partial (its pair failed part-way, `Result.partial`), a verdict that would be
        "ok" is "partial" instead, and `reason` says which run stopped and why: outputs it
        never compared cannot be held to anything.
        """
        import pandas as pd

        (first_name, first), *rest = self.runs.items()
        rows = []
        for name, result in rest:
            stopped = [
                (n, r.partial) for n, r in ((first_name, first), (name, result)) if r.partial
            ]
            partial = "; ".join(f"{n}: {partial_words(why)}" for n, why in stopped)
            try:
                s = compare_to_baseline(
                    result, first, metric=self.metric, baseline_name=first_name
                ).summary()
            except ValueError as err:
                rows.append({"run": name, "vs": first_name, "verdict": "not comparable",
                             "reason": "; ".join(filter(None, (str(err), partial)))})  # fmt: skip
                continue
            verdict = "worse" if not s["ok"] else "partial" if stopped else "ok"
            rows.append(
                {
                    "run": name,
                    "vs": first_name,
                    "verdict": verdict,
                    "reason": partial or None,
                    **{k: s[k] for k in ("worse", "improved", "unchanged", "new", "missing")},
                    "worst_module": s["worst_module"],
                    "worst_ratio": s["worst_ratio"],
                }
            )
        return pd.DataFrame(rows).set_index("run")

    @property
    def worse(self) -> list[str]:
        """Names of the later runs with a module output worse than in the first run."""
        return [name for name, cmp in self.comparisons().items() if not cmp.ok]

    @checked_arguments
    def plot_overlay(self, metric: str | None = None, *, backend: str = "plotly") -> Any:
        """`lab.views.plots.plot_overlay` of the runs (the first is the baseline line)."""
        from lab.views import plots

        return plots.plot_overlay(self.runs, metric or self.metric, backend=backend)

    def describe(self) -> str:
        """A few lines: the runs, the settings that differ, and each later run's verdict."""
        first = next(iter(self.runs))
        lines = [f"{len(self.runs)} runs, held against {first!r} on {self.metric}:"]
        for name, r in self.runs.items():
            s = r.summary()
            none = "none (bit-exact)" if r.partial is None else "none among the outputs compared"
            output = s.get("model_output_rel_max")
            lines.append(
                f"  {name}: {s.get('family')} [{s.get('preset')}] {r.mode}, "
                f"{r.side_a.get('name')} vs {r.side_b.get('name')}; model_output_rel_max "
                f"{_fmt(output) if output is not None else 'not captured (no <root> row)'}, "
                f"first divergence {s.get('first_divergent_module') or none}"
            )
            if r.partial is not None:
                lines.append(f"    {partial_words(r.partial)}")
        diff = self.settings_diff()
        shown = ", ".join(diff.index[:8]) + (", ..." if len(diff) > 8 else "")
        lines.append(f"  settings that differ ({len(diff)}): {shown or 'none'}")
        for name, row in self.verdicts().iterrows():
            if row["verdict"] == "not comparable":
                lines.append(f"  {name} vs {row['vs']}: not comparable per module: {row['reason']}")
                continue
            worst = (
                f"; worst {row['worst_module']} x{row['worst_ratio']:.3g}"
                if row["worst_module"]
                else ""
            )
            lines.append(
                f"  {name} vs {row['vs']}: {row['verdict'].upper()} ({row['worse']} worse, "
                f"{row['improved']} improved, {row['unchanged']} unchanged, {row['new']} new, "
                f"{row['missing']} missing{worst})"
            )
        return "\n".join(lines)


@checked_arguments
def compare_runs(
    refs: Sequence[str | Path | SavedRun] | Mapping[str, Result],
    *,
    root: str | Path | None = None,
    metric: str = "rel_max",
) -> RunComparison:
    """Load two or more saved runs (see `find_run`) and compare them; the first is the reference.

    Args:
        refs: Run names, paths or SavedRun records; or a mapping name -> Result already loaded.
        root: Where run names are looked up; None: the lab home's runs/ and baselines/.
        metric: The per-module metric of the overlay and the verdicts (a PairMetrics field).

    Raises:
        ValueError: Fewer than two runs, or an unknown run (see `find_run`).
    """
    runs = dict(refs) if isinstance(refs, Mapping) else load_runs(refs, root=root)
    if len(runs) < 2:
        raise ValueError(
            f"compare: need two or more runs, got {len(runs)}. List the saved ones with "
            "list_runs() (or `precision-lab compare` without arguments)."
        )
    return RunComparison(runs, metric)


@checked_arguments
def newest(runs: Sequence[SavedRun], count: int = 2) -> list[SavedRun]:
    """The `count` newest Results among `runs`, oldest of them first (the reference).

    Raises:
        ValueError: Fewer than `count` Results are saved.
    """
    results = [r for r in sorted(runs, key=lambda r: -r.modified) if r.kind != "trajectory"]
    if len(results) < count:
        raise ValueError(
            f"compare: {len(results)} saved Result(s), {count} needed for the newest "
            f"{count}. Save runs first (notebook 01, `precision-lab pair`), or name them."
        )
    return list(reversed(results[:count]))


MATCHED_TRAINER: dict[str, Any] = {"autocast": False, "op_switches": {"timestep_from": "scheduler"}}
"""Trainer overrides that match the engine-like rollout on tiny flux: no autocast, and the
scheduler's fp32 timestep the engine hands its DiT (the pipeline rounds it to bf16)."""


@checked_arguments
def save_examples(
    root: str | Path | None = None,
    *,
    if_fewer_than: int = 2,
    family: FamilyName = "flux",
    preset: str = "tiny",
) -> list[Path]:
    """Save two small runs to compare when fewer than `if_fewer_than` Results are saved.

    The runs are the trainer as it is, then matched to the engine (`MATCHED_TRAINER`), against
    the same rollout: on tiny flux the matched trainer matches the engine-like rollout bit for
    bit, so the overlay shows every divergence of the first run gone in the second. They go to a
    fresh folder `<root>/runs/examples/<family>-<preset>-<time>/`, as `trainer/results.json` and
    `trainer_matched/results.json`: examples saved earlier are never written over.

    Args:
        root: The folder `list_runs` searches; None: the lab home (the working directory or
            $LAB_HOME).
        if_fewer_than: Save only when fewer Results than this are listed (0: always).
        family: The family of the two runs.
        preset: Their preset.

    Returns:
        The paths written; [] when enough runs were saved already.
    """
    from lab.pairing.run import pair_family

    saved = [r for r in list_runs(root) if r.kind != "trajectory"]
    if len(saved) >= if_fewer_than > 0:
        return []
    out = run_folder("examples", family=family, preset=preset, home=root)
    paths = []
    for name, trainer in (("trainer", {}), ("trainer_matched", MATCHED_TRAINER)):
        result = pair_family(family, preset, trainer=trainer)
        paths.append(result.to_json(out / name / "results.json"))
    return paths


# ---- reading files ----------------------------------------------------------------------


def _json_files(root: Path) -> list[Path]:
    out = []
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir():
                if entry.name not in _SKIP_DIRS and not entry.name.startswith("."):
                    stack.append(entry)
            elif entry.suffix == ".json":
                out.append(entry)
    return out


def _name_in(root: Path, path: Path) -> str:
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        rel = path
    rel_text = rel.as_posix()
    if rel.name == "results.json":
        return rel.parent.as_posix() if rel.parent.as_posix() != "." else rel_text
    return rel_text


def _kind_of(path: Path) -> Kind:
    """A run folder next to a sweep.csv is a sweep run; any other file an ad-hoc run."""
    return "sweep" if (path.parent.parent / "sweep.csv").is_file() else "run"


def _read_run(path: Path, name: str, kind: Kind, *, strict: bool = False) -> SavedRun | None:
    """The SavedRun of a Result or Trajectory JSON; None for any other file.

    A Result is read as `Result.from_json` reads it (every field and value checked) and its
    summary recomputed from its rows, so a listing never shows numbers the file's rows do not
    hold. A file that is meant as a lab result but cannot be read (named results.json, or of
    the result schema) is refused with why: raised when `strict` (a file the user named),
    else warned about and left out.

    Raises:
        ValueError: (strict only) An unreadable, truncated or invalid lab result, naming it.
    """
    try:
        text = path.read_text(encoding="utf-8")
        modified = path.stat().st_mtime
        data = json.loads(text)
    except (OSError, ValueError) as err:
        if path.name == "results.json" or strict:
            _unreadable(path, err, strict)
        return None
    if not isinstance(data, dict):
        return None
    if str(data.get("schema", "")).startswith("precision-lab/result/"):
        try:
            result = Result.from_dict(data, where=f"saved run {name!r} ({str(path)!r})")
        except ValueError as err:
            if strict:
                raise
            warnings.warn(f"saved runs: left out: {err}", stacklevel=3)
            return None
        summary = result.summary()
        return SavedRun(
            name=name,
            path=path,
            kind=kind,
            family=result.meta.get("family", summary.get("family")),
            preset=result.meta.get("preset", summary.get("preset")),
            mode=result.mode,
            sides=f"{result.side_a.get('name')} vs {result.side_b.get('name')}",
            modified=modified,
            summary=summary,
        )
    if {"meta", "overall", "per_step"} <= set(data):
        meta, overall = data.get("meta") or {}, data.get("overall") or {}
        side_a, side_b = meta.get("side_a") or {}, meta.get("side_b") or {}
        return SavedRun(
            name=name,
            path=path,
            kind="trajectory",
            family=meta.get("family"),
            preset=meta.get("preset"),
            mode=None,
            sides=f"{side_a.get('name')} vs {side_b.get('name')}",
            modified=modified,
            summary={k: overall.get(k) for k in _SUMMARY_COLUMNS if k in overall},
        )
    return None


def _unreadable(path: Path, err: BaseException, strict: bool) -> None:
    """Say why a file meant as a lab result cannot be read: `Result.from_json`'s own words."""
    why = str(err)
    if isinstance(err, ValueError):
        try:
            Result.from_json(path)  # names an empty, truncated or non-JSON file as such
        except ValueError as named:
            why = str(named)
    elif isinstance(err, OSError):
        why = f"{str(path)!r} cannot be read: {err.strerror or err}"
    if strict:
        raise ValueError(f"saved run: {why}") from None
    warnings.warn(f"saved runs: left out: {why}", stacklevel=4)


def _settings(result: Result) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": result.mode}
    out.update({f"side_a.{k}": v for k, v in result.side_a.items()})
    out.update({f"side_b.{k}": v for k, v in result.side_b.items()})
    out.update({f"meta.{k}": v for k, v in result.meta.items() if k not in _VOLATILE_META})
    return out


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _cell(value: Any) -> Any:
    """Scalars as they are; containers as compact JSON (a table cell holds one string)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, default=str)


def _fmt(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value):
        return f"{value:.3e}"
    return str(value)

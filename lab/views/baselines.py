"""Known-good runs under baselines/<name>.json, and which module outputs got worse since.

    save_baseline(result, "flux_tiny_rollout_vs_trainer")          # once, when it is right
    cmp = compare_to_baseline(new_result, "flux_tiny_rollout_vs_trainer")
    cmp.worse()                     # the module outputs that regressed, worst first
    report.write_html(new_result, "report.html", comparison=cmp)

The verdict per module output (module, call, output), on one metric (rel_max by default):

    worse      candidate > factor * baseline + atol, or more non-finite elements than before
    improved   baseline > factor * candidate + atol (and no more non-finite elements)
    unchanged  neither
    new        only the candidate has this output;  missing: only the baseline has it

With atol = 0, an output that was bit-exact and now differs at all is worse, and one that
now matches exactly is improved.

Baselines are the user's: they live in `baselines/` of the working directory, or of $LAB_HOME
when it is set (`lab.views.home.baselines_home`), never inside the installed package.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lab.base.arguments import checked_arguments
from lab.pairing.capture import ROOT
from lab.pairing.result import Result
from lab.views.home import baselines_home

if TYPE_CHECKING:
    import pandas as pd

Status = Literal["worse", "improved", "unchanged", "new", "missing"]
STATUSES: tuple[str, ...] = ("worse", "improved", "unchanged", "new", "missing")

# Factor 2 is one binary order: bf16/fp16 differences move in powers of two, so a module whose
# error merely lands on a neighbouring rounding of the same size stays "unchanged", while one
# extra bit of error (or more) is flagged. Runs on the same settings are bit-identical (the
# lab is deterministic), so any factor >= 1 keeps "same run -> nothing worse".
DEFAULT_FACTOR = 2.0
_COLUMNS: tuple[str, ...] = (
    "module", "call", "output", "label", "module_class", "dtypes_baseline", "dtypes",
    "baseline", "candidate", "ratio", "nonfinite_baseline", "nonfinite", "status",
)  # fmt: skip
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Settings that must agree for a row-by-row comparison to mean anything; others are listed.
_META_KEYS: tuple[str, ...] = ("family", "preset", "variant", "seed", "sigma", "batch", "cfg")


def _baseline_path(name: str, directory: str | Path | None) -> Path:
    """<baselines_home()>/<name>.json (or <directory>/<name>.json).

    Raises:
        ValueError: For a name that is not a plain file stem.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"baseline name {name!r} is not a plain file stem: use letters, digits, '_', '-' "
            "and '.', e.g. 'flux_tiny_rollout_vs_trainer'."
        )
    return Path(directory or baselines_home()) / f"{name.removesuffix('.json')}.json"


@checked_arguments
def list_baselines(directory: str | Path | None = None) -> list[str]:
    """Names of the saved baselines (file stems), sorted.

    Hidden files are not baselines: a writer killed mid-write (kill -9) can leave lab.base.atomic's
    temporary `.<name>.<random>.tmp.json` behind, never a torn `<name>.json`.
    """
    folder = Path(directory or baselines_home())
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.json") if not p.name.startswith("."))


@checked_arguments
def save_baseline(
    result: Result,
    name: str,
    *,
    directory: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Save a run as known-good: `result.to_json(<baselines_home()>/<name>.json)`.

    Args:
        result: The run to keep.
        name: File stem, e.g. "flux_tiny_rollout_vs_trainer".
        directory: Folder instead of `baselines_home()`: baselines/ of the working directory,
            or of $LAB_HOME when it is set.
        overwrite: Replace an existing baseline of that name.

    Returns:
        The path written.

    Raises:
        ValueError: A bad name, or a baseline of that name exists and overwrite is False
            (also one another run saved while this one was writing: the file is created
            exclusively, never replaced unless overwrite is asked).
    """
    path = free_baseline_path(name, directory=directory, overwrite=overwrite)
    if overwrite:
        return result.to_json(path)
    # Written whole beside it, then linked in under the name: the link fails if the name
    # exists, so of two saves of one name at once exactly one lands (both passed the check
    # above, and the second replaced the first).
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{threading.get_ident()}.new.json")
    try:
        result.to_json(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise _exists(path) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


@checked_arguments
def free_baseline_path(
    name: str, *, directory: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Where `save_baseline(result, name)` would write, checked before any run is made.

    Raises:
        ValueError: A bad name, or a baseline of that name exists and overwrite is False.
    """
    path = _baseline_path(name, directory)
    if path.exists() and not overwrite:
        raise _exists(path)
    return path


def _exists(path: Path) -> ValueError:
    return ValueError(
        f"baseline {path.stem!r}: {path} exists. Pass overwrite=True (from the command line: "
        "delete the file) to replace the known-good run, or choose another name."
    )


@checked_arguments
def load_baseline(name_or_path: str | Path, *, directory: str | Path | None = None) -> Result:
    """Read a baseline by name (from `baselines_home()`) or by path to a result.json.

    Raises:
        ValueError: No such baseline; the message lists the saved ones and the nearest name.
    """
    as_path = Path(name_or_path)
    if as_path.suffix == ".json" and as_path.exists():
        return Result.from_json(as_path)
    path = _baseline_path(str(name_or_path), directory)
    if not path.exists():
        known = list_baselines(directory)
        close = difflib.get_close_matches(str(name_or_path), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"no baseline {str(name_or_path)!r} in {path.parent}.{hint} "
            f"Saved: {known or 'none'}. Save one with save_baseline(result, name), or from "
            "the command line with `precision-lab pair ... --save-baseline NAME`."
        )
    return Result.from_json(path)


@checked_arguments
@dataclass(frozen=True, eq=False)
class BaselineComparison:
    """One run compared module output by module output against a known-good run."""

    baseline_name: str
    metric: str
    factor: float
    atol: float
    table: pd.DataFrame
    """One row per module output in either run, baseline order then new ones: module, call,
    output, label, module_class, dtypes_baseline / dtypes ("reference/candidate" of each run),
    baseline, candidate (the metric), ratio (candidate / baseline), nonfinite_baseline,
    nonfinite (non-finite elements on both sides of the pair), status."""
    baseline: Result = field(repr=False)
    candidate: Result = field(repr=False)
    settings_differ: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Meta keys (family, preset, seed, ...) whose values differ: {key: (baseline, candidate)};
    `versions.<name>` for a differing torch, diffusers or CPU kernel set (`versions.cpu`, ATen's
    capability: AVX512 and AVX2 kernels round reductions differently)."""

    @checked_arguments
    def rows(self, status: Status) -> pd.DataFrame:
        """The table's rows of one status; worse/improved sorted by how far they moved.

        Raises:
            ValueError: For an unknown status.
        """
        if status not in STATUSES:
            raise ValueError(f"BaselineComparison.rows: unknown status {status!r}. {STATUSES}.")
        sub = self.table[self.table["status"] == status]
        if status in ("worse", "improved"):
            up = status == "improved"
            sub = sub.sort_values(["ratio", "candidate"], ascending=[up, up], kind="stable")
        return sub.reset_index(drop=True)

    def worse(self) -> pd.DataFrame:
        """Module outputs that got worse, worst first."""
        return self.rows("worse")

    def improved(self) -> pd.DataFrame:
        """Module outputs that got better, most improved first."""
        return self.rows("improved")

    @property
    def ok(self) -> bool:
        """Nothing got worse and nothing the baseline had is missing."""
        counts = self.table["status"].value_counts()
        return not counts.get("worse", 0) and not counts.get("missing", 0)

    def summary(self) -> dict[str, Any]:
        """Counts per status, the worst regression, the verdict rule and any settings differing."""
        counts = self.table["status"].value_counts()
        worse = self.worse()
        return {
            "baseline": self.baseline_name,
            "metric": self.metric,
            "rule": f"worse if candidate > {self.factor:g} x baseline + {self.atol:g}",
            "ok": self.ok,
            **{s: int(counts.get(s, 0)) for s in STATUSES},
            "worst_module": worse["label"].iloc[0] if len(worse) else None,
            "worst_ratio": float(worse["ratio"].iloc[0]) if len(worse) else None,
            "baseline_model_output_" + self.metric: _root_value(self.baseline, self.metric),
            "candidate_model_output_" + self.metric: _root_value(self.candidate, self.metric),
            "settings_differ": {k: list(v) for k, v in self.settings_differ.items()},
        }

    def describe(self) -> str:
        """A few human lines: the verdict and the worst regressions."""
        s = self.summary()
        lines = [
            f"vs baseline {self.baseline_name!r} on {self.metric} ({s['rule']}): "
            f"{s['worse']} worse, {s['improved']} improved, {s['unchanged']} unchanged, "
            f"{s['new']} new, {s['missing']} missing -> {'OK' if s['ok'] else 'REGRESSED'}"
        ]
        for row in self.worse().head(5).itertuples(index=False):
            lines.append(
                f"  worse: {row.label}: {row.baseline:.3e} -> {row.candidate:.3e} "
                f"({_ratio_words(row.ratio)})"
            )
        if self.settings_differ:
            lines.append(f"  settings differ: {s['settings_differ']}")
        if any(k.startswith("versions.") for k in self.settings_differ):
            lines.append(
                "  the runs used different software or CPU kernels (versions.*): their low bits "
                "can differ with no change of yours; take the baseline again on this machine "
                "to compare bit for bit"
            )
        return "\n".join(lines)


@checked_arguments
def compare_to_baseline(
    result: Result,
    baseline: Result | str | Path,
    *,
    metric: str = "rel_max",
    factor: float = DEFAULT_FACTOR,
    atol: float = 0.0,
    directory: str | Path | None = None,
    baseline_name: str | None = None,
) -> BaselineComparison:
    """Compare a run against a known-good one, per module output (module, call, output).

    Args:
        result: The new run (the candidate).
        baseline: A Result, a baseline name under `baselines_home()`, or a path to a
            result.json.
        metric: A numeric metric of `PairMetrics` (rel_max, max_abs_diff, mean_abs_diff, ...).
        factor: Worse when candidate > factor * baseline + atol; improved the other way. >= 1.
        atol: Absolute slack in the metric's units; 0 flags any departure from bit-exact.
        directory: Folder to look a baseline name up in instead of `baselines_home()`.
        baseline_name: What the verdict and errors call the baseline (default: its name or file
            stem; "baseline" for a Result).

    Returns:
        A BaselineComparison; `.worse()` lists the regressions.

    Raises:
        ValueError: An unknown metric, factor < 1, atol < 0, an unknown baseline name, or two
            runs with no module output in common (different models).
    """
    import pandas as pd

    where = "baseline comparison"
    if not (isinstance(factor, int | float) and factor >= 1):
        raise ValueError(f"{where}: factor must be a number >= 1, got {factor!r}.")
    if not (isinstance(atol, int | float) and atol >= 0):
        raise ValueError(f"{where}: atol must be a number >= 0, got {atol!r}.")
    if isinstance(baseline, Result):
        base, name = baseline, baseline_name or "baseline"
    else:
        base = load_baseline(baseline, directory=directory)
        name = baseline_name or Path(str(baseline)).stem
    probe = next(iter(result.rows or base.rows), None)
    if probe is not None:
        numeric = [
            k
            for k, v in dataclasses.asdict(probe.metrics).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if metric not in numeric:
            close = difflib.get_close_matches(metric, numeric, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: unknown metric {metric!r}.{hint} Choose from {numeric}.")

    def keyed(res: Result) -> dict[tuple[str, int, str], Any]:
        return {(r.module, r.call, r.output): r for r in res.rows}

    old, new = keyed(base), keyed(result)
    model_old, model_new = _model_class(base), _model_class(result)
    if (old and new and not set(old) & set(new)) or (
        model_old and model_new and model_new != model_old
    ):
        raise ValueError(
            f"{where}: the run and baseline {name!r} are different models: "
            f"{_model_words(result)} ({model_new}) vs {_model_words(base)} ({model_old}). "
            "Compare runs of the same model class and preset."
        )
    records = []
    for key in list(old) + [k for k in new if k not in old]:
        a, b = old.get(key), new.get(key)
        ref = b or a
        base_value = float(getattr(a.metrics, metric)) if a else math.nan
        value = float(getattr(b.metrics, metric)) if b else math.nan
        nonfinite_base = a.metrics.nonfinite_a + a.metrics.nonfinite_b if a else 0
        nonfinite = b.metrics.nonfinite_a + b.metrics.nonfinite_b if b else 0
        records.append(
            {
                "module": key[0],
                "call": key[1],
                "output": key[2],
                "label": ref.label(),
                "module_class": ref.module_class,
                "dtypes_baseline": f"{a.dtype_a}/{a.dtype_b}" if a else None,
                "dtypes": f"{b.dtype_a}/{b.dtype_b}" if b else None,
                "baseline": base_value,
                "candidate": value,
                "ratio": _ratio(value, base_value),
                "nonfinite_baseline": nonfinite_base,
                "nonfinite": nonfinite,
                "status": _status(a, b, base_value, value, nonfinite_base, nonfinite, factor, atol),
            }
        )
    differ = {
        k: (base.meta.get(k), result.meta.get(k))
        for k in _META_KEYS
        if base.meta.get(k) != result.meta.get(k)
    }
    if base.mode != result.mode:
        differ["mode"] = (base.mode, result.mode)
    # Another torch, diffusers or CPU kernel set rounds differently: name it beside the verdict.
    old_versions = base.meta.get("versions") or {}
    new_versions = result.meta.get("versions") or {}
    for key in sorted(set(old_versions) & set(new_versions)):
        if old_versions[key] != new_versions[key]:
            differ[f"versions.{key}"] = (old_versions[key], new_versions[key])
    return BaselineComparison(
        baseline_name=name,
        metric=metric,
        factor=float(factor),
        atol=float(atol),
        table=pd.DataFrame.from_records(records, columns=list(_COLUMNS)),
        baseline=base,
        candidate=result,
        settings_differ=differ,
    )


def _status(
    a: Any,
    b: Any,
    base: float,
    value: float,
    nonfinite_base: int,
    nonfinite: int,
    factor: float,
    atol: float,
) -> str:
    if a is None:
        return "new"
    if b is None:
        return "missing"
    # A NaN metric comes from non-finite elements: judge those by their count instead.
    if nonfinite > nonfinite_base or (math.isnan(value) and not math.isnan(base)):
        return "worse"
    if value > factor * base + atol:
        return "worse"
    if base > factor * value + atol or (nonfinite < nonfinite_base):
        return "improved"
    return "unchanged"


def _ratio(value: float, base: float) -> float:
    """Candidate / baseline; inf when a bit-exact output now differs, 1 when both are zero."""
    if math.isnan(value) or math.isnan(base):
        return math.nan
    if base == 0:
        return 1.0 if value == 0 else math.inf
    return value / base


def _ratio_words(ratio: float) -> str:
    return "was bit-exact" if math.isinf(ratio) else f"x{ratio:.3g}"


def _root_value(result: Result, metric: str) -> float | None:
    roots = result.root_rows()
    return float(getattr(roots[0].metrics, metric)) if roots else None


def _model_class(result: Result) -> str | None:
    """Class of the model itself (its root row), or None when the root was not captured."""
    return next((r.module_class for r in result.rows if r.module == ROOT), None)


def _model_words(result: Result) -> str:
    return f"{result.meta.get('family', 'model')} [{result.meta.get('preset', '?')}]"

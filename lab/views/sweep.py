r"""Sweeps: run one notebook with papermill over a parameter grid, collect one table and a plot.

    python -m lab sweep notebooks/01_quickstart.ipynb --grid family=flux,sd3 \\
        --grid mode=propagated,local --jobs 2

The sweep writes into a fresh folder `runs/sweep/<notebook>-<time>` under the working
directory (or $LAB_HOME) unless `--out` names one; a named folder holding an earlier sweep is
refused unless `--resume` or `--overwrite` is given. Each grid point gets its own folder
`<out>/<run name>/` holding the executed notebook and whatever the notebook writes there (its
`out_dir` parameter is pointed at the folder, with `overwrite` on: the sweep owns it). Every
run's `results.json` summary (a Result's `summary`, a Trajectory's `overall`) becomes one row
of `<out>/sweep.csv`, written as the run finishes; `<out>/sweep.png` plots the headline metric
per run. A failed run keeps its executed notebook, is reported with the cell error, and the
other runs still finish.

Each run is one papermill process that dies with the sweep, even on `kill -9`; Ctrl-C or SIGTERM
ends the running ones and keeps the finished rows; `--resume` runs only the points that have
not finished ok with the same notebook and parameters (each run's folder records them in
`run.json`).

Before the first run, every point is checked: parameter names and types, the values the lab
knows the choices of (family, preset, mode, sde_type, device), and that no two runs would
write one output folder. A sweep holds its folder while it runs (`.lab-lock`, with its pid):
a second sweep into it is refused. The kernels' connection files (their HMAC and CurveZMQ
keys) go to a private temporary folder that is removed on every way out.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.base.arguments import checked_arguments
from lab.base.atomic import atomic_path, atomic_write_text
from lab.base.processes import Interrupted
from lab.views.notebooks import KERNEL_START_TIMEOUT_S

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
"""Where bare notebook names ("01_quickstart") are looked up."""
HEADLINE_METRICS: tuple[str, ...] = (
    "model_output_rel_max",
    "ratio_abs_minus_1",
    "model_output_max_abs_diff",
    "max_ulp",
)
"""The first of these a table has is the one `plot_sweep` draws by default."""


# ---- grid ---------------------------------------------------------------------------------


@checked_arguments
def parse_value(text: str) -> Any:
    """One grid value: JSON where it parses (ints, floats, bools, null, lists, dicts), else str."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, braces and quotes (so a dict value stays whole)."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


@checked_arguments
def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """`["key=v1,v2", "key2=a,b"]` -> {"key": [v1, v2], "key2": ["a", "b"]}.

    Values parse as JSON where possible (`steps=2,4`, `cfg=true`, `trainer_overrides=
    {"autocast": false},{}`), else stay strings.

    Raises:
        ValueError: A spec without `=`, an empty key or value, or a key given twice.
    """
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip()
        if not eq or not key or not values.strip():
            raise ValueError(
                f"--grid {spec!r}: expected KEY=V1,V2,... (e.g. family=flux,sd3 or steps=2,4)."
            )
        if key in grid:
            raise ValueError(f"--grid: key {key!r} given twice; list all its values in one --grid.")
        grid[key] = [parse_value(v) for v in _split_top_level(values)]
    return grid


@checked_arguments
def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid, in row-major order of the keys as given."""
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*grid.values())]


@checked_arguments
def run_name(index: int, point: Mapping[str, Any]) -> str:
    """A folder-safe name for one grid point: `003_family=sd3_mode=local`."""
    words = "_".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in point.items()
    )
    return f"{index:03d}_" + re.sub(r"[^A-Za-z0-9_=.,+-]+", "-", words)[:120].strip("-")


@checked_arguments
def resolve_notebook(notebook: str | Path) -> Path:
    """A path, or a bare name under notebooks/ ("01_quickstart" or "01_quickstart.ipynb").

    Raises:
        ValueError: Nothing found, listing the notebooks there are.
    """
    path = Path(notebook)
    if path.is_file():
        return path.resolve()
    for candidate in (NOTEBOOK_DIR / path.name, NOTEBOOK_DIR / f"{path.name}.ipynb"):
        if candidate.is_file():
            return candidate
    known = ", ".join(p.name for p in sorted(NOTEBOOK_DIR.glob("*.ipynb")))
    raise ValueError(f"sweep: notebook {str(notebook)!r} not found. Known in notebooks/: {known}.")


# ---- one run --------------------------------------------------------------------------------


@checked_arguments
@dataclass(frozen=True)
class RunOutcome:
    """What one grid point gave: its summary row, or the error and the kept notebook."""

    name: str
    point: dict[str, Any]
    folder: str
    notebook: str
    """The executed notebook (kept for a failed run, to open and read the traceback)."""
    ok: bool
    error: str = ""
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


@checked_arguments
def summarize_results_json(path: Path) -> dict[str, Any]:
    """Flat scalar summary of a results.json: a Result's `summary`, a Trajectory's `overall`."""
    data = json.loads(path.read_text())
    block = data.get("summary") or data.get("overall") or data
    return {k: v for k, v in block.items() if v is None or isinstance(v, str | int | float | bool)}


def _outcome(
    folder: str,
    name: str,
    point: dict[str, Any],
    error: BaseException | None,
    results_dir: Path | None = None,
) -> RunOutcome:
    """One grid point's row, read from what its run left in `folder` (results: `results_dir`)."""
    out_dir = Path(folder)
    executed = out_dir / "executed.ipynb"
    seconds = _duration(executed)
    if error is not None:
        return RunOutcome(
            name, point, folder, str(executed), False, _error_line(executed, error), seconds
        )
    where = out_dir if results_dir is None else results_dir
    results = where / "results.json"
    if not results.is_file():
        return RunOutcome(
            name,
            point,
            folder,
            str(executed),
            False,
            f"the notebook wrote no results.json in {where}",
            seconds,
        )
    return RunOutcome(
        name, point, folder, str(executed), True, "", seconds, summarize_results_json(results)
    )


def _duration(executed: Path) -> float:
    try:
        meta = json.loads(executed.read_text()).get("metadata", {}).get("papermill", {})
        return float(meta.get("duration") or 0.0)
    except (OSError, ValueError):
        return 0.0


def _error_line(executed: Path, err: BaseException) -> str:
    """`ename: evalue` of the failing cell (papermill records it in the executed notebook)."""
    try:
        cells = json.loads(executed.read_text())["cells"]
        for cell in cells:
            for output in cell.get("outputs", []):
                if output.get("output_type") == "error":
                    return f"{output['ename']}: {output['evalue']}"
    except (OSError, ValueError, KeyError):
        pass
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"


# ---- the sweep ------------------------------------------------------------------------------


@checked_arguments
@dataclass
class Sweep:
    """A finished sweep: one outcome per grid point, the table and where things went."""

    notebook: Path
    out_dir: Path
    outcomes: list[RunOutcome]
    table_path: Path
    plot_path: Path | None

    @property
    def failed(self) -> list[RunOutcome]:
        """The runs that failed, in grid order."""
        return [o for o in self.outcomes if not o.ok]

    def table(self) -> Any:
        """One row per grid point (pandas DataFrame): run, status, the grid keys, the summary."""
        return sweep_table(self.outcomes)

    def describe(self) -> str:
        """A few lines: how many runs passed, and each failure with its kept notebook."""
        lines = [
            f"sweep of {self.notebook.name}: {len(self.outcomes) - len(self.failed)}/"
            f"{len(self.outcomes)} runs ok; table {self.table_path}"
            + (f", plot {self.plot_path}" if self.plot_path else "")
        ]
        lines += [f"  FAILED {o.name}: {o.error}\n    notebook: {o.notebook}" for o in self.failed]
        return "\n".join(lines)


@checked_arguments
def sweep_table(outcomes: Sequence[RunOutcome]) -> Any:
    """The sweep's table: run, status, seconds, one column per grid key, then the summaries."""
    import pandas as pd

    rows = [
        {
            "run": o.name,
            "status": "ok" if o.ok else "failed",
            "seconds": round(o.seconds, 2),
            **{
                k: v if isinstance(v, str | int | float | bool) else json.dumps(v)
                for k, v in o.point.items()
            },
            **{k: v for k, v in o.summary.items() if k not in o.point},
            "error": o.error,
            "notebook": o.notebook,
        }
        for o in outcomes
    ]
    return pd.DataFrame(rows)


@checked_arguments
def plot_sweep(table: Any, metric: str | None = None, *, title: str | None = None) -> Any:
    """Bar chart of one metric per run (log scale), failed runs marked; a matplotlib Figure.

    Args:
        table: `Sweep.table()` or the CSV read back.
        metric: A numeric column; defaults to the first of HEADLINE_METRICS present.
        title: Figure title.

    Raises:
        ValueError: No numeric metric column to plot.
    """
    # A bare Figure (no pyplot): nothing global changes and nothing pops up in a notebook.
    from matplotlib.figure import Figure

    if metric is None:
        metric = next((m for m in HEADLINE_METRICS if m in table.columns), None)
    if metric is None or metric not in table.columns:
        raise ValueError(
            f"plot_sweep: no metric column {metric!r} in the table; columns: "
            f"{', '.join(table.columns)}. Pass metric= one of the numeric columns."
        )
    values = [float(v) if v == v and v is not None else math.nan for v in table[metric]]
    fig = Figure(figsize=(max(6.0, 0.9 * len(table) + 2), 4.2), layout="constrained")
    ax = fig.add_subplot()
    labels = [str(r)[4:] or str(r) for r in table["run"]]
    ok = (table["status"] == "ok").tolist()
    # A bit-exact run (0) sits on a floor bar instead of vanishing from the log axis.
    floor = 1e-12
    heights = [max(v, floor) if ok[i] and v == v else 0.0 for i, v in enumerate(values)]
    bars = ax.bar(range(len(values)), heights, color=["#1f77b4" if k else "#d62728" for k in ok])
    for i, bar in enumerate(bars):
        text = f"{values[i]:.2e}" if ok[i] else "FAILED"
        ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, max(heights[i], floor)),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_yscale("log")
    # Bars on a log axis grow from its bottom: a decade below the smallest keeps every bar's
    # height readable against the others (autoscaling puts the bottom at the smallest bar).
    drawn = [h for h in heights if h > 0]
    if drawn:
        ax.set_ylim(min(drawn) / 10, max(drawn) * 3)
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric} per sweep run (red: failed)", fontsize=9)
    ax.grid(alpha=0.3, axis="y", which="both")
    return fig


_WORKER = """
import json, sys
import papermill as pm
import zmq
from traitlets.config import Config
task = json.loads(open(sys.argv[1], encoding="utf-8").read())
# lab.views.notebooks.kernel_config(), without importing lab (torch): CurveZMQ keys for the kernel.
# The connection file (the kernel's HMAC and CurveZMQ keys) goes where the sweep removes it on
# every way out, not to the shared temporary folder (where a SIGTERM'd papermill left it).
config = Config({"KernelManager": {"transport_encryption": "auto" if zmq.has("curve") else
                                   "disabled", "connection_file": task["connection_file"]}})
pm.execute_notebook(task["notebook"], task["output"], parameters=task["parameters"],
                    kernel_name="python3", progress_bar=False, cwd=task["cwd"], config=config,
                    start_timeout=task["start_timeout"])
"""
"""One grid point's process: papermill itself, importable without torch, so it starts fast; the
notebook's kernel is its child and exits when it does (ipykernel polls its parent)."""

RUN_RECORD = "run.json"
"""Written into a run's folder when it finishes: what ran (notebook hash, parameters), how it
ended. `--resume` skips a point whose folder holds an ok record with identical parameters."""


class SweepInterrupted(Interrupted):
    """Ctrl-C or SIGTERM stopped a sweep; its children were ended and the finished rows written.

    `sweep` holds the finished runs (its table is on disk), `signal_name` "SIGINT" or "SIGTERM".
    """

    def __init__(self, message: str, sweep: Sweep, signal_name: str) -> None:
        """Keep the partial sweep next to the message."""
        super().__init__(message, signal_name)
        self.sweep = sweep


@dataclass
class _Task:
    index: int
    name: str
    folder: Path
    point: dict[str, Any]
    requested: dict[str, Any]
    """The parameters as asked for (before out_dir/interactive are filled in): resume's key."""
    params: dict[str, Any]
    results: Path
    """Where the run writes its results.json: its `out_dir` (relative to its folder, where
    the kernel runs), or its folder for a notebook without one."""
    connection_file: Path | None = None
    """The kernel's connection file, in the sweep's private temporary folder."""


@checked_arguments
def run_sweep(
    notebook: str | Path,
    grid: Mapping[str, Sequence[Any]],
    out_dir: str | Path = "",
    *,
    parameters: Mapping[str, Any] | None = None,
    jobs: int = 2,
    metric: str | None = None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> Sweep:
    """Execute `notebook` once per grid point with papermill, `jobs` at a time; collect results.

    Each run is its own process (papermill, which starts the notebook's kernel), killed by the
    kernel if this process dies, even by `kill -9`. Each finished run's row is written to
    `<out>/sweep.csv` at once (atomically: the table on disk is always whole). Ctrl-C or SIGTERM
    ends the running runs (their processes and kernels), writes the rows finished so far and
    raises `SweepInterrupted`; no queued run starts. Works from a script without an
    `if __name__ == "__main__":` guard (nothing re-imports the caller).

    Args:
        notebook: A notebook path, or a name under notebooks/ ("01_quickstart").
        grid: key -> values; every combination runs (keys must be notebook parameters).
        out_dir: Sweep folder: one sub-folder per run, plus sweep.csv and sweep.png; "" for a
            fresh folder `runs/sweep/<notebook>-<time>` under the lab home (the working
            directory or $LAB_HOME).
        parameters: Parameters every run gets (the grid wins on a clash).
        jobs: Runs in parallel (processes, each starting its own kernel).
        metric: The column sweep.png plots; None = the first of HEADLINE_METRICS present.
        progress: Show a tqdm bar over finished runs.
        resume: Skip every point whose run already finished ok in `out_dir` with the same
            notebook (by content) and identical parameters; failed, interrupted and changed
            points run again.
        overwrite: Run into an `out_dir` that holds an earlier sweep (sweep.csv, ...): its
            points run again and their files are replaced. Without it (or `resume`) such a
            folder is refused.

    Returns:
        The Sweep (outcomes, table path, plot path); failed runs are in `Sweep.failed`.

    Raises:
        ValueError: An unknown notebook, an empty grid, a grid key the notebook does not
            declare as a parameter, jobs not an int >= 1, parameters that are not JSON, a
            value that cannot run (an unknown family, preset, mode, sde_type, or a device not
            here), parameters that give two runs one output folder, an out_dir that cannot
            be written, or one holding an earlier sweep without resume or overwrite. All
            before the first run.
        lab.base.processes.FolderInUseError: Another live sweep holds `out_dir` (a ValueError).
        SweepInterrupted: Ctrl-C or SIGTERM (a KeyboardInterrupt; `.sweep` has what finished).
    """
    from lab.base.processes import holding_folder, owned_temp_dir
    from lab.views.home import check_folder_free, run_folder
    from lab.views.notebooks import check_parameters

    path = resolve_notebook(notebook)
    # Names and types first: `-p famly=flux` with no grid is a misspelling before an empty grid.
    values = [(k, v) for k, vs in grid.items() for v in vs] + list((parameters or {}).items())
    declared = check_parameters(path, list(grid), "sweep", values)
    if not grid or any(not list(v) for v in grid.values()):
        raise ValueError("sweep: the grid is empty; give each key at least one value.")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"sweep: jobs must be an int >= 1, got {jobs!r}.")
    fresh = not str(out_dir).strip()
    if not fresh and not resume:
        try:
            check_folder_free(out_dir, overwrite=overwrite)
        except ValueError as err:
            raise ValueError(
                f"sweep: {err} Or run only its points not finished ok: resume=True (--resume)."
            ) from None
    out = run_folder("sweep", label=path.stem).resolve() if fresh else Path(out_dir).resolve()
    try:
        tasks = []
        for i, point in enumerate(grid_points(grid)):
            name = run_name(i, point)
            folder = out / name
            requested = {**dict(parameters or {}), **point}
            params = dict(requested)
            if "out_dir" in declared and "out_dir" not in params:
                params["out_dir"] = str(folder)
            # The sweep owns its points' folders: a rerun (resume, overwrite) writes over them.
            if "overwrite" in declared and "overwrite" not in params:
                params["overwrite"] = True
            if "interactive" in declared and "interactive" not in params:
                params["interactive"] = False
            _check_json(params)
            results = folder / Path(params["out_dir"]) if "out_dir" in params else folder
            tasks.append(_Task(i, name, folder, point, requested, params, results.resolve()))
        # Every point's values before the first run: a typo in the last one fails now, not
        # after the others ran.
        _check_values(path, grid, tasks)
        _check_own_outputs(grid, tasks)
    except BaseException:
        if fresh:
            out.rmdir()  # made above, still empty: a refused sweep leaves nothing
        raise
    out = _writable_folder(out)
    with holding_folder(out, "sweep"), owned_temp_dir("lab-sweep-") as keys:
        for task in tasks:
            task.connection_file = keys / f"kernel-{task.index:03d}.json"
        return _run_tasks(path, grid, out, tasks, jobs, metric, progress, resume)


def _run_tasks(
    path: Path,
    grid: Mapping[str, Sequence[Any]],
    out: Path,
    tasks: list[_Task],
    jobs: int,
    metric: str | None,
    progress: bool,
    resume: bool,
) -> Sweep:
    """Run the checked tasks of `run_sweep` in `out` (held), `jobs` at a time."""
    from lab.base.processes import end_child, signal_name, sigterm_raises
    from lab.base.progress import progress as progress_bar

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    done = _finished_runs(out, digest) if resume else {}
    outcomes: dict[int, RunOutcome] = {}
    todo = []
    for task in tasks:
        kept = done.get(_record_key(digest, task.requested))
        if kept is not None:
            folder, results = kept
            outcomes[task.index] = _outcome(str(folder), folder.name, task.point, None, results)
        else:
            todo.append(task)
    table_path = out / "sweep.csv"

    def finished() -> list[RunOutcome]:
        return [outcomes[t.index] for t in tasks if t.index in outcomes]

    def write_table() -> None:
        with atomic_path(table_path) as tmp:
            sweep_table(finished()).to_csv(tmp, index=False)

    if outcomes:
        write_table()
    running: dict[int, tuple[_Task, Any]] = {}
    pending = list(reversed(todo))
    bar = progress_bar(
        total=len(tasks), initial=len(outcomes), desc=f"sweep {path.stem}", disable=not progress
    )
    try:
        with sigterm_raises():
            try:
                while pending or running:
                    while pending and len(running) < jobs:
                        task = pending.pop()
                        proc = _start_run(path, task)
                        running[proc.pid] = (task, proc)
                    ended = [pid for pid, (_, proc) in running.items() if proc.poll() is not None]
                    if not ended:
                        time.sleep(0.1)
                        continue
                    for pid in ended:
                        task, proc = running.pop(pid)
                        outcome = _finish_run(task, proc.returncode, digest)
                        outcomes[task.index] = outcome
                        write_table()
                        bar.update(1)
                        bar.set_postfix(failed=sum(1 for o in outcomes.values() if not o.ok))
            except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM as Terminated
                for _, proc in running.values():
                    end_child(proc)
                write_table()
                name = signal_name(err)
                partial = Sweep(path, out, finished(), table_path, None)
                raise SweepInterrupted(
                    f"sweep: stopped by {name}; {len(partial.outcomes)} of "
                    f"{len(tasks)} runs finished ({len(running)} ended, {len(pending)} never "
                    f"started); their rows are in {table_path}. Run again with resume=True "
                    "(--resume) to run only the rest.",
                    partial,
                    name,
                ) from err
    finally:
        bar.close()

    ordered = finished()
    write_table()
    plot_path: Path | None = out / "sweep.png"
    try:
        fig = plot_sweep(sweep_table(ordered), metric, title=f"{path.stem}: {', '.join(grid)}")
        with atomic_path(plot_path) as tmp:
            fig.savefig(tmp, dpi=110)
    except ValueError:
        # Every run failed (or wrote no metric): there is nothing to plot, the table says why.
        plot_path = None
    return Sweep(path, out, ordered, table_path, plot_path)


def _check_own_outputs(grid: Mapping[str, Sequence[Any]], tasks: Sequence[_Task]) -> None:
    """Refuse parameters that give two runs one output folder (each would overwrite the other).

    `-p out_dir=X` made every run write X/results.json, and every row read whichever run
    wrote last. Relative values are taken from each run's folder, where its kernel runs.

    Raises:
        ValueError: Naming the parameter, the shared folder and the runs that share it.
    """
    by_folder: dict[Path, list[_Task]] = {}
    for task in tasks:
        by_folder.setdefault(task.results, []).append(task)
    for folder, sharing in by_folder.items():
        if len(sharing) < 2:
            continue
        how = "grid key" if "out_dir" in grid else "parameter"
        value = sharing[0].params.get("out_dir")
        names = ", ".join(t.name for t in sharing[:3]) + (", ..." if len(sharing) > 3 else "")
        raise ValueError(
            f"sweep: {how} out_dir={value!r} gives {len(sharing)} runs one output folder "
            f"{str(folder)!r} ({names}): each would write its results.json over the others'. "
            "Leave out_dir out (each run then writes into its own folder of the sweep), give a "
            "relative folder (taken inside each run's folder), or one value per run. Nothing ran."
        )


def _check_values(path: Path, grid: Mapping[str, Sequence[Any]], tasks: Sequence[_Task]) -> None:
    """Refuse, before any run, a value the lab knows cannot run (an unknown family, preset, ...).

    `--grid family=flux,sdd3` ran flux, then failed in the sdd3 run's kernel. Checked here
    for the parameters whose choices the lab knows (`_CHOICES`), each point's values with the
    notebook's defaults under them (a preset is a preset of the point's family).

    Raises:
        ValueError: Naming the parameter, the bad value, the nearest choice and all of them.
    """
    import ast

    import papermill as pm

    defaults: dict[str, Any] = {}
    for name, info in pm.inspect_notebook(str(path)).items():
        try:
            defaults[name] = ast.literal_eval(str(info.get("default")))
        except (ValueError, SyntaxError):
            continue
    seen: set[tuple[str, str]] = set()
    for task in tasks:
        values = {**defaults, **task.requested}
        for name in task.requested:
            check = _CHOICES.get(name)
            key = (name, json.dumps(values.get(name), sort_keys=True, default=str))
            if check is None or key in seen or values[name] is None:
                continue
            seen.add(key)
            problem = check(values[name], values)
            if problem:
                how = "grid value" if name in grid else "parameter"
                raise ValueError(
                    f"sweep: {how} {name}={values[name]!r} {problem} Nothing ran; every "
                    "point is checked before the first run."
                )


def _one_of(value: Any, known: Sequence[str], what: str) -> str | None:
    """None when `value` is one of `known`, else why not (with the nearest name)."""
    import difflib

    if isinstance(value, str) and value in known:
        return None
    near = difflib.get_close_matches(str(value), list(known), n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return f"is not {what}.{hint} Known: {', '.join(known)}."


def _family_choice(value: Any, values: Mapping[str, Any]) -> str | None:
    from lab.families import FAMILY_NAMES

    return _one_of(value, FAMILY_NAMES, "a family")


def _preset_choice(value: Any, values: Mapping[str, Any]) -> str | None:
    from lab.families import FAMILY_NAMES, family

    if values.get("family") not in FAMILY_NAMES:
        return None  # the family's own check names it
    fam = family(values["family"])
    return _one_of(value, list(fam.presets), f"a preset of {fam.name}")


def _mode_choice(value: Any, values: Mapping[str, Any]) -> str | None:
    from lab.pairing.run import MODES

    return _one_of(value, MODES, "a pairing mode")


def _sde_type_choice(value: Any, values: Mapping[str, Any]) -> str | None:
    from lab.rl.flow_grpo import SDE_TYPES

    return _one_of(value, SDE_TYPES, "an SDE type")


def _device_choice(value: Any, values: Mapping[str, Any]) -> str | None:
    from lab.base.devices import resolve_device

    try:
        resolve_device(value)
    except ValueError as err:
        return f"cannot run here: {err}"
    return None


_CHOICES: dict[str, Callable[[Any, Mapping[str, Any]], str | None]] = {
    "family": _family_choice,
    "preset": _preset_choice,
    "mode": _mode_choice,
    "sde_type": _sde_type_choice,
    "device": _device_choice,
}
"""Parameter name -> (value, the point's values) -> why the value cannot run, or None."""


def _writable_folder(out: Path) -> Path:
    """Create `out` and check a file can be written there, or say what is wrong."""
    from lab.base.atomic import folder_write_problem

    problem = folder_write_problem(out, keep=True)
    if problem:
        raise ValueError(
            f"sweep: cannot write the sweep folder {str(out)!r} ({problem}). Choose a folder "
            "you can write with --out (out_dir=)."
        )
    return out


def _check_json(params: Mapping[str, Any]) -> None:
    for key, value in params.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"sweep: parameter {key}={value!r} is not JSON ({err}); sweep parameters "
                "travel to each run as JSON: use numbers, strings, booleans, lists and dicts."
            ) from err


def _start_run(notebook: Path, task: _Task) -> Any:
    """Start one grid point's papermill process (it dies with this one)."""
    from lab.base.processes import start_child

    task.folder.mkdir(parents=True, exist_ok=True)
    # A rerun must not read what an earlier run of this folder left.
    for stale in (task.results / "results.json", task.folder / "executed.ipynb",
                  task.folder / RUN_RECORD):  # fmt: skip
        stale.unlink(missing_ok=True)
    spec = task.folder / "task.json"
    atomic_write_text(
        spec,
        json.dumps(
            {
                "notebook": str(notebook),
                "output": str(task.folder / "executed.ipynb"),
                "parameters": task.params,
                "cwd": str(task.folder),
                "start_timeout": KERNEL_START_TIMEOUT_S,
                "connection_file": str(task.connection_file or ""),
            }
        ),
    )
    # The child writes its own copy of the descriptor; ours is closed once it has started.
    with open(task.folder / "papermill.log", "wb") as log:
        return start_child(
            [sys.executable, "-c", _WORKER, str(spec)],
            cwd=task.folder,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _finish_run(task: _Task, returncode: int, digest: str) -> RunOutcome:
    """Read a finished run's folder into its row and record it for `resume`."""
    error = None
    if returncode != 0:
        error = RuntimeError(_log_tail(task.folder / "papermill.log", returncode))
    outcome = _outcome(str(task.folder), task.name, task.point, error, task.results)
    record = {
        "notebook_sha256": digest,
        "parameters": task.requested,
        "results_dir": str(task.results),
        "status": "ok" if outcome.ok else "failed",
        "error": outcome.error,
        "seconds": outcome.seconds,
    }
    atomic_write_text(task.folder / RUN_RECORD, json.dumps(record, indent=1))
    return outcome


def _log_tail(log: Path, returncode: int) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    how = f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
    return f"the papermill process ended with {how}" + (f": {lines[-1]}" if lines else "")


def _record_key(digest: str, requested: Mapping[str, Any]) -> str:
    return json.dumps({"notebook_sha256": digest, "parameters": requested}, sort_keys=True)


def _finished_runs(out: Path, digest: str) -> dict[str, tuple[Path, Path]]:
    """Run folders under `out` whose record says ok and whose results.json is there.

    Key -> (the run's folder, the folder of its results.json).
    """
    found: dict[str, tuple[Path, Path]] = {}
    for record_path in sorted(out.glob(f"*/{RUN_RECORD}")):
        try:
            record = json.loads(record_path.read_text())
            if record.get("status") != "ok" or record.get("notebook_sha256") != digest:
                continue
            key = _record_key(digest, record["parameters"])
            results = Path(record.get("results_dir") or record_path.parent)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged record: the point simply runs again
        if (results / "results.json").is_file():
            found.setdefault(key, (record_path.parent, results))
    return found

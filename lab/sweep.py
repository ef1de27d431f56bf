r"""Sweeps: run one notebook with papermill over a parameter grid, collect one table and a plot.

    python -m lab sweep notebooks/01_quickstart.ipynb --grid family=flux,sd3 \\
        --grid mode=propagated,local --out runs/sweep --jobs 2

Each grid point gets its own folder `<out>/<run name>/` holding the executed notebook and
whatever the notebook writes there (its `out_dir` parameter is pointed at the folder). Every
run's `results.json` summary (a Result's `summary`, a Trajectory's `overall`) becomes one row
of `<out>/sweep.csv`; `<out>/sweep.png` plots the headline metric per run. A failed run keeps
its executed notebook, is reported with the cell error, and the other runs still finish.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import math
import multiprocessing
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
"""Where bare notebook names ("01_quickstart") are looked up."""
HEADLINE_METRICS: tuple[str, ...] = (
    "model_output_rel_max",
    "ratio_abs_minus_1",
    "model_output_max_abs_diff",
    "max_ulp",
)
"""The first of these a table has is the one `plot_sweep` draws by default."""


# ---- grid ---------------------------------------------------------------------------------


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


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid, in row-major order of the keys as given."""
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*grid.values())]


def run_name(index: int, point: Mapping[str, Any]) -> str:
    """A folder-safe name for one grid point: `003_family=sd3_mode=local`."""
    words = "_".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in point.items()
    )
    return f"{index:03d}_" + re.sub(r"[^A-Za-z0-9_=.,+-]+", "-", words)[:120].strip("-")


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


def summarize_results_json(path: Path) -> dict[str, Any]:
    """Flat scalar summary of a results.json: a Result's `summary`, a Trajectory's `overall`."""
    data = json.loads(path.read_text())
    block = data.get("summary") or data.get("overall") or data
    return {k: v for k, v in block.items() if v is None or isinstance(v, str | int | float | bool)}


def _outcome(
    folder: str, name: str, point: dict[str, Any], error: BaseException | None
) -> RunOutcome:
    """One grid point's row, read from what its run left in `folder`."""
    out_dir = Path(folder)
    executed = out_dir / "executed.ipynb"
    seconds = _duration(executed)
    if error is not None:
        return RunOutcome(
            name, point, folder, str(executed), False, _error_line(executed, error), seconds
        )
    results = out_dir / "results.json"
    if not results.is_file():
        return RunOutcome(
            name,
            point,
            folder,
            str(executed),
            False,
            f"the notebook wrote no results.json in {out_dir}",
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
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric} per sweep run (red: failed)", fontsize=9)
    ax.grid(alpha=0.3, axis="y", which="both")
    return fig


def run_sweep(
    notebook: str | Path,
    grid: Mapping[str, Sequence[Any]],
    out_dir: str | Path,
    *,
    parameters: Mapping[str, Any] | None = None,
    jobs: int = 2,
    metric: str | None = None,
    progress: bool = True,
) -> Sweep:
    """Execute `notebook` once per grid point with papermill, `jobs` at a time; collect results.

    Args:
        notebook: A notebook path, or a name under notebooks/ ("01_quickstart").
        grid: key -> values; every combination runs (keys must be notebook parameters).
        out_dir: Sweep folder: one sub-folder per run, plus sweep.csv and sweep.png.
        parameters: Parameters every run gets (the grid wins on a clash).
        jobs: Runs in parallel (processes, each starting its own kernel).
        metric: The column sweep.png plots; None = the first of HEADLINE_METRICS present.
        progress: Show a tqdm bar over finished runs.

    Returns:
        The Sweep (outcomes, table path, plot path); failed runs are in `Sweep.failed`.

    Raises:
        ValueError: An unknown notebook, an empty grid, a grid key the notebook does not
            declare as a parameter, or jobs < 1.
    """
    import papermill as pm
    from tqdm.auto import tqdm

    path = resolve_notebook(notebook)
    if not grid or any(not list(v) for v in grid.values()):
        raise ValueError("run_sweep: the grid is empty; give each key at least one value.")
    if jobs < 1:
        raise ValueError(f"run_sweep: jobs must be >= 1, got {jobs!r}.")
    declared = pm.inspect_notebook(str(path))
    unknown = sorted((set(grid) | set(parameters or {})) - set(declared))
    if unknown:
        raise ValueError(
            f"run_sweep: {unknown} are not parameters of {path.name}. Its parameters: "
            f"{', '.join(declared)}."
        )
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    points = grid_points(grid)
    tasks = []
    for i, point in enumerate(points):
        name = run_name(i, point)
        folder = out / name
        params = {**dict(parameters or {}), **point}
        if "out_dir" in declared and "out_dir" not in params:
            params["out_dir"] = str(folder)
        if "interactive" in declared and "interactive" not in params:
            params["interactive"] = False
        folder.mkdir(parents=True, exist_ok=True)
        tasks.append((str(path), str(folder), name, point, params))

    outcomes: dict[str, RunOutcome] = {}
    # spawn, not fork: the parent may hold torch's thread pools, and a forked child could
    # inherit a held lock.
    ctx = multiprocessing.get_context("spawn")
    with (
        cf.ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx) as pool,
        tqdm(total=len(tasks), desc=f"sweep {path.stem}", disable=not progress) as bar,
    ):
        # The workers run papermill itself (importable without torch, so a worker starts fast);
        # everything else is read back from the run folder here.
        futures = {
            pool.submit(
                pm.execute_notebook,
                notebook,
                str(Path(folder) / "executed.ipynb"),
                parameters=params,
                kernel_name="python3",
                progress_bar=False,
                cwd=folder,
            ): (folder, name, point)
            for notebook, folder, name, point, params in tasks
        }
        for future in cf.as_completed(futures):
            folder, name, point = futures[future]
            try:
                future.result()
                error = None
            except Exception as err:  # a failed run becomes a row; the other runs carry on
                error = err
            outcome = _outcome(folder, name, point, error)
            outcomes[name] = outcome
            bar.update(1)
            bar.set_postfix(failed=sum(1 for o in outcomes.values() if not o.ok))

    ordered = [outcomes[t[2]] for t in tasks]
    table = sweep_table(ordered)
    table_path = out / "sweep.csv"
    table.to_csv(table_path, index=False)
    plot_path: Path | None = out / "sweep.png"
    try:
        fig = plot_sweep(table, metric, title=f"{path.stem}: {', '.join(grid)}")
        fig.savefig(plot_path, dpi=110)
    except ValueError:
        # Every run failed (or wrote no metric): there is nothing to plot, the table says why.
        plot_path = None
    return Sweep(path, out, ordered, table_path, plot_path)

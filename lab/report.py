"""One self-contained HTML file from one or more Results, with matplotlib PNGs beside it.

    write_html(result, "runs/quickstart/report.html")
    write_html({"before fix": r0, "after fix": r1}, "report.html")       # a section each + overlay
    write_html(result, "report.html", comparison=compare_to_baseline(result, "flux_tiny"))

The file opens offline: plotly.js is inlined once in <head>, the styles and the table-sorting
script are inline, and nothing is fetched from the network. The static PNGs go to
`<stem>_files/` next to the report and are referenced relatively, so the folder can be moved
or zipped as a whole. Reads only Results (a `Result.from_json` is enough), never runs a model.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab import plots
from lab.result import Result, results_table

if TYPE_CHECKING:
    import pandas as pd

    from lab.baselines import BaselineComparison

# Per-module table columns, in reading order (the rest of Result.table() stays in result.json).
_TABLE_COLUMNS: tuple[str, ...] = (
    "order", "module", "call", "output", "module_class", "dtype_a", "dtype_b", "shape",
    "mean_abs_diff", "max_abs_diff", "rel_max", "max_ulp", "bitexact_frac", "cosine_dist",
    "rounding_only", "max_abs_diff_rounded", "nonfinite_a", "nonfinite_b", "degenerate",
)  # fmt: skip
# Meta keys shown in the sides table rather than the run table.
_SIDE_META: tuple[tuple[str, str], ...] = (
    ("autocast policy (resolved)", "autocast_policy"),
    ("parameter dtypes (count)", "param_dtypes"),
)

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 2rem 4rem;
       color: #222; max-width: 1500px; }
h1 { margin-top: 1.2rem; } h2 { border-bottom: 2px solid #ddd; padding-top: 1rem; }
h3 { margin-bottom: .3rem; }
table { border-collapse: collapse; margin: .4rem 0 1rem; font-size: 12.5px; }
th, td { border: 1px solid #ddd; padding: 2px 7px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; position: sticky; top: 0; }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th:hover { background: #e6e6e6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; font-family: ui-monospace,
         monospace; }
tr.diff td { background: #fff3cd; } tr.diff td:first-child { font-weight: 600; }
tr.exact td { color: #888; } tr.first td { background: #fde2e2; }
tr.worse td { background: #fde2e2; } tr.improved td { background: #e2f5e2; }
tr.new td, tr.missing td { background: #e8eefc; }
.ok { color: #197319; font-weight: 600; } .bad { color: #b00020; font-weight: 600; }
.note { color: #666; font-size: 12.5px; } pre { background: #f7f7f7; padding: .6rem; }
.scroll { max-height: 34rem; overflow: auto; display: inline-block; max-width: 100%; }
nav a { margin-right: 1rem; } details { margin: .3rem 0 1rem; } img { max-width: 100%; }
input.filter { margin: .2rem 0; padding: 2px 6px; width: 20rem; }
"""

# Click a header to sort by it (numbers by data-v, text otherwise); type to filter rows.
_JS = """
function sortTable(th) {
  const table = th.closest("table"), body = table.tBodies[0];
  const idx = Array.from(th.parentNode.children).indexOf(th);
  const asc = th.dataset.dir !== "asc"; th.dataset.dir = asc ? "asc" : "desc";
  const key = (tr) => { const td = tr.children[idx];
    const v = td.dataset.v !== undefined ? parseFloat(td.dataset.v) : NaN;
    return isNaN(v) ? td.textContent : v; };
  const rows = Array.from(body.rows).sort((a, b) => { const x = key(a), y = key(b);
    const c = (typeof x === "number" && typeof y === "number") ? x - y
      : String(x).localeCompare(String(y)); return asc ? c : -c; });
  rows.forEach((r) => body.appendChild(r));
}
function filterTable(input, id) {
  const q = input.value.toLowerCase();
  for (const tr of document.getElementById(id).tBodies[0].rows)
    tr.style.display = tr.textContent.toLowerCase().includes(q) ? "" : "none";
}
"""


def write_html(
    result_or_results: Result | Sequence[Result] | Mapping[str, Result],
    path: str | Path,
    *,
    title: str | None = None,
    metric: str = "rel_max",
    comparison: BaselineComparison | None = None,
    trajectories: Any = (),
    static: bool = True,
) -> Path:
    """Write one self-contained HTML report (plus PNGs in `<stem>_files/`).

    Each Result gets a section: the settings of both sides (differences highlighted, with
    each side's resolved autocast policy), the summary metrics, divergence across depth and
    the ULP histogram (interactive; static PNGs underneath), the per-module table (every row,
    sortable) and the skipped pairs with their reasons. Several Results add an overlay of
    `metric` across depth; a baseline comparison adds its verdict, regressions and overlay.

    Args:
        result_or_results: A Result, a list of them, or a mapping section name -> Result.
        path: The .html file to write; parent folders are created.
        title: Page title; defaults to the first Result's family, preset and sides.
        metric: The metric of the depth and overlay plots (a numeric `Result.table()` column).
        comparison: A `lab.baselines.compare_to_baseline(...)` record to include.
        trajectories: Ratio-drift runs to include: one object or a list / mapping of them,
            each with `per_step()` -> DataFrame (e.g. `lab.trajectory.Trajectory`); a
            `captures` mapping step -> Result adds a steps x layers heatmap.
        static: Also write matplotlib PNGs beside the report.

    Returns:
        The path of the HTML file.

    Raises:
        ValueError: No Result given, or an unknown metric.
    """
    path = Path(path)
    named = _named_results(result_or_results)
    files = _Files(path, static)
    body: list[str] = []
    nav: list[tuple[str, str]] = []
    if len(named) > 1:
        nav.append(("overview", "Overview"))
        body.append(_overview_section(named, metric, files))
    if comparison is not None:
        nav.append(("baseline", "Baseline comparison"))
        body.append(_comparison_section(comparison, files))
    for i, (name, result) in enumerate(named):
        nav.append((f"run-{i}", name))
        body.append(_result_section(result, name, i, metric, files))
    for i, (name, traj) in enumerate(_named_trajectories(trajectories)):
        nav.append((f"trajectory-{i}", name))
        body.append(_trajectory_section(traj, name, i, files))

    first = named[0][1]
    title = title or f"Precision Lab report: {_run_name(first, None)}"
    versions = first.meta.get("versions") or {}
    stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    from plotly.offline import get_plotlyjs

    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title>
<style>{_CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
<script type="text/javascript">{_JS}</script>
</head><body>
<h1>{_e(title)}</h1>
<p class="note">Written {_e(stamp)}; {_e(", ".join(f"{k} {v}" for k, v in versions.items()))}.
In every table and plot the first side is the reference and the second the candidate;
metrics are candidate vs reference.</p>
<nav>{"".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in nav)}</nav>
{"".join(body)}
</body></html>
"""
    from lab.atomic import atomic_write_text  # a failed write leaves the old report whole

    return atomic_write_text(path, page, encoding="utf-8")


# ---- inputs -------------------------------------------------------------------------------


def _named_results(value: Any) -> list[tuple[str, Result]]:
    """[(section name, Result)] from a Result, a list or a mapping.

    Raises:
        ValueError: For no Result or something that is not a Result.
    """
    if isinstance(value, Result):
        items = [(_run_name(value, None), value)]
    elif isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = [(_run_name(r, i), r) for i, r in enumerate(value)]
    else:
        raise ValueError(
            f"write_html: expected a Result, a list of Results or a mapping name -> Result, "
            f"got {type(value).__name__}."
        )
    if not items:
        raise ValueError("write_html: no Result given; pass at least one.")
    bad = [name for name, r in items if not isinstance(r, Result)]
    if bad:
        raise ValueError(f"write_html: {bad} are not Results (load one with Result.from_json).")
    return items


def _run_name(result: Result, index: int | None) -> str:
    m = result.meta
    what = (
        f"{m.get('family', 'model')} [{m.get('preset', '?')}], "
        f"{result.side_a.get('name')} vs {result.side_b.get('name')}"
    )
    return what if index is None else f"run {index}: {what}"


def _named_trajectories(value: Any) -> list[tuple[str, Any]]:
    if value is None or (isinstance(value, Sequence) and not value):
        return []
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    items = list(value) if isinstance(value, Sequence) else [value]
    return [(f"trajectory {i}", t) for i, t in enumerate(items)]


class _Files:
    """The `<stem>_files/` folder beside the report; PNGs are referenced relative to it."""

    def __init__(self, report: Path, static: bool) -> None:
        self.dir = report.parent / f"{report.stem}_files"
        self.static = static

    def png(self, fig: Any, name: str) -> str:
        """Save a matplotlib figure, close it, and return an <img> (or "" when not static)."""
        import matplotlib.pyplot as plt

        try:
            if not self.static:
                return ""
            plots.save_figure(fig, self.dir / name)
        finally:
            plt.close(fig)
        src = f"{self.dir.name}/{name}"
        return (
            f'<details><summary>static PNG: <a href="{_e(src)}">{_e(src)}</a></summary>'
            f'<img src="{_e(src)}" alt="{_e(name)}"></details>'
        )


# ---- sections -----------------------------------------------------------------------------


def _result_section(result: Result, name: str, i: int, metric: str, files: _Files) -> str:
    summary = result.summary()
    parts = [
        f'<section id="run-{i}"><h2>{_e(name)}</h2>',
        f"<pre>{_e(result.describe())}</pre>",
        "<h3>Summary</h3>",
        _kv_table(summary),
        "<h3>Settings of both sides</h3>",
        '<p class="note">Rows where the sides differ are highlighted.</p>',
        _sides_table(result),
        "<h3>Run</h3>",
        _kv_table(
            {
                k: v
                for k, v in result.meta.items()
                if not any(k.startswith(p) for _, p in _SIDE_META)
            }
        ),
    ]
    if result.rows:
        prefix = f"run{i}_"
        parts += [
            "<h3>Divergence across depth</h3>",
            _plotly_div(plots.plot_divergence_by_layer(result, metric, backend="plotly")),
            files.png(plots.plot_divergence_by_layer(result, metric), f"{prefix}divergence.png"),
            "<h3>ULP distance histogram</h3>",
            '<p class="note">Every paired output summed; ULPs in the coarser dtype of each pair.'
            "</p>",
            _plotly_div(plots.plot_ulp_histogram(result, backend="plotly")),
            files.png(plots.plot_ulp_histogram(result), f"{prefix}ulp_histogram.png"),
        ]
    parts += [
        f"<h3>Per-module table ({len(result.rows)} paired outputs)</h3>",
        '<p class="note">Click a header to sort. Red: first divergent output; grey: bit-exact.</p>',
        _module_table(result, f"modules-{i}"),
        f"<h3>Skipped pairs ({len(result.skipped)})</h3>",
        _skipped_table(result),
        "</section>",
    ]
    return "\n".join(parts)


def _overview_section(named: list[tuple[str, Result]], metric: str, files: _Files) -> str:
    table = results_table([r for _, r in named])
    table.insert(0, "run", [n for n, _ in named])
    parts = ['<section id="overview"><h2>Overview</h2>', _df_table(table, "overview-table")]
    labels = [{r.label() for r in res.rows} for _, res in named]
    if all(labels) and set.intersection(*labels):
        runs = dict(named)
        parts += [
            f"<h3>Overlay: {_e(metric)} across depth</h3>",
            f'<p class="note">The first run ({_e(named[0][0])}) is the baseline; a fix shows as '
            "a drop below its line.</p>",
            _plotly_div(plots.plot_overlay(runs, metric, backend="plotly")),
            files.png(plots.plot_overlay(runs, metric), "overlay.png"),
        ]
    else:
        parts.append('<p class="note">No overlay: these runs share no module output.</p>')
    parts.append("</section>")
    return "\n".join(parts)


def _comparison_section(cmp: BaselineComparison, files: _Files) -> str:
    s = cmp.summary()
    verdict = (
        '<span class="ok">OK: nothing got worse</span>'
        if s["ok"]
        else f'<span class="bad">REGRESSED: {s["worse"]} worse, {s["missing"]} missing</span>'
    )
    runs = {f"baseline {cmp.baseline_name}": cmp.baseline, "this run": cmp.candidate}
    parts = [
        '<section id="baseline"><h2>Baseline comparison</h2>',
        f"<p>{verdict} (baseline {_e(cmp.baseline_name)}; {_e(s['rule'])} on "
        f"{_e(cmp.metric)}).</p>",
        _kv_table(s),
        _plotly_div(plots.plot_overlay(runs, cmp.metric, backend="plotly")),
        files.png(plots.plot_overlay(runs, cmp.metric), "baseline_overlay.png"),
    ]
    for status in ("worse", "improved", "new", "missing"):
        rows = cmp.rows(status)
        parts.append(f"<h3>{status.capitalize()} ({len(rows)})</h3>")
        parts.append(_df_table(rows, f"baseline-{status}", row_class="status") if len(rows) else "")
    parts.append("</section>")
    return "\n".join(parts)


def _trajectory_section(traj: Any, name: str, i: int, files: _Files) -> str:
    df = traj.per_step()
    parts = [f'<section id="trajectory-{i}"><h2>{_e(name)}</h2>']
    describe = getattr(traj, "describe", None)
    if callable(describe):
        parts.append(f"<pre>{_e(describe())}</pre>")
    fig = _ratio_drift_plotly(df, getattr(traj, "meta", {}) or {})
    if fig is not None:
        parts += ["<h3>Ratio drift per step</h3>", _plotly_div(fig)]
    if files.static and hasattr(traj, "per_sample") and hasattr(traj, "meta"):
        # Lazy import: the report reads trajectories duck-typed and must not need lab.trajectory.
        from lab import drift_plots

        parts.append(files.png(drift_plots.plot_ratio_drift(traj), f"traj{i}_ratio_drift.png"))
        parts.append(files.png(drift_plots.plot_ratio_histogram(traj), f"traj{i}_ratio_hist.png"))
    captures = getattr(traj, "captures", None) or {}
    if captures and all(isinstance(r, Result) and r.rows for r in captures.values()):
        parts += [
            "<h3>Steps x layers (rel_max of the captured steps)</h3>",
            _plotly_div(plots.plot_steps_by_layers(captures, backend="plotly")),
            files.png(plots.plot_steps_by_layers(captures), f"traj{i}_steps_by_layers.png"),
        ]
    parts += [f"<h3>Per step ({len(df)})</h3>", _df_table(df, f"trajectory-{i}-steps")]
    parts.append("</section>")
    return "\n".join(parts)


def _ratio_drift_plotly(df: pd.DataFrame, meta: Mapping[str, Any]) -> Any:
    """Ratio - 1 per step (median, p01..p99 band, clip range), or None without those columns.

    The plotly twin of `lab.drift_plots.plot_ratio_drift`; it lives here until drift_plots
    grows a plotly backend, because the report is its only caller.
    """
    need = {"step", "ratio_p01", "ratio_p50", "ratio_p99"}
    if not need <= set(df.columns):
        return None
    import plotly.graph_objects as go

    if "in_window" in df.columns:
        df = df[df["in_window"].astype(bool)]
    steps = df["step"].tolist()
    band = {"mode": "lines", "line": {"width": 0}, "hoverinfo": "skip"}
    fig = go.Figure(
        [
            go.Scatter(x=steps, y=(df["ratio_p99"] - 1).tolist(), showlegend=False, **band),
            go.Scatter(
                x=steps, y=(df["ratio_p01"] - 1).tolist(), fill="tonexty", name="p01..p99", **band
            ),
            go.Scatter(
                x=steps,
                y=(df["ratio_p50"] - 1).tolist(),
                mode="lines+markers",
                name="median",
                hovertemplate="step %{x}: ratio - 1 = %{y:.3e}<extra></extra>",
            ),
        ]
    )
    clip = meta.get("clip_range")
    if isinstance(clip, int | float):
        for sign in (1, -1):
            fig.add_hline(y=sign * clip, line={"color": "red", "dash": "dot", "width": 1})
    fig.update_xaxes(title="denoising step")
    fig.update_yaxes(title="ratio - 1 (trainer / rollout)", exponentformat="e")
    fig.update_layout(template="plotly_white", height=360)
    return fig


# ---- HTML pieces --------------------------------------------------------------------------


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _plotly_div(fig: Any) -> str:
    # plotly.js is inlined once in <head>; each figure is only its div and a newPlot call.
    return fig.to_html(
        full_html=False, include_plotlyjs=False, include_mathjax=False,
        config={"displaylogo": False, "responsive": True},
    )  # fmt: skip


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value) or value == 0:
            return str(value)
        return f"{value:.0f}" if value.is_integer() and abs(value) < 1e9 else f"{value:.4g}"
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, default=str)
    return str(value)


def _cell(value: Any) -> str:
    import numpy as np

    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, int | float) and not isinstance(value, bool):
        # data-v is what the sort reads; JavaScript's parseFloat spells infinity "Infinity".
        key = ("Infinity" if value > 0 else "-Infinity") if math.isinf(value) else repr(value)
        return f'<td class="num" data-v="{key}">{_e(_fmt(value))}</td>'
    return f"<td>{_e(_fmt(value))}</td>"


def _kv_table(data: Mapping[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th>{_cell(v)}</tr>" for k, v in data.items())
    return f"<table>{rows}</table>"


def _sides_table(result: Result) -> str:
    a, b = result.side_a, result.side_b
    rows = []
    keys = list(a) + [k for k in b if k not in a]
    extra = [
        (label, result.meta.get(f"{key}_a"), result.meta.get(f"{key}_b"))
        for label, key in _SIDE_META
    ]
    for label, va, vb in [(k, a.get(k), b.get(k)) for k in keys] + extra:
        differ = json.dumps(va, sort_keys=True, default=str) != json.dumps(
            vb, sort_keys=True, default=str
        )
        cls = ' class="diff"' if differ else ""
        rows.append(f"<tr{cls}><td>{_e(label)}</td>{_cell(va)}{_cell(vb)}</tr>")
    head = (
        f"<tr><th>field</th><th>{_e(a.get('name'))} (reference)</th>"
        f"<th>{_e(b.get('name'))} (candidate)</th></tr>"
    )
    return f"<table><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>"


def _module_table(result: Result, table_id: str) -> str:
    table = result.table()
    if not len(table):
        return '<p class="note">No paired outputs.</p>'
    cols = [c for c in _TABLE_COLUMNS if c in table.columns]
    first = result.first_divergence()
    head = "".join(f'<th onclick="sortTable(this)">{_e(c)}</th>' for c in cols)
    rows = []
    for row, rec in zip(result.rows, table[cols].itertuples(index=False), strict=True):
        cls = "first" if first is not None and row.order == first.order else ""
        cls = cls or ("exact" if not row.diverges else "")
        cells = "".join(_cell(v) for v in rec)
        rows.append(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
    return (
        f'<input class="filter" placeholder="filter rows (module, class, dtype)" '
        f"oninput=\"filterTable(this, '{table_id}')\">"
        f'<div class="scroll"><table class="sortable" id="{table_id}"><thead><tr>{head}</tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _skipped_table(result: Result) -> str:
    if not result.skipped:
        return '<p class="note">None: every captured output was paired and compared.</p>'
    rows = "".join(
        f"<tr><td>{_e(s.module)}</td><td>{s.call}</td><td>{_e(s.output)}</td>"
        f"<td>{_e(s.reason)}</td></tr>"
        for s in result.skipped
    )
    return (
        "<table><thead><tr><th>module</th><th>call</th><th>output</th><th>reason</th></tr>"
        f"</thead><tbody>{rows}</tbody></table>"
    )


def _df_table(df: pd.DataFrame, table_id: str, *, row_class: str | None = None) -> str:
    head = "".join(f'<th onclick="sortTable(this)">{_e(c)}</th>' for c in df.columns)
    rows = []
    for rec in df.itertuples(index=False):
        cls = f' class="{_e(getattr(rec, row_class))}"' if row_class else ""
        rows.append(f"<tr{cls}>{''.join(_cell(v) for v in rec)}</tr>")
    return (
        f'<div class="scroll"><table class="sortable" id="{table_id}"><thead><tr>{head}</tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table></div>"
    )

"""One HTML file from one or more Results: attach it to a review and nothing is missing.

    write_html(result, "runs/quickstart/report.html")
    write_html({"before fix": r0, "after fix": r1}, "report.html")       # a section each + overlay
    write_html(result, "report.html", comparison=compare_to_baseline(result, "flux_tiny"))

Everything is inside the file: plotly.js once (gzip-compressed and base64-encoded, unpacked by
the browser's DecompressionStream: 2.0 MB instead of 4.8 MB), each figure's data as JSON,
each figure's static PNG as a data: URI (shown until the interactive figure draws, and instead
of it where scripts do not run), the styles and the table-sorting script. Nothing is fetched
from the network or from beside the file. Reads only Results (a `Result.from_json` is enough),
never runs a model.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import gzip
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab.pairing.result import Result, partial_words, results_table
from lab.views import plots
from lab.views.plots.divergence import bitexact_words

if TYPE_CHECKING:
    import pandas as pd

    from lab.views.baselines import BaselineComparison

# Per-module table columns, in reading order (the rest of Result.table() stays in result.json).
_TABLE_COLUMNS: tuple[str, ...] = (
    "order", "module", "call", "output", "module_class", "dtype_a", "dtype_b", "param_dtypes_a",
    "param_dtypes_b", "shape", "mean_abs_diff", "max_abs_diff", "rel_max", "max_ulp",
    "bitexact_frac", "cosine_dist", "rounding_only", "max_abs_diff_rounded", "nonfinite_a",
    "nonfinite_b", "degenerate", "why",
)  # fmt: skip
# Meta keys that are measurements of a run rather than its settings (left out of the diff): its
# timings, and how the pair ran (`pair_core`: the side threads' core, probes, hand-overs;
# `metric_batches`), which give the same numbers either way and differ from run to run.
_NOT_SETTINGS: frozenset[str] = frozenset(
    {"timings_s", "repeated_pairs", "pair_core", "metric_batches"}
)
# Static fallback PNGs: enough for a review screen, a third of the 130-dpi file size.
_PNG_DPI = 90
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
td.why, th.why { min-width: 24rem; white-space: normal; }
.fig { margin: .4rem 0 1rem; } .fig.drawn img.static { display: none; }
.fig .why { margin: .2rem 0; } table.settings td { max-width: 28rem; overflow-wrap: anywhere; }
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
// plotly.js ships gzip-compressed in #plotly-gz; unpack it, then draw every .fig[data-figure]
// from its JSON. Until then (and where this cannot run) each figure's static PNG shows.
async function drawFigures() {
  const packed = document.getElementById("plotly-gz");
  if (!packed) return;
  try {
    if (typeof DecompressionStream === "undefined")
      throw new Error("this browser has no DecompressionStream");
    const bytes = Uint8Array.from(atob(packed.textContent.trim()), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    const script = document.createElement("script");
    script.textContent = await new Response(stream).text();
    document.head.appendChild(script);
  } catch (err) {
    document.body.dataset.figures = "static: " + err;
    return;
  }
  let drawn = 0;
  for (const fig of document.querySelectorAll(".fig[data-figure]")) {
    const spec = JSON.parse(document.getElementById(fig.dataset.figure).textContent);
    try {
      await Plotly.newPlot(fig.querySelector(".plot"), spec.data, spec.layout, spec.config);
      fig.classList.add("drawn");
      drawn += 1;
    } catch (err) { console.error(fig.dataset.figure, err); }
  }
  document.body.dataset.figures = "drawn " + drawn;
}
window.addEventListener("DOMContentLoaded", drawFigures);
"""


_VERSION_WORDS = {"cpu": "CPU kernels", "gpu": "GPU", "cuda": "CUDA"}
"""How the report's first line names a `meta["versions"]` key (the rest by their own name)."""


def write_html(
    result_or_results: Result | Sequence[Result] | Mapping[str, Result],
    path: str | Path,
    *,
    title: str | None = None,
    metric: str = "rel_max",
    comparison: BaselineComparison | None = None,
    trajectories: Any = (),
    static: bool = True,
    interactive: bool = True,
) -> Path:
    """Write one self-contained HTML report and print its size.

    Each Result gets a section: its summary (with the first divergence's `why` when the
    Result has one), the settings of both sides (differences highlighted, with each side's
    resolved autocast policy and parameter dtypes), divergence across depth and the ULP
    histogram, the per-module table (every row, sortable, with its `why`) and the skipped
    pairs with their reasons. Several Results add an overview: the settings and rules that
    differ between the runs, their summary rows, and an overlay of `metric` across depth. A
    baseline comparison adds its verdict, regressions and overlay.

    Args:
        result_or_results: A Result, a list of them, or a mapping section name -> Result.
        path: The .html file to write; parent folders are created.
        title: Page title; defaults to the first Result's family, preset and sides.
        metric: The metric of the depth and overlay plots (a numeric `Result.table()` column).
        comparison: A `lab.views.baselines.compare_to_baseline(...)` record to include.
        trajectories: Ratio-drift runs to include: one object or a list / mapping of them,
            each with `per_step()` -> DataFrame (e.g. `lab.rl.trajectory.Trajectory`); a
            `captures` mapping step -> Result adds a steps x layers heatmap.
        static: Embed a PNG of every figure (data: URI), shown where scripts do not run.
        interactive: Embed plotly.js (compressed, once) and draw every figure interactively.

    Returns:
        The path of the HTML file.

    Raises:
        ValueError: No Result given, an unknown metric, neither `static` nor `interactive`, or
            a `path` that cannot be written (a folder, a read-only place, a name too long):
            refused before any figure is drawn.
    """
    from lab.base.atomic import atomic_write_text, check_file_path

    check_file_path(path, "write_html")
    if not (static or interactive):
        raise ValueError(
            "write_html: static=False and interactive=False leave no way to show a figure; "
            "keep at least one True."
        )
    path = Path(path)
    named = _named_results(result_or_results)
    figs = _Figures(static=static, interactive=interactive)
    body: list[str] = []
    nav: list[tuple[str, str]] = []
    if len(named) > 1:
        nav.append(("overview", "Overview"))
        body.append(_overview_section(named, metric, figs))
    if comparison is not None:
        nav.append(("baseline", "Baseline comparison"))
        body.append(_comparison_section(comparison, figs))
    for i, (name, result) in enumerate(named):
        nav.append((f"run-{i}", name))
        body.append(_result_section(result, name, i, metric, figs))
    for i, (name, traj) in enumerate(_named_trajectories(trajectories)):
        nav.append((f"trajectory-{i}", name))
        body.append(_trajectory_section(traj, name, i, figs))

    first = named[0][1]
    title = title or f"Precision Lab report: {_run_name(first, None)}"
    versions = first.meta.get("versions") or {}
    built_with = ", ".join(f"{_VERSION_WORDS.get(k, k)} {v}" for k, v in versions.items())
    stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    packed = (
        f'<script type="application/gzip+base64" id="plotly-gz">{_plotlyjs_gzip_b64()}</script>'
        if interactive and figs.count
        else ""
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title>
<style>{_CSS}</style>
<script type="text/javascript">{_JS}</script>
</head><body>
<h1>{_e(title)}</h1>
<p class="note">Written {_e(stamp)}; {_e(built_with)}.
In every table and plot the first side is the reference and the second the candidate;
metrics are candidate vs reference.</p>
<nav>{"".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in nav)}</nav>
{"".join(body)}
{packed}
</body></html>
"""
    atomic_write_text(path, page, encoding="utf-8")  # a failed write leaves the old report whole
    print(f"wrote {path} ({_size(path.stat().st_size)})")
    return path


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


@functools.lru_cache(maxsize=1)
def _plotlyjs_gzip_b64() -> str:
    """plotly.js, gzip-compressed (mtime 0: the same bytes every time) and base64-encoded."""
    from plotly.offline import get_plotlyjs

    packed = gzip.compress(get_plotlyjs().encode("utf-8"), compresslevel=9, mtime=0)
    return base64.b64encode(packed).decode("ascii")


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


class _Figures:
    """Embeds figures in the page: plotly JSON drawn by the page's script, and a static PNG."""

    def __init__(self, *, static: bool, interactive: bool) -> None:
        self.static = static
        self.interactive = interactive
        self.count = 0

    def embed(self, fig: Any, name: str) -> str:
        """The markup of one lab plotly figure (which carries its matplotlib twin)."""
        import json

        import plotly.io as pio

        fid = f"fig-{self.count}"
        self.count += 1
        parts = []
        if self.interactive:
            spec = json.loads(pio.to_json(fig, validate=False, remove_uids=True))
            spec["config"] = {"displaylogo": False, "responsive": True}
            text = _script_json(spec)
            parts += [
                f'<script type="application/json" id="{fid}">{text}</script>',
                '<div class="plot"></div>',
            ]
        if self.static:
            png = base64.b64encode(plots.figure_png(fig, dpi=_PNG_DPI)).decode("ascii")
            parts.append(f'<img class="static" alt="{_e(name)}" src="data:image/png;base64,{png}">')
        attrs = f' data-figure="{fid}"' if self.interactive else ""
        return f'<div class="fig" id="{fid}-box"{attrs}>{"".join(parts)}</div>'


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element: no "<", ">" or "&" left, each as its u-escape.

    "</script" would end the element, and "<!--" followed by "<script" switches the HTML parser
    into a state where the element's own "</script>" no longer ends it (a name holding
    `<!--<script>` swallowed the rest of the report). The escapes are the same JSON strings.
    """
    text = json.dumps(value, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# ---- sections -----------------------------------------------------------------------------


def _result_section(result: Result, name: str, i: int, metric: str, figs: _Figures) -> str:
    summary = result.summary()
    why = _first_divergence_why(result)
    if why and not any("why" in k for k in summary):
        summary["first_divergence_why"] = why
    stopped = f'<p class="bad">{_e(partial_words(result.partial))}</p>' if result.partial else ""
    agree = bitexact_words(result)
    if agree is not None:
        summary = _bitexact_summary(summary)
    parts = [
        f'<section id="run-{i}"><h2>{_e(name)}{" (PARTIAL)" if result.partial else ""}</h2>',
        stopped,
        f'<p class="ok bitexact">{_e(agree)}</p>' if agree is not None else "",
        f"<pre>{_e(result.describe())}</pre>",
        "<h3>Summary</h3>",
        _kv_table(summary, row_class={"first_divergence_why": "first"}),
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
        parts += [
            "<h3>Divergence across depth</h3>",
            '<p class="note">Hover a point for its module, class, dtypes of both sides, metrics '
            "and why.</p>",
            figs.embed(
                plots.plot_divergence_by_layer(result, metric, backend="plotly"),
                f"run {i}: {metric} across depth",
            ),
            "<h3>ULP distance histogram</h3>",
            '<p class="note">Every paired output summed; ULPs in the coarser dtype of each pair.'
            "</p>",
            figs.embed(plots.plot_ulp_histogram(result, backend="plotly"), f"run {i}: ULPs"),
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


_NO_DIVERGENCE = "none: the sides agree bit for bit"
"""What a summary's first-divergence fields read for a pair where nothing differs."""


def _bitexact_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The summary with words, not an empty cell, where a field names no divergence."""
    out = dict(summary)
    for key in ("first_divergent_module", "first_non_rounding_divergence"):
        if out.get(key) is None:
            out[key] = _NO_DIVERGENCE if out.get("bitexact_pairs") == out.get("pairs") else "none"
    return out


def _first_divergence_why(result: Result) -> str | None:
    """The `why` of the first divergent row, when the Result's table has that column."""
    first = result.first_divergence()
    if first is None:
        return None
    table = result.table()
    if "why" not in table.columns:
        return None
    why = table["why"].iloc[result.rows.index(first)]
    return why if isinstance(why, str) and why else None


def _overview_section(named: list[tuple[str, Result]], metric: str, figs: _Figures) -> str:
    table = results_table([r for _, r in named])
    # A run without a divergence has no name there (NaN in the frame): say what that means.
    for j, (_, result) in enumerate(named):
        words = _bitexact_summary(result.summary())
        for key in (
            "first_divergent_module",
            "first_non_rounding_divergence",
            "first_divergence_why",
            "first_non_rounding_divergence_why",
        ):
            if key in table.columns and not isinstance(table.at[table.index[j], key], str):
                table[key] = table[key].astype(object)
                table.at[table.index[j], key] = words.get(key) or ""
    table.insert(0, "run", [n for n, _ in named])
    parts = [
        '<section id="overview"><h2>Overview</h2>',
        "<h3>Settings that differ between the runs</h3>",
        _settings_diff(named),
        "<h3>Summary of every run</h3>",
        _df_table(table, "overview-table"),
    ]
    labels = [{r.label() for r in res.rows} for _, res in named]
    if all(labels) and set.intersection(*labels):
        runs = dict(named)
        parts += [
            f"<h3>Overlay: {_e(metric)} across depth</h3>",
            f'<p class="note">The first run ({_e(named[0][0])}) is the baseline; a fix shows as '
            "a drop below its line.</p>",
            figs.embed(plots.plot_overlay(runs, metric, backend="plotly"), f"{metric} overlay"),
        ]
    else:
        parts.append('<p class="note">No overlay: these runs share no module output.</p>')
    parts.append("</section>")
    return "\n".join(parts)


def _settings(result: Result) -> dict[str, Any]:
    """Every setting of one run, flat: the run's meta, then each side's fields by role.

    Sides are named by role ("reference", "candidate") so runs whose sides have other names
    still line up; the side names themselves are rows too.
    """
    side_meta = {key for _, key in _SIDE_META}
    out: dict[str, Any] = {"mode": result.mode}
    for k, v in result.meta.items():
        if k not in _NOT_SETTINGS and not any(k in (f"{m}_a", f"{m}_b") for m in side_meta):
            out[k] = v
    for role, side, suffix in (
        ("reference", result.side_a, "a"),
        ("candidate", result.side_b, "b"),
    ):
        for k, v in side.items():
            out[f"{role}.{k}"] = v
        for label, key in _SIDE_META:
            if f"{key}_{suffix}" in result.meta:
                out[f"{role}.{label}"] = result.meta[f"{key}_{suffix}"]
    return out


def _settings_diff(named: list[tuple[str, Result]]) -> str:
    """Settings x runs: the rows that differ first (highlighted), the rest folded away."""
    per_run = [_settings(r) for _, r in named]
    keys = list(dict.fromkeys(k for s in per_run for k in s))
    differ, same = [], []
    for key in keys:
        values = [s.get(key) for s in per_run]
        canon = {json.dumps(v, sort_keys=True, default=str) for v in values}
        row = f"<td>{_e(key)}</td>{''.join(_cell(v) for v in values)}"
        if len(canon) > 1:
            differ.append(f'<tr class="diff">{row}</tr>')
        else:
            same.append(f"<tr>{row}</tr>")
    head = "<tr><th>setting</th>" + "".join(f"<th>{_e(n)}</th>" for n, _ in named) + "</tr>"
    if differ:
        shown = (
            f'<table class="settings" id="settings-diff"><thead>{head}</thead>'
            f"<tbody>{''.join(differ)}</tbody></table>"
        )
    else:
        shown = '<p class="note">None: every run has the same settings.</p>'
    return (
        f"{shown}<details><summary>{len(same)} settings the same in every run</summary>"
        f'<table class="settings"><thead>{head}</thead><tbody>{"".join(same)}</tbody></table>'
        "</details>"
    )


def _comparison_section(cmp: BaselineComparison, figs: _Figures) -> str:
    s = cmp.summary()
    verdict = (
        '<span class="ok">OK: nothing got worse</span>'
        if s["ok"]
        else f'<span class="bad">REGRESSED: {s["worse"]} worse, {s["missing"]} missing</span>'
    )
    runs = {f"baseline {cmp.baseline_name}": cmp.baseline, "this run": cmp.candidate}
    stopped = [
        f'<p class="bad">{_e(what)}: {_e(partial_words(r.partial))}</p>'
        for what, r in runs.items()
        if r.partial
    ]
    parts = [
        '<section id="baseline"><h2>Baseline comparison</h2>',
        f"<p>{verdict} (baseline {_e(cmp.baseline_name)}; {_e(s['rule'])} on "
        f"{_e(cmp.metric)}).</p>",
        *stopped,
        _kv_table(s),
        figs.embed(plots.plot_overlay(runs, cmp.metric, backend="plotly"), "baseline overlay"),
    ]
    for status in ("worse", "improved", "new", "missing"):
        rows = cmp.rows(status)
        parts.append(f"<h3>{status.capitalize()} ({len(rows)})</h3>")
        parts.append(_df_table(rows, f"baseline-{status}", row_class="status") if len(rows) else "")
    parts.append("</section>")
    return "\n".join(parts)


def _trajectory_section(traj: Any, name: str, i: int, figs: _Figures) -> str:
    df = traj.per_step()
    parts = [f'<section id="trajectory-{i}"><h2>{_e(name)}</h2>']
    describe = getattr(traj, "describe", None)
    if callable(describe):
        parts.append(f"<pre>{_e(describe())}</pre>")
    if {"step", "ratio_p01", "ratio_p50", "ratio_p99"} <= set(df.columns):
        parts += [
            "<h3>Ratio drift per step</h3>",
            figs.embed(plots.plot_ratio_drift(traj), f"{name}: ratio drift"),
        ]
    if callable(getattr(traj, "per_sample", None)) and "ratio" in traj.per_sample().columns:
        parts += [
            "<h3>Ratio distribution</h3>",
            figs.embed(plots.plot_ratio_histogram(traj), f"{name}: ratio histogram"),
        ]
    captures = getattr(traj, "captures", None) or {}
    if captures and all(isinstance(r, Result) and r.rows for r in captures.values()):
        parts += [
            "<h3>Steps x layers (rel_max of the captured steps)</h3>",
            figs.embed(plots.plot_steps_by_layers(captures), f"{name}: steps x layers"),
        ]
    parts += [f"<h3>Per step ({len(df)})</h3>", _df_table(df, f"trajectory-{i}-steps")]
    parts.append("</section>")
    return "\n".join(parts)


# ---- HTML pieces --------------------------------------------------------------------------


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


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


def _cell(value: Any, *, cls: str = "") -> str:
    import numpy as np

    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, int | float) and not isinstance(value, bool):
        # data-v is what the sort reads; JavaScript's parseFloat spells infinity "Infinity".
        key = ("Infinity" if value > 0 else "-Infinity") if math.isinf(value) else repr(value)
        return f'<td class="num" data-v="{key}">{_e(_fmt(value))}</td>'
    return f'<td class="{cls}">{_e(_fmt(value))}</td>' if cls else f"<td>{_e(_fmt(value))}</td>"


def _kv_table(data: Mapping[str, Any], *, row_class: Mapping[str, str] | None = None) -> str:
    rows = []
    for k, v in data.items():
        cls = (row_class or {}).get(k)
        attr = f' class="{cls}"' if cls else ""
        rows.append(f"<tr{attr}><th>{_e(k)}</th>{_cell(v)}</tr>")
    return f"<table>{''.join(rows)}</table>"


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
    why_attr = ' class="why"'
    head = "".join(
        f'<th onclick="sortTable(this)"{why_attr if c == "why" else ""}>{_e(c)}</th>' for c in cols
    )
    rows = []
    for row, rec in zip(result.rows, table[cols].itertuples(index=False), strict=True):
        cls = "first" if first is not None and row.order == first.order else ""
        cls = cls or ("exact" if not row.diverges else "")
        cells = "".join(
            _cell(v, cls="why" if c == "why" else "") for c, v in zip(cols, rec, strict=True)
        )
        rows.append(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
    return (
        f'<input class="filter" placeholder="filter rows (module, class, dtype, why)" '
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

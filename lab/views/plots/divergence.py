"""Divergence figures from a Result (a saved result.json is enough).

Every plot comes in both backends through one argument: `backend="plotly"` (the default: an
interactive go.Figure whose hover names the module, its class, both sides' dtypes and
parameter dtypes, the metrics and the row's `why`) or `backend="matplotlib"` (a static Figure
for reviews). A plotly figure made here carries its matplotlib twin, drawn only when a static
image is needed:

    plot_divergence_by_layer(result, metric)          one run across depth, by module kind
                                                      (or block), x axis labelled by block
    plot_steps_by_layers(results_per_step, metric)    steps x module outputs heatmap
    plot_ulp_histogram(result, modules=None)          ULP distance counts, summed or per module
    plot_overlay([baseline, candidate], metric)       the same metric across depth for each run

`plot_divergence_by_layer_plotly` is `plot_divergence_by_layer(..., backend="plotly")` under
the name issue 6 gives it. Every figure keeps the Result's side order: the first side is the
reference, the second the candidate, and axis labels say which is which. A pair with nothing to
debug says so in words (`bitexact_words`), on the figure as in the panel and the report.
"""

from __future__ import annotations

import difflib
import functools
import html
import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lab.pairing.capture import ROOT
from lab.views.plots._show import Backend, _pyplot, attach_static_twin, check_backend

if TYPE_CHECKING:
    import pandas as pd

    from lab.pairing.result import Result


# Floor for log-scale plots: a bit-exact row sits on it instead of vanishing from the axis.
_FLOOR = 1e-12
# Hover lines shown for every module output, after the plotted metric.
_HOVER_METRICS: tuple[str, ...] = ("max_abs_diff", "rel_max", "max_ulp", "bitexact_frac")


def module_kind(module_class: str) -> str:
    """Coarse kind of a module class, for colouring: norm, attention, linear, ... or other."""
    name = module_class.lower()
    for kind, keys in (
        ("norm", ("norm",)),
        ("attention", ("attention", "attn")),
        ("embedding", ("embed", "rope", "timestep", "pos")),
        ("linear", ("linear", "conv")),
        ("feedforward", ("feedforward", "mlp", "gelu", "swiglu", "silu")),
        ("block", ("block", "layer")),
    ):
        if any(k in name for k in keys):
            return kind
    return "other"


# ---- shared helpers ---------------------------------------------------------------------


def _labelled_table(
    result: Result, metric: str, where: str, table: pd.DataFrame | None = None
) -> pd.DataFrame:
    """`result.table()` plus `label`, `kind`, `block` and `params` columns, checking `metric`.

    `params` is the hover line for parameter dtypes of both sides (see `_param_dtypes`).
    `table`: `result.table()` when the caller has it already (the panel computes it once a
    run); it is copied, never changed.

    Raises:
        ValueError: For a Result without rows or a metric that is not a numeric column.
    """
    table = result.table() if table is None else table.copy()
    if not len(table):
        raise ValueError(f"{where}: the Result has no paired rows to plot.")
    if metric not in table.columns or table[metric].dtype.kind not in "fiub":
        numeric = [c for c in table.columns if table[c].dtype.kind in "fiu"]
        close = difflib.get_close_matches(metric, numeric, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: unknown metric {metric!r}.{hint} Choose from {numeric}.")
    table["label"] = [r.label() for r in result.rows]
    table["kind"] = table["module_class"].map(module_kind)
    table["block"] = table["module"].map(block_of)
    table["params"] = _param_dtypes(result, table)
    return table


def block_of(module: str) -> str:
    """The block a module path belongs to: its path up to the first numbered component.

    "transformer_blocks.3.attn.to_q" -> "transformer_blocks.3"; a module outside any numbered
    container is its own top-level module ("norm_out.linear" -> "norm_out"); the model itself
    is ROOT.
    """
    if module == ROOT:
        return ROOT
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def bitexact_words(result: Result) -> str | None:
    """The sentence for a pair with nothing to debug, or None when the sides differ.

    "These sides agree bit for bit: all 147 paired outputs are bit-exact." when every
    paired output is; "The model outputs agree bit for bit; 3 of 150 paired outputs inside
    differ (first: x), ..." when only internal ones differ (the difference is rounded away or
    cancels before the output). A partial Result (a forward that stopped) says "so far".
    """
    rows = result.rows
    if not rows:
        return None
    differ = [r for r in rows if r.diverges]
    so_far = " so far (the forward stopped part-way)" if result.partial else ""
    if not differ:
        return (
            f"These sides agree bit for bit: all {len(rows)} paired outputs are bit-exact{so_far}."
        )
    roots = result.root_rows()
    if roots and not any(r.diverges for r in roots):
        verb = "differs" if len(differ) == 1 else "differ"
        return (
            f"The model outputs agree bit for bit; {len(differ)} of {len(rows)} paired outputs "
            f"inside {verb} (first: {differ[0].label()}), and the difference is rounded away or "
            f"cancels before the output{so_far}."
        )
    return None


def _param_dtypes(result: Result, table: pd.DataFrame) -> list[str]:
    """Per row: "params: <reference> (ref) / <candidate> (cand)" of the row's module.

    Counts that module's own parameters (its submodules' included); "" when it holds none or
    none is known. Read from per-row `param_dtypes_a/_b` table columns when a Result has
    them, else from the pair's weight plans (`result.flow`: every parameter's dtype on each
    side), else from `meta["param_dtypes_a/_b"]` when those map parameter name -> dtype. A
    saved result.json keeps only dtype -> count for the whole model there, which says nothing
    about one module: no line then (the report's sides table shows those counts).
    """
    if "param_dtypes_a" in table.columns and "param_dtypes_b" in table.columns:
        return [
            _params_line(_dtype_counts_text(a), _dtype_counts_text(b))
            for a, b in zip(table["param_dtypes_a"], table["param_dtypes_b"], strict=True)
        ]
    flow = getattr(result, "flow", None)
    plan_a, plan_b = getattr(flow, "plan_a", None), getattr(flow, "plan_b", None)
    if plan_a is not None and plan_b is not None:
        from lab.base.dtypes import dtype_name

        names_a = {n: dtype_name(d) for n, d in plan_a.param_dtypes.items()}
        names_b = {n: dtype_name(d) for n, d in plan_b.param_dtypes.items()}
    else:
        names_a = result.meta.get("param_dtypes_a")
        names_b = result.meta.get("param_dtypes_b")
        if not isinstance(names_a, Mapping) or not isinstance(names_b, Mapping):
            return [""] * len(table)
        if any(isinstance(v, int) for v in (*names_a.values(), *names_b.values())):
            return [""] * len(table)  # dtype -> count of the whole model
    own_a, own_b = _per_module_counts(names_a), _per_module_counts(names_b)
    return [
        _params_line(
            _dtype_counts_text(own_a.get(module, {})), _dtype_counts_text(own_b.get(module, {}))
        )
        for module in table["module"]
    ]


def _per_module_counts(names: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Module path -> dtype -> how many parameters it holds (recursively), ROOT for all.

    One pass over the names, each counted at every module above it: a full-size model has
    ~1000 parameters and ~1000 rows, which a prefix filter per row would make 10^6 checks.
    """
    out: dict[str, dict[str, int]] = {}
    for name, dtype in names.items():
        parts = name.split(".")[:-1]
        for module in (ROOT, *(".".join(parts[: i + 1]) for i in range(len(parts)))):
            counts = out.setdefault(module, {})
            counts[dtype] = counts.get(dtype, 0) + 1
    return out


def _dtype_counts_text(value: Any) -> str:
    """Text like `bf16 x12, fp32 x2` from dtype -> count, name -> dtype, or a string."""
    if isinstance(value, str) or value is None:
        return value or ""
    if not isinstance(value, Mapping):
        return str(value)
    counts: dict[str, int] = {}
    for k, v in value.items():
        dtype, n = (str(k), int(v)) if isinstance(v, int) else (str(v), 1)
        counts[dtype] = counts.get(dtype, 0) + n
    return ", ".join(f"{d} x{n}" for d, n in sorted(counts.items()))


def _params_line(a: str, b: str) -> str:
    if not a and not b:
        return ""
    return f"params: {a or 'none'} (ref) / {b or 'none'} (cand)"


def _why_text(row: Any) -> str:
    """The row's `why` (a table column helper "why" adds), wrapped for a hover; "" without."""
    why = getattr(row, "why", None)
    if not isinstance(why, str) or not why:
        return ""
    return "why: " + "<br>  ".join(textwrap.wrap(html.escape(why), 70))


def hover_texts(result: Result, metric: str = "rel_max") -> list[str]:
    """The plotly hover text of every row of `result`, in row order (HTML with <br>).

    Each names the output (`module[:output][#call]`), its class and kind, both sides' dtypes
    and shape, both sides' parameter dtypes when the Result records them, `metric` and the
    other headline metrics, and the row's `why` when the table has that column.

    Raises:
        ValueError: For a Result without rows or an unknown metric.
    """
    return _hover_lines(_labelled_table(result, metric, "hover_texts"), metric)


def _hover_lines(table: pd.DataFrame, metric: str) -> list[str]:
    """Per row: label, class, dtypes (reference / candidate), shape, params, metrics, why."""
    texts = []
    for row in table.itertuples(index=False):
        lines = [
            f"<b>{html.escape(row.label)}</b>",
            f"class: {_text(row.module_class)} ({_text(row.kind)})",
            f"dtype: {_text(row.dtype_a)} (ref) / {_text(row.dtype_b)} (cand), shape {row.shape}",
        ]
        block = getattr(row, "block", None)
        if block and block != row.module:
            lines.insert(2, f"block: {_text(block)}")
        if row.params:
            lines.append(_text(row.params))
        lines.append(f"{metric}: {_fmt(getattr(row, metric))}")
        lines += [f"{m}: {_fmt(getattr(row, m))}" for m in _HOVER_METRICS if m != metric]
        if why := _why_text(row):
            lines.append(why)
        texts.append("<br>".join(lines))
    return texts


def _text(value: Any) -> str:
    """A value escaped as plotly text, so that it reads as written.

    Plotly reads tags and entities in hovers, titles, legends and ticks: a name holding `<b>`
    or `<br>` would be drawn as markup.
    """
    return html.escape(str(value))


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float):
        v = float(value)
        return f"{v:g}" if v == 0 or math.isnan(v) or v.is_integer() else f"{v:.3e}"
    return str(value)


def _title(result: Result) -> str:
    meta = result.meta
    return (
        f"{meta.get('family', 'model')} [{meta.get('preset', '?')}], {result.mode}: "
        f"{result.side_a.get('name')} (reference) vs {result.side_b.get('name')}"
    )


def _metric_axis(result: Result, metric: str) -> str:
    return f"{metric} ({result.side_b.get('name')} vs {result.side_a.get('name')})"


def _kind_colours(kinds: Sequence[str]) -> dict[str, str]:
    """The same kind gets the same colour in both backends (matplotlib's tab10 hex codes)."""
    tab10 = (
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
        "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    )  # fmt: skip
    return {k: tab10[i % 10] for i, k in enumerate(sorted(set(kinds)))}


# ---- divergence across depth ------------------------------------------------------------


COLOR_BY: tuple[str, ...] = ("kind", "block")
"""What `plot_divergence_by_layer` colours points by: module kind, or the block they are in."""


def plot_divergence_by_layer(
    result: Result,
    metric: str = "rel_max",
    *,
    title: str | None = None,
    backend: Backend = "plotly",
    color_by: str = "kind",
) -> Any:
    """Divergence of every paired output across depth, log scale, coloured by module kind.

    The x axis is forward completion order, labelled by block (each numbered block's outputs
    sit on a shaded band, its name under the axis); the first divergent module is marked.
    Rows at parity are drawn on a floor line (labelled) rather than dropped from the log axis;
    a pair with nothing to debug says so in words (`bitexact_words`).

    Args:
        result: A Result (or `Result.from_json(...)`).
        metric: Any numeric column of `result.table()` (rel_max, max_abs_diff, max_ulp, ...).
        title: Figure title; defaults to family, preset and the two sides.
        backend: "plotly" (a go.Figure, one trace per module kind or block) or "matplotlib".
        color_by: "kind" (norm, attention, linear, ...) or "block" (one colour per block).

    Raises:
        ValueError: For a metric that is not a numeric table column, an unknown backend or
            an unknown `color_by`.
    """
    where = "plot_divergence_by_layer"
    check_backend(backend, where)
    if backend == "plotly":
        import plotly.graph_objects as go

        spec = divergence_spec(result, metric, title=title, color_by=color_by)
        fig = go.Figure(spec)
        return attach_static_twin(
            fig,
            lambda: plot_divergence_by_layer(
                result, metric, title=title, backend="matplotlib", color_by=color_by
            ),
        )
    d = _DepthPlot(result, metric, title, color_by, where)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.6), constrained_layout=True)
    for i, (start, stop, _) in enumerate(d.bands):
        ax.axvspan(start - 0.5, stop + 0.5, color="0.93" if i % 2 == 0 else "0.97", lw=0, zorder=0)
    for name, sel in d.groups:
        ax.scatter(sel, d.values.iloc[sel], s=14, color=d.colours[name], label=name, zorder=2)
    ax.set_yscale("log")
    ax.axhline(_FLOOR, color="0.8", lw=0.8, ls=":")
    ax.text(
        0, _FLOOR * 1.6, d.floor_words, fontsize=10 if d.flat else 7,
        color="#197319" if d.flat else "0.5",
    )  # fmt: skip
    if d.words and not d.flat:
        ax.text(
            0.99, 0.97, d.words_short, transform=ax.transAxes, fontsize=9, color="#197319",
            va="top", ha="right", bbox={"fc": "white", "ec": "none", "alpha": 0.85},
        )  # fmt: skip
    if d.flat:
        ax.set_yticks([_FLOOR], ["0"])
        ax.minorticks_off()
    ax.set_xticks(d.tickvals, d.ticktext, rotation=40, ha="right", fontsize=7)
    if d.first_pos is not None:
        ax.axvline(d.first_pos, color="crimson", lw=1, ls="--")
        at = d.values.iloc[d.first_pos]
        # Below the point when it is near the top, where a label above would cross the title.
        below = at >= d.values.max() / 10
        ax.annotate(
            f"first divergence: {d.first_label}",
            (d.first_pos, at),
            xytext=(8, -14 if below else 12),
            va="top" if below else "baseline",
            textcoords="offset points",
            color="crimson",
            fontsize=8,
            # Over the points it names (a divergent model sits at 1e-3..1e-2): legible on them.
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "crimson", "lw": 0.5,
                  "alpha": 0.85},
        )  # fmt: skip
    ax.set_xlabel(d.xlabel)
    ax.set_ylabel(_metric_axis(result, metric))
    ax.set_title(d.title)
    fig.legend(fontsize=7, loc="outside right upper", title=f"module {color_by}", title_fontsize=7)
    ax.grid(alpha=0.3, which="both", axis="y")
    return fig


def divergence_spec(
    result: Result,
    metric: str = "rel_max",
    *,
    title: str | None = None,
    color_by: str = "kind",
    table: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """`plot_divergence_by_layer`'s plotly figure as plain JSON data (`data`, `layout`).

    What the control panel sends to the browser: building a go.Figure validates every value
    (a third of a second for a tiny model's 150 points), and this is the same figure without
    that. `table`: `result.table()` when the caller has it already.

    Raises:
        ValueError: As `plot_divergence_by_layer`.
    """
    d = _DepthPlot(result, metric, title, color_by, "plot_divergence_by_layer", table)
    hover = _hover_lines(d.table, metric)
    values = [float(v) for v in d.values]
    data = [
        {
            "type": "scatter",
            "x": [int(i) for i in sel],
            "y": [values[i] for i in sel],
            "mode": "markers",
            "name": _text(name),
            "marker": {"color": d.colours[name], "size": 7},
            "text": [hover[i] for i in sel],
            "hovertemplate": "%{text}<extra></extra>",
        }
        for name, sel in d.groups
    ]
    shapes: list[dict[str, Any]] = [
        {"type": "rect", "xref": "x", "yref": "paper", "x0": start - 0.5, "x1": stop + 0.5,
         "y0": 0, "y1": 1, "fillcolor": "#eef1f5" if i % 2 == 0 else "#f7f8fa",
         "line": {"width": 0}, "layer": "below"}
        for i, (start, stop, _) in enumerate(d.bands)
    ]  # fmt: skip
    shapes.append(
        {"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": _FLOOR,
         "y1": _FLOOR, "line": {"color": "#bbb", "dash": "dot", "width": 1}}
    )  # fmt: skip
    annotations: list[dict[str, Any]] = [
        {"x": 0, "y": math.log10(_FLOOR), "text": _text(d.floor_words), "showarrow": False,
         "yshift": 24 if d.flat else 8, "xanchor": "left", "font": {"size": 13 if d.flat else 9,
         "color": "#197319" if d.flat else "#888"}}
    ]  # fmt: skip
    if d.words and not d.flat:
        annotations.append(
            {"xref": "paper", "yref": "paper", "x": 0.99, "y": 0.99, "xanchor": "right",
             "yanchor": "top", "showarrow": False, "text": _text(d.words_short),
             "font": {"size": 11, "color": "#197319"}, "bgcolor": "rgba(255,255,255,0.85)"}
        )  # fmt: skip
    yaxis: dict[str, Any] = {
        "type": "log",
        "title": {"text": _text(_metric_axis(result, metric))},
        "exponentformat": "e",
    }
    if d.flat:
        # Every point and the floor line at one value: plotly.js's autorange collapses to
        # zero height there and draws no annotation, so the range is a decade either side.
        floor = math.log10(_FLOOR)
        yaxis.update(tickvals=[_FLOOR], ticktext=["0"], range=[floor - 1, floor + 1])
    if d.first_pos is not None:
        shapes.append(
            {"type": "line", "xref": "x", "yref": "paper", "x0": d.first_pos, "x1": d.first_pos,
             "y0": 0, "y1": 1, "line": {"color": "crimson", "dash": "dash", "width": 1}}
        )  # fmt: skip
        annotations.append(
            {"x": d.first_pos, "y": math.log10(values[d.first_pos]),
             "text": f"first divergence: {_text(d.first_label)}",
             "font": {"color": "crimson", "size": 10}, "arrowcolor": "crimson", "ax": 40,
             "ay": -30, "bgcolor": "rgba(255,255,255,0.85)"}
        )  # fmt: skip
    layout = {
        "title": {"text": _text(d.title)},
        "template": _plotly_white(),
        "height": 460,
        "hovermode": "closest",
        "legend": {"title": {"text": f"module {color_by}"}},
        "margin": {"b": 110},
        "shapes": shapes,
        "annotations": annotations,
        "xaxis": {
            "title": {"text": d.xlabel},
            "tickvals": d.tickvals,
            "ticktext": [_text(t) for t in d.ticktext],
            "tickangle": -40,
            "tickfont": {"size": 9},
            "range": [-1, len(values)],
            "zeroline": False,
        },
        "yaxis": yaxis,
    }
    return {"data": data, "layout": layout}


@functools.cache
def _plotly_white() -> dict[str, Any]:
    """The "plotly_white" template as JSON data, read once.

    A template name would be resolved by the browser's plotly.js, which knows none.
    """
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


class _DepthPlot:
    """What both backends of `plot_divergence_by_layer` draw, computed once."""

    _MAX_TICKS = 30
    """At most this many block labels fit under the axis."""

    def __init__(
        self,
        result: Result,
        metric: str,
        title: str | None,
        color_by: str,
        where: str,
        table: pd.DataFrame | None = None,
    ) -> None:
        if color_by not in COLOR_BY:
            close = difflib.get_close_matches(str(color_by), COLOR_BY, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{where}: unknown color_by {color_by!r}.{hint} Choose from {list(COLOR_BY)}."
            )
        import numpy as np

        self.table = table = _labelled_table(result, metric, where, table)
        self.values = table[metric].astype(float).clip(lower=_FLOOR)
        column = table[color_by]
        # Kinds sorted by name (the same colour per kind in every plot); blocks in depth order.
        names = sorted(set(column)) if color_by == "kind" else list(dict.fromkeys(column))
        self.colours = _kind_colours(names) if color_by == "kind" else _block_colours(names)
        codes = column.to_numpy()
        self.groups = [(name, np.flatnonzero(codes == name)) for name in names]
        first = result.first_divergence()
        self.first_pos = (
            int((table["order"] == first.order).to_numpy().argmax()) if first is not None else None
        )
        self.first_label = first.label() if first is not None else ""
        self.title = title or _title(result)
        # Every row at the floor: say so, and no decades of ticks around a value nobody measured.
        self.flat = bool(len(self.values)) and bool((self.values <= _FLOOR).all())
        self.words = bitexact_words(result)
        self.words_short = (self.words or "").split(", and the difference")[0]
        self.floor_words = self.words if self.flat and self.words else "bit-exact / zero"
        # Consecutive rows of one block: a band per numbered block, a label per segment.
        segments: list[tuple[int, int, str]] = []
        for i, block in enumerate(table["block"]):
            if segments and segments[-1][2] == block:
                segments[-1] = (segments[-1][0], i, block)
            else:
                segments.append((i, i, block))
        self.bands = [s for s in segments if _numbered(s[2])]
        # A label per segment, skipping one that would sit on the last one shown (a few
        # one-output embedders in a row; a full model's 60 blocks).
        gap = len(table) / self._MAX_TICKS
        self.tickvals: list[float] = []
        self.ticktext: list[str] = []
        for start, stop, block in segments:
            middle = (start + stop) / 2
            if not self.tickvals or middle - self.tickvals[-1] >= gap:
                self.tickvals.append(middle)
                self.ticktext.append(block)
        self.xlabel = "module output, forward completion order (labelled by block)"


def _numbered(block: str) -> bool:
    return block.rpartition(".")[2].isdigit()


def _block_colours(blocks: Sequence[str]) -> dict[str, str]:
    """Blocks of one container share a hue ramp by depth; other modules get tab10 colours."""
    import matplotlib

    out: dict[str, str] = {}
    containers = list(dict.fromkeys(b.rpartition(".")[0] for b in blocks if _numbered(b)))
    ramps = ("Blues", "Oranges", "Greens", "Purples", "Reds")
    for c, container in enumerate(containers):
        members = [b for b in blocks if _numbered(b) and b.rpartition(".")[0] == container]
        cmap = matplotlib.colormaps[ramps[c % len(ramps)]]
        for k, block in enumerate(members):
            out[block] = matplotlib.colors.to_hex(cmap(0.45 + 0.5 * k / max(1, len(members) - 1)))
    rest = [b for b in blocks if b not in out]
    out.update(_kind_colours(rest))
    return out


def plot_divergence_by_layer_plotly(
    result: Result, metric: str = "rel_max", *, title: str | None = None
) -> Any:
    """`plot_divergence_by_layer(result, metric, backend="plotly")`: a plotly go.Figure.

    Raises:
        ValueError: For a metric that is not a numeric table column.
    """
    return plot_divergence_by_layer(result, metric, title=title, backend="plotly")


# ---- steps x layers ---------------------------------------------------------------------


def plot_steps_by_layers(
    results: Sequence[Result] | Mapping[Any, Result],
    metric: str = "rel_max",
    *,
    modules: Sequence[str] | str | None = None,
    title: str | None = None,
    backend: Backend = "plotly",
) -> Any:
    """Heatmap of one metric, module outputs (rows) x denoising steps (columns), log colour.

    Module outputs are matched across steps by label (`module[:output][#call]`) and kept in
    the first step's forward order; one missing at a step is left blank (grey), a bit-exact
    one gets the colour below the scale (white), so zero is never confused with small.

    Args:
        results: One Result per step: a list (steps 0, 1, ...) or a mapping step -> Result,
            such as `Trajectory.captures`.
        metric: A numeric column of `Result.table()`.
        modules: Keep only these module paths (or labels); None keeps every paired output.
        title: Figure title; defaults to the first Result's family, preset and sides.
        backend: "plotly" or "matplotlib".

    Raises:
        ValueError: No Result, an unknown metric or backend, or a module that matches nothing.
    """
    import numpy as np

    where = "plot_steps_by_layers"
    check_backend(backend, where)
    items = list(results.items()) if isinstance(results, Mapping) else list(enumerate(results))
    if not items:
        raise ValueError(f"{where}: no Results given; pass one Result per step.")
    if isinstance(results, Mapping):
        items.sort(key=lambda kv: kv[0])
    tables = [(step, _labelled_table(r, metric, where)) for step, r in items]
    labels: list[str] = []
    # Per step: label -> hover of that step's row (class, dtypes, params, metrics, why).
    hover_at: list[dict[str, str]] = []
    seen: set[str] = set()
    for _, t in tables:
        hover_at.append(dict(zip(t["label"], _hover_lines(t, metric), strict=True)))
        labels += [lab_ for lab_ in t["label"] if lab_ not in seen]
        seen.update(t["label"])
    if modules is not None:
        module_of = {lab_: lab_.split(":")[0].split("#")[0] for lab_ in labels}
        unknown = [m for m in modules if m not in labels and m not in module_of.values()]
        if unknown:
            close = difflib.get_close_matches(unknown[0], labels, n=3)
            raise ValueError(
                f"{where}: modules {unknown} match no paired output. Nearest: {close}."
            )
        labels = [lab_ for lab_ in labels if lab_ in modules or module_of[lab_] in modules]
    col = {lab_: j for j, lab_ in enumerate(labels)}
    z = np.full((len(tables), len(labels)), np.nan)
    for i, (_, t) in enumerate(tables):
        for lab_, v in zip(t["label"], t[metric].astype(float), strict=True):
            if lab_ in col:
                z[i, col[lab_]] = v
    positive = z[np.isfinite(z) & (z > 0)]
    vmax = float(positive.max()) if positive.size else 1.0
    # One decade under the smallest non-zero value: bit-exact cells sit below the scale.
    vmin = float(positive.min()) / 10 if positive.size else vmax / 10
    steps = [str(step) for step, _ in tables]
    title = title or f"{metric} per step: {_title(items[0][1])}"
    if backend == "plotly":
        import plotly.graph_objects as go

        hover = [
            [
                f"step: {_text(steps[i])}<br>"
                + hover_at[i].get(lab_, f"<b>{html.escape(lab_)}</b><br>missing at this step")
                for lab_ in labels
            ]
            for i in range(len(tables))
        ]
        zmin = math.log10(vmin) - 0.5
        zmax = math.log10(vmax) if vmax > vmin else math.log10(vmin) + 1
        zlog = np.where(z > 0, np.log10(np.clip(z, vmin, None)), np.where(z == 0, zmin, np.nan))
        cut = 0.5 / (zmax - zmin)
        colorscale = [[0.0, "white"], [cut * 0.999, "white"]] + [
            [cut + (1 - cut) * k / 8, c]
            for k, c in enumerate(
                ("#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c",
                 "#28ae80", "#5ec962", "#addc30", "#fde725")
            )
        ]  # fmt: skip
        ticks = list(range(math.ceil(zmin + 0.5), math.floor(zmax) + 1))
        fig = go.Figure(
            go.Heatmap(
                z=zlog.T.tolist(),
                x=[_text(step) for step in steps],
                y=[_text(label) for label in labels],
                text=[list(col) for col in zip(*hover, strict=True)],
                hovertemplate="%{text}<extra></extra>",
                zmin=zmin,
                zmax=zmax,
                colorscale=colorscale,
                colorbar={
                    "title": metric,
                    "tickvals": ticks,
                    "ticktext": [f"1e{t}" for t in ticks],
                },
            )
        )
        fig.update_yaxes(
            title="module output, forward order", tickfont={"size": 8}, autorange="reversed"
        )
        fig.update_xaxes(title="step", type="category")
        fig.update_layout(
            title=_text(title), template="plotly_white", height=160 + 14 * len(labels)
        )
        return attach_static_twin(
            fig,
            lambda: plot_steps_by_layers(
                results, metric, modules=modules, title=title, backend="matplotlib"
            ),
        )

    from matplotlib.colors import LogNorm

    plt = _pyplot()
    fig, ax = plt.subplots(
        figsize=(min(14.0, 4.5 + 0.4 * len(steps)), 1.5 + 0.13 * len(labels)),
        constrained_layout=True,
    )
    cmap = plt.get_cmap("viridis").with_extremes(under="white", bad="0.85")
    shown = np.where(z == 0, vmin / 2, z).T
    mesh = ax.pcolormesh(
        np.ma.masked_invalid(shown), cmap=cmap, norm=LogNorm(vmin=vmin, vmax=max(vmax, vmin * 10))
    )
    fig.colorbar(mesh, ax=ax, label=f"{metric} (white: bit-exact, grey: missing)", extend="min")
    ax.set_yticks([j + 0.5 for j in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xticks([i + 0.5 for i in range(len(steps))])
    ax.set_xticklabels(steps)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=9)
    return fig


# ---- ULP histogram ----------------------------------------------------------------------


def plot_ulp_histogram(
    result: Result,
    modules: Sequence[str] | None = None,
    *,
    title: str | None = None,
    backend: Backend = "plotly",
) -> Any:
    """Element counts per ULP-distance bin (0, 1, 2-3, 4-15, ...), log count axis.

    ULPs are counted in the coarser dtype of each pair (see `lab.pairing.metrics.ulp_distance`), so
    a bf16-vs-fp32 pair is measured in bf16 steps.

    Args:
        result: A Result (or `Result.from_json(...)`).
        modules: None sums every paired output into one set of bars; otherwise one set of
            bars per entry, an entry being a module path (its outputs and calls summed) or a
            label `module[:output][#call]` (one paired output).
        title: Figure title; defaults to family, preset and the two sides.
        backend: "plotly" or "matplotlib".

    Raises:
        ValueError: No rows, an unknown backend, or a module that matches no paired output.
    """
    import numpy as np

    from lab.pairing.metrics import ULP_BIN_LABELS

    where = "plot_ulp_histogram"
    check_backend(backend, where)
    table = _labelled_table(result, "max_ulp", where)
    hists = np.array([list(h) for h in table["ulp_hist"]], dtype=float)
    groups: list[tuple[str, str, np.ndarray]] = []  # name, hover header, counts per bin
    if modules is None:
        groups.append(
            (f"all {len(table)} paired outputs", f"<b>all {len(table)} paired outputs</b>",
             hists.sum(axis=0))
        )  # fmt: skip
    else:
        # One name is one module (a str would otherwise be read letter by letter).
        for entry in [modules] if isinstance(modules, str) else modules:
            sel = ((table["module"] == entry) | (table["label"] == entry)).to_numpy()
            if not sel.any():
                labels = list(dict.fromkeys(table["label"]))
                close = difflib.get_close_matches(entry, labels, n=3, cutoff=0.3)
                near = f"Nearest: {close}" if close else f"Paired outputs: {labels[:12]}"
                raise ValueError(
                    f"{where}: module {entry!r} matches no paired output. {near} (result.table() "
                    "lists every label)."
                )
            sub = table[sel]
            first = next(sub.itertuples(index=False))
            header = "<br>".join(
                line
                for line in (
                    f"<b>{html.escape(entry)}</b>",
                    f"class: {_text(first.module_class)}",
                    f"dtype: {_text('/'.join(sorted(set(sub['dtype_a']))))} (ref) / "
                    f"{_text('/'.join(sorted(set(sub['dtype_b']))))} (cand), {len(sub)} output(s)",
                    _text(first.params) if first.params else "",
                    _why_text(first),
                )
                if line
            )
            groups.append((entry, header, hists[sel].sum(axis=0)))
    title = title or f"ULP distance: {_title(result)}"
    if backend == "plotly":
        import plotly.graph_objects as go

        fig = go.Figure()
        for name, header, counts in groups:
            total = counts.sum() or 1.0
            fig.add_trace(
                go.Bar(
                    x=list(ULP_BIN_LABELS),
                    y=counts.tolist(),
                    name=_text(name),
                    text=[
                        f"{header}<br>ULP bin {b}: {int(c)} elements ({100 * c / total:.2f}%)"
                        for b, c in zip(ULP_BIN_LABELS, counts, strict=True)
                    ],
                    textposition="none",
                    hovertemplate="%{text}<extra></extra>",
                )
            )
        fig.update_yaxes(type="log", title="elements")
        fig.update_xaxes(title="ULP distance, coarser dtype of the pair", type="category")
        fig.update_layout(title=_text(title), template="plotly_white", barmode="group", height=380)
        return attach_static_twin(
            fig, lambda: plot_ulp_histogram(result, modules, title=title, backend="matplotlib")
        )

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8), constrained_layout=True)
    width = 0.8 / len(groups)
    x = np.arange(len(ULP_BIN_LABELS))
    for k, (name, _, counts) in enumerate(groups):
        ax.bar(x + (k - (len(groups) - 1) / 2) * width, counts, width=width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(ULP_BIN_LABELS, fontsize=8)
    ax.set_xlabel("ULP distance, coarser dtype of the pair")
    ax.set_ylabel("elements")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both", axis="y")
    return fig


# ---- overlay of runs --------------------------------------------------------------------


def plot_overlay(
    runs: Sequence[Result] | Mapping[str, Result],
    metric: str = "rel_max",
    *,
    title: str | None = None,
    backend: Backend = "plotly",
) -> Any:
    """The same metric across depth for several runs of one model; the first is the baseline.

    A fix shows as the candidate's line dropping below the baseline's. Module outputs are
    matched by label and placed in the baseline's forward order; outputs only the later runs
    have are appended on the right.

    Args:
        runs: At least two Results: a list (named "baseline", "candidate", "run 2", ...) or a
            mapping name -> Result, such as {"before fix": r0, "after fix": r1}.
        metric: A numeric column of `Result.table()`.
        title: Figure title; defaults to the baseline's family and preset.
        backend: "plotly" (hover gives each run's value and its ratio to the baseline's) or
            "matplotlib".

    Raises:
        ValueError: Fewer than two runs, an unknown metric or backend.
    """
    where = "plot_overlay"
    check_backend(backend, where)
    if isinstance(runs, Mapping):
        named = [(str(k), v) for k, v in runs.items()]
    else:
        default = ["baseline", "candidate"]
        named = [(default[i] if i < 2 else f"run {i}", r) for i, r in enumerate(runs)]
    if len(named) < 2:
        raise ValueError(f"{where}: got {len(named)} run(s); pass a baseline and a candidate.")
    tables = [(name, _labelled_table(r, metric, where)) for name, r in named]
    position: dict[str, int] = {}
    for _, t in tables:
        for lab_ in t["label"]:
            position.setdefault(lab_, len(position))
    base = dict(zip(tables[0][1]["label"], tables[0][1][metric].astype(float), strict=True))
    baseline_result = named[0][1]
    title = title or (
        f"{metric}, {' vs '.join(n for n, _ in named)}: "
        f"{baseline_result.meta.get('family', 'model')} [{baseline_result.meta.get('preset', '?')}]"
    )
    ylabel = _metric_axis(baseline_result, metric)
    if backend == "plotly":
        import plotly.graph_objects as go

        fig = go.Figure()
        for k, (name, t) in enumerate(tables):
            hover = _hover_lines(t, metric)
            if k:
                hover = [
                    f"{h}<br>vs {_text(tables[0][0])}: {_ratio_text(v, base.get(lab_))}"
                    for h, lab_, v in zip(hover, t["label"], t[metric].astype(float), strict=True)
                ]
            fig.add_trace(
                go.Scatter(
                    x=[position[lab_] for lab_ in t["label"]],
                    y=t[metric].astype(float).clip(lower=_FLOOR).tolist(),
                    mode="lines+markers",
                    name=_text(name),
                    line={"width": 1},
                    marker={"size": 5},
                    text=[f"<b>{_text(name)}</b><br>{h}" for h in hover],
                    hovertemplate="%{text}<extra></extra>",
                )
            )
        fig.add_hline(y=_FLOOR, line={"color": "#bbb", "dash": "dot", "width": 1})
        fig.update_yaxes(type="log", title=_text(ylabel), exponentformat="e")
        fig.update_xaxes(title="module output, baseline forward order")
        fig.update_layout(title=_text(title), template="plotly_white", height=420)
        return attach_static_twin(
            fig, lambda: plot_overlay(runs, metric, title=title, backend="matplotlib")
        )

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2), constrained_layout=True)
    for name, t in tables:
        ax.plot(
            [position[lab_] for lab_ in t["label"]],
            t[metric].astype(float).clip(lower=_FLOOR),
            marker="o",
            ms=3,
            lw=0.8,
            label=name,
        )
    ax.set_yscale("log")
    ax.axhline(_FLOOR, color="0.8", lw=0.8, ls=":")
    ax.text(0, _FLOOR * 1.6, "bit-exact / zero", fontsize=7, color="0.5")
    ax.set_xlabel("module output, baseline forward order")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both", axis="y")
    return fig


def _ratio_text(value: float, baseline: float | None) -> str:
    if baseline is None:
        return "not in the baseline"
    if baseline == 0:
        return "same (both zero)" if value == 0 else "was bit-exact"
    return f"x{value / baseline:.3g}"

"""The figure of each pipeline parity check (`lab.checks`): one `plot_check` for all four.

    batch_invariance   max ULP per module output of the sample (forward order), and the model
                       output of every position in the batch
    cfg_batching       max ULP per module output, one series per branch (uncond, cond)
    sigma_parity       sigma and timestep ULPs per step, and the log-prob bias per step
    weight_sync        max ULP per tensor coloured by status, and the count of each status

ULP counts are whole numbers, so a bit-exact row (0 ULP) is drawn on a floor line at 0.5 of a
log axis. A check that does not apply to the family draws its verdict as text.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lab.base.arguments import checked_arguments
from lab.pairing.capture import ROOT
from lab.views.plots._show import Backend, _pyplot, attach_static_twin, check_backend

if TYPE_CHECKING:
    from lab.causes.checks import CheckResult

_FLOOR = 0.5
"""Where 0 ULP sits on the log axis (a nonzero ULP count is >= 1)."""
_STATUS_COLORS: dict[str, str] = {
    "missing": "#d62728", "extra": "#9467bd", "shape": "#8c564b", "differs": "#e377c2",
    "dtype": "#ff7f0e", "rounded": "#1f77b4", "equal": "#2ca02c",
}  # fmt: skip
_BRANCH_COLORS: dict[str, str] = {"uncond": "#ff7f0e", "cond": "#1f77b4"}


@checked_arguments
def plot_check(result: CheckResult, *, backend: Backend = "plotly") -> Any:
    """The figure of one CheckResult (any of the four checks; a saved one read back works).

    Args:
        result: What `lab.checks.batch_invariance`, `cfg_batching`, `sigma_parity` or
            `weight_sync` returned (or `CheckResult.from_json`).
        backend: "plotly" (hover names the module, tensor or step with its numbers) or
            "matplotlib".

    Returns:
        A plotly go.Figure (with its matplotlib twin attached) or a matplotlib Figure.

    Raises:
        ValueError: An unknown backend, or something that is not a CheckResult.
    """
    check_backend(backend, "plot_check")
    check = getattr(result, "check", None)
    if check not in _DRAW:
        raise ValueError(
            f"plot_check: expected a CheckResult of {', '.join(_DRAW)}, got "
            f"{type(result).__name__}" + (f" (check {check!r})" if check else "") + "."
        )
    title = _title(result)
    if not result.applicable or not result.rows:
        return _text_figure(result, title, backend)
    return _DRAW[check](result, title, backend)


def _title(result: CheckResult) -> str:
    m = result.meta
    where = " ".join(str(m[k]) for k in ("family", "preset", "device") if m.get(k))
    side = (m.get("side") or {}).get("name")
    status = "PASS" if result.passed else "FAIL"
    return (
        f"{result.check}{' [' + where + ']' if where else ''}"
        + (f", side {side!r}" if side else "")
        + f": {status}"
    )


def _ulp(values: Sequence[Any]) -> list[float]:
    return [
        _FLOOR if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0 else float(v)
        for v in values
    ]


def _ulp_ticks(top: float, floor_label: str = "0") -> tuple[list[float], list[str]]:
    """Ticks of a ULP log axis that ends at `top`.

    The floor, labelled `floor_label`, then whole decades (each one up to six of them, then
    every other, ...): never matplotlib's 6x10^-1-style minor labels around the floor.
    """
    decades = max(0, math.floor(math.log10(top))) if top >= 1 else 0
    step = max(1, math.ceil(decades / 6))
    # Past three decades the "1" tick would sit on the floor's label: start a step up.
    powers = list(range(0 if decades <= 3 else step, decades + 1, step))
    labels = [f"{10**k:d}" if k <= 3 else f"1e{k}" for k in powers]
    return [_FLOOR, *(10.0**k for k in powers)], [floor_label, *labels]


def _exact_note(raw: Sequence[Any], noun: str, count: int | None = None) -> str | None:
    """The note of an axis whose every raw ULP count is a number and 0, else None.

    E.g. "bit-exact (0 ULP): all 16 outputs". Read before `_ulp` floors the values: NaN, inf
    (no counterpart, another shape) and None sit on the same floor as 0 and must never read as
    bit-exact. `count`: how many `noun`s the values stand for (default: one a value).
    """
    if not raw or not all(isinstance(v, numbers.Real) and v == 0 for v in raw):
        return None
    n = len(raw) if count is None else count
    return f"bit-exact (0 ULP): {'all ' if n > 1 else ''}{n} {noun}{'s' if n > 1 else ''}"


def _ulp_axis_mpl(ax: Any, values: Sequence[float], headroom: float = 2.0,
                  floor_label: str = "0", note: str | None = None) -> None:  # fmt: skip
    """A matplotlib ULP axis over `values` (floored by `_ulp`).

    Log scale, the floor drawn dotted and labelled, decade ticks only, and `note` (from
    `_exact_note`) in the axis: a check with every value bit-exact then reads as one, not as an
    empty axis.
    """
    from matplotlib.ticker import NullLocator

    top = max([_FLOOR * 4, *values]) * headroom
    ax.axhline(_FLOOR, color="grey", lw=0.6, ls=":")
    ax.set_yscale("log")
    ax.set_ylim(_FLOOR / 2, top)
    ticks, labels = _ulp_ticks(top, floor_label)
    ax.set_yticks(ticks, labels)
    ax.yaxis.set_minor_locator(NullLocator())
    if note:
        ax.text(0.5, 0.6, note, transform=ax.transAxes, ha="center", va="center", fontsize=10,
                color="#2ca02c")  # fmt: skip


def _ulp_axis_plotly(
    fig: Any, values: Sequence[float], row: int, col: int, floor_label: str = "0",
    note: str | None = None, **title: str,
) -> None:  # fmt: skip
    """The plotly twin of `_ulp_axis_mpl` for the subplot at (row, col)."""
    top = max([_FLOOR * 4, *values]) * 2
    ticks, labels = _ulp_ticks(top, floor_label)
    fig.update_yaxes(
        type="log", range=[math.log10(_FLOOR / 2), math.log10(top)], tickvals=ticks,
        ticktext=labels, row=row, col=col, **title,
    )  # fmt: skip
    fig.add_hline(y=_FLOOR, line={"color": "#bbb", "dash": "dot", "width": 1}, row=row, col=col)
    if note:
        fig.add_annotation(
            text=note, xref="x domain", yref="y domain",
            x=0.5, y=0.6, showarrow=False, font={"color": "#2ca02c"}, row=row, col=col,
        )  # fmt: skip


def _text_figure(result: CheckResult, title: str, backend: Backend) -> Any:
    text = "\n".join(textwrap.wrap(result.verdict, 90)) or "(no rows)"
    if backend == "plotly":
        import plotly.graph_objects as go

        fig = go.Figure()
        fig.add_annotation(
            text=text.replace("\n", "<br>"), x=0.5, y=0.5, xref="paper", yref="paper",
            showarrow=False, align="left",
        )  # fmt: skip
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        fig.update_layout(title=title + " (n/a)", template="plotly_white", height=260)
        return attach_static_twin(fig, lambda: _text_figure(result, title, "matplotlib"))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 2.6), layout="constrained")
    ax.axis("off")
    ax.text(0.01, 0.5, text, va="center", ha="left", fontsize=9, wrap=True)
    ax.set_title(title + " (n/a)", fontsize=10)
    return fig


# ---- batch_invariance and cfg_batching ------------------------------------------------------


def _module_hover(r: dict[str, Any]) -> str:
    return (
        f"<b>{r['module']}</b>{':' + r['output'] if r.get('output') else ''} "
        f"({r.get('module_class', '')})<br>max_ulp {r['max_ulp']:g}, max_abs_diff "
        f"{r['max_abs_diff']:.3e}<br>rel_max {r['rel_max']:.3e}, bit-exact "
        f"{100 * r['bitexact_frac']:.1f} %<br>{r.get('dtype', '')} {r.get('shape', '')}"
    )


def _draw_modules(
    result: CheckResult, title: str, backend: Backend, series: dict[str, list[dict]],
    side_panel: tuple[str, list[str], list[float], list[float]] | None,
) -> Any:  # fmt: skip
    """Per-module max ULP, one line per series; optionally a bar panel on the right.

    The panel is (title, bar labels, max ULPs, rel_maxes): each bar is labelled with its
    rel_max, since an output's max ULP runs to millions from elements near zero alone.
    """
    if backend == "plotly":
        from plotly.subplots import make_subplots

        cols = 2 if side_panel else 1
        fig = make_subplots(
            rows=1, cols=cols, column_widths=[0.78, 0.22] if side_panel else None,
            subplot_titles=["max ULP per module output (forward order)",
                            side_panel[0] if side_panel else ""][:cols],
        )  # fmt: skip
        for name, rows in series.items():
            fig.add_scatter(
                x=list(range(len(rows))), y=_ulp([r["max_ulp"] for r in rows]),
                mode="lines+markers", name=name, marker={"size": 4},
                line={"width": 1, "color": _BRANCH_COLORS.get(name)},
                text=[_module_hover(r) for r in rows], hovertemplate="%{text}<extra></extra>",
                row=1, col=1,
            )  # fmt: skip
        if side_panel:
            _, labels, values, rel = side_panel
            fig.add_bar(x=labels, y=_ulp(values), name="model output", row=1, col=2,
                        marker={"color": "#7f7f7f"}, text=[_rel_words(v) for v in rel],
                        textposition="auto")  # fmt: skip
            _ulp_axis_plotly(fig, _ulp(values), 1, 2, note=_exact_note(values, "output"))
        raw = [r["max_ulp"] for rows in series.values() for r in rows]
        _ulp_axis_plotly(fig, _ulp(raw), 1, 1, note=_exact_note(raw, "output"),
                         title="max ULP (dotted line = bit-exact)")  # fmt: skip
        fig.update_xaxes(title="module output", row=1, col=1)
        fig.update_layout(title=title, template="plotly_white", height=420, hovermode="closest")
        return attach_static_twin(
            fig, lambda: _draw_modules(result, title, "matplotlib", series, side_panel)
        )
    plt = _pyplot()
    if side_panel:
        fig, (ax, side_ax) = plt.subplots(
            1, 2, figsize=(12, 4.2), layout="constrained", gridspec_kw={"width_ratios": [4, 1]}
        )
    else:
        fig, ax = plt.subplots(figsize=(11, 4.2), layout="constrained")
    plotted = []
    for name, rows in series.items():
        ys = _ulp([r["max_ulp"] for r in rows])
        plotted += ys
        ax.plot(range(len(rows)), ys, marker="o", ms=3, lw=0.8, label=name,
                color=_BRANCH_COLORS.get(name))  # fmt: skip
    raw = [r["max_ulp"] for rows in series.values() for r in rows]
    _ulp_axis_mpl(ax, plotted, note=_exact_note(raw, "output"))
    ax.set_xlabel("module output (forward order)")
    ax.set_ylabel("max ULP (dotted line = bit-exact)")
    ax.legend(fontsize=8, loc="best")
    if side_panel:
        name, labels, values, rel = side_panel
        bars = side_ax.bar(labels, _ulp(values), color="#7f7f7f")
        _ulp_axis_mpl(side_ax, _ulp(values), note=_exact_note(values, "output"))
        side_ax.bar_label(bars, [_rel_words(v) for v in rel], fontsize=8, label_type="center",
                          color="white", rotation=90 if len(rel) > 1 else 0)  # fmt: skip
        side_ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    return fig


def _rel_words(rel_max: float) -> str:
    return "bit-exact" if rel_max == 0 else f"rel_max {rel_max:.1e}"


def _batch_invariance(result: CheckResult, title: str, backend: Backend) -> Any:
    position = result.meta.get("position", 0)
    mine = [r for r in result.rows if r["position"] == position]
    roots = [r for r in result.rows if r["module"] == ROOT]
    several = len({r["output"] for r in roots}) > 1
    panel = (
        f"model output per position (batch {result.meta.get('batch')})",
        [f"pos {r['position']}" + (f":{r['output']}" if several else "") for r in roots],
        [r["max_ulp"] for r in roots],
        [r["rel_max"] for r in roots],
    )
    return _draw_modules(result, title, backend, {f"sample {position}": mine}, panel)


def _cfg_batching(result: CheckResult, title: str, backend: Backend) -> Any:
    series = {b: [r for r in result.rows if r["branch"] == b] for b in ("uncond", "cond")}
    guided = [r for r in result.rows if r["branch"] == "guided"]
    panel = (
        f"guided velocity (CFG {result.meta.get('cfg_scale', 0):g})",
        [f"output {r['output']}" for r in guided],
        [r["max_ulp"] for r in guided],
        [r["rel_max"] for r in guided],
    )
    return _draw_modules(result, title, backend, series, panel if guided else None)


# ---- sigma_parity ---------------------------------------------------------------------------


def _sigma_parity(result: CheckResult, title: str, backend: Backend) -> Any:
    rows = result.rows
    steps = [r["step"] for r in rows]
    sigma_ulp = _ulp([r["sigma_ulp"] for r in rows])
    ts_ulp = _ulp([r["timestep_ulp"] for r in rows])
    # Bit-exact steps: both the sigma and the presented timestep at 0 ULP (inf: no timestep
    # on one side, or another shape; never read as exact).
    both = [v for r in rows for v in (r["sigma_ulp"], r["timestep_ulp"])]
    exact = _exact_note(both, "step", count=len(rows))
    bias = [r["log_prob_bias"] if r["log_prob_bias"] == r["log_prob_bias"] else None
            for r in rows]  # fmt: skip
    if backend == "plotly":
        from plotly.subplots import make_subplots

        fig = make_subplots(
            rows=1, cols=2, subplot_titles=["ULP per step (dotted line = bit-exact)",
                                            "log-prob bias per step (velocity held fixed)"],
        )  # fmt: skip
        hover = [
            f"<b>step {r['step']}</b><br>sigma {r['sigma_a']!r} vs {r['sigma_b']!r}<br>"
            f"{r['timestep_key']}: {r['timestep_a']!r} {r['timestep_dtype_a']} vs "
            f"{r['timestep_b']!r} {r['timestep_dtype_b']}<br>log_prob bias "
            f"{r['log_prob_bias']:.3e} (max |d| {r['log_prob_abs_diff_max']:.3e})"
            for r in rows
        ]
        common = {"text": hover, "hovertemplate": "%{text}<extra></extra>", "row": 1, "col": 1}
        fig.add_bar(x=steps, y=sigma_ulp, name="sigma (fp32 ULP)", **common)
        fig.add_bar(x=steps, y=ts_ulp, name="timestep as presented (ULP)", **common)
        fig.add_scatter(
            x=steps,
            y=bias,
            mode="lines+markers",
            name="mean log_prob B - A",
            text=hover,
            hovertemplate="%{text}<extra></extra>",
            row=1,
            col=2,
        )
        _ulp_axis_plotly(fig, [*sigma_ulp, *ts_ulp], 1, 1, note=exact)
        fig.update_yaxes(exponentformat="e", row=1, col=2)
        fig.update_xaxes(title="denoising step (sigma 1 -> 0)")
        fig.update_layout(title=title, template="plotly_white", height=400, barmode="group")
        return attach_static_twin(fig, lambda: _sigma_parity(result, title, "matplotlib"))
    plt = _pyplot()
    fig, (ax, bias_ax) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    width = 0.4
    ax.bar([s - width / 2 for s in steps], sigma_ulp, width, label="sigma (fp32 ULP)")
    ax.bar([s + width / 2 for s in steps], ts_ulp, width, label="timestep as presented (ULP)")
    _ulp_axis_mpl(ax, [*sigma_ulp, *ts_ulp], headroom=50, note=exact)  # headroom: the legend
    ax.set_xlabel("denoising step (sigma 1 -> 0)")
    ax.set_ylabel("ULP (dotted line = bit-exact)")
    ax.legend(fontsize=8)
    finite = [(s, b) for s, b in zip(steps, bias, strict=True) if b is not None]
    bias_ax.plot([s for s, _ in finite], [b for _, b in finite], marker="o")
    bias_ax.axhline(0.0, color="black", lw=0.5)
    # symlog: equal grids give exactly 0, a rounded grid moves log_prob by 1e-6..1e-2.
    bias_ax.set_yscale("symlog", linthresh=1e-7)
    bias_ax.set_xlabel("denoising step (sigma 1 -> 0)")
    bias_ax.set_ylabel("mean log_prob(B's sigmas) - log_prob(A's)")
    fig.suptitle(title, fontsize=10)
    return fig


# ---- weight_sync ----------------------------------------------------------------------------


def _weight_sync(result: CheckResult, title: str, backend: Backend) -> Any:
    rows = result.rows
    counts = result.meta.get("status_counts") or {}
    statuses = [s for s in _STATUS_COLORS if counts.get(s)]
    if backend == "plotly":
        from plotly.subplots import make_subplots

        fig = make_subplots(
            rows=1, cols=2, column_widths=[0.75, 0.25],
            subplot_titles=["max ULP per tensor (dotted line = 0 or unknown)", "tensors by status"],
        )  # fmt: skip
        for status in statuses:
            idx = [i for i, r in enumerate(rows) if r["status"] == status]
            fig.add_scatter(
                x=idx, y=_ulp([rows[i]["max_ulp"] for i in idx]), mode="markers", name=status,
                marker={"color": _STATUS_COLORS[status], "size": 6},
                text=[
                    f"<b>{rows[i]['name']}</b><br>{status}: {rows[i]['dtype_a']} "
                    f"{rows[i]['shape_a']} vs {rows[i]['dtype_b']} {rows[i]['shape_b']}<br>"
                    f"max_ulp {rows[i]['max_ulp']}, rounded_to {rows[i]['rounded_to'] or '-'}"
                    for i in idx
                ],
                hovertemplate="%{text}<extra></extra>", row=1, col=1,
            )  # fmt: skip
        fig.add_bar(
            x=statuses, y=[counts[s] for s in statuses], showlegend=False,
            marker={"color": [_STATUS_COLORS[s] for s in statuses]}, row=1, col=2,
        )  # fmt: skip
        ys = _ulp([r["max_ulp"] for r in rows])
        _ulp_axis_plotly(fig, ys, 1, 1, floor_label="0 / n/a")
        fig.update_xaxes(title="tensor (reference order, then extras)", row=1, col=1)
        fig.update_layout(title=title, template="plotly_white", height=420)
        return attach_static_twin(fig, lambda: _weight_sync(result, title, "matplotlib"))
    plt = _pyplot()
    fig, (ax, bar_ax) = plt.subplots(
        1, 2, figsize=(12, 4.2), layout="constrained", gridspec_kw={"width_ratios": [3, 1]}
    )
    values = []
    for status in statuses:
        idx = [i for i, r in enumerate(rows) if r["status"] == status]
        ys = _ulp([rows[i]["max_ulp"] for i in idx])
        values += ys
        ax.scatter(idx, ys, s=12, color=_STATUS_COLORS[status], label=status)
    # The floor also holds tensors not compared by ULP: the status panel says what they are.
    _ulp_axis_mpl(ax, values, floor_label="0 / n/a")
    ax.set_xlabel("tensor (reference order, then extras)")
    ax.set_ylabel("max ULP (dotted line = 0 or unknown)")
    ax.legend(fontsize=8)
    bar_ax.bar(statuses, [counts[s] for s in statuses],
               color=[_STATUS_COLORS[s] for s in statuses])  # fmt: skip
    bar_ax.set_title("tensors by status", fontsize=9)
    fig.suptitle(title, fontsize=10)
    return fig


_DRAW = {
    "batch_invariance": _batch_invariance,
    "cfg_batching": _cfg_batching,
    "sigma_parity": _sigma_parity,
    "weight_sync": _weight_sync,
}

"""The ranked figure of an Attribution: each unit's share of the final divergence, own vs input.

    plot_attribution(attr)                  horizontal bars, largest share on top, stacked:
                                            what the unit adds itself (own) and what the code
                                            before it adds (input: root glue, model inputs)

An attribution is read duck-typed: `table()` returning a DataFrame with module, module_class,
share, own_share, input_share, rel_l2/rel_max_after_graft, and a `meta` mapping (a saved
attribution.json read back with `Attribution.from_json` is enough). Both backends, like every
plot: `backend="plotly"` (hover: the unit's class, calls, shares and what remains after its
graft) or `backend="matplotlib"`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lab.base.arguments import checked_arguments
from lab.views.plots._show import Backend, _pyplot, attach_static_twin, check_backend

if TYPE_CHECKING:
    import pandas as pd

    from lab.causes.attribute import Attribution

_OWN_COLOR = "#1f77b4"
_INPUT_COLOR = "#ff7f0e"


def _meta(attr: Any) -> Mapping[str, Any]:
    meta = getattr(attr, "meta", None)
    return meta if isinstance(meta, Mapping) else {}


def _title(attr: Any) -> str:
    m = _meta(attr)
    r0 = m.get("r0") or {}
    metric = m.get("metric", "rel_l2")
    what = f"{m.get('grafted_from', 'A')} grafted into {m.get('grafted_into', 'B')}"
    where = f"{m['family']} ({m.get('preset', '?')}), " if "family" in m else ""
    scenario = f"{m['scenario']}: " if "scenario" in m else ""
    residual = m.get("residual")
    tail = f"; residual {residual:.1%}" if isinstance(residual, int | float) else ""
    r0_value = r0.get(metric)
    r0_text = f"{r0_value:.3g}" if isinstance(r0_value, int | float) else "?"
    what_of = f"the final {metric} divergence"
    step = m.get("step")
    if metric == "log_ratio" and isinstance(step, Mapping):
        what_of = f"the step-{step.get('step')} log-prob drift, mean |log ratio|"
    return (
        f"{scenario}share of {what_of} ({r0_text}), level "
        f"{m.get('level', 'block')!r}: {where}{what}{tail}"
    )


def _ranked(attr: Any, top: int | None) -> pd.DataFrame:
    df = attr.table()
    df = df.sort_values(["share", "position"], ascending=[False, True], kind="stable")
    return df.head(top) if top is not None else df


def _hover(row: Mapping[str, Any]) -> str:
    return "<br>".join(
        [
            f"<b>{row['module']}</b> ({row['module_class']}), {row['calls']} call(s)",
            f"share: {row['share']:.2%}",
            f"own: {row['own_share']:.2%} (what the unit adds on A's exact inputs)",
            f"input: {row['input_share']:.2%} (the code before it: root glue, model inputs)",
            f"rel_l2 after graft: {row['rel_l2_after_graft']:.4g}",
            f"rel_max after graft: {row['rel_max_after_graft']:.4g}",
        ]
    )


@checked_arguments
def plot_attribution(
    attr: Attribution, *, top: int | None = 20, backend: Backend = "plotly"
) -> Any:
    """Units ranked by share, bars stacked as own share + input share.

    Negative parts (a graft that moves the output further away, e.g. errors of opposite sign
    cancelling in B's own forward) are drawn left of zero, so the bars of a row still add up
    to its share.

    Args:
        attr: An Attribution (or anything with `table()` and `meta`).
        top: Show the `top` largest shares (None: every unit).
        backend: "plotly" (hover: class, calls, shares, the divergence left after the graft)
            or "matplotlib".

    Raises:
        ValueError: For an unknown backend or a `top` below 1.
    """
    check_backend(backend, "plot_attribution")
    if top is not None and (not isinstance(top, int) or top < 1):
        raise ValueError(f"plot_attribution: top must be None or an int >= 1, got {top!r}.")
    df = _ranked(attr, top)
    title = _title(attr)
    meta = _meta(attr)
    xlabel = (
        "share of the log-prob drift"
        if meta.get("metric") == "log_ratio"
        else "share of the final divergence"
    )
    identical = (meta.get("r0") or {}).get(meta.get("metric", "rel_l2")) == 0
    # Largest on top: horizontal bars are drawn bottom-up.
    rows = df.iloc[::-1].to_dict("records")
    labels = [r["module"] for r in rows]
    height = max(3.0, 0.32 * len(rows) + 1.5)
    # No unit with an input share: the legend says so rather than naming a colour never drawn.
    input_name = "input" if any(r["input_share"] for r in rows) else "input (0 for every unit)"
    if backend == "plotly":
        import plotly.graph_objects as go

        hover = [_hover(r) for r in rows]
        fig = go.Figure(
            [
                go.Bar(
                    y=labels, x=[r["own_share"] for r in rows], orientation="h", name="own",
                    marker_color=_OWN_COLOR, text=hover, textposition="none",
                    hovertemplate="%{text}<extra></extra>",
                ),
                go.Bar(
                    y=labels, x=[r["input_share"] for r in rows], orientation="h", name=input_name,
                    marker_color=_INPUT_COLOR, text=hover, textposition="none",
                    hovertemplate="%{text}<extra></extra>",
                ),
            ]
        )  # fmt: skip
        if identical:
            fig.add_annotation(
                text="nothing to attribute: the sides are bit-identical", xref="paper",
                yref="paper", x=0.5, y=0.5, showarrow=False,
            )  # fmt: skip
        fig.update_xaxes(title=xlabel, tickformat=".0%")
        fig.update_layout(
            title={"text": "<br>".join(textwrap.wrap(title, 110)), "font": {"size": 12}},
            template="plotly_white",
            barmode="relative", height=int(height * 96), hovermode="closest",
        )  # fmt: skip
        return attach_static_twin(
            fig, lambda: plot_attribution(attr, top=top, backend="matplotlib")
        )

    from matplotlib.ticker import PercentFormatter

    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7.5, height), layout="constrained")
    own = [r["own_share"] for r in rows]
    inp = [r["input_share"] for r in rows]
    ax.barh(labels, own, color=_OWN_COLOR, label="own")
    # Stacked like plotly's relative mode: each part continues on its own sign's side.
    left = [o if (o >= 0) == (i >= 0) else 0.0 for o, i in zip(own, inp, strict=True)]
    ax.barh(labels, inp, left=left, color=_INPUT_COLOR, label=input_name)
    ax.axvline(0.0, color="black", linewidth=0.5)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(xlabel)
    # The zero-width input bars would pin the axis at the longest bar's end (sticky edges).
    ax.use_sticky_edges = False
    ax.margins(x=0.05)
    if identical:
        ax.text(
            0.5, 0.5, "nothing to attribute: the sides are bit-identical",
            transform=ax.transAxes, ha="center",
        )  # fmt: skip
    # Wrapped: the full sentence is longer than the axes are wide.
    ax.set_title("\n".join(textwrap.wrap(title, 95)), fontsize=8)
    ax.legend(fontsize=8, loc="lower right")
    return fig

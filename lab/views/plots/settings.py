"""The figure of a SettingAttribution: each knob's Shapley share, with its effect alone and removed.

    plot_setting_shares(attr)      horizontal bars, largest share on top; markers for the knob's
                                   effect alone (A plus it) and removed (B minus it), so
                                   interactions show; error bars for sampled shares

Read duck-typed: `table()` with knob, share, share_pct, stderr, alone, removed, value_a,
value_b, and `metric`, `total`, `side_a`, `side_b` attributes (what `attribute_settings`
returns). Both backends, like every plot.
"""

from __future__ import annotations

import html
import textwrap
from typing import Any

from lab.views.plots._show import Backend, _pyplot, attach_static_twin, check_backend

_SHARE = "#1f77b4"
_ALONE = "#2ca02c"
_REMOVED = "#d62728"


def _title(attr: Any) -> str:
    a = (getattr(attr, "side_a", None) or {}).get("name", "A")
    b = (getattr(attr, "side_b", None) or {}).get("name", "B")
    meta = getattr(attr, "meta", None) or {}
    where = f"{meta['family']} ({meta.get('preset', '?')}): " if meta.get("family") else ""
    how = "exact Shapley" if getattr(attr, "exact", True) else "sampled Shapley (+- 1 s.e.)"
    return (
        f"{where}which setting causes the {attr.metric} of {b} against {a} "
        f"({attr.total:.3g}); {how}"
    )


def plot_setting_shares(attr: Any, *, backend: Backend = "plotly") -> Any:
    """Each knob's share of the divergence, with its effect alone and removed.

    Args:
        attr: A SettingAttribution (`lab.causes.settings.attribute_settings`).
        backend: "plotly" (hover: the knob's two values, share, alone, removed) or
            "matplotlib".

    Raises:
        ValueError: An unknown backend, or an object that is not a setting attribution.
    """
    check_backend(backend, "plot_setting_shares")
    if not all(hasattr(attr, a) for a in ("table", "metric", "total")):
        raise ValueError(
            f"plot_setting_shares: expected what lab.attribute_settings returns, got "
            f"{type(attr).__name__}."
        )
    df = attr.table()
    rows = df.iloc[::-1].to_dict("records")  # largest on top: bars are drawn bottom-up
    labels = [r["knob"] for r in rows]
    height = max(3.0, 0.4 * len(rows) + 1.5)
    title = _title(attr)
    nothing = not rows or (attr.total == 0 and not any(r["alone"] for r in rows))
    if backend == "plotly":
        import plotly.graph_objects as go

        hover = [
            f"<b>{html.escape(r['knob'])}</b><br>{html.escape(str(r['value_a']))} -> "
            f"{html.escape(str(r['value_b']))}<br>share {r['share']:.3g} "
            f"({r['share_pct']:.1f} %)<br>alone {r['alone']:.3g}, removed {r['removed']:.3g}"
            for r in rows
        ]
        escaped = [html.escape(x) for x in labels]
        fig = go.Figure(
            [
                go.Bar(
                    y=escaped, x=[r["share"] for r in rows], orientation="h", name="Shapley share",
                    marker_color=_SHARE, text=hover, textposition="none",
                    hovertemplate="%{text}<extra></extra>",
                    error_x={"type": "data", "array": [r["stderr"] for r in rows],
                             "visible": any(r["stderr"] for r in rows)},
                ),
                go.Scatter(
                    y=escaped, x=[r["alone"] for r in rows], mode="markers", name="alone (A + it)",
                    marker={"color": _ALONE, "symbol": "circle", "size": 9},
                    hovertemplate="alone %{x:.3g}<extra></extra>",
                ),
                go.Scatter(
                    y=escaped, x=[r["removed"] for r in rows], mode="markers",
                    name="removed (B - it)", marker={"color": _REMOVED, "symbol": "x", "size": 9},
                    hovertemplate="removed %{x:.3g}<extra></extra>",
                ),
            ]
        )  # fmt: skip
        if nothing:
            fig.add_annotation(
                text="nothing to attribute: the sides agree knob by knob", xref="paper",
                yref="paper", x=0.5, y=0.5, showarrow=False,
            )  # fmt: skip
        fig.update_xaxes(title=attr.metric)
        fig.update_layout(
            title={"text": "<br>".join(textwrap.wrap(html.escape(title), 100)),
                   "font": {"size": 12}},
            template="plotly_white", height=int(height * 96), hovermode="closest",
        )  # fmt: skip
        return attach_static_twin(fig, lambda: plot_setting_shares(attr, backend="matplotlib"))

    plt = _pyplot()
    # Merged knobs have long names: wrapped, so the axes keep their width.
    labels = ["\n".join(textwrap.wrap(x, 36)) or x for x in labels]
    lines = sum(x.count("\n") + 1 for x in labels)
    height = max(3.0, 0.3 * lines + 0.15 * len(rows) + 1.5)
    fig, ax = plt.subplots(figsize=(8.5, height), layout="constrained")
    shares = [r["share"] for r in rows]
    errors = [r["stderr"] for r in rows]
    ax.barh(labels, shares, color=_SHARE, label="Shapley share",
            xerr=errors if any(errors) else None)  # fmt: skip
    ax.scatter([r["alone"] for r in rows], labels, color=_ALONE, label="alone (A + it)", zorder=3)
    ax.scatter(
        [r["removed"] for r in rows], labels, color=_REMOVED, marker="x", label="removed (B - it)",
        zorder=3,
    )  # fmt: skip
    ax.axvline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel(attr.metric)
    if nothing:
        ax.text(0.5, 0.5, "nothing to attribute: the sides agree knob by knob",
                transform=ax.transAxes, ha="center")  # fmt: skip
    fig.suptitle("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    ax.legend(fontsize=8, loc="lower right")
    return fig

"""The gradient figure of `lab.gradients` (notebook 07): per-parameter divergence of two sides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lab.base.arguments import checked_arguments
from lab.views.plots._show import _pyplot

if TYPE_CHECKING:
    from lab.rl.gradients import GradientResult


@checked_arguments
def plot_gradient_divergence(
    results: GradientResult | Mapping[str, GradientResult], metric: str = "rel_max"
) -> Any:
    """One marker per parameter (named_parameters order) of `metric`, one series per result.

    Zeros (bit-exact gradients) sit on a floor line below the smallest non-zero value, so a
    log axis can show them.

    Returns:
        A matplotlib Figure.

    Raises:
        ValueError: `metric` is not a column of the gradient table.
    """
    plt = _pyplot()
    runs = dict(results) if isinstance(results, Mapping) else {"": results}
    tables = {label: r.table() for label, r in runs.items()}
    for t in tables.values():
        if len(t) and metric not in t.columns:
            raise ValueError(
                f"plot_gradient_divergence: unknown metric {metric!r}. Known: "
                f"{', '.join(c for c in t.columns if t[c].dtype.kind in 'fi')}."
            )
    nonzero = [v for t in tables.values() if len(t) for v in t[metric] if v > 0]
    floor = min(nonzero) / 10 if nonzero else 1e-12
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for label, t in tables.items():
        if not len(t):
            continue
        values = t[metric].where(t[metric] > 0, floor)
        first = next(iter(runs.values()))
        name = label or f"{first.side_b.get('name')} vs {first.side_a.get('name')}"
        ax.plot(range(len(t)), values, marker="o", ms=3, lw=0.8, label=name)
    ax.axhline(floor, color="grey", lw=0.6, ls=":")
    # Limits before the log scale: when every parameter is bit-exact all points sit on the
    # floor, and matplotlib would warn that it cannot scale an axis of one value.
    ax.set_ylim(floor / 3, max([*nonzero, floor]) * 3)
    ax.set_yscale("log")
    ax.set_xlabel("parameter (named_parameters order)")
    ax.set_ylabel(f"{metric} of the fp32 gradient")
    first = next(iter(runs.values()))
    ax.set_title(
        f"{first.meta.get('family') or 'model'} [{first.meta.get('preset') or '?'}]: gradient "
        f"divergence per parameter (dotted line = bit-exact)"
    )
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig

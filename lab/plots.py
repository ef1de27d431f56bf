"""matplotlib figures from a Result (a saved result.json is enough), nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lab.result import Result

# Floor for log-scale plots: a bit-exact row sits on it instead of vanishing from the axis.
_FLOOR = 1e-12


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


def plot_divergence_by_layer(
    result: Result, metric: str = "rel_max", *, title: str | None = None
) -> Figure:
    """Divergence of every paired output across depth, log scale, coloured by module kind.

    The x axis is forward completion order; the first divergent module is marked. Rows at
    parity are drawn on a floor line (labelled) rather than dropped from the log axis.

    Args:
        result: A Result (or `Result.from_json(...)`).
        metric: Any numeric column of `result.table()` (rel_max, max_abs_diff, max_ulp, ...).
        title: Figure title; defaults to family, preset and the two sides.

    Raises:
        ValueError: For a metric that is not a numeric table column.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    table = result.table()
    if not len(table):
        raise ValueError("plot_divergence_by_layer: the Result has no paired rows to plot.")
    if metric not in table.columns or table[metric].dtype.kind not in "fiub":
        numeric = [c for c in table.columns if table[c].dtype.kind in "fiu"]
        raise ValueError(
            f"plot_divergence_by_layer: unknown metric {metric!r}. Choose from {numeric}."
        )
    fig, ax = plt.subplots(figsize=(11, 4.2), constrained_layout=True)
    kinds = table["module_class"].map(module_kind)
    x = range(len(table))
    values = table[metric].astype(float).clip(lower=_FLOOR)
    cmap = plt.get_cmap("tab10")
    for i, kind in enumerate(sorted(kinds.unique())):
        sel = (kinds == kind).to_numpy()
        ax.scatter(
            [xi for xi, s in zip(x, sel, strict=True) if s],
            values[sel],
            s=14,
            color=cmap(i % 10),
            label=kind,
        )
    ax.set_yscale("log")
    ax.axhline(_FLOOR, color="0.8", lw=0.8, ls=":")
    ax.text(0, _FLOOR * 1.6, "bit-exact / zero", fontsize=7, color="0.5")
    first = result.first_divergence()
    if first is not None:
        pos = int((table["order"] == first.order).to_numpy().argmax())
        ax.axvline(pos, color="crimson", lw=1, ls="--")
        ax.annotate(
            f"first divergence: {first.label()}",
            (pos, values.iloc[pos]),
            xytext=(8, 12),
            textcoords="offset points",
            color="crimson",
            fontsize=8,
        )
    ax.set_xlabel("module output, forward completion order")
    ax.set_ylabel(f"{metric} ({result.side_b.get('name')} vs {result.side_a.get('name')})")
    meta = result.meta
    ax.set_title(
        title
        or f"{meta.get('family', 'model')} [{meta.get('preset', '?')}], {result.mode}: "
        f"{result.side_a.get('name')} (reference) vs {result.side_b.get('name')}"
    )
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    ax.grid(alpha=0.3, which="both", axis="y")
    return fig


def save_figure(fig: Any, path: str | Path, *, dpi: int = 130) -> Path:
    """Write a matplotlib figure (PNG/SVG by suffix), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path

"""Figures of scenario runs: bug vs fixed divergence per module, culprits marked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lab.scenarios import ScenarioRun

_FLOOR = 1e-12
"""rel_max 0 (bit-exact) is drawn at this floor on the log axis."""


def _series(run: ScenarioRun) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for label, result in (("bug", run.bug), ("fixed", run.fixed)):
        rows = result.rows
        out[label] = (list(range(len(rows))), [max(r.metrics.rel_max, _FLOOR) for r in rows])
    return out


def _culprit_index(run: ScenarioRun) -> int | None:
    return next((i for i, r in enumerate(run.bug.rows) if r.module == run.found_culprit), None)


def plot_bug_vs_fixed(runs: list[ScenarioRun], *, interactive: bool = False) -> Any:
    """One panel per scenario: rel_max per module (propagated) for the bug and the fix.

    The found culprit is marked with a vertical line. Returns a matplotlib figure, or a plotly
    figure when `interactive`.
    """
    if interactive:
        return _plotly(runs)
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n = max(len(runs), 1)
    fig, axes = plt.subplots(n, 1, figsize=(8.0, 2.4 * n), layout="constrained", squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=False):
        for label, (x, y) in _series(run).items():
            ax.plot(x, y, marker=".", linewidth=0.8, label=label)
        idx = _culprit_index(run)
        if idx is not None:
            ax.axvline(idx, color="red", linestyle=":", linewidth=1.0)
        ax.set_yscale("log")
        ax.set_ylabel("rel_max")
        ax.set_title(
            f"{run.name}: expected {run.expected_culprit!r}, found {run.found_culprit!r} "
            f"({run.found_by})",
            fontsize=8,
        )
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel(f"module output, forward completion order (0 = bit-exact at {_FLOOR})")
    return fig


def _plotly(runs: list[ScenarioRun]) -> Any:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=max(len(runs), 1), cols=1, subplot_titles=[r.name for r in runs])
    for i, run in enumerate(runs, start=1):
        names = [r.label() for r in run.bug.rows]
        for label, (x, y) in _series(run).items():
            fig.add_scatter(x=x, y=y, name=f"{run.name} {label}", text=names, row=i, col=1)
        fig.update_yaxes(type="log", row=i, col=1)
    fig.update_layout(height=260 * max(len(runs), 1))
    return fig

"""Figures of scenario runs: bug vs fixed divergence per module, culprits marked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lab.base.arguments import checked_arguments
from lab.views.plots._show import Backend, _pyplot, attach_static_twin, check_backend
from lab.views.plots.divergence import hover_texts

if TYPE_CHECKING:
    from lab.engine.scenarios import ScenarioRun

_FLOOR = 1e-12
"""rel_max 0 (bit-exact) is drawn at this floor on the log axis."""
_COLOURS = {"bug": "#d62728", "fixed": "#1f77b4"}


def _series(run: ScenarioRun) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for label, result in (("bug", run.bug), ("fixed", run.fixed)):
        rows = result.rows
        out[label] = (list(range(len(rows))), [max(r.metrics.rel_max, _FLOOR) for r in rows])
    return out


def _culprit_index(run: ScenarioRun) -> int | None:
    return next((i for i, r in enumerate(run.bug.rows) if r.module == run.found_culprit), None)


def _title(run: ScenarioRun) -> str:
    return (
        f"{run.name}: expected {run.expected_culprit!r}, found {run.found_culprit!r} "
        f"({run.found_by})"
    )


@checked_arguments
def plot_bug_vs_fixed(
    runs: list[ScenarioRun], *, backend: Backend = "plotly", interactive: bool | None = None
) -> Any:
    """One panel per scenario: rel_max per module (propagated) for the bug and the fix.

    The found culprit is marked with a vertical line. The plotly hover names the module, its
    class, both sides' dtypes and parameter dtypes, the metrics and the row's `why`.

    Args:
        runs: Scenario runs (`lab.engine.scenarios.run_scenario(...)`).
        backend: "plotly" (a go.Figure with its matplotlib twin) or "matplotlib".
        interactive: The notebooks' switch: True is backend "plotly", False "matplotlib";
            None leaves `backend` as given.

    Raises:
        ValueError: For an unknown backend.
    """
    if interactive is not None:
        backend = "plotly" if interactive else "matplotlib"
    check_backend(backend, "plot_bug_vs_fixed")
    if backend == "plotly":
        fig = _plotly(runs)
        return attach_static_twin(fig, lambda: plot_bug_vs_fixed(runs, backend="matplotlib"))
    plt = _pyplot()

    from matplotlib.lines import Line2D

    n = max(len(runs), 1)
    fig, axes = plt.subplots(n, 1, figsize=(8.0, 2.4 * n), layout="constrained", squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=False):
        for label, (x, y) in _series(run).items():
            ax.plot(x, y, marker=".", linewidth=0.8, label=label, color=_COLOURS[label])
        idx = _culprit_index(run)
        if idx is not None:
            ax.axvline(idx, color="red", linestyle=":", linewidth=1.0)
        ax.set_yscale("log")
        ax.set_ylabel(f"rel_max\n({_FLOOR:g}: bit-exact)", fontsize=8)
        ax.set_title(_title(run), fontsize=8)
    axes[-1, 0].set_xlabel("module output, forward completion order")
    # One legend for every panel, above them: a panel's own would sit on its data.
    handles = [
        Line2D([], [], color=_COLOURS[label], marker=".", linewidth=0.8, label=label)
        for label in ("bug", "fixed")
    ] + [Line2D([], [], color="red", linestyle=":", linewidth=1.0, label="found culprit")]
    fig.legend(handles=handles, loc="outside upper center", ncols=3, fontsize=8)
    return fig


def _plotly(runs: list[ScenarioRun]) -> Any:
    from plotly.subplots import make_subplots

    n = max(len(runs), 1)
    fig = make_subplots(
        rows=n, cols=1, subplot_titles=[_title(r) for r in runs], vertical_spacing=0.3 / n
    )
    fig.update_annotations(font_size=10)
    for i, run in enumerate(runs, start=1):
        for label, (x, y) in _series(run).items():
            result = run.bug if label == "bug" else run.fixed
            hover = hover_texts(result, "rel_max") if result.rows else []
            fig.add_scatter(
                x=x, y=y, mode="lines+markers", name=f"{run.name}: {label}",
                legendgroup=label, line={"width": 1, "color": _COLOURS[label]},
                marker={"size": 4}, text=[f"<b>{label}</b><br>{h}" for h in hover],
                hovertemplate="%{text}<extra></extra>", row=i, col=1,
            )  # fmt: skip
        idx = _culprit_index(run)
        if idx is not None:
            fig.add_vline(
                x=idx, line={"color": "red", "dash": "dot", "width": 1}, row=i, col=1,
                annotation_text=f"culprit: {run.found_culprit}",
                annotation_font={"color": "red", "size": 9},
            )  # fmt: skip
        fig.update_yaxes(type="log", title="rel_max", exponentformat="e", row=i, col=1)
    fig.update_xaxes(title="module output, forward completion order", row=n, col=1)
    fig.update_layout(height=80 + 260 * n, template="plotly_white", hovermode="closest")
    return fig

"""Figures of PPO-ratio drift from a Trajectory (a saved results.json is enough).

Each figure comes in both backends, like `lab.views.plots`: `backend="plotly"` (the default: hover
gives the step's sigma, expert and drift numbers; `lab.views.plots.show` stores a PNG of the
matplotlib twin beside it for static viewers) or `backend="matplotlib"`.

    plot_ratio_drift(traj)                  ratio - 1 per step: median, mean, p01..p99, clip
    plot_ratio_histogram(traj)              ratio - 1 over every (in-window step, sample)
    plot_logprob_vs_velocity_gap(traj)      |d log_prob| against the velocity gap per sample,
                                            predicted and noise-averaged beside it
    plot_noise_floor(traj, clip_range)      per step: the share of identical-weight ratios a
                                            PPO clip range cuts, p50/p99 |log ratio|

A trajectory is read duck-typed: `per_step()` (and `per_sample()` for the last two) returning
DataFrames, and an optional `meta` mapping (family, preset, clip_range, sides, ...);
`plot_noise_floor` takes a `NoiseFloor` or anything with `noise_floor(clip_range)`.
"""

from __future__ import annotations

import html
import textwrap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lab.views.plots._show import Backend, _pyplot, attach_static_twin, check_backend

if TYPE_CHECKING:
    import pandas as pd

    from lab.rl.noise_floor import NoiseFloor
    from lab.rl.trajectory import Trajectory

# Per-step columns the ratio-drift hover shows after the ratio quantiles, when present.
_STEP_HOVER: tuple[str, ...] = (
    "clip_frac", "velocity_gap_rms", "model_output_rel_max", "log_prob_mean_abs_diff",
)  # fmt: skip


def _figure(figsize: tuple[float, float] = (7.0, 4.0)) -> tuple[Any, Any]:
    plt = _pyplot()

    return plt.subplots(figsize=figsize, layout="constrained")


def _meta(traj: Any) -> Mapping[str, Any]:
    meta = getattr(traj, "meta", None)
    return meta if isinstance(meta, Mapping) else {}


def _clip(traj: Any) -> float | None:
    clip = _meta(traj).get("clip_range")
    return float(clip) if isinstance(clip, int | float) else None


def _title(traj: Any, what: str) -> str:
    m = _meta(traj)
    if "family" not in m:
        return what
    side_a, side_b = m.get("side_a") or {}, m.get("side_b") or {}
    return (
        f"{what}: {m['family']} ({m.get('preset', '?')}), CFG {m.get('cfg_scale', 0):g}, "
        f"eta {m.get('noise_level', 0):g} ({m.get('sde_type', '?')}); "
        f"{side_a.get('name', 'rollout')} vs {side_b.get('name', 'trainer')}"
    )


def _in_window(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["in_window"].astype(bool)] if "in_window" in df.columns else df


def _step_words(traj: Any, newline: str = "\n") -> str:
    """The step axis' title: and when an SDE window leaves steps out, which and why."""
    full = traj.per_step()
    words = "denoising step (sigma 1 -> 0)"
    if "in_window" not in full.columns or bool(full["in_window"].astype(bool).all()):
        return words
    inside = full.loc[full["in_window"].astype(bool), "step"].tolist()
    shown = f"steps {min(inside)}-{max(inside)}" if inside else "no step"
    total = _meta(traj).get("steps") or len(full)
    return (
        f"{words}{newline}SDE window: {shown} of {total}; the others are deterministic (no "
        "log-prob, no ratio)"
    )


def _integer_axis(ax: Any, axis: str) -> None:
    """Whole-number ticks (steps, counts) on a matplotlib axis."""
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))


def _g(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def plot_ratio_drift(traj: Trajectory, *, backend: Backend = "plotly") -> Any:
    """Ratio - 1 per step: median and mean lines, the p01..p99 band, the PPO clip range.

    Args:
        traj: A Trajectory (or anything with `per_step()` and `meta`).
        backend: "plotly" (hover: the step's sigma, expert, quantiles, clip fraction, velocity
            gap) or "matplotlib" (symlog axis: identical sides give exactly 0).

    Raises:
        ValueError: For an unknown backend.
    """
    check_backend(backend, "plot_ratio_drift")
    df = _in_window(traj.per_step())
    clip = _clip(traj)
    title = _title(traj, "PPO ratio drift")
    if backend == "plotly":
        import plotly.graph_objects as go

        steps = df["step"].tolist()
        extra = [c for c in ("sigma", "expert", *_STEP_HOVER) if c in df.columns]
        hover = [
            "<br>".join(
                [f"<b>step {r['step']}</b>"]
                + [f"ratio {q}: {r[f'ratio_{q}']:.6g}" for q in ("p01", "p50", "p99")]
                + ([f"ratio mean: {r['ratio_mean']:.6g}"] if "ratio_mean" in r else [])
                + [f"{c}: {_g(r[c])}" for c in extra]
            )
            for r in df.to_dict("records")
        ]
        band = {"mode": "lines", "line": {"width": 0}, "hoverinfo": "skip"}
        fig = go.Figure(
            [
                go.Scatter(x=steps, y=(df["ratio_p99"] - 1).tolist(), showlegend=False, **band),
                go.Scatter(
                    x=steps, y=(df["ratio_p01"] - 1).tolist(), fill="tonexty", name="p01..p99",
                    fillcolor="rgba(31,119,180,0.25)", **band,
                ),
                go.Scatter(
                    x=steps, y=(df["ratio_p50"] - 1).tolist(), mode="lines+markers",
                    name="median", text=hover, hovertemplate="%{text}<extra></extra>",
                ),
            ]
        )  # fmt: skip
        if "ratio_mean" in df.columns:
            fig.add_scatter(
                x=steps, y=(df["ratio_mean"] - 1).tolist(), mode="lines+markers", name="mean",
                line={"dash": "dash"}, marker={"symbol": "x"}, hoverinfo="skip",
            )  # fmt: skip
        if clip is not None:
            for sign in (1, -1):
                fig.add_hline(y=sign * clip, line={"color": "red", "dash": "dot", "width": 1})
        fig.update_xaxes(title=_step_words(traj, "<br>"), dtick=1 if len(steps) <= 20 else None)
        fig.update_yaxes(title="ratio - 1 (trainer / rollout)", exponentformat="e")
        legend = f"clip range +-{clip:g}" if clip is not None else ""
        fig.update_layout(
            title=html.escape(title), template="plotly_white", height=380, hovermode="closest",
            legend_title_text=legend,
        )  # fmt: skip
        return attach_static_twin(fig, lambda: plot_ratio_drift(traj, backend="matplotlib"))

    fig, ax = _figure()
    ax.fill_between(
        df["step"], df["ratio_p01"] - 1, df["ratio_p99"] - 1, alpha=0.25, label="p01..p99"
    )
    ax.plot(df["step"], df["ratio_p50"] - 1, marker="o", label="median")
    if "ratio_mean" in df.columns:
        ax.plot(df["step"], df["ratio_mean"] - 1, marker="x", linestyle="--", label="mean")
    if clip is not None:
        for sign in (1, -1):
            ax.axhline(sign * clip, color="red", linewidth=0.8, linestyle=":")
    ax.axhline(0.0, color="black", linewidth=0.5)
    # symlog: identical sides give exactly 0, real drift spans decades around the clip range.
    ax.set_yscale("symlog", linthresh=(clip or 0.2) / 100)
    _integer_axis(ax, "x")
    ax.set_xlabel(_step_words(traj), fontsize=9)
    ax.set_ylabel("ratio - 1 (trainer / rollout)")
    ax.set_title(title, fontsize=9)
    ax.legend(
        fontsize=8, title=f"clip range +-{clip:g}" if clip is not None else None, title_fontsize=8
    )
    return fig


def plot_ratio_histogram(traj: Trajectory, *, bins: int = 40, backend: Backend = "plotly") -> Any:
    """Distribution of ratio - 1 over every (in-window step, sample), clip range marked.

    Args:
        traj: A Trajectory (or anything with `per_sample()` and `meta`).
        bins: Number of bins.
        backend: "plotly" or "matplotlib".

    Raises:
        ValueError: For an unknown backend.
    """
    check_backend(backend, "plot_ratio_histogram")
    df = traj.per_sample()
    clip = _clip(traj)
    values = (df["ratio"] - 1).to_numpy() if len(df) else []
    title = _title(traj, "Ratio distribution")
    if backend == "plotly":
        import numpy as np
        import plotly.graph_objects as go

        counts, edges = np.histogram(values, bins=bins)
        fig = go.Figure(
            go.Bar(
                x=((edges[:-1] + edges[1:]) / 2).tolist(),
                y=counts.tolist(),
                width=(edges[1:] - edges[:-1]).tolist(),
                text=[
                    f"ratio - 1 in [{lo:.4g}, {hi:.4g}): {c} samples x steps"
                    for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True)
                ],
                textposition="none",
                hovertemplate="%{text}<extra></extra>",
                name="samples x steps",
            )
        )
        if clip is not None:
            for sign in (1, -1):
                fig.add_vline(x=sign * clip, line={"color": "red", "dash": "dot", "width": 1})
        fig.update_xaxes(title="ratio - 1", exponentformat="e")
        fig.update_yaxes(title="samples x steps", dtick=1 if counts.max(initial=0) <= 10 else None)
        fig.update_layout(title=html.escape(title), template="plotly_white", height=360, bargap=0)
        return attach_static_twin(
            fig, lambda: plot_ratio_histogram(traj, bins=bins, backend="matplotlib")
        )

    fig, ax = _figure()
    ax.hist(values, bins=bins)
    if clip is not None:
        for sign in (1, -1):
            ax.axvline(sign * clip, color="red", linewidth=0.8, linestyle=":")
    # Ratios sit within ~1e-4 of 1: a shared power of ten keeps the tick labels apart.
    ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 2), useMathText=True)
    _integer_axis(ax, "y")
    ax.set_xlabel("ratio - 1")
    ax.set_ylabel("samples x steps")
    ax.set_title(title, fontsize=9)
    return fig


def _series(df: pd.DataFrame) -> list[tuple[str, str, str, bool]]:
    """(legend name, per-sample column, plotly symbol, colour scale shown) of each marker set."""
    series = [
        ("measured", "log_ratio", "circle", True),
        ("predicted (linear + quadratic)", "predicted_log_ratio", "x", False),
    ]
    # A saved run from before the linear term was added holds only the noise-averaged part.
    if "expected_log_ratio" in df.columns and df["expected_log_ratio"].notna().any():
        series.append(("noise-averaged |E[log ratio]|", "expected_log_ratio", "triangle-up", False))
    return series


def plot_logprob_vs_velocity_gap(traj: Trajectory, *, backend: Backend = "plotly") -> Any:
    """|d log_prob| against the rms velocity gap per sample, coloured by step; predicted beside.

    Three markers per sample: the measured |log_prob_new - log_prob_old| (circle), the
    prediction rebuilt from both velocities and the rollout's x_t, x_prev (x: linear +
    quadratic term, on top of the circle up to the fp32 rounding of the log-probs), and the
    noise-averaged part alone |E[log ratio]| = mean(dm^2) / (2 s^2) (triangle), which sits
    10-100x below on tiny and reduced models: there the zero-mean linear term dominates.

    Args:
        traj: A Trajectory (or anything with `per_sample()` and `meta`).
        backend: "plotly" (hover: step, sample, prompt seed, both log-probs, the ratio) or
            "matplotlib".

    Raises:
        ValueError: For an unknown backend.
    """
    check_backend(backend, "plot_logprob_vs_velocity_gap")
    df = traj.per_sample()
    title = _title(traj, "Log-prob gap vs velocity gap")
    xlabel = "velocity gap rms |v_trainer - v_rollout|"
    ylabel = "|log_prob_new - log_prob_old|"
    positive = (
        len(df) > 0 and (df["velocity_gap_rms"] > 0).any() and (df["log_ratio"].abs() > 0).any()
    )
    if backend == "plotly":
        import plotly.graph_objects as go

        fig = go.Figure()
        if len(df):
            cols = [
                c
                for c in ("prompt_seed", "sigma", "log_prob_old", "log_prob_new", "ratio")
                if c in df.columns
            ]
            hover = [
                "<br>".join(
                    [f"<b>step {r['step']}, sample {r.get('sample', '?')}</b>"]
                    + [f"{c}: {_g(r[c])}" for c in cols]
                    + [
                        f"velocity_gap_rms: {r['velocity_gap_rms']:.4g}",
                        f"|log_ratio|: {abs(r['log_ratio']):.4g}",
                        f"|predicted|: {abs(r['predicted_log_ratio']):.4g}",
                    ]
                    + [
                        f"{c}: {_g(r[c])}"
                        for c in ("expected_log_ratio", "log_ratio_sd", "transition_kl")
                        if c in r
                    ]
                )
                for r in df.to_dict("records")
            ]
            for name, column, symbol, scale in _series(df):
                fig.add_scatter(
                    x=df["velocity_gap_rms"].tolist(), y=df[column].abs().tolist(),
                    mode="markers", name=name, text=hover,
                    hovertemplate="%{text}<extra></extra>",
                    marker={
                        "color": df["step"].tolist(), "symbol": symbol, "size": 7,
                        "colorscale": "Viridis", "showscale": scale,
                        "colorbar": {"title": "step"},
                    },
                )  # fmt: skip
        if positive:
            fig.update_xaxes(type="log")
            fig.update_yaxes(type="log")
        else:
            fig.add_annotation(
                text="no drift: every gap is 0", xref="paper", yref="paper", x=0.5, y=0.5,
                showarrow=False,
            )  # fmt: skip
        fig.update_xaxes(title=xlabel, exponentformat="e")
        fig.update_yaxes(title=ylabel, exponentformat="e")
        fig.update_layout(
            title=html.escape(title), template="plotly_white", height=400, legend={"x": 0, "y": 1}
        )
        return attach_static_twin(
            fig, lambda: plot_logprob_vs_velocity_gap(traj, backend="matplotlib")
        )

    fig, ax = _figure()
    if len(df):
        markers = {"circle": "o", "x": "x", "triangle-up": "^"}
        sc = None
        for name, column, symbol, _ in _series(df):
            points = ax.scatter(
                df["velocity_gap_rms"], df[column].abs(), c=df["step"], s=14,
                marker=markers[symbol], label=name,
            )  # fmt: skip
            sc = sc or points
        fig.colorbar(sc, ax=ax, label="step")
        if positive:
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no drift: every gap is 0", transform=ax.transAxes, ha="center")
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return fig


def plot_noise_floor(
    source: NoiseFloor | Trajectory,
    clip_range: float | None = None,
    *,
    backend: Backend = "plotly",
) -> Any:
    """Per step: the share of identical-weight ratios a PPO clip range cuts, and |log ratio|.

    Bars (right axis) give the clipped share at each in-window step, red where the clip range
    is below the numeric noise floor; lines (left axis, log) give the p50, p99 and max
    |log ratio| against the clip range (a ratio is clipped once |log ratio| passes about
    clip_range). The title carries the verdict.

    Args:
        source: A NoiseFloor, or a Trajectory (anything with `noise_floor(clip_range)`).
        clip_range: For a Trajectory: the clip range to test (None: the one it ran with).
            Must be None for a NoiseFloor, which has its own.
        backend: "plotly" (hover: the step's sigma, samples, clipped count, quantiles,
            margin) or "matplotlib".

    Raises:
        ValueError: For an unknown backend, or a clip_range given with a NoiseFloor.
    """
    check_backend(backend, "plot_noise_floor")
    if hasattr(source, "verdict") and hasattr(source, "table"):
        if clip_range is not None and clip_range != source.clip_range:
            raise ValueError(
                f"plot_noise_floor: clip_range={clip_range!r}, but this NoiseFloor was made for "
                f"{source.clip_range!r}. Pass the Trajectory to test another clip range."
            )
        floor = source
    else:
        floor = source.noise_floor(clip_range)
    df = floor.table()
    clip = floor.clip_range
    title = _title(source, f"Noise floor at clip range {clip:g}")
    colors = ["#d62728" if c else "#7f7f7f" for c in df["clipped"].tolist()]
    lines = (
        ("p50 |log ratio|", "log_ratio_abs_p50", "circle"),
        ("p99 |log ratio|", "log_ratio_abs_p99", "diamond"),
        ("max |log ratio|", "log_ratio_abs_max", "x"),
    )
    positive = len(df) > 0 and bool((df["log_ratio_abs_max"] > 0).any())
    if backend == "plotly":
        from plotly.subplots import make_subplots

        fig = make_subplots(specs=[[{"secondary_y": True}]])
        steps = df["step"].tolist()
        hover = [
            "<br>".join(
                [
                    f"<b>step {r['step']}</b> (sigma {r['sigma']:.4g})",
                    f"clipped: {r['clipped']} of {r['samples']} ({100 * r['clip_frac']:.3g} %)",
                    f"p50 |log ratio|: {r['log_ratio_abs_p50']:.4g}",
                    f"p99 |log ratio|: {r['log_ratio_abs_p99']:.4g}",
                    f"max |ratio - 1|: {r['ratio_max_abs_minus_1']:.4g}",
                    f"margin clip / max: {_g(r['margin'])}",
                ]
            )
            for r in df.to_dict("records")
        ]
        fig.add_bar(
            x=steps, y=(100 * df["clip_frac"]).tolist(), name="clipped with no update (%)",
            marker={"color": colors}, opacity=0.45, text=hover, textposition="none",
            hovertemplate="%{text}<extra></extra>", secondary_y=True,
        )  # fmt: skip
        for name, column, symbol in lines:
            fig.add_scatter(
                x=steps, y=df[column].tolist(), mode="lines+markers", name=name,
                marker={"symbol": symbol}, text=hover, hovertemplate="%{text}<extra></extra>",
                secondary_y=False,
            )  # fmt: skip
        fig.add_hline(
            y=clip, line={"color": "red", "dash": "dot", "width": 1}, secondary_y=False,
            annotation_text=f"clip range {clip:g}", annotation_position="top left",
        )  # fmt: skip
        fig.update_xaxes(title="denoising step (sigma 1 -> 0)", dtick=1)
        fig.update_yaxes(
            title="|log_prob_new - log_prob_old|", exponentformat="e", secondary_y=False,
            type="log" if positive else "linear",
        )  # fmt: skip
        fig.update_yaxes(title="ratios clipped (%)", range=[0, 100], secondary_y=True)
        fig.update_layout(
            title={"text": f"{html.escape(title)}<br><sup>{html.escape(floor.verdict)}</sup>"},
            template="plotly_white",
            height=420, legend={"x": 0, "y": -0.25, "orientation": "h"}, hovermode="closest",
        )  # fmt: skip
        return attach_static_twin(fig, lambda: _noise_floor_matplotlib(floor, title, lines))
    return _noise_floor_matplotlib(floor, title, lines)


def _noise_floor_matplotlib(
    floor: NoiseFloor, title: str, lines: tuple[tuple[str, str, str], ...]
) -> Any:
    df = floor.table()
    clip = floor.clip_range
    fig, ax = _figure((7.0, 4.4))
    bars = ax.twinx()
    colors = ["#d62728" if c else "#7f7f7f" for c in df["clipped"].tolist()]
    bars.bar(df["step"], 100 * df["clip_frac"], color=colors, alpha=0.35, label="clipped (%)")
    bars.set_ylim(0, 100)
    bars.set_ylabel("ratios clipped with no update (%)")
    markers = {"circle": "o", "diamond": "D", "x": "x"}
    for name, column, symbol in lines:
        ax.plot(df["step"], df[column], marker=markers[symbol], label=name)
    ax.axhline(clip, color="red", linewidth=0.8, linestyle=":", label=f"clip range {clip:g}")
    if len(df) and bool((df["log_ratio_abs_max"] > 0).any()):
        ax.set_yscale("log")
    ax.set_zorder(bars.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_xlabel("denoising step (sigma 1 -> 0)")
    ax.set_ylabel("|log_prob_new - log_prob_old|")
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{title}\n{textwrap.fill(floor.verdict, 110)}", fontsize=8)
    return fig

"""Figures of PPO-ratio drift from a Trajectory (a saved results.json is enough).

Each figure comes in both backends, like `lab.views.plots`: `backend="plotly"` (the default: hover
gives the step's sigma, expert and drift numbers; `lab.views.plots.show` stores a PNG of the
matplotlib twin beside it for static viewers) or `backend="matplotlib"`.

    plot_ratio_drift(traj)                  ratio - 1 per step: median, mean, p01..p99, clip
    plot_ratio_histogram(traj)              ratio - 1 over every (in-window step, sample)
    plot_logprob_vs_velocity_gap(traj)      |d log_prob| against the velocity gap per sample

A trajectory is read duck-typed: `per_step()` (and `per_sample()` for the last two) returning
DataFrames, and an optional `meta` mapping (family, preset, clip_range, sides, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lab.views.plots._show import Backend, attach_static_twin, check_backend

if TYPE_CHECKING:
    import pandas as pd

    from lab.rl.trajectory import Trajectory

# Per-step columns the ratio-drift hover shows after the ratio quantiles, when present.
_STEP_HOVER: tuple[str, ...] = (
    "clip_frac", "velocity_gap_rms", "model_output_rel_max", "log_prob_mean_abs_diff",
)  # fmt: skip


def _figure(figsize: tuple[float, float] = (7.0, 4.0)) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

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
        fig.update_xaxes(title="denoising step (sigma 1 -> 0)")
        fig.update_yaxes(title="ratio - 1 (trainer / rollout)", exponentformat="e")
        legend = f"clip range +-{clip:g}" if clip is not None else ""
        fig.update_layout(
            title=title, template="plotly_white", height=380, hovermode="closest",
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
    ax.set_xlabel("denoising step (sigma 1 -> 0)")
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
        fig.update_yaxes(title="samples x steps")
        fig.update_layout(title=title, template="plotly_white", height=360, bargap=0)
        return attach_static_twin(
            fig, lambda: plot_ratio_histogram(traj, bins=bins, backend="matplotlib")
        )

    fig, ax = _figure()
    ax.hist(values, bins=bins)
    if clip is not None:
        for sign in (1, -1):
            ax.axvline(sign * clip, color="red", linewidth=0.8, linestyle=":")
    ax.set_xlabel("ratio - 1")
    ax.set_ylabel("samples x steps")
    ax.set_title(title, fontsize=9)
    return fig


def plot_logprob_vs_velocity_gap(traj: Trajectory, *, backend: Backend = "plotly") -> Any:
    """|d log_prob| against the rms velocity gap per sample, coloured by step; predicted beside.

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
                )
                for r in df.to_dict("records")
            ]
            for name, column, symbol, scale in (
                ("measured", "log_ratio", "circle", True),
                ("predicted |E[log ratio]|", "predicted_log_ratio", "x", False),
            ):
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
        fig.update_layout(title=title, template="plotly_white", height=400, legend={"x": 0, "y": 1})
        return attach_static_twin(
            fig, lambda: plot_logprob_vs_velocity_gap(traj, backend="matplotlib")
        )

    fig, ax = _figure()
    if len(df):
        sc = ax.scatter(
            df["velocity_gap_rms"], df["log_ratio"].abs(), c=df["step"], s=14, label="measured"
        )
        ax.scatter(
            df["velocity_gap_rms"],
            df["predicted_log_ratio"].abs(),
            c=df["step"],
            s=14,
            marker="x",
            label="predicted |E[log ratio]|",
        )
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

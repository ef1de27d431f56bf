"""matplotlib figures of PPO-ratio drift from a Trajectory (a saved results.json is enough)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lab.trajectory import Trajectory


def _figure(figsize: tuple[float, float] = (7.0, 4.0)) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize, layout="constrained")


def _title(traj: Trajectory, what: str) -> str:
    m = traj.meta
    return (
        f"{what}: {m['family']} ({m['preset']}), CFG {m['cfg_scale']:g}, eta {m['noise_level']:g} "
        f"({m['sde_type']}); {m['side_a']['name']} vs {m['side_b']['name']}"
    )


def plot_ratio_drift(traj: Trajectory) -> Any:
    """Ratio - 1 per step: median and mean lines, the p01..p99 band, the PPO clip range."""
    df = traj.per_step()
    df = df[df["in_window"]]
    fig, ax = _figure()
    clip = float(traj.meta["clip_range"])
    ax.fill_between(
        df["step"], df["ratio_p01"] - 1, df["ratio_p99"] - 1, alpha=0.25, label="p01..p99"
    )
    ax.plot(df["step"], df["ratio_p50"] - 1, marker="o", label="median")
    ax.plot(df["step"], df["ratio_mean"] - 1, marker="x", linestyle="--", label="mean")
    for sign in (1, -1):
        ax.axhline(sign * clip, color="red", linewidth=0.8, linestyle=":")
    ax.axhline(0.0, color="black", linewidth=0.5)
    # symlog: identical sides give exactly 0, real drift spans decades around the clip range.
    ax.set_yscale("symlog", linthresh=clip / 100)
    ax.set_xlabel("denoising step (sigma 1 -> 0)")
    ax.set_ylabel("ratio - 1 (trainer / rollout)")
    ax.set_title(_title(traj, "PPO ratio drift"), fontsize=9)
    ax.legend(fontsize=8, title=f"clip range +-{clip:g}", title_fontsize=8)
    return fig


def plot_ratio_histogram(traj: Trajectory, *, bins: int = 40) -> Any:
    """Distribution of ratio - 1 over every (in-window step, sample), clip range marked."""
    df = traj.per_sample()
    fig, ax = _figure()
    clip = float(traj.meta["clip_range"])
    values = (df["ratio"] - 1).to_numpy() if len(df) else []
    ax.hist(values, bins=bins)
    for sign in (1, -1):
        ax.axvline(sign * clip, color="red", linewidth=0.8, linestyle=":")
    ax.set_xlabel("ratio - 1")
    ax.set_ylabel("samples x steps")
    ax.set_title(_title(traj, "Ratio distribution"), fontsize=9)
    return fig


def plot_logprob_vs_velocity_gap(traj: Trajectory) -> Any:
    """|d log_prob| against the rms velocity gap per sample, coloured by step; predicted beside."""
    df = traj.per_sample()
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
        positive = (df["velocity_gap_rms"] > 0).any() and (df["log_ratio"].abs() > 0).any()
        if positive:
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no drift: every gap is 0", transform=ax.transAxes, ha="center")
        ax.legend(fontsize=8)
    ax.set_xlabel("velocity gap rms |v_trainer - v_rollout|")
    ax.set_ylabel("|log_prob_new - log_prob_old|")
    ax.set_title(_title(traj, "Log-prob gap vs velocity gap"), fontsize=9)
    return fig

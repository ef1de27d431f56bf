"""trajectory(): a denoising rollout and the trainer's recompute of its log-probs, step by step.

The rollout side samples N steps from seeded noise (Flow-GRPO SDE inside the window, the Euler
ODE step outside it) and records x_t, x_prev, its guided velocity and log_prob_old; the trainer
side recomputes its velocity on the same x_t and scores the same x_prev (log_prob_new). The
PPO ratio exp(log_prob_new - log_prob_old) is what a velocity gap costs the policy update.

Multi-output families (LTX-2 video + audio, MiniMax-H3 video + audio rows) are scored as one
sample: every latent tensor is flattened per sample and concatenated, and the log-prob is the
mean over that whole vector (what Flow-GRPO's mean over non-batch dims gives for one tensor).
"""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.base.atomic import atomic_write_text
from lab.base.devices import DeviceName, resolve_device
from lab.base.errors import PairError, TrajectoryError
from lab.base.processes import Interrupted
from lab.families import Family, FamilyName, Inputs
from lab.families import family as get_family
from lab.families.master import master_summary
from lab.pairing.guards import gc_paused
from lab.pairing.result import Result
from lab.pairing.run import block_classes, forward_side, pair
from lab.pairing.sides import Side
from lab.pairing.weights import WeightView
from lab.rl.flow_grpo import (
    SDE_TYPES,
    SdeType,
    check_sigma_schedule,
    euler_step,
    log_ratio_terms,
    sampler_settings,
    sde_step_with_logprob,
    sigma_schedule,
)
from lab.rl.latents import flatten_samples, latent_leaves, unflatten_samples
from lab.rl.noise_floor import NoiseFloor, noise_floor
from lab.rl.step_score import guided_velocity

QUANTILES: tuple[float, ...] = (0.01, 0.5, 0.99)


# ---- records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One denoising step's tensors, fp32 on CPU, latents flattened per sample: (P*B, N)."""

    step: int
    sigma: float
    sigma_prev: float
    in_window: bool
    expert: str | None
    x_t: torch.Tensor
    x_prev: torch.Tensor
    noise_pred_old: torch.Tensor
    """The rollout's guided velocity (diffusers sign convention)."""
    noise_pred_new: torch.Tensor
    """The trainer's guided velocity on the same x_t."""
    log_prob_old: torch.Tensor | None
    """(P*B,) fp32; None outside the SDE window (a deterministic step has no density)."""
    log_prob_new: torch.Tensor | None
    std_dev_t: float | None


@dataclass(frozen=True)
class StepDrift:
    """One row of `Trajectory.per_step()`: rollout (reference) vs trainer (candidate) at a step."""

    step: int
    sigma: float
    sigma_prev: float
    in_window: bool
    expert: str | None
    model_output_mean_abs_diff: float
    model_output_max_abs_diff: float
    model_output_rel_max: float
    model_output_mean_abs_diff_per_cfg: float
    """model_output_mean_abs_diff / cfg_scale: comparable across guidance scales."""
    model_output_max_abs_diff_per_cfg: float
    velocity_gap_rms: float
    log_prob_mean_abs_diff: float
    log_prob_mean_abs_diff_per_cfg: float
    ratio_abs_minus_1: float
    ratio_mean: float
    ratio_p01: float
    ratio_p50: float
    ratio_p99: float
    ratio_max_abs_minus_1: float
    clip_frac: float
    """Share of samples with |ratio - 1| > clip_range."""
    measured_log_ratio: float
    """mean(log_prob_new - log_prob_old) over samples."""
    predicted_log_ratio: float
    """Mean over samples of the exact log-ratio rebuilt in float64 from both velocities and the
    rollout's x_t, x_prev (`flow_grpo.log_ratio_terms`: linear + quadratic term). It matches
    measured_log_ratio to the fp32 rounding of the log-probs."""
    std_dev_t: float
    expected_log_ratio: float = math.nan
    """Mean over samples of the noise-averaged part alone, -mean(dm^2) / (2 s^2) ("sde":
    -transition_kl / N): what the drift costs on average over the SDE noise, <= 0."""
    log_ratio_sd: float = math.nan
    """Mean over samples of the spread of the zero-mean linear term, ||dm|| / (s N)."""
    transition_kl: float = math.nan
    """Mean over samples of KL(rollout || trainer) between the two Gaussian SDE transitions
    (same noise scale s, means dm apart): sum(dm^2) / (2 s^2), float64. NaN at a step with
    s = 0 (the last "cps" step; see meta["metric_notes"])."""
    transition_kl_max: float = math.nan
    chi_square: float = math.nan
    """Mean over samples of the chi-square divergence of the same transitions,
    expm1(sum(dm^2) / s^2) (of the joint density, not of the mean-reduced PPO ratio)."""
    chi_square_max: float = math.nan


@dataclass(frozen=True)
class SampleDrift:
    """One row of `Trajectory.per_sample()`: one sample at one in-window step."""

    step: int
    sample: int
    prompt_seed: int
    sigma: float
    log_prob_old: float
    log_prob_new: float
    log_ratio: float
    ratio: float
    velocity_gap_rms: float
    predicted_log_ratio: float
    """The exact log-ratio rebuilt in float64 (see StepDrift.predicted_log_ratio)."""
    expected_log_ratio: float = math.nan
    log_ratio_sd: float = math.nan
    transition_kl: float = math.nan
    chi_square: float = math.nan


# The per-step columns `Trajectory.metrics_by_step` flattens for a trainer's logger.
STEP_LOG_METRICS: tuple[str, ...] = (
    "transition_kl", "chi_square", "log_prob_mean_abs_diff", "ratio_abs_minus_1", "clip_frac",
    "measured_log_ratio", "predicted_log_ratio", "expected_log_ratio", "model_output_rel_max",
)  # fmt: skip


@checked_arguments
@dataclass
class Trajectory:
    """What `trajectory()` returns: per-step and per-sample drift, the tensors, captures."""

    meta: dict[str, Any]
    sigmas: list[float]
    step_drifts: list[StepDrift]
    sample_drifts: list[SampleDrift]
    steps: list[StepRecord] = field(default_factory=list)
    """The recorded tensors (not written by to_json)."""
    captures: dict[int, Result] = field(default_factory=dict)
    """Per-module pair() Results at the chosen capture_steps (first prompt's inputs)."""

    def per_step(self) -> Any:
        """Pandas DataFrame, one row per step (NaN log-prob columns outside the window)."""
        import pandas as pd

        return pd.DataFrame([dataclasses.asdict(r) for r in self.step_drifts])

    def per_sample(self) -> Any:
        """Pandas DataFrame, one row per (in-window step, sample)."""
        import pandas as pd

        cols = [f.name for f in dataclasses.fields(SampleDrift)]
        return pd.DataFrame([dataclasses.asdict(r) for r in self.sample_drifts], columns=cols)

    def overall(self) -> dict[str, Any]:
        """Summary over the in-window steps (means of per-step metrics, pooled sample stats)."""
        rows = [r for r in self.step_drifts if r.in_window]
        samples = self.sample_drifts
        lr = torch.tensor([s.log_ratio for s in samples], dtype=torch.float64)
        clip = float(self.meta["clip_range"])

        def mean(attr: str, pool: Sequence[StepDrift] = rows) -> float:
            vals = [getattr(r, attr) for r in pool]
            return float(sum(vals) / len(vals)) if vals else math.nan

        out = {
            k: self.meta[k]
            for k in ("family", "preset", "steps", "cfg_scale", "noise_level", "sde_type")
        }
        out.update(
            sde_window=list(self.meta["sde_window"]),
            samples=len(samples),
            model_output_mean_abs_diff=mean("model_output_mean_abs_diff", self.step_drifts),
            model_output_max_abs_diff=max(
                (r.model_output_max_abs_diff for r in self.step_drifts), default=math.nan
            ),
            model_output_rel_max=max(
                (r.model_output_rel_max for r in self.step_drifts), default=math.nan
            ),
            log_prob_mean_abs_diff=float(lr.abs().mean()) if lr.numel() else math.nan,
            log_prob_abs_diff_p99=float(lr.abs().quantile(0.99)) if lr.numel() else math.nan,
            ratio_abs_minus_1=float((lr.exp() - 1).abs().mean()) if lr.numel() else math.nan,
            ratio_max_abs_minus_1=float((lr.exp() - 1).abs().max()) if lr.numel() else math.nan,
            clip_frac=float(((lr.exp() - 1).abs() > clip).double().mean())
            if lr.numel()
            else math.nan,
            measured_log_ratio=float(lr.mean()) if lr.numel() else math.nan,
            predicted_log_ratio=mean("predicted_log_ratio"),
            expected_log_ratio=mean("expected_log_ratio"),
            transition_kl=mean("transition_kl"),
            transition_kl_max=max((r.transition_kl_max for r in rows), default=math.nan),
            chi_square=mean("chi_square"),
        )
        return out

    @checked_arguments
    def metrics_by_step(self, prefix: str = "precision") -> dict[str, float]:
        """The in-window per-step metrics as one flat dict, keyed for a trainer's logger.

        Keys are `{prefix}/step_{i}/{metric}` for each metric of `STEP_LOG_METRICS`
        (transition_kl, chi_square, log_prob_mean_abs_diff, clip_frac, ...), so they sit beside
        a trainer's per-timestep metrics (e.g. `wandb.log(traj.metrics_by_step())`).
        """
        return {
            f"{prefix}/step_{r.step}/{name}": float(getattr(r, name))
            for r in self.step_drifts
            if r.in_window
            for name in STEP_LOG_METRICS
        }

    @checked_arguments
    def noise_floor(self, clip_range: float | None = None) -> NoiseFloor:
        """Where `clip_range` sits against this trajectory's numeric noise floor, per step.

        Both sides run the same master weights (learning rate 0), so every ratio that is not
        1.0 is numeric noise: the share a PPO clip range cuts here is clipped with no update.

        Args:
            clip_range: The PPO clip range; None = the one this trajectory ran with.

        Returns:
            A NoiseFloor: `table()` per step (clip_frac, p50/p99 |log ratio|, margin) and
            `verdict`.

        Raises:
            ValueError: clip_range not a finite number > 0.
        """
        clip = self.meta["clip_range"] if clip_range is None else clip_range
        by_step: dict[int, tuple[float, list[float]]] = {}
        for r in self.sample_drifts:
            by_step.setdefault(r.step, (r.sigma, []))[1].append(r.log_ratio)
        return noise_floor(by_step, clip)

    def describe(self) -> str:
        """A few lines: what ran and the headline drift numbers."""
        o = self.overall()
        return (
            f"{o['family']} ({o['preset']}): {o['steps']} steps, SDE window {o['sde_window']}, "
            f"eta {o['noise_level']} ({o['sde_type']}), CFG {o['cfg_scale']}, "
            f"{o['samples']} sample-steps; rollout={self.meta['side_a']['name']!r} vs "
            f"trainer={self.meta['side_b']['name']!r}\n"
            f"  model_output rel_max {o['model_output_rel_max']:.3e}, mean_abs_diff "
            f"{o['model_output_mean_abs_diff']:.3e}\n"
            f"  |d log_prob| mean {o['log_prob_mean_abs_diff']:.3e} (p99 "
            f"{o['log_prob_abs_diff_p99']:.3e}); |ratio-1| mean {o['ratio_abs_minus_1']:.3e}, "
            f"max {o['ratio_max_abs_minus_1']:.3e}; clip_frac {o['clip_frac']:.3f} at "
            f"{self.meta['clip_range']:g}\n"
            f"  log-ratio measured {o['measured_log_ratio']:.3e} vs predicted "
            f"{o['predicted_log_ratio']:.3e} (noise-averaged part {o['expected_log_ratio']:.3e})"
            f"; transition KL mean {o['transition_kl']:.3e}, max {o['transition_kl_max']:.3e}"
            + "".join(f"\n  note: {n}" for n in self.meta.get("metric_notes", ()))
            + (
                f"\n  FAILED at step {failed['step']}: {failed['error']}; the figures above are "
                f"the {self.meta.get('completed_steps')} step(s) before it"
                if (failed := self.meta.get("failed"))
                else ""
            )
            + (
                f"\n  STOPPED by {stopped['signal']} in step {stopped['step']}; the figures "
                f"above are the {self.meta.get('completed_steps')} step(s) before it"
                if (stopped := self.meta.get("interrupted"))
                else ""
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN -> null); tensors are not included."""
        return _clean(
            dict(
                meta=self.meta,
                sigmas=self.sigmas,
                overall=self.overall(),
                per_step=[dataclasses.asdict(r) for r in self.step_drifts],
                per_sample=[dataclasses.asdict(r) for r in self.sample_drifts],
                captures={str(k): v.to_dict() for k, v in self.captures.items()},
            )
        )

    @checked_arguments
    def to_json(self, path: str | Path) -> Path:
        """Write `to_dict()` to `path` (parent folders created)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    @checked_arguments
    def from_json(cls, path: str | Path) -> Trajectory:
        """Read what `to_json` wrote (without tensors).

        Raises:
            ValueError: Not JSON, or not a trajectory (a paired forward's Result, say).
        """
        where = f"Trajectory.from_json({str(path)!r})"
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg}, line {err.lineno}).") from None
        if not isinstance(data, dict) or "per_step" not in data:
            kind = (
                "a paired forward's Result; read it with lab.Result.from_json"
                if isinstance(data, dict) and "rows" in data
                else "not a document Trajectory.to_json writes"
            )
            raise ValueError(f"{where}: this file has no per_step: it is {kind}.")

        def rows(kind: type, items: list[dict]) -> list:
            return [kind(**{k: math.nan if v is None else v for k, v in d.items()}) for d in items]

        def upgrade(d: dict) -> dict:
            # Saved before the linear term was added: its predicted_log_ratio was the
            # noise-averaged part alone, which is expected_log_ratio now.
            d = dict(d)
            if "predicted_log_ratio" in d and "expected_log_ratio" not in d:
                d["expected_log_ratio"], d["predicted_log_ratio"] = d["predicted_log_ratio"], None
            return d

        step_rows = []
        for d in data["per_step"]:
            d = upgrade(d)
            expert = d.pop("expert")
            step_rows.append(
                StepDrift(expert=expert, **{k: math.nan if v is None else v for k, v in d.items()})
            )
        return cls(
            meta=data["meta"],
            sigmas=data["sigmas"],
            step_drifts=step_rows,
            sample_drifts=rows(SampleDrift, [upgrade(d) for d in data["per_sample"]]),
            captures={int(k): Result.from_dict(v) for k, v in data.get("captures", {}).items()},
        )


class TrajectoryInterrupted(Interrupted):
    """Ctrl-C or SIGTERM stopped a trajectory after some steps; `trajectory` holds them.

    Its `meta["interrupted"]` names the step that was running and the signal; `signal_name` is
    "SIGINT" or "SIGTERM" (a KeyboardInterrupt: whatever does not know it unwinds as usual).
    """

    def __init__(self, message: str, trajectory: Trajectory, signal_name: str) -> None:
        """The message, the steps completed and the signal."""
        super().__init__(message, signal_name)
        self.trajectory = trajectory


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


# ---- latents <-> one flat vector per sample -----------------------------------------------


# ---- the run ------------------------------------------------------------------------------


def _resolve_side(
    value: Side | Mapping[str, Any] | None, fam: Family, preset_name: str, device: str
) -> Side:
    return Side.from_overrides(value, fam, preset_name, device, where="trajectory")


def _guided_velocity(
    fam: Family,
    model: torch.nn.Module,
    view: WeightView,
    side: Side,
    inputs: Inputs,
    cfg_scale: float,
    like: Sequence[torch.Tensor],
    batch: int,
    out: Any = None,
) -> torch.Tensor:
    """One side's guided velocity, flattened (B, N) fp32, diffusers sign convention.

    `out`: the side's model output on `inputs` when a `pair` already ran that forward.
    """
    if out is None:
        out = forward_side(model, inputs, side, view=view)
    negative = None
    if cfg_scale > 1.0 and fam.cfg_layout == "separate":
        if inputs.negative is None:
            raise ValueError(
                f"trajectory({fam.name!r}): cfg_layout 'separate' but make_inputs(cfg=True) "
                "returned no negative branch."
            )
        negative = forward_side(model, inputs.negative, side, view=view)
    shapes = [(batch, *t.shape[1:]) for t in like]
    return guided_velocity(fam.name, out, negative, cfg_scale, shapes, batch)


# The cyclic collector off for the whole rollout, as inside each pair and forward it runs
# (`guards.gc_paused`). Between them it was on, and a captured step's Result (qwen_image full:
# 2237 rows, each with its metrics and flow entries) survives into the old generations: as the
# captures pile up, full collections walk them and the model's and libraries' objects again
# and again. Off for the call, what the trajectory keeps is walked once, after it returns.
@gc_paused()  # outermost: `trajectory.__wrapped__` is the call with the collector on
@checked_arguments
def trajectory(
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    steps: int = 10,
    sde_window: tuple[int, int] | None = None,
    noise_level: float = 0.7,
    cfg_scale: float = 1.0,
    samples: int = 2,
    prompts: int = 1,
    seed: int = 0,
    device: DeviceName = "cpu",
    variant: str | None = None,
    rollout: Side | Mapping[str, Any] | None = None,
    trainer: Side | Mapping[str, Any] | None = None,
    sde_type: SdeType = "sde",
    sigmas: Sequence[float] | torch.Tensor | None = None,
    shift: float | None = None,
    capture_steps: Sequence[int] = (),
    clip_range: float = 1e-4,
    keep_tensors: bool = True,
    progress: bool = True,
    init: str | None = None,
    stream: bool | None = None,
) -> Trajectory:
    """Sample a Flow-GRPO rollout and recompute its log-probs as the trainer, step by step.

    Each prompt p has seed `seed + p` (conditioning and initial noise from the family's
    make_inputs; the SDE noise from its own generator), and `samples` samples per forward.
    Wan2.2 builds both experts and switches at the family's boundary.

    Args:
        family_name: One of `lab.families()`.
        preset: "tiny", "reduced" or "full".
        steps: Denoising steps N (>= 2).
        sde_window: [start, end) step indices that get SDE noise; None = every step. Outside
            it the rollout takes the deterministic Euler step and no log-prob is scored.
        noise_level: eta > 0.
        cfg_scale: Guidance scale; > 1 runs the family's CFG layout (rejected for
            guidance-distilled families).
        samples: Samples per prompt: one forward's batch, or several forwards for a family
            whose forward holds fewer (`Family.max_batch`: Cosmos3 takes one at a time).
        prompts: Number of prompts (seeds).
        seed: Weight seed and first prompt seed.
        device: "cpu" or "cuda".
        variant: A family variant.
        rollout: The reference side: a Side, or field overrides for `Side.rollout(family)`.
        trainer: The candidate side: a Side, or overrides for `Side.trainer(family)`.
        sde_type: "sde" (Flow-SDE) or "cps".
        sigmas: Use this grid (steps + 1 values, 1 -> 0) instead of the family's scheduler.
        shift: Override the scheduler's static shift.
        capture_steps: Steps at which to also run per-module `pair()` (first prompt).
        clip_range: PPO clip range for clip_frac (Flow-GRPO's default 1e-4).
        keep_tensors: Keep each step's tensors in `Trajectory.steps`.
        progress: Show a tqdm bar over steps.
        init: Seeded-weight regime for `Family.build` ("trained", "bf16_shipped", "plain");
            None = the build default. Recorded as meta["init"].
        stream: Cast each side's weights block by block from the fp32 master, right before a
            block runs, as `pair(stream=True)` does, instead of the whole model per forward:
            memory holds the master plus one block's casts. Bit-identical to not streaming.
            None (default): stream for the "full" preset. Wan2.2's experts are built when
            the schedule first reaches them and dropped after their last step either way.

    Returns:
        A Trajectory (per_step(), per_sample(), overall(), to_json()).

    Raises:
        ValueError: steps < 2, a schedule that is not decreasing, a window or capture step
            outside the schedule, noise_level <= 0, cfg_scale > 1 on a guidance-distilled
            family, an unknown sde_type, or stream=True on a model without block classes.
        TrajectoryInterrupted: Ctrl-C or SIGTERM after one or more steps completed (a
            KeyboardInterrupt): `err.trajectory` holds them. Before any step completed the
            KeyboardInterrupt itself.
        TrajectoryError: A step failed after earlier ones completed (out of memory, a failed
            captured pair): `err.trajectory` holds the completed steps (`meta["failed"]`:
            the step and the error; `meta["completed_steps"]`), `err.step` the failing
            step, `err.result` the failed captured pair's compared modules, if any. A
            failure before any step completed raises the error itself.
    """
    from lab.base.progress import progress as progress_bar

    fam = get_family(family_name)
    where = f"trajectory({family_name!r})"
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"{where}: steps must be an int >= 2, got {steps!r}.")
    for name, value in (("noise_level", noise_level), ("cfg_scale", cfg_scale),
                        ("clip_range", clip_range), ("shift", shift)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{where}: {name} must be a number, got {value!r}.")
    if shift is not None and not (math.isfinite(shift) and shift > 0):
        raise ValueError(f"{where}: shift must be a finite number > 0, got {shift!r}.")
    if sigmas is not None:
        grid = check_sigma_schedule(torch.as_tensor(sigmas), where=f"{where}: sigmas")
        if grid.numel() != steps + 1:
            raise ValueError(
                f"{where}: sigmas has {grid.numel()} values; {steps} steps need {steps + 1}."
            )
    else:
        grid = sigma_schedule(fam, steps, preset=preset, variant=variant, shift=shift)
    if sde_window is not None and (
        isinstance(sde_window, (str, bytes))
        or not hasattr(sde_window, "__len__")
        or not all(not isinstance(w, bool) and hasattr(w, "__index__") for w in sde_window)
    ):
        raise ValueError(
            f"{where}: sde_window must be two whole step indices [start, end), e.g. (0, 3), "
            f"got {sde_window!r}."
        )
    window = (0, steps) if sde_window is None else tuple(w.__index__() for w in sde_window)
    if len(window) != 2 or not 0 <= window[0] < window[1] <= steps:
        raise ValueError(
            f"{where}: sde_window {sde_window!r} is outside the schedule; it must be [start, "
            f"end) with 0 <= start < end <= steps = {steps}."
        )
    if not (math.isfinite(noise_level) and noise_level > 0.0):
        raise ValueError(
            f"{where}: noise_level must be a finite number > 0 (Flow-GRPO's is 0.7), got "
            f"{noise_level!r}."
        )
    if not (math.isfinite(clip_range) and clip_range > 0.0):
        raise ValueError(
            f"{where}: clip_range must be a finite number > 0 (Flow-GRPO's is 1e-4), got "
            f"{clip_range!r}."
        )
    resolve_device(device)  # CUDA asked for with no GPU: the lab's message, before any work
    if sde_type not in SDE_TYPES:
        raise ValueError(f"{where}: unknown sde_type {sde_type!r}. Known: {', '.join(SDE_TYPES)}.")
    if not (math.isfinite(cfg_scale) and cfg_scale >= 1.0):
        raise ValueError(
            f"{where}: cfg_scale must be a finite number >= 1 (1 = no guidance), got {cfg_scale!r}."
        )
    if cfg_scale > 1.0 and fam.cfg_layout == "none":
        raise ValueError(
            f"{where}: cfg_scale={cfg_scale!r}, but {fam.title} is guidance-distilled "
            "(cfg_layout 'none'): each step is one forward with no negative branch. Use "
            "cfg_scale=1.0."
        )
    if samples < 1 or prompts < 1:
        raise ValueError(f"{where}: samples and prompts must be >= 1, got {samples}, {prompts}.")
    bad_capture = [s for s in capture_steps if not 0 <= int(s) < steps]
    if bad_capture:
        raise ValueError(
            f"{where}: capture_steps {bad_capture} are outside the schedule (0..{steps - 1})."
        )
    side_a = _resolve_side(rollout, fam, "rollout", device)
    side_b = _resolve_side(trainer, fam, "trainer", device)
    sigma_list = [float(s) for s in grid]
    sigma_max = sigma_list[1]
    use_cfg = cfg_scale > 1.0

    # Per stream (a prompt's samples, in forwards of at most fam.max_batch samples): the fp32
    # initial noise as make_inputs draws it, and its own SDE generator. Drawn before any model
    # is built, so inputs the family refuses fail before the work starts.
    prompt_seeds = [seed + p for p in range(prompts)]
    per_forward = min(samples, fam.max_batch or samples)
    streams: list[tuple[int, int]] = []  # (prompt seed, samples in its forwards)
    states: list[torch.Tensor] = []
    stream_shapes: list[list[tuple[int, ...]]] = []
    gens: list[torch.Generator] = []
    for ps in prompt_seeds:
        for chunk, start in enumerate(range(0, samples, per_forward)):
            n = min(per_forward, samples - start)
            first = fam.make_inputs(preset, ps, n, False, variant=variant, dtype="fp32", sigma=1.0)
            leaves = latent_leaves(first)
            # Offset so the SDE noise is not the initial-noise stream of the same seed. A later
            # chunk of the same prompt (a family whose forward holds fewer samples than asked)
            # draws its own initial noise and SDE noise; the first chunk is what one forward
            # of every sample would have drawn first.
            sde_seed = ps + 1_000_003
            if chunk:
                noise_gen = torch.Generator("cpu").manual_seed((ps + 1_000_003) * 1_000 + chunk)
                leaves = [torch.randn(t.shape, generator=noise_gen) for t in leaves]
                sde_seed = (ps + 2_000_003) * 1_000 + chunk
            streams.append((ps, n))
            stream_shapes.append([tuple(t.shape) for t in leaves])
            states.append(flatten_samples(leaves).to(device))
            gens.append(torch.Generator("cpu").manual_seed(sde_seed))
    shapes = stream_shapes[0]

    step_experts = [fam.expert_for_sigma(s) for s in sigma_list[:-1]]
    experts = list(dict.fromkeys(step_experts))
    last_step = {e: i for i, e in enumerate(step_experts)}
    stream = preset == "full" if stream is None else bool(stream)
    build_init = {} if init is None else {"init": init}
    # Each expert (Wan2.2: high_noise, then low_noise) is built when the schedule first needs
    # it and dropped after its last step, so at most one expert's master is held at a time,
    # with one weight plan per side reused at every step.
    models: dict[str | None, torch.nn.Module] = {}
    views: dict[tuple[str | None, int], WeightView] = {}
    model_init: list[str | None] = []
    model_master: list[dict[str, Any]] = []

    def expert_model(e: str | None) -> torch.nn.Module:
        if e not in models:
            m = models[e] = fam.build(
                preset, seed, variant=variant, expert=e, device=device, **build_init
            )
            model_init.append(getattr(m, "lab_init", None))
            model_master.append(master_summary(m))
            blocks = block_classes(m, side_a, side_b) if stream else ()
            if stream and not blocks:
                raise ValueError(
                    f"{where}: stream=True needs block classes; neither side names "
                    f"fsdp_wrap_classes and {type(m).__name__} declares no _no_split_modules. "
                    "Pass stream=False, or a side with fsdp_wrap_classes=(...)."
                )
            for k, side in enumerate((side_a, side_b)):
                views[(e, k)] = WeightView(m, side, stream_classes=blocks)
        return models[e]

    records: list[StepRecord] = []
    step_drifts: list[StepDrift] = []
    sample_drifts: list[SampleDrift] = []
    captures: dict[int, Result] = {}
    notes: list[str] = []

    def _assemble() -> Trajectory:
        """The Trajectory of the steps run so far (all of them but on a failure)."""
        meta = dict(
            family=family_name,
            preset=preset,
            variant=variant,
            steps=steps,
            sde_window=list(window),
            noise_level=float(noise_level),
            cfg_scale=float(cfg_scale),
            cfg_layout=fam.cfg_layout,
            samples=samples,
            prompts=prompts,
            seed=seed,
            device=str(device),
            sde_type=sde_type,
            clip_range=float(clip_range),
            latent_shapes=[list(s) for s in shapes],
            experts=[e for e in experts if e is not None],
            side_a=side_a.to_dict(),
            side_b=side_b.to_dict(),
            sampler_notes=sampler_settings(fam).notes,
            init=model_init[0] if model_init else None,
            master=model_master[0] if model_master else None,
            stream=stream,
            metric_notes=notes,
        )
        meta["completed_steps"] = len(step_drifts)
        return Trajectory(meta, sigma_list, step_drifts, sample_drifts, records, captures)

    try:
        for i in progress_bar(range(steps), desc=f"{family_name} steps", disable=not progress):
            sigma, sigma_prev = sigma_list[i], sigma_list[i + 1]
            in_window = window[0] <= i < window[1]
            expert = step_experts[i]
            model = expert_model(expert)
            per_prompt: list[tuple] = []
            for p, (ps, n) in enumerate(streams):
                x = states[p]
                inputs = fam.make_inputs(
                    preset,
                    ps,
                    n,
                    use_cfg,
                    variant=variant,
                    sigma=sigma,
                    latents=unflatten_samples(x.cpu(), stream_shapes[p]),
                    device=device,
                )
                like = [torch.empty(s, device="meta") for s in stream_shapes[p]]
                outs: dict[str, Any] = {}
                if i in capture_steps and p == 0:
                    # The pair's two forwards are the step's own (the same outputs, bit for bit:
                    # tests/test_trajectory.py): a captured step costs no extra forward.
                    captures[i] = pair(
                        model,
                        inputs,
                        side_a,
                        side_b,
                        meta=dict(family=family_name, preset=preset, step=i, sigma=sigma),
                        stream=stream,
                        outputs=outs,
                    )
                v_old = _guided_velocity(
                    fam,
                    model,
                    views[(expert, 0)],
                    side_a,
                    inputs,
                    cfg_scale,
                    like,
                    n,
                    outs.get("a"),
                )
                v_new = _guided_velocity(
                    fam,
                    model,
                    views[(expert, 1)],
                    side_b,
                    inputs,
                    cfg_scale,
                    like,
                    n,
                    outs.get("b"),
                )
                if in_window:
                    x_prev, lp_old, _, std = sde_step_with_logprob(
                        v_old, x, sigma, sigma_prev, sigma_max, noise_level,
                        generator=gens[p], sde_type=sde_type,
                    )  # fmt: skip
                    _, lp_new, _, _ = sde_step_with_logprob(
                        v_new, x, sigma, sigma_prev, sigma_max, noise_level,
                        prev_sample=x_prev, sde_type=sde_type,
                    )  # fmt: skip
                    std_f = float(std)
                else:
                    x_prev, lp_old, lp_new = euler_step(v_old, x, sigma, sigma_prev), None, None
                    std_f = math.nan
                _check_finite_step(
                    where, i, {"rollout velocity": v_old, "trainer velocity": v_new,
                               "x_prev": x_prev, "log_prob_old": lp_old,
                               "log_prob_new": lp_new}, x, noise_level, cfg_scale,
                )  # fmt: skip
                per_prompt.append((x, x_prev, v_old, v_new, lp_old, lp_new))
                states[p] = x_prev
            x_t, x_prev, v_old, v_new = (
                torch.cat([r[k] for r in per_prompt]).cpu() for k in range(4)
            )
            lp_old = torch.cat([r[4] for r in per_prompt]).cpu() if in_window else None
            lp_new = torch.cat([r[5] for r in per_prompt]).cpu() if in_window else None
            if keep_tensors:
                records.append(
                    StepRecord(
                        i, sigma, sigma_prev, in_window, expert, x_t, x_prev, v_old, v_new,
                        lp_old, lp_new, None if not in_window else std_f,
                    )
                )  # fmt: skip
            drift, rows = _step_drift(
                i, sigma, sigma_prev, in_window, expert, x_t, x_prev, v_old, v_new, lp_old, lp_new,
                std_f, cfg_scale, clip_range, sde_type, samples, prompt_seeds,
            )  # fmt: skip
            step_drifts.append(drift)
            sample_drifts.extend(rows)
            if sde_type == "cps" and in_window and std_f == 0.0:
                notes.append(
                    f"step {i}: transition_kl and chi_square are NaN: the cps step to sigma_prev "
                    f"{sigma_prev:g} has noise scale 0, so both transitions are point masses "
                    "(infinite KL when they differ); the log-ratio columns are still exact."
                )
            if last_step[expert] == i:
                # The last reference too: the next expert is built before `model` is rebound, and
                # two Wan2.2-A14B masters (2 x 57 GB) do not fit one H200 next to a forward.
                for k in (0, 1):
                    del views[(expert, k)]
                del models[expert]
                model = inputs = None

    except BaseException as err:
        # The experts' masters go now, not with the error (a notebook keeps the last one).
        models.clear()
        views.clear()
        model = inputs = None
        step = len(step_drifts)  # steps complete in order: the failing one is the next
        if not step or not isinstance(err, Exception | KeyboardInterrupt):
            raise  # no step completed (or the process is exiting): the error as it is
        # The frames of the failed call (the model's forward among them) hold the model too;
        # the traceback still prints.
        traceback.clear_frames(err.__traceback__)
        # Nothing computed is lost: the steps before the failing one, as a Trajectory (the
        # failed step's own capture, if it got one, is no completed step's).
        for k in [k for k in captures if k >= step]:
            del captures[k]
        done = _assemble()
        if isinstance(err, KeyboardInterrupt):
            from lab.base.processes import signal_name

            name = signal_name(err)
            done.meta["interrupted"] = {"step": step, "signal": name}
            raise TrajectoryInterrupted(
                f"{where}: stopped by {name} in step {step} of {steps}; the {step} step(s) "
                "before it are in err.trajectory (its meta['interrupted'] says where).",
                done,
                name,
            ) from err
        done.meta["failed"] = {"step": step, "error": f"{type(err).__name__}: {err}"}
        raise TrajectoryError(
            f"{where}: step {step} of {steps} (sigma {sigma_list[step]:g}) failed: "
            f"{type(err).__name__}: {str(err).rstrip('.')}. The {step} step(s) before it are in "
            "err.trajectory (its meta['failed'] says where)"
            + (
                ", the failed pair's compared modules in err.result."
                if isinstance(err, PairError) and err.result is not None
                else "."
            ),
            done,
            step=step,
            cause=err,
        ) from err
    return _assemble()


def _check_finite_step(
    where: str,
    step: int,
    tensors: Mapping[str, torch.Tensor | None],
    x_t: torch.Tensor,
    noise_level: float,
    cfg_scale: float,
) -> None:
    """Refuse a step whose velocities, next latents or log-probs hold NaN/Inf.

    A NaN there read as a valid trajectory ("|d log_prob| mean nan", clip_frac 0, exit 0).

    Raises:
        ValueError: Naming the step, what went non-finite, whether x_t already was, and the
            settings that blow the latents up.
    """
    present = {name: t for name, t in tensors.items() if t is not None}
    # One host sync for all of them (the step's tensors may live on the GPU).
    counts = torch.stack([(~torch.isfinite(t)).sum() for t in (*present.values(), x_t)]).tolist()
    bad = {name: c for name, c in zip(present, counts, strict=False) if c}
    if not bad:
        return
    held = counts[-1]
    raise ValueError(
        f"{where}: step {step} holds NaN/Inf: "
        + ", ".join(f"{name} {count}" for name, count in bad.items())
        + (
            f" (x_t already held {held}: an earlier step's SDE noise blew the latents up)"
            if held
            else ""
        )
        + f". Ratios of non-finite log-probs mean nothing. noise_level {noise_level:g} and "
        f"cfg_scale {cfg_scale:g} scale the step (Flow-GRPO's are 0.7 and 4.5); with the "
        "defaults, check the sides' dtypes (fp16 overflows above 65504)."
    )


def _step_drift(
    step: int,
    sigma: float,
    sigma_prev: float,
    in_window: bool,
    expert: str | None,
    x_t: torch.Tensor,
    x_prev: torch.Tensor,
    v_old: torch.Tensor,
    v_new: torch.Tensor,
    lp_old: torch.Tensor | None,
    lp_new: torch.Tensor | None,
    std: float,
    cfg_scale: float,
    clip_range: float,
    sde_type: SdeType,
    samples: int,
    prompt_seeds: Sequence[int],
) -> tuple[StepDrift, list[SampleDrift]]:
    """The section-6 metrics of one step (fp32 differences, float64 reductions)."""
    d = v_new - v_old
    mean_abs = float(d.abs().double().mean())
    max_abs = float(d.abs().max())
    rel_max = max_abs / (float(v_old.abs().max()) + 1e-30)
    gap_rms = (d.double() ** 2).mean(dim=1).sqrt()
    nan = math.nan
    rows: list[SampleDrift] = []
    if in_window and lp_old is not None and lp_new is not None:
        # The trainer's difference in fp32, as the PPO loss forms it; reduced in float64.
        lr = (lp_new - lp_old).double()
        ratio = lr.exp()
        q = torch.quantile(ratio, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
        terms = log_ratio_terms(v_old, v_new, x_t, x_prev, sigma, sigma_prev, std, sde_type)
        pred = terms.predicted
        lp_stats = dict(
            log_prob_mean_abs_diff=float(lr.abs().mean()),
            log_prob_mean_abs_diff_per_cfg=float(lr.abs().mean()) / cfg_scale,
            ratio_abs_minus_1=float((ratio - 1).abs().mean()),
            ratio_mean=float(ratio.mean()),
            ratio_p01=q[0],
            ratio_p50=q[1],
            ratio_p99=q[2],
            ratio_max_abs_minus_1=float((ratio - 1).abs().max()),
            clip_frac=float(((ratio - 1).abs() > clip_range).double().mean()),
            measured_log_ratio=float(lr.mean()),
            predicted_log_ratio=float(pred.mean()),
            std_dev_t=std,
            expected_log_ratio=float(terms.quadratic.mean()),
            log_ratio_sd=float(terms.sd.mean()),
            transition_kl=float(terms.transition_kl.mean()),
            transition_kl_max=float(terms.transition_kl.max()),
            chi_square=float(terms.chi_square.mean()),
            chi_square_max=float(terms.chi_square.max()),
        )
        for k in range(lr.numel()):
            rows.append(
                SampleDrift(
                    step=step,
                    sample=k,
                    prompt_seed=int(prompt_seeds[k // samples]),
                    sigma=sigma,
                    log_prob_old=float(lp_old[k]),
                    log_prob_new=float(lp_new[k]),
                    log_ratio=float(lr[k]),
                    ratio=float(ratio[k]),
                    velocity_gap_rms=float(gap_rms[k]),
                    predicted_log_ratio=float(pred[k]),
                    expected_log_ratio=float(terms.quadratic[k]),
                    log_ratio_sd=float(terms.sd[k]),
                    transition_kl=float(terms.transition_kl[k]),
                    chi_square=float(terms.chi_square[k]),
                )
            )
    else:
        lp_stats = dict(
            log_prob_mean_abs_diff=nan, log_prob_mean_abs_diff_per_cfg=nan,
            ratio_abs_minus_1=nan, ratio_mean=nan, ratio_p01=nan, ratio_p50=nan, ratio_p99=nan,
            ratio_max_abs_minus_1=nan, clip_frac=nan, measured_log_ratio=nan,
            predicted_log_ratio=nan, std_dev_t=nan,
        )  # fmt: skip
    drift = StepDrift(
        step=step,
        sigma=sigma,
        sigma_prev=sigma_prev,
        in_window=in_window,
        expert=expert,
        model_output_mean_abs_diff=mean_abs,
        model_output_max_abs_diff=max_abs,
        model_output_rel_max=rel_max,
        model_output_mean_abs_diff_per_cfg=mean_abs / cfg_scale,
        model_output_max_abs_diff_per_cfg=max_abs / cfg_scale,
        velocity_gap_rms=float(gap_rms.mean()),
        **lp_stats,
    )
    return drift, rows

"""One recorded SDE step as a yardstick: what a model output's velocity gap costs in log-ratio.

`trajectory()` computes each side's guided velocity from its model output(s) and scores the
rollout's x_prev under both. `StepScore` keeps one step's x_t, x_prev, sigmas and std_dev_t so
any other model output on that step's inputs (a grafted forward, say) can be turned into the
same guided velocity and the exact log-ratio against a reference velocity
(`flow_grpo.log_ratio_terms`: linear + quadratic term, float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lab.base.arguments import checked_arguments
from lab.families import family as get_family
from lab.rl.flow_grpo import SdeType, combine_cfg, log_ratio_terms, sampler_settings
from lab.rl.latents import flatten_samples, output_leaves

if TYPE_CHECKING:
    from lab.rl.trajectory import Trajectory


def guided_velocity(
    family_name: str,
    output: Any,
    negative_output: Any,
    cfg_scale: float,
    shapes: Sequence[tuple[int, ...]],
    batch: int,
) -> torch.Tensor:
    """The guided velocity (B, N) fp32, diffusers sign convention, from a side's model output.

    `output` is the forward's output (for the "batched" CFG layout the batch is [negative,
    positive]); `negative_output` the negative branch's own forward for the "separate" layout
    (None otherwise). `shapes` are the latent shapes of one sample batch, in kwargs order.

    Raises:
        ValueError: Output tensors that do not match the latents, or a "separate" layout
            with guidance and no negative output.
    """
    fam = get_family(family_name)
    like = [torch.empty(s, device="meta") for s in shapes]
    use_cfg = cfg_scale > 1.0
    if use_cfg and fam.cfg_layout == "batched":
        leaves = output_leaves(output, like, 2 * batch, fam.name)
        pairs = [(t[batch:], t[:batch]) for t in leaves]
    elif use_cfg:
        if negative_output is None:
            raise ValueError(
                f"guided_velocity({fam.name!r}): cfg_layout 'separate' with cfg_scale "
                f"{cfg_scale!r} needs the negative branch's output, got None."
            )
        pos_leaves = output_leaves(output, like, batch, fam.name)
        neg_leaves = output_leaves(negative_output, like, batch, fam.name)
        pairs = list(zip(pos_leaves, neg_leaves, strict=True))
    else:
        pairs = [(t, None) for t in output_leaves(output, like, batch, fam.name)]
    # Combined per tensor in the model's layout: Qwen-Image's rescale is over the last dim.
    guided = [combine_cfg(fam, pos, neg, cfg_scale) for pos, neg in pairs]
    return flatten_samples(guided) * sampler_settings(fam).velocity_sign


@checked_arguments
@dataclass(frozen=True)
class StepScore:
    """One in-window SDE step of one forward's samples: x_t, the rollout's x_prev, the sigmas.

    `log_ratio(v_old, v_new)` is log_prob_new - log_prob_old per sample, exact in float64, for
    any two velocities on this x_t (the rollout's drawn x_prev scored under both).
    """

    family_name: str
    step: int
    cfg_scale: float
    shapes: tuple[tuple[int, ...], ...]
    """Latent shapes of the forward's batch (model layout), in kwargs order."""
    x_t: torch.Tensor
    """(B, N) fp32, samples flattened."""
    x_prev: torch.Tensor
    """(B, N) fp32: the rollout's drawn next sample."""
    sigma: float
    sigma_prev: float
    std_dev_t: float
    sde_type: SdeType = "sde"

    @property
    def batch(self) -> int:
        """Samples in the forward."""
        return int(self.x_t.shape[0])

    def velocity(self, output: Any, negative_output: Any = None) -> torch.Tensor:
        """The guided velocity of a model output on this step's inputs (see `guided_velocity`)."""
        return guided_velocity(
            self.family_name, output, negative_output, self.cfg_scale, self.shapes, self.batch
        )

    @checked_arguments
    def log_ratio(self, v_old: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """log_prob_new - log_prob_old per sample (B,) float64, exact (linear + quadratic)."""
        device = v_old.device
        terms = log_ratio_terms(
            v_old, v_new, self.x_t.to(device), self.x_prev.to(device), self.sigma,
            self.sigma_prev, self.std_dev_t, self.sde_type,
        )  # fmt: skip
        return terms.predicted

    def to_dict(self) -> dict[str, Any]:
        """The step's scalars (for an Attribution's meta; the tensors are not written)."""
        return {
            "family": self.family_name,
            "step": self.step,
            "cfg_scale": self.cfg_scale,
            "batch": self.batch,
            "sigma": self.sigma,
            "sigma_prev": self.sigma_prev,
            "std_dev_t": self.std_dev_t,
            "sde_type": self.sde_type,
        }

    @classmethod
    @checked_arguments
    def from_trajectory(cls, traj: Trajectory, step: int) -> StepScore:
        """Step `step` of the first forward of `traj`'s first prompt (its first samples).

        Raises:
            ValueError: A trajectory run with keep_tensors=False, a step outside the schedule
                or outside the SDE window (a deterministic step has no log-prob).
        """
        meta = traj.meta
        if not traj.steps:
            raise ValueError(
                "StepScore.from_trajectory: the trajectory holds no tensors (it ran with "
                "keep_tensors=False, or was read back with Trajectory.from_json, which writes "
                "none); run lab.trajectory(..., keep_tensors=True) (the default) in this session."
            )
        if isinstance(step, bool) or not hasattr(step, "__index__"):
            raise ValueError(
                f"StepScore.from_trajectory: step must be an int index into the schedule "
                f"(0..{len(traj.steps) - 1}; the SDE window is {meta.get('sde_window')}), got "
                f"{step!r} ({type(step).__name__})."
            )
        step = step.__index__()
        if not 0 <= step < len(traj.steps):
            raise ValueError(
                f"StepScore.from_trajectory: step {step!r} is outside the schedule "
                f"(0..{len(traj.steps) - 1})."
            )
        record = traj.steps[step]
        if not record.in_window or record.std_dev_t is None or math.isnan(record.std_dev_t):
            raise ValueError(
                f"StepScore.from_trajectory: step {step} is outside the SDE window "
                f"{meta['sde_window']} (a deterministic Euler step scores no log-prob); pick a "
                "step inside it."
            )
        fam = get_family(meta["family"])
        n = min(int(meta["samples"]), fam.max_batch or int(meta["samples"]))
        shapes = tuple((n, *s[1:]) for s in meta["latent_shapes"])
        return cls(
            family_name=meta["family"],
            step=step,
            cfg_scale=float(meta["cfg_scale"]),
            shapes=shapes,
            x_t=record.x_t[:n].clone(),
            x_prev=record.x_prev[:n].clone(),
            sigma=record.sigma,
            sigma_prev=record.sigma_prev,
            std_dev_t=float(record.std_dev_t),
            sde_type=meta.get("sde_type", "sde"),
        )

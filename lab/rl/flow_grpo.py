"""Flow-GRPO's SDE step log-prob, each family's sigma schedule and CFG combination.

The formulas are precision-facts.md section 7, in fp32 as Flow-GRPO computes them: the rollout's
`log_prob_old` and the trainer's `log_prob_new` both come from `sde_step_with_logprob`, and the
PPO ratio is exp(log_prob_new - log_prob_old). Everything here is a pure function of tensors
except `sigma_schedule`, which asks each family's own diffusers scheduler for its grid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from lab.families import Family, SamplerSettings

SdeType = Literal["sde", "cps"]
SDE_TYPES: tuple[str, ...] = ("sde", "cps")


def sampler_settings(family: Family | str) -> SamplerSettings:
    """The family's `SamplerSettings` (`Family.sampler`)."""
    from lab.families import family as get_family

    return (get_family(family) if isinstance(family, str) else family).sampler


# ---- sigma schedules ----------------------------------------------------------------------


def calculate_shift(
    image_seq_len: int, base_seq_len: float, max_seq_len: float, base_shift: float, max_shift: float
) -> float:
    """The pipelines' mu: linear in the packed latent token count (diffusers' calculate_shift)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def check_sigma_schedule(sigmas: torch.Tensor, *, where: str = "sigma schedule") -> torch.Tensor:
    """Check a flow-matching grid: 1-D, >= 3 entries, in [0, 1], strictly decreasing, ends at 0.

    Returns:
        The schedule as a 1-D fp32 CPU tensor.

    Raises:
        ValueError: Naming the first offending entry.
    """
    s = torch.as_tensor(sigmas).detach().to("cpu", torch.float32).flatten()
    if s.numel() < 3:
        raise ValueError(
            f"{where}: needs steps + 1 >= 3 sigmas (at least 2 steps), got {s.numel()}: "
            f"{s.tolist()}."
        )
    if not bool(torch.isfinite(s).all()) or float(s.max()) > 1.0 or float(s.min()) < 0.0:
        raise ValueError(f"{where}: every sigma must be finite and in [0, 1], got {s.tolist()}.")
    bad = (s[1:] >= s[:-1]).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"{where}: sigmas must be strictly decreasing, but sigmas[{i}] = {float(s[i])!r} <= "
            f"sigmas[{i + 1}] = {float(s[i + 1])!r}. A flow-matching sampler goes from ~1 "
            "(noise) down to 0 (data)."
        )
    if float(s[-1]) != 0.0:
        raise ValueError(f"{where}: the last sigma must be 0.0 (clean data), got {float(s[-1])!r}.")
    return s


def _dynamic_shift_mu(
    fam: Family, scheduler_config: Mapping[str, Any], preset: str, variant: str | None
) -> float:
    """The pipelines' mu: calculate_shift of `latents.shape[1]`, the packed latent token count.

    Raises:
        ValueError: If the family's latents are not packed (B, tokens, C), where shape[1] would
            be a channel count rather than the token count.
    """
    inputs = fam.make_inputs(preset, 0, 1, False, variant=variant, sigma=1.0)
    key = inputs.keys_with_role("latents")[0]
    first = inputs.kwargs[key]
    if first.ndim != 3:
        raise ValueError(
            f"sigma_schedule({fam.name!r}): use_dynamic_shifting needs packed latents (B, tokens, "
            f"C) for the token count mu is computed from, but {key!r} is shaped "
            f"{tuple(first.shape)}. Turn use_dynamic_shifting off in the sampler's "
            "scheduler_config (its static `shift` applies then)."
        )
    return calculate_shift(
        first.shape[1],
        base_seq_len=scheduler_config["base_image_seq_len"],
        max_seq_len=scheduler_config["max_image_seq_len"],
        base_shift=scheduler_config["base_shift"],
        max_shift=scheduler_config["max_shift"],
    )


def sigma_schedule(
    family: Family | str,
    steps: int,
    *,
    preset: str = "tiny",
    variant: str | None = None,
    shift: float | None = None,
) -> torch.Tensor:
    """The family pipeline's sigma grid for `steps` denoising steps, from its diffusers scheduler.

    As the pipeline's `__call__` builds it: Flux, Qwen-Image and LTX-2 pass sigmas =
    `np.linspace(1, 1/N, N)` in float64 and mu from the packed latent token count of `preset`'s
    geometry (their `latents.shape[1]`); SD3 and the others take the scheduler's own grid. Equal
    bit for bit to the pipelines' `scheduler.sigmas` (tests/test_sigmas.py).

    Args:
        family: A Family or its name.
        steps: Number of denoising steps (model evaluations), >= 2.
        preset: Whose geometry sets the token count for dynamic shifting.
        variant: A family variant (only matters if it changes the latent shape).
        shift: Override the static shift (families without dynamic shifting).

    Returns:
        1-D fp32 CPU tensor of steps + 1 sigmas, sigmas[0] == 1.0, strictly decreasing to 0.0.

    Raises:
        ValueError: steps < 2, a scheduler grid that is not strictly decreasing, or dynamic
            shifting on a family whose latents are not packed (B, tokens, C).
    """
    from lab.families import family as get_family

    fam = get_family(family) if isinstance(family, str) else family
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(
            f"sigma_schedule({fam.name!r}): steps must be an int >= 2 (Flow-GRPO's sigma_max is "
            f"sigmas[1]), got {steps!r}."
        )
    settings = sampler_settings(fam)
    config = dict(settings.scheduler_config)
    if shift is not None:
        config["shift"] = float(shift)
    if settings.scheduler == "minimax_h3":
        from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

        sched = MiniMaxH3Scheduler(**config)
        # Its grid counts the terminal 0 among the points: N + 1 points drive N evaluations.
        sched.set_timesteps(steps + 1)
        sigmas = sched.sigmas
    else:
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler(**config)
        kwargs: dict[str, Any] = {}
        if sched.config.use_dynamic_shifting:
            kwargs["mu"] = _dynamic_shift_mu(fam, sched.config, preset, variant)
        if settings.pipeline_sigmas:
            # float64, as the pipelines' np.linspace: the scheduler rounds it to fp32 itself.
            # An fp32 torch.linspace lands 1-4 fp32 ULP off at 10, 28 and 40 steps.
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), **kwargs)
        else:
            sched.set_timesteps(steps, **kwargs)
        sigmas = sched.sigmas
    sigmas = check_sigma_schedule(sigmas, where=f"sigma_schedule({fam.name!r}, {steps})")
    if sigmas.numel() != steps + 1:
        raise ValueError(
            f"sigma_schedule({fam.name!r}): the scheduler gave {sigmas.numel()} sigmas for "
            f"{steps} steps (its shift collapsed duplicates); ask for fewer steps."
        )
    return sigmas


# ---- the SDE step -------------------------------------------------------------------------


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or per-sample (B,) value as fp32, broadcastable against `like` (B, ...)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        return t
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def sde_step_with_logprob(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_prev: float | torch.Tensor,
    sigma_max: float | torch.Tensor,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sde_type: SdeType = "sde",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Flow-GRPO SDE step x_t -> x_prev and the log-density of x_prev, all in fp32.

    "sde" (Flow-SDE): std = sqrt(sigma / (1 - sigma')) * eta with sigma' = sigma_max when
    sigma == 1 (else sigma), mean = x (1 + std^2 dt / (2 sigma)) + v (1 + std^2 (1 - sigma) /
    (2 sigma)) dt, noise scale std sqrt(-dt), Gaussian log-density. "cps": std = sigma_prev
    sin(eta pi / 2), mean = x0 (1 - sigma_prev) + x1 sqrt(sigma_prev^2 - std^2) with x0 = x -
    sigma v and x1 = x + (1 - sigma) v, noise scale std, log_prob = -(x_prev - mean)^2 (constants
    dropped). Either way the log-prob is the MEAN over every non-batch dimension.

    Args:
        model_output: Velocity v (B, ...), diffusers convention (x0 = x - sigma v); cast to fp32.
        sample: x_t (B, ...); cast to fp32.
        sigma: sigmas[i] (float or (B,)).
        sigma_prev: sigmas[i + 1] (< sigma).
        sigma_max: sigmas[1], used in place of sigma when sigma == 1 (else 1 / 0).
        noise_level: eta > 0 (Flow-GRPO's default 0.7).
        prev_sample: x_prev to score (the trainer's recompute); None draws it.
        generator: For the noise draw; the noise is drawn on `generator`'s device in fp32.
        sde_type: "sde" or "cps".

    Returns:
        (prev_sample, log_prob (B,), prev_sample_mean, std_dev_t), all fp32.

    Raises:
        ValueError: Unknown sde_type, noise_level <= 0, sigma_prev >= sigma, or shape mismatch.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_step_with_logprob: unknown sde_type {sde_type!r}. Known: sde, cps.")
    if not float(noise_level) > 0.0:
        raise ValueError(
            f"sde_step_with_logprob: noise_level must be > 0, got {noise_level!r}. Use "
            "`euler_step` for a deterministic (ODE) step."
        )
    if tuple(model_output.shape) != tuple(sample.shape):
        raise ValueError(
            f"sde_step_with_logprob: model_output {tuple(model_output.shape)} and sample "
            f"{tuple(sample.shape)} differ in shape."
        )
    v = model_output.to(torch.float32)
    x = sample.to(torch.float32)
    s = _per_sample(sigma, x)
    s_prev = _per_sample(sigma_prev, x)
    if bool((s_prev >= s).any()):
        raise ValueError(
            f"sde_step_with_logprob: sigma_prev {sigma_prev!r} must be < sigma {sigma!r} "
            "(sigmas decrease towards the data)."
        )
    dt = s_prev - s
    if sde_type == "sde":
        s_max = torch.as_tensor(sigma_max, dtype=torch.float32, device=x.device)
        std_dev_t = torch.sqrt(s / (1 - torch.where(s == 1, s_max, s))) * noise_level
        mean = (
            x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        )
        scale = std_dev_t * torch.sqrt(-1 * dt)
    else:
        std_dev_t = s_prev * math.sin(noise_level * math.pi / 2)
        x0 = x - s * v
        x1 = x + v * (1 - s)
        mean = x0 * (1 - s_prev) + x1 * torch.sqrt(s_prev**2 - std_dev_t**2)
        scale = std_dev_t
    if prev_sample is None:
        noise = torch.randn(
            x.shape,
            generator=generator,
            dtype=torch.float32,
            device=generator.device if generator is not None else x.device,
        ).to(x.device)
        prev_sample = mean + scale * noise
    else:
        if tuple(prev_sample.shape) != tuple(x.shape):
            raise ValueError(
                f"sde_step_with_logprob: prev_sample {tuple(prev_sample.shape)} and sample "
                f"{tuple(x.shape)} differ in shape."
            )
        prev_sample = prev_sample.to(torch.float32)
    if sde_type == "sde":
        log_prob = (
            -((prev_sample.detach() - mean) ** 2) / (2 * scale**2)
            - torch.log(scale)
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
        )
    else:
        log_prob = -((prev_sample.detach() - mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, mean, torch.as_tensor(std_dev_t, dtype=torch.float32)


def euler_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_prev: float | torch.Tensor,
) -> torch.Tensor:
    """The deterministic flow-matching step x + v (sigma_prev - sigma), in fp32 (ODE steps)."""
    x = sample.to(torch.float32)
    dt = _per_sample(sigma_prev, x) - _per_sample(sigma, x)
    return x + model_output.to(torch.float32) * dt


def mean_velocity_factor(
    sigma: float, sigma_prev: float, std_dev_t: float, sde_type: SdeType = "sde"
) -> float:
    """D mean / d v of one step: how much a velocity gap moves the step's Gaussian mean.

    "sde": (1 + std^2 (1 - sigma) / (2 sigma)) dt; "cps": (1 - sigma) sqrt(sigma_prev^2 - std^2)
    - sigma (1 - sigma_prev).
    """
    if sde_type == "sde":
        return (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * (sigma_prev - sigma)
    return (1 - sigma) * math.sqrt(max(sigma_prev**2 - std_dev_t**2, 0.0)) - sigma * (
        1 - sigma_prev
    )


def transition_scale(
    sigma: float, sigma_prev: float, std_dev_t: float, sde_type: SdeType = "sde"
) -> float:
    """The noise scale s of one step's Gaussian transition x_prev ~ N(mean, s^2 I).

    "sde": std_dev_t sqrt(sigma - sigma_prev) (not std_dev_t itself); "cps": std_dev_t, which
    is 0 at the last step (sigma_prev = 0): that step is deterministic.
    """
    if sde_type == "sde":
        return std_dev_t * math.sqrt(sigma - sigma_prev)
    return std_dev_t


@dataclass(frozen=True)
class LogRatioTerms:
    """log_prob_new - log_prob_old of one step split exactly into its two terms, per sample.

    Both sides score the rollout's own x_t and x_prev = mean_old + s z, so with the gap of the
    two transition means dm = (v_new - v_old) * mean_velocity_factor (the x_t part cancels):

        "sde": log_ratio = mean(z dm) / s - mean(dm^2) / (2 s^2)
        "cps": log_ratio = 2 mean((x_prev - mean_old) dm) - mean(dm^2)

    (means over the N elements of a sample). Every field is (B,) float64.
    """

    linear: torch.Tensor
    """The first-order noise term: zero mean over the step's noise z, spread `sd`. It
    dominates whenever rms(dm) / s < ~1.6 / sqrt(N) (every tiny and reduced run)."""
    quadratic: torch.Tensor
    """-mean(dm^2) / (2 s^2) ("cps": -mean(dm^2)): the expectation over z, <= 0. For "sde" it
    is exactly -transition_kl / N."""
    sd: torch.Tensor
    """Standard deviation of `linear` over z: ||dm|| / (s N) ("cps": 2 s ||dm|| / N)."""
    transition_kl: torch.Tensor
    """KL(rollout || trainer) of the two Gaussian transitions (same s): sum(dm^2) / (2 s^2).
    NaN where s = 0 (the last "cps" step: two point masses, infinite KL)."""
    chi_square: torch.Tensor
    """Chi-square divergence of the same two Gaussians: expm1(sum(dm^2) / s^2). This is the
    divergence of the joint density over all N elements, not of the PPO ratio of the
    mean-reduced log-prob (about N^2 times smaller). NaN where s = 0."""

    @property
    def predicted(self) -> torch.Tensor:
        """The log-ratio itself (linear + quadratic), up to the fp32 rounding of the log-probs."""
        return self.linear + self.quadratic


def _step_mean_float64(
    v: torch.Tensor, x: torch.Tensor, sigma: float, sigma_prev: float, std: float, sde_type: str
) -> torch.Tensor:
    """`sde_step_with_logprob`'s transition mean, written again in float64."""
    if sde_type == "sde":
        dt = sigma_prev - sigma
        return x * (1 + std**2 / (2 * sigma) * dt) + v * mean_velocity_factor(
            sigma, sigma_prev, std, "sde"
        )
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    return x0 * (1 - sigma_prev) + x1 * math.sqrt(max(sigma_prev**2 - std**2, 0.0))


def log_ratio_terms(
    v_old: torch.Tensor,
    v_new: torch.Tensor,
    x_t: torch.Tensor,
    x_prev: torch.Tensor,
    sigma: float,
    sigma_prev: float,
    std_dev_t: float,
    sde_type: SdeType = "sde",
) -> LogRatioTerms:
    """The exact log-ratio of one step from both velocities and the rollout's x_t, x_prev.

    Computed in float64 from the fp32 tensors; dm comes from the float64 difference of the
    velocities, never from the difference of the two fp32 means (which cancels to ~1e-3
    relative). `predicted` then matches the measured fp32 log_prob_new - log_prob_old to the
    fp32 rounding of the log-probs: a few ulp of max |log_prob| from their reductions, plus the
    rounding of the fp32 transition mean, which enters divided by the noise scale s (about
    eps max|x_prev| / (s sqrt(N)) for N elements). Where s is small, at the end of a grid that
    comes close to 0, that second part dominates: cosmos3 tiny, CFG 4.5, step 9 of 10 (sigma
    1e-3, s = 7e-4) is 32 ulp of max |log_prob| over 16 samples (tests/test_flow_grpo.py).

    Args:
        v_old: The rollout's velocity (B, ...), diffusers convention.
        v_new: The trainer's velocity on the same x_t (B, ...).
        x_t: The step's input sample (B, ...).
        x_prev: The rollout's drawn next sample (B, ...).
        sigma: sigmas[i].
        sigma_prev: sigmas[i + 1].
        std_dev_t: The step's std_dev_t from `sde_step_with_logprob`.
        sde_type: "sde" or "cps".

    Returns:
        LogRatioTerms, each (B,) float64.

    Raises:
        ValueError: Unknown sde_type, or tensors of different shapes.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"log_ratio_terms: unknown sde_type {sde_type!r}. Known: sde, cps.")
    shapes = {tuple(t.shape) for t in (v_old, v_new, x_t, x_prev)}
    if len(shapes) != 1:
        raise ValueError(
            f"log_ratio_terms: v_old, v_new, x_t and x_prev must share one shape, got "
            f"{[tuple(t.shape) for t in (v_old, v_new, x_t, x_prev)]}."
        )
    dims = tuple(range(1, x_t.ndim))
    n = x_t[0].numel()
    dm = (v_new.double() - v_old.double()) * mean_velocity_factor(
        sigma, sigma_prev, std_dev_t, sde_type
    )
    mean_old = _step_mean_float64(
        v_old.double(), x_t.double(), sigma, sigma_prev, std_dev_t, sde_type
    )
    residual_dm = ((x_prev.double() - mean_old) * dm).mean(dim=dims)
    dm2 = (dm**2).sum(dim=dims)
    norm = dm2.sqrt()
    s = transition_scale(sigma, sigma_prev, std_dev_t, sde_type)
    if sde_type == "sde":
        linear = residual_dm / s**2
        quadratic = -dm2 / n / (2 * s**2)
        sd = norm / (s * n)
    else:
        linear = 2 * residual_dm
        quadratic = -dm2 / n
        sd = 2 * s * norm / n
    if s > 0:
        kl = dm2 / (2 * s**2)
        chi2 = torch.expm1(dm2 / s**2)
    else:
        kl = chi2 = torch.full_like(dm2, math.nan)
    return LogRatioTerms(linear, quadratic, sd, kl, chi2)


# ---- CFG ----------------------------------------------------------------------------------


def combine_cfg(
    family: Family | str, pos: torch.Tensor, neg: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The guided velocity: neg + scale (pos - neg) when scale > 1, else pos (fp32).

    Qwen-Image's true CFG then rescales each token's guided vector to the norm of pos over the
    last dim, as QwenImagePipeline does.

    Raises:
        ValueError: scale > 1 without a negative branch.
    """
    pos = pos.to(torch.float32)
    if not scale > 1.0:
        return pos
    if neg is None:
        raise ValueError(f"combine_cfg: scale {scale!r} > 1 needs the negative branch, got None.")
    guided = neg.to(torch.float32) + scale * (pos - neg.to(torch.float32))
    if sampler_settings(family).cfg_rescale_to_pos_norm:
        guided = guided * (
            torch.norm(pos, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True)
        )
    return guided

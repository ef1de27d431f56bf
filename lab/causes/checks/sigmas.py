"""sigma_parity: the sigma grid and the timestep each side would use, compared exactly.

A rollout engine and a trainer each rebuild the sampler: its scheduler and shift, the dtype it
holds the sigma grid in (the SDE step reads sigma, sigma_prev and sigma_max from there), the
dtype the pipeline computes the timestep in (Flux and Qwen-Image round t = sigma * 1000 to the
latent dtype before dividing) and the dtype its boundary policy presents it at. Any difference
is a pipeline difference, not the DiT's. A sigma difference moves the PPO ratio even with
identical velocities: the SDE mean and std of the step depend on the sigmas. This check
measures that part with the velocity held fixed (the same x_t, v and x_prev scored under both
sides' sigmas). A timestep difference changes what the DiT sees; `lab.pair` measures that.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.base.dtypes import dtype_name, parse_dtype
from lab.causes.checks.result import CheckResult
from lab.families import Family, SamplerSettings
from lab.families import family as get_family
from lab.pairing.metrics import ulp_distance
from lab.pairing.sides import Side
from lab.pairing.stats_layout import coarser_dtype
from lab.precision.input_policy import apply_input_dtype_policy, check_input_dtype_policy
from lab.rl.flow_grpo import SDE_TYPES, SdeType, check_sigma_schedule, sde_step_with_logprob
from lab.rl.flow_grpo import sigma_schedule as family_sigma_schedule
from lab.rl.latents import latent_leaves

COLUMNS: list[str] = [
    "step", "sigma_a", "sigma_b", "sigma_ulp", "sigma_abs_diff", "timestep_key", "timestep_a",
    "timestep_b", "timestep_dtype_a", "timestep_dtype_b", "timestep_ulp", "timestep_abs_diff",
    "timestep_rounding_only", "log_prob_bias", "log_prob_abs_diff_max",
]  # fmt: skip
"""`sigma_*`: sigmas[step] as each side holds it (fp32 ULPs). `timestep_*`: the timestep-role
kwarg that differs most, its first element as presented, ULPs in the finer of the two dtypes
(exact), `timestep_rounding_only` when rounding both to the coarser dtype makes them equal.
`log_prob_bias`: mean over samples of log_prob(side B's sigmas) - log_prob(side A's), the same
x_t, velocity and x_prev."""


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class SigmaSettings:
    """How one side builds its sigma grid and presents the timestep to the DiT."""

    name: str = "side"
    sampler: SamplerSettings | None = None
    """Scheduler, its config and pipeline sigmas; None = the family's own (`Family.sampler`)."""
    shift: float | None = None
    """Override the scheduler's static shift (families without dynamic shifting)."""
    sigmas: tuple[float, ...] | None = None
    """An explicit grid (steps + 1 values, 1 -> 0) instead of the scheduler's."""
    sigma_dtype: str = "fp32"
    """Dtype the sampler holds the grid in; the SDE step reads its sigmas from there."""
    pipeline_dtype: str | None = None
    """Dtype the pipeline builds the transformer's inputs at (`make_inputs(dtype=)`), which
    is where Flux and Qwen-Image round the timestep; None = the family's rollout dtype."""
    input_dtype_policy: Mapping[str, str | None] = field(default_factory=dict)
    """The side's boundary policy; its "timestep" entry casts the timestep-role kwargs."""
    forward_dtype: str = "bf16"
    """What "default" in the policy casts to."""

    def __post_init__(self) -> None:
        where = f"SigmaSettings({self.name!r})"
        parse_dtype(self.sigma_dtype, where=f"{where}.sigma_dtype")
        parse_dtype(self.forward_dtype, where=f"{where}.forward_dtype")
        if self.pipeline_dtype is not None:
            parse_dtype(self.pipeline_dtype, where=f"{where}.pipeline_dtype")
        object.__setattr__(
            self,
            "input_dtype_policy",
            check_input_dtype_policy(self.input_dtype_policy, where=f"{where}.input_dtype_policy"),
        )
        if self.sampler is not None and not isinstance(self.sampler, SamplerSettings):
            raise ValueError(
                f"{where}.sampler: expected a SamplerSettings (e.g. "
                "dataclasses.replace(fam.sampler, scheduler_config={...})), got "
                f"{type(self.sampler).__name__}."
            )
        if self.shift is not None and (
            isinstance(self.shift, bool) or not isinstance(self.shift, int | float)
            or not self.shift > 0
        ):  # fmt: skip
            raise ValueError(
                f"{where}.shift: expected a number > 0 (e.g. 3.0), got {self.shift!r}."
            )
        if self.sigmas is not None:
            object.__setattr__(self, "sigmas", tuple(float(s) for s in self.sigmas))

    @classmethod
    @checked_arguments
    def from_side(cls, side: Side, **overrides: Any) -> SigmaSettings:
        """The settings a `Side` implies: its name, boundary policy and forward dtype."""
        base = dict(
            name=side.name,
            input_dtype_policy=dict(side.input_dtype_policy),
            forward_dtype=side.forward_dtype,
        )
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the sampler as its fields)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["sampler"] = None if self.sampler is None else _sampler_dict(self.sampler)
        out["sigmas"] = None if self.sigmas is None else list(self.sigmas)
        out["input_dtype_policy"] = dict(self.input_dtype_policy)
        return out


SettingsLike = SigmaSettings | Side | SamplerSettings | Mapping[str, Any] | None


def as_sigma_settings(value: SettingsLike, default_name: str, where: str) -> SigmaSettings:
    """A SigmaSettings from any accepted form (None = the family's own sampler, passthrough).

    Raises:
        ValueError: Unknown fields in a mapping (listing the known ones), or another type.
    """
    if value is None:
        return SigmaSettings(name=default_name)
    if isinstance(value, SigmaSettings):
        return value
    if isinstance(value, Side):
        return SigmaSettings.from_side(value)
    if isinstance(value, SamplerSettings):
        return SigmaSettings(name=default_name, sampler=value)
    if isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(SigmaSettings)]
        unknown = sorted(set(value) - set(known), key=str)
        if unknown:
            raise ValueError(f"{where}: unknown settings {unknown}. Known: {', '.join(known)}.")
        return SigmaSettings(**{"name": default_name, **value})
    raise ValueError(
        f"{where}: expected SigmaSettings, a Side, a SamplerSettings, a mapping of SigmaSettings "
        f"fields or None, got {type(value).__name__}."
    )


@dataclass(frozen=True)
class _SideGrid:
    settings: SigmaSettings
    sigmas: torch.Tensor
    """The grid as the side holds it, widened to fp32 (what the SDE step computes with)."""
    timesteps: list[dict[str, torch.Tensor]]
    """Per step: each timestep-role kwarg as presented to the DiT."""


def _grid(
    fam: Family, s: SigmaSettings, steps: int, preset: str, variant: str | None, where: str
) -> _SideGrid:
    if s.sigmas is not None:
        grid = check_sigma_schedule(torch.tensor(s.sigmas), where=f"{where}: {s.name}.sigmas")
        if grid.numel() != steps + 1:
            raise ValueError(
                f"{where}: {s.name}.sigmas has {grid.numel()} values; {steps} steps need "
                f"{steps + 1}."
            )
    else:
        sampled = fam if s.sampler is None else dataclasses.replace(fam, sampler=s.sampler)
        grid = family_sigma_schedule(sampled, steps, preset=preset, variant=variant, shift=s.shift)
    held = grid.to(parse_dtype(s.sigma_dtype, where=where)).to(torch.float32)
    timesteps = []
    for sigma in held[:-1].tolist():
        inputs = fam.make_inputs(
            preset, 0, 1, False, variant=variant, dtype=s.pipeline_dtype, sigma=sigma
        )
        cast = apply_input_dtype_policy(s.input_dtype_policy, inputs, s.forward_dtype)
        timesteps.append(
            {k: cast.kwargs[k].detach() for k in cast.keys_with_role("timestep")
             if isinstance(cast.kwargs[k], torch.Tensor)}
        )  # fmt: skip
    return _SideGrid(s, held, timesteps)


@checked_arguments
def sigma_parity(
    family: Family | str,
    side_a_settings: SettingsLike = None,
    side_b_settings: SettingsLike = None,
    *,
    steps: int = 10,
    preset: str = "tiny",
    variant: str | None = None,
    noise_level: float = 0.7,
    sde_type: SdeType = "sde",
    samples: int = 8,
    seed: int = 0,
) -> CheckResult:
    """Compare the sigma grid and presented timestep of two sides, step by step, exactly.

    Args:
        family: A Family or its name.
        side_a_settings: The reference side (rollout): SigmaSettings, a Side (its boundary
            policy), a SamplerSettings, a mapping of SigmaSettings fields, or None (the family's
            own sampler, timestep as make_inputs presents it).
        side_b_settings: The candidate side (trainer), same forms.
        steps: Denoising steps (>= 2).
        preset: Geometry for dynamic shifting, and for the latent size of the log-prob bias.
        variant: A family variant.
        noise_level: eta of the Flow-GRPO SDE step (> 0).
        sde_type: "sde" or "cps".
        samples: Samples drawn per step for the log-prob bias.
        seed: Seed of those samples (x0, noise, the step's SDE noise).

    Returns:
        A CheckResult, one row per step; passed = sigmas and presented timesteps equal bit for
        bit at every step.

    Raises:
        ValueError: steps < 2, an explicit grid of the wrong length or not decreasing, bad
            settings, noise_level <= 0, an unknown sde_type or samples < 1.
    """
    where = "sigma_parity"
    fam = get_family(family) if isinstance(family, str) else family
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"{where}: steps must be an int >= 2, got {steps!r}.")
    if not float(noise_level) > 0.0:
        raise ValueError(f"{where}: noise_level must be > 0 (eta, e.g. 0.7), got {noise_level!r}.")
    if sde_type not in SDE_TYPES:
        raise ValueError(f"{where}: unknown sde_type {sde_type!r}. Known: {', '.join(SDE_TYPES)}.")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{where}: samples must be an int >= 1, got {samples!r}.")
    a = as_sigma_settings(side_a_settings, "rollout", f"{where}(side_a_settings)")
    b = as_sigma_settings(side_b_settings, "trainer", f"{where}(side_b_settings)")
    grid_a = _grid(fam, a, steps, preset, variant, where)
    grid_b = _grid(fam, b, steps, preset, variant, where)
    numel = sum(t[0].numel() for t in latent_leaves(fam.make_inputs(preset, 0, 1, False,
                                                                    variant=variant)))  # fmt: skip
    gen = torch.Generator("cpu").manual_seed(seed)
    rows = []
    for i in range(steps):
        row: dict[str, Any] = {"step": i}
        sa, sb = grid_a.sigmas[i], grid_b.sigmas[i]
        row.update(
            sigma_a=float(sa),
            sigma_b=float(sb),
            sigma_ulp=float(ulp_distance(sa.reshape(1), sb.reshape(1))[0]),
            sigma_abs_diff=abs(float(sa.double()) - float(sb.double())),
        )
        row.update(_timestep_row(grid_a.timesteps[i], grid_b.timesteps[i]))
        row.update(_log_prob_bias(grid_a.sigmas, grid_b.sigmas, i, numel, samples,
                                  noise_level, sde_type, gen))  # fmt: skip
        rows.append(row)
    passed = all(r["sigma_ulp"] == 0 and r["timestep_ulp"] == 0 for r in rows) and all(
        r["timestep_abs_diff"] == 0 for r in rows
    )
    meta = {
        "family": fam.name,
        "preset": preset,
        "variant": variant,
        "steps": steps,
        "noise_level": float(noise_level),
        "sde_type": sde_type,
        "samples": samples,
        "seed": seed,
        "latent_numel": numel,
        "timestep_presentation": fam.timestep_presentation,
        "side_a": a.to_dict(),
        "side_b": b.to_dict(),
        "applicable": True,
    }
    return CheckResult(where, rows, list(COLUMNS), _verdict(fam, a, b, rows), passed, meta)


def _timestep_row(ta: Mapping[str, torch.Tensor], tb: Mapping[str, torch.Tensor]) -> dict:
    """The timestep-role kwarg that differs most between two sides at one step."""
    keys = [k for k in ta if k in tb] or list(ta) or list(tb)
    best: dict[str, Any] | None = None
    for key in keys:
        a, b = ta.get(key), tb.get(key)
        if a is None or b is None:
            entry = dict(timestep_key=key, timestep_ulp=math.inf, timestep_abs_diff=math.inf,
                         timestep_rounding_only=False)  # fmt: skip
        elif a.shape != b.shape:
            entry = dict(timestep_key=key, timestep_ulp=math.inf, timestep_abs_diff=math.inf,
                         timestep_rounding_only=False)  # fmt: skip
        else:
            # ULPs in the finer dtype (the coarser one widens to it exactly), and whether
            # the difference is rounding only: equal once both are rounded to the coarser.
            coarse = coarser_dtype(a.dtype, b.dtype)
            fine = b.dtype if coarse == a.dtype else a.dtype
            ulp = ulp_distance(a.to(fine), b.to(fine))
            diff = (a.double() - b.double()).abs()
            top = float(ulp.max()) if ulp.numel() else 0.0
            entry = dict(
                timestep_key=key,
                timestep_ulp=top,
                timestep_abs_diff=float(diff.max()) if diff.numel() else 0.0,
                timestep_rounding_only=bool(
                    top > 0 and a.dtype != b.dtype and torch.equal(a.to(coarse), b.to(coarse))
                ),
            )
        entry.update(
            timestep_a=float(a.reshape(-1)[0]) if a is not None and a.numel() else math.nan,
            timestep_b=float(b.reshape(-1)[0]) if b is not None and b.numel() else math.nan,
            timestep_dtype_a=dtype_name(a.dtype) if a is not None else "absent",
            timestep_dtype_b=dtype_name(b.dtype) if b is not None else "absent",
        )
        rank = (entry["timestep_abs_diff"], entry["timestep_ulp"])
        if best is None or rank > (best["timestep_abs_diff"], best["timestep_ulp"]):
            best = entry
    if best is None:
        return dict(timestep_key="", timestep_a=math.nan, timestep_b=math.nan,
                    timestep_dtype_a="absent", timestep_dtype_b="absent", timestep_ulp=0.0,
                    timestep_abs_diff=0.0, timestep_rounding_only=False)  # fmt: skip
    return best


def _log_prob_bias(
    sigmas_a: torch.Tensor,
    sigmas_b: torch.Tensor,
    i: int,
    numel: int,
    samples: int,
    noise_level: float,
    sde_type: SdeType,
    gen: torch.Generator,
) -> dict[str, float]:
    """log_prob under B's sigmas minus under A's, for one step's x_t, velocity and x_prev.

    x_t = (1 - sigma) x0 + sigma noise and v = noise - x0 (the flow velocity, exact) on A's
    sigma; A draws x_prev; both score it. Equal grids give exactly 0 (the same fp32 ops).
    """
    x0 = torch.randn(samples, numel, generator=gen)
    noise = torch.randn(samples, numel, generator=gen)
    step_gen = torch.Generator("cpu").manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    sa, sa_prev, sa_max = (float(sigmas_a[k]) for k in (i, i + 1, 1))
    sb, sb_prev, sb_max = (float(sigmas_b[k]) for k in (i, i + 1, 1))
    x = (1 - sa) * x0 + sa * noise
    v = noise - x0
    try:
        x_prev, lp_a, _, _ = sde_step_with_logprob(
            v, x, sa, sa_prev, sa_max, noise_level, generator=step_gen, sde_type=sde_type
        )
        _, lp_b, _, _ = sde_step_with_logprob(
            v, x, sb, sb_prev, sb_max, noise_level, prev_sample=x_prev, sde_type=sde_type
        )
    except ValueError:
        # A grid that rounding made non-decreasing (sigma_prev >= sigma): no density to score.
        return {"log_prob_bias": math.nan, "log_prob_abs_diff_max": math.nan}
    diff = (lp_b - lp_a).double()
    return {
        "log_prob_bias": float(diff.mean()),
        "log_prob_abs_diff_max": float(diff.abs().max()),
    }


def _verdict(fam: Family, a: SigmaSettings, b: SigmaSettings, rows: Sequence[dict]) -> str:
    names = f"{a.name!r} vs {b.name!r}"
    sig = [r for r in rows if r["sigma_ulp"] != 0]
    ts = [r for r in rows if r["timestep_ulp"] != 0 or r["timestep_abs_diff"] != 0]
    if not sig and not ts:
        r0 = rows[0]
        return (
            f"{fam.title}: {names} use the same sigma grid and present the same timestep at all "
            f"{len(rows)} steps, bit for bit ({r0['timestep_key']!r} {r0['timestep_dtype_a']}, "
            f"presented as {fam.timestep_presentation!r}); the schedule adds no log-prob bias."
        )
    parts = [f"{fam.title}: {names}:"]
    if sig:
        first = sig[0]
        parts.append(
            f"the sigmas first differ at step {first['step']} ({first['sigma_a']!r} vs "
            f"{first['sigma_b']!r}, {first['sigma_ulp']:g} fp32 ULP; max "
            f"{max(r['sigma_ulp'] for r in sig):g} ULP, {len(sig)} of {len(rows)} steps)."
        )
        bias = [r for r in rows if math.isfinite(r["log_prob_bias"])]
        worst = max(bias, key=lambda r: abs(r["log_prob_bias"]), default=None)
        if worst is not None:
            mean = sum(r["log_prob_bias"] for r in bias) / len(bias)
            parts.append(
                f"With the velocity held fixed, that alone moves log_prob by {mean:.3e} per step "
                f"on average (largest mean {worst['log_prob_bias']:.3e} at step {worst['step']}, "
                f"a sample up to {max(r['log_prob_abs_diff_max'] for r in bias):.3e}); Flow-GRPO "
                "clips the ratio at 1 +- 1e-4."
            )
        if len(bias) < len(rows):
            parts.append(
                f"{len(rows) - len(bias)} step(s) have no log-prob: rounding made a grid "
                "non-decreasing there (sigma_prev >= sigma)."
            )
    else:
        parts.append("the sigma grids agree bit for bit, so the SDE step adds no log-prob bias.")
    if ts:
        first = ts[0]
        rounding = all(r["timestep_rounding_only"] for r in ts)
        parts.append(
            f"The timestep the DiT sees first differs at step {first['step']} "
            f"({first['timestep_key']!r}: {first['timestep_a']!r} {first['timestep_dtype_a']} vs "
            f"{first['timestep_b']!r} {first['timestep_dtype_b']}; max abs "
            f"{max(r['timestep_abs_diff'] for r in ts):.3g}, {len(ts)} of {len(rows)} steps"
            + (", rounding only: equal once both are rounded to the coarser dtype" if rounding
               else "")
            + "): the model gets another conditioning, a velocity gap that lab.pair measures."
        )  # fmt: skip
    else:
        parts.append("The presented timesteps agree bit for bit.")
    return " ".join(parts)


def _sampler_dict(sampler: SamplerSettings) -> dict[str, Any]:
    out = {f.name: getattr(sampler, f.name) for f in dataclasses.fields(sampler)}
    out["scheduler_config"] = dict(sampler.scheduler_config)
    return out

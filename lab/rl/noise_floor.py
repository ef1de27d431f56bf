"""noise_floor(): how many PPO ratios a clip range cuts when the weights did not change at all.

A trajectory's rollout and trainer sides hold the same fp32 master weights: it is the first
inner PPO step of an on-policy update, or any step at learning rate 0. Every ratio that is not
exactly 1.0 is then numeric noise (kernels, dtypes, CFG), and a clip range that cuts some of
them clips samples that no update moved. This module reads the per-sample log-ratios of such a
trajectory and says, per step, where a clip range sits against that floor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class NoiseFloorStep:
    """One in-window step: the ratios of identical weights against one clip range."""

    step: int
    sigma: float
    samples: int
    clipped: int
    """Samples with |ratio - 1| > clip_range (Flow-GRPO's clipfrac test)."""
    clip_frac: float
    log_ratio_abs_p50: float
    log_ratio_abs_p99: float
    log_ratio_abs_max: float
    ratio_max_abs_minus_1: float
    """The smallest clip range that cuts nothing at this step."""
    margin: float
    """clip_range / ratio_max_abs_minus_1: > 1 above the floor, <= 1 at or below it (inf when
    every ratio is exactly 1.0)."""


@dataclass(frozen=True)
class NoiseFloor:
    """What `Trajectory.noise_floor(clip_range)` returns: per-step rows and one verdict."""

    clip_range: float
    rows: list[NoiseFloorStep]
    verdict: str
    """One sentence: the steps where the clip range is below the floor and the share of ratios
    it clips there, or the margin above the floor at every step."""

    @property
    def below_steps(self) -> list[int]:
        """Steps at which the clip range cuts at least one ratio."""
        return [r.step for r in self.rows if r.clipped]

    def table(self) -> Any:
        """Pandas DataFrame, one row per in-window step."""
        import pandas as pd

        cols = [f.name for f in dataclasses.fields(NoiseFloorStep)]
        return pd.DataFrame([dataclasses.asdict(r) for r in self.rows], columns=cols)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (an infinite margin becomes null)."""

        def finite(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        rows = [{k: finite(v) for k, v in dataclasses.asdict(r).items()} for r in self.rows]
        return dict(clip_range=self.clip_range, verdict=self.verdict, per_step=rows)

    def __str__(self) -> str:
        return self.verdict


def noise_floor(
    log_ratios: Mapping[int, tuple[float, Sequence[float] | torch.Tensor]], clip_range: float
) -> NoiseFloor:
    """Per step, the share of identical-weight ratios `clip_range` cuts, and a verdict.

    Args:
        log_ratios: In-window step -> (its sigma, the per-sample log_prob_new - log_prob_old).
        clip_range: The PPO clip range epsilon (> 0): a ratio is clipped when |ratio - 1| >
            clip_range.

    Returns:
        A NoiseFloor.

    Raises:
        ValueError: clip_range not a finite number > 0.
    """
    if not isinstance(clip_range, int | float) or not 0.0 < float(clip_range) < math.inf:
        raise ValueError(
            f"noise_floor: clip_range must be a finite number > 0 (Flow-GRPO's default is "
            f"1e-4), got {clip_range!r}."
        )
    clip = float(clip_range)
    rows = []
    for step in sorted(log_ratios):
        sigma, values = log_ratios[step]
        lr = torch.as_tensor(values, dtype=torch.float64).flatten()
        if not lr.numel():
            continue
        dev = (lr.exp() - 1).abs()
        clipped = int((dev > clip).sum())
        q = torch.quantile(lr.abs(), torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
        worst = float(dev.max())
        rows.append(
            NoiseFloorStep(
                step=int(step),
                sigma=float(sigma),
                samples=lr.numel(),
                clipped=clipped,
                clip_frac=clipped / lr.numel(),
                log_ratio_abs_p50=q[0],
                log_ratio_abs_p99=q[1],
                log_ratio_abs_max=float(lr.abs().max()),
                ratio_max_abs_minus_1=worst,
                margin=clip / worst if worst > 0 else math.inf,
            )
        )
    return NoiseFloor(clip, rows, _verdict(clip, rows))


def _verdict(clip_range: float, rows: Sequence[NoiseFloorStep]) -> str:
    clip = _short(clip_range)
    if not rows:
        return f"clip_range {clip}: no SDE step was scored, so there is no noise floor to test."
    below = [r for r in rows if r.clipped]
    total = sum(r.samples for r in rows)
    if below:
        cut = sum(r.clipped for r in below)
        seen = sum(r.samples for r in below)
        overall = sum(r.clipped for r in rows) / total
        return (
            f"clip_range {clip} is below the numeric noise floor at "
            f"{_step_ranges([r.step for r in below])}: {_percent(cut / seen)} of ratios clipped "
            f"with no update ({cut} of {seen} there; {_percent(overall)} of all {total} "
            f"in-window ratios)."
        )
    worst = max(rows, key=lambda r: r.ratio_max_abs_minus_1)
    if worst.ratio_max_abs_minus_1 == 0.0:
        return (
            f"clip_range {clip} is above the numeric noise floor at every step: every ratio "
            f"is exactly 1.0 (the two sides agree bit for bit)."
        )
    return (
        f"clip_range {clip} is above the numeric noise floor at every step: the largest "
        f"|ratio - 1| is {worst.ratio_max_abs_minus_1:.3g} (step {worst.step}), "
        f"{worst.margin:.3g}x below it."
    )


def _step_ranges(steps: Sequence[int]) -> str:
    """[2, 4, 5, 6] -> "steps 2, 4-6"; [3] -> "step 3"."""
    parts: list[str] = []
    start = prev = steps[0]
    for s in [*steps[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    word = "step" if len(steps) == 1 else "steps"
    return f"{word} {', '.join(parts)}"


def _short(value: float) -> str:
    """1e-4 -> "1e-4", 2.5e-05 -> "2.5e-5", 0.02 -> "0.02" (as a clip range is written)."""
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:g}"
    mantissa, exponent = f"{value:.3e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _percent(frac: float) -> str:
    pct = 100 * frac
    return f"{pct:.0f} %" if pct >= 1 or pct == 0 else f"{pct:.2g} %"

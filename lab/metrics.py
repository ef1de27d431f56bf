"""Pure tensor -> number functions: abs, rel, ULP, bit-exact share, cosine, rounding-only check.

Everything for one pair is computed on the tensors' device into one small float64 vector
(`pair_stats`), so a paired forward never syncs with the host per module; `decode_stats` turns
the stacked vectors into numbers once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Mantissa bits decide which dtype is coarser; a ULP is counted in the coarser one.
_MANTISSA_BITS: dict[torch.dtype, int] = {
    torch.bfloat16: 7,
    torch.float16: 10,
    torch.float32: 23,
    torch.float64: 52,
}
_INT_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}

ULP_BIN_EDGES: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 16.0, 64.0, 256.0, 4096.0, 65536.0)
"""Histogram bins [0], [1], [2, 3], [4, 15], ... [65536, inf): one count per bin."""
ULP_BIN_LABELS: tuple[str, ...] = (
    "0", "1", "2-3", "4-15", "16-63", "64-255", "256-4095", "4096-65535", ">=65536",
)  # fmt: skip

STAT_FIELDS: tuple[str, ...] = (
    "numel", "finite", "sum_abs_diff", "max_abs_diff", "max_abs_a", "max_abs_b", "max_ulp",
    "bitexact", "dot", "norm2_a", "norm2_b", "nonfinite_a", "nonfinite_b",
    "max_abs_diff_rounded", "degenerate_a", "degenerate_b", "mean_a", "mean_b",
)  # fmt: skip
_N = len(STAT_FIELDS)


def coarser_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype with fewer mantissa bits (bf16 < fp16 < fp32 < fp64).

    Raises:
        ValueError: For a non-floating dtype.
    """
    for d in (a, b):
        if d not in _MANTISSA_BITS:
            raise ValueError(f"coarser_dtype: {d} is not a floating dtype the lab compares.")
    return a if _MANTISSA_BITS[a] <= _MANTISSA_BITS[b] else b


def _sign_magnitude(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bit and magnitude bits of each float, as int64."""
    bits = x.view(_INT_VIEW[x.dtype]).to(torch.int64)
    width = torch.finfo(x.dtype).bits
    return bits < 0, bits & ((1 << (width - 1)) - 1)


def ulp_distance(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Count representable values between paired elements, in their shared dtype.

    Both tensors must share shape and dtype: a bf16 ULP and an fp32 ULP are different units,
    so a mixed pair is an error rather than a silent upcast (round first, see `pair_stats`).

    Returns:
        float64 tensor shaped like the inputs; 0 where the two are bit-identical (or +0/-0).

    Raises:
        ValueError: On a shape or dtype mismatch, naming both.
    """
    if reference.shape != candidate.shape or reference.dtype != candidate.dtype:
        raise ValueError(
            f"ulp_distance: needs equal shape and dtype, got {tuple(reference.shape)} "
            f"{reference.dtype} vs {tuple(candidate.shape)} {candidate.dtype}."
        )
    sign_a, mag_a = _sign_magnitude(reference)
    sign_b, mag_b = _sign_magnitude(candidate)
    # Same sign: the magnitudes' difference, exact in int64 for every dtype. Opposite signs: the
    # steps down to zero on one side plus up from it on the other (+0 and -0 are both zero),
    # summed in float64 so fp64 magnitudes cannot overflow.
    same = (mag_a - mag_b).abs().to(torch.float64)
    across = mag_a.to(torch.float64) + mag_b.to(torch.float64)
    return torch.where(sign_a == sign_b, same, across)


def pair_stats(
    reference: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """All per-pair statistics as one float64 vector plus the ULP histogram, on-device.

    Non-finite elements (on either side) are excluded from the difference statistics and
    counted per side. Differences are taken in float64, ULPs in the coarser dtype.

    Args:
        reference: The first side's tensor (rollout by default).
        candidate: The second side's tensor, same shape.

    Returns:
        (stats, histogram): float64 vectors of len(STAT_FIELDS) and len(ULP_BIN_EDGES).

    Raises:
        ValueError: On a shape mismatch or non-floating tensors.
    """
    if reference.shape != candidate.shape:
        raise ValueError(
            f"pair_stats: shapes differ: {tuple(reference.shape)} vs {tuple(candidate.shape)}."
        )
    coarse = coarser_dtype(reference.dtype, candidate.dtype)
    a64, b64 = reference.detach().to(torch.float64), candidate.detach().to(torch.float64)
    fin_a, fin_b = torch.isfinite(a64), torch.isfinite(b64)
    finite = fin_a & fin_b
    zero = torch.zeros((), dtype=torch.float64, device=a64.device)
    a_f, b_f = torch.where(finite, a64, zero), torch.where(finite, b64, zero)
    diff = (b_f - a_f).abs()
    ra, rb = reference.detach().to(coarse), candidate.detach().to(coarse)
    ulp = torch.where(finite, ulp_distance(ra, rb), zero)
    rounded_diff = torch.where(finite, (rb.to(torch.float64) - ra.to(torch.float64)).abs(), zero)
    numel = reference.numel()

    def _degenerate(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return torch.ones((), dtype=torch.float64, device=x.device)
        return (x.amax() == x.amin()).to(torch.float64)

    def _max(x: torch.Tensor) -> torch.Tensor:
        return x.amax() if x.numel() else zero

    stats = torch.stack(
        [
            torch.tensor(float(numel), dtype=torch.float64, device=a64.device),
            finite.sum().to(torch.float64),
            diff.sum(),
            _max(diff),
            _max(a_f.abs()),
            _max(b_f.abs()),
            _max(ulp),
            ((a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))).sum().to(torch.float64),
            (a_f * b_f).sum(),
            (a_f * a_f).sum(),
            (b_f * b_f).sum(),
            (~fin_a).sum().to(torch.float64),
            (~fin_b).sum().to(torch.float64),
            _max(rounded_diff),
            _degenerate(a_f),
            _degenerate(b_f),
            a_f.sum() / finite.sum().clamp(min=1),
            b_f.sum() / finite.sum().clamp(min=1),
        ]
    )
    edges = torch.tensor(ULP_BIN_EDGES, dtype=torch.float64, device=a64.device)
    bins = torch.bucketize(ulp[finite], edges, right=True) - 1
    hist = torch.bincount(bins, minlength=len(ULP_BIN_EDGES)).to(torch.float64)
    return stats, hist


@dataclass(frozen=True)
class PairMetrics:
    """The numbers one pair of tensors gives (reference first, candidate second)."""

    numel: int
    mean_abs_diff: float
    max_abs_diff: float
    rel_max: float
    """max|d| / (max|reference| + 1e-30), the seed's model_output_rel_max formula."""
    max_ulp: float
    bitexact_frac: float
    cosine_dist: float
    """1 - 2<a,b> / (|a|^2 + |b|^2): 0 for identical tensors, scale-aware."""
    rounding_only: bool
    """The dtypes differ and rounding both to the coarser one removes every difference."""
    max_abs_diff_rounded: float
    nonfinite_a: int
    nonfinite_b: int
    degenerate: bool
    """Both sides all-zero or constant: agreement here is not evidence of parity."""
    ulp_hist: tuple[int, ...]
    mean_a: float
    """Mean of the reference over the elements finite on both sides."""
    mean_b: float
    max_abs_a: float
    max_abs_b: float


def decode_stats(
    stats: torch.Tensor, hist: torch.Tensor, dtype_a: torch.dtype, dtype_b: torch.dtype
) -> PairMetrics:
    """Turn one (host-side) stats vector into named metrics."""
    s = dict(zip(STAT_FIELDS, stats.tolist(), strict=True))
    finite = max(s["finite"], 1.0)
    denom = s["norm2_a"] + s["norm2_b"]
    cosine = 1.0 - 2.0 * s["dot"] / denom if denom > 0 else 0.0
    return PairMetrics(
        numel=int(s["numel"]),
        mean_abs_diff=s["sum_abs_diff"] / finite,
        max_abs_diff=s["max_abs_diff"],
        rel_max=s["max_abs_diff"] / (s["max_abs_a"] + 1e-30),
        max_ulp=s["max_ulp"],
        bitexact_frac=s["bitexact"] / max(s["numel"], 1.0),
        cosine_dist=max(cosine, 0.0),
        rounding_only=bool(
            dtype_a != dtype_b and s["max_abs_diff"] > 0 and s["max_abs_diff_rounded"] == 0
        ),
        max_abs_diff_rounded=s["max_abs_diff_rounded"],
        nonfinite_a=int(s["nonfinite_a"]),
        nonfinite_b=int(s["nonfinite_b"]),
        degenerate=bool(s["degenerate_a"] and s["degenerate_b"]),
        ulp_hist=tuple(int(v) for v in hist.tolist()),
        mean_a=s["mean_a"],
        mean_b=s["mean_b"],
        max_abs_a=s["max_abs_a"],
        max_abs_b=s["max_abs_b"],
    )


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> PairMetrics:
    """Metrics of one pair, computed now (a convenience over pair_stats + decode_stats)."""
    stats, hist = pair_stats(reference, candidate)
    return decode_stats(stats.cpu(), hist.cpu(), reference.dtype, candidate.dtype)

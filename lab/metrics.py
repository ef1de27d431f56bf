"""Pure tensor -> number functions: abs, rel, ULP, bit-exact share, cosine, rounding-only check.

Everything for one pair is computed on the tensors' device into one small float64 vector
(`pair_stats`), so a paired forward never syncs with the host per module; `decode_stats` turns
the stacked vectors into numbers once, at the end.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    "0",
    "1",
    "2-3",
    "4-15",
    "16-63",
    "64-255",
    "256-4095",
    "4096-65535",
    ">=65536",
)

STAT_FIELDS: tuple[str, ...] = (
    "numel",
    "finite",
    "sum_abs_diff",
    "max_abs_diff",
    "max_abs_a",
    "max_abs_b",
    "max_ulp",
    "bitexact",
    "sum_sq_diff",
    "norm2_a",
    "norm2_b",
    "nonfinite_a",
    "nonfinite_b",
    "max_abs_diff_rounded",
    "degenerate_a",
    "degenerate_b",
    "mean_a",
    "mean_b",
)
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
    """Sign bit and magnitude bits of each float (int32 for 16-bit dtypes, int64 otherwise)."""
    wide = torch.int32 if x.element_size() == 2 else torch.int64
    bits = x.view(_INT_VIEW[x.dtype]).to(wide)
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
    return _ulp(reference, candidate).to(torch.float64)


def _ulp(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """ulp_distance in the narrowest exact float: fp32 for 16-bit dtypes, fp64 otherwise."""
    sign_a, mag_a = _sign_magnitude(reference)
    sign_b, mag_b = _sign_magnitude(candidate)
    if reference.element_size() == 2:
        # 16-bit magnitudes: every distance (< 2^16) is exact in int32 and in fp32.
        return torch.where(sign_a == sign_b, (mag_a - mag_b).abs(), mag_a + mag_b).float()
    # Same sign: the magnitudes' difference, exact in int64. Opposite signs: the steps down to
    # zero on one side plus up from it on the other (+0 and -0 are both zero), summed in
    # float64 so fp64 magnitudes cannot overflow.
    same = (mag_a - mag_b).abs().to(torch.float64)
    across = mag_a.to(torch.float64) + mag_b.to(torch.float64)
    return torch.where(sign_a == sign_b, same, across)


def pair_stats(
    reference: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """All statistics of one pair as a float64 vector plus its ULP histogram, on-device.

    Non-finite elements (on either side) are excluded from the difference statistics and
    counted per side. Differences are taken in fp32 (fp64 for fp64 tensors), ULPs in the
    coarser dtype, counts and sums accumulated in float64.

    Args:
        reference: The first side's tensor (rollout by default).
        candidate: The second side's tensor, same shape.

    Returns:
        (stats, histogram): float64 vectors of len(STAT_FIELDS) and len(ULP_BIN_EDGES).

    Raises:
        ValueError: On a shape mismatch or non-floating tensors.
    """
    stats, hist = segment_stats([(reference, candidate)])
    return stats[0], hist[0]


def segment_stats(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pair_stats` of many pairs at once: a few vectorised passes instead of ~40 ops a pair.

    Pairs are grouped by (coarser dtype, compute dtype), flattened into one buffer per group
    and reduced per segment, so a hundred small activations cost about as much as one.

    Returns:
        (stats, histograms): float64 tensors shaped (len(pairs), len(STAT_FIELDS)) and
        (len(pairs), len(ULP_BIN_EDGES)), in the order of `pairs`.

    Raises:
        ValueError: On a shape mismatch or a non-floating tensor, naming the pair's index.
    """
    if not pairs:
        raise ValueError("segment_stats: no pairs given.")
    device = pairs[0][0].device
    stats = torch.zeros(len(pairs), _N, dtype=torch.float64, device=device)
    hists = torch.zeros(len(pairs), len(ULP_BIN_EDGES), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        if a.shape != b.shape:
            raise ValueError(
                f"pair_stats: pair {i}: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}."
            )
        coarse = coarser_dtype(a.dtype, b.dtype)
        compute = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        if a.numel() == 0:
            stats[i, STAT_FIELDS.index("degenerate_a")] = 1.0
            stats[i, STAT_FIELDS.index("degenerate_b")] = 1.0
            continue
        groups.setdefault((coarse, compute), []).append(i)
    for (coarse, compute), index in groups.items():
        group_stats, group_hist = _group_stats([pairs[i] for i in index], coarse, compute)
        where = torch.tensor(index, device=device)
        stats[where] = group_stats
        hists[where] = group_hist
    return stats, hists


def _group_stats(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], coarse: torch.dtype, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    device = pairs[0][0].device
    if len(pairs) == 1:
        a, b = (t.detach().reshape(-1) for t in pairs[0])
        return _single_stats(device)(a, b, coarse, compute)
    sizes = [a.numel() for a, _ in pairs]
    a = torch.cat([p[0].detach().reshape(-1).to(compute) for p in pairs])
    b = torch.cat([p[1].detach().reshape(-1).to(compute) for p in pairs])
    ra = torch.cat([p[0].detach().reshape(-1).to(coarse) for p in pairs])
    rb = torch.cat([p[1].detach().reshape(-1).to(coarse) for p in pairs])
    lengths = torch.tensor(sizes, device=device)

    def seg(x: torch.Tensor, op: str) -> torch.Tensor:
        x = x.to(torch.float64) if op == "sum" else x
        return torch.segment_reduce(x, op, lengths=lengths).to(torch.float64)

    return _stats_from(a, b, ra, rb, compute, seg)


def _stats_from(
    a: torch.Tensor,
    b: torch.Tensor,
    ra: torch.Tensor,
    rb: torch.Tensor,
    compute: torch.dtype,
    seg: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise core shared by the segmented and the single-pair (compiled) paths."""
    f64 = torch.float64
    fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
    finite = fin_a & fin_b
    zero = torch.zeros((), dtype=compute, device=a.device)
    a_f, b_f = torch.where(finite, a, zero), torch.where(finite, b, zero)
    diff = (b_f - a_f).abs()
    ulp = torch.where(finite, _ulp(ra, rb), 0)
    rounded = torch.where(finite, (rb.to(compute) - ra.to(compute)).abs(), zero)
    count = seg(finite, "sum")
    columns = {
        "numel": seg(torch.ones_like(finite), "sum"),
        "finite": count,
        "sum_abs_diff": seg(diff, "sum"),
        "max_abs_diff": seg(diff, "max"),
        "max_abs_a": seg(a_f.abs(), "max"),
        "max_abs_b": seg(b_f.abs(), "max"),
        "max_ulp": seg(ulp, "max"),
        "bitexact": seg((a == b) | (torch.isnan(a) & torch.isnan(b)), "sum"),
        # |a - b|^2 rather than 2<a,b>: 1 - 2<a,b>/(|a|^2+|b|^2) equals |a-b|^2/(|a|^2+|b|^2)
        # and the latter keeps its digits when the two tensors nearly agree.
        "sum_sq_diff": seg(diff * diff, "sum"),
        "norm2_a": seg(a_f * a_f, "sum"),
        "norm2_b": seg(b_f * b_f, "sum"),
        "nonfinite_a": seg(~fin_a, "sum"),
        "nonfinite_b": seg(~fin_b, "sum"),
        "max_abs_diff_rounded": seg(rounded, "max"),
        "degenerate_a": (seg(a_f, "max") == seg(a_f, "min")).to(f64),
        "degenerate_b": (seg(b_f, "max") == seg(b_f, "min")).to(f64),
        "mean_a": seg(a_f, "sum") / count.clamp(min=1),
        "mean_b": seg(b_f, "sum") / count.clamp(min=1),
    }
    stats = torch.stack([columns[name] for name in STAT_FIELDS], dim=1)
    # Counts at or above each bin edge, then differences: comparisons and sums only, so the
    # single-pair path fuses under torch.compile (bincount would not).
    at_least = torch.stack([seg(finite & (ulp >= edge), "sum") for edge in ULP_BIN_EDGES], dim=1)
    above = torch.cat([at_least[:, 1:], torch.zeros_like(at_least[:, :1])], dim=1)
    return stats, at_least - above


def _single_core(
    a: torch.Tensor, b: torch.Tensor, coarse: torch.dtype, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    def seg(x: torch.Tensor, op: str) -> torch.Tensor:
        if op == "sum":
            return x.sum(dtype=torch.float64).reshape(1)
        return (x.amax() if op == "max" else x.amin()).to(torch.float64).reshape(1)

    return _stats_from(a.to(compute), b.to(compute), a.to(coarse), b.to(coarse), compute, seg)


_COMPILED: dict[str, Any] = {}


def _single_stats(device: torch.device) -> Any:
    """The single-pair core: compiled into a few fused kernels on CUDA, eager elsewhere.

    Set LAB_COMPILE_METRICS=0 to use the eager version on CUDA too (a compile failure also
    falls back to it, once, with a warning).
    """
    if device.type != "cuda" or os.environ.get("LAB_COMPILE_METRICS", "1") == "0":
        return _single_core
    if "cuda" not in _COMPILED:
        # emulate_precision_casts: without it inductor folds x.to(bf16).to(fp32) into x, which
        # would erase exactly the rounding the rounding-only check measures.
        compiled = torch.compile(
            _single_core, dynamic=True, options={"emulate_precision_casts": True}
        )

        def guarded(*args: Any) -> Any:
            if _COMPILED.get("failed"):
                return _single_core(*args)
            try:
                return compiled(*args)
            except Exception as err:  # inductor unavailable or an unsupported op
                warnings.warn(
                    f"metrics: torch.compile failed ({err!r:.200}); using eager.", stacklevel=2
                )
                _COMPILED["failed"] = True
                return _single_core(*args)

        _COMPILED["cuda"] = guarded
    return _COMPILED["cuda"]


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
    cosine = s["sum_sq_diff"] / denom if denom > 0 else 0.0
    return PairMetrics(
        numel=int(s["numel"]),
        mean_abs_diff=s["sum_abs_diff"] / finite,
        max_abs_diff=s["max_abs_diff"],
        rel_max=s["max_abs_diff"] / (s["max_abs_a"] + 1e-30),
        max_ulp=s["max_ulp"],
        bitexact_frac=s["bitexact"] / s["numel"] if s["numel"] else 1.0,
        cosine_dist=max(cosine, 0.0),
        rounding_only=bool(
            dtype_a != dtype_b and s["max_abs_diff"] > 0 and s["max_abs_diff_rounded"] == 0
        ),
        max_abs_diff_rounded=s["max_abs_diff_rounded"],
        nonfinite_a=int(s["nonfinite_a"]),
        nonfinite_b=int(s["nonfinite_b"]),
        # One element is trivially constant: only larger tensors can be degenerate.
        degenerate=bool(s["numel"] > 1 and s["degenerate_a"] and s["degenerate_b"]),
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

"""The layout every metrics core shares: the statistic vector, the ULP bins, the coarse dtype.

`lab.pairing.metrics` (the torch cores) and `lab.pairing._fused_stats` (the Triton core) both
write this layout, so it lives one floor below them.
"""

from __future__ import annotations

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


def coarser_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype with fewer mantissa bits (bf16 < fp16 < fp32 < fp64).

    Raises:
        ValueError: For a non-floating dtype.
    """
    for d in (a, b):
        if d not in _MANTISSA_BITS:
            raise ValueError(f"coarser_dtype: {d} is not a floating dtype the lab compares.")
    return a if _MANTISSA_BITS[a] <= _MANTISSA_BITS[b] else b

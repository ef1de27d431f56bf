"""One-pass Triton kernel for the single-pair statistics of `lab.pairing.metrics`.

`fused_pair_stats(a, b)` returns what
`lab.pairing.metrics._single_core(a, b, coarse, compute)` returns
(as 1-D vectors) while reading each input once. Every Triton program walks a grid-strided set
of tiles; each thread keeps its own running sums, maxima and counts in registers (no
cross-thread traffic inside the loop), and at the end the program reduces its threads and
writes one row of partials (float64). A second, one-program kernel folds the rows into the
final vectors (in a fixed order, so results are deterministic) and the host never waits for the
GPU. (A chain of small torch ops did that fold first: ~115 us of host time a pair, against
~25 us for this launch; a whole call costs ~90 us of host time.)

Semantics reproduced from `lab.pairing.metrics._stats_from`:

- compute dtype: fp64 if either side is fp64, else fp32; both sides are widened exactly.
- coarse dtype: `coarser_dtype(a.dtype, b.dtype)`; one side already is it, the other is rounded
  to nearest even the way torch's `.to()` rounds: fp64 goes through fp32 first (torch rounds
  fp64 -> fp16/bf16 twice), values beyond the coarse range become inf.
- non-finite elements (either side) are left out of every difference statistic and of the
  histogram; `bitexact` counts `a == b` or both NaN over all elements.
- ULP distances between the coarse sign/magnitude bit patterns (opposite signs add the
  magnitudes), exact in integers (float64 for fp64, as the reference).
- every summand is computed in the compute dtype (so rounded and overflowing like the
  reference) and added in float64: only the order of the float64 additions differs from
  torch. Counts, maxima and the histogram are exact.
- `max_abs_diff_rounded` cannot be NaN: the coarse side is never rounded, so on finite
  elements one of the two rounded values is finite and the difference is at worst inf.

Tiles and launch shape (chosen on an H200: 132 SMs, a plain read of both inputs at ~4 TB/s). A tile
is a [THREADS, UNROLL, VEC] block: thread t reads UNROLL vectors of VEC contiguous elements,
VEC = 16 bytes of the wider input, so a warp's load covers 32 * 16 contiguous bytes, and the
last two axes stay inside one thread (Triton's layout on sm_90, checked in the generated code:
no shuffles or barriers in the loop), so accumulating costs no cross-thread traffic. Defaults:
NUM_WARPS = 4 (THREADS = 128) and ELEMENTS_PER_THREAD = 16 (8 with an fp64 side), which keep
registers at ~128 (fp32, bf16 pairs), and PROGRAMS_PER_SM = 8 grid-strided programs: at most
1056 partial rows of 29 float64 on an H200, whatever the size. The kernel is bound by its ~75
instructions an element (11 counters, 6 float64 sums, 7 maxima), not by memory: on the H200 it
ran at 1.0-1.2 TB/s for bf16 pairs and 2.0-2.6 TB/s for fp32 pairs, about 6-8x the
torch.compile path (`bench/metric_kernels.py --sweep` times other launch shapes: none was more
than ~7% faster).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from typing import Any

import numpy as np
import torch

from lab.pairing.stats_layout import STAT_FIELDS, ULP_BIN_EDGES, coarser_dtype

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels ship without triton: `available` says False
    triton = None
    tl = None

NUM_WARPS = 4
ELEMENTS_PER_THREAD = 16
"""Elements a thread takes from each input per tile: UNROLL = this / VEC vectors."""
ELEMENTS_PER_THREAD_FP64 = 8
"""The same where a side is fp64: wider values, more registers an element."""
PROGRAMS_PER_SM = 8
"""Grid cap on CUDA: at most this many programs (each looping over tiles) per multiprocessor."""
_INTERPRETER_PROGRAMS = 4
"""Grid cap under the CPU interpreter, which runs programs one after the other."""

_KIND: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}

# The kernel hard-codes these edges (see `_count_at_least`).
if tuple(ULP_BIN_EDGES) != (0.0, 1.0, 2.0, 4.0, 16.0, 64.0, 256.0, 4096.0, 65536.0):
    raise RuntimeError(
        f"_fused_stats: ULP_BIN_EDGES changed to {ULP_BIN_EDGES}; update _count_at_least."
    )
_BINS = len(ULP_BIN_EDGES)

# Columns of one program's partial row, in the order the kernel stores them. The first block
# is reduced across programs by a sum, the second by a max (minima are stored negated).
_SUM_COLS: tuple[str, ...] = (
    "numel",
    "finite",
    "sum_abs_diff",
    "bitexact",
    "sum_sq_diff",
    "norm2_a",
    "norm2_b",
    "nonfinite_a",
    "nonfinite_b",
    "sum_a",
    "sum_b",
    *(f"hist{k}" for k in range(_BINS)),
)
_MAX_COLS: tuple[str, ...] = (
    "max_abs_diff",
    "max_abs_a",
    "max_abs_b",
    "max_ulp",
    "max_abs_diff_rounded",
    "max_a",
    "max_b",
    "negmin_a",
    "negmin_b",
)
_DERIVED_COLS: tuple[str, ...] = ("degenerate_a", "degenerate_b", "mean_a", "mean_b")
"""Computed from the reduced columns: max == min of a side, and its sum over `finite`."""
_N_SUM = len(_SUM_COLS)
_N_COLS = _N_SUM + len(_MAX_COLS)
_HIST0 = _SUM_COLS.index("hist0")


def _destinations() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where each reduced column and each derived value goes in the STAT_FIELDS vector.

    Returns:
        (columns, derived): the STAT_FIELDS index of each of the _SUM_COLS + _MAX_COLS (-1 for
        those kept only to derive others, and the histogram) and of each _DERIVED_COLS.

    Raises:
        RuntimeError: If STAT_FIELDS names a statistic the kernel does not produce.
    """
    produced = set(_SUM_COLS) | set(_MAX_COLS) | set(_DERIVED_COLS)
    missing = [name for name in STAT_FIELDS if name not in produced]
    if missing:
        raise RuntimeError(f"_fused_stats: no kernel column for the statistics {missing}.")
    index = {name: i for i, name in enumerate(STAT_FIELDS)}
    columns = tuple(index.get(name, -1) for name in (*_SUM_COLS, *_MAX_COLS))
    return columns, tuple(index[name] for name in _DERIVED_COLS)


_DEST_COLUMNS, _DEST_DERIVED = _destinations()
_DERIVED_FROM = tuple(
    (*_SUM_COLS, *_MAX_COLS).index(name)
    for name in ("finite", "sum_a", "sum_b", "max_a", "max_b", "negmin_a", "negmin_b")
)
"""The columns `_finish_kernel` derives degenerate_a/b and mean_a/b from, in this order."""


def _jit(fn):
    """`triton.jit` when triton is importable; the plain function otherwise (never launched)."""
    return triton.jit(fn) if triton is not None else fn


# ---- kernel ------------------------------------------------------------------------------
# Tiles are [THREADS, UNROLL, VEC]; `_per_thread_*` reduce the last two axes, which Triton keeps
# inside one thread, so the running accumulators are [THREADS] vectors: one value a thread.


@_jit
def _per_thread_sum(x):
    return tl.sum(tl.sum(x, axis=2), axis=1)


@_jit
def _per_thread_max(x):
    return tl.max(tl.max(x, axis=2), axis=1)


@_jit
def _widen(raw, KIND: tl.constexpr, COMPUTE64: tl.constexpr):
    """A loaded tile in the compute dtype, exactly (`x.to(compute)`)."""
    if KIND == "bf16":
        # bf16 arrives as its int16 bit pattern: the fp32 with the same top 16 bits.
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif KIND == "fp16":
        x = raw.to(tl.float32)
    else:
        x = raw
    if COMPUTE64:
        x = x.to(tl.float64)
    return x


@_jit
def _fp32_to_bf16(x32):
    """Round fp32 to bf16, nearest even, in integers: (sign, magnitude bits << 16, value).

    Exact for every finite input, subnormals included, and overflows to inf like torch (the
    CPU interpreter's own fp32 -> bf16 cast truncates). NaN/inf inputs give unused garbage.
    """
    bits = x32.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # Add just under half a bf16 step, plus one when the kept part is odd (ties to even), then
    # clear the 16 dropped bits.
    mag = (mag + 0x7FFF + ((mag >> 16) & 1)) & -65536
    value = (mag | (bits & -2147483648)).to(tl.float32, bitcast=True)  # sign bit back
    return bits < 0, mag, value


@_jit
def _coarse(raw, KIND: tl.constexpr, COARSE: tl.constexpr, COMPUTE64: tl.constexpr):
    """`raw.to(coarse)` as torch computes it: (sign, magnitude bits, value in compute dtype).

    Magnitudes are int32, int64 for fp64; bf16 ones are kept as the magnitude of the fp32 with
    the same value (the bf16 magnitude << 16), which saves unpacking 16-bit halves.
    """
    if KIND == COARSE:
        # The coarse side: its own bit pattern, nothing rounded.
        if KIND == "fp64":
            bits = raw.to(tl.int64, bitcast=True)
            mag = bits & 0x7FFFFFFFFFFFFFFF
        elif KIND == "fp16":
            bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
            mag = bits & 0x7FFF
        else:  # fp32, or bf16 widened to fp32 (see above)
            bits = _widen(raw, KIND, False).to(tl.int32, bitcast=True)
            mag = bits & 0x7FFFFFFF
        sign = bits < 0
        value = _widen(raw, KIND, COMPUTE64)
    else:
        # The finer side, rounded to nearest even. torch takes fp64 -> fp16/bf16 through fp32
        # (two roundings), so fp32 is the first step from every source (bf16, the coarsest
        # dtype, is never rounded).
        x32 = raw if KIND == "fp32" else raw.to(tl.float32)
        if COARSE == "bf16":
            sign, mag, value = _fp32_to_bf16(x32)
        elif COARSE == "fp16":
            x16 = x32.to(tl.float16)  # nearest even, inf beyond 65504, subnormals (like torch)
            bits = x16.to(tl.int16, bitcast=True).to(tl.int32)
            sign, mag, value = bits < 0, bits & 0x7FFF, x16.to(tl.float32)
        else:  # fp32, from fp64
            bits = x32.to(tl.int32, bitcast=True)
            sign, mag, value = bits < 0, bits & 0x7FFFFFFF, x32
        if COMPUTE64:
            value = value.to(tl.float64)
    return sign, mag, value


@_jit
def _ulp(sign_a, mag_a, sign_b, mag_b, COARSE: tl.constexpr):
    """Representable values between the two coarse values (`lab.pairing.metrics._ulp`).

    float64 for fp64 (as the reference), uint32 for fp32, int32 for fp16 and, for bf16, uint32
    counting in units of 2^16 (the magnitudes are shifted, see `_coarse`).
    """
    if COARSE == "fp64":
        # As the reference: the int64 gap, or both magnitudes summed in float64.
        same = tl.abs(mag_a - mag_b).to(tl.float64)
        across = mag_a.to(tl.float64) + mag_b.to(tl.float64)
    elif COARSE == "fp16":  # 16-bit magnitudes: everything fits int32
        same = tl.abs(mag_a - mag_b)
        across = mag_a + mag_b
    else:
        # Magnitudes < 2^31: the gap fits int32, the sum across zero (< 2^32) fits uint32.
        same = tl.abs(mag_a - mag_b).to(tl.uint32)
        across = mag_a.to(tl.uint32) + mag_b.to(tl.uint32)
    return tl.where(sign_a == sign_b, same, across)


@_jit
def _count_at_least(counts, ulp, COARSE: tl.constexpr):
    """Add, per thread, the elements with ulp >= each ULP_BIN_EDGES edge above 0.

    Non-finite (and padding) elements have ulp 0, so they reach no edge. 16-bit magnitudes
    stay below 0x7F81, so their ulp never reaches 65536.
    """
    ge1, ge2, ge4, ge16, ge64, ge256, ge4096, ge65536 = counts
    unit: tl.constexpr = 65536 if COARSE == "bf16" else 1  # bf16 ULPs come shifted by 16
    ge1 += _per_thread_sum((ulp >= 1 * unit).to(tl.int32))
    ge2 += _per_thread_sum((ulp >= 2 * unit).to(tl.int32))
    ge4 += _per_thread_sum((ulp >= 4 * unit).to(tl.int32))
    ge16 += _per_thread_sum((ulp >= 16 * unit).to(tl.int32))
    ge64 += _per_thread_sum((ulp >= 64 * unit).to(tl.int32))
    ge256 += _per_thread_sum((ulp >= 256 * unit).to(tl.int32))
    ge4096 += _per_thread_sum((ulp >= 4096 * unit).to(tl.int32))
    if COARSE == "fp32" or COARSE == "fp64":
        ge65536 += _per_thread_sum((ulp >= 65536).to(tl.int32))
    return ge1, ge2, ge4, ge16, ge64, ge256, ge4096, ge65536


@_jit
def _accumulate(
    a_ptr,
    b_ptr,
    offs,
    valid,
    sums,
    maxima,
    counts,
    at_least,
    A: tl.constexpr,
    B: tl.constexpr,
    COARSE: tl.constexpr,
    COMPUTE64: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Fold one tile into the per-thread accumulators (see `_pair_stats_kernel`).

    MASKED is only set for the partial last tile, where `valid` marks the real elements; full
    tiles load without bounds checks.
    """
    if MASKED:
        raw_a = tl.load(a_ptr + offs, mask=valid, other=0)
        raw_b = tl.load(b_ptr + offs, mask=valid, other=0)
    else:
        raw_a = tl.load(a_ptr + offs)
        raw_b = tl.load(b_ptr + offs)
    a = _widen(raw_a, A, COMPUTE64)
    b = _widen(raw_b, B, COMPUTE64)

    # isfinite: |x| < inf is False for +-inf and NaN. Padding loads 0: finite, masked below.
    fin_a = tl.abs(a) < float("inf")
    fin_b = tl.abs(b) < float("inf")
    finite = fin_a & fin_b
    a_f = tl.where(finite, a, 0.0)
    b_f = tl.where(finite, b, 0.0)
    diff = tl.abs(b_f - a_f)

    sign_a, mag_a, coarse_a = _coarse(raw_a, A, COARSE, COMPUTE64)
    sign_b, mag_b, coarse_b = _coarse(raw_b, B, COARSE, COMPUTE64)
    ulp = tl.where(finite, _ulp(sign_a, mag_a, sign_b, mag_b, COARSE), 0)
    if A == COARSE and B == COARSE:
        rounded = diff  # neither side was rounded: the same numbers
    else:
        rounded = tl.where(finite, tl.abs(coarse_b - coarse_a), 0.0)
    bitexact = (a == b) | ((a != a) & (b != b))

    # Sums: each summand rounded in the compute dtype first (as the reference), added in fp64.
    s_diff, s_sq, s_a2, s_b2, s_a, s_b = sums
    s_diff += _per_thread_sum(diff.to(tl.float64))
    s_sq += _per_thread_sum((diff * diff).to(tl.float64))
    s_a2 += _per_thread_sum((a_f * a_f).to(tl.float64))
    s_b2 += _per_thread_sum((b_f * b_f).to(tl.float64))
    s_a += _per_thread_sum(a_f.to(tl.float64))
    s_b += _per_thread_sum(b_f.to(tl.float64))

    # Maxima: diff, rounded and ulp are >= 0 and padding gives 0, so only the signed extremes
    # (for max|x| and the degenerate check) must skip padding.
    m_diff, m_round, m_ulp, m_a, m_b, nm_a, nm_b = maxima
    m_diff = tl.maximum(m_diff, _per_thread_max(diff))
    m_round = tl.maximum(m_round, _per_thread_max(rounded))
    m_ulp = tl.maximum(m_ulp, _per_thread_max(ulp))
    if MASKED:
        m_a = tl.maximum(m_a, _per_thread_max(tl.where(valid, a_f, -float("inf"))))
        m_b = tl.maximum(m_b, _per_thread_max(tl.where(valid, b_f, -float("inf"))))
        nm_a = tl.maximum(nm_a, _per_thread_max(tl.where(valid, -a_f, -float("inf"))))
        nm_b = tl.maximum(nm_b, _per_thread_max(tl.where(valid, -b_f, -float("inf"))))
    else:
        m_a = tl.maximum(m_a, _per_thread_max(a_f))
        m_b = tl.maximum(m_b, _per_thread_max(b_f))
        nm_a = tl.maximum(nm_a, _per_thread_max(-a_f))
        nm_b = tl.maximum(nm_b, _per_thread_max(-b_f))

    c_fin_a, c_fin_b, c_finite, c_bitexact = counts
    if MASKED:
        fin_a = fin_a & valid
        fin_b = fin_b & valid
        finite = finite & valid
        bitexact = bitexact & valid
    c_fin_a += _per_thread_sum(fin_a.to(tl.int32))
    c_fin_b += _per_thread_sum(fin_b.to(tl.int32))
    c_finite += _per_thread_sum(finite.to(tl.int32))
    c_bitexact += _per_thread_sum(bitexact.to(tl.int32))
    return (
        (s_diff, s_sq, s_a2, s_b2, s_a, s_b),
        (m_diff, m_round, m_ulp, m_a, m_b, nm_a, nm_b),
        (c_fin_a, c_fin_b, c_finite, c_bitexact),
        _count_at_least(at_least, ulp, COARSE),
    )


@_jit
def _pair_stats_kernel(
    a_ptr,
    b_ptr,
    part_ptr,
    n,
    A: tl.constexpr,
    B: tl.constexpr,
    COARSE: tl.constexpr,
    COMPUTE64: tl.constexpr,
    THREADS: tl.constexpr,
    UNROLL: tl.constexpr,
    VEC: tl.constexpr,
    N_COLS: tl.constexpr,
):
    """One row of partials per program (`_SUM_COLS` then `_MAX_COLS`): `_pair_program`."""
    pid = tl.program_id(0)
    _pair_program(
        a_ptr, b_ptr, part_ptr + pid.to(tl.int64) * N_COLS, n, pid, tl.num_programs(0),
        A, B, COARSE, COMPUTE64, THREADS, UNROLL, VEC,
    )  # fmt: skip


@_jit
def _multi_pair_stats_kernel(
    a_base,
    b_base,
    pairs_ptr,
    owner_ptr,
    part_ptr,
    A: tl.constexpr,
    B: tl.constexpr,
    COARSE: tl.constexpr,
    COMPUTE64: tl.constexpr,
    THREADS: tl.constexpr,
    UNROLL: tl.constexpr,
    VEC: tl.constexpr,
    N_COLS: tl.constexpr,
    ALIGN_A: tl.constexpr,
    ALIGN_B: tl.constexpr,
):
    """`_pair_stats_kernel` for many pairs of one dtype pair in one launch.

    Pair p has a row of `_PAIR_META` int64s in `pairs_ptr`: where its a and b start, in
    elements from `a_base` and `b_base` (the first pair's tensors, typed pointers), its numel,
    its own grid G_p and its first partial row R_p. Program R_p + j (`owner_ptr` names p) runs
    exactly what program j of a single-pair launch of grid G_p runs, so its partial row is
    that row, bit for bit. ALIGN_A / ALIGN_B > 1: every a (b) of the launch, and its base,
    starts on 16 bytes = that many elements (checked on the host, as Triton specializes a
    single launch's pointers), so the loads are 16-byte vectors as there.
    """
    pid = tl.program_id(0)
    pair = tl.load(owner_ptr + pid).to(tl.int64)
    meta = pairs_ptr + pair * 5
    offset_a = tl.load(meta + 0)
    offset_b = tl.load(meta + 1)
    if ALIGN_A > 1:
        offset_a = tl.multiple_of(offset_a, ALIGN_A)
    if ALIGN_B > 1:
        offset_b = tl.multiple_of(offset_b, ALIGN_B)
    n = tl.load(meta + 2)
    grid = tl.load(meta + 3)
    first = tl.load(meta + 4)
    _pair_program(
        a_base + offset_a, b_base + offset_b, part_ptr + pid.to(tl.int64) * N_COLS, n,
        pid - first, grid, A, B, COARSE, COMPUTE64, THREADS, UNROLL, VEC,
    )  # fmt: skip


@_jit
def _pair_program(
    a_ptr,
    b_ptr,
    row,
    n,
    pid,
    n_programs,
    A: tl.constexpr,
    B: tl.constexpr,
    COARSE: tl.constexpr,
    COMPUTE64: tl.constexpr,
    THREADS: tl.constexpr,
    UNROLL: tl.constexpr,
    VEC: tl.constexpr,
):
    """Program `pid` of `n_programs` over one pair: its row of partials at `row`.

    The program folds the full tiles pid, pid + P, pid + 2P, ... and, if it is the first
    program with one full tile fewer than the rest, the partial last tile.
    """
    TILE: tl.constexpr = THREADS * UNROLL * VEC
    # Thread t's elements: UNROLL runs of VEC contiguous ones, a warp's run 32 * VEC long.
    local = (
        tl.arange(0, THREADS)[:, None, None] * VEC
        + tl.arange(0, UNROLL)[None, :, None] * (THREADS * VEC)
        + tl.arange(0, VEC)[None, None, :]
    )

    f64 = tl.zeros([THREADS], tl.float64)
    if COMPUTE64:
        zero = tl.zeros([THREADS], tl.float64)
    else:
        zero = tl.zeros([THREADS], tl.float32)
    if COARSE == "fp64":
        zero_ulp = tl.zeros([THREADS], tl.float64)
    elif COARSE == "fp16":
        zero_ulp = tl.zeros([THREADS], tl.int32)
    else:
        zero_ulp = tl.zeros([THREADS], tl.uint32)
    count = tl.zeros([THREADS], tl.int32)
    low = zero - float("inf")
    sums = (f64, f64, f64, f64, f64, f64)
    maxima = (zero, zero, zero_ulp, low, low, low, low)
    counts = (count, count, count, count)
    at_least = (count, count, count, count, count, count, count, count)

    n_full = n // TILE
    # A while loop: the CPU interpreter cannot take a runtime bound in range().
    tile = pid
    while tile < n_full:
        offs = tile.to(tl.int64) * TILE + local
        sums, maxima, counts, at_least = _accumulate(
            a_ptr, b_ptr, offs, offs < n, sums, maxima, counts, at_least,
            A, B, COARSE, COMPUTE64, False,
        )  # fmt: skip
        tile += n_programs
    n_seen = ((n_full - pid + n_programs - 1) // n_programs).to(tl.int64) * TILE
    if (n_full * TILE < n) & (pid == n_full % n_programs):
        offs = n_full.to(tl.int64) * TILE + local
        sums, maxima, counts, at_least = _accumulate(
            a_ptr, b_ptr, offs, offs < n, sums, maxima, counts, at_least,
            A, B, COARSE, COMPUTE64, True,
        )  # fmt: skip
        n_seen += n - n_full * TILE

    # Reduce the threads and store the row: _SUM_COLS at row + 0..19, _MAX_COLS at 20..28.
    s_diff, s_sq, s_a2, s_b2, s_a, s_b = sums
    m_diff, m_round, m_ulp, m_a, m_b, nm_a, nm_b = maxima
    c_fin_a, c_fin_b, c_finite, c_bitexact = counts
    finite = tl.sum(c_finite.to(tl.int64))
    tl.store(row + 0, n_seen.to(tl.float64))
    tl.store(row + 1, finite.to(tl.float64))
    tl.store(row + 2, tl.sum(s_diff))
    tl.store(row + 3, tl.sum(c_bitexact.to(tl.int64)).to(tl.float64))
    tl.store(row + 4, tl.sum(s_sq))
    tl.store(row + 5, tl.sum(s_a2))
    tl.store(row + 6, tl.sum(s_b2))
    tl.store(row + 7, (n_seen - tl.sum(c_fin_a.to(tl.int64))).to(tl.float64))
    tl.store(row + 8, (n_seen - tl.sum(c_fin_b.to(tl.int64))).to(tl.float64))
    tl.store(row + 9, tl.sum(s_a))
    tl.store(row + 10, tl.sum(s_b))
    # Histogram bin k: elements reaching edge k but not edge k + 1 (edge 0: every finite one).
    above = finite
    col = 11
    for ge in tl.static_range(0, 8):
        reached = tl.sum(at_least[ge].to(tl.int64))
        tl.store(row + col + ge, (above - reached).to(tl.float64))
        above = reached
    tl.store(row + 19, above.to(tl.float64))
    m_a = tl.max(m_a).to(tl.float64)
    m_b = tl.max(m_b).to(tl.float64)
    nm_a = tl.max(nm_a).to(tl.float64)
    nm_b = tl.max(nm_b).to(tl.float64)
    tl.store(row + 20, tl.max(m_diff).to(tl.float64))
    tl.store(row + 21, tl.maximum(m_a, nm_a))  # max|x| = max(max x, -min x)
    tl.store(row + 22, tl.maximum(m_b, nm_b))
    m_ulp = tl.max(m_ulp)
    if COARSE == "bf16":
        m_ulp = m_ulp >> 16
    tl.store(row + 23, m_ulp.to(tl.float64))
    tl.store(row + 24, tl.max(m_round).to(tl.float64))
    tl.store(row + 25, m_a)
    tl.store(row + 26, m_b)
    tl.store(row + 27, nm_a)
    tl.store(row + 28, nm_b)


@_jit
def _pick(vector, i: tl.constexpr):
    """Entry i of a small vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, vector.shape[0]) == i, vector, 0.0))


@_jit
def _finish_kernel(
    part_ptr,
    stats_ptr,
    hist_ptr,
    rows,
    DEST: tl.constexpr,
    DEST_DERIVED: tl.constexpr,
    SRC_DERIVED: tl.constexpr,
    N_SUM: tl.constexpr,
    N_COLS: tl.constexpr,
    HIST0: tl.constexpr,
    BINS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One program: reduce the partial rows, write (stats, hist) in STAT_FIELDS order."""
    _finish_rows(
        part_ptr, stats_ptr, hist_ptr, rows,
        DEST, DEST_DERIVED, SRC_DERIVED, N_SUM, N_COLS, HIST0, BINS, ROWS,
    )  # fmt: skip


@_jit
def _multi_finish_kernel(
    pairs_ptr,
    part_ptr,
    stats_ptr,
    hist_ptr,
    N_STATS: tl.constexpr,
    DEST: tl.constexpr,
    DEST_DERIVED: tl.constexpr,
    SRC_DERIVED: tl.constexpr,
    N_SUM: tl.constexpr,
    N_COLS: tl.constexpr,
    HIST0: tl.constexpr,
    BINS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """`_finish_kernel` for pair p = program p: its G_p rows from R_p, into row p of the outputs."""
    pair = tl.program_id(0).to(tl.int64)
    meta = pairs_ptr + pair * 5
    grid = tl.load(meta + 3)
    first = tl.load(meta + 4)
    _finish_rows(
        part_ptr + first * N_COLS, stats_ptr + pair * N_STATS, hist_ptr + pair * BINS, grid,
        DEST, DEST_DERIVED, SRC_DERIVED, N_SUM, N_COLS, HIST0, BINS, ROWS,
    )  # fmt: skip


@_jit
def _finish_rows(
    part_ptr,
    stats_ptr,
    hist_ptr,
    rows,
    DEST: tl.constexpr,
    DEST_DERIVED: tl.constexpr,
    SRC_DERIVED: tl.constexpr,
    N_SUM: tl.constexpr,
    N_COLS: tl.constexpr,
    HIST0: tl.constexpr,
    BINS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Reduce `rows` partial rows into (stats, hist).

    Sum columns add up in float64 in a fixed order (blocks of ROWS rows), max columns take
    their max; then the derived statistics are computed from the totals.
    """
    col = tl.arange(0, 32)
    sums = tl.zeros([32], tl.float64)
    maxima = tl.full([32], -float("inf"), tl.float64)
    start = 0
    while start < rows:
        row = start + tl.arange(0, ROWS)[:, None]
        valid = (row < rows) & (col[None, :] < N_COLS)
        block = tl.load(part_ptr + row * N_COLS + col[None, :], mask=valid, other=0.0)
        sums += tl.sum(block, axis=0)
        maxima = tl.maximum(maxima, tl.max(tl.where(valid, block, -float("inf")), axis=0))
        start += ROWS
    total = tl.where(col < N_SUM, sums, maxima)

    for i in tl.static_range(N_COLS):
        if DEST[i] >= 0:
            tl.store(stats_ptr + DEST[i], _pick(total, i))
    tl.store(hist_ptr + col - HIST0, total, mask=(col >= HIST0) & (col < HIST0 + BINS))
    # _DERIVED_COLS from the columns SRC_DERIVED names (see `_DERIVED_FROM`).
    finite = tl.maximum(_pick(total, SRC_DERIVED[0]), 1.0)
    for side in tl.static_range(2):
        high = _pick(total, SRC_DERIVED[3 + side])
        neg_low = _pick(total, SRC_DERIVED[5 + side])
        tl.store(stats_ptr + DEST_DERIVED[side], (high == -neg_low).to(tl.float64))
        tl.store(stats_ptr + DEST_DERIVED[2 + side], _pick(total, SRC_DERIVED[1 + side]) / finite)


# ---- host side ---------------------------------------------------------------------------


def available(device: torch.device | str) -> bool:
    """Whether `fused_pair_stats` can run on `device`.

    True for CUDA devices when triton is importable, and for any device when TRITON_INTERPRET=1
    (the CPU interpreter, for tests; it must be set before this module is imported).
    """
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def fused_pair_stats(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    threads: int | None = None,
    max_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All `lab.pairing.metrics` statistics of one pair in one pass over both tensors.

    Equal to `lab.pairing.metrics._single_core(a.reshape(-1), b.reshape(-1), coarse, compute)` (its
    `[0]` rows), up to the order of the float64 additions in the sums. Two dense tensors with
    the same strides (a permuted view on both sides) are read where they are, in memory order
    (`_as_stored`); other non-contiguous inputs are made contiguous first (a copy).

    Args:
        a: Reference tensor (bf16, fp16, fp32 or fp64).
        b: Candidate tensor, same shape and device; its dtype may differ.
        threads: Tile rows (a power of two); default 32 * NUM_WARPS, one per thread. Tests
            under the interpreter use small ones to get many tiles from few elements.
        max_programs: Cap on the grid; default PROGRAMS_PER_SM per multiprocessor on CUDA.

    Returns:
        (stats, hist): float64 vectors of len(STAT_FIELDS) and len(ULP_BIN_EDGES), on the
        inputs' device. An empty pair gives what `segment_stats` gives it: zeros, degenerate.

    Raises:
        ValueError: On a shape or device mismatch, or a dtype the lab does not compare.
        RuntimeError: If the kernel cannot run on this device (see `available`).
    """
    if a.shape != b.shape:
        raise ValueError(f"fused_pair_stats: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}.")
    if a.device != b.device:
        raise ValueError(f"fused_pair_stats: devices differ: {a.device} vs {b.device}.")
    coarser_dtype(a.dtype, b.dtype)  # raises on a dtype the lab does not compare
    device = a.device
    if a.numel() == 0:
        stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=device)
        stats[STAT_FIELDS.index("degenerate_a")] = 1.0
        stats[STAT_FIELDS.index("degenerate_b")] = 1.0
        return stats, torch.zeros(_BINS, dtype=torch.float64, device=device)
    if not available(device):
        raise RuntimeError(f"fused_pair_stats: needs triton and a CUDA device, got {device}.")
    tile, constexprs = _launch_plan(a.dtype, b.dtype, threads or 32 * NUM_WARPS)
    tiles = -(-a.numel() // tile)
    if max_programs is None:
        if device.type == "cuda":
            max_programs = _multiprocessors(device) * PROGRAMS_PER_SM
        else:
            max_programs = _INTERPRETER_PROGRAMS
    grid = min(tiles, max_programs)
    partials = torch.empty(grid, _N_COLS, dtype=torch.float64, device=device)
    # Triton launches on the current CUDA device: make it the inputs' one.
    switch = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if switch else contextlib.nullcontext():
        flat_a, flat_b = _flat_pair(a, b)
        _launch(_pair_stats_kernel, grid, (flat_a, flat_b, partials, a.numel()), constexprs)
        return _finish(partials)


@functools.cache
def _launch_plan(
    dtype_a: torch.dtype, dtype_b: torch.dtype, threads: int
) -> tuple[int, dict[str, Any]]:
    """(elements a tile, the pair kernel's constexprs) for a dtype pair.

    A single-pair launch and a multi-pair group use the same, so their programs are the same.
    Callers copy the dict before adding keys.
    """
    size = max(torch.empty((), dtype=d).element_size() for d in (dtype_a, dtype_b))
    vec = 16 // size  # 16-byte loads of the wider input
    per_thread = ELEMENTS_PER_THREAD_FP64 if vec == 2 else ELEMENTS_PER_THREAD
    unroll = max(1, per_thread // vec)
    constexprs = dict(
        A=_KIND[dtype_a],
        B=_KIND[dtype_b],
        COARSE=_KIND[coarser_dtype(dtype_a, dtype_b)],
        COMPUTE64=torch.float64 in (dtype_a, dtype_b),
        THREADS=threads,
        UNROLL=unroll,
        VEC=vec,
        N_COLS=_N_COLS,
    )
    return threads * unroll * vec, constexprs


_SMS: dict[int | None, int] = {}


def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (asked once per device)."""
    count = _SMS.get(device.index)
    if count is None:
        count = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


_COMPILED: dict[tuple, object] = {}
"""(kernel, device, constexprs, specialization) -> the compiled kernel Triton launched for it."""


def _specialization(value: object) -> tuple:
    """What Triton specializes a launch argument on (at least as fine as Triton's own key).

    Tensors: dtype and 16-byte alignment of the data pointer; integers: == 1, divisible by 16,
    and whether they fit int32 (the argument's type).
    """
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    return (value == 1, value % 16 == 0, -(2**31) <= value < 2**31)  # type: ignore[operator]


def _launch(
    kernel,
    grid: int,
    args: tuple,
    constexprs: dict,
    stream: torch.cuda.Stream | None = None,
    handle: int | None = None,
) -> None:
    """`kernel[(grid,)](*args, **constexprs, num_warps=NUM_WARPS)`, with less host time.

    Triton's launch binds and specializes every argument and builds its cache key on every call
    (~30-40 us of host time, two launches a pair). Once a specialization has been launched
    through Triton, the same compiled kernel is launched straight through its launcher: the
    same binary on the same arguments, so the same numbers. Under the interpreter, or with a
    Triton launch hook installed (a profiler), every launch goes through Triton. `stream`:
    launch there (None: the current stream). `handle`: that stream's `cuda_stream`, when the
    caller has read it already (a batch reads it once for its launches: ~8 us a read).
    """
    device = args[0].device
    if device.type != "cuda" or _hooked():
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            kernel[(grid,)](*args, **constexprs, num_warps=NUM_WARPS)
        return
    key = (kernel, device.index, *constexprs.values(), *map(_specialization, args))
    compiled = _COMPILED.get(key)
    if compiled is None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            _COMPILED[key] = kernel[(grid,)](*args, **constexprs, num_warps=NUM_WARPS)
        return
    if handle is None:
        handle = (stream if stream is not None else torch.cuda.current_stream(device)).cuda_stream
    compiled.run(
        grid, 1, 1, handle, compiled.function, compiled.packed_metadata, None, None, None,
        *args, *constexprs.values(),
    )  # fmt: skip


def _hooked() -> bool:
    """A Triton launch hook (a profiler) is installed: launches must go through Triton.

    Triton 3.6 keeps the hooks as (usually empty) `HookChain`s; older ones as None or a callable.
    """
    runtime = triton.knobs.runtime
    return any(
        hook is not None and bool(getattr(hook, "calls", True))
        for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook)
    )


def _read_in_place(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Each pair's two tensors as the multi-pair kernel reads them, and whose memory that is.

    The first list holds the pairs flat and contiguous; the second each tensor the kernels
    read, once (what a side stream marks as in use). A contiguous tensor is read where it is
    (the table holds its address). The others are copied, a few kernels a batch rather than
    one a tensor:
    - those whose elements form rows of one length under `view(-1, last dim)` (a chunk or
      slice along the last dimension, as adaLN chunks) with one `torch.cat` per dtype and row
      length; a cat's pieces start 16 bytes apart or a multiple of it (only row lengths that
      keep them so are batched), so the group's vector loads stay on;
    - the rest (permuted views with no rows view) with one `torch.stack` per dtype and shape,
      where a tensor's bytes are a multiple of 16 (the same alignment); the few left are
      copied one by one.
    A batch sends here only the pairs it cannot read where they are (`_as_stored`): sd3 full's
    244 permuted q/k-norm outputs a pair, the same layout on both sides, are read in place
    since stop 25; a permuted view whose other side is laid out otherwise is still stacked.
    Whether the rows view exists is read from the strides: asking `view` costs a raised and
    caught error, ~30-50 us, a tensor that has none. Every copy holds the values in the order
    of `reshape(-1)`.
    """
    flats = [[a, b] for a, b in pairs]
    read: list[torch.Tensor] = []
    rows: dict[tuple[torch.dtype, int], list[tuple[int, int, torch.Tensor]]] = {}
    alike: dict[tuple[torch.dtype, torch.Size], list[tuple[int, int, torch.Tensor]]] = {}
    for i, pair in enumerate(pairs):
        for j, tensor in enumerate(pair):
            if tensor.is_contiguous() and not tensor.is_neg():
                read.append(tensor)
                continue
            size = tensor.element_size()
            width = tensor.shape[-1] if tensor.dim() else 0
            if width and (width * size) % 16 == 0:
                view = _rows_view(tensor)
                if view is not None:
                    rows.setdefault((tensor.dtype, width), []).append((i, j, view))
                    continue
            if (tensor.numel() * size) % 16 == 0:
                alike.setdefault((tensor.dtype, tensor.shape), []).append((i, j, tensor))
                continue
            flats[i][j] = copy = _flat(tensor)
            read.append(copy)
    for group in rows.values():
        flat = torch.cat([view for _, _, view in group]).view(-1)
        read.append(flat)
        start = 0
        for i, j, view in group:
            flats[i][j] = flat[start : start + view.numel()]
            start += view.numel()
    for group in alike.values():
        tensors = [tensor.detach() for _, _, tensor in group]
        # Into a contiguous buffer: `stack` keeps its inputs' memory format, and a stack of
        # channels-last tensors (an NHWC output seen as NCHW) would have no flat view.
        first = tensors[0]
        stacked = torch.empty((len(tensors), *first.shape), dtype=first.dtype, device=first.device)
        torch.stack(tensors, out=stacked)
        read.append(stacked)
        flat = stacked.view(len(group), -1)
        for k, (i, j, _) in enumerate(group):
            flats[i][j] = flat[k]
    return [(a, b) for a, b in flats], read


def _rows_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """`tensor.view(-1, last dim)` where its leading dimensions merge, else None.

    They merge when each one's stride is the next non-trivial inner one's stride times its
    size (dimensions of size 1 do not count), the rule `view` applies.
    """
    shape, strides = tensor.shape, tensor.stride()
    expected = None
    for dim in range(tensor.dim() - 2, -1, -1):
        if shape[dim] == 1:
            continue
        if expected is not None and strides[dim] != expected:
            return None
        expected = strides[dim] * shape[dim]
    try:
        return tensor.detach().view(-1, shape[-1])
    except RuntimeError:  # not expected after the check above; copied instead
        return None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Contiguous 1-D view; bf16 as its int16 bits (the kernel widens them itself).

    A negated view (`is_neg`) is copied with its sign applied: the kernels read raw memory.
    """
    return _bits(x.detach().reshape(-1).contiguous().resolve_neg())


def _flat_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors as the single-pair kernel reads them.

    Where they are when `_as_stored` (a dense block each, in memory order), else `_flat`'s
    contiguous copies (reshape order).
    """
    if _as_stored(a, b) and not (a.is_contiguous() and b.is_contiguous()):
        n = a.numel()
        return _bits(a.detach().as_strided((n,), (1,))), _bits(b.detach().as_strided((n,), (1,)))
    return _flat(a), _flat(b)


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense (torch's `is_non_overlapping_and_dense`).

    The elements fill one block of memory with no gap and no element twice, in some order of
    the dimensions (size-1 dimensions take any stride).
    """
    expected = 1
    dims = zip(x.shape, x.stride(), strict=True)
    for stride, size in sorted((st, sz) for sz, st in dims if sz >= 2):
        if stride != expected:
            return False
        expected *= size
    return True


def _as_stored(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernels read `a` and `b` where they are, element k against element k.

    Both contiguous, or both dense with the same strides (sd3 full's 244 q/k-norm outputs a
    pair: (B, H, S, D) views of (B, S, H, D) memory on both sides). The same strides over the
    same shape put every element at the same place in both blocks, so memory order pairs the
    same elements as `reshape(-1)` order does; the stats are the same but for the order of the
    float64 additions in the sums. `_pair_core.scan` is the same rule in C++ (with torch's
    `is_non_overlapping_and_dense`). Never a negated view (`is_neg`): its memory holds the
    values' negatives, and the kernels read raw memory; it is copied, which applies the sign.
    """
    if a.is_neg() or b.is_neg():
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    return a.stride() == b.stride() and _dense(a) and _dense(b)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """`x` as the kernels take it: bf16 as its int16 bits, any other dtype as it is."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _finish(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the per-program rows into (stats, hist) on the device: one more small launch."""
    stats = torch.empty(len(STAT_FIELDS), dtype=torch.float64, device=partials.device)
    hist = torch.empty(_BINS, dtype=torch.float64, device=partials.device)
    constexprs = dict(
        DEST=_DEST_COLUMNS,
        DEST_DERIVED=_DEST_DERIVED,
        SRC_DERIVED=_DERIVED_FROM,
        N_SUM=_N_SUM,
        N_COLS=_N_COLS,
        HIST0=_HIST0,
        BINS=_BINS,
        ROWS=64,
    )
    _launch(_finish_kernel, 1, (partials, stats, hist, partials.shape[0]), constexprs)
    return stats, hist


# ---- many pairs of one run ---------------------------------------------------------------


_PAIR_META = 5
"""int64s per pair in a multi-pair launch: address of a, address of b, numel, grid, first row."""


@dataclasses.dataclass(slots=True)
class _Group:
    """One dtype pair's pairs of a batch, as `RunReducer.reduce_many` launches them."""

    index: list[int]
    """Positions of its pairs in the batch."""
    base_a: torch.Tensor
    base_b: torch.Tensor
    meta: np.ndarray
    """`_PAIR_META` int64s a pair: offsets of a and b from the bases, numel, grid, first row."""
    owners: np.ndarray
    """The pair (int32, its position in the group) each program of the pair launch reads."""
    first: int
    """Programs of its pair launch (partial rows)."""
    constexprs: dict[str, Any]
    table_at: int = 0
    owners_at: int = 0
    """Byte offsets of its table and owners in the batch's buffer."""
    parts_at: int = 0
    rows_at: int = 0
    """Its first partial row and first output row in the batch's buffers."""


def _core() -> Any:
    """The C++ pairing extension (`pair_core`) for the batch's table, or None (LAB_PAIR_CORE)."""
    from lab.pairing import pair_core

    return pair_core.extension()


class RunReducer:
    """`fused_pair_stats` for every CUDA pair of one run, many pairs a launch.

    `reduce_many(pairs)` queues a batch: pairs are grouped by dtype pair, and each group is one
    launch of `_multi_pair_stats_kernel` (program R_p + j of it runs program j of pair p's own
    single-pair launch, grid G_p = min(tiles, the cap), so the partial rows are the same
    numbers) and one of `_multi_finish_kernel` (pair p's G_p rows folded as `_finish_kernel`
    folds them). So every pair's (stats, hist) equals `fused_pair_stats(a, b)` bit for bit,
    at two launches a group instead of two a pair. A batch's groups share one table buffer
    (one host-to-device copy) and one allocation each for partial rows, stats and histograms.
    On a side stream the batch waits for the forward's stream through one re-recorded event,
    and what the kernels read is marked in use there (`record_stream`, once a storage), so
    the caching allocator hands that memory out again only once they have read it. (Keeping
    the tensors alive until an event recorded after the kernels had completed, checked at
    each batch, was measured once with sd3 full's peak at 1.13x of a plain forward's on the
    H200, against 1.07x before: likely memory coming back a batch later, not isolated, as
    another change went in with it.) Contiguous outputs are read where they are (their
    address and length go in the batch's table), and so are two dense tensors with the same
    strides, in memory order (`_as_stored`); only the other pairs are copied (`_read_in_place`).
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        """Reduce on `stream` (None: on the stream current when a batch is queued)."""
        self.device = device
        self.stream = stream
        self._event = torch.cuda.Event() if stream is not None else None
        self._programs = (
            _multiprocessors(device) * PROGRAMS_PER_SM
            if device.type == "cuda"
            else _INTERPRETER_PROGRAMS
        )
        self._outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._finish_constexprs = dict(
            N_STATS=len(STAT_FIELDS),
            DEST=_DEST_COLUMNS,
            DEST_DERIVED=_DEST_DERIVED,
            SRC_DERIVED=_DERIVED_FROM,
            N_SUM=_N_SUM,
            N_COLS=_N_COLS,
            HIST0=_HIST0,
            BINS=_BINS,
            ROWS=64,
        )
        self.count = 0
        self.launches = 0
        self.batches = {"side": 0, "current": 0}
        """Batches queued on the side stream and on the caller's current stream."""

    def reduce_many(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], on_side: bool = True
    ) -> list[tuple[int, int]]:
        """Queue pairs (same shape, CUDA, numel > 0); returns each one's (output, row).

        The kernels read the tensors after this returns (in stream order): the caller keeps
        them unedited until then, or compares copies. `on_side=False`: this batch runs on the
        current stream even where the reducer has a side stream (no event, no `record_stream`:
        the forward's later kernels are queued behind these anyway); `batches` counts each way.
        """
        core = _core()
        stream = self.stream if on_side else None
        # Pairs the kernels read where they are (`_as_stored`: contiguous, or dense with the
        # same strides on both sides) go in the table as they are; only the others are copied
        # (`_read_in_place`, or its C++ twin `read_in_place`: the same copies).
        if core is None:
            groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
            strided = []
            for i, (a, b) in enumerate(pairs):
                groups.setdefault((a.dtype, b.dtype), []).append(i)
                if not _as_stored(a, b):
                    strided.append(i)
        else:
            groups, strided = core.scan(pairs)  # the same groups and the same rule, in C++
        flats, read = pairs, []
        if strided:
            copy = _read_in_place if core is None else core.read_in_place
            copied, read = copy([pairs[i] for i in strided])
            flats = list(pairs)
            for i, flat in zip(strided, copied, strict=True):
                flats[i] = flat
        if stream is not None:
            skip = set(strided)
            read += [t for i, pair in enumerate(pairs) if i not in skip for t in pair]
        self.batches["side" if stream is not None else "current"] += 1
        if stream is not None:
            # After the copies above: the side stream waits for them and for the outputs, and
            # their memory is not handed out again before its kernels have read them.
            self._event.record(torch.cuda.current_stream(self.device))
            stream.wait_event(self._event)
            for tensor in read:
                tensor.record_stream(stream)
        plans = [self._plan(flats, index, dtypes, core) for dtypes, index in groups.items()]
        # One buffer for every group's table and owners (one host-to-device copy a batch) and
        # one each for the partial rows, stats and histograms, each group in its own slice: the
        # host work of a batch does not grow with its dtype pairs (sd3 full: two or three).
        # Every slice starts on 16 bytes, as a tensor of its own would, so the kernels
        # specialize (and load) as they did with one allocation a group.
        host_bytes = parts = rows = 0
        for plan in plans:
            plan.table_at = host_bytes
            host_bytes += -(-8 * len(plan.meta) // 16) * 16
            plan.owners_at = host_bytes
            host_bytes += -(-4 * plan.first // 16) * 16
            plan.parts_at, plan.rows_at = parts, rows
            parts += plan.first + (plan.first & 1)  # 232-byte rows: an even count keeps 16
            rows += len(plan.index) + (len(plan.index) & 1)  # 72-byte histogram rows: same
        pinned = self.device.type == "cuda"
        # From pinned memory and without waiting: a copy from pageable memory synchronizes the
        # stream, so the host would wait for every queued kernel at every batch (flux full on
        # the H200: 229 such waits, 0.33 s a pair).
        host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=pinned)
        view = host.numpy()
        for plan in plans:
            view[plan.table_at : plan.table_at + 8 * len(plan.meta)].view(np.int64)[:] = plan.meta
            view[plan.owners_at : plan.owners_at + 4 * plan.first].view(np.int32)[:] = plan.owners
        handles: list[tuple[int, int]] = [(0, 0)] * len(pairs)
        out = len(self._outputs)
        # The buffers are made on the stream that reads them.
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            moved = host.to(self.device, non_blocking=pinned)
            # The stream the launches go to, read once (inside the block: the current stream).
            handle = torch.cuda.current_stream(device=self.device).cuda_stream if pinned else None
            device = self.device
            partials = torch.empty(parts, _N_COLS, dtype=torch.float64, device=device)
            stats = torch.empty(rows, len(STAT_FIELDS), dtype=torch.float64, device=device)
            hist = torch.empty(rows, _BINS, dtype=torch.float64, device=device)
            for plan in plans:
                count = len(plan.index)
                table = moved[plan.table_at : plan.table_at + 8 * len(plan.meta)]
                owners = moved[plan.owners_at : plan.owners_at + 4 * plan.first]
                table, owners = table.view(torch.int64), owners.view(torch.int32)
                group_parts = partials[plan.parts_at : plan.parts_at + plan.first]
                group_stats = stats[plan.rows_at : plan.rows_at + count]
                group_hist = hist[plan.rows_at : plan.rows_at + count]
                args = (plan.base_a, plan.base_b, table, owners, group_parts)
                _launch(_multi_pair_stats_kernel, plan.first, args, plan.constexprs, stream,
                        handle)  # fmt: skip
                _launch(_multi_finish_kernel, count, (table, group_parts, group_stats, group_hist),
                        self._finish_constexprs, stream, handle)  # fmt: skip
                for row, i in enumerate(plan.index, plan.rows_at):
                    handles[i] = (out, row)
                self.launches += 2
        self._outputs.append((stats, hist))
        self.count += len(pairs)
        return handles

    def _plan(
        self,
        flats: list[tuple[torch.Tensor, torch.Tensor]],
        index: list[int],
        dtypes: tuple[torch.dtype, torch.dtype],
        core: Any = None,
    ) -> _Group:
        """One dtype pair's launch: its table (`_PAIR_META` a pair), programs and constexprs.

        `core`: the C++ extension (`_core()`, asked once a batch) builds the table; None: the
        Python loop below, the same table.
        """
        tile, plan = _launch_plan(*dtypes, 32 * NUM_WARPS)
        constexprs = dict(plan)
        meta: list[int] = []
        first = 0
        base_a, base_b = (_bits(t) for t in flats[index[0]])
        origin_a, origin_b = base_a.data_ptr(), base_b.data_ptr()
        size_a, size_b = base_a.element_size(), base_b.element_size()
        programs = self._programs
        if core is not None:  # the same table, the loop in C++ (`_pair_core.table`)
            table, owned, first, misaligned = core.table(
                flats, index, tile, programs, origin_a, origin_b, size_a, size_b
            )
            meta_array = np.frombuffer(table, dtype=np.int64)
            owners = np.frombuffer(owned, dtype=np.int32)
        else:
            misaligned = 0
            for i in index:
                fa, fb = flats[i]
                n = fa.numel()
                grid = min(-(-n // tile), programs)
                address_a, address_b = fa.data_ptr(), fb.data_ptr()
                misaligned |= (address_a & 15) | ((address_b & 15) << 4)
                # Element offsets from the bases (every tensor sits on its element size).
                meta += ((address_a - origin_a) // size_a, (address_b - origin_b) // size_b, n,
                         grid, first)  # fmt: skip
                first += grid
            meta_array = np.array(meta, dtype=np.int64)
            # Owners are laid out here (numpy) rather than by `repeat_interleave` on the device
            # (five small ops a group).
            grids = meta_array[3::_PAIR_META]
            owners = np.repeat(np.arange(len(index), dtype=np.int32), grids)
        constexprs["ALIGN_A"] = 1 if misaligned & 15 else 16 // size_a
        constexprs["ALIGN_B"] = 1 if misaligned >> 4 else 16 // size_b
        return _Group(index, base_a, base_b, meta_array, owners, first, constexprs)

    def host_rows(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Every queued batch's rows on the host, one array each, and where each batch starts.

        Batch `out`'s row `row` (a `reduce_many` handle) is row `starts[out] + row`. One
        transfer each for the stats and the histograms.
        """
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if not self._outputs:
            empty = np.empty((0, len(STAT_FIELDS)), dtype=np.float64)
            return empty, np.empty((0, _BINS), dtype=np.float64), []
        stats = torch.cat([s for s, _ in self._outputs]).cpu().numpy()
        hists = torch.cat([h for _, h in self._outputs]).cpu().numpy()
        sizes = (s.shape[0] for s, _ in self._outputs)
        return stats, hists, list(itertools.accumulate(sizes, initial=0))

    def rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each queued batch's (stats, hist) on the host, in queue order (one transfer)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if not self._outputs:
            return []
        stats = torch.cat([s for s, _ in self._outputs]).cpu()
        hists = torch.cat([h for _, h in self._outputs]).cpu()
        out, start = [], 0
        for s, _ in self._outputs:
            n = s.shape[0]
            out.append((stats[start : start + n], hists[start : start + n]))
            start += n
        return out

"""Pure tensor -> number functions: abs, rel, ULP, bit-exact share, cosine, rounding-only check.

Everything for one pair is computed on the tensors' device into one small float64 vector
(`pair_stats`), so a paired forward never syncs with the host per module; `decode_stats` turns
the stacked vectors into numbers once, at the end.
"""

from __future__ import annotations

import array
import itertools
import math
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from lab.pairing import cpu_kernel
from lab.pairing.stats_layout import (  # noqa: F401  (STAT_FIELDS & co. are public here too)
    _INT_VIEW,
    _MANTISSA_BITS,
    STAT_FIELDS,
    ULP_BIN_EDGES,
    ULP_BIN_LABELS,
    coarser_dtype,
)

_N = len(STAT_FIELDS)


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
    device = reference.device
    if device.type != "cpu" and reference.numel() and reference.shape == candidate.shape:
        # One pair on a device goes straight to its single-pair core: the batched layout's
        # index tensors would be host-to-device copies, each waiting for the GPU to drain.
        coarse = coarser_dtype(reference.dtype, candidate.dtype)
        f64 = torch.float64
        compute = f64 if f64 in (reference.dtype, candidate.dtype) else torch.float32
        a, b = (t.detach().reshape(-1) for t in (reference, candidate))
        stats, hist = _single_stats(device)(a, b, coarse, compute)
        return stats[0], hist[0]
    stats, hist = segment_stats([(reference, candidate)])
    return stats[0], hist[0]


def segment_stats(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pair_stats` of many pairs at once: a few vectorised passes instead of ~40 ops a pair.

    On the CPU, one call of the C core (`cpu_kernel`, LAB_CPU_STATS=c, the default) reduces
    every pair. Otherwise pairs are grouped by compute dtype and laid out as zero-padded rows of
    one buffer per group (see `_rows_stats`), so a hundred small activations cost about as much
    as one.

    Returns:
        (stats, histograms): float64 tensors shaped (len(pairs), len(STAT_FIELDS)) and
        (len(pairs), len(ULP_BIN_EDGES)), in the order of `pairs`.

    Raises:
        ValueError: On a shape mismatch or a non-floating tensor, naming the pair's index.
    """
    if not pairs:
        raise ValueError("segment_stats: no pairs given.")
    device = pairs[0][0].device
    # On the CPU the C core (`cpu_kernel`, LAB_CPU_STATS) takes every pair in one call; a
    # batch holding any other tensor goes to the torch core (which names what is wrong).
    lib = cpu_kernel.library() if device.type == "cpu" else None
    if lib is not None and not all(cpu_kernel.readable(a, b) for a, b in pairs):
        lib = None
    groups: dict[torch.dtype | None, list[tuple[int, int, int]]] = {}
    empty: list[int] = []
    for i, (a, b) in enumerate(pairs):
        if a.shape != b.shape:
            raise ValueError(
                f"pair_stats: pair {i}: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}."
            )
        bits_a, bits_b = _MANTISSA_BITS.get(a.dtype), _MANTISSA_BITS.get(b.dtype)
        if bits_a is None or bits_b is None:
            coarser_dtype(a.dtype, b.dtype)  # raises, naming the dtype
        if a.numel() == 0:
            empty.append(i)
            continue
        compute = None if lib else torch.float64 if 52 in (bits_a, bits_b) else torch.float32
        groups.setdefault(compute, []).append((bits_a, bits_b, i))
    if lib is not None and not empty:
        with torch.no_grad():
            return _table(*cpu_kernel.aggregates(pairs, lib, checked=True))
    stats = torch.zeros(len(pairs), _N, dtype=torch.float64, device=device)
    hists = torch.zeros(len(pairs), len(ULP_BIN_EDGES), dtype=torch.float64, device=device)
    for i in empty:
        stats[i, STAT_FIELDS.index("degenerate_a")] = 1.0
        stats[i, STAT_FIELDS.index("degenerate_b")] = 1.0
    for compute, keyed in groups.items():
        keyed.sort()  # pairs of one dtype pair side by side: their rows share a coarser dtype
        index = [i for _, _, i in keyed]
        group = [pairs[i] for i in index]
        if compute is None:
            with torch.no_grad():
                group_stats, group_hist = _table(*cpu_kernel.aggregates(group, lib, checked=True))
        else:
            group_stats, group_hist = _group_stats(group, compute)
        where = _host_tensor(index, device)
        stats[where] = group_stats
        hists[where] = group_hist
    return stats, hists


_ROW = 128
"""Elements per row of the batched layout: a pair wastes under one row of zero padding."""
_CHUNK_NUMEL = 1 << 18
"""Elements (padding included) laid out at once. Bounds the CPU scratch buffers, kept between
calls, to ~30 MiB a compute dtype and thread; larger pairs are reduced in pieces."""
_SERIAL_CAT = 32768
"""torch.cat on the CPU copies input by input, each through a parallel loop, unless its result
is smaller than one grain (32768 elements): then one serial kernel copies them all, several
times faster for many small inputs."""
_EXP0 = 127
"""The fp32 biased exponent of 1.0: a ULP count's class is its exponent minus this, plus 1."""
_CLASSES = 18
"""ULP classes: 0 holds ulp == 0, k (1..16) holds floor(log2(ulp)) == k - 1, 17 holds ulp >=
65536. Elements of class 0 are not counted but inferred: the finite ones no other class holds."""
_CLASS_BIN = (0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7, 8)
"""The ULP_BIN_EDGES bin each class falls in."""
_COLUMNS = (
    "sum_a",
    "sum_b",
    "norm2_a",
    "norm2_b",
    "sum_abs_diff",
    "sum_sq_diff",
    "not_bitexact",
    "nonfinite",
    "nonfinite_a",
    "nonfinite_b",
    "max_a",
    "max_b",
    "max_abs_diff",
    "max_ulp",
    "max_abs_diff_rounded",
    "neg_min_a",
    "neg_min_b",
)
"""Columns of the float64 (rows, k) matrix a block of rows reduces to: sums up to
`nonfinite_b`, then maxima (minima negated, so one max reduces them all). Counts are exact in
float64 to 2**53, and only ever of what padding never adds to: padding is finite, equal on both
sides and 0 ULPs apart."""
_SUMS = _COLUMNS.index("max_a")
_MAXS = _COLUMNS.index("neg_min_a") - _SUMS
_C = {name: i for i, name in enumerate(_COLUMNS)}
_TABLE = (
    "numel",
    "finite",
    "bitexact",
    *_COLUMNS[:6],
    "nonfinite_a",
    "nonfinite_b",
    "max_abs_diff",
    "max_ulp",
    "max_abs_diff_rounded",
    "max_abs_a",
    "max_abs_b",
    "degenerate_a",
    "degenerate_b",
    "mean_a",
    "mean_b",
)
"""Columns of the per-pair table `_table` assembles; STAT_FIELDS picks them in order."""
_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_SCRATCH = threading.local()


def _group_stats(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stats and histograms of non-empty pairs that share a compute dtype.

    A lone pair off the CPU takes the single-pair core (compiled on CUDA). Everything else is
    reduced by `_rows_stats` in chunks of at most _CHUNK_NUMEL elements: a pair larger than
    that is cut into flat pieces, reduced as pairs of their own and combined (sums and counts
    add up, maxima take the max), so memory stays bounded whatever the pair's size.
    """
    device = pairs[0][0].device
    if len(pairs) == 1 and device.type != "cpu":
        a, b = (t.detach().reshape(-1) for t in pairs[0])
        return _single_stats(device)(a, b, coarser_dtype(a.dtype, b.dtype), compute)
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    per_pair: list[int] = []
    for a, b in pairs:
        if a.numel() <= _CHUNK_NUMEL:
            pieces.append((a, b))
            per_pair.append(1)
            continue
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        starts = range(0, a.numel(), _CHUNK_NUMEL)
        pieces += [(flat_a[i : i + _CHUNK_NUMEL], flat_b[i : i + _CHUNK_NUMEL]) for i in starts]
        per_pair.append(len(starts))
    # Chunks of at most _CHUNK_NUMEL laid-out (padded) elements.
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    numel = 0
    for piece in pieces:
        padded = -(-piece[0].numel() // _ROW) * _ROW
        if chunks[-1] and numel + padded > _CHUNK_NUMEL:
            chunks.append([])
            numel = 0
        chunks[-1].append(piece)
        numel += padded
    with torch.no_grad():
        results = [_rows_stats(chunk, compute) for chunk in chunks]
        numel_t, sums, maxs, classes = (
            torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*results, strict=True)
        )
        if len(pieces) > len(pairs):
            lengths = _host_tensor(per_pair, device)
            numel_t, sums, classes = (
                torch.segment_reduce(x, "sum", lengths=lengths, axis=0, unsafe=True)
                for x in (numel_t, sums, classes)
            )
            maxs = torch.segment_reduce(maxs, "max", lengths=lengths, axis=0, unsafe=True)
        return _table(numel_t, sums, maxs, classes)


@dataclass(frozen=True)
class _Span:
    """Consecutive rows of the layout whose pairs share both dtypes."""

    rows: slice
    coarse: torch.dtype
    native: tuple[bool, bool]
    """Which sides hold the coarser dtype already (rounding to it changes nothing there)."""
    gathered: tuple[bool, bool]
    """Which sides `small` already holds (filled while gathering)."""
    small: torch.Tensor | None = None
    """The rows' (2, rows, _ROW) buffer of values in the coarser dtype, if a side was gathered
    into it."""


def _rows_stats(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batched core: every pair flattened into zero-padded rows of _ROW elements.

    Elementwise work runs once over a (2, rows, _ROW) buffer, reductions run along its rows into
    a small (rows, _COLUMNS) matrix, and one segment sum and one segment max fold that into
    pairs (ULP classes are counted per pair directly). Padding (a = b = 0) adds nothing to the
    sums, to the maxima of non-negative values, nor to the counts kept; the side maxima and
    minima of a padded row are recomputed over its real elements. On the CPU every row is first
    reduced as if finite (no masks), and only rows holding a NaN or an Inf are redone with
    masks; elsewhere every row is masked, so the host never waits on the device.

    Returns:
        Per pair, float64: numel (P,), the sum columns (P, _SUMS), the max columns (P, 7) and
        the ULP-class counts (P, _CLASSES), class 0 left to `_table`.
    """
    f64 = torch.float64
    device = pairs[0][0].device
    n_pairs = len(pairs)
    sizes = [a.numel() for a, _ in pairs]
    lengths = [-(-n // _ROW) for n in sizes]
    pads = [rows * _ROW - n for rows, n in zip(lengths, sizes, strict=True)]
    ends = list(itertools.accumulate(lengths))
    partial = [end - 1 for end, pad in zip(ends, pads, strict=True) if pad]
    real = [_ROW - pad for pad in pads if pad]
    host = _host_tensor([*lengths, *sizes, *partial, *real], device)
    lengths_t, numel = host[:n_pairs], host[n_pairs : 2 * n_pairs].to(f64)
    partial_t, real_t = host[2 * n_pairs :].view(2, -1)
    ab = _scratch("ab", (2, ends[-1], _ROW), compute, device)
    sides = tuple(zip(*pairs, strict=True))  # all a tensors, all b tensors
    spans: list[_Span] = []
    first = 0
    for (dtype_a, dtype_b), run in itertools.groupby((a.dtype, b.dtype) for a, b in pairs):
        last = first + sum(1 for _ in run)
        rows = slice(ends[first] - lengths[first], ends[last - 1])
        coarse = coarser_dtype(dtype_a, dtype_b)
        small = _scratch("small", ab.shape, coarse, device)[:, rows]
        native = (dtype_a == coarse, dtype_b == coarse)
        gathered = (native[0] and coarse != compute, native[1] and coarse != compute)
        for side in (0, 1):
            out = small[side] if gathered[side] else ab[side, rows]
            _gather(out, sides[side][first:last], sizes[first:last], pads[first:last])
            if gathered[side]:
                ab[side, rows].copy_(out)
        spans.append(_Span(rows, coarse, native, gathered, small if any(gathered) else None))
        first = last
    keys = torch.repeat_interleave(lengths_t, output_size=ends[-1]).to(torch.int32)

    matrix = _scratch("matrix", (ends[-1], len(_COLUMNS)), f64, device)
    if _host_reads_are_cheap(device):
        extremes = ab.amax(2), ab.amin(2)
        # amax and amin propagate NaN and keep +-Inf, so a row holding one has a non-finite
        # max - min (as has a float64 range overflowing, which is merely redone).
        spread = extremes[0] - extremes[1]
        bad = None
        if not spread.isfinite().all():
            bad = (~spread.isfinite().all(0)).nonzero()[:, 0]
        # Bad rows' ULP classes go to a discarded key, and are redone.
        fast_keys = keys if bad is None else keys.index_fill(0, bad, n_pairs)
        classes = _row_stats(ab, spans, matrix, fast_keys, n_pairs + 1, extremes)
        if bad is not None:
            redo = torch.empty(len(bad), len(_COLUMNS), dtype=f64, device=device)
            spans_redo = _subspans(spans, bad.tolist())
            x = ab.index_select(1, bad)
            classes += _row_stats(x, spans_redo, redo, keys[bad], n_pairs + 1)
            matrix[bad] = redo
    else:
        bad = True
        classes = _row_stats(ab, spans, matrix, keys, n_pairs + 1)

    # The last row of a padded pair: side maxima and minima over its real elements only.
    if partial:
        x = ab.index_select(1, partial_t)
        if bad is not None:
            x = torch.where(x.isfinite().all(0), x, 0)
        # Padding takes the row's first element, which is always real: it moves no extreme.
        x = torch.where(torch.arange(_ROW, device=device) < real_t[:, None], x, x[:, :, :1])
        matrix[partial_t, _C["max_a"] : _C["max_b"] + 1] = x.amax(2).T.to(f64)
        matrix[partial_t, _C["neg_min_a"] :] = x.amin(2).T.neg().to(f64)

    sums = torch.segment_reduce(matrix[:, :_SUMS], "sum", lengths=lengths_t, axis=0, unsafe=True)
    maxs = torch.segment_reduce(matrix[:, _SUMS:], "max", lengths=lengths_t, axis=0, unsafe=True)
    return numel, sums, maxs, classes[:, :n_pairs].T


def _table(
    numel: torch.Tensor, sums: torch.Tensor, maxs: torch.Tensor, classes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stats, histograms) of pairs from their aggregates (see `_rows_stats`)."""
    f64 = torch.float64
    class_bins, stat_columns = _constants(numel.device)
    finite = numel - sums[:, _C["nonfinite"]]
    classes = classes.to(f64, copy=True)
    classes[:, 0] = finite - classes[:, 1:].sum(1)
    maxs, side_min = maxs[:, :_MAXS], -maxs[:, _MAXS:]
    side_max = maxs[:, : _C["max_b"] + 1 - _SUMS]
    table = torch.cat(
        [
            torch.stack([numel, finite, numel - sums[:, _C["not_bitexact"]]], 1),
            sums[:, : _C["not_bitexact"]],
            sums[:, _C["nonfinite_a"] :],
            maxs[:, _C["max_abs_diff"] - _SUMS :],
            torch.maximum(side_max.abs(), side_min.abs()),
            (side_max == side_min).to(f64),
            sums[:, : _C["norm2_a"]] / finite.clamp(min=1)[:, None],
        ],
        dim=1,
    )
    return table.index_select(1, stat_columns), classes @ class_bins


def _host_reads_are_cheap(device: torch.device) -> bool:
    """Whether the batched path may branch on its data: a host read, free on the CPU only."""
    return device.type == "cpu"


def _host_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host integers (via a buffer: torch.tensor is slow on long lists)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64).to(device, copy=True)


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(classes, bins) one-hot matrix and the STAT_FIELDS columns of `_TABLE`, per device."""
    if device not in _CONSTANTS:
        class_bins = torch.zeros(_CLASSES, len(ULP_BIN_EDGES), dtype=torch.float64)
        class_bins[torch.arange(_CLASSES), torch.tensor(_CLASS_BIN)] = 1.0
        columns = torch.tensor([_TABLE.index(name) for name in STAT_FIELDS])
        _CONSTANTS[device] = class_bins.to(device), columns.to(device)
    return _CONSTANTS[device]


def _subspans(spans: list[_Span], rows: list[int]) -> list[_Span]:
    """`spans` restricted to the (sorted) `rows`, renumbered as positions in that list."""
    out, start = [], 0
    for span in spans:
        end = start
        while end < len(rows) and rows[end] < span.rows.stop:
            end += 1
        if end > start:
            out.append(_Span(slice(start, end), span.coarse, span.native, (False, False)))
        start = end
    return out


def _scratch(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialised contiguous buffer, kept between calls (per thread) on the CPU.

    The CPU allocator hands large freed blocks back to the kernel, and faulting their pages in
    again on every call costs more than the arithmetic done in them. Elsewhere: torch.empty.
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _SCRATCH.__dict__
    numel = math.prod(shape)
    buffer = buffers.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[name, dtype] = torch.empty(numel, dtype=dtype)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return buffer.as_strided(shape, strides)


def _gather(
    out: torch.Tensor, tensors: Sequence[torch.Tensor], sizes: list[int], pads: list[int]
) -> None:
    """Copy the tensors, flattened and each followed by `pads[i]` zeros, into `out`."""
    dtype = tensors[0].dtype
    zeros = torch.zeros(_ROW, dtype=dtype, device=out.device)
    paddings = {pad: zeros[:pad] for pad in set(pads) if pad}  # few sizes: shapes repeat
    # Runs of parts under one grain, each joined by the serial kernel on the CPU (one run
    # elsewhere); flatten_dense_tensors does each part's view(-1) and the cat in C++.
    limit = _SERIAL_CAT if out.device.type == "cpu" else out.numel() + 1
    runs: list[list[torch.Tensor]] = [[]]
    numel = 0
    for t, n, pad in zip(tensors, sizes, pads, strict=True):
        if runs[-1] and numel + n + pad >= limit:
            runs.append([])
            numel = 0
        runs[-1] += (t, paddings[pad]) if pad else (t,)
        numel += n + pad
    joined = [torch._utils._flatten_dense_tensors(run) for run in runs]
    if dtype == out.dtype and out.is_contiguous():
        torch.cat(joined, out=out.view(-1))
    else:
        out.copy_((torch.cat(joined) if len(joined) > 1 else joined[0]).view(out.shape))


def _row_stats(
    ab: torch.Tensor,
    spans: list[_Span],
    matrix: torch.Tensor,
    keys: torch.Tensor,
    n_keys: int,
    extremes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Fill `matrix` (rows, _COLUMNS) from a (2, rows, _ROW) block; return its ULP classes.

    The classes are counted per key (`keys`: each row's), as (_CLASSES, n_keys). Given
    `extremes` (each row's amax and amin, all finite), no masks: b - a == 0 exactly when a == b
    for finite floats, so a row's mismatches are the sum of sign(|b - a|). Without, the masks
    of `_stats_from` apply, for rows that may hold NaN or Inf.
    """
    f64 = torch.float64
    compute, device, rows = ab.dtype, ab.device, ab.shape[1]
    columns = matrix.T  # one (rows,) view per column: the reductions write into them
    finite = None
    x = ab
    if extremes is None:
        finite_ab = ab.isfinite()
        finite = finite_ab[0] & finite_ab[1]
        x = torch.where(finite, ab, 0)
        extremes = x.amax(2), x.amin(2)
    diff = _scratch("diff", (rows, _ROW), compute, device)
    torch.sub(x[1], x[0], out=diff).abs_()
    # Values and products in the compute dtype, widened to float64, then summed. (Every
    # temporary is a scratch buffer: an op writing another dtype would allocate one.)
    wide = _scratch("wide", (2, rows, _ROW), f64, device)
    product = _scratch("product", (2, rows, _ROW), compute, device)
    torch.sum(wide.copy_(x), 2, out=columns[_C["sum_a"] : _C["sum_b"] + 1])
    wide.copy_(torch.mul(x, x, out=product))
    torch.sum(wide, 2, out=columns[_C["norm2_a"] : _C["norm2_b"] + 1])
    wide[0].copy_(diff)
    wide[1].copy_(torch.mul(diff, diff, out=product[0]))
    torch.sum(wide, 2, out=columns[_C["sum_abs_diff"] : _C["sum_sq_diff"] + 1])
    if finite is None:
        # Row counts up to _ROW are exact in any float dtype.
        columns[_C["not_bitexact"]] = torch.sign(diff, out=product[0]).sum(1)
        columns[_C["nonfinite"] : _SUMS] = 0.0
    else:
        a, b = ab[0], ab[1]
        columns[_C["not_bitexact"]] = (~((a == b) | (a.isnan() & b.isnan()))).sum(1)
        columns[_C["nonfinite"]] = (~finite).sum(1)
        columns[_C["nonfinite_a"] : _SUMS] = (~finite_ab).sum(2)
    columns[_C["max_a"] : _C["max_b"] + 1] = extremes[0]
    columns[_C["max_abs_diff"]] = diff.amax(1)
    torch.neg(extremes[1], out=extremes[1])
    columns[_C["neg_min_a"] :] = extremes[1]
    classes = torch.zeros(_CLASSES, n_keys, dtype=f64, device=device)
    for span in spans:
        small = span.small
        if small is None:
            small = _scratch("small", ab.shape, span.coarse, device)[:, span.rows]
        span_finite = None if finite is None else finite[span.rows]
        classes += _ulp_rows(
            ab[:, span.rows],
            small,
            span,
            span_finite,
            keys[span.rows],
            n_keys,
            columns[:, span.rows],
        )
    return classes


def _ulp_rows(
    ab: torch.Tensor,
    small: torch.Tensor,
    span: _Span,
    finite: torch.Tensor | None,
    keys: torch.Tensor,
    n_keys: int,
    columns: torch.Tensor,
) -> torch.Tensor:
    """A span's ULP-class counts per key; its rows' max ULP and max rounded difference too.

    `small` is the span's (2, rows, _ROW) buffer of values rounded to the coarser dtype, filled
    here except on the sides `span.gathered` names; `columns` is its rows' slice of the matrix
    (column-major). Outside `finite`, when given, elements count as 0 ULPs and 0 difference.
    """
    compute, device, rows = ab.dtype, ab.device, ab.shape[1]
    shape = (2, rows, _ROW)
    coarse = span.coarse
    if coarse != compute:  # both sides rounded to the coarser dtype (the gathered ones are)
        for side in (0, 1):
            if not span.gathered[side]:
                small[side].copy_(ab[side])
    if all(span.native):  # the rounded difference is the difference
        columns[_C["max_abs_diff_rounded"]] = columns[_C["max_abs_diff"]]
    else:
        back = _scratch("back", shape, compute, device)
        sides = [ab[s] if span.native[s] else back[s].copy_(small[s]) for s in (0, 1)]
        rounded = _scratch("rounded", shape[1:], compute, device)
        torch.sub(sides[1], sides[0], out=rounded).abs_()
        if finite is not None:
            rounded = torch.where(finite, rounded, 0)
        columns[_C["max_abs_diff_rounded"]] = rounded.amax(1)
    if coarse == torch.float64:
        ulp = _ulp(ab[0], ab[1])
    else:
        # Sign-magnitude bits onto a signed line (-magnitude for negatives, so +0 and -0 are
        # both 0): the ULP distance is the distance of two points on it, exact in int32 for
        # 16-bit floats and in int64 for fp32.
        bits = (ab if coarse == compute else small).view(_INT_VIEW[coarse])
        line = _scratch("line", shape, bits.dtype, device)
        sign = _scratch("sign", shape, bits.dtype, device)
        width = 8 * bits.element_size()
        torch.bitwise_right_shift(bits, width - 1, out=sign)
        torch.bitwise_xor(bits, sign, out=line)
        line.sub_(sign.bitwise_and_((1 << (width - 1)) - 1))
        wide = torch.int32 if width == 16 else torch.int64
        ulp = _scratch("ulp", shape[1:], wide, device).copy_(line[0])
        ulp.sub_(_scratch("ulp_b", shape[1:], wide, device).copy_(line[1])).abs_()
    if finite is not None:
        ulp = torch.where(finite, ulp, 0)
    columns[_C["max_ulp"]] = ulp.amax(1)
    # The fp32 exponent of a count picks its class: exact below 2**24, and anything above
    # rounds to a float still >= 65536 (the last class).
    klass = _scratch("klass", shape[1:], torch.float32, device)
    key = klass.copy_(ulp).view(torch.int32).bitwise_right_shift_(23)
    key.clamp_(_EXP0 - 1, _EXP0 + _CLASSES - 2)
    torch.add((keys - (_EXP0 - 1) * n_keys)[:, None], key, alpha=n_keys, out=key)
    if device.type == "cpu":
        counts = torch.bincount(key.view(-1), minlength=_CLASSES * n_keys)
    else:  # bincount sizes its result from the data: a device sync
        counts = torch.zeros(_CLASSES * n_keys, dtype=torch.int64, device=device)
        ones = torch.ones_like(counts[:1]).expand(key.numel())
        counts.scatter_add_(0, key.view(-1).long(), ones)
    return counts.view(_CLASSES, n_keys)


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


METRIC_KERNELS: tuple[str, ...] = ("fused", "compiled", "eager")
"""Single-pair cores on CUDA, chosen with the LAB_METRICS_KERNEL environment variable."""


def metrics_kernel() -> str:
    """The CUDA metrics core LAB_METRICS_KERNEL names ("fused" when unset).

    Raises:
        ValueError: A value not in METRIC_KERNELS.
    """
    kernel = os.environ.get("LAB_METRICS_KERNEL", "fused")
    if kernel not in METRIC_KERNELS:
        raise ValueError(
            f"LAB_METRICS_KERNEL={kernel!r} is not a metrics kernel. Known: "
            f"{', '.join(METRIC_KERNELS)}."
        )
    return kernel


def _single_stats(device: torch.device) -> Any:
    """The single-pair core for `device`: on CUDA the fused Triton kernel by default.

    LAB_METRICS_KERNEL picks the CUDA core: "fused" (`lab.pairing._fused_stats`: one read of each
    input, ~0.2 MiB of scratch; falls back to "compiled" when triton is missing), "compiled"
    (`torch.compile` of the eager core: several kernels, GiB-sized temporaries for big pairs;
    a compile failure falls back to eager, once, with a warning) or "eager". Elsewhere: eager.

    Raises:
        ValueError: An unknown LAB_METRICS_KERNEL value.
    """
    if device.type != "cuda":
        return _single_core
    kernel = metrics_kernel()
    if kernel == "eager":
        return _single_core
    if kernel == "fused":
        from lab.pairing import _fused_stats

        if _fused_stats.available(device):
            return _fused_rows
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


def _fused_rows(
    a: torch.Tensor, b: torch.Tensor, coarse: torch.dtype, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_pair_stats` shaped like `_single_core`'s result (one row each)."""
    from lab.pairing._fused_stats import fused_pair_stats

    stats, hist = fused_pair_stats(a, b)
    return stats.unsqueeze(0), hist.unsqueeze(0)


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


_new = object.__new__
T = TypeVar("T")


def built(cls: type[T], fields: dict[str, Any]) -> T:
    """`cls(**fields)` for a frozen dataclass without `__post_init__`, every field given.

    The same object, built without the per-field `object.__setattr__` of a frozen dataclass's
    `__init__` (3.7 of PairMetrics' ~9 us a row; a full-size Result builds 1000-3600 rows).

    Raises:
        TypeError: `fields` does not name exactly the dataclass's fields (as `cls(**fields)`).
    """
    if fields.keys() != cls.__dataclass_fields__.keys():
        wanted, given = set(cls.__dataclass_fields__), set(fields)
        raise TypeError(
            f"built({cls.__name__}): missing {sorted(wanted - given)}, "
            f"unknown {sorted(given - wanted)}."
        )
    obj = _new(cls)
    obj.__dict__.update(fields)
    return obj


def decode_stats(
    stats: torch.Tensor | Sequence[float],
    hist: torch.Tensor | Sequence[float],
    dtype_a: torch.dtype,
    dtype_b: torch.dtype,
) -> PairMetrics:
    """Turn one (host-side) stats vector, a tensor or its `tolist()`, into named metrics."""
    if isinstance(stats, torch.Tensor):
        stats, hist = stats.tolist(), hist.tolist()
    # Unpacked by position (the order of STAT_FIELDS): no dict a row.
    (
        numel, finite, sum_abs_diff, max_abs_diff, max_abs_a, max_abs_b, max_ulp, bitexact,
        sum_sq_diff, norm2_a, norm2_b, nonfinite_a, nonfinite_b, max_abs_diff_rounded,
        degenerate_a, degenerate_b, mean_a, mean_b,
    ) = stats  # fmt: skip
    finite = max(finite, 1.0)
    denom = norm2_a + norm2_b
    cosine = sum_sq_diff / denom if denom > 0 else 0.0
    return built(
        PairMetrics,
        {
            "numel": int(numel),
            "mean_abs_diff": sum_abs_diff / finite,
            "max_abs_diff": max_abs_diff,
            "rel_max": max_abs_diff / (max_abs_a + 1e-30),
            "max_ulp": max_ulp,
            "bitexact_frac": bitexact / numel if numel else 1.0,
            "cosine_dist": max(cosine, 0.0),
            "rounding_only": bool(
                dtype_a != dtype_b and max_abs_diff > 0 and max_abs_diff_rounded == 0
            ),
            "max_abs_diff_rounded": max_abs_diff_rounded,
            "nonfinite_a": int(nonfinite_a),
            "nonfinite_b": int(nonfinite_b),
            # One element is trivially constant: only larger tensors can be degenerate.
            "degenerate": bool(numel > 1 and degenerate_a and degenerate_b),
            "ulp_hist": tuple(map(int, hist)),
            "mean_a": mean_a,
            "mean_b": mean_b,
            "max_abs_a": max_abs_a,
            "max_abs_b": max_abs_b,
        },
    )


_METRIC_KEYS: tuple[str, ...] = tuple(PairMetrics.__dataclass_fields__)


def decode_many(
    stats: Sequence[Sequence[float]],
    hists: Sequence[Sequence[float]],
    different_dtypes: Sequence[bool],
) -> list[PairMetrics]:
    """`decode_stats` of many rows at once: each derived column computed once, in numpy.

    Row i equals `decode_stats(stats[i], hists[i], dtype_a, dtype_b)` field for field and bit
    for bit (`different_dtypes[i]`: its two dtypes differ): the same IEEE operations on the same
    doubles, each of Python's `max(x, c)` written as `where(c > x, c, x)`, which keeps a NaN
    and a zero's sign as `max` does. ~1 us a row where `decode_stats` takes ~2.7 (a full-size
    Result decodes 1000-3600 rows; `tests/test_metrics_decode.py`).
    """
    if not len(stats):
        return []
    s = np.asarray(stats, dtype=np.float64).reshape(len(stats), len(STAT_FIELDS))
    numel, finite, sum_abs, max_abs, max_a, max_b, max_ulp, bitexact, sum_sq = s[:, :9].T
    norm2_a, norm2_b, nonfinite_a, nonfinite_b, rounded, deg_a, deg_b, mean_a, mean_b = s[:, 9:].T
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        finite = np.where(1.0 > finite, 1.0, finite)
        denom = norm2_a + norm2_b
        cosine = np.where(denom > 0, sum_sq / np.where(denom > 0, denom, 1.0), 0.0)
        bitexact_frac = np.where(numel != 0, bitexact / np.where(numel != 0, numel, 1.0), 1.0)
        columns = (
            numel.astype(np.int64).tolist(),
            (sum_abs / finite).tolist(),
            max_abs.tolist(),
            (max_abs / (max_a + 1e-30)).tolist(),
            max_ulp.tolist(),
            bitexact_frac.tolist(),
            np.where(0.0 > cosine, 0.0, cosine).tolist(),
            (np.asarray(different_dtypes, dtype=bool) & (max_abs > 0) & (rounded == 0)).tolist(),
            rounded.tolist(),
            nonfinite_a.astype(np.int64).tolist(),
            nonfinite_b.astype(np.int64).tolist(),
            ((numel > 1) & (deg_a != 0) & (deg_b != 0)).tolist(),
            [tuple(h) for h in np.asarray(hists, dtype=np.float64).astype(np.int64).tolist()],
            mean_a.tolist(),
            mean_b.tolist(),
            max_a.tolist(),
            max_b.tolist(),
        )
    out = []
    keys = _METRIC_KEYS
    for values in zip(*columns, strict=True):
        obj = _new(PairMetrics)
        obj.__dict__.update(zip(keys, values, strict=True))
        out.append(obj)
    return out


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> PairMetrics:
    """Metrics of one pair, computed now (a convenience over pair_stats + decode_stats)."""
    stats, hist = pair_stats(reference, candidate)
    return decode_stats(stats.cpu(), hist.cpu(), reference.dtype, candidate.dtype)

"""Dense pairs of one layout read where they are, against copied first, side by side (issue 16).

    python bench/ab_as_stored.py OUT.json [--families sd3,cosmos3] [--device cuda] [--rounds 15]

A CUDA metric batch reads contiguous outputs where they are and copies the others. sd3 full has 244
permuted q/k-norm outputs a pair ((B, H, S, D) views of (B, S, H, D) memory on both sides), and
their copies were a quarter of its metric batches' host time (`bench/pair_spy.py`). Two dense
tensors with the same strides hold the same elements at the same places, so the kernels now read
them where they are, in memory order (`_fused_stats._as_stored`). For each family, in one process,
warm, interleaved over --rounds rounds (the rounds' orders a balanced Latin square,
`pair_host.round_orders`): `plain` (both sides' `lab.forward_side`, streamed views), `stored` (the
every-module `lab.pair` as it is) and `copied` (the same pair with only contiguous pairs read where
they are, as before: `copied_first` below). Median and minimum seconds, their ratios to `plain`,
each round's own ratio, and on CUDA the peaks. Then the two pairs' rows: `rows_same_but_sums` (every
row's metrics equal but the means and ratios built on float64 sums) and `sums_rel_max` (the largest
relative difference there: the order of the additions). On CPU the family is a deep tiny model
(`pair_host.deep_tiny`; its CPU metrics take no batch, so the two pairs are the same). Writes
OUT.json after each family.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pair_host
import torch
from ab_switch import peak  # bench/ is this script's folder

from lab.pairing import _fused_stats

SUMS = ("mean_abs_diff", "cosine_dist", "mean_a", "mean_b")
"""PairMetrics fields built on float64 sums (the order of the additions moves their last bits)."""


class _OldScan:
    """The C++ extension with `scan` reporting every pair with a non-contiguous tensor."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def scan(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, list[int]]:
        groups, _ = self._core.scan(pairs)
        return groups, [i for i, (a, b) in enumerate(pairs)
                        if not (a.is_contiguous() and b.is_contiguous())]  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


@contextlib.contextmanager
def copied_first() -> Iterator[None]:
    """The batches as before: only pairs of two contiguous tensors read where they are."""
    as_stored, core = _fused_stats._as_stored, _fused_stats._core
    _fused_stats._as_stored = lambda a, b: a.is_contiguous() and b.is_contiguous()
    _fused_stats._core = lambda: None if core() is None else _OldScan(core())
    try:
        yield
    finally:
        _fused_stats._as_stored, _fused_stats._core = as_stored, core


def compare_rows(stored: Any, copied: Any) -> dict[str, Any]:
    """Whether the two Results' rows agree but for the sums, and by how much the sums differ."""
    same, rel = len(stored.rows) == len(copied.rows), 0.0
    for x, y in zip(stored.rows, copied.rows, strict=False):
        mx, my = dataclasses.asdict(x.metrics), dataclasses.asdict(y.metrics)
        same &= (x.order, x.label(), x.shape) == (y.order, y.label(), y.shape)
        for key in mx:
            a, b = mx[key], my[key]
            if key in SUMS and isinstance(a, float) and math.isfinite(a) and math.isfinite(b):
                rel = max(rel, abs(a - b) / max(abs(a), abs(b), 1e-300))
            elif repr(a) != repr(b):
                same = False
    return {"rows_same_but_sums": same, "sums_rel_max": rel, "pairs": len(stored.rows)}


def measure(name: str, device: str, rounds: int) -> dict[str, Any]:
    fam, preset, model, inputs = pair_host.family_case(name, device)
    plain, paired = pair_host.side_runs(fam, model, inputs, device)
    every = paired(None)

    def copied() -> Any:
        with copied_first():
            return every()

    cases = {"plain": plain, "stored": every, "copied": copied}
    results, peaks = {}, {}
    for key, fn in cases.items():  # warm, and the Results compared below
        results[key], peaks[key] = peak(device, fn)
    times = pair_host.timed_rounds(cases, rounds, device)
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "rounds": rounds}
    row.update(pair_host.vs_plain(times))
    row.update({f"{key}_times_s": values for key, values in times.items()})
    if device == "cuda":
        for key in ("stored", "copied"):
            row[f"{key}_peak_vs_plain"] = peaks[key] / max(peaks["plain"], 1)
    row.update(compare_rows(results["stored"], results["copied"]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3,cosmos3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    pair_host.rows_per_family(
        args.out, args.families, args.device, lambda name: measure(name, args.device, args.rounds)
    )


if __name__ == "__main__":
    main()

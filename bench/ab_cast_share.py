"""Streamed lockstep's block casts shared between the sides, against each side casting its own.

    python bench/ab_cast_share.py OUT.json [--families sd3,cosmos3,qwen_image] [--device cuda]
        [--rounds 6]

A streamed lockstep pair casts a block's weights when a side enters it. Since stop 16 the side
that leaves a block first keeps its casts for the other side (`PairedWeights.exit_block`), and
hands over there even with nothing parked (`_Lockstep.boundary`'s `lead`), so the two forwards
cast each block once. This bench times, in one process and interleaved round by round (the
first round untimed), on each family's `full` preset on CUDA (`tiny` on CPU):
- `plain`: both sides' `lab.forward_side` with streamed views (the full-size bench's baseline);
- `root`: `lab.pair` capturing the model output alone, and `root_no_lead`: the same without the
  hand-over after a block the other side has yet to run (each block cast per side, as before);
- `every`: every module, and `every_no_share`: every module with each block's casts dropped as
  its first side leaves it (the other side casts it again, as before stop 16);
- `every_park_2g` and `every_park_8g`: every module with LAB_PARK_BUDGET at 2 and 8 GiB (fewer
  hand-overs mid-block, more parked outputs).
Per case: the median and minimum wall time and, on CUDA, the peak allocated memory; then, for
`root`, `every` and `every_park_8g`, the number of hand-overs and how long a side took to wake up
after the other gave it the baton (median, sum). Writes OUT.json after every family.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from full_pair import timed  # bench/ is this script's folder
from pair_host import side_runs

import lab
from lab.base.switches import env_set
from lab.pairing import lockstep, weights
from lab.pairing.capture import ROOT

BUDGETS = {"every_park_2g": 2 << 30, "every_park_8g": 8 << 30}
"""LAB_PARK_BUDGET of the cases that set it."""


def _drop_at_first_exit(self: weights.PairedWeights, key: str, module: torch.nn.Module) -> None:
    """`PairedWeights.exit_block` before stop 16: the last side out drops, nothing is kept."""
    entries = self._inside[key].pop(id(module), [])
    if self.stream and not any(id(module) in inside for inside in self._inside.values()):
        self._drop(id(module), entries)


def _no_lead(self: lockstep._Lockstep, key: str, lead: bool = False) -> None:
    """`_Lockstep.boundary` that hands over for parked outputs only."""
    _BOUNDARY(self, key, False)


_EXIT, _BOUNDARY = weights.PairedWeights.exit_block, lockstep._Lockstep.boundary
"""The pairing code as it is (each variant patches one or both for its case)."""


@contextlib.contextmanager
def variant(case: str) -> Iterator[None]:
    """The pairing code as `case` runs it (restored on exit)."""
    saved = (weights.PairedWeights.exit_block, lockstep._Lockstep.boundary)
    budget = str(BUDGETS[case]) if case in BUDGETS else None
    try:
        if case == "every_no_share":
            weights.PairedWeights.exit_block = _drop_at_first_exit  # type: ignore[method-assign]
            lockstep._Lockstep.boundary = _no_lead  # type: ignore[method-assign]
        elif case == "root_no_lead":
            lockstep._Lockstep.boundary = _no_lead  # type: ignore[method-assign]
        with env_set("LAB_PARK_BUDGET", budget):
            yield
    finally:
        weights.PairedWeights.exit_block, lockstep._Lockstep.boundary = saved


@contextlib.contextmanager
def wake_times(latencies: list[float]) -> Iterator[None]:
    """Record, for each hand-over, the time from `_Baton.give` to the woken side's return."""
    give, wait = lockstep._Baton.give, lockstep._Baton.wait
    given: list[float] = []

    def timed_give(self: lockstep._Baton, key: str) -> None:
        given.append(time.perf_counter())
        give(self, key)

    def timed_wait(self: lockstep._Baton, key: str) -> None:
        wait(self, key)
        if given:
            latencies.append(time.perf_counter() - given[-1])

    lockstep._Baton.give, lockstep._Baton.wait = timed_give, timed_wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        lockstep._Baton.give, lockstep._Baton.wait = give, wait  # type: ignore[method-assign]


def measure(name: str, device: str, rounds: int) -> dict[str, Any]:
    """Every case of one family, interleaved (see the module docstring)."""
    fam = lab.family(name)
    preset = "full" if device == "cuda" else "tiny"
    model = fam.build(preset, 0, device=device, expert=fam.expert_for_sigma(0.75))
    inputs = fam.make_inputs(preset, 0, device=device)
    plain, paired = side_runs(fam, model, inputs, device)
    root, every = paired(lambda label: label == ROOT), paired(None)
    cases = {"plain": plain, "root": root, "root_no_lead": root, "every": every,
             "every_no_share": every, **dict.fromkeys(BUDGETS, every)}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in cases}
    peaks: dict[str, float] = {}
    for rnd in range(rounds):
        for case, fn in cases.items():
            with variant(case):
                seconds, peaks[case] = timed(fn, device)
            if rnd:
                times[case].append(seconds)
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "rounds": rounds}
    for case, values in times.items():
        peak = peaks[case] if device == "cuda" else None  # (timed gives NaN off CUDA)
        row[case] = {"median_s": statistics.median(values), "min_s": min(values),
                     "peak_gib": peak}  # fmt: skip
    for case in ("root", "every", "every_park_8g"):
        latencies: list[float] = []
        with variant(case), wake_times(latencies):
            cases[case]()
        row[case]["handovers"] = len(latencies)
        row[case]["wake_median_us"] = statistics.median(latencies) * 1e6 if latencies else 0.0
        row[case]["wake_sum_ms"] = sum(latencies) * 1e3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON file to write")
    parser.add_argument("--families", default="sd3,cosmos3,qwen_image")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, the first untimed")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: give at least 2 (the first is untimed).")
    rows = []
    for name in args.families.split(","):
        rows.append(measure(name, args.device, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

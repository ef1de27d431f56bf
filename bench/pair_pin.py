"""The kept side threads pinned to one core against left to the scheduler (LAB_PAIR_PIN, issue 16).

    python bench/pair_pin.py OUT.json [--families sd3,cosmos3] [--device cuda] [--repeat 7]

A pair hands the baton between its two side threads at every block; the woken thread, left to
the scheduler, often starts on another core with cold caches. For each family, in one process
and interleaved over --repeat rounds: `plain` (both sides' `lab.forward_side`, streamed views),
and the streamed `lab.pair` capturing `nothing` and `every` module, each with LAB_PAIR_PIN=core
(`_core`) and =off (`_off`). Median and minimum seconds of each case and its ratio to `plain`.

Only the kept threads are pinned, and only CUDA pairs keep theirs (`lockstep.KEEP_WORKERS_ON`):
with --device cpu the bench keeps them too, on a deep tiny model (`pair_host.deep_tiny`), so the
switch can be tried without a GPU; the CPU pairs of the lab never pin. Writes OUT.json after each
family.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import pair_host
import torch

from lab.base.switches import env_set
from lab.pairing import lockstep
from lab.pairing.state import sync


def cases(fam: Any, model: torch.nn.Module, inputs: Any, device: str) -> dict[str, Callable]:
    """plain, and nothing / every under each pin mode."""
    plain, paired = pair_host.side_runs(fam, model, inputs, device)
    out: dict[str, Callable[[], Any]] = {"plain": plain}
    for what, names_filter in (("nothing", lambda n: False), ("every", None)):
        run = paired(names_filter)
        for mode in ("core", "off"):

            def case(run: Callable[[], Any] = run, mode: str = mode) -> Any:
                with env_set("LAB_PAIR_PIN", mode):
                    return run()

            out[f"{what}_{mode}"] = case
    return out


def measure(name: str, device: str, repeat: int) -> dict[str, Any]:
    """One family's row (see the module docstring)."""
    fam, preset, model, inputs = pair_host.family_case(name, device)
    runs = cases(fam, model, inputs, device)
    pinned = None
    for key, fn in runs.items():
        fn()
        if key.endswith("_core"):
            pinned = lockstep._WORKERS.pinned  # the CPU the pinned cases ran on
    times: dict[str, list[float]] = {k: [] for k in runs}
    keys = list(runs)
    for round_ in range(repeat):
        # Every other round runs each setting's "off" before its "core".
        swap = [0, 2, 1, 4, 3]
        order = keys if round_ % 2 == 0 else [keys[i] for i in swap]
        for key in order:
            fn = runs[key]
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[key].append(time.perf_counter() - start)
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "repeat": repeat,
                           "cpus": len(os.sched_getaffinity(0)), "pinned_cpu": pinned}  # fmt: skip
    for key, values in times.items():
        row[f"{key}_s"] = statistics.median(values)
        row[f"{key}_min_s"] = min(values)
    for key in times:
        row[f"{key}_vs_plain"] = row[f"{key}_s"] / row["plain_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3,cosmos3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    pair_host.rows_per_family(
        args.out, args.families, args.device, lambda name: measure(name, args.device, args.repeat)
    )


if __name__ == "__main__":
    main()

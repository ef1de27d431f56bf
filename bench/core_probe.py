"""How fast each CPU runs the same interpreter work now, pass after pass (issue 16).

    python bench/core_probe.py [OUT.json] [--passes 3] [--loops 300000]

The calling thread moves to each CPU it may use in turn (2 ms to settle), times `--loops`
additions in a Python loop there, and prints one line a pass: the milliseconds per CPU. On a
shared host (a cloud VM's vCPUs) the CPUs do not all run at one speed, and which ones are
slow changes; `lab.pairing.lockstep.fastest_cpu` probes the same way, shorter, before each
pair. The thread gets its CPU set back at the end. `scripts/gpu_run.sh OUT cores` runs it
before and after the other stages of a call (`data/gpu/cores_h200_6a4657c.txt` came from
the same loop, inline).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lab.pairing.lockstep import _probe_s, restore_affinity


def loop_ms(loops: int) -> float:
    """Milliseconds `loops` additions take on the calling thread's CPU now (the loop
    `fastest_cpu` probes with, `lockstep._probe_s`, longer)."""
    return _probe_s(loops) * 1e3


def probe_pass(cpus: list[int], loops: int, settle_s: float = 0.002) -> dict[int, float | None]:
    """One pass over `cpus`: each one's milliseconds (None: the thread may not run there)."""
    mask = os.sched_getaffinity(0)
    out: dict[int, float | None] = {}
    try:
        for cpu in cpus:
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError:
                out[cpu] = None
                continue
            time.sleep(settle_s)
            out[cpu] = loop_ms(loops)
    finally:
        restore_affinity(mask)  # as fastest_cpu: the caller's CPU set back, on every path
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", nargs="?", help="append the passes here as JSON lines")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--loops", type=int, default=300_000)
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        sys.exit("core_probe.py: needs Linux thread affinity (os.sched_setaffinity).")
    cpus = sorted(os.sched_getaffinity(0))
    for _ in range(args.passes):
        ms = probe_pass(cpus, args.loops)
        print("core ms", [round(v, 1) if v is not None else None for v in ms.values()], flush=True)
        if args.out:
            with Path(args.out).open("a") as f:
                f.write(json.dumps({"t": time.time(), "loops": args.loops, "ms": ms}) + "\n")


if __name__ == "__main__":
    main()

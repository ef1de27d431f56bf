"""Why a CPU pair in lockstep costs more than two passes: OpenMP teams, one per forward thread.

    python bench/cpu_threads.py [OUT.json] [--families flux,sd3] [--repeat 12]

Lockstep runs each side's forward in its own thread (`lab.pairing.lockstep`). On CPU every
thread that enters a parallel region of torch's OpenMP (libgomp) becomes the master of its own
team, so a pair holds three teams: the caller's and one per side. libgomp counts the threads of
every team, and once that count exceeds the machine's CPUs it throttles the spin-wait of each
team's idle threads (`do_spin` uses `gomp_throttled_spin_count_var` while
`gomp_managed_threads > gomp_available_cpus`): between two parallel regions they sleep on a
futex instead of spinning, and every region pays a wake-up. A tiny model's forward is hundreds
of short regions, so it runs slower in a side thread than on the caller's, and nothing of the
pairing's own work is in that difference.

Measured, in one process (minimum of --repeat rounds; this machine's noise only adds time):
- `op`: one short parallel op (layer_norm over 64 x 1536 fp32) on the calling thread, then in a
  fresh thread (a new team: the count exceeds the CPUs while it lives), then on the calling
  thread again once that thread is gone;
- `pairs`: per family at `tiny`, the two plain forwards, `lab.pair` in two passes (on the calling
  thread) and in lockstep, at the process's thread count and at one thread (no team to wake;
  the numbers differ from those at two threads, so this is a diagnosis, not an option).
Prints JSON and writes it to OUT.json when given.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lab


def best_of(fn: Callable[[], Any], repeat: int, inner: int = 1) -> float:
    """Seconds a call of `fn`: the fastest of `repeat` + 1 rounds of `inner` calls (the first
    round warms up; being the slowest, the minimum leaves it out)."""
    best = float("inf")
    for _ in range(repeat + 1):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / inner


def in_fresh_thread(fn: Callable[[], float]) -> float:
    """`fn()` run in a new thread (its own OpenMP team), its return value handed back."""
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def op_times(repeat: int) -> dict[str, float]:
    """Microseconds of one short parallel op: caller's thread, a fresh thread, caller again."""
    x = torch.randn(64, 1536)
    norm = torch.nn.LayerNorm(1536)

    def timed() -> float:
        with torch.no_grad():
            return best_of(lambda: norm(x), repeat, inner=200) * 1e6

    return {
        "caller_us": timed(),
        "fresh_thread_us": in_fresh_thread(timed),
        "caller_after_us": timed(),
    }


def pair_times(name: str, repeat: int) -> dict[str, float]:
    """Milliseconds of the plain forwards, a two-pass pair and a lockstep pair of `name` tiny."""
    fam = lab.family(name)
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    cases: dict[str, Callable[[], Any]] = {
        "plain": lambda: [lab.forward_side(model, inputs, side) for side in (a, b)],
        "two_pass": lambda: lab.pair(model, inputs, a, b, lockstep=False),
        "lockstep": lambda: lab.pair(model, inputs, a, b, lockstep=True),
    }
    best = {k: float("inf") for k in cases}
    for fn in cases.values():
        fn()
    for _ in range(repeat):  # interleaved: a slow spell of the machine hits every case
        for key, fn in cases.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    row = {f"{k}_ms": v * 1e3 for k, v in best.items()}
    row["two_pass_vs_plain"] = best["two_pass"] / best["plain"]
    row["lockstep_vs_plain"] = best["lockstep"] / best["plain"]
    return row


def measure(families: list[str], repeat: int) -> dict[str, Any]:
    """The op times and, per family, the pair times at the process's thread count and at one."""
    threads = torch.get_num_threads()
    out: dict[str, Any] = {"threads": threads, "op": op_times(repeat), "pairs": {}}
    try:
        for count in dict.fromkeys((threads, 1)):
            torch.set_num_threads(count)
            out["pairs"][str(count)] = {name: pair_times(name, repeat) for name in families}
    finally:
        torch.set_num_threads(threads)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--families", default="flux,sd3")
    parser.add_argument("--repeat", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    got = measure(args.families.split(","), args.repeat)
    got["torch"] = torch.__version__
    text = json.dumps(got, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

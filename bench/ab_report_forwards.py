"""Captured modules reporting from instance forwards against forward hooks, side by side (issue 16).

    python bench/ab_report_forwards.py OUT.json [--families sd3,qwen_image,cosmos3]
        [--device cuda] [--repeat 15]

A lockstep pair reports each captured output to `_Lockstep._on_output`. Until stop 19 every
captured module had a forward hook for it; a module with any hook runs `Module._call_impl`'s
slow path on every call (the hook lists, a closure), and sd3 full makes 1912 captured calls a
pair. Now a captured module that is no block reports from an instance forward wrapped around
its own (`lockstep._reporting_forwards`); blocks keep their hooks. For each family, in one
process, warm, interleaved over --repeat rounds (every other round in reverse order): `plain`
(both sides' `lab.forward_side`, streamed views), `every_forwards` (the streamed every-module
`lab.pair` as it is) and `every_hooks` (the same pair with the captured modules hooked as
before, `hooked` below). Median and minimum seconds and their ratios to `plain`; `rows_equal`:
the two pairs' rows are the same, metric for metric. On CPU the family is a deep tiny model
(`pair_host.deep_tiny`) and the pairs keep their side threads, as on CUDA. Writes OUT.json
after each family.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import pair_host
import torch

from lab.pairing import lockstep
from lab.pairing.state import sync


@contextlib.contextmanager
def hooked(
    modules: list[tuple[torch.nn.Module, str]], on_output: Callable[..., None]
) -> Iterator[None]:
    """`lockstep._reporting_forwards` as it was: a forward hook with kwargs on each module."""
    handles = []
    for module, label in modules:

        def post(mod: Any, args: tuple, kwargs: dict, output: Any, label: str = label) -> None:
            key = lockstep._current_key()
            if key:
                with torch._C.DisableTorchFunction():
                    on_output(key, label, args, kwargs, output)

        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def with_hooks(run: Callable[[], Any]) -> Callable[[], Any]:
    """`run()` with the captured modules reporting through forward hooks."""

    def hooked_run() -> Any:
        with pair_host.replaced(lockstep, "_reporting_forwards", hooked):
            return run()

    return hooked_run


def measure(name: str, device: str, repeat: int) -> dict[str, Any]:
    """One family's row (see the module docstring)."""
    fam, preset, model, inputs = pair_host.family_case(name, device)
    plain, paired = pair_host.side_runs(fam, model, inputs, device)
    every = paired(None)
    cases = {"plain": plain, "every_forwards": every, "every_hooks": with_hooks(every)}
    got = {key: fn() for key, fn in cases.items()}  # warm, and the rows to compare
    rows = {k: [(r.label(), r.metrics) for r in got[k].rows] for k in cases if k != "plain"}
    times: dict[str, list[float]] = {k: [] for k in cases}
    keys = list(cases)
    for round_ in range(repeat):
        for key in keys if round_ % 2 == 0 else keys[::-1]:
            sync(device)
            start = time.perf_counter()
            cases[key]()
            sync(device)
            times[key].append(time.perf_counter() - start)
    row: dict[str, Any] = {
        "family": name,
        "preset": preset,
        "device": device,
        "repeat": repeat,
        "pairs": len(rows["every_forwards"]),
        "rows_equal": rows["every_forwards"] == rows["every_hooks"],
    }
    plain_med, plain_min = statistics.median(times["plain"]), min(times["plain"])
    for key, values in times.items():
        row[f"{key}_s"] = statistics.median(values)
        row[f"{key}_min_s"] = min(values)
        row[f"{key}_vs_plain"] = statistics.median(values) / plain_med
        row[f"{key}_min_vs_plain"] = min(values) / plain_min
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3,qwen_image,cosmos3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    pair_host.rows_per_family(
        args.out, args.families, args.device, lambda name: measure(name, args.device, args.repeat)
    )


if __name__ == "__main__":
    main()

"""Host or GPU: where a paired forward's time goes beyond two plain forwards (issue 16).

    python bench/pair_breakdown.py OUT_DIR [--families sd3,cosmos3,qwen_image,flux]

For each family at `full` on CUDA, in one process, interleaved rounds (median of --repeat,
after one untimed run of each case):
- `plain`: both sides' `lab.forward_side` with streamed views;
- `nothing`: `lab.pair` capturing nothing (its fixed cost: views, guards, hooks on the blocks,
  lockstep threads, the Result);
- `blocks`: `lab.pair` on the block outputs only;
- `every`: `lab.pair` on every module;
- `every_noreduce`: the same with the metric reduction replaced by a constant (so the rest of
  the per-pair work, hooks and bookkeeping, is what remains).
Then one run of plain / nothing / every / every_noreduce under `torch.profiler` (CUDA
activity only): the GPU's busy time (union of kernel intervals), the metric kernels' share and
the span from the first kernel to the last. A case whose wall time exceeds its GPU busy time
waits for the host. Writes OUT_DIR/pair_breakdown.json after every family.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import lab
from lab.pairing import collect
from lab.pairing.metrics import STAT_FIELDS, ULP_BIN_EDGES
from lab.pairing.weights import WeightView

_METRIC_KERNELS = ("multi_pair", "pair_stats", "finish")


def _no_reduction(self: Any, pending: Any, a: torch.Tensor, b: torch.Tensor, *_: Any) -> None:
    pending.stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=a.device)
    pending.hist = torch.zeros(len(ULP_BIN_EDGES), dtype=torch.float64, device=a.device)


def gpu_time(prof: Any) -> dict[str, float]:
    """Busy seconds (union of kernel intervals), metric-kernel seconds, first-to-last span."""
    intervals, metric = [], 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            start, end = event.time_range.start, event.time_range.end
            intervals.append((start, end))
            if any(k in event.name for k in _METRIC_KERNELS):
                metric += end - start
    intervals.sort()
    busy, open_start, open_end = 0.0, None, None
    for start, end in intervals:
        if open_end is None or start > open_end:
            if open_end is not None:
                busy += open_end - open_start
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_end is not None:
        busy += open_end - open_start
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    return {"busy_s": busy / 1e6, "metric_s": metric / 1e6, "span_s": span / 1e6,
            "kernels": len(intervals)}  # fmt: skip


def measure(name: str, repeat: int) -> dict[str, Any]:
    fam = lab.family(name)
    model = fam.build("full", 0, device="cuda", expert=fam.expert_for_sigma(0.75))
    inputs = fam.make_inputs("full", 0, device="cuda")
    a, b = lab.Side.rollout(fam, device="cuda"), lab.Side.trainer(fam, device="cuda")
    views = {s.name: WeightView(model, s, stream_classes=fam.block_classes) for s in (a, b)}
    blocks = {n for n, m in model.named_modules() if type(m).__name__ in fam.block_classes}

    def plain() -> None:
        for side in (a, b):
            lab.forward_side(model, inputs, side, view=views[side.name])

    def every_noreduce() -> None:
        real = collect.Collector._reduce_on_device
        collect.Collector._reduce_on_device = _no_reduction
        try:
            lab.pair(model, inputs, a, b, stream=True, check_outputs=False)
        finally:
            collect.Collector._reduce_on_device = real

    cases = {
        "plain": plain,
        "nothing": lambda: lab.pair(
            model, inputs, a, b, stream=True, names_filter=lambda n: False, check_outputs=False
        ),
        "blocks": lambda: lab.pair(
            model, inputs, a, b, stream=True, names_filter=blocks.__contains__
        ),
        "every": lambda: lab.pair(model, inputs, a, b, stream=True),
        "every_noreduce": every_noreduce,
    }
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeat):
        for key, fn in cases.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[key].append(time.perf_counter() - start)
    row: dict[str, Any] = {"family": name, "repeat": repeat}
    for key, values in times.items():
        row[f"{key}_s"] = statistics.median(values)
        row[f"{key}_x"] = row[f"{key}_s"] / statistics.median(times["plain"])
    result = lab.pair(model, inputs, a, b, stream=True)
    row["pairs"] = len(result.rows)
    row["numel_total"] = sum(r.metrics.numel for r in result.rows)
    for key in ("plain", "nothing", "every", "every_noreduce"):
        torch.cuda.synchronize()
        activity = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activity) as prof:
            cases[key]()
            torch.cuda.synchronize()
        for field, value in gpu_time(prof).items():
            row[f"{key}_gpu_{field}"] = value
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3,cosmos3,qwen_image,flux")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/pair_breakdown.py measures on CUDA; this machine has no GPU.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.families.split(","):
        try:
            row = measure(name, args.repeat)
        except Exception as err:  # keep the other families' figures
            row = {"family": name, "error": repr(err)[:400]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        (out / "pair_breakdown.json").write_text(json.dumps(rows, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

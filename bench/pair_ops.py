"""Which torch ops a paired forward runs on the host that two plain forwards do not (issue 16).

    python bench/pair_ops.py OUT_DIR [--families sd3,cosmos3] [--preset full] [--device cuda]
        [--rounds 7]

A pair's extra host time is spread over many small things; the per-output path and the metric
table are in C++ now (`lab/pairing/_pair_core.cpp`), so a Python profile no longer sees them. This
counts what every thread asks of torch instead: for each family, in one process, warm, the cases
`plain` (both sides' `lab.forward_side`, streamed views), `nothing` (`lab.pair` capturing no
module: views, hand-overs, Result), `blocks` (the block outputs only) and `every` (every module;
with --ablate on CUDA also `every_nolaunch`, the metric kernels not launched), first timed in
--rounds interleaved rounds (median seconds and each round's own ratio to plain), then each run
once under `torch.profiler` (CPU and, on CUDA, the kernels). Per case: every op's calls, self CPU
and self device time, and `device_ms`, its kernels' time (the GPU's busy time); then each pair
case's ops against plain's by the extra self CPU time, with the extra calls a pair. Writes
OUT_DIR/pair_ops.json and OUT_DIR/pair_ops.txt after every family.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

import lab
from lab.pairing.state import sync
from lab.pairing.weights import WeightView

CASES = ("plain", "nothing", "blocks", "every")


def _ops(prof: Any) -> dict[str, dict[str, float]]:
    """Op name -> calls, self CPU microseconds, self device microseconds."""
    out: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        out[event.key] = {
            "calls": float(event.count),
            "cpu_us": float(event.self_cpu_time_total),
            "device_us": float(getattr(event, "self_device_time_total", 0.0)),
            # A kernel's time shows twice: on its own row and as its launching op's self device
            # time. The kernels' own rows alone add up to the GPU's busy time.
            "kernel": float(str(getattr(event, "device_type", "")).endswith("CUDA")),
        }
    return out


def _diff(ops: dict[str, dict[str, float]], base: dict[str, dict[str, float]], pairs: int,
          top: int = 30) -> list[dict[str, Any]]:  # fmt: skip
    """The ops whose self CPU time a case adds over `base`, largest first."""
    rows = []
    for name in set(ops) | set(base):
        a, b = ops.get(name, {}), base.get(name, {})
        extra_us = a.get("cpu_us", 0.0) - b.get("cpu_us", 0.0)
        extra_calls = a.get("calls", 0.0) - b.get("calls", 0.0)
        rows.append({
            "op": name, "extra_cpu_ms": extra_us / 1e3, "extra_calls": extra_calls,
            "extra_calls_per_pair": extra_calls / pairs if pairs else None,
            "extra_device_ms": (a.get("device_us", 0.0) - b.get("device_us", 0.0)) / 1e3,
        })  # fmt: skip
    rows.sort(key=lambda r: -abs(r["extra_cpu_ms"]))
    return rows[:top]


def _without_launches(fn: Any) -> Any:
    from lab.pairing import _fused_stats

    launch = _fused_stats._launch
    _fused_stats._launch = lambda *args, **kwargs: None
    try:
        return fn()
    finally:
        _fused_stats._launch = launch


def make_cases(
    name: str, preset: str, device: str, ablate: bool = False
) -> dict[str, Callable[[], Any]]:
    """The cases of one family, built once: `plain`, `nothing`, `blocks`, `every` (and
    `every_nolaunch` with `ablate` on CUDA). bench/pair_spy.py samples the same cases."""
    fam = lab.family(name)
    model = fam.build(preset, 0, device=device, expert=fam.expert_for_sigma(0.75))
    inputs = fam.make_inputs(preset, 0, device=device)
    a, b = lab.Side.rollout(fam, device=device), lab.Side.trainer(fam, device=device)
    blocks = fam.block_classes
    views = {s.name: WeightView(model, s, stream_classes=blocks) for s in (a, b)}
    block_names = {
        n for n, m in model.named_modules() if type(m).__name__ in blocks and n.count(".") <= 1
    }

    def plain() -> None:
        for side in (a, b):
            lab.forward_side(model, inputs, side, view=views[side.name])

    def paired(names_filter: Any = None, check: bool = True) -> Any:
        return lab.pair(model, inputs, a, b, stream=True, names_filter=names_filter,
                        check_outputs=check)  # fmt: skip

    cases: dict[str, Callable[[], Any]] = {
        "plain": plain,
        "nothing": lambda: paired(lambda _: False, check=False),
        "blocks": lambda: paired(block_names.__contains__),
        "every": paired,
    }
    if device == "cuda" and ablate:
        # The metric kernels not launched (their buffers still made, rows decoded from them):
        # what the kernels and their launches cost the pair, the rest of its path unchanged.
        cases["every_nolaunch"] = lambda: _without_launches(paired)
    return cases


def measure(
    name: str, preset: str, device: str, rounds: int, ablate: bool = False
) -> dict[str, Any]:
    cases = make_cases(name, preset, device, ablate)
    pairs = {}
    for key, fn in cases.items():  # warm-up; the pair counts
        result = fn()
        pairs[key] = len(result.rows) if result is not None else 0
        del result
    times: dict[str, list[float]] = {k: [] for k in cases}
    own: dict[str, list[float]] = {k: [] for k in cases}
    order = list(cases)
    for r in range(rounds):
        took = {}
        for key in order[r % len(order) :] + order[: r % len(order)]:
            sync(device)
            start = time.perf_counter()
            cases[key]()
            sync(device)
            took[key] = time.perf_counter() - start
            times[key].append(took[key])
        for key in cases:
            own[key].append(took[key] / took["plain"])
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "rounds": rounds,
                           "pairs": pairs}  # fmt: skip
    for key in cases:
        row[f"{key}_s"] = statistics.median(times[key])
        row[f"{key}_vs_plain"] = row[f"{key}_s"] / row["plain_s"]
        row[f"{key}_vs_plain_rounds"] = statistics.median(own[key])
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ops = {}
    for key, fn in cases.items():
        sync(device)
        # The side threads run the forwards: every thread's ops, not only this one's.
        config = _ExperimentalConfig(profile_all_threads=True)
        with profile(activities=activities, experimental_config=config, acc_events=True) as prof:
            fn()
            sync(device)
        ops[key] = _ops(prof)
        row[f"{key}_ops_calls"] = sum(v["calls"] for v in ops[key].values())
        row[f"{key}_ops_cpu_ms"] = sum(v["cpu_us"] for v in ops[key].values()) / 1e3
        row[f"{key}_device_ms"] = (
            sum(v["device_us"] for v in ops[key].values() if v["kernel"]) / 1e3
        )
    row["top_plain"] = sorted(
        ({"op": k, **v} for k, v in ops["plain"].items()), key=lambda r: -r["cpu_us"]
    )[:30]
    for key in ("nothing", "blocks", "every"):
        row[f"{key}_over_plain"] = _diff(ops[key], ops["plain"], pairs["every"])
    row["every_over_blocks"] = _diff(ops["every"], ops["blocks"], pairs["every"] - pairs["blocks"])
    return row


def _text(row: dict[str, Any]) -> str:
    lines = [f"===== {row['family']} {row['preset']} {row['device']}, pairs {row['pairs']}"]
    for key in [k for k in (*CASES, "every_nolaunch") if f"{k}_s" in row]:
        lines.append(
            f"{key:8s} {row[f'{key}_s'] * 1e3:8.1f} ms  {row[f'{key}_vs_plain']:.3f}x "
            f"(rounds {row[f'{key}_vs_plain_rounds']:.3f}x)  ops {row[f'{key}_ops_calls']:.0f}, "
            f"self CPU {row[f'{key}_ops_cpu_ms']:.1f} ms, device {row[f'{key}_device_ms']:.1f} ms"
        )
    for key in ("nothing_over_plain", "blocks_over_plain", "every_over_plain", "every_over_blocks"):
        lines.append(f"--- {key}: op, extra self CPU ms, extra calls (a pair), extra device ms")
        for r in row[key]:
            per = r["extra_calls_per_pair"]
            lines.append(
                f"  {r['op'][:60]:60s} {r['extra_cpu_ms']:9.2f} {r['extra_calls']:9.0f} "
                f"({per if per is None else round(per, 2)}) {r['extra_device_ms']:8.2f}"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3,cosmos3")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ablate", action="store_true", help="add every_nolaunch (CUDA)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, texts = [], []
    for name in args.families.split(","):
        try:
            row = measure(name, args.preset, args.device, args.rounds, args.ablate)
            text = _text(row)
        except Exception as err:  # keep the other families' figures
            row, text = {"family": name, "error": f"{type(err).__name__}: {err}"}, ""
        print(text or json.dumps(row), flush=True)
        rows.append(row)
        texts.append(text)
        (out / "pair_ops.json").write_text(json.dumps(rows, indent=1))
        (out / "pair_ops.txt").write_text("\n".join(texts))
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

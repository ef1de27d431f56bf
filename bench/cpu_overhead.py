"""Where a tiny CPU paired forward spends its time, stage by stage, against the two plain forwards.

Run: `python bench/cpu_overhead.py [OUT.json] [--threads 2] [--repeat 40] [--families sd3,flux]`.
For each family at `tiny` it times, interleaved and taking each stage's minimum over --repeat
rounds (this machine's noise is one-sided: other work only ever adds time), and for the pairs
also the median of each round's own ratio to the plain forwards (`*_vs_plain_rounds`: a shared
machine's slow stretches last longer than a round):
- plain: `forward_side` of each side with a prebuilt WeightView (the issue's baseline);
- setup: `pair` capturing nothing (names_filter rejects every module): views, contexts, meta;
- hooks: both plain forwards reporting every module's output to a no-op, as two-pass pairing
  reports them (`capture.OutputReports`, instance forwards). Here
  the reports wrap the class forwards, outside `forward_side`: a module whose forward an engine
  op replaces for the side is not reported (the pair wraps those too);
- held: both forwards holding every floating module output with its `_version`, as two-pass
  pairing holds side A's (kept alive, so the allocator cannot reuse their memory);
- metrics: `segment_stats` over every (a, b) output pair of the two sides, one batch;
- pair: `lab.pair(...)` (two-pass, the CPU default) and `lab.pair(..., lockstep=True)`; the
  default's time is also split into its two forwards and the rest
  (`pair_forwards_vs_plain_rounds`, `pair_outside_vs_plain_rounds`: each round's own against its
  plain forwards; the two add up to `pair_vs_plain_rounds` only roughly, medians of each);
- metrics_torch, pair_torch: `metrics` and `pair` with LAB_CPU_STATS=torch (the batched torch
  passes instead of the C core), side by side with the default.
Prints one JSON row per family and writes them all to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lab
from lab.base.switches import env_set
from lab.pairing import cpu_kernel
from lab.pairing.capture import ROOT, ModuleHooks, OutputReports, flatten_output
from lab.pairing.metrics import segment_stats
from lab.pairing.weights import WeightView


def _floating(output: Any) -> list[torch.Tensor]:
    return [
        leaf
        for _, leaf in flatten_output(output)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]


def torch_stats(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` run with LAB_CPU_STATS=torch (the variable restored after)."""

    def run() -> Any:
        with env_set("LAB_CPU_STATS", "torch"):
            return fn()

    return run


def per_round_ratio(case: list[float], plain: list[float]) -> float:
    """The median over rounds of each round's case / plain seconds."""
    return statistics.median(c / p for c, p in zip(case, plain, strict=True))


def measure(name: str, repeat: int) -> dict[str, Any]:
    fam = lab.family(name)
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    views = {a.name: WeightView(model, a), b.name: WeightView(model, b)}

    def plain() -> None:
        for side in (a, b):
            lab.forward_side(model, inputs, side, view=views[side.name])

    labelled = [(module, name or ROOT) for name, module in model.named_modules()]

    def with_hooks(on_output: Callable[..., None]) -> Callable[[], None]:
        reports = OutputReports(labelled, on_output)

        def run() -> None:
            with reports.attached():
                plain()

        return run

    held: list[tuple[torch.Tensor, int]] = []

    def keep(label: str, call: int, module: Any, args: Any, kwargs: Any, out: Any) -> None:
        held.extend((t, t._version) for t in _floating(out))

    outputs: dict[str, list[torch.Tensor]] = {}
    for side in (a, b):
        got: list[torch.Tensor] = []
        hooks = ModuleHooks(model, lambda *x, got=got: got.extend(_floating(x[-1])))
        with hooks.attached():
            lab.forward_side(model, inputs, side, view=views[side.name])
        outputs[side.name] = [t.detach().clone() for t in got]
    pairs = [
        (x, y) for x, y in zip(outputs[a.name], outputs[b.name], strict=True) if x.shape == y.shape
    ]

    def nothing(name: str) -> bool:
        return False

    stages: dict[str, Callable[[], Any]] = {
        "plain": plain,
        "setup": lambda: lab.pair(model, inputs, a, b, names_filter=nothing, check_outputs=False),
        "hooks": with_hooks(lambda *x: None),
        "held": with_hooks(keep),
        "metrics": lambda: segment_stats(pairs),
        "pair": lambda: lab.pair(model, inputs, a, b),
        "pair_lockstep": lambda: lab.pair(model, inputs, a, b, lockstep=True),
        "metrics_torch": torch_stats(lambda: segment_stats(pairs)),
        "pair_torch": torch_stats(lambda: lab.pair(model, inputs, a, b)),
    }
    times: dict[str, list[float]] = {k: [] for k in stages}
    forwards: list[float] = []  # each round's pair: its two forwards (`meta["timings_s"]`)
    for fn in stages.values():
        fn()  # warm-up
    for _ in range(repeat):
        for key, fn in stages.items():
            held.clear()
            start = time.perf_counter()
            got = fn()
            times[key].append(time.perf_counter() - start)
            if key == "pair":
                forwards.append(got.meta["timings_s"]["a_s"] + got.meta["timings_s"]["b_s"])
    ms = {f"{k}_ms": min(v) * 1e3 for k, v in times.items()}
    plain_ms = ms["plain_ms"]
    row: dict[str, Any] = {"family": name, "pairs": len(pairs), **ms}
    for stage in ("pair", "pair_lockstep", "pair_torch"):
        row[f"{stage}_vs_plain"] = ms[f"{stage}_ms"] / plain_ms
        # Each round's own ratio: plain and the pair ran a few hundred ms apart, so a slow
        # stretch of a shared machine (seconds to minutes) weighs on both; the minima above
        # can come from different stretches.
        row[f"{stage}_vs_plain_rounds"] = per_round_ratio(times[stage], times["plain"])
    # The pair's time split where it falls: inside its two forwards (the reports, bookkeeping
    # and held outputs run there) and outside them (views, the metrics pass, the Result), each
    # round against its own plain forwards.
    row["pair_forwards_vs_plain_rounds"] = per_round_ratio(forwards, times["plain"])
    outside = [p - f for p, f in zip(times["pair"], forwards, strict=True)]
    row["pair_outside_vs_plain_rounds"] = per_round_ratio(outside, times["plain"])
    # Incremental costs over the two plain forwards, each as a fraction of them.
    row["share_hooks"] = (ms["hooks_ms"] - plain_ms) / plain_ms
    row["share_held"] = (ms["held_ms"] - ms["hooks_ms"]) / plain_ms
    row["share_metrics"] = ms["metrics_ms"] / plain_ms
    row["share_setup"] = ms["setup_ms"] / plain_ms - 1.0
    row["share_rest"] = (
        row["pair_vs_plain"]
        - 1.0
        - sum(row[k] for k in ("share_hooks", "share_held", "share_metrics", "share_setup"))
    )
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--families", default=",".join(lab.families()))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(lab.family(name).name, args.repeat) for name in args.families.split(",")]
    if args.out:
        meta = {"torch": torch.__version__, "threads": args.threads, "repeat": args.repeat,
                "cpu_stats_isa": list(cpu_kernel.isa_flags()), "lab_commit": _commit(),
                "recorded": time.strftime("%Y-%m-%d")}  # fmt: skip
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _commit() -> str | None:
    """The checkout's short commit, for the record (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


if __name__ == "__main__":
    main()

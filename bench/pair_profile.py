"""Where the host time of a paired forward goes, against two plain forwards (issue 16).

    python bench/pair_profile.py OUT_DIR [--families flux,sd3] [--preset full] [--device cuda]

For each family, in one process, warm (one untimed run of each case first): the two plain
forwards (`lab.forward_side` with a streamed view on CUDA), `lab.pair` capturing nothing
(`names_filter` rejecting every module: views, contexts, lockstep hand-overs, Result), and
`lab.pair` on every module (metric kernels on a side stream, the default, and on the forward's
stream, LAB_METRICS_STREAM=0); then one capture-nothing and one every-module pair under
cProfile. Writes OUT_DIR/pair_profile.json (the times and ratios) and OUT_DIR/pair_profile.txt
(the top functions by own time and by cumulative time, per case and family), both after every
family.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import lab
from lab.base.switches import env_set
from lab.pairing.state import sync
from lab.pairing.weights import WeightView


def _timed(fn: Any, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _nothing(name: str) -> bool:
    return False


def _one_stream(fn: Any) -> Any:
    """`fn()` with the metric kernels on the forward's stream (LAB_METRICS_STREAM=0)."""
    with env_set("LAB_METRICS_STREAM", "0"):
        return fn()


def measure(name: str, preset: str, device: str, repeat: int) -> tuple[dict[str, Any], str]:
    fam = lab.family(name)
    init = "bf16_shipped" if (name == "minimax_h3" and preset == "full") else "trained"
    model = fam.build(preset, 0, device=device, expert=fam.expert_for_sigma(0.75), init=init)
    inputs = fam.make_inputs(preset, 0, device=device)
    a, b = lab.Side.rollout(fam, device=device), lab.Side.trainer(fam, device=device)
    stream = device == "cuda"
    blocks = fam.block_classes if stream else ()
    views = {s.name: WeightView(model, s, stream_classes=blocks) for s in (a, b)}

    def plain() -> None:
        for side in (a, b):
            lab.forward_side(model, inputs, side, view=views[side.name])

    cases = {
        "plain": plain,
        "nothing": lambda: lab.pair(
            model, inputs, a, b, stream=stream, names_filter=_nothing, check_outputs=False
        ),
        "every_module": lambda: lab.pair(model, inputs, a, b, stream=stream),
        "every_module_one_stream": lambda: _one_stream(
            lambda: lab.pair(model, inputs, a, b, stream=stream)
        ),
    }
    for fn in cases.values():
        fn()  # warm-up
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device}
    for key, fn in cases.items():
        row[f"{key}_s"] = _timed(fn, repeat, device)
    row["nothing_vs_plain"] = row["nothing_s"] / row["plain_s"]
    row["every_module_vs_plain"] = row["every_module_s"] / row["plain_s"]
    row["every_module_one_stream_vs_plain"] = row["every_module_one_stream_s"] / row["plain_s"]
    result = cases["every_module"]()
    row["pairs"] = len(result.rows)
    row["timings_s"] = result.meta.get("timings_s", {})
    text = io.StringIO()
    text.write(f"===== {name} {preset} {device}: {json.dumps(row)}\n")
    for case in ("nothing", "every_module"):
        profile = cProfile.Profile()
        sync(device)
        profile.enable()
        cases[case]()
        sync(device)
        profile.disable()
        text.write(f"----- {case}\n")
        for order in ("tottime", "cumulative"):
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats(order).print_stats(40)
    cases.clear()
    return row, text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default=",".join(lab.families()))
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, texts = [], []
    for name in args.families.split(","):
        try:
            row, text = measure(name, args.preset, args.device, args.repeat)
        except Exception as err:  # keep the other families' figures
            row, text = {"family": name, "error": f"{type(err).__name__}: {err}"}, ""
        print(json.dumps(row), flush=True)
        rows.append(row)
        texts.append(text)
        (out / "pair_profile.json").write_text(json.dumps(rows, indent=1))
        (out / "pair_profile.txt").write_text("\n".join(texts))
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

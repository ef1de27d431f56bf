"""GPU figures for the lab core: every family paired at `reduced`, Wan2.2-A14B at `full`.

Run on the device: `python bench/gpu_core.py OUT.json`. For each run it records the build time,
each side's forward time (hooks and on-device metrics included), the paired time, the peak GPU
memory and the output metrics, then writes them as JSON.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch

import lab
from lab.pairing.capture import depth_filter


def measure(family_name: str, preset: str, capture_depth: int | None = None) -> dict:
    fam = lab.family(family_name)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = fam.build(preset, 0, device="cuda", expert=fam.expert_for_sigma(0.75))
    inputs = fam.make_inputs(preset, 0, device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    weights_gib = torch.cuda.memory_allocated() / 2**30
    rollout = lab.Side.rollout(fam, device="cuda")
    trainer = lab.Side.trainer(fam, device="cuda")
    names_filter = depth_filter(capture_depth) if capture_depth is not None else None
    start = time.perf_counter()
    result = lab.pair(
        model,
        inputs,
        rollout,
        trainer,
        names_filter=names_filter,
        meta={"family": family_name, "preset": preset},
    )
    paired_s = time.perf_counter() - start
    out = result.output_metrics()
    first = result.first_divergence()
    row = {
        "family": family_name,
        "preset": preset,
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "capture_depth": capture_depth,
        "pairs": len(result.rows),
        "skipped": len(result.skipped),
        "build_s": round(build_s, 3),
        "rollout_s": round(result.meta["timings_s"]["a_s"], 3),
        "trainer_s": round(result.meta["timings_s"]["b_s"], 3),
        "paired_s": round(paired_s, 3),
        "weights_gib": round(weights_gib, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "model_output_rel_max": out.get("model_output_rel_max"),
        "model_output_mean_abs_diff": out.get("model_output_mean_abs_diff"),
        "first_divergent_module": first.label() if first else None,
    }
    print(json.dumps(row), flush=True)
    del model, inputs, result
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "gpu_core.json"
    measure("flux", "tiny")  # warm-up: CUDA context, cuBLAS handles, kernels
    rows = []
    for name in lab.families():
        try:
            rows.append(measure(name, "reduced"))
        except Exception as err:  # keep the other families' figures
            rows.append({"family": name, "preset": "reduced", "error": repr(err)[:500]})
            print(rows[-1], flush=True)
    try:
        rows.append(measure("wan2_2", "full", capture_depth=1))
    except Exception as err:
        rows.append({"family": "wan2_2", "preset": "full", "error": repr(err)[:500]})
        print(rows[-1], flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

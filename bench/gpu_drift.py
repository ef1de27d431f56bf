"""Ratio drift at real width on the GPU: 10-step reduced trajectories with CFG 4.5.

Run on the device: `python bench/gpu_drift.py OUT.json`. For SD3.5, Qwen-Image and Wan2.2 at the
`reduced` preset it samples 10 denoising steps (rollout side, SDE window (0, 10)) and recomputes
the log-probs as the trainer, at CFG 1 and 4.5, and records mean |d log_prob|, its p99, the
ratio deviation and the fraction of samples outside Flow-GRPO's 1e-4 clip range.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import lab


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "gpu_drift.json"
    rows = []
    for name in ("sd3", "qwen_image", "wan2_2"):
        for cfg in (1.0, 4.5):
            start = time.perf_counter()
            try:
                traj = lab.trajectory(
                    name,
                    "reduced",
                    steps=10,
                    cfg_scale=cfg,
                    samples=2,
                    device="cuda",
                    keep_tensors=False,
                    progress=False,
                )
                row = {**traj.overall(), "seconds": round(time.perf_counter() - start, 2)}
            except Exception as err:  # keep the other runs' figures
                row = {"family": name, "cfg_scale": cfg, "error": repr(err)[:400]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

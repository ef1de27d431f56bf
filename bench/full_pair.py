"""Paired-forward cost against its physical limit: plain forwards, paired modes, dump-then-compare.

Run in one call on the H200: `python bench/full_pair.py OUT_DIR [--cpu-only]`. For each case it
measures, side by side in one process:
- each side's plain forward (`forward_side`, the same resident fp32 master) and its peak memory;
- the paired forward with every-module metrics, propagated and local (streamed where the
  full-size model needs it) and its peak memory;
- the same comparison done by dumping every captured module output to disk on each side and
  comparing the files afterwards;
and writes OUT_DIR/full_pair.json plus OUT_DIR/full_pair.png (ratios). The CPU section times the
tiny presets with 2 threads, as CI's machine has.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import lab
from lab.pairing.capture import ROOT, ModuleHooks, depth_filter, flatten_output
from lab.pairing.metrics import compare
from lab.pairing.state import sync
from lab.pairing.weights import WeightView


def timed(fn, device: str, repeat: int = 1) -> tuple[float, float]:
    """Median seconds over `repeat` runs and the peak GPU memory (GiB) of the last one."""
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return statistics.median(times), peak


def dump_then_compare(model, inputs, a, b, device, names_filter, root: Path) -> float:
    """Write every captured output of each side to disk, then compare the files."""
    start = time.perf_counter()
    for side in (a, b):
        folder = root / side.name
        folder.mkdir(parents=True, exist_ok=True)
        index: list[tuple[str, str]] = []

        def on_output(label, call, module, args, kwargs, output, folder=folder, index=index):
            for idx, leaf in flatten_output(output):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    name = f"{len(index):05d}.pt"
                    torch.save(leaf.detach().cpu(), folder / name)
                    index.append((f"{label}#{call}:{idx}", name))

        hooks = ModuleHooks(model, on_output, names_filter=names_filter)
        with hooks.attached():
            lab.forward_side(model, inputs, side)
        (folder / "index.json").write_text(json.dumps(index))
    index_a = dict(json.loads((root / a.name / "index.json").read_text()))
    index_b = dict(json.loads((root / b.name / "index.json").read_text()))
    for key, name in index_a.items():
        ta = torch.load(root / a.name / name).to(device)
        tb = torch.load(root / b.name / index_b[key]).to(device)
        compare(ta, tb)
    sync(device)
    return time.perf_counter() - start


_BUILT: dict[tuple[str, str, str], Any] = {}
"""The last model built (and its inputs): the cases of one model share one build."""


def measure(
    family_name: str,
    preset: str,
    device: str,
    *,
    stream: bool,
    dump: bool,
    capture_depth: int | None = None,
    repeat: int = 3,
    modes: tuple[str, ...] = ("propagated", "local"),
) -> dict[str, Any]:
    fam = lab.family(family_name)
    key = (family_name, preset, device)
    warm = key in _BUILT
    if not warm:
        _BUILT.clear()  # one model resident at a time
        gc.collect()
        model = fam.build(preset, 0, device=device, expert=fam.expert_for_sigma(0.75))
        _BUILT[key] = (model, fam.make_inputs(preset, 0, device=device))
    model, inputs = _BUILT[key]
    a = lab.Side.rollout(fam, device=device)
    b = lab.Side.trainer(fam, device=device)
    names_filter = depth_filter(capture_depth) if capture_depth is not None else None
    row: dict[str, Any] = {
        "family": family_name,
        "preset": preset,
        "device": device,
        "stream": stream,
        "capture_depth": capture_depth,
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
    }
    if device == "cuda":
        row["resident_gib"] = torch.cuda.memory_allocated() / 2**30
    blocks = fam.block_classes if stream else ()
    view_a = WeightView(model, a, stream_classes=blocks)
    view_b = WeightView(model, b, stream_classes=blocks)
    if not warm:  # warm-up: kernels, autotuning
        lab.forward_side(model, inputs, a, view=view_a)
        lab.forward_side(model, inputs, b, view=view_b)
    row["plain_a_s"], row["plain_a_peak_gib"] = timed(
        lambda: lab.forward_side(model, inputs, a, view=view_a), device, repeat
    )
    row["plain_b_s"], row["plain_b_peak_gib"] = timed(
        lambda: lab.forward_side(model, inputs, b, view=view_b), device, repeat
    )
    plain = row["plain_a_s"] + row["plain_b_s"]
    # (name, pair() arguments): the modes, plus the pieces that explain where the time goes.
    cases: list[tuple[str, dict[str, Any]]] = [
        (mode, {"mode": mode, "names_filter": names_filter}) for mode in modes
    ]
    if device == "cpu":
        # CPU default is two passes (cheapest for tiny tensors); lockstep shown beside it.
        cases.append(("lockstep", {"mode": "propagated", "lockstep": True}))
    if preset == "full" and capture_depth is None:
        # The metric kernels on a side stream, overlapping the forward's next kernels (the
        # default since data/gpu/full_pair_h200.json, whose `propagated` ran on one stream),
        # and on the forward's own stream.
        for name, flag in (("side_stream", "1"), ("same_stream", "0")):
            cases.append((name, {"mode": "propagated", "_env": {"LAB_METRICS_STREAM": flag}}))
        # The lockstep machinery with only the model output compared: threads, baton, casts.
        cases.append(("root_only", {"mode": "propagated", "names_filter": lambda n: n == ROOT}))
    for name, kwargs in cases:
        holder: dict[str, Any] = {}

        def run(kwargs: dict[str, Any] = kwargs, holder: dict = holder) -> None:
            kwargs = dict(kwargs)
            env = kwargs.pop("_env", {})
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                holder["r"] = lab.pair(model, inputs, a, b, stream=stream, **kwargs)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

        try:
            # Local mode re-runs every module: timed once, it is the slow diagnostic mode.
            runs = 1 if preset == "full" or name == "local" else repeat
            seconds, peak = timed(run, device, runs)
            row[f"{name}_s"], row[f"{name}_peak_gib"] = seconds, peak
            row[f"{name}_pairs"] = len(holder["r"].rows)
            row[f"{name}_vs_plain"] = seconds / plain
            row[f"{name}_timings_s"] = holder["r"].meta.get("timings_s")
            if device == "cuda":
                row[f"{name}_peak_vs_plain"] = peak / max(
                    row["plain_a_peak_gib"], row["plain_b_peak_gib"]
                )
            row[f"{name}_repeated_pairs"] = holder["r"].meta.get("repeated_pairs")
            if name == "propagated":
                row["model_output_rel_max"] = holder["r"].output_metrics()["model_output_rel_max"]
                row["lockstep"] = holder["r"].meta.get("lockstep")
        except Exception as err:  # keep the other figures
            row[f"{name}_error"] = repr(err)[:300]
        holder.clear()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if dump:
        root = Path(tempfile.mkdtemp(prefix="lab-dump-"))
        try:
            row["dump_s"] = dump_then_compare(model, inputs, a, b, device, names_filter, root)
            row["dump_vs_propagated"] = row["dump_s"] / row["propagated_s"]
        except Exception as err:
            row["dump_error"] = repr(err)[:300]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(row), flush=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['family']}\n{r['preset']}/{r['device']}"
        + ("\ndepth 1" if r.get("capture_depth") == 1 else "")
        for r in rows
    ]
    fig, (ax, mem) = plt.subplots(
        2, 1, figsize=(max(8, len(rows) * 1.1), 7), constrained_layout=True, sharex=True
    )
    x = range(len(rows))
    for offset, key, name in (
        (-0.2, "propagated_vs_plain", "propagated"),
        (0.2, "local_vs_plain", "local"),
    ):
        ax.bar(
            [i + offset for i in x],
            [r.get(key, float("nan")) for r in rows],
            width=0.4,
            label=f"paired {name} / two plain forwards",
        )
    ax.axhline(1.15, color="crimson", ls="--", lw=1, label="GPU target 1.15x")
    ax.axhline(1.5, color="orange", ls=":", lw=1, label="CPU tiny target 1.5x")
    ax.set_yscale("log")
    ax.set_ylabel("time ratio")
    ax.legend(fontsize=7)
    mem.bar(list(x), [r.get("propagated_peak_vs_plain", float("nan")) for r in rows], width=0.4)
    mem.axhline(1.10, color="crimson", ls="--", lw=1, label="target 1.10x")
    mem.set_ylabel("paired peak / larger plain peak")
    mem.set_ylim(0.9, None)
    mem.legend(fontsize=7)
    mem.set_xticks(list(x), labels, fontsize=7)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--cpu-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30
        if torch.cuda.is_available()
        else None,
    }
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        # Written after every case, so a run cut short still leaves its figures.
        rows.append(row)
        (out / "full_pair.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, out / "full_pair.png")

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    for name in lab.families():
        record(measure(name, "tiny", "cpu", stream=False, dump=False, repeat=5))
    torch.set_num_threads(threads)
    if not args.cpu_only and torch.cuda.is_available():
        # Compile the on-device metric kernels once for every dtype pair, outside every timed
        # region (sd3's fp16 pairs compiled inside its first timed run in data/gpu/).
        floats = (torch.bfloat16, torch.float16, torch.float32)
        for dtype_a, dtype_b in itertools.product(floats, floats):
            x = torch.randn(4096, device="cuda")
            compare(x.to(dtype_a), (x + 1e-3).to(dtype_b))
        # Every module first (the targets' case), then block outputs only, where dumping every
        # captured output to disk stays feasible (54 outputs instead of 1020).
        record(
            measure(
                "wan2_2", "full", "cuda", stream=True, dump=False, modes=("propagated",), repeat=1
            )
        )
        record(measure("wan2_2", "full", "cuda", stream=True, dump=True, capture_depth=1, repeat=1))
        _BUILT.clear()
        gc.collect()
        torch.cuda.empty_cache()
        for name in lab.families():
            dump = name in ("sd3", "flux")
            record(measure(name, "reduced", "cuda", stream=False, dump=dump, repeat=2))


if __name__ == "__main__":
    main()

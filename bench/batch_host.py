"""The host time of one CUDA metric batch, part by part (issue 16).

    python bench/batch_host.py OUT.json [--device cuda] [--pairs 40] [--scale 1.0] [--repeat 300]

A paired forward at full size queues its module outputs' metrics in batches
(`RunReducer.reduce_many`: sd3 full makes 29 a pair, of ~42 pairs each), and on a host-bound
forward every microsecond of a batch's host work is the pair's. This builds one batch shaped like
sd3 full's (bf16 pairs of 12.6M, 6.3M, 262K and 3K elements, --scale shrinks them) and times its
parts, each --repeat times: the pairs' scan, the table with its owners (one int32 a program; tens
of thousands a batch at full size) in C++ and in Python (`_plan`, with the device's program cap),
the strided copies in C++ and in Python (`read_in_place`, on adaLN-like chunks and permuted
views), and on CUDA a launch through `_launch` against the compiled kernel's own `run`, reading
the current stream's handle, the pinned table's copy up, a device buffer, and the whole
`reduce_many`. Both tables and both copies are checked equal. Writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab.pairing import _fused_stats as fs

SIZES = (1536 * 8192, 1536 * 2, 4096 * 64, 1536 * 4096)
"""Element counts of the batch's pairs, in turn (sd3 full: hidden states, adaLN rows, ...)."""


def _timed(fn: Callable[[], Any], repeat: int, device: torch.device) -> float:
    """Microseconds a call of `fn` takes on the host (warm; the device synchronized around)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    took = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return took / repeat * 1e6


def batch(
    device: torch.device, pairs: int, scale: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`pairs` contiguous bf16 pairs, their sizes cycling through SIZES (times `scale`)."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for i in range(pairs):
        n = max(1, int(SIZES[i % len(SIZES)] * scale))
        a = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
        out.append((a, (a.float() * 1.001).to(torch.bfloat16)))
    return out


def strided(device: torch.device, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-contiguous pairs as a block makes them: adaLN chunks and (B, H, S, D) views."""
    width = max(16, int(1536 * scale) // 16 * 16)
    emb = torch.randn(2, 6 * width, device=device).to(torch.bfloat16)
    chunks = emb.chunk(6, dim=1)
    tokens = max(4, int(4096 * scale))
    heads = torch.randn(2, tokens, 24, 64, device=device).to(torch.bfloat16).transpose(1, 2)
    pairs = [(chunks[k], chunks[(k + 1) % 6]) for k in range(6)]
    pairs += [(heads, heads * 2), (heads * 3, heads * 4)]
    return pairs


def measure(device: torch.device, pairs: int, scale: float, repeat: int) -> dict[str, Any]:
    row: dict[str, Any] = {"device": str(device), "pairs": pairs, "scale": scale,
                           "repeat": repeat}  # fmt: skip
    core = fs._core()
    if core is None:
        raise RuntimeError("batch_host: the C++ pairing extension is off (LAB_PAIR_CORE=python)")
    work = batch(device, pairs, scale)
    reducer = fs.RunReducer(device, None)
    if device.type != "cuda":
        reducer._programs = 132 * fs.PROGRAMS_PER_SM  # an H200's cap, for the table's size
    row["programs_cap"] = reducer._programs
    groups, _ = core.scan(work)
    ((dtypes, index),) = groups.items()
    ours = reducer._plan(work, index, dtypes, core)
    theirs = reducer._plan(work, index, dtypes, None)
    row["table_equal"] = bool(
        np.array_equal(ours.meta, theirs.meta)
        and np.array_equal(ours.owners, theirs.owners)
        and ours.constexprs == theirs.constexprs
    )
    row["programs"] = ours.first
    row["scan_us"] = _timed(lambda: core.scan(work), repeat, device)
    row["table_cxx_us"] = _timed(lambda: reducer._plan(work, index, dtypes, core), repeat, device)
    row["table_python_us"] = _timed(
        lambda: reducer._plan(work, index, dtypes, None), repeat, device
    )
    views = strided(device, scale)
    copied, read = core.read_in_place(views)
    copied_py, read_py = fs._read_in_place(views)
    row["copies_equal"] = all(
        torch.equal(x, y)
        for p, q in zip(copied, copied_py, strict=True)
        for x, y in zip(p, q, strict=True)
    ) and len(read) == len(read_py)
    row["copies_cxx_us"] = _timed(lambda: core.read_in_place(views), repeat, device)
    row["copies_python_us"] = _timed(lambda: fs._read_in_place(views), repeat, device)
    if device.type == "cuda":
        host = torch.empty(8 * len(ours.meta) + 4 * ours.first + 16, dtype=torch.uint8,
                           pin_memory=True)  # fmt: skip
        moved = host.to(device, non_blocking=True)
        table = moved[: 8 * len(ours.meta)].view(torch.int64)
        owners = moved[: 4 * ours.first].view(torch.int32)
        parts = torch.empty(ours.first + 1, fs._N_COLS, dtype=torch.float64, device=device)
        args = (ours.base_a, ours.base_b, table, owners, parts)
        kernel = fs._multi_pair_stats_kernel
        fs._launch(kernel, ours.first, args, ours.constexprs)  # compiles, or finds it compiled
        key = (kernel, device.index if device.index is not None else 0,
               *ours.constexprs.values(), *map(fs._specialization, args))  # fmt: skip
        compiled = fs._COMPILED.get(key)
        handle = torch.cuda.current_stream(device).cuda_stream
        row["launch_us"] = _timed(lambda: fs._launch(kernel, ours.first, args, ours.constexprs),
                                  repeat, device)  # fmt: skip
        row["launch_with_handle_us"] = _timed(
            lambda: fs._launch(kernel, ours.first, args, ours.constexprs, None, handle),
            repeat, device,
        )  # fmt: skip
        if compiled is not None:
            row["compiled_run_us"] = _timed(
                lambda: compiled.run(ours.first, 1, 1, handle, compiled.function,
                                     compiled.packed_metadata, None, None, None, *args,
                                     *ours.constexprs.values()),
                repeat, device,
            )  # fmt: skip
        row["stream_handle_us"] = _timed(
            lambda: torch.cuda.current_stream(device).cuda_stream, repeat, device
        )
        row["copy_up_us"] = _timed(lambda: host.to(device, non_blocking=True), repeat, device)
        row["device_empty_us"] = _timed(
            lambda: torch.empty(64, 29, dtype=torch.float64, device=device), repeat, device
        )

        def whole() -> None:
            reducer._outputs.clear()
            reducer.reduce_many(work, on_side=False)
            torch.cuda.synchronize(device)  # the host time alone, not the queue filling up

        row["reduce_many_synced_us"] = _timed(whole, max(1, repeat // 10), device)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=300)
    args = parser.parse_args()
    row = measure(torch.device(args.device), args.pairs, args.scale, args.repeat)
    row["torch"] = torch.__version__
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()

"""The single-pair metrics core on the GPU: eager, torch.compile, the fused Triton kernel.

Run on the device: `python bench/metric_kernels.py [--out OUT.json] [--sweep]`. For activation
shapes of a 14B DiT, (1, 32760, 5120) and (1, 32760, 13824), a small (1, 1024, 3072) one where
overheads dominate, and the dtype pairs (bf16, bf16),
(bf16, fp32) and (fp32, fp32), it times one pair (median of --repeat runs, CUDA-synchronised)
with
- eager: `lab.pairing.metrics._single_core`;
- compiled: `lab.pairing.metrics._single_stats(cuda)`, the path `pair_stats` takes today
  (warmed first);
- fused: `lab.pairing._fused_stats.fused_pair_stats`, one read of each input;
- read_only: `a.float().sum() + b.float().sum()`, a bandwidth reference doing no metrics
  (for bf16 it also writes and rereads the fp32 copy);
- sum_only: `a.sum(dtype=torch.float32) + b.sum(dtype=torch.float32)`, one plain read of each;
and reports each one's GB/s (bytes of both inputs / time), peak extra memory (the rise of
`torch.cuda.max_memory_allocated` over what was allocated before the call) and the wall-clock
time a call of back-to-back calls (`wall_ms_pipelined`, which counts host overhead). `fused_matches`
says whether the fused result equals the eager one (counts, maxima, histogram exactly; sums to
rtol 1e-12). --sweep also times the fused kernel under other launch shapes (warps, elements a
thread per tile, programs per SM) to show why the defaults were chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SHAPES = ((1, 32760, 5120), (1, 32760, 13824), (1, 1024, 3072))
"""A 14B DiT's activations, and a small one where launch and host overhead dominate."""
DTYPES = (
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
)
SWEEP = {"NUM_WARPS": (4, 8), "ELEMENTS_PER_THREAD": (8, 16), "PROGRAMS_PER_SM": (4, 8, 16)}
SUM_FIELDS = ("sum_abs_diff", "sum_sq_diff", "norm2_a", "norm2_b", "mean_a", "mean_b")


def _time(fn: Callable[[], Any], repeat: int) -> tuple[float, float, float]:
    """(median ms of `repeat` synchronised runs, peak extra MiB, wall ms a call back-to-back).

    The last is the wall-clock time of `repeat` calls issued without waiting, per call: the
    host's overhead shows there once the GPU work is small.
    """
    fn()  # warm: compilation, autotuning, allocator
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    begin = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - begin) * 1e3 / repeat
    return statistics.median(times), peak_mib, wall_ms


def _matches(fused: tuple[torch.Tensor, torch.Tensor], eager: tuple[torch.Tensor, ...]) -> bool:
    """Counts, maxima and histogram equal; sums within rtol 1e-12 (float64 reassociation)."""
    from lab.pairing.metrics import STAT_FIELDS

    stats, hist = (t.cpu() for t in fused)
    ref_stats, ref_hist = eager[0][0].cpu(), eager[1][0].cpu()
    if not torch.equal(hist, ref_hist):
        return False
    for i, name in enumerate(STAT_FIELDS):
        f, r = stats[i].item(), ref_stats[i].item()
        if name in SUM_FIELDS:
            if not (f == r or abs(f - r) <= 1e-12 * abs(r)):
                return False
        elif not (f == r or (f != f and r != r)):
            return False
    return True


def _inputs(shape: tuple[int, ...], dtype_a: torch.dtype, dtype_b: torch.dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(shape, device="cuda", generator=gen)
    b = (a + 1e-3 * torch.randn(shape, device="cuda", generator=gen)).to(dtype_b)
    return a.to(dtype_a), b


def bench_case(
    shape: tuple[int, ...], dtype_a: torch.dtype, dtype_b: torch.dtype, repeat: int, sweep: bool
) -> dict[str, Any]:
    from lab.pairing import _fused_stats, metrics

    a, b = _inputs(shape, dtype_a, dtype_b)
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    coarse = metrics.coarser_dtype(dtype_a, dtype_b)
    compute = torch.float64 if torch.float64 in (dtype_a, dtype_b) else torch.float32
    compiled = metrics._single_stats(torch.device("cuda"))
    nbytes = a.numel() * a.element_size() + b.numel() * b.element_size()
    methods: dict[str, Callable[[], Any]] = {
        "eager": lambda: metrics._single_core(flat_a, flat_b, coarse, compute),
        "compiled": lambda: compiled(flat_a, flat_b, coarse, compute),
        "fused": lambda: _fused_stats.fused_pair_stats(a, b),
        "read_only": lambda: a.float().sum() + b.float().sum(),
        "sum_only": lambda: a.sum(dtype=torch.float32) + b.sum(dtype=torch.float32),
    }
    row: dict[str, Any] = {
        "shape": list(shape),
        "dtype_a": str(dtype_a).removeprefix("torch."),
        "dtype_b": str(dtype_b).removeprefix("torch."),
        "gbytes": nbytes / 1e9,
    }
    for name, fn in methods.items():
        ms, peak, wall_ms = _time(fn, repeat)
        row[name] = {
            "ms": ms,
            "gbps": nbytes / ms / 1e6,
            "peak_extra_mib": peak,
            "wall_ms_pipelined": wall_ms,
        }
        print(
            json.dumps({"shape": shape, "a": row["dtype_a"], "b": row["dtype_b"], name: row[name]})
        )
    row["compile_failed"] = bool(metrics._COMPILED.get("failed"))
    row["fused_matches"] = _matches(methods["fused"](), methods["eager"]())
    if sweep:
        defaults = {key: getattr(_fused_stats, key) for key in SWEEP}
        row["sweep"] = []
        try:
            for values in itertools.product(*SWEEP.values()):
                config = dict(zip(SWEEP, values, strict=True))
                for key, value in config.items():
                    setattr(_fused_stats, key, value)
                ms, _, _ = _time(methods["fused"], repeat)
                row["sweep"].append({**config, "ms": ms, "gbps": nbytes / ms / 1e6})
                print(json.dumps(row["sweep"][-1]))
        finally:
            for key, value in defaults.items():
                setattr(_fused_stats, key, value)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here too")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("metric_kernels: needs a CUDA device.")
    import triton

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "repeat": args.repeat,
        "cases": [],
    }
    for shape in SHAPES:
        for dtype_a, dtype_b in DTYPES:
            result["cases"].append(bench_case(shape, dtype_a, dtype_b, args.repeat, args.sweep))
            torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

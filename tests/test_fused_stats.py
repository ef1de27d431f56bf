"""lab.pairing._fused_stats: the one-pass Triton kernel equals `lab.pairing.metrics._single_core`.

The CPU tests run the kernel under Triton's interpreter. TRITON_INTERPRET must be set before
`triton.jit` decorates the kernel, so it is set only in a subprocess: this file, run as a
script, computes every case with the kernel and with `_single_core` and prints them as JSON; the
tests compare them. Counts, maxima, flags and the histogram must be equal; the float64 sums may
differ by the order of their additions only (rtol 1e-12). The `gpu` tests check the compiled
kernel on CUDA the same way, on the same cases and on tensors of 3e7 elements.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from itertools import product
from pathlib import Path

import pytest
import torch

from lab.pairing import metrics

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
DTYPES = (BF16, FP16, FP32, FP64)
NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32", FP64: "fp64"}
INF, NAN = math.inf, math.nan
SUM_FIELDS = ("sum_abs_diff", "sum_sq_diff", "norm2_a", "norm2_b", "mean_a", "mean_b")
ROOT = Path(__file__).resolve().parent.parent

# Pairs of float64 values (a, b), cast to each side's dtype: non-finite on either side or both,
# signed zeros, subnormals of every dtype, opposite signs, values that overflow or tie when
# rounded to the coarser dtype (fp64 -> fp16 double rounding included), and ULP gaps from 0 to
# far beyond 65536. The huge values of one side share a sign: a sum where they cancel would be
# ill-conditioned, its digits set by the order of the additions.
SPECIAL: tuple[tuple[float, float], ...] = (
    (NAN, 1.0),
    (2.0, NAN),
    (NAN, NAN),
    (INF, INF),
    (-INF, -INF),
    (INF, -INF),
    (INF, 3.0),
    (-5.0, -INF),
    (NAN, INF),
    (0.0, -0.0),
    (-0.0, 0.0),
    (-0.0, -0.0),
    (1e-40, -1e-40),
    (1e-40, 2e-40),
    (3e-39, 3.1e-39),
    (1e-310, 0.0),
    (-1e-310, 1e-300),
    (6e-8, 5.9e-8),
    (3e-5, -3e-5),
    (1.5, -1.5),
    (-2.0, 2.0 + 2**-20),
    (70000.0, 65504.0),
    (65519.99999999, 65504.0),
    (65520.0, -65520.0),
    (3.4e38, 3.3e38),
    (3.39e38, -3.4e38),
    (1e39, -1e39),
    (1.0 + 2**-8, 1.0),
    (1.0 + 3 * 2**-8, 1.0),
    (1.0 + 2**-11, 1.0),
    (1.0 + 2**-11 + 2**-40, 1.0),
    (1.0 + 2**-24, 1.0 - 2**-25),
    (1.0, 1e30),
    (1e-30, 1e30),
    (7.0, 7.0),
    (-7.25, -7.25),
)


def _special(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n float64 pairs: SPECIAL spread over random data with multiplicative gaps 0..1e-1."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=gen, dtype=FP64) * 4
    scale = 10.0 ** -torch.randint(1, 10, (n,), generator=gen).to(FP64)
    b = a * (1 + scale * torch.randn(n, generator=gen, dtype=FP64))
    equal = torch.rand(n, generator=gen) < 0.1
    b[equal] = a[equal]
    k = min(n, len(SPECIAL))
    where = torch.randperm(n, generator=gen)[:k]
    chosen = torch.randperm(len(SPECIAL), generator=gen)[:k]
    a[where] = torch.tensor([SPECIAL[i][0] for i in chosen], dtype=FP64)
    b[where] = torch.tensor([SPECIAL[i][1] for i in chosen], dtype=FP64)
    return a, b


Case = Callable[[], tuple[torch.Tensor, torch.Tensor, dict[str, int]]]


def _mixed(dtype_a: torch.dtype, dtype_b: torch.dtype, n: int, **kwargs: int) -> Case:
    def build() -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        a, b = _special(n, seed=n + 17 * DTYPES.index(dtype_a) + DTYPES.index(dtype_b))
        return a.to(dtype_a), b.to(dtype_b), kwargs

    return build


def _made(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], **kwargs: int) -> Case:
    return lambda: (*fn(), kwargs)


def _identical(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a, _ = _special(3001, seed=5)
    a = a.to(dtype)
    return a, a.clone()


CASES: dict[str, Case] = {}
for _a, _b in product(DTYPES, DTYPES):
    _pair = f"{NAMES[_a]}-{NAMES[_b]}"
    # Small tiles, a capped grid: up to three grid-strided tiles a program, then a partial one.
    CASES[f"mixed-{_pair}"] = _mixed(_a, _b, 1000, threads=16, max_programs=3)
    CASES[f"n1-{_pair}"] = _mixed(_a, _b, 1)
    CASES[f"n7-{_pair}"] = _mixed(_a, _b, 7)
for _a, _b in ((BF16, BF16), (BF16, FP32), (FP32, FP32), (FP16, FP64)):
    # Large tiles: the interpreter's cost is per tile (and it checks one more tile shape).
    CASES[f"n70001-{NAMES[_a]}-{NAMES[_b]}"] = _mixed(_a, _b, 70_001, threads=512)
for _d in DTYPES:
    CASES[f"identical-{NAMES[_d]}"] = _made(lambda d=_d: _identical(d), threads=64)
CASES["constant-bf16-fp32"] = _made(
    lambda: (torch.full((999,), 2.5, dtype=BF16), torch.full((999,), 2.5, dtype=FP32)), threads=16
)
CASES["constant-but-masked"] = _made(
    lambda: (
        torch.tensor([3.0, NAN, 3.0, 3.0, 3.0], dtype=FP32),
        torch.tensor([1.0, 1.0, INF, 1.0, 1.0], dtype=FP32),
    )
)
CASES["zeros-signed-fp16"] = _made(
    lambda: (torch.zeros(600, dtype=FP16), -torch.zeros(600, dtype=FP16)), threads=16
)
CASES["no-finite-pair-fp32-fp64"] = _made(
    lambda: (
        torch.tensor([NAN, INF, 1.0, -INF] * 50, dtype=FP32),
        torch.tensor([1.0, NAN, INF, -INF] * 50, dtype=FP64),
    ),
    threads=8,
)


def _compute(case: str, device: str) -> dict[str, list[list[float]]]:
    """The kernel's and the reference's (stats, hist) for one case, as lists."""
    from lab.pairing._fused_stats import fused_pair_stats

    a, b, kwargs = CASES[case]()
    a, b = a.to(device), b.to(device)
    if device != "cpu":
        kwargs = {}  # the compiled kernel runs its own launch shape
    coarse = metrics.coarser_dtype(a.dtype, b.dtype)
    compute = FP64 if FP64 in (a.dtype, b.dtype) else FP32
    ref_stats, ref_hist = metrics._single_core(a.reshape(-1), b.reshape(-1), coarse, compute)
    stats, hist = fused_pair_stats(a, b, **kwargs)
    return {
        "fused": [stats.tolist(), hist.tolist()],
        "reference": [ref_stats[0].tolist(), ref_hist[0].tolist()],
    }


def _assert_same(result: dict[str, list[list[float]]]) -> None:
    (stats, hist), (ref_stats, ref_hist) = result["fused"], result["reference"]
    assert hist == ref_hist
    assert len(stats) == len(metrics.STAT_FIELDS)
    for name, got, want in zip(metrics.STAT_FIELDS, stats, ref_stats, strict=True):
        if name in SUM_FIELDS:
            assert got == pytest.approx(want, rel=1e-12, abs=0, nan_ok=True), name
        else:
            assert got == want or (math.isnan(got) and math.isnan(want)), (name, got, want)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, list[list[float]]]]:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_kernel_matches_single_core(
    interpreted: dict[str, dict[str, list[list[float]]]], case: str
) -> None:
    _assert_same(interpreted[case])


def test_cases_cover_what_they_claim(
    interpreted: dict[str, dict[str, list[list[float]]]],
) -> None:
    field = {name: i for i, name in enumerate(metrics.STAT_FIELDS)}
    identical = interpreted["identical-bf16"]["fused"][0]
    assert identical[field["sum_abs_diff"]] == 0.0
    assert identical[field["max_ulp"]] == 0.0
    assert identical[field["bitexact"]] == identical[field["numel"]] == 3001
    assert identical[field["nonfinite_a"]] > 0
    constant = interpreted["constant-bf16-fp32"]["fused"][0]
    assert constant[field["degenerate_a"]] == constant[field["degenerate_b"]] == 1.0
    assert constant[field["mean_b"]] == 2.5
    # Masked elements count as zeros for the degenerate check, but not for the means.
    masked = interpreted["constant-but-masked"]["fused"][0]
    assert masked[field["degenerate_a"]] == masked[field["degenerate_b"]] == 0.0
    assert masked[field["mean_a"]] == 3.0 and masked[field["finite"]] == 3
    assert all(count > 0 for count in interpreted["mixed-fp32-fp64"]["fused"][1])
    fp16 = interpreted["mixed-fp32-fp16"]["fused"]
    assert all(count > 0 for count in fp16[1][:-1])  # 16-bit ULPs stay below 65536
    assert fp16[0][field["max_abs_diff_rounded"]] == INF  # 70000 rounds to the fp16 inf
    assert interpreted["no-finite-pair-fp32-fp64"]["fused"][0][field["finite"]] == 0


def test_empty_pair_matches_segment_stats() -> None:
    from lab.pairing._fused_stats import fused_pair_stats

    a, b = torch.zeros(0, 3, dtype=BF16), torch.zeros(0, 3, dtype=FP32)
    stats, hist = fused_pair_stats(a, b)
    want_stats, want_hist = metrics.segment_stats([(a, b)])
    assert torch.equal(stats, want_stats[0]) and torch.equal(hist, want_hist[0])


def test_rejects_mismatched_pairs() -> None:
    from lab.pairing._fused_stats import fused_pair_stats

    with pytest.raises(ValueError, match="shapes differ"):
        fused_pair_stats(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="not a floating dtype"):
        fused_pair_stats(torch.zeros(3, dtype=torch.int32), torch.zeros(3))


def test_available_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from lab.pairing import _fused_stats

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not _fused_stats.available(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _fused_stats.available("cpu") == (_fused_stats.triton is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_kernel_matches_single_core_on_cuda(case: str) -> None:
    _assert_same(_compute(case, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype_a", "dtype_b"), list(product(DTYPES, DTYPES)))
def test_compiled_kernel_matches_single_core_on_large_tensors(
    dtype_a: torch.dtype, dtype_b: torch.dtype
) -> None:
    from lab.pairing._fused_stats import fused_pair_stats

    n = 30_000_000 + 4097  # not a multiple of any tile
    gen = torch.Generator("cuda").manual_seed(1)
    a = torch.randn(n, device="cuda", generator=gen, dtype=FP64) * 3
    b = a * (1 + 1e-3 * torch.randn(n, device="cuda", generator=gen, dtype=FP64))
    special_a, special_b = _special(5000, seed=2)
    a[-5000:], b[:5000] = special_a.cuda(), special_b.cuda()
    a, b = a.to(dtype_a).reshape(-1, 1), b.to(dtype_b).reshape(-1, 1)
    coarse = metrics.coarser_dtype(dtype_a, dtype_b)
    compute = FP64 if FP64 in (dtype_a, dtype_b) else FP32
    ref_stats, ref_hist = metrics._single_core(a.reshape(-1), b.reshape(-1), coarse, compute)
    stats, hist = fused_pair_stats(a, b)
    _assert_same(
        {
            "fused": [stats.tolist(), hist.tolist()],
            "reference": [ref_stats[0].tolist(), ref_hist[0].tolist()],
        }
    )


if __name__ == "__main__":
    # The interpreter run (TRITON_INTERPRET=1, set by the `interpreted` fixture).
    warnings.simplefilter("ignore")  # numpy warns on the overflow of masked-out lanes
    torch.set_num_threads(1)
    print(json.dumps({case: _compute(case, "cpu") for case in CASES}))


@pytest.mark.gpu
def test_direct_launches_equal_tritons_own_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    # `_launch` reuses the kernel Triton compiled for a specialization (pointer alignment,
    # n == 1, n % 16, dtypes): every case is run cold (through Triton) and warm (direct), and
    # with the cache emptied and every launch forced through Triton, and must agree bitwise.
    from lab.pairing import _fused_stats as fused

    gen = torch.Generator("cuda").manual_seed(0)
    base = torch.randn(3 * 4096 * 37 + 5, device="cuda", generator=gen)
    cases = []
    for dtype_a, dtype_b in [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float64),
    ]:
        for n in (1, 16, 1000, 4096 * 37, 3 * 4096 * 37):
            for offset in (0, 1):  # offset 1: a view whose pointer is not 16-byte aligned
                a = base.to(dtype_a)[offset : offset + n]
                b = (base * (1 + 1e-3)).to(dtype_b)[offset : offset + n]
                cases.append((a, b))
    fused._COMPILED.clear()
    cold = [fused.fused_pair_stats(a, b) for a, b in cases]
    warm = [fused.fused_pair_stats(a, b) for a, b in cases]
    assert fused._COMPILED, "no compiled kernel was kept for direct launches"
    monkeypatch.setattr(fused, "_hooked", lambda: True)  # every launch through Triton
    through_triton = [fused.fused_pair_stats(a, b) for a, b in cases]
    for (s1, h1), (s2, h2), (s3, h3) in zip(cold, warm, through_triton, strict=True):
        assert torch.equal(s1, s2) and torch.equal(s1, s3)
        assert torch.equal(h1, h2) and torch.equal(h1, h3)
    numel = metrics.STAT_FIELDS.index("numel")
    assert [int(s[numel].item()) for s, _ in warm] == [a.numel() for a, _ in cases]
    assert any(a.data_ptr() % 16 for a, _ in cases)  # misaligned views were covered


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_run_reducer_rows_equal_fused_pair_stats_bit_for_bit(side_stream: bool) -> None:
    # RunReducer: batches grouped by dtype pair, two launches a group, on a side stream or the
    # current one; every pair's numbers must be fused_pair_stats' own.
    from lab.pairing import _fused_stats as fused

    gen = torch.Generator("cuda").manual_seed(2)
    base = torch.randn(4096 * 37 + 5, device="cuda", generator=gen)
    pairs = []
    for i in range(300):
        dtype_a, dtype_b = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                            (torch.float32, torch.float32)][i % 3]  # fmt: skip
        n = (1, 16, 1000, 4096 * 37)[i % 4]
        a = base.to(dtype_a)[i % 2 : i % 2 + n]
        b = (base * (1 + 1e-3 * (i % 5))).to(dtype_b)[i % 2 : i % 2 + n]
        pairs.append((a, b))
    # Non-contiguous pairs too: their contiguous copies are temporaries a side stream must
    # not lose to the forward's stream (a queued kernel holding the side stream back, and
    # every temporary's memory handed out and overwritten right after each batch).
    square = base[: 512 * 256].reshape(512, 256)
    for i in range(6):
        a, b = square.t(), (square * (1 + 1e-3 * i)).t()
        pairs.append((a.to(torch.bfloat16), b) if i % 2 else (a, b))
    wants = [fused.fused_pair_stats(a, b) for a, b in pairs]
    stream = torch.cuda.Stream() if side_stream else None
    reducer = fused.RunReducer(torch.device("cuda"), stream)
    handles, own = [], []
    for start in range(0, len(pairs), 37):
        if stream is not None:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(200_000)  # the side stream lags behind the forward's
        # Contiguous outputs the forward drops right after they are queued (read in place:
        # their memory must not be handed out before the lagging kernels have read it).
        a = (base[:4096] * (start + 1)).to(torch.bfloat16)
        b = base[:4096] * (start + 1)
        own.append(fused.fused_pair_stats(a, b))
        handles += reducer.reduce_many([*pairs[start : start + 37], (a, b)])
        del a, b
        # Blocks of their sizes are handed out again at once if nothing holds them back.
        churn = [torch.full((4096,), float("nan"), device="cuda", dtype=d)
                 for d in (torch.bfloat16, torch.float32)]  # fmt: skip
        torch.full((4096 * 64,), float("nan"), device="cuda")  # reuses freed memory at once
        del churn
    outs = reducer.rows()
    batches = -(-len(pairs) // 37)
    assert reducer.count == len(pairs) + batches and reducer.launches <= 2 * 3 * batches
    wanted = []
    for start in range(0, len(pairs), 37):
        wanted += [*wants[start : start + 37], own[start // 37]]
    for (want_stats, want_hist), (out, row) in zip(wanted, handles, strict=True):
        assert torch.equal(outs[out][0][row], want_stats.cpu())
        assert torch.equal(outs[out][1][row], want_hist.cpu())


def test_launch_hooks_are_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    from lab.pairing import _fused_stats as fused

    if fused.triton is None:
        pytest.skip("triton not installed")
    runtime = fused.triton.knobs.runtime
    assert not fused._hooked()  # Triton's empty hook chains are no hook
    hook = runtime.launch_enter_hook
    if hasattr(hook, "add"):
        hook.add(print)
        try:
            assert fused._hooked()
        finally:
            hook.remove(print)
    else:
        monkeypatch.setattr(runtime, "launch_enter_hook", print)
        assert fused._hooked()
    assert not fused._hooked()

"""cpu_kernel.py: the C metrics core's build, its fallback and what its numbers do not depend on.

Its numbers against the single-pair reference are tested in test_metrics.py (every test there
runs on both CPU cores).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lab.pairing import cpu_kernel, metrics
from lab.pairing.metrics import STAT_FIELDS, segment_stats

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _pairs(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for i, n in enumerate((1, 7, 8, 9, 127, 128, 129, 1000, 4099)):
        a = torch.randn(n, generator=gen) * 10.0 ** (i - 4)
        b = a * (1 + 1e-3 * torch.randn(n, generator=gen))
        b[:: max(n // 5, 1)] = a[:: max(n // 5, 1)]
        dtypes = [(FP32, FP32), (BF16, BF16), (BF16, FP32), (FP16, FP32), (FP16, BF16)]
        dtype_a, dtype_b = dtypes[i % len(dtypes)]
        pairs.append((a.to(dtype_a), b.to(dtype_b)))
    a = torch.randn(300, generator=gen, dtype=FP64)
    pairs.append((a, (a * (1 + 1e-9)).to(FP32)))
    pairs.append((a.to(BF16), a))
    return pairs


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty build cache and no loaded library (restored after the test)."""
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LAB_CPU_STATS", "c")
    monkeypatch.setattr(cpu_kernel, "_STATE", {})
    return tmp_path


def test_the_library_is_built_once_into_the_cache_and_reused(fresh: Path) -> None:
    path = cpu_kernel.build()
    assert path.parent == fresh and path.suffix == ".so"
    built = path.stat().st_mtime_ns
    assert cpu_kernel.build() == path and path.stat().st_mtime_ns == built
    assert [p.name for p in fresh.iterdir()] == [path.name]  # no temporary left behind
    assert cpu_kernel.library() is cpu_kernel.library()


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernel.isa_flags(), reason="one build only: this CPU has no AVX2")
def test_every_build_gives_the_same_bits(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The source fixes its eight lanes; -mavx2 and the AVX-512 flags (where the CPU has them)
    # only change the speed, and -mf16c's conversions round as the portable code does, at the
    # 16-bit edges too.
    pairs = _pairs(1)
    edges = [2.0**-24 * k for k in (0.5, 1.5, 2.5, 1023.5, 1023.75)] + [2.0**-14 - 2.0**-30]
    edges += [1 + 2.0**-11, 1 + 3 * 2.0**-11, 65504.0, 65519.0, 65520.0, 3.4e38, 1e-30]
    x = torch.tensor(edges + [-v for v in edges], dtype=FP32)
    y = torch.nextafter(x, torch.full_like(x, float("inf")))
    for i in range(len(x)):  # each value a pair of its own: no two errors cancel in a count
        xi, yi = x[i : i + 1].repeat(3), y[i : i + 1].repeat(3)
        pairs += [
            (xi, yi.to(FP16)),
            (xi.to(FP16), yi),
            (xi.to(BF16), yi.to(FP16)),
            (xi, xi.to(BF16)),
        ]
    # Every tier of flags this CPU has: all of them (AVX-512 where it has it), AVX2 and F16C
    # alone, none.
    full = cpu_kernel.isa_flags()
    tiers = [full, *([full[:2]] if len(full) > 2 else []), ()]
    libs = []
    for flags in tiers:
        monkeypatch.setattr(cpu_kernel, "isa_flags", lambda flags=flags: flags)
        libs.append(cpu_kernel._load(cpu_kernel.build()))
    got = [cpu_kernel.aggregates(pairs, lib) for lib in libs]
    for other in got[1:]:
        for x, y in zip(got[0], other, strict=True):
            assert torch.equal(x, y)
    assert len(list(fresh.iterdir())) == len(tiers)  # one build each


def test_a_pair_gets_the_same_bits_alone_in_a_batch_and_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LAB_CPU_STATS", "c")
    assert cpu_kernel.library() is not None
    pairs = _pairs(2)
    stats, hists = segment_stats(pairs)
    again = segment_stats(pairs)
    assert torch.equal(stats, again[0]) and torch.equal(hists, again[1])
    for i, pair in enumerate(pairs):
        alone = segment_stats([pair])
        assert torch.equal(alone[0][0], stats[i]) and torch.equal(alone[1][0], hists[i]), i
    reordered = segment_stats(pairs[::-1])
    assert torch.equal(reordered[0], stats.flip(0))


def test_empty_pairs_in_a_batch_keep_their_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_CPU_STATS", "c")
    assert cpu_kernel.library() is not None
    pairs = _pairs(3)[:4]
    mixed = [pairs[0], (torch.ones(0), torch.ones(0, dtype=BF16)), *pairs[1:]]
    stats, hists = segment_stats(mixed)
    want_stats, want_hists = segment_stats(pairs)
    keep = [0, 2, 3, 4]
    assert torch.equal(stats[keep], want_stats) and torch.equal(hists[keep], want_hists)
    empty = dict(zip(STAT_FIELDS, stats[1].tolist(), strict=True))
    assert empty["degenerate_a"] == empty["degenerate_b"] == 1.0 and empty["numel"] == 0


def test_no_compiler_warns_once_and_the_torch_core_gives_the_numbers(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pairs = _pairs(4)
    want = segment_stats(pairs)  # the C core, built in `fresh`
    monkeypatch.setattr(cpu_kernel, "_STATE", {})
    monkeypatch.setenv("LAB_CACHE_DIR", str(fresh / "other"))
    monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C compiler on PATH.*LAB_CPU_STATS=torch"):
        got = segment_stats(pairs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call is silent
        segment_stats(pairs)
    assert cpu_kernel.library() is None
    assert torch.equal(got[1], want[1])
    sums = ("sum_abs_diff", "sum_sq_diff", "norm2_a", "norm2_b", "mean_a", "mean_b")
    summed = [STAT_FIELDS.index(f) for f in sums]  # float64 sums in another order
    exact = [i for i in range(len(STAT_FIELDS)) if i not in summed]
    assert torch.equal(got[0][:, exact], want[0][:, exact])
    torch.testing.assert_close(got[0][:, summed], want[0][:, summed], rtol=1e-12, atol=1e-15)


def test_a_compiler_error_is_quoted(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = fresh / "broken.c"
    broken.write_text("int lab_pair_stats(void) { return oops; }\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    quoted = r"(?s)failed \(1\): .*(oops.* undeclared|undeclared .*oops)"  # gcc's, clang's
    with pytest.raises(RuntimeError, match=quoted):
        cpu_kernel.build()
    assert not list(fresh.glob("*.so*"))


def test_a_bad_core_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_CPU_STATS", "numba")
    with pytest.raises(ValueError, match=r"LAB_CPU_STATS='numba': use 'c' .* or 'torch'"):
        segment_stats(_pairs(5))


def test_torch_core_is_used_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_CPU_STATS", "torch")
    calls = []
    monkeypatch.setattr(
        metrics, "_rows_stats", lambda *a, _f=metrics._rows_stats: calls.append(1) or _f(*a)
    )
    segment_stats(_pairs(6))
    assert calls


def test_other_tensors_go_to_the_torch_core_and_views_are_read_as_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LAB_CPU_STATS", "c")
    x = torch.arange(1.0, 6.0)
    # A negated view is read with its sign (its memory holds the positive values).
    neg = torch._neg_view(x)
    stats, _ = segment_stats([(neg, -x)])
    fields = dict(zip(STAT_FIELDS, stats[0].tolist(), strict=True))
    assert fields["mean_a"] == -3.0 and fields["bitexact"] == 5.0
    # A tensor the C core cannot read (not in CPU memory): the torch core answers, naming it.
    with pytest.raises(RuntimeError, match="meta"):
        segment_stats([(x, x.clone()), (x, torch.empty(5, device="meta"))])
    with pytest.raises(ValueError, match="strided CPU tensor"):
        cpu_kernel.aggregates([(x, torch.empty(5, device="meta"))], cpu_kernel.library())


def test_a_pair_over_a_million_rows_counts_its_histogram_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The C core's per-lane counters are folded every 65536 rows of 128: a pair of 2^23 + 2^22
    # + 5 elements crosses that once and ends on a partial row.
    monkeypatch.setenv("LAB_CPU_STATS", "c")
    n = (1 << 23) + (1 << 22) + 5
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(n, generator=gen)
    b = a + torch.randn(n, generator=gen) * 1e-6
    _, hist = segment_stats([(a, b.to(BF16))])
    _, want = metrics._single_core(a, b.to(BF16), BF16, FP32)
    assert hist[0].tolist() == want[0].tolist() and sum(hist[0].tolist()) == n

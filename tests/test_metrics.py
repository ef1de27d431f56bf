"""metrics.py: ULP distance, the paired statistics and the metrics decoded from them.

Every expected number is computed here, independently of lab.metrics: ULP counts from the IEEE bit
patterns via `struct` (or from facts such as "1.0 and 2.0 are 2**23 fp32 ULPs apart"), sums and
norms in Python floats or exact `Fraction`s on values chosen to be exact in every dtype involved.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from lab.pairing import cpu_kernel, metrics
from lab.pairing.metrics import (
    STAT_FIELDS,
    ULP_BIN_EDGES,
    ULP_BIN_LABELS,
    _single_core,
    coarser_dtype,
    compare,
    decode_stats,
    pair_stats,
    segment_stats,
    ulp_distance,
)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
INF = float("inf")


@pytest.fixture(autouse=True, params=["c", "torch"])
def cpu_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both CPU metrics cores (LAB_CPU_STATS): the C one must build."""
    monkeypatch.setenv("LAB_CPU_STATS", request.param)
    if request.param == "c":
        assert cpu_kernel.library() is not None, "the C metrics core did not build"
    return request.param


def _ordered_fp32(value: float) -> int:
    """Signed-magnitude fp32 bit pattern as an integer line (+0 and -0 both 0)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    magnitude = bits & 0x7FFF_FFFF
    return -magnitude if bits >> 31 else magnitude


def _fp32_ulps(a: float, b: float) -> int:
    return abs(_ordered_fp32(a) - _ordered_fp32(b))


def _step_fp32(x: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """Move each positive fp32 element `steps[i]` representable values up."""
    assert (x > 0).all()
    return (x.view(torch.int32) + torch.tensor(steps, dtype=torch.int32)).view(FP32)


def _rand(n: int, seed: int, dtype: torch.dtype = FP32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- ulp_distance ------------------------------------------------------------------------


def test_struct_helper_agrees_with_known_fp32_facts() -> None:
    assert _fp32_ulps(1.0, 2.0) == 2**23
    assert _fp32_ulps(0.0, -0.0) == 0
    assert _fp32_ulps(1.0, 1.0 + 2**-23) == 1


VALUES = [1.0, -1.0, 3.1415927, -2.5e-3, 1e-40, -1e-40, 6.5e4, 3.0e38, 0.0, -0.0, 1.17549435e-38]


@pytest.mark.parametrize("direction", [INF, -INF], ids=["up", "down"])
def test_fp32_nextafter_neighbours_are_one_ulp_apart(direction: float) -> None:
    x = torch.tensor(VALUES, dtype=FP32)
    y = torch.nextafter(x, torch.full_like(x, direction))
    assert (x != y).all(), "nextafter returned an equal value: the test would prove nothing"

    dist = ulp_distance(x, y)

    assert dist.shape == x.shape
    assert dist.tolist() == [1.0] * len(VALUES)
    assert ulp_distance(y, x).tolist() == [1.0] * len(VALUES)


@pytest.mark.parametrize("direction", [INF, -INF], ids=["up", "down"])
def test_bf16_neighbours_are_one_ulp_apart(direction: float) -> None:
    x = torch.tensor([1.0, -3.0, 0.0078125, 1e-39, 2.0**100], dtype=BF16)
    y = torch.nextafter(x, torch.full_like(x, direction))
    assert (x != y).all()

    assert ulp_distance(x, y).tolist() == [1.0] * 5


def test_fp16_neighbours_are_one_ulp_apart() -> None:
    x = torch.tensor([1.0, -3.0, 6e-8, 65504.0], dtype=FP16)
    y = torch.nextafter(x, torch.zeros_like(x))
    assert (x != y).all()

    assert ulp_distance(x, y).tolist() == [1.0] * 4


@pytest.mark.parametrize(("dtype", "mantissa_bits"), [(FP32, 23), (FP16, 10), (BF16, 7)])
def test_one_octave_is_two_to_the_mantissa_bits(dtype: torch.dtype, mantissa_bits: int) -> None:
    # Between 1.0 and 2.0 (and -1.0 and -2.0) every mantissa pattern occurs once.
    a = torch.tensor([1.0, -1.0, 2.0], dtype=dtype)
    b = torch.tensor([2.0, -2.0, 4.0], dtype=dtype)

    assert ulp_distance(a, b).tolist() == [2.0**mantissa_bits] * 3


def test_signed_zeros_are_zero_ulps_and_straddling_zero_counts_both_sides() -> None:
    tiny = 2.0**-149  # the smallest fp32 subnormal
    a = torch.tensor([0.0, -0.0, tiny, tiny, -tiny], dtype=FP32)
    b = torch.tensor([-0.0, 0.0, -tiny, 0.0, -0.0], dtype=FP32)

    assert ulp_distance(a, b).tolist() == [0.0, 0.0, 2.0, 1.0, 1.0]


def test_multi_step_distances_match_the_bit_pattern_count() -> None:
    x = torch.tensor([1.0, 0.75, 123.456, 1.9999999], dtype=FP32)
    steps = [5, 1000, 2**20, 3]  # the last one crosses the 2.0 exponent boundary
    y = _step_fp32(x, steps)
    expected = [_fp32_ulps(a, b) for a, b in zip(x.tolist(), y.tolist(), strict=True)]
    assert expected == steps

    assert ulp_distance(x, y).tolist() == [float(s) for s in steps]


def test_large_distance_across_zero_is_exact() -> None:
    a = torch.tensor([3.0e38], dtype=FP32)
    b = torch.tensor([-3.0e38], dtype=FP32)
    expected = _fp32_ulps(a.item(), b.item())
    assert expected > 2**31

    assert ulp_distance(a, b).item() == expected


def test_ulp_distance_rejects_mixed_dtypes_and_shapes() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        ulp_distance(torch.ones(3), torch.ones(3, dtype=BF16))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        ulp_distance(torch.ones(3), torch.ones(4))


def test_fp64_neighbours_are_one_ulp_apart() -> None:
    x = torch.tensor([1.0, 3.0, -2.5], dtype=FP64)
    y = torch.nextafter(x, torch.full_like(x, INF))
    assert (x != y).all()

    assert ulp_distance(x, y).tolist() == [1.0, 1.0, 1.0]
    metrics = compare(x, y)
    assert metrics.max_ulp == 1.0
    assert metrics.ulp_hist[0] == 0, "no element is bit-identical, yet bin 0 holds them"


# ---- coarser_dtype -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "coarser"),
    [
        (BF16, FP16, BF16),
        (BF16, FP32, BF16),
        (FP16, FP32, FP16),
        (FP32, FP64, FP32),
        (BF16, FP64, BF16),
        (FP32, FP32, FP32),
    ],
)
def test_coarser_dtype_orders_by_mantissa_bits(
    a: torch.dtype, b: torch.dtype, coarser: torch.dtype
) -> None:
    assert coarser_dtype(a, b) is coarser
    assert coarser_dtype(b, a) is coarser


@pytest.mark.parametrize("bad", [torch.int32, torch.int64, torch.bool])
def test_coarser_dtype_rejects_non_floating(bad: torch.dtype) -> None:
    with pytest.raises(ValueError, match="not a floating dtype"):
        coarser_dtype(FP32, bad)


# ---- pair_stats / compare on known tensors ---------------------------------------------------

# Dyadic values: exact in bf16, fp16, fp32 and float64, so every sum below is exact too.
REF = [1.0, -2.0, 0.5, 4.0, 0.0, -0.25, 3.0, -1.0]
CAND = [1.0, -1.5, 0.75, 4.0, 0.125, -0.25, 2.0, -1.0]


def test_known_pair_gives_hand_computed_metrics() -> None:
    a, b = torch.tensor(REF, dtype=FP32), torch.tensor(CAND, dtype=FP32)
    m = compare(a, b)

    d = [abs(y - x) for x, y in zip(REF, CAND, strict=True)]
    assert d == [0.0, 0.5, 0.25, 0.0, 0.125, 0.0, 1.0, 0.0]
    assert m.numel == 8
    assert m.mean_abs_diff == sum(d) / 8 == 1.875 / 8
    assert m.max_abs_diff == 1.0
    assert m.max_abs_a == 4.0 and m.max_abs_b == 4.0
    assert m.rel_max == 1.0 / (4.0 + 1e-30) == 0.25
    assert m.bitexact_frac == 4 / 8
    assert m.mean_a == sum(REF) / 8 and m.mean_b == sum(CAND) / 8

    dot = sum(Fraction(x) * Fraction(y) for x, y in zip(REF, CAND, strict=True))
    norms = sum(Fraction(x) ** 2 for x in REF) + sum(Fraction(y) ** 2 for y in CAND)
    cosine = float(1 - 2 * dot / norms)
    assert cosine > 1e-3
    # Exact inputs; the code rounds twice in float64 (the quotient, then 1 - q): 2 ULPs of 1.0.
    assert m.cosine_dist == pytest.approx(cosine, rel=0, abs=4.5e-16)

    ulps = [_fp32_ulps(x, y) for x, y in zip(REF, CAND, strict=True)]
    assert m.max_ulp == max(ulps)
    assert m.nonfinite_a == m.nonfinite_b == 0
    assert m.rounding_only is False and m.degenerate is False


def test_random_pair_matches_a_float64_hand_computation() -> None:
    a, b = _rand(4096, seed=1), _rand(4096, seed=1) + 1e-3 * _rand(4096, seed=2)
    m = compare(a, b)

    ra, rb = a.tolist(), b.tolist()  # fp32 values, exact as Python floats
    d = [abs(y - x) for x, y in zip(ra, rb, strict=True)]
    max_ref = max(abs(x) for x in ra)
    dot = math.fsum(x * y for x, y in zip(ra, rb, strict=True))
    norms = math.fsum(x * x for x in ra) + math.fsum(y * y for y in rb)
    ulps = [_fp32_ulps(x, y) for x, y in zip(ra, rb, strict=True)]

    # Differences and maxima are single float64 operations on exact inputs: bit-exact.
    assert m.max_abs_diff == max(d)
    assert m.rel_max == max(d) / (max_ref + 1e-30)
    assert m.max_ulp == max(ulps)
    assert m.bitexact_frac == sum(x == y for x, y in zip(ra, rb, strict=True)) / 4096
    # torch sums 4096 float64 terms in its own order, fsum rounds once: 1e-12 covers the order.
    assert m.mean_abs_diff == pytest.approx(math.fsum(d) / 4096, rel=1e-12)
    # The formula cancels to ~1e-7 here; 4096-term sums in another order move it by < n*eps.
    assert m.cosine_dist == pytest.approx(1 - 2 * dot / norms, rel=0, abs=1e-12)
    assert m.cosine_dist > 1e-9, "the perturbation vanished: the cosine check is vacuous"


def test_rel_max_divides_by_the_reference_side() -> None:
    m = compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 10.0]))
    assert m.rel_max == 8.0 / 2.0

    flipped = compare(torch.tensor([1.0, 10.0]), torch.tensor([1.0, 2.0]))
    assert flipped.rel_max == 8.0 / 10.0


def test_rel_max_with_an_all_zero_reference_uses_the_1e_30_floor() -> None:
    m = compare(torch.zeros(3), torch.tensor([0.0, 0.5, -0.25]))
    assert m.rel_max == 0.5 / 1e-30


def test_identical_tensors_give_zero_metrics_and_full_bitexact() -> None:
    a = _rand(1000, seed=3)
    m = compare(a, a.clone())

    assert (m.mean_abs_diff, m.max_abs_diff, m.rel_max, m.max_ulp, m.cosine_dist) == (0, 0, 0, 0, 0)
    assert m.max_abs_diff_rounded == 0
    assert m.bitexact_frac == 1.0
    assert m.ulp_hist == (1000,) + (0,) * (len(ULP_BIN_EDGES) - 1)
    assert m.rounding_only is False
    assert m.degenerate is False, "random data is not a degenerate pair"


def test_ulp_histogram_bins_follow_their_labels() -> None:
    steps = [0, 1, 2, 3, 4, 15, 16, 63, 64, 255, 256, 4095, 4096, 65535, 65536, 2**20]
    a = torch.full((len(steps),), 1.5, dtype=FP32)
    b = _step_fp32(a, steps)

    m = compare(a, b)

    assert ULP_BIN_LABELS == ("0", "1", "2-3", "4-15", "16-63", "64-255", "256-4095",
                              "4096-65535", ">=65536")  # fmt: skip
    # One count per label's range: 0 | 1 | 2,3 | 4,15 | 16,63 | ... | 65536, 2**20.
    assert m.ulp_hist == (1, 1, 2, 2, 2, 2, 2, 2, 2)
    assert m.max_ulp == 2**20
    assert m.bitexact_frac == 1 / len(steps)


# ---- rounding_only -----------------------------------------------------------------------


def test_fp32_against_its_own_bf16_rounding_is_rounding_only() -> None:
    x = _rand(512, seed=4)
    y = x.to(BF16)
    assert not torch.equal(x, y.float()), "no element needed rounding: the test proves nothing"

    for m in (compare(x, y), compare(y, x)):
        assert m.max_abs_diff > 0
        assert m.max_abs_diff_rounded == 0
        assert m.rounding_only is True
        # ULPs are counted in the coarser dtype, where the two sides agree exactly.
        assert m.max_ulp == 0 and m.ulp_hist[0] == 512


def test_a_real_difference_beyond_rounding_is_not_rounding_only() -> None:
    x = _rand(512, seed=5)
    y = (x * 1.01).to(BF16)
    m = compare(x, y)

    assert m.max_abs_diff > 0
    expected_rounded = (x.to(BF16).double() - y.double()).abs().max().item()
    assert expected_rounded > 0
    assert m.max_abs_diff_rounded == expected_rounded
    assert m.rounding_only is False


def test_same_dtype_difference_is_never_rounding_only() -> None:
    x = _rand(64, seed=6)
    y = torch.nextafter(x, torch.full_like(x, INF))
    m = compare(x, y)

    assert m.max_abs_diff > 0 and m.max_ulp == 1
    assert m.rounding_only is False


# ---- non-finite and degenerate ---------------------------------------------------------------


def test_nan_and_inf_are_counted_per_side_and_excluded_from_diffs() -> None:
    nan = float("nan")
    ref = [1.0, nan, nan, INF, 4.0, -INF, 2.0]
    cand = [1.5, nan, 2.0, INF, 4.0, 3.0, 2.0]
    m = compare(torch.tensor(ref), torch.tensor(cand))

    assert (m.nonfinite_a, m.nonfinite_b) == (4, 2)
    # Only indices 0, 4, 6 are finite on both sides: diffs 0.5, 0, 0.
    assert m.max_abs_diff == 0.5
    assert m.mean_abs_diff == 0.5 / 3
    assert m.max_abs_a == 4.0 and m.max_abs_b == 4.0
    assert m.rel_max == 0.5 / 4.0
    assert sum(m.ulp_hist) == 3
    assert m.max_ulp == _fp32_ulps(1.0, 1.5)
    dot = 1.0 * 1.5 + 16.0 + 4.0
    norms = (1.0 + 16.0 + 4.0) + (2.25 + 16.0 + 4.0)
    assert m.cosine_dist == pytest.approx(1 - 2 * dot / norms, rel=0, abs=4.5e-16)
    assert all(math.isfinite(v) for v in (m.mean_abs_diff, m.max_abs_diff, m.cosine_dist))


def test_per_side_means_of_a_finite_pair() -> None:
    m = compare(torch.tensor([1.0, 2.0, 4.0, -3.0]), torch.tensor([0.5, 2.0, 4.0, 1.5]))
    assert (m.mean_a, m.mean_b) == (4.0 / 4, 8.0 / 4)


def test_per_side_means_exclude_non_finite_elements() -> None:
    m = compare(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([float("nan"), 2.0, 3.0]))
    # Either definition is defensible; 5/3 (the sum over 2 elements divided by 3) is not.
    assert m.mean_a in (2.0, 2.5)
    assert m.mean_b == 2.5


@pytest.mark.parametrize(
    ("ref", "cand"),
    [
        ([0.0] * 6, [0.0] * 6),
        ([3.0] * 6, [3.0] * 6),
        ([3.0] * 6, [5.0] * 6),
        ([0.0] * 6, [-2.0] * 6),
    ],
    ids=["both_zero", "same_constant", "two_constants", "zero_and_constant"],
)
def test_constant_pairs_are_flagged_degenerate(ref: list[float], cand: list[float]) -> None:
    m = compare(torch.tensor(ref), torch.tensor(cand))
    assert m.degenerate is True


@pytest.mark.parametrize("constant_side", ["reference", "candidate", "neither"])
def test_one_constant_side_is_not_degenerate(constant_side: str) -> None:
    varying = _rand(6, seed=7)
    constant = torch.full((6,), 2.0)
    if constant_side == "reference":
        a, b = constant, varying
    elif constant_side == "candidate":
        a, b = varying, constant
    else:
        a, b = varying, _rand(6, seed=8)
    assert varying.amax() != varying.amin()

    assert compare(a, b).degenerate is False


def test_all_zero_pair_has_zero_cosine_distance_not_nan() -> None:
    m = compare(torch.zeros(4), torch.zeros(4))
    assert m.cosine_dist == 0.0
    assert m.bitexact_frac == 1.0


# ---- the raw vector ------------------------------------------------------------------------


def test_pair_stats_vector_decodes_to_compare() -> None:
    a, b = _rand(32, seed=9), _rand(32, seed=9, dtype=BF16)
    stats, hist = pair_stats(a, b)

    assert stats.dtype is FP64 and stats.shape == (len(STAT_FIELDS),)
    assert hist.dtype is FP64 and hist.shape == (len(ULP_BIN_EDGES),)
    fields = dict(zip(STAT_FIELDS, stats.tolist(), strict=True))
    assert fields["numel"] == 32 and fields["finite"] == 32
    assert decode_stats(stats, hist, a.dtype, b.dtype) == compare(a, b)


def test_pair_stats_rejects_shape_mismatch_and_non_floating() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        pair_stats(torch.ones(3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="not a floating dtype"):
        pair_stats(torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))


# ---- the batched path (segment_stats) against the per-pair reference -----------------------

DTYPES = (BF16, FP16, FP32, FP64)
# Sizes around the batched layout's row widths (64, 128, 256), a few odd ones, 0 and 1.
SIZES = (0, 1, 2, 3, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 1000, 1031, 4096)
SUMMED = ("sum_abs_diff", "sum_sq_diff", "norm2_a", "norm2_b", "mean_a", "mean_b")
SPECIALS = (float("nan"), INF, -INF, 0.0, -0.0, 1e-40, -3e-39, 7e4, 1e30, -1e30)


def _reference(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pair through `_single_core`, the single-pair reference (and segment_stats' empties)."""
    if a.numel() == 0:
        stats = torch.zeros(len(STAT_FIELDS), dtype=FP64)
        stats[STAT_FIELDS.index("degenerate_a")] = stats[STAT_FIELDS.index("degenerate_b")] = 1
        return stats, torch.zeros(len(ULP_BIN_EDGES), dtype=FP64)
    compute = FP64 if FP64 in (a.dtype, b.dtype) else FP32
    stats, hist = _single_core(
        a.reshape(-1), b.reshape(-1), coarser_dtype(a.dtype, b.dtype), compute
    )
    return stats.reshape(-1), hist.reshape(-1)


def _mean_abs(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean |x| over the elements finite on both sides: the scale of a signed sum's rounding."""
    compute = FP64 if FP64 in (x.dtype, y.dtype) else FP32
    x, y = x.reshape(-1).to(compute), y.reshape(-1).to(compute)
    finite = x.isfinite() & y.isfinite()
    return x[finite].double().abs().sum().item() / max(int(finite.sum()), 1)


def _assert_batched_matches_reference(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    stats, hists = segment_stats(pairs)
    assert stats.shape == (len(pairs), len(STAT_FIELDS)) and stats.dtype is FP64
    assert hists.shape == (len(pairs), len(ULP_BIN_EDGES)) and hists.dtype is FP64
    for i, (a, b) in enumerate(pairs):
        want_stats, want_hist = _reference(a, b)
        where = f"pair {i}: {a.dtype} vs {b.dtype}, shape {tuple(a.shape)}"
        assert hists[i].tolist() == want_hist.tolist(), where
        for name, got, want in zip(
            STAT_FIELDS, stats[i].tolist(), want_stats.tolist(), strict=True
        ):
            if name in SUMMED:
                # float64 sums of the same terms in another order; a signed sum (the means) may
                # cancel, so its slack scales with the mean magnitude, not the result.
                scale = {"mean_a": _mean_abs(a, b), "mean_b": _mean_abs(b, a)}.get(name, 0.0)
                assert got == pytest.approx(want, rel=1e-12, abs=1e-13 * scale), (where, name)
            else:  # counts, maxima, flags: bit-identical
                assert got == want, (where, name, got, want)


def _random_pair(gen: torch.Generator, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair of random dtypes and shape whose candidate is a random kind of copy, sprinkled
    with NaN, +-Inf, +-0, subnormals and values beyond the 16-bit ranges."""

    def pick(n: int) -> int:
        return int(torch.randint(n, (), generator=gen))

    dtype_a, dtype_b = DTYPES[pick(4)], DTYPES[pick(4)]
    shape = [(numel,), (1, numel), (numel, 1)][pick(3)]
    if numel % 8 == 0 and numel:
        shape = (2, numel // 8, 4)
    scale = 10.0 ** (6 * torch.rand((), generator=gen).item() - 3)
    a = torch.randn(numel, generator=gen, dtype=FP64) * scale
    kind = pick(6)
    if kind == 0:  # identical values (bit-identical once in a shared dtype)
        b = a.clone()
    elif kind == 1:  # nearby
        b = a * (1 + 1e-3 * torch.randn(numel, generator=gen, dtype=FP64))
    elif kind == 2:  # unrelated
        b = torch.randn(numel, generator=gen, dtype=FP64) * scale
    elif kind == 3:  # one constant on both sides
        a = torch.full((numel,), scale, dtype=FP64)
        b = a.clone()
    elif kind == 4:  # two different constants (one of them zero)
        a, b = torch.full((numel,), -scale, dtype=FP64), torch.zeros(numel, dtype=FP64)
    else:  # the candidate is the reference rounded to bfloat16
        b = a.to(BF16).double()
    if numel and pick(2):
        for x in (a, b):
            where = torch.randint(numel, (max(numel // 20, 1),), generator=gen)
            x[where] = torch.tensor(SPECIALS, dtype=FP64)[
                torch.randint(len(SPECIALS), where.shape, generator=gen)
            ]
    return a.to(dtype_a).reshape(shape), b.to(dtype_b).reshape(shape)


@pytest.mark.parametrize("seed", range(12))
def test_batched_stats_match_the_single_pair_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n_pairs = [1, 2, 7, 40][seed % 4]
    sizes = torch.tensor(SIZES)[torch.randint(len(SIZES), (n_pairs,), generator=gen)]
    _assert_batched_matches_reference([_random_pair(gen, int(n)) for n in sizes])


@pytest.mark.parametrize("dtype_a", DTYPES)
@pytest.mark.parametrize("dtype_b", DTYPES)
def test_batched_stats_match_for_every_dtype_pair(
    dtype_a: torch.dtype, dtype_b: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(100)
    a = torch.randn(3, 333, generator=gen, dtype=FP64) * 100
    b = a + torch.randn(a.shape, generator=gen, dtype=FP64) * 0.1
    b[0, :5] = torch.tensor([float("nan"), INF, -INF, -0.0, 0.0])
    pairs = [(a.to(dtype_a), b.to(dtype_b)), (a[:, :7].to(dtype_a), b[:, :7].to(dtype_b))]
    pairs.append((torch.full((130,), -2.5, dtype=dtype_a), torch.full((130,), -2.5, dtype=dtype_b)))
    _assert_batched_matches_reference(pairs)


def _bits_f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(FP32)


@pytest.mark.parametrize("coarse", [BF16, FP16])
def test_batched_stats_round_like_torch_at_the_edges_of_a_16_bit_dtype(coarse: torch.dtype) -> None:
    # Values whose rounding to the coarser dtype is hardest to get right: ties to even on both
    # sides of each, the fp16 subnormal range and its top, the overflow threshold (65520 rounds
    # to Inf in fp16; past bf16's largest value in fp32), a float64 that rounds differently
    # through float32 than directly, and neighbours a ULP or two apart.
    one = 0x3F80_0000
    ties = [one + (1 << 15), one + (3 << 15), one + (1 << 12), one + (3 << 12), one + 1]
    sub = [2.0**-24 * k for k in (0.5, 1.5, 2.5, 1023.5, 1023.75)] + [2.0**-14 - 2.0**-30]
    big = [65504.0, 65519.0, 65520.0, 3.3e38, 3.4028e38, -65520.0, -3.39e38]
    a = torch.cat([_bits_f32(ties), torch.tensor(sub + big, dtype=FP32)])
    a = torch.cat([a, -a])
    b = torch.nextafter(a, torch.full_like(a, INF))
    pairs = [(a, b.to(coarse)), (a.to(coarse), b), (a, a.to(coarse)), (a.flip(0), b)]
    x64 = torch.tensor([1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-11 + 2.0**-40, -(2.0**-24) * 1.5000001])
    pairs += [(x64, x64.to(coarse)), (x64.to(coarse), x64 * (1 + 2.0**-20))]
    _assert_batched_matches_reference(pairs)


def test_batched_stats_of_real_activation_shapes_and_mixed_dtypes() -> None:
    # Layouts like a model's outputs: bf16 and fp32 tensors of assorted shapes in one batch.
    gen = torch.Generator().manual_seed(7)
    shapes = [(1, 16, 64), (1, 16, 192), (1, 64), (2, 4, 16, 16), (1, 8, 3), (1,), (5, 7, 11)]
    pairs = []
    for i, shape in enumerate(shapes * 3):
        x = torch.randn(shape, generator=gen)
        reference = x.to(BF16) if i % 3 else x
        candidate = [x.to(BF16), x + 1e-3, x * (1 + 1e-2)][i % 3]
        pairs.append((reference, candidate.to([BF16, FP32, FP16][i % 3])))
    _assert_batched_matches_reference(pairs)


def test_batched_stats_of_non_contiguous_scalar_and_grad_tracking_tensors() -> None:
    x = torch.randn(40, 70, dtype=FP32, requires_grad=True)
    y = x.detach() + 1e-3
    pairs = [
        (x.T, y.T),  # non-contiguous
        (x[:, 3], y[:, 3]),  # strided
        (x[0, 0], y[0, 0]),  # 0-dim
        (x * 2, y * 2),  # tracked by autograd
    ]
    _assert_batched_matches_reference(pairs)


def test_non_finite_rows_inside_a_large_pair_are_masked_per_element() -> None:
    # Only some rows of a multi-row pair hold NaN/Inf: those are reduced with masks, the others
    # without, and the pair's statistics must still be exact.
    a = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    b = a + 1e-2
    a[[17, 1500, 4999]] = torch.tensor([float("nan"), INF, -INF])
    b[[18, 2600]] = torch.tensor([-INF, float("nan")])
    _assert_batched_matches_reference([(a, b), (a.to(BF16), b), (a[:100], b[:100])])


def test_padding_does_not_move_side_extremes_or_degeneracy() -> None:
    # Constant non-zero pairs whose sizes leave padding zeros in their last row: zeros there
    # must neither break the constant (degenerate) nor lower a negative maximum.
    pairs = [(torch.full((n,), -3.0), torch.full((n,), 5.0, dtype=BF16)) for n in (2, 65, 129, 300)]
    pairs.append((torch.full((70,), 0.125), torch.full((70,), 0.125)))
    stats, _ = segment_stats(pairs)
    fields = {name: stats[:, i].tolist() for i, name in enumerate(STAT_FIELDS)}
    assert fields["degenerate_a"] == fields["degenerate_b"] == [1.0] * 5
    assert fields["max_abs_a"] == [3.0, 3.0, 3.0, 3.0, 0.125]
    assert fields["mean_a"] == [-3.0, -3.0, -3.0, -3.0, 0.125]
    _assert_batched_matches_reference(pairs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_pairs_give_exact_zeros_in_a_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    pairs = []
    for n in (1, 64, 100, 1000):
        x = (torch.randn(n, generator=gen) * 1e3).to(dtype)
        x[::7] = float("nan")
        x[1::9] = -INF
        pairs.append((x, x.clone()))
    stats, hists = segment_stats(pairs)
    fields = {name: stats[:, i] for i, name in enumerate(STAT_FIELDS)}
    for name in ("sum_abs_diff", "max_abs_diff", "max_ulp", "sum_sq_diff", "max_abs_diff_rounded"):
        assert fields[name].tolist() == [0.0] * 4, name
    # NaN equals NaN for the bit-exact count; only the finite elements reach the histogram.
    assert fields["bitexact"].tolist() == fields["numel"].tolist()
    assert hists[:, 0].tolist() == fields["finite"].tolist()
    assert hists[:, 1:].sum().item() == 0
    assert fields["norm2_a"].tolist() == fields["norm2_b"].tolist()


def test_batched_stats_keep_pair_order_across_groups_and_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tiny chunks: every group is laid out in several passes, in the order of dtype pairs.
    monkeypatch.setattr(metrics, "_CHUNK_NUMEL", 300)
    gen = torch.Generator().manual_seed(5)
    pairs = [_random_pair(gen, n) for n in (200, 0, 129, 1, 500, 64, 3, 257, 0, 90)]
    _assert_batched_matches_reference(pairs)
    alone = [segment_stats([pair]) for pair in pairs]
    stats, hists = segment_stats(pairs)
    assert torch.equal(hists, torch.cat([h for _, h in alone]))
    exact = [i for i, name in enumerate(STAT_FIELDS) if name not in SUMMED]
    assert torch.equal(stats[:, exact], torch.cat([s for s, _ in alone])[:, exact])


def test_a_pair_larger_than_a_chunk_is_reduced_in_pieces_and_combined() -> None:
    # Bounded memory: the pair is cut into chunk-sized flat pieces whose sums, counts and
    # extremes recombine into exactly the whole pair's statistics.
    n = 2 * metrics._CHUNK_NUMEL + 5
    a = torch.randn(n, generator=torch.Generator().manual_seed(9))
    b = a.to(BF16)
    a[-3] = float("nan")
    b[n // 2] = INF
    constant = torch.full((n,), -0.75)
    _assert_batched_matches_reference([(a, b), (constant, constant.to(BF16))])


def test_batched_stats_without_host_reads_or_kept_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The path devices other than the CPU take: every row masked (no data-dependent branch),
    # and fresh buffers (here filled with garbage) instead of the CPU's kept scratch ones.
    def fresh(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.full(shape, 12345, dtype=dtype, device=device)

    monkeypatch.setattr(metrics, "_host_reads_are_cheap", lambda device: False)
    monkeypatch.setattr(metrics, "_scratch", fresh)
    gen = torch.Generator().manual_seed(31)
    for n_pairs in (1, 9, 30):
        sizes = torch.tensor(SIZES)[torch.randint(len(SIZES), (n_pairs,), generator=gen)]
        _assert_batched_matches_reference([_random_pair(gen, int(n)) for n in sizes])


@pytest.mark.gpu
def test_batched_stats_on_cuda_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(21)
    for n_pairs in (2, 9, 30):
        sizes = torch.tensor(SIZES)[torch.randint(len(SIZES), (n_pairs,), generator=gen)]
        pairs = [_random_pair(gen, int(n)) for n in sizes]
        _assert_batched_matches_reference([(a.cuda(), b.cuda()) for a, b in pairs])


def test_unknown_metrics_kernel_names_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_METRICS_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"'fast' is not a metrics kernel\. Known: fused"):
        metrics._single_stats(torch.device("cuda"))


def test_built_rows_equal_constructed_ones_and_refuse_a_missing_field() -> None:
    import dataclasses

    from lab.pairing.metrics import PairMetrics, built, decode_stats
    from lab.pairing.result import LayerDivergence

    stats = [float(i + 1) for i in range(len(metrics.STAT_FIELDS))]
    hist = [1.0] * len(metrics.ULP_BIN_EDGES)
    fast = decode_stats(stats, hist, torch.bfloat16, torch.float32)
    slow = PairMetrics(**dataclasses.asdict(fast))
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.numel = 0  # type: ignore[misc]
    row = dict(order=0, module="m", call=0, output="", module_class="Linear", dtype_a="bf16",
               dtype_b="fp32", shape=(2, 3), metrics=fast, module_a=None)  # fmt: skip
    assert built(LayerDivergence, row) == LayerDivergence(**row)
    with pytest.raises(TypeError, match=r"missing \['metrics'\], unknown \['metric'\]"):
        built(LayerDivergence, {**{k: v for k, v in row.items() if k != "metrics"}, "metric": 1})

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

from lab.metrics import (
    STAT_FIELDS,
    ULP_BIN_EDGES,
    ULP_BIN_LABELS,
    coarser_dtype,
    compare,
    decode_stats,
    pair_stats,
    ulp_distance,
)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
INF = float("inf")


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

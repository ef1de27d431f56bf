"""`decode_many` (every row of a Result decoded at once) against `decode_stats`, bit for bit."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from lab.pairing.metrics import STAT_FIELDS, ULP_BIN_EDGES, decode_many, decode_stats

SPECIAL = (0.0, -0.0, 1.0, 1e-30, -1e-30, 5e-324, 1e308, math.inf, -math.inf, math.nan)


def _bits(value: object) -> object:
    """A value as it compares bit for bit: floats by their IEEE bytes (NaN == NaN, 0 != -0)."""
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, tuple):
        return tuple(_bits(v) for v in value)
    return (type(value).__name__, value)


def _rows(count: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        row = []
        for field in STAT_FIELDS:
            pick = rng.random()
            if field in ("numel", "finite", "bitexact", "nonfinite_a", "nonfinite_b"):
                value = float(rng.choice((0, 1, 2, 7, 4096, 2**40)))
            elif field.startswith("degenerate"):
                value = rng.choice((0.0, 1.0, math.nan))
            elif pick < 0.3:
                value = rng.choice(SPECIAL)
            else:
                value = rng.uniform(-3, 3) * 10.0 ** rng.randint(-20, 20)
            if field.startswith(("max_abs", "norm2", "sum_")):
                value = abs(value)  # magnitudes (decode_stats divides by max_abs_a + 1e-30)
            row.append(value)
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_decode_many_equals_decode_stats_bit_for_bit(seed: int) -> None:
    stats = _rows(500, seed)
    rng = random.Random(seed + 100)
    hists = [[float(rng.randint(0, 2**30)) for _ in ULP_BIN_EDGES] for _ in stats]
    dtypes = [rng.choice(((torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                          (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)))
              for _ in stats]  # fmt: skip
    many = decode_many(stats, hists, [a != b for a, b in dtypes])
    assert len(many) == len(stats)
    fields = list(type(many[0]).__dataclass_fields__)
    for row, hist, (a, b), got in zip(stats, hists, dtypes, many, strict=True):
        want = decode_stats(row, hist, a, b)
        for field in fields:
            assert _bits(getattr(got, field)) == _bits(getattr(want, field)), (field, row)
        assert type(got.numel) is int and type(got.rounding_only) is bool
        assert type(got.degenerate) is bool and type(got.ulp_hist[0]) is int
        if not any(isinstance(v, float) and math.isnan(v) for v in vars(want).values()):
            assert got == want
    # The edge cases the rows draw from are present: NaN and zero cosines, empty tensors.
    cos = [m.cosine_dist for m in many]
    assert any(math.isnan(c) for c in cos) and any(c == 0.0 for c in cos)
    assert any(m.numel == 0 and m.bitexact_frac == 1.0 for m in many)


def test_decode_many_of_real_pairs_and_of_nothing() -> None:
    from lab.pairing.metrics import pair_stats

    torch.manual_seed(0)
    pairs = []
    for n in (1, 5, 4096):
        a = torch.randn(n)
        pairs.append((a, a.to(torch.bfloat16)))
        pairs.append((a, a.clone()))
        pairs.append((torch.zeros(n), torch.zeros(n)))
    stats, hists = zip(*(pair_stats(a, b) for a, b in pairs), strict=True)
    many = decode_many([s.tolist() for s in stats], [h.tolist() for h in hists],
                       [a.dtype != b.dtype for a, b in pairs])  # fmt: skip
    for (a, b), s, h, got in zip(pairs, stats, hists, many, strict=True):
        assert got == decode_stats(s, h, a.dtype, b.dtype)
    assert many[1].bitexact_frac == 1.0 and many[-1].degenerate and not many[-2].degenerate
    assert many[-3].rounding_only or many[-3].max_abs_diff == 0
    assert decode_many([], [], []) == []


def test_a_pair_whose_reduction_never_ran_is_skipped_not_made_up() -> None:
    # A run that fails between `compare` and the pair's metrics (out of memory in the reduction)
    # leaves that pair without numbers: the partial Result reports it as skipped.
    from lab.pairing.collect import Collector

    collector = Collector({"lin": "Linear"})
    a, b = torch.ones(4), torch.full((4,), 2.0)
    collector.compare(0, ("lin", 0, ""), a, b)
    collector.flush()
    collector.compare(1, ("lin", 1, ""), a.clone(), b.clone())
    collector.pending[-1].stats = None  # as a reduction that raised leaves it
    collector._batch.clear()
    rows = collector.rows()
    assert [(r.module, r.call) for r in rows] == [("lin", 0)]
    assert rows[0].metrics.max_abs_diff == 1.0
    [skip] = collector.skipped
    assert (skip.module, skip.call) == ("lin", 1)
    assert skip.reason.startswith("not reduced: the run failed")

"""bench/ab_as_stored.py: the pair as it is against the batches copying every strided pair."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch


def test_copied_first_restores_the_old_rule_and_gives_the_new_one_back(
    load_bench: Callable[[str], ModuleType],
) -> None:
    from lab.pairing import _fused_stats, pair_core

    bench = load_bench("ab_as_stored")
    x = torch.randn(2, 3, 4)
    pair = (x.transpose(1, 2), (x * 2).transpose(1, 2))
    assert _fused_stats._as_stored(*pair)
    with bench.copied_first():
        assert not _fused_stats._as_stored(*pair)
        assert _fused_stats._as_stored(x, x * 2)
        core = _fused_stats._core()
        if pair_core.extension() is not None:
            groups, strided = core.scan([pair, (x, x * 2)])
            assert strided == [0] and list(groups.values()) == [[0, 1]]
            assert core.table is pair_core.extension().table  # the rest is the extension's
    assert _fused_stats._as_stored(*pair)
    if pair_core.extension() is not None:
        assert _fused_stats._core().scan([pair])[1] == []


def test_measure_times_both_ways_and_compares_their_rows(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("ab_as_stored")
    row = bench.measure("sd3", "cpu", rounds=2)
    assert row["preset"] == "tiny (full layer counts)" and row["pairs"] > 1000
    for key in ("plain", "stored", "copied"):
        assert row[f"{key}_s"] > 0 and len(row[f"{key}_times_s"]) == 2
    assert row["plain_vs_plain"] == 1.0
    # CPU metrics take no CUDA batch: the same rows both ways, to the bit.
    assert row["rows_same_but_sums"] is True and row["sums_rel_max"] == 0.0
    assert "stored_peak_vs_plain" not in row


def test_compare_rows_tells_sums_from_other_metrics(
    load_bench: Callable[[str], ModuleType],
) -> None:
    import dataclasses
    from types import SimpleNamespace

    import lab

    bench = load_bench("ab_as_stored")
    fam = lab.family("sd3")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    result = lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam))
    assert bench.compare_rows(result, result) == {
        "rows_same_but_sums": True, "sums_rel_max": 0.0, "pairs": len(result.rows),
    }  # fmt: skip
    k = next(i for i, r in enumerate(result.rows) if r.metrics.mean_a != 0)

    def with_metrics(**change: float) -> SimpleNamespace:
        row = result.rows[k]
        rows = list(result.rows)
        rows[k] = dataclasses.replace(row, metrics=dataclasses.replace(row.metrics, **change))
        return SimpleNamespace(rows=rows)

    got = bench.compare_rows(result, with_metrics(mean_a=result.rows[k].metrics.mean_a * 1.5))
    assert got["rows_same_but_sums"] is True and got["sums_rel_max"] == pytest.approx(1 / 3)
    got = bench.compare_rows(result, with_metrics(max_ulp=result.rows[k].metrics.max_ulp + 1))
    assert got["rows_same_but_sums"] is False
    assert bench.compare_rows(result, SimpleNamespace(rows=result.rows[1:]))[
        "rows_same_but_sums"] is False  # fmt: skip

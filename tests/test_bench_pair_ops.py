"""bench/pair_ops.py: the torch ops each pair case runs, on every thread, against plain's."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


def test_diff_orders_by_extra_cpu_time_and_counts_calls_a_pair(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("pair_ops")
    case = {
        "aten::cat": {"calls": 30.0, "cpu_us": 900.0, "device_us": 50.0, "kernel": 0.0},
        "aten::mm": {"calls": 10.0, "cpu_us": 100.0, "device_us": 0.0, "kernel": 0.0},
    }
    base = {
        "aten::mm": {"calls": 10.0, "cpu_us": 400.0, "device_us": 0.0, "kernel": 0.0},
        "aten::add": {"calls": 4.0, "cpu_us": 20.0, "device_us": 0.0, "kernel": 0.0},
    }
    rows = bench._diff(case, base, pairs=10)
    assert [r["op"] for r in rows] == ["aten::cat", "aten::mm", "aten::add"]
    cat, mm, add = rows
    assert cat["extra_cpu_ms"] == pytest.approx(0.9) and cat["extra_calls"] == 30
    assert cat["extra_calls_per_pair"] == pytest.approx(3.0)
    assert cat["extra_device_ms"] == pytest.approx(0.05)
    assert mm["extra_cpu_ms"] == pytest.approx(-0.3) and mm["extra_calls"] == 0
    assert add["extra_calls"] == -4 and add["extra_calls_per_pair"] == pytest.approx(-0.4)
    assert bench._diff(case, base, pairs=0)[0]["extra_calls_per_pair"] is None
    assert len(bench._diff(case, base, pairs=10, top=1)) == 1


def test_measure_profiles_the_side_threads_of_every_case(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("pair_ops")
    row = bench.measure("sd3", "tiny", "cpu", rounds=1)
    pairs = row["pairs"]
    assert pairs["plain"] == 0 and pairs["nothing"] == 0
    assert 0 < pairs["blocks"] < pairs["every"]
    for key in bench.CASES:
        assert row[f"{key}_s"] > 0 and row[f"{key}_ops_calls"] > 0
        assert row[f"{key}_device_ms"] == 0  # no kernels on the CPU
    assert row["plain_vs_plain"] == 1.0 and row["plain_vs_plain_rounds"] == 1.0
    # The pairs' forwards run in side threads: their ops are counted too, so a pair that
    # captures nothing asks torch for about as many ops as the two plain forwards (a profile
    # of the calling thread alone sees a few hundred).
    assert row["nothing_ops_calls"] > 0.5 * row["plain_ops_calls"]
    # Every module adds ops over the block outputs only (its pairs' bookkeeping), never fewer.
    assert row["every_ops_calls"] > row["blocks_ops_calls"]
    assert "every_nolaunch_s" not in row  # --ablate is CUDA only
    for key in ("nothing_over_plain", "blocks_over_plain", "every_over_plain"):
        assert row[key] and all(set(r) >= {"op", "extra_cpu_ms", "extra_calls"} for r in row[key])
    text = bench._text(row)
    assert text.startswith("===== sd3 tiny cpu") and "--- every_over_blocks" in text

"""bench/batch_host.py: a metric batch's host parts; the C++ and Python tables and copies agree."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch


def test_batch_parts_are_timed_and_both_paths_agree(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("batch_host")
    row = bench.measure(torch.device("cpu"), pairs=12, scale=0.01, repeat=3)
    assert row["table_equal"] is True and row["copies_equal"] is True
    # An H200's cap on CPU: the table's owners hold one int32 a program, many a big pair.
    assert row["programs_cap"] == 132 * 8
    assert row["programs"] > row["pairs"]
    for key in ("scan_us", "table_cxx_us", "table_python_us", "copies_cxx_us", "copies_python_us"):
        assert row[key] > 0
    assert "launch_us" not in row  # CUDA only


def test_batch_sizes_cycle_and_scale(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("batch_host")
    pairs = bench.batch(torch.device("cpu"), 6, 0.001)
    assert [a.numel() for a, _ in pairs] == [
        max(1, int(n * 0.001)) for n in (*bench.SIZES, *bench.SIZES[:2])
    ]
    assert all(a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() for a, b in pairs)
    views = bench.strided(torch.device("cpu"), 0.01)
    assert all(not (a.is_contiguous() and b.is_contiguous()) for a, b in views)


def test_batch_host_refuses_without_the_extension(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("batch_host")
    monkeypatch.setenv("LAB_PAIR_CORE", "python")
    with pytest.raises(RuntimeError, match="LAB_PAIR_CORE=python"):
        bench.measure(torch.device("cpu"), pairs=2, scale=0.001, repeat=1)

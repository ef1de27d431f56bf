"""bench/full_size.py: how many runs a family's cases get (it needs CUDA to run)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def test_one_run_only_where_both_warm_forwards_take_seconds(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_size")  # it imports its sibling bench/full_pair.py
    assert bench.runs_for([3.35, 3.36], 3) == 1  # wan2_2 full: steady, one run a case
    # sd3 first in a process: its first side's warm-up paid CUDA's set-up. Before, that one
    # slow warm-up left every case of the family (and of side b) at one run.
    assert bench.runs_for([4.2, 0.12], 3) == 3
    assert bench.runs_for([0.11, 0.12], 5) == 5

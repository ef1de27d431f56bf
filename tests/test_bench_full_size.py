"""bench/full_size.py: how many runs a family's cases get, in rounds, and their ratios (its
main needs CUDA; these parts run anywhere)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


def test_one_run_only_where_both_warm_forwards_take_seconds(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_size")  # it imports its sibling bench/full_pair.py
    assert bench.runs_for([3.35, 3.36], 3) == 1  # wan2_2 full: steady, one run a case
    # sd3 first in a process: its first side's warm-up paid CUDA's set-up. Before, that one
    # slow warm-up left every case of the family (and of side b) at one run.
    assert bench.runs_for([4.2, 0.12], 3) == 3
    assert bench.runs_for([0.11, 0.12], 5) == 5


def test_cases_run_in_rounds_and_keep_only_their_last_value(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_size")
    order: list[str] = []
    held: list[int] = []

    def case(key: str) -> Callable[[], object]:
        def run() -> object:
            order.append(key)
            held.append(len(order))
            return (key, len(order))

        return run

    times, peaks, last = bench.in_rounds({k: case(k) for k in ("p", "q", "r")}, 4)
    # Rotated a step a round: each case follows each of the others.
    assert order == ["p", "q", "r", "q", "r", "p", "r", "p", "q", "p", "q", "r"]
    assert {k: len(v) for k, v in times.items()} == {"p": 4, "q": 4, "r": 4}
    assert all(s >= 0.0 for v in times.values() for s in v)
    assert last == {"p": ("p", 10), "q": ("q", 11), "r": ("r", 12)}
    assert set(peaks) == {"p", "q", "r"}
    order.clear()
    bench.in_rounds({k: case(k) for k in ("p", "q", "r")}, 2, rotate=False)
    assert order == ["p", "q", "r"] * 2


def test_ratios_of_medians_minima_and_rounds(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("full_size")
    times = {
        "plain_a": [0.10, 0.20, 0.10],
        "plain_b": [0.10, 0.20, 0.12],
        # A noisy round (the second) slows every case alike: the round's own ratio stays put.
        "every_module": [0.26, 0.52, 0.33],
    }
    got = bench.ratios(times, "every_module")
    assert got["every_module_vs_plain"] == pytest.approx(0.33 / (0.10 + 0.12))
    assert got["every_module_vs_plain_min"] == pytest.approx(0.26 / 0.20)
    assert got["every_module_vs_plain_rounds"] == pytest.approx(1.3)  # 1.3, 1.3, 1.5

"""bench/arguments.py: every case runs checked and unchecked, and both give the same result."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType


def test_each_case_runs_both_ways_with_the_same_result(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("arguments")
    cases = bench.cases()
    assert set(cases) == {"family", "config", "expert", "mean_velocity", "side", "pair"}
    for name, (checked, unchecked, _) in cases.items():
        if name != "pair":  # a Result holds its own timing; the rows are compared below
            assert checked() == unchecked(), name
    a, b = cases["pair"][0](), cases["pair"][1]()
    assert [r.row() for r in a.rows] == [r.row() for r in b.rows] and a.rows
    rows = bench.measure(repeat=1, number=2)
    assert [r["case"] for r in rows] == list(cases)
    assert all(math.isfinite(r["checked_us"]) and r["unchecked_us"] > 0 for r in rows)

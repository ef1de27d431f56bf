"""bench/cpu_threads.py: its cases run, hand their figures back and leave the thread count."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from types import ModuleType

import torch


def test_fresh_thread_runs_elsewhere_and_hands_back(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("cpu_threads")
    caller = threading.get_ident()
    assert bench.in_fresh_thread(lambda: float(threading.get_ident())) != caller
    calls: list[int] = []
    seconds = bench.best_of(lambda: calls.append(1), repeat=2, inner=3)
    assert len(calls) == (2 + 1) * 3  # a warm-up round, then `repeat` rounds of `inner` calls
    assert 0 < seconds < 1.0


def test_measure_gives_every_case_and_restores_threads(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("cpu_threads")
    threads = torch.get_num_threads()
    got = bench.measure(["sd3"], repeat=1)
    assert torch.get_num_threads() == threads == got["threads"]
    assert set(got["op"]) == {"caller_us", "fresh_thread_us", "caller_after_us"}
    assert list(got["pairs"]) == list(dict.fromkeys((str(threads), "1")))
    for rows in got["pairs"].values():
        row = rows["sd3"]
        assert set(row) == {
            "plain_ms", "two_pass_ms", "lockstep_ms", "two_pass_vs_plain", "lockstep_vs_plain"
        }  # fmt: skip
        assert all(math.isfinite(v) and v > 0 for v in row.values()), row
        assert row["lockstep_vs_plain"] == row["lockstep_ms"] / row["plain_ms"]
    assert all(math.isfinite(v) and v > 0 for v in got["op"].values())

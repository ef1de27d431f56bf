"""bench/pair_pin.py: its cases run the pairs under each LAB_PAIR_PIN value (CPU, deep tiny)."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import pytest

from lab.pairing import lockstep


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or lockstep.current_cpu() is None,
    reason="Linux thread affinity",
)
def test_pin_bench_times_each_case_and_pins_only_the_core_cases(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("pair_pin")
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))  # as its --device cpu
    monkeypatch.delenv("LAB_PAIR_PIN", raising=False)
    seen = []
    pin = lockstep._WORKERS.pin
    monkeypatch.setattr(lockstep._WORKERS, "pin", lambda cpu: seen.append(cpu) or pin(cpu))
    row = bench.measure("wan2_2", "cpu", repeat=2)
    cases = ["plain", "nothing_core", "nothing_off", "every_core", "every_off"]
    assert [k[: -len("_s")] for k in row if k.endswith("_s") and "min" not in k] == cases
    assert all(row[f"{c}_s"] >= row[f"{c}_min_s"] > 0 for c in cases)
    assert row["plain_vs_plain"] == 1.0
    # Three runs of each paired case (warm-up, two rounds), the second round "off" first.
    assert [cpu is None for cpu in seen] == [False, True] * 4 + [True, False] * 2
    assert row["pinned_cpu"] in os.sched_getaffinity(0)
    assert "LAB_PAIR_PIN" not in os.environ

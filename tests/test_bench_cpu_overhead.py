"""bench/cpu_overhead.py: its stages run, and its metrics stage covers the pair's own outputs."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from types import ModuleType

import pytest

import lab


def test_stages_pair_the_outputs_the_pair_does(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("cpu_overhead")
    monkeypatch.delenv("LAB_CPU_STATS", raising=False)
    row = bench.measure("sd3", repeat=1)
    fam = lab.family("sd3")
    result = lab.pair(
        fam.build("tiny", 0), fam.make_inputs("tiny", 0), lab.Side.rollout(fam),
        lab.Side.trainer(fam),
    )  # fmt: skip
    # The metrics stage reduces every output pair the pair itself reports.
    assert row["pairs"] == len(result.rows) > 100
    stages = ("plain", "setup", "hooks", "held", "metrics", "pair", "pair_lockstep",
              "metrics_torch", "pair_torch")  # fmt: skip
    assert all(math.isfinite(row[f"{s}_ms"]) and row[f"{s}_ms"] > 0 for s in stages), row
    assert "copies_ms" not in row  # the pair holds its outputs, it no longer copies them
    assert "LAB_CPU_STATS" not in os.environ  # the torch stages put the variable back

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
    # The pair's two forwards run at least as long as the plain ones would have, less than the
    # whole pair; what is outside them is the rest of that one round.
    inside, outside = row["pair_forwards_vs_plain_rounds"], row["pair_outside_vs_plain_rounds"]
    assert 0.5 < inside < row["pair_vs_plain_rounds"] and outside > 0
    assert inside + outside == pytest.approx(row["pair_vs_plain_rounds"], rel=1e-9)
    # One round: its own ratio is the minima's.
    for stage in ("pair", "pair_lockstep", "pair_torch"):
        ratio = row[f"{stage}_ms"] / row["plain_ms"]
        assert row[f"{stage}_vs_plain_rounds"] == pytest.approx(ratio, rel=1e-9)
        assert row[f"{stage}_vs_plain"] == pytest.approx(ratio, rel=1e-9)


def test_the_rounds_ratio_takes_each_round_against_its_own_plain(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("cpu_overhead")
    # The machine slowed down by 2x after the first round's plain forwards: the minima's ratio
    # reads 2.4x, each round's own reads 1.2x twice.
    plain, case = [1.0, 2.0, 2.0], [2.4, 2.4, 2.4]
    assert min(case) / min(plain) == pytest.approx(2.4)
    assert bench.per_round_ratio(case, plain) == pytest.approx(1.2)
    with pytest.raises(ValueError):
        bench.per_round_ratio([1.0], [1.0, 2.0])

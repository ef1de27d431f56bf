"""bench/ab_switch.py: each value of a switch paired side by side, its Results compared (CPU)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from types import ModuleType

import pytest

from lab.pairing import lockstep


def test_each_value_runs_under_its_setting_and_finds_the_same_rows(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("ab_switch")
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))  # as its --device cpu
    monkeypatch.delenv("LAB_LOCKSTEP_HANDOVER", raising=False)
    seen: list[str | None] = []
    run_once = lockstep._run_once

    def spy(run, block_ids, stream, segments):
        seen.append(os.environ.get("LAB_LOCKSTEP_HANDOVER"))
        return run_once(run, block_ids, stream, segments)

    monkeypatch.setattr(lockstep, "_run_once", spy)
    switch, values = bench.parse_switch("LAB_LOCKSTEP_HANDOVER=block,module")
    row = bench.measure("wan2_2", "cpu", switch, values, rounds=2, blocks=True)
    cases = ["plain", "pair_block", "pair_module", "blocks_block", "blocks_module"]
    assert [k[: -len("_s")] for k in row if k.endswith("_s") and "min" not in k] == cases
    for case in cases:
        assert row[f"{case}_s"] >= row[f"{case}_min_s"] > 0
        assert row[f"{case}_vs_plain_rounds"] > 0
    assert row["plain_vs_plain"] == row["plain_vs_plain_rounds"] == 1.0
    # Every paired case ran under its own value: the warm-up run and one a round.
    assert seen.count("block") == seen.count("module") == 2 * 3
    assert row["pairs"] > 100 and row["rows_equal"] is True
    # The first value against the other, round by round: two rounds give no interval.
    rounds = row["round_seconds"]
    assert sorted(rounds) == sorted(cases) and all(len(v) == 2 for v in rounds.values())
    for what in ("pair", "blocks"):
        first, other = rounds[f"{what}_block"], rounds[f"{what}_module"]
        assert row[f"{what}_block_vs_{what}_module"] == pytest.approx(
            statistics.median(first) / statistics.median(other)
        )
        assert row[f"{what}_block_vs_{what}_module_ci"] is None
        faster = sum(a < b for a, b in zip(first, other, strict=True))
        assert row[f"{what}_block_faster_than_{what}_module_rounds"] == faster
    assert "LAB_LOCKSTEP_HANDOVER" not in os.environ


@pytest.mark.parametrize("text", ["LAB_METRICS_STREAM", "LAB_METRICS_STREAM=1", "PATH=a,b", "=1,0"])
def test_a_switch_needs_a_lab_name_and_two_values(
    load_bench: Callable[[str], ModuleType], text: str
) -> None:
    bench = load_bench("ab_switch")
    with pytest.raises(ValueError, match="two or more values"):
        bench.parse_switch(text)

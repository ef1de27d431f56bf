"""bench/ab_report_forwards.py: both ways of reporting give the same rows; the old way hooks."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import lab
from lab.pairing import lockstep


def test_forwards_and_hooks_cases_give_the_same_rows_and_time_each(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("ab_report_forwards")
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))  # as its --device cpu
    row = bench.measure("cosmos3", "cpu", repeat=2)
    assert row["rows_equal"] is True
    assert row["pairs"] > 100
    for case in ("plain", "every_forwards", "every_hooks"):
        assert row[f"{case}_s"] >= row[f"{case}_min_s"] > 0
    assert row["plain_vs_plain"] == 1.0


def test_the_hooks_case_hooks_the_captured_modules_and_removes_them(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("ab_report_forwards")
    fam = lab.family("flux")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    hooked_during: list[int] = []
    on_output = lockstep._Lockstep._on_output

    def spy(self: Any, key: str, label: str, args: tuple, kwargs: dict, output: Any) -> None:
        if not hooked_during:
            hooked_during.append(sum(bool(m._forward_hooks) for m in model.modules()))
        on_output(self, key, label, args, kwargs, output)

    def run() -> lab.Result:
        return lab.pair(model, inputs, a, b, stream=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lockstep._Lockstep, "_on_output", spy)
        forwards = run()
        assert hooked_during.pop() < 30  # the blocks' hooks only
        hooked = bench.with_hooks(run)()
        assert hooked_during.pop() > 100  # every captured module
    assert [r.metrics for r in hooked.rows] == [r.metrics for r in forwards.rows]
    assert not any(m._forward_hooks or "forward" in m.__dict__ for m in model.modules())
    assert lockstep._reporting_forwards is not bench.hooked

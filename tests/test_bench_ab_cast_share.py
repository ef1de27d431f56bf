"""bench/ab_cast_share.py: its variants are the pairing code before stop 16, and it restores it."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import lab
from lab.pairing import lockstep, weights


def test_variants_cast_as_before_and_restore(
    load_bench: Callable[[str], ModuleType], monkeypatch
) -> None:
    bench = load_bench("ab_cast_share")
    fam = lab.family("flux")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    side = lab.Side.rollout(fam)
    seen: list[weights.PairedWeights] = []

    class Recorded(weights.PairedWeights):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(lockstep, "PairedWeights", Recorded)
    view = weights.WeightView(model, side, stream_classes=fam.block_classes)
    blocks = len(view.streamed_ids)
    casts, handovers, results = {}, {}, {}
    for case in ("root", "root_no_lead", "every", "every_no_share"):
        filt = (lambda name: name == "<root>") if case.startswith("root") else None
        latencies: list[float] = []
        with bench.variant(case), bench.wake_times(latencies):
            results[case] = lab.pair(model, inputs, side, side, lockstep=True, stream=True,
                                     names_filter=filt, check_outputs=False)  # fmt: skip
        casts[case], handovers[case] = seen[-1].casts, len(latencies)
    # Shared: each block cast once for both sides; before stop 16 once a side.
    shared_blocks = casts["every_no_share"] - casts["every"]
    assert shared_blocks > 0
    assert casts["root_no_lead"] - casts["root"] == shared_blocks - _last_block_casts(view)
    # The model output alone: a hand-over a block with `lead`, one at the start and end without.
    assert handovers["root_no_lead"] <= 3 < blocks <= handovers["root"]
    assert [r.metrics for r in results["every"].rows] == [
        r.metrics for r in results["every_no_share"].rows
    ]
    assert weights.PairedWeights.exit_block is bench._EXIT
    assert lockstep._Lockstep.boundary is bench._BOUNDARY


def _last_block_casts(view: weights.WeightView) -> int:
    """Casts of the last streamed block: kept for side B even without the lead hand-over."""
    last = [m for m in view.model.modules() if id(m) in view.streamed_ids][-1]
    keys = {view.cast_key(e.master, e.dtype) for e in view.entries(last, set())}
    return sum(len(k) > 1 for k in keys)


def test_wake_times_counts_each_hand_over(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("ab_cast_share")
    give, wait = lockstep._Baton.give, lockstep._Baton.wait
    baton = lockstep._Baton("a")
    latencies: list[float] = []
    with bench.wake_times(latencies):
        baton.give("b")
        baton.wait("b")
        baton.give("a")
        baton.wait("a")
    assert len(latencies) == 2 and all(t >= 0 for t in latencies)
    assert (lockstep._Baton.give, lockstep._Baton.wait) == (give, wait)


def test_measure_times_every_case_on_cpu(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("ab_cast_share")
    row = bench.measure("flux", "cpu", rounds=2)
    cases = ("plain", "root", "root_no_lead", "every", "every_no_share", *bench.BUDGETS)
    assert row["preset"] == "tiny" and all(c in row for c in cases)
    for case in cases:
        assert 0 < row[case]["min_s"] <= row[case]["median_s"]
        assert row[case]["peak_gib"] is None  # CPU: no device peak
    blocks = len(weights.WeightView(
        lab.family("flux").build("tiny", 0), lab.Side.rollout(lab.family("flux")),
        stream_classes=lab.family("flux").block_classes,
    ).streamed_ids)  # fmt: skip
    # The model output alone hands over at each block the other side has yet to run.
    assert row["root"]["handovers"] >= blocks
    assert row["every"]["handovers"] >= row["every_park_8g"]["handovers"] > 0
    assert weights.PairedWeights.exit_block is bench._EXIT

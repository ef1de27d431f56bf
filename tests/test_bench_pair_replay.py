"""bench/pair_replay.py: the recorded calls, replayed without the forwards, give the pair's rows."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from lab.pairing import collect, dtype_flow, lockstep


def test_replay_gives_the_pairs_rows_and_each_case_takes_its_part_out(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("pair_replay")
    originals = (lockstep._Lockstep._on_output, collect.Collector.compare,
                 dtype_flow.FlowRecorder.record, collect.Aliases.name)  # fmt: skip
    row = bench.measure("sd3", "cpu", rounds=2, tiny=True)
    assert row["preset"] == "tiny" and row["pairs"] > 100
    # Both sides' captured calls, each once: more calls than pairs, fewer than two a pair
    # (a module output both sides hand on unchanged is one pair of names, compared once).
    assert row["pairs"] < row["calls"] <= 2 * row["pairs"] + 10
    assert row["replay_matches"] is True
    for case in ("full", "noflow", "noaliases", "nocompare"):
        assert row[f"{case}_loop_ms"] > 0
        per_pair = row[f"{case}_loop_ms"] * 1e3 / row["pairs"]
        assert row[f"{case}_us_per_pair"] == pytest.approx(per_pair, rel=1e-12)
    assert "noreduce_loop_ms" not in row and row["timed_ms"] == {}  # CUDA only
    # Everything the cases swapped is back.
    assert originals == (lockstep._Lockstep._on_output, collect.Collector.compare,
                         dtype_flow.FlowRecorder.record, collect.Aliases.name)  # fmt: skip


def test_replay_cases_take_their_part_out(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("pair_replay")
    import lab

    fam = lab.family("flux")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    _, paired = bench.pair_host.side_runs(fam, model, inputs, "cpu")
    result, calls, run = bench.record(paired(None))
    cases = bench.variants("cpu", {})
    with bench.swapped(cases["nocompare"]):
        _, _, rows = bench.replay(run, calls, "cpu")
    assert rows == [] and run.collector.pending == []
    with bench.swapped(cases["noflow"]):
        bench.replay(run, calls, "cpu")
    assert run.flow.inputs == {"a": {}, "b": {}}
    _, _, rows = bench.replay(run, calls, "cpu")
    assert [r.metrics for r in rows] == [r.metrics for r in result.rows]
    assert run.flow.inputs["a"] and run.flow.inputs["b"]  # recorded again, both sides


def test_timed_case_times_the_cxx_copies_too(load_bench: Callable[[str], ModuleType]) -> None:
    # The C++ path copies a batch's strided pairs through the extension's own `read_in_place`,
    # not `_fused_stats._read_in_place`: the timed case wraps both, and puts both back.
    import torch

    from lab.pairing import pair_core

    bench = load_bench("pair_replay")
    extension = pair_core.extension()
    if extension is None:
        pytest.skip("the C++ extension did not build here")
    original = extension.read_in_place
    timings: dict = {}
    swaps = bench.variants("cuda", timings)["timed"]
    assert any(owner is extension and name == "read_in_place" for owner, name, _ in swaps)
    x = torch.randn(4, 8)
    with bench.swapped(swaps):
        extension.read_in_place([(x[:, :4], x[:, 4:])])
    assert extension.read_in_place is original
    assert timings["_pair_core.read_in_place"][0] == 1

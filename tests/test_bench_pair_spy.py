"""bench/pair_spy.py: py-spy's samples of each pair case, summed a run and set against plain's."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

SITE = "/v/lib/python3.11/site-packages"
RAW = "\n".join([
    "thread (101): MainThread;<module> (/w/bench/pair_spy.py:9);pair (/w/lab/pairing/run.py:40);"
    "flush (/w/lab/pairing/collect.py:7) 30",
    f"thread (102): lab-pair-a;_loop (/w/lab/pairing/lockstep.py:120);"
    f"forward ({SITE}/diffusers/models/attention.py:88) 50",
    f"thread (103): lab-pair-b;_loop (/w/lab/pairing/lockstep.py:120);"
    f"forward ({SITE}/diffusers/models/attention.py:90) 15",
    f"thread (103): lab-pair-b;_loop (/w/lab/pairing/lockstep.py:120);"
    f"_call_impl ({SITE}/torch/nn/modules/module.py:1784) 5",
    "",
])  # fmt: skip


def _installed_spy(bench: ModuleType) -> str:
    """py-spy's path, or skip: it is no dependency of the lab."""
    try:
        return bench.find_spy()
    except FileNotFoundError:
        pytest.skip("py-spy is not installed (it is no dependency of the lab: pip install py-spy)")


def test_summarize_adds_samples_up_a_run_by_thread_line_function_and_area(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("pair_spy")
    s = bench.summarize(RAW, rate=100.0, runs=2)  # one sample = 10 ms, over 2 runs = 5 ms a run
    assert s["samples"] == 100 and s["cpu_ms"] == pytest.approx(500.0) and s["torn_lines"] == 0
    # A frame read mid-change (a docstring's bytes, newlines and all) breaks its line into
    # pieces: each counted as torn, that stack's samples lost, every other line's kept.
    torn = RAW.replace("flush (/w/lab", "flush (~25 us for\nthis launch.)\n (/w/lab")
    t = bench.summarize(torn, rate=100.0, runs=2)
    assert t["torn_lines"] == 3 and t["samples"] == 100 - 30
    assert s["by_thread_ms"] == pytest.approx(
        {"lab-pair-a": 250.0, "lab-pair-b": 100.0, "MainThread": 150.0}
    )
    assert s["by_area_ms"] == pytest.approx(
        {"diffusers": 325.0, "lab/pairing": 150.0, "torch": 25.0}
    )
    # Leaf lines apart, leaf functions together (lines 88 and 90 of one forward).
    assert s["own_ms"]["forward (diffusers/models/attention.py:88)"] == pytest.approx(250.0)
    assert s["own_function_ms"]["forward (diffusers/models/attention.py)"] == pytest.approx(325.0)
    # Inclusive: a function counts once a stack, however deep.
    assert s["inclusive_ms"]["_loop (lab/pairing/lockstep.py)"] == pytest.approx(350.0)
    assert s["inclusive_ms"]["<module> (pair_spy.py)"] == pytest.approx(150.0)
    assert s["inclusive_ms"]["pair (lab/pairing/run.py)"] == pytest.approx(150.0)


def test_parts_split_waits_forwards_and_pairing_work(
    load_bench: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    bench = load_bench("pair_spy")
    side = ["Thread.run (threading.py:975)", "_Worker._loop (lab/pairing/lockstep.py:120)"]
    call = "Module._call_impl (torch/nn/modules/module.py:1790)"
    batches = ["Collector._flush_device (lab/pairing/collect.py:364)",
               "RunReducer.reduce_many (lab/pairing/_fused_stats.py:1042)"]  # fmt: skip
    casts = ["PairedWeights.enter_block (lab/pairing/weights.py:700)",
             "WeightView.cast (lab/pairing/weights.py:343)"]  # fmt: skip
    cases = {
        "wait": [*side, "_Baton.wait (lab/pairing/lockstep.py:66)",
                 "Condition.wait (threading.py:355)"],
        "side: metric batches": [*side, *batches],
        "side: module calls": [*side, call],
        "side: forward": [*side, call, "forward (diffusers/models/attention.py:88)"],
        "side: weight casts": [*side, *casts],
        "side: hand-over": [*side, "_Lockstep.boundary (lab/pairing/lockstep.py:500)"],
        "side: other pairing": [*side, "_Lockstep.thread (lab/pairing/lockstep.py:640)"],
    }  # fmt: skip
    for want, frames in cases.items():
        assert bench.part("lab-pair-a", frames) == want, want
    main = ["<module> (pair_spy.py:9)", "pair (lab/pairing/run.py:40)"]
    assert (
        bench.part(
            "MainThread",
            [
                *main,
                "pair.<locals>.partial (lab/pairing/run.py:9)",
                "Collector.rows (lab/pairing/collect.py:3)",
            ],
        )
        == "main: rows"
    )
    assert bench.part("MainThread", [*main, "_run_strategy (lab/pairing/run.py:5)",
                                     "Collector.flush (lab/pairing/collect.py:3)"]) == (
        "main: final flush")  # fmt: skip
    assert bench.part("MainThread", [*main, "_run_strategy (lab/pairing/run.py:5)"]) == (
        "main: lockstep set-up")  # fmt: skip
    assert bench.part("MainThread", [*main, "WeightView.both (lab/pairing/weights.py:1)"]) == (
        "main: set-up")  # fmt: skip
    assert bench.part("MainThread", ["forward_side (lab/pairing/run.py:1)"]) == "plain forward"
    assert bench.part("MainThread", ["holding (lab/pairing/guards.py:70)"]) == (
        "main: after the call")  # fmt: skip
    s = bench.summarize(RAW, rate=100.0, runs=2)
    # The RAW's caller flushes straight from `pair` (set-up's part); a bare `_call_impl` frame
    # (no `Module.`) is the forward's own.
    assert s["parts_ms"] == pytest.approx({"main: set-up": 150.0, "side: forward": 350.0})
    assert s["work_ms"] == pytest.approx(500.0)
    for case in bench.CASES:
        (tmp_path / f"sd3_{case}.txt").write_text(RAW)
    table = bench.from_raw(tmp_path, "sd3", runs=2, rate=100.0)
    assert "side: forward" in table and table.count("350.0") == 4
    with pytest.raises(FileNotFoundError, match="no samples of case 'plain' for 'flux'"):
        bench.from_raw(tmp_path, "flux", runs=2, rate=100.0)


def test_over_orders_functions_by_the_time_a_case_adds(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("pair_spy")
    case = {"inclusive_ms": {"f (a.py)": 9.0, "g (a.py)": 1.0}}
    base = {"inclusive_ms": {"g (a.py)": 4.0, "h (b.py)": 0.5}}
    rows = bench.over(case, base)
    assert [r["function"] for r in rows] == ["f (a.py)", "g (a.py)", "h (b.py)"]
    assert [r["extra_ms"] for r in rows] == pytest.approx([9.0, -3.0, -0.5])
    assert [r["ms"] for r in rows] == pytest.approx([9.0, 1.0, 0.0])
    assert len(bench.over(case, base, top=1)) == 1


def test_frames_and_paths_parse_to_their_package(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("pair_spy")
    assert bench.parse_frame("forward (/x/site-packages/torch/nn/linear.py:12)") == (
        "forward", "torch/nn/linear.py", 12,
    )  # fmt: skip
    assert bench.parse_frame("Lockstep.run (/home/u/repo/lab/pairing/lockstep.py:5)") == (
        "Lockstep.run", "lab/pairing/lockstep.py", 5,
    )  # fmt: skip
    assert bench.parse_frame("<native>") == ("<native>", "", None)
    assert bench._area("lab/precision/autocast.py") == "lab (other)"
    assert bench._area("threading.py") == "python"


def test_a_missing_spy_is_named_with_the_fix(
    load_bench: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    bench = load_bench("pair_spy")
    with pytest.raises(FileNotFoundError, match="is not an executable file"):
        bench.find_spy(str(tmp_path / "nope"))


def test_measure_samples_the_side_threads_of_every_case(
    load_bench: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    bench = load_bench("pair_spy")
    spy = _installed_spy(bench)
    affinity = os.sched_getaffinity(0)
    row = bench.measure("sd3", "tiny", "cpu", runs=3, rate=400.0, spy=spy, out=tmp_path)
    assert row["pairs"]["plain"] == 0 and 0 < row["pairs"]["blocks"] < row["pairs"]["every"]
    for key in bench.CASES:
        assert row[f"{key}_s"] > 0 and len(row[f"{key}_times_s"]) == 3
        assert row[key]["samples"] > 0 and (tmp_path / f"sd3_{key}.txt").stat().st_size > 0
    # Plain forwards run on the calling thread, a pair's on its two side threads.
    assert set(row["plain"]["by_thread_ms"]) == {"MainThread"}
    assert {"lab-pair-a", "lab-pair-b"} <= set(row["every"]["by_thread_ms"])
    assert row["every"]["inclusive_ms"]["pair (lab/pairing/run.py)"] > 0
    assert "pair (lab/pairing/run.py)" not in row["plain"]["inclusive_ms"]
    assert bench.text(row).startswith("===== sd3 tiny cpu, 3 runs a case")
    assert os.sched_getaffinity(0) == affinity  # each case's spy gave the cores back


def test_spy_keeps_off_the_pairs_core_and_gives_the_thread_back_its_cores(
    load_bench: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    bench = load_bench("pair_spy")
    spy = _installed_spy(bench)
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one core: nowhere else to put py-spy")
    running = bench.Spy(spy, tmp_path / "raw.txt", 100.0)
    try:
        mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(running.proc.pid)
    finally:
        running.stop()
    assert len(mine) == 1 and not (mine & theirs) and mine | theirs == before
    assert os.sched_getaffinity(0) == before

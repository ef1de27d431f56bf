"""bench/full_size.py: how many runs a family's cases get, in rounds, and their ratios (its
main needs CUDA; these parts, and `measure` at tiny on the CPU, run anywhere)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import lab


def test_one_run_only_where_both_warm_forwards_take_seconds(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_size")  # it imports its sibling bench/full_pair.py
    assert bench.runs_for([3.35, 3.36], 3) == 1  # wan2_2 full: steady, one run a case
    # sd3 first in a process: its first side's warm-up paid CUDA's set-up. Before, that one
    # slow warm-up left every case of the family (and of side b) at one run.
    assert bench.runs_for([4.2, 0.12], 3) == 3
    assert bench.runs_for([0.11, 0.12], 5) == 5


def test_short_forwards_get_as_many_rounds_as_fill_the_round_seconds(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_size")
    # sd3 full (warm plain 0.075 s a side, the first of a process slower): a round is about
    # 3.2 x 0.15 s, so 15 s hold 32 rounds, a whole number of the Latin square's 4-round cycles.
    assert bench.runs_for([4.2, 0.075], 7, round_seconds=15.0) == 32
    assert bench.runs_for([0.2, 0.21], 7, round_seconds=15.0) == 12  # flux: 11.7 -> 12
    assert bench.runs_for([0.55, 0.54], 7, round_seconds=15.0) == 7  # ltx2: 4.3 rounds, floor 7
    assert bench.runs_for([0.01, 0.01], 7, round_seconds=15.0) == 41  # capped
    assert bench.runs_for([0.01, 0.01], 7, round_seconds=15.0, most=20) == 20
    assert bench.runs_for([3.3, 3.3], 7, round_seconds=15.0) == 1  # seconds: steady, one run
    assert bench.runs_for([0.075, 0.08], 7) == 7  # no round seconds: --repeat, as before


def test_the_median_ratios_interval_is_seeded_and_holds_the_ratio(
    load_bench: Callable[[str], ModuleType], noisy_rounds: Callable[..., dict[str, list[float]]]
) -> None:
    import random

    bench = load_bench("full_size")
    rng = random.Random(2)
    # A shared host's noise: each round's cases slowed alike by a factor, the pair 1.25x.
    times = noisy_rounds({"plain_a": 0.075, "plain_b": 0.080}, rounds=32, seed=1, jitter=0.05)
    pairs = zip(times["plain_a"], times["plain_b"], strict=True)
    times["every_module"] = [1.25 * (a + b) for a, b in pairs]
    got = bench.ratios(times, "every_module")
    lo, hi = got["every_module_vs_plain_ci"]
    assert lo <= got["every_module_vs_plain"] <= hi
    assert 1.0 < lo < hi < 1.6 and hi - lo > 0.01  # noisy rounds: a real width
    assert got["every_module_vs_plain_rounds"] == pytest.approx(1.25)
    assert bench.ratio_interval(times, "every_module") == [lo, hi]  # seeded: the same again
    assert bench.ratio_interval(times, "every_module", seed=2) != [lo, hi]
    # A steadier host gives a narrower interval around the same ratio.
    steady = {k: [v[0]] * 32 for k, v in times.items()}
    steady["plain_a"] = [0.075 * (1 + 0.01 * rng.random()) for _ in range(32)]
    s_lo, s_hi = bench.ratio_interval(steady, "every_module")
    assert s_hi - s_lo < hi - lo
    four = {k: v[:4] for k, v in times.items()}
    assert bench.ratios(four, "every_module")["every_module_vs_plain_ci"] is None


def test_the_table_states_each_familys_ratios_and_why_a_row_has_none(
    load_bench: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    import json
    import subprocess
    import sys

    bench = load_bench("full_size")
    row = {"family": "sd3", "variant": "large", "preset": "full", "repeat": 20,
           "plain_a_s": 0.12, "plain_b_s": 0.13,
           "every_module_vs_plain": 1.234, "every_module_vs_plain_min": 1.185,
           "every_module_vs_plain_rounds": 1.21, "every_module_vs_plain_ci": [1.19, 1.31],
           "blocks_only_vs_plain": 1.002, "blocks_only_vs_plain_min": 0.972,
           "blocks_only_vs_plain_rounds": 0.997, "blocks_only_vs_plain_ci": None,
           "every_module_peak_vs_plain": 1.0241, "blocks_only_peak_vs_plain": 1.0238}  # fmt: skip
    skipped = {"family": "minimax_h3", "case": "sharded_2gpu", "skipped": "needs 2 GPUs, found 1"}
    text = bench.table([row, skipped])
    lines = text.splitlines()
    assert lines[0].startswith("| family |") and len(lines) == 4
    assert lines[2] == (
        "| sd3 large | 0.120 + 0.130 s | 20 | 1.23x [1.19-1.31] / 1.19x / 1.21x | "
        "1.00x / 0.97x / 1.00x | 1.024 / 1.024x |"
    )
    assert "minimax_h3 (sharded_2gpu) | needs 2 GPUs, found 1 |" in lines[3]
    # A sharded case that ran: no plain forwards, so its figures in words.
    sharded = {"family": "minimax_h3", "preset": "full", "case": "sharded_2gpu", "wall_s": 80.25,
               "pairs": 52, "model_output_rel_max": 0.01234,
               "fsdp2_a": {"build_s": 1.21, "forward_s": 3.4, "world_size": 2,
                           "peak_memory_gib_per_rank": [90.12, 89.7]},
               "fsdp2_b": {"build_s": 1.1, "forward_s": 3.91, "world_size": 2,
                           "peak_memory_gib_per_rank": [91.1, 90.7]}}  # fmt: skip
    assert bench.table([sharded]).splitlines()[2] == (
        "| minimax_h3 (sharded_2gpu) | paired in 80.2 s on 2 ranks, 52 block pairs (a: build "
        "1.2 s, forward 3.40 s, peak GiB 90.1/89.7; b: build 1.1 s, forward 3.91 s, peak GiB "
        "91.1/90.7), model output rel_max 0.0123 | | | | |"
    )
    # The same table from a written file, without a GPU.
    path = tmp_path / "full_size.json"
    path.write_text(json.dumps({"meta": {}, "rows": [row, skipped]}))
    script = Path(__file__).resolve().parents[1] / "bench" / "full_size.py"
    out = subprocess.run(
        [sys.executable, str(script), "--table", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == text + "\n\n" + bench.host_table([row, skipped])


def test_host_work_splits_a_pairs_cpu_time_into_blocks_and_the_modules_inside(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_size")

    def runs(cpu: list[float], side: float = 0.0, probe: float | None = None) -> list[dict]:
        # A pair's forwards run on its side threads; the calling thread does the rest.
        return [{"thread_cpu_s": c - side, "side_cpu_s": side, "probe_us": probe} for c in cpu]

    row = {"family": "sd3", "variant": "large", "every_module_vs_plain": 1.4,
           "every_module_pairs": 1717, "blocks_only_pairs": 75,
           "plain_a_clocks": runs([0.12, 0.10, 0.11, 0.13, 0.11], probe=21.0),
           "plain_b_clocks": runs([0.13, 0.12, 0.12, 0.12, 0.14], probe=23.0),
           "every_module_clocks": runs([0.36, 0.33, 0.35, 0.50, 0.34], side=0.3, probe=20.0),
           "blocks_only_clocks": runs([0.26, 0.25, 0.24, 0.27, 0.25], side=0.2)}  # fmt: skip
    work = bench.host_work(row)
    assert work["plain_a_cpu_s"] == pytest.approx(0.11) and work["plain_b_cpu_s"] == 0.12
    assert work["every_module_cpu_s"] == pytest.approx(0.35)  # the median run, both threads
    assert work["blocks_only_cpu_s"] == pytest.approx(0.25)
    assert work["modules_cpu_s"] == pytest.approx(0.10)
    assert work["modules_cpu_us_per_pair"] == pytest.approx(0.10 / 1642 * 1e6)
    assert work["plain_a_probe_us"] == 21.0 and work["blocks_only_probe_us"] is None
    lines = bench.host_table([row]).splitlines()
    assert lines[2] == "| sd3 large | 0.110 + 0.120 / 0.350 / 0.250 | 100 ms (61 us) | 21 / 20 |"
    # Too few rounds to read (a forward of seconds, timed once), or no clocks: left out.
    once = {**row, **{f"{c}_clocks": row[f"{c}_clocks"][:1] for c in
                      ("plain_a", "plain_b", "every_module", "blocks_only")}}  # fmt: skip
    assert bench.host_work(once) is None and bench.host_work({"family": "x"}) is None
    assert len(bench.host_table([once, {"family": "x", "error": "OOM"}]).splitlines()) == 2


def test_cases_run_in_rounds_and_keep_only_their_last_value(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_size")
    order: list[str] = []
    held: list[int] = []

    def case(key: str) -> Callable[[], object]:
        def run() -> object:
            order.append(key)
            held.append(len(order))
            return (key, len(order))

        return run

    times, peaks, last = bench.in_rounds({k: case(k) for k in ("p", "q", "r")}, 6)
    # A balanced Latin square (three cases: six rounds), each case after each other twice.
    rounds = [order[i : i + 3] for i in range(0, 18, 3)]
    assert rounds == [list(r) for r in ("pqr", "qrp", "rpq", "rqp", "prq", "qpr")]
    after = Counter((r[i], r[i + 1]) for r in rounds for i in range(2))
    assert set(after.values()) == {2} and len(after) == 6
    assert {k: len(v) for k, v in times.items()} == {"p": 6, "q": 6, "r": 6}
    assert all(s >= 0.0 for v in times.values() for s in v)
    assert last == {"p": ("p", 17), "q": ("q", 16), "r": ("r", 18)}  # the last round: q p r
    assert set(peaks) == {"p", "q", "r"}
    order.clear()
    bench.in_rounds({k: case(k) for k in ("p", "q", "r")}, 2, rotate=False)
    assert order == ["p", "q", "r"] * 2


def test_ratios_of_medians_minima_and_rounds(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("full_size")
    times = {
        "plain_a": [0.10, 0.20, 0.10],
        "plain_b": [0.10, 0.20, 0.12],
        # A noisy round (the second) slows every case alike: the round's own ratio stays put.
        "every_module": [0.26, 0.52, 0.33],
    }
    got = bench.ratios(times, "every_module")
    assert got["every_module_vs_plain"] == pytest.approx(0.33 / (0.10 + 0.12))
    assert got["every_module_vs_plain_min"] == pytest.approx(0.26 / 0.20)
    assert got["every_module_vs_plain_rounds"] == pytest.approx(1.3)  # 1.3, 1.3, 1.5


def test_measure_runs_every_case_in_rounds_and_records_each_runs_core(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bench's own measure, end to end at tiny on the CPU, with the kept side threads of a
    # CUDA pair (pinned to the core LAB_PAIR_PIN picks), so each run's core is recorded.
    import os

    from lab.pairing import lockstep

    if not hasattr(os, "sched_getaffinity") or lockstep.current_cpu() is None:
        pytest.skip("needs Linux CPU affinity and sched_getcpu to pin the side threads")
    monkeypatch.delenv("LAB_PAIR_PIN", raising=False)  # the default: the fastest core
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))
    bench = load_bench("full_size")
    row = bench.measure("sd3", 3, preset="tiny", device="cpu")
    assert row["preset"] == "tiny" and row["order"] == "rotated" and row["repeat"] == 3
    for case in ("plain_a", "plain_b", "every_module", "blocks_only"):
        assert len(row[f"{case}_times_s"]) == 3 and all(t > 0 for t in row[f"{case}_times_s"])
    assert row["every_module_pairs"] > 100 and 0 < row["blocks_only_pairs"] < 10
    assert row["every_module_lockstep"] and row["blocks_only_lockstep"]
    allowed = os.sched_getaffinity(0)
    for case in ("every_module", "blocks_only"):
        cpus = row[f"{case}_pinned_cpus"]
        assert len(cpus) == 3 and all(cpu in allowed for cpu in cpus), cpus
        assert row[f"{case}_vs_plain"] == pytest.approx(
            statistics.median(row[f"{case}_times_s"])
            / (
                statistics.median(row["plain_a_times_s"])
                + statistics.median(row["plain_b_times_s"])
            )
        )
        assert row[f"{case}_peak_vs_plain"] is None  # no device peaks on the CPU
        # Each run's host clocks, read on the core its side threads were pinned to; the side
        # threads ran the pair's forwards, so they spent CPU time.
        clocks = row[f"{case}_clocks"]
        assert [c["cpu"] for c in clocks] == cpus
        assert all(c["side_cpu_s"] > 0 and c["wall_s"] > 0 for c in clocks), clocks
        # ... and each pair's phases, which fit in its wall time.
        assert all(sum(c["timings_s"].values()) <= c["wall_s"] for c in clocks), clocks
    for case in ("plain_a", "plain_b"):
        clocks = row[f"{case}_clocks"]
        assert len(clocks) == 3
        # A plain forward runs on the calling thread: its CPU time is its, not the side threads'.
        assert all(c["thread_cpu_s"] > 0 and c["cpu"] == c["cpu_start"] for c in clocks), clocks
        assert sum(c["side_cpu_s"] for c in clocks) < sum(
            c["side_cpu_s"] for c in row["every_module_clocks"]
        )
    assert row["model_output_rel_max"] > 0  # rollout against trainer: they differ


def test_plain_forwards_can_run_on_the_fastest_core_as_the_pairs_do(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from lab.pairing import lockstep

    if not hasattr(os, "sched_getaffinity") or lockstep.current_cpu() is None:
        pytest.skip("needs Linux CPU affinity and sched_getcpu")
    allowed = os.sched_getaffinity(0)
    fast = max(allowed)
    monkeypatch.setattr(lockstep, "KEEP_WORKERS_ON", ("cpu", "cuda"))
    monkeypatch.setattr(
        lockstep, "_probe_s", lambda: 20e-6 if lockstep.current_cpu() == fast else 38e-6
    )
    monkeypatch.delenv("LAB_PAIR_PIN", raising=False)  # the default: fastest
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(lockstep, "PROBE_CPUS", len(allowed))
    import lab

    ran_on: list[int | None] = []
    forward = lab.forward_side

    def watched(*args: object, **kwargs: object) -> object:
        ran_on.append(lockstep.current_cpu())  # where the forward itself runs
        return forward(*args, **kwargs)

    monkeypatch.setattr(lab, "forward_side", watched)
    bench = load_bench("full_size")
    row = bench.measure("sd3", 2, preset="tiny", device="cpu", plain_fastest=True)
    assert row["plain_pin"] == "fastest"
    # Every plain forward (two warm-ups, two rounds of each side) ran on the fast core ...
    assert ran_on == [fast] * 6, ran_on
    for case in ("plain_a", "plain_b"):
        # ... and its clocks were read there, with the probe that chose the core.
        assert [c["cpu"] for c in row[f"{case}_clocks"]] == [fast, fast]
        assert [c["probe_us"] for c in row[f"{case}_clocks"]] == pytest.approx([20.0, 20.0])
    assert row["every_module_pinned_cpus"] == [fast, fast]
    assert [c["probe_us"] for c in row["every_module_clocks"]] == pytest.approx([20.0, 20.0])
    assert os.sched_getaffinity(0) == allowed
    assert bench.measure("sd3", 1, preset="tiny", device="cpu")["plain_pin"] == "none"


@pytest.mark.slow
def test_the_sharded_row_runs_and_keeps_a_failed_runs_pairs(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`measure_sharded` through `pair_sharded` on CPU ranks (the GPU case's path at tiny): a
    run's figures, then a rank failing in the trainer's forward, named with its pairs kept."""
    bench = load_bench("full_size")
    row = bench.measure_sharded(2, "sd3", "tiny", "cpu")
    assert row["fsdp2_a"]["world_size"] == row["fsdp2_b"]["world_size"] == 2
    assert row["pairs"] == len(lab.pair_family("sd3", "tiny", capture_depth=1).rows)
    assert "paired in" in bench.table([row]).splitlines()[2]
    monkeypatch.setenv("LAB_FSDP2_FAULT", "raise@0:trainer:transformer_blocks.1")
    failed = bench.measure_sharded(2, "sd3", "tiny", "cpu")
    assert failed["failed"] == {"side": "trainer", "module": "transformer_blocks.1", "rank": 0,
                                "error_type": "RuntimeError"}  # fmt: skip
    assert failed["error"].startswith("pair_sharded: side 'trainer' failed under FSDP2")
    assert failed["pairs_before_failure"] == 9 < row["pairs"]
    assert [c["partial"] for c in failed["captured"]] == [None, True]
    assert "(9 block pairs kept)" in bench.table([failed]).splitlines()[2]

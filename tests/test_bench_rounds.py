"""bench/rounds.py: deep tiny models, round orders, intervals and run clocks (CPU)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import lab
from lab.pairing import lockstep


def test_deep_tiny_keeps_tiny_widths_with_full_layer_counts(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("rounds")
    for name in ("sd3", "flux", "cosmos3"):
        fam = lab.family(name)
        full, tiny = fam.config("full"), fam.config("tiny")  # read before deep_tiny runs
        got = bench.deep_tiny(fam).config("tiny")
        layers = [k for k in full if "layers" in k]
        assert layers, name
        assert {k: tiny[k] for k in layers} != {k: full[k] for k in layers}, name
        assert {k: got[k] for k in layers} == {k: full[k] for k in layers}
        assert {k: v for k, v in got.items() if k not in layers} == {
            k: v for k, v in tiny.items() if k not in layers
        }
        assert fam.config("tiny") == tiny  # the registry's family is left as it was


def test_one_case_against_another_with_an_interval_over_the_rounds(
    load_bench: Callable[[str], ModuleType], noisy_rounds: Callable[..., dict[str, list[float]]]
) -> None:
    import statistics

    bench = load_bench("rounds")
    # Each round slowed alike by the host; the new path 10 % faster than the old.
    times = noisy_rounds({"old": 0.30, "new": 0.27}, rounds=21, seed=3, jitter=0.03)
    got = bench.against(times, "new", "old")
    assert got["new_vs_old"] == statistics.median(times["new"]) / statistics.median(times["old"])
    lo, hi = got["new_vs_old_ci"]
    assert lo <= got["new_vs_old"] <= hi and hi - lo > 0.01
    assert got["new_faster_than_old_rounds"] == 21  # the round's own comparison: every time
    # The interval is seeded, needs 5 rounds, and narrows as the draws' spread does.
    assert bench.against(times, "new", "old")["new_vs_old_ci"] == [lo, hi]
    short = {k: v[:4] for k, v in times.items()}
    assert bench.against(short, "new", "old")["new_vs_old_ci"] is None
    assert bench.bootstrap_interval(lambda picked: 1.5, 10) == [1.5, 1.5]
    picked_sizes = []
    bench.bootstrap_interval(lambda p: picked_sizes.append(len(p)) or 0.0, 7, draws=30)
    assert picked_sizes == [7] * 30


def test_a_family_case_may_name_a_variant(load_bench: Callable[[str], ModuleType]) -> None:
    # "sd3:large" in the benches: on the CPU the tiny width at the variant's full depth.
    bench = load_bench("rounds")
    _, preset, medium, _ = bench.family_case("sd3", "cpu")
    fam, _, large, inputs = bench.family_case("sd3:large", "cpu")
    assert preset == "tiny (full layer counts)"
    full_large = lab.family("sd3").config("full", "large")["num_layers"]
    assert len(large.transformer_blocks) == full_large == 38
    assert len(medium.transformer_blocks) == lab.family("sd3").config("full")["num_layers"]
    out = lab.forward_side(large, inputs, lab.Side.rollout(fam))
    out = out[0] if isinstance(out, tuple) else out
    latents = inputs.kwargs[inputs.keys_with_role("latents")[0]]
    assert out.shape == latents.shape and out.isfinite().all()
    with pytest.raises(ValueError, match=r"unknown variant 'huge'\. Known: large"):
        bench.family_case("sd3:huge", "cpu")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_orders_put_each_case_after_each_other_equally_often(
    load_bench: Callable[[str], ModuleType], n: int
) -> None:
    from collections import Counter

    bench = load_bench("rounds")
    keys = [f"case{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n  # Williams' design: n rows, or 2n for an odd n
    rows = bench.round_orders(keys, 2 * cycle)
    assert len(rows) == 2 * cycle and all(sorted(r) == keys for r in rows)
    assert rows[cycle:] == rows[:cycle]  # the design repeats
    after = Counter((r[i], r[i + 1]) for r in rows[:cycle] for i in range(n - 1))
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1  # every ordered pair
    assert len(set(Counter(r[0] for r in rows[:cycle]).values())) == 1  # each case first alike
    if n == 4:
        # A plain rotation (row i starting at case i) would put case1 after case0 in 3 of 4.
        assert after[("case0", "case1")] == 1
    assert bench.round_orders([], 3) == []


def test_timed_rounds_and_vs_plain(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("rounds")
    ran: list[tuple[str, int]] = []
    cases = {k: (lambda k=k: ran.append((k, -1))) for k in ("plain", "pair")}
    times = bench.timed_rounds(cases, 3, "cpu", run=lambda k, r, fn: ran.append((k, r)))
    assert {k: len(v) for k, v in times.items()} == {"plain": 3, "pair": 3}
    # `run` runs each case, in round_orders' order (two cases: the order alternates).
    assert ran == [("plain", 0), ("pair", 0), ("pair", 1), ("plain", 1), ("plain", 2), ("pair", 2)]
    row = bench.vs_plain({"plain": [0.10, 0.20, 0.10], "pair": [0.13, 0.26, 0.15]})
    assert row["plain_vs_plain"] == 1.0 and row["pair_s"] == 0.15 and row["pair_min_s"] == 0.13
    assert row["pair_vs_plain"] == pytest.approx(1.5)
    assert row["pair_vs_plain_min"] == pytest.approx(1.3)
    assert row["pair_vs_plain_rounds"] == pytest.approx(1.3)  # 1.3, 1.3, 1.5


def test_rows_per_family_keeps_the_other_families_on_an_error(
    load_bench: Callable[[str], ModuleType], tmp_path: Any, capsys: pytest.CaptureFixture
) -> None:
    import json

    bench = load_bench("rounds")

    def measure(name: str) -> dict[str, Any]:
        if name == "bad":
            raise RuntimeError("out of memory")
        return {"family": name, "x_s": 0.123456, "x_times_s": [0.1, 0.2]}

    out = tmp_path / "out.json"
    bench.rows_per_family(str(out), "a,bad,b", "cuda", measure)
    rows = json.loads(out.read_text())["rows"]
    assert [r["family"] for r in rows] == ["a", "bad", "b"]
    assert rows[1]["error"] == "RuntimeError: out of memory" and rows[2]["x_times_s"] == [0.1, 0.2]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed[0] == {"family": "a", "x_s": 0.1235}  # rounded, without the per-run times


def test_core_jiffies_reads_each_cpus_busy_and_stolen_ticks(
    load_bench: Callable[[str], ModuleType], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("rounds")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        "cpu  30 0 10 500 5 0 0 7 0 0\n"
        "cpu0 10 0 5 200 2 0 1 3 4 0\n"
        "cpu2 20 1 5 300 3 2 0 4 0 0\n"
        "intr 12345\n"
    )
    real_path = bench.Path
    monkeypatch.setattr(bench, "Path", lambda p: stat if p == "/proc/stat" else real_path(p))
    # cpu0: busy = 10+5+1 (guest is inside user); cpu1 is offline: zeros; cpu2: 20+1+5+2.
    assert bench.core_jiffies() == [(16, 3), (0, 0), (28, 4)]
    monkeypatch.setattr(bench, "Path", lambda p: tmp_path / "missing")
    assert bench.core_jiffies() is None


def test_run_clock_counts_a_busy_threads_cpu_and_its_core(
    load_bench: Callable[[str], ModuleType],
) -> None:
    import time

    bench = load_bench("rounds")
    clock = bench.RunClock()
    with pytest.raises(RuntimeError, match="start"):
        clock.record()
    clock.start()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # busy on this thread
        pass
    clock.stop()
    got = clock.record()
    assert 0.3 <= got["wall_s"] < 5.0
    # This thread ran all along, less what other processes took from it on a busy machine.
    assert 0.1 * got["wall_s"] <= got["thread_cpu_s"] <= got["wall_s"] + 0.02
    if lockstep.current_cpu() is not None:
        assert got["cpu"] == got["cpu_start"] is not None and got["cpu_end"] is not None
    if bench.core_jiffies() is not None and got["cpu_start"] == got["cpu_end"]:
        # The core it stayed on was busy at least while the loop ran there (ticks of 10 ms).
        assert got["core_busy_s"] >= got["thread_cpu_s"] - 0.03
        assert got["core_steal_s"] >= 0 and got["host_steal_s"] >= got["core_steal_s"]
        assert got["cores_busy_s"][got["cpu"]] == round(got["core_busy_s"], 2)
        assert len(got["cores_busy_s"]) == len(bench.core_jiffies())
    # A core named by the caller is the one read.
    assert clock.record(0)["cpu"] == 0
    assert got["gc_full"] == 0 and got["gc_s"] >= 0

    # The collector's runs inside the clock are counted and timed; none after it stops.
    import gc

    gc.disable()  # only the two collections asked for below
    try:
        clock.start()
        held = [[i] for i in range(200_000)]  # tracked objects for the full collection to walk
        gc.collect(0)
        gc.collect()
        clock.stop()
    finally:
        gc.enable()
    gc.collect()
    got = clock.record()
    assert got["gc_full"] == 1 and 0 < got["gc_full_s"] <= got["gc_s"] <= got["wall_s"]
    assert clock._on_gc not in gc.callbacks
    del held

    # As a context manager, a run that raises still stops the clock and its callback.
    with pytest.raises(KeyError), bench.RunClock() as failing:
        assert failing._on_gc in gc.callbacks
        raise KeyError("the run failed")
    assert failing._on_gc not in gc.callbacks and failing.record()["wall_s"] >= 0

"""bench/host_watch.py: its sampler process, its /proc/cpuinfo reading and its join (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_mhz_reads_each_cpus_clock(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("host_watch")
    text = "processor\t: 0\ncpu MHz\t\t: 2400.125\nflags: x\nprocessor\t: 1\ncpu MHz\t\t: 1800.0\n"
    assert bench.cpu_mhz(text) == [2400.125, 1800.0]
    assert bench.cpu_mhz("no clocks here") == []
    # Indexed by processor number: an offline CPU 1 leaves a gap, not a shift.
    gap = "processor\t: 0\ncpu MHz\t: 2000.0\nprocessor\t: 2\ncpu MHz\t: 3000.0\n"
    assert bench.cpu_mhz(gap) == [2000.0, None, 3000.0]


def test_watch_writes_timed_samples_until_its_time_is_up(tmp_path: Path) -> None:
    out = tmp_path / "watch.jsonl"
    # As the device script runs it: a process of its own.
    subprocess.run(
        [sys.executable, str(ROOT / "bench/host_watch.py"), str(out), "--period", "0.01",
         "--seconds", "0.3"],
        check=True, timeout=60,
    )  # fmt: skip
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(samples) <= 31, len(samples)
    times = [s["t"] for s in samples]
    assert times == sorted(times) and times[-1] - times[0] < 1.0
    assert all(isinstance(s["cpu_mhz"], list) for s in samples)


def test_join_sets_each_run_against_the_clocks_over_its_span(
    load_bench: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    bench = load_bench("host_watch")
    # Samples every 10 ms from t=100: the SM clock drops to 1200 MHz under a power cap
    # (reason 0x4) from t=100.5 on; CPU 1 runs at 2000 MHz, CPU 0 at 3000.
    samples = [
        {"t": 100 + i / 100, "cpu_mhz": [3000.0, 2000.0],
         "sm_mhz": 1980 if i < 50 else 1200, "mem_mhz": 3201, "power_w": 300.0,
         "util_pct": 60, "reasons": 0 if i < 50 else 0x4}
        for i in range(100)
    ]  # fmt: skip
    watch = tmp_path / "watch.jsonl"
    watch.write_text("\n".join(json.dumps(s) for s in samples) + '\n{"t": 1')  # cut by the kill
    assert bench.read_samples(watch) == samples

    def run(t0: float, t1: float, cpu: int) -> dict:
        return {"wall_s": t1 - t0, "t0": t0, "t1": t1, "cpu": cpu}

    size = tmp_path / "full_size.json"
    rows = [
        {"family": "sd3", "variant": None, "plain_a_clocks": [run(100.0, 100.095, 0)],
         "every_module_clocks": [run(100.6, 100.895, 1), run(100.2, 100.395, 1)]},
        {"family": "flux", "variant": None, "plain_a_clocks": [run(100.1, 100.2, 0)]},
    ]  # fmt: skip
    size.write_text(json.dumps({"rows": rows}))
    got = bench.join(size, samples, {"sd3"})
    assert [(r["case"], r["round"]) for r in got] == [
        ("plain_a", 0),
        ("every_module", 1),
        ("every_module", 0),
    ]  # time order
    fast, slow = got[1], got[2]
    assert fast["samples"] == 20 and fast["sm_mhz"] == 1980 and fast["reasons"] == 0
    assert slow["samples"] == 30 and slow["sm_mhz"] == 1200 and slow["reasons"] == 0x4
    assert fast["cpu_mhz"] == 2000.0 and got[0]["cpu_mhz"] == 3000.0
    assert len(bench.join(size, samples, None)) == 4

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [{"family": "sd3", "plain_a_clocks": [{"wall_s": 1}]}]}))
    with pytest.raises(ValueError, match=r"no t0/t1.*Run bench/full_size\.py again"):
        bench.join(old, samples, None)

"""bench/core_probe.py: each CPU's time at the same loop, the caller's CPU set kept (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="Linux thread affinity"
)


def test_a_pass_times_the_loop_on_each_cpu_it_may_use(
    load_bench: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench("core_probe")
    allowed = os.sched_getaffinity(0)
    seen: list[int] = []
    real = bench.loop_ms

    def where(loops: int) -> float:
        from lab.pairing.lockstep import current_cpu

        seen.append(current_cpu())  # the loop runs on the CPU it was moved to
        return real(loops)

    monkeypatch.setattr(bench, "loop_ms", where)
    got = bench.probe_pass(sorted(allowed), 20_000, settle_s=0.0)
    assert list(got) == sorted(allowed) and seen == sorted(allowed)
    assert all(v is not None and v > 0 for v in got.values())
    assert os.sched_getaffinity(0) == allowed
    # A CPU the thread may not use reads None, and the others are still timed.
    missing = max(allowed) + 1
    got = bench.probe_pass([missing, *sorted(allowed)], 20_000, settle_s=0.0)
    assert got[missing] is None and all(got[c] > 0 for c in allowed)
    assert os.sched_getaffinity(0) == allowed
    # More work takes longer.
    assert min(real(200) for _ in range(5)) < min(real(200_000) for _ in range(3))


def test_the_script_prints_and_appends_a_line_a_pass(tmp_path: Path) -> None:
    out = tmp_path / "cores.jsonl"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench/core_probe.py"), str(out), "--passes", "2",
         "--loops", "5000"],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("core ms [") for line in lines)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and records[0]["loops"] == 5000
    assert {int(c) for c in records[0]["ms"]} == os.sched_getaffinity(0)

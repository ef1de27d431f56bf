"""bench/full_traj.py on the tiny preset on CPU: the row it writes and its forward counts."""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable
from types import ModuleType

import pytest

import lab


def test_wan2_2_row_counts_the_trajectorys_own_forwards_across_both_experts(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_traj")
    fam = lab.family("wan2_2")
    row = bench.measure("wan2_2", preset="tiny", device="cpu", steps=2, cfg_scale=4.5)

    expected = {
        "family", "steps", "steps_requested", "sigmas", "experts_by_step", "experts_ran",
        "cfg_scale", "cfg_layout", "samples", "repeat", "stream", "build_s",
        "plain_s", "plain_forwards", "plain_peak_gib",
        "seed_metrics_s", "seed_metrics_vs_plain", "seed_metrics_forwards",
        "seed_metrics_build_s", "seed_metrics_peak_gib", "log_prob_mean_abs_diff",
        "every_module_s", "every_module_vs_plain", "every_module_forwards",
        "every_module_build_s", "every_module_peak_gib", "every_module_pairs",
        "every_module_capture_forwards",
    }  # fmt: skip
    assert expected <= set(row), sorted(expected - set(row))
    assert row["steps"] == 2 and "steps_note" not in row
    assert row["experts_ran"] == list(fam.experts) == ["high_noise", "low_noise"]
    assert row["experts_by_step"] == ["high_noise", "low_noise"]
    for key in ("seed_metrics_vs_plain", "every_module_vs_plain", "plain_s", "build_s"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    # CFG "separate": per step, each side runs a positive and a negative forward.
    assert row["plain_forwards"] == 2 * 2 * 2
    assert row["seed_metrics_forwards"] == row["plain_forwards"]
    assert row["every_module_pairs"] > 0
    # A captured step pairs the step's own forwards: no extra forward (pair(outputs=)); the
    # bench's every_module_capture_forwards is this difference.
    assert row["every_module_forwards"] == row["plain_forwards"]
    assert math.isfinite(row["log_prob_mean_abs_diff"])
    assert row["plain_peak_gib"] is None  # no CUDA peak on CPU
    assert "build" not in vars(fam), "the build timer left its wrapper on the registry's Family"


def test_forward_counter_counts_root_calls_only(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("full_traj")
    fam = lab.family("sd3")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0)
    side = lab.Side.rollout(fam)
    with bench._counting_forwards(fam) as count:
        lab.forward_side(model, inputs, side)
        lab.forward_side(model, inputs, side)
    lab.forward_side(model, inputs, side)  # after the hook is removed

    assert count == [2]


def test_steps_reaching_every_expert(load_bench: Callable[[str], ModuleType]) -> None:
    bench = load_bench("full_traj")
    wan, sd3 = lab.family("wan2_2"), lab.family("sd3")

    steps, sigmas = bench.steps_reaching_every_expert(wan, 2, "tiny")
    assert steps == 2 and len(sigmas) == 3
    assert [wan.expert_for_sigma(s) for s in sigmas[:-1]] == ["high_noise", "low_noise"]
    assert bench.steps_reaching_every_expert(sd3, 3, "tiny")[0] == 3
    # Wan2.2's shift-12 grid never goes below sigma 0.126 before 0: a boundary under it is
    # never crossed, and the search says so instead of looping.
    low = dataclasses.replace(wan, expert_boundary=0.05)
    with pytest.raises(ValueError, match=r"no schedule of 2\.\.8 steps reaches every expert"):
        bench.steps_reaching_every_expert(low, 2, "tiny", most=8)


def test_gc_ab_case_runs_the_same_pairs_with_the_collector_on(
    load_bench: Callable[[str], ModuleType],
) -> None:
    bench = load_bench("full_traj")
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # the interpreter's defaults, whatever a test set before
    try:
        row = bench.measure("sd3", preset="tiny", device="cpu", steps=2, gc_ab=True)
    finally:
        gc.set_threshold(*thresholds)

    assert row["every_module_gc_on_pairs"] == row["every_module_pairs"] > 100
    assert row["every_module_gc_on_forwards"] == row["every_module_forwards"]
    assert row["every_module_gc_on_capture_forwards"] == 0
    assert math.isfinite(row["every_module_gc_on_vs_plain"])
    young, middle, full = row["every_module_gc_collections"]
    # Paused for the call: the timed young collection after it, and the one the first
    # allocation after the pause may start (which can reach the older generations once).
    assert 1 <= young <= 2 and middle <= 1 and full <= 1, row["every_module_gc_collections"]
    assert row["every_module_gc_on_gc_collections"][0] > young + 3
    for case in ("seed_metrics", "every_module", "every_module_gc_on"):
        assert row[f"{case}_gc_s"] >= 0.0

"""Prescriptions: the cheapest verified change that meets a target, with its measured cost."""

from __future__ import annotations

import pytest

import lab
from lab.causes.prescribe import check_target, prescribe
from lab.engine.search import minimal_subset


def _case(family_name: str = "flux") -> tuple:
    fam = lab.family(family_name)
    return fam, fam.build("tiny", 0), fam.make_inputs("tiny", 0)


def test_minimal_subset_finds_the_needed_items_only() -> None:
    calls: list[list[int]] = []

    def meets(items: list[int]) -> bool:
        calls.append(items)
        return {3, 7} <= set(items)

    assert sorted(minimal_subset(list(range(10)), meets)) == [3, 7]
    assert minimal_subset([1, 2], lambda items: True) == []
    assert len(calls) < 2**10 / 10  # bisection, not a scan of the subsets


def test_flux_bitexact_by_copying_autocast_and_the_timestep_verified_and_costed() -> None:
    fam, model, inputs = _case()
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    found = prescribe(model, inputs, a, b, repeats=2)
    assert found.baseline > 0 and not found.baseline_meets
    best = found.best()
    assert best is not None and best.kind == "copy"
    # The engine's two differences from the trainer on tiny flux, and nothing else.
    assert [c.knob.name for c in best.changes] == ["autocast", "op_switches['timestep_from']"]
    assert best.side.autocast is False and best.side.name == "trainer"
    assert best.side.op_switches == {"timestep_from": "scheduler"}
    # Verified: the pair of side A and the moved side is bit-exact at the model output.
    assert best.result.output_metrics()["model_output_max_abs_diff"] == 0.0
    assert best.result.side_b["autocast"] is False
    assert best.value == 0.0 and best.meets
    assert best.extra_bytes == 0 and best.time_ratio > 0
    assert "only matches rollout" in best.effect
    # Islands cannot make a more precise trainer equal the engine's bf16 bit for bit.
    assert found.searched["island"].startswith("all ")
    table = found.table()
    assert table.loc[0, "changes"].startswith("autocast: ") and bool(table.loc[0, "meets"])
    assert "1. [copy] autocast: " in found.describe()
    assert "op_switches['timestep_from']: pipeline (stock) -> scheduler" in found.describe()
    assert found.to_dict()["prescriptions"][0]["summary"]["family"] == "flux"


def test_a_threshold_target_admits_fp32_islands_with_their_bytes() -> None:
    # Toward an fp32 reference, an fp32 block on Wan's trainer side lowers its rel_max.
    fam, model, inputs = _case("wan2_2")
    a, b = lab.Side.fp32_reference(fam), lab.Side.trainer(fam)
    base = lab.pair(model, inputs, a, b).output_metrics()["model_output_rel_max"]
    target = {"metric": "rel_max", "max": base * 0.9}
    found = prescribe(model, inputs, a, b, target=target, kinds=("island",), repeats=1)
    best = found.best()
    assert best is not None, found.describe()
    assert best.result.output_metrics()["model_output_rel_max"] <= target["max"]
    assert best.value == best.result.output_metrics()["model_output_rel_max"]
    assert best.extra_bytes > 0, "fp32 islands hold parameters at 4 bytes instead of 2"
    assert all(c.rule[1] == "fp32" for c in best.changes)
    assert "fp32 island" in best.effect


def test_moving_side_a_copies_the_trainers_settings_into_the_rollout() -> None:
    fam, model, inputs = _case()
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    found = prescribe(model, inputs, a, b, movable="a", kinds=("copy",), repeats=1)
    best = found.best()
    assert best is not None and best.side.name == "rollout" and best.side.autocast is True
    assert best.result.side_a["name"] == "rollout"


def test_identical_sides_need_nothing() -> None:
    fam, model, inputs = _case()
    a = lab.Side.rollout(fam)
    found = prescribe(model, inputs, a, a.replace(name="same"))
    assert found.baseline == 0.0 and found.baseline_meets and not len(found)
    assert "already meet the target" in found.describe()


def test_bad_targets_and_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"target must be 'bitexact', 'noise_floor' or"):
        check_target("exact", None, 1e-4)
    with pytest.raises(ValueError, match=r"target metric 'rel_maxx' unknown"):
        check_target({"metric": "rel_maxx", "max": 1e-3}, None, 1e-4)
    with pytest.raises(ValueError, match=r"target\['max'\] must be a number >= 0, got -1"):
        check_target({"metric": "rel_max", "max": -1}, None, 1e-4)
    with pytest.raises(ValueError, match=r"target='noise_floor' scores a trajectory step"):
        check_target("noise_floor", None, 1e-4)
    fam, model, inputs = _case()
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    with pytest.raises(ValueError, match=r"unknown candidate kind\(s\) \['islands'\]"):
        prescribe(model, inputs, a, b, kinds=("islands",))
    with pytest.raises(ValueError, match=r"movable must be 'a' or 'b', got 'trainer'"):
        prescribe(model, inputs, a, b, movable="trainer")


def test_noise_floor_target_on_a_trajectory_step() -> None:
    traj = lab.trajectory("flux", "tiny", steps=4, samples=2, progress=False)
    step = lab.StepScore.from_trajectory(traj, 2)
    fam, model, _ = _case()
    record = traj.steps[2]
    inputs = fam.make_inputs("tiny", 0, step.batch, False, sigma=record.sigma,
                             latents=record.x_t[: step.batch].reshape(step.shapes[0]))  # fmt: skip
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    clip = 1e-9
    found = prescribe(model, inputs, a, b, target="noise_floor", step=step, clip_range=clip,
                      kinds=("copy",), repeats=1)  # fmt: skip
    assert found.baseline > clip, "flux tiny's drift is already under a 1e-9 clip range"
    best = found.best()
    assert best is not None and best.value <= clip

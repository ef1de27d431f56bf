"""attribute_step / attribute(step=...): shares of one trajectory step's log-prob drift."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import lab
from lab.causes.attribute import Attribution, attribute_step
from lab.rl.flow_grpo import log_ratio_terms
from lab.rl.step_score import StepScore


def _measured(traj: lab.Trajectory, step: int, n: int) -> torch.Tensor:
    """The trajectory's own exact log-ratio of the first n samples at `step` (float64)."""
    r = traj.steps[step]
    terms = log_ratio_terms(
        r.noise_pred_old[:n], r.noise_pred_new[:n], r.x_t[:n], r.x_prev[:n], r.sigma,
        r.sigma_prev, r.std_dev_t, traj.meta["sde_type"],
    )  # fmt: skip
    return terms.predicted


@pytest.fixture(scope="module")
def sd3_traj() -> lab.Trajectory:
    return lab.trajectory("sd3", "tiny", steps=4, samples=2, cfg_scale=4.5, progress=False)


def test_r0_is_the_trajectorys_own_drift_and_grafts_remove_it_all(sd3_traj) -> None:
    attr = attribute_step(sd3_traj, 1)
    want = float(_measured(sd3_traj, 1, 2).abs().mean())
    # The same velocities as the trajectory's forwards, bit for bit: the same float64 number.
    assert attr.r0.log_ratio == want > 0
    assert attr.metric == "log_ratio"
    assert attr.meta["step"]["step"] == 1 and attr.meta["step"]["cfg_scale"] == 4.5
    shares = [r["share"] for r in attr.rows]
    assert math.isclose(sum(shares), 1.0 - attr.residual, abs_tol=1e-9)
    # Batched CFG: both branches are in the grafted forward, so every graft removes it all.
    assert attr.rows[-1]["log_ratio_after_graft"] == 0.0 and attr.residual == 0.0
    assert all(math.isfinite(r["log_ratio_after_graft"]) for r in attr.rows)
    top = attr.top()
    assert top is not None and top["share"] > 0
    assert "step-1 log-prob drift" in attr.verdict
    # The other metrics keep their meaning; the log-ratio columns are filled either way.
    by_l2 = attribute_step(sd3_traj, 1, metric="rel_l2")
    assert by_l2.metric == "rel_l2" and by_l2.r0.log_ratio == attr.r0.log_ratio
    assert [r["log_ratio_after_graft"] for r in by_l2.rows] == [
        r["log_ratio_after_graft"] for r in attr.rows
    ]


def test_reverse_scores_the_same_pair_and_json_round_trips(sd3_traj, tmp_path) -> None:
    forward = attribute_step(sd3_traj, 2)
    backward = attribute_step(sd3_traj, 2, reverse=True)
    assert backward.r0.log_ratio == forward.r0.log_ratio
    assert backward.meta["grafted_from"] == forward.meta["grafted_into"]
    back = Attribution.from_json(forward.to_json(tmp_path / "a.json"))
    assert back.r0 == forward.r0 and back.table().equals(forward.table())


def test_separate_cfg_keeps_the_negative_branch_drift_as_residual() -> None:
    # Qwen-Image's default sides are bit-identical (its engine group): drop the group.
    traj = lab.trajectory(
        "qwen_image", "tiny", steps=3, samples=1, cfg_scale=4.0, progress=False,
        rollout={"engine_ops": ()},
    )  # fmt: skip
    attr = attribute_step(traj, 1)
    assert attr.r0.log_ratio == float(_measured(traj, 1, 1).abs().mean()) > 0
    # Every positive-branch unit grafted: what is left is the negative branch's own forward.
    assert attr.residual > 0
    assert math.isclose(
        sum(r["share"] for r in attr.rows), 1.0 - attr.residual, rel_tol=0, abs_tol=1e-9
    )


def test_unguided_family_and_rel_l2_shares_agree_in_ranking() -> None:
    traj = lab.trajectory("flux", "tiny", steps=3, samples=2, progress=False)
    attr = attribute_step(traj, 1)
    assert attr.r0.log_ratio == float(_measured(traj, 1, 2).abs().mean()) > 0
    assert attr.residual == 0.0


def test_bad_steps_and_metrics_are_refused(sd3_traj) -> None:
    fam = lab.family("sd3")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0)
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    with pytest.raises(ValueError, match="metric 'log_ratio' needs step"):
        lab.attribute(model, inputs, a, b, metric="log_ratio")
    with pytest.raises(ValueError, match=r"step must be a StepScore or None, got 3 \(int\)"):
        lab.attribute(model, inputs, a, b, step=3)
    with pytest.raises(ValueError, match="outside the schedule"):
        attribute_step(sd3_traj, 9)
    for bad in ("1", 1.0, True):
        with pytest.raises(ValueError, match=rf"step must be an int, got {bad!r}"):
            attribute_step(sd3_traj, bad)  # type: ignore[arg-type]
    assert StepScore.from_trajectory(sd3_traj, np.int64(1)).step == 1
    windowed = lab.trajectory("sd3", "tiny", steps=3, samples=1, sde_window=(0, 1), progress=False)
    with pytest.raises(ValueError, match=r"outside the SDE window \[0, 1\]"):
        StepScore.from_trajectory(windowed, 2)
    bare = lab.trajectory("sd3", "tiny", steps=2, samples=1, keep_tensors=False, progress=False)
    with pytest.raises(ValueError, match="keep_tensors=True"):
        attribute_step(bare, 0)


def test_a_trajectory_read_back_from_json_says_it_holds_no_tensors(sd3_traj, tmp_path) -> None:
    back = lab.Trajectory.from_json(sd3_traj.to_json(tmp_path / "traj.json"))
    with pytest.raises(ValueError, match=r"read back with Trajectory\.from_json"):
        attribute_step(back, 1)


def test_plot_names_the_step_drift_and_shows_every_bar_whole(sd3_traj) -> None:
    from lab.views.plots import plot_attribution

    attr = attribute_step(sd3_traj, 1)
    fig = plot_attribution(attr, backend="matplotlib")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "share of the log-prob drift"
    assert "step-1 log-prob drift" in ax.get_title().replace("\n", " ")
    lo, hi = ax.get_xlim()
    shares = [r["share"] for r in attr.rows]
    # Margins beyond the longest bars on both sides (zero-width input bars pin no edge).
    assert hi > max(shares) and lo < min(0.0, min(shares))

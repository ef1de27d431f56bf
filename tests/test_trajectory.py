"""trajectory(): identical sides give ratio exactly 1; drift grows with CFG and lower eta."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.rl.trajectory import Trajectory, trajectory

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _cfg_for(family_name: str) -> float:
    """2.0 where the family has a CFG branch (exercises it), 1.0 for guidance-distilled ones."""
    return 1.0 if lab.family(family_name).cfg_layout == "none" else 2.0


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_identical_sides_give_ratio_exactly_one(family_name: str) -> None:
    fam = lab.family(family_name)
    rollout = lab.Side.rollout(fam)
    traj = trajectory(
        family_name,
        steps=2,
        samples=1,
        prompts=2,
        cfg_scale=_cfg_for(family_name),
        rollout=rollout,
        trainer=rollout,
        progress=False,
    )
    assert len(traj.steps) == 2
    for rec in traj.steps:
        assert rec.log_prob_old is not None and rec.log_prob_new is not None
        assert torch.isfinite(rec.log_prob_old).all(), "log-prob is not finite"
        assert not torch.equal(rec.x_prev, rec.x_t), "the step did not move the sample"
        assert rec.noise_pred_old.abs().max() > 0, "all-zero velocity: the check is vacuous"
        assert torch.equal(rec.log_prob_new, rec.log_prob_old)
        assert torch.equal(rec.noise_pred_new, rec.noise_pred_old)
    df = traj.per_step()
    assert (df["ratio_mean"] == 1.0).all() and (df["ratio_p01"] == 1.0).all()
    assert (df["ratio_p99"] == 1.0).all() and (df["clip_frac"] == 0.0).all()
    assert (df["log_prob_mean_abs_diff"] == 0.0).all()
    assert (traj.per_sample()["ratio"] == 1.0).all() and len(traj.per_sample()) == 4


def test_wan_switches_experts_at_its_boundary() -> None:
    traj = trajectory("wan2_2", steps=3, samples=1, progress=False, shift=1.0)
    experts = [r.expert for r in traj.steps]
    assert experts == ["high_noise", "low_noise", "low_noise"], (traj.sigmas, experts)


def test_columns_window_capture_and_json(tmp_path: Path) -> None:
    traj = trajectory(
        "sd3",
        steps=4,
        sde_window=(1, 3),
        samples=2,
        cfg_scale=2.0,
        capture_steps=(2,),
        progress=False,
    )
    df = traj.per_step()
    want = {
        "step", "sigma", "sigma_prev", "in_window", "model_output_mean_abs_diff",
        "model_output_max_abs_diff", "model_output_rel_max", "log_prob_mean_abs_diff",
        "ratio_abs_minus_1", "ratio_mean", "ratio_p01", "ratio_p50", "ratio_p99", "clip_frac",
        "model_output_mean_abs_diff_per_cfg", "predicted_log_ratio", "measured_log_ratio",
    }  # fmt: skip
    assert want <= set(df.columns)
    assert df["in_window"].tolist() == [False, True, True, False]
    assert df["ratio_mean"].isna().tolist() == [True, False, False, True]
    assert (df["model_output_rel_max"] > 0).all(), (
        "rollout and trainer should differ (fp16 vs autocast)"
    )
    assert (df.loc[df.in_window, "predicted_log_ratio"] < 0).all()
    assert list(traj.captures) == [2] and traj.captures[2].rows
    path = traj.to_json(tmp_path / "t.json")
    back = Trajectory.from_json(path)
    assert back.per_step()["ratio_p50"].tolist()[1:3] == df["ratio_p50"].tolist()[1:3]
    assert json.loads(path.read_text())["overall"]["family"] == "sd3"


def _drift(**kwargs) -> dict:
    return trajectory("sd3", steps=6, samples=4, progress=False, **kwargs).overall()


def test_drift_grows_with_cfg_scale_and_lower_noise_level() -> None:
    low, high = _drift(cfg_scale=2.0), _drift(cfg_scale=4.5)
    # The expected log-ratio is -mean(dm^2)/(2 s^2), dm ~ s_cfg (pos - neg gap): quadratic in
    # the scale. Measured on tiny sd3: x5.9 for (4.5/2)^2 = 5.06; the factor 2 either way allows
    # for the positive branch's own gap, which does not scale with s.
    growth = high["predicted_log_ratio"] / low["predicted_log_ratio"]
    assert (4.5 / 2.0) ** 2 / 2 < growth < (4.5 / 2.0) ** 2 * 2, growth
    # The measured |d log_prob| is dominated by its zero-mean term z dm / s, linear in dm, so
    # it only has to grow (tiny sd3: x1.6).
    assert high["log_prob_mean_abs_diff"] > low["log_prob_mean_abs_diff"]
    assert high["model_output_mean_abs_diff"] > 2 * low["model_output_mean_abs_diff"]
    quiet = _drift(cfg_scale=4.5, noise_level=0.3)
    # Same velocity gap, smaller noise scale s: |d log_prob| ~ 1/s, E[log ratio] ~ 1/s^2.
    assert quiet["log_prob_mean_abs_diff"] > 1.3 * high["log_prob_mean_abs_diff"]
    assert quiet["predicted_log_ratio"] < 2 * high["predicted_log_ratio"] < 0


def test_bad_inputs_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="steps must be an int >= 2"):
        trajectory("sd3", steps=1)
    with pytest.raises(ValueError, match=r"strictly decreasing, but sigmas\[1\]"):
        trajectory("sd3", steps=3, sigmas=[1.0, 0.5, 0.6, 0.0])
    with pytest.raises(ValueError, match=r"sde_window \(2, 9\) is outside the schedule"):
        trajectory("sd3", steps=4, sde_window=(2, 9))
    with pytest.raises(ValueError, match="noise_level must be > 0"):
        trajectory("sd3", steps=4, noise_level=0.0)
    with pytest.raises(ValueError, match="guidance-distilled"):
        trajectory("flux", steps=4, cfg_scale=3.5)
    with pytest.raises(ValueError, match="capture_steps"):
        trajectory("sd3", steps=4, capture_steps=(4,))


# Each papermill run starts a kernel and imports torch + diffusers (~8-12 s on 2 cores), so only
# sd3 runs by default; `pytest -m slow` runs every other family.
@pytest.mark.parametrize(
    "family_name",
    [n if n == "sd3" else pytest.param(n, marks=pytest.mark.slow) for n in FAMILY_NAMES],
)
def test_ratio_drift_notebook_runs_for_every_family(family_name: str, tmp_path: Path) -> None:
    import papermill as pm

    out_dir = tmp_path / "out"
    pm.execute_notebook(
        str(NOTEBOOKS / "02_ratio_drift.ipynb"),
        str(tmp_path / "02.ipynb"),
        parameters=dict(
            family=family_name,
            preset="tiny",
            steps=3,
            samples=1,
            prompts=2,
            cfg_scale=_cfg_for(family_name),
            out_dir=str(out_dir),
        ),
        kernel_name="python3",
        progress_bar=False,
        cwd=str(tmp_path),
    )
    data = json.loads((out_dir / "results.json").read_text())
    assert data["meta"]["family"] == family_name and len(data["per_step"]) == 3
    assert (
        data["meta"]["side_a"]["name"] == "rollout" and data["meta"]["side_b"]["name"] == "trainer"
    )
    assert math.isfinite(data["overall"]["log_prob_mean_abs_diff"])
    for png in ("ratio_drift.png", "ratio_hist.png", "logprob_vs_velocity_gap.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

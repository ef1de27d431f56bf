"""trajectory(): identical sides give ratio exactly 1; drift grows with CFG and lower eta; the
policy-level metrics (transition KL, exact log-ratio, noise floor); streamed weights."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.rl.trajectory import STEP_LOG_METRICS, Trajectory, trajectory
from lab.views.notebooks import execute_notebook

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
    for column in ("transition_kl", "chi_square", "predicted_log_ratio", "expected_log_ratio"):
        assert (df[column] == 0.0).all(), column
    assert (traj.per_sample()["ratio"] == 1.0).all() and len(traj.per_sample()) == 4
    assert "every ratio is exactly 1.0" in traj.noise_floor(1e-12).verdict


def test_wan_switches_experts_at_its_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import weakref

    fam = lab.family("wan2_2")
    build = type(fam).build
    built: list[tuple[str, weakref.ref]] = []
    alive_at_build: list[list[str]] = []

    def spy(self, *args, **kwargs):
        gc.collect()
        alive_at_build.append([e for e, ref in built if ref() is not None])
        model = build(self, *args, **kwargs)
        built.append((kwargs["expert"], weakref.ref(model)))
        return model

    monkeypatch.setattr(type(fam), "build", spy)
    traj = trajectory("wan2_2", steps=3, samples=1, progress=False, shift=1.0)
    experts = [r.expert for r in traj.steps]
    assert experts == ["high_noise", "low_noise", "low_noise"], (traj.sigmas, experts)
    # Each expert is built when the schedule reaches it, after the previous one was dropped:
    # one master at a time (Wan2.2-A14B full: 57 GB each).
    assert [e for e, _ in built] == ["high_noise", "low_noise"]
    assert alive_at_build == [[], []]


@pytest.mark.parametrize(
    ("family_name", "kwargs"),
    [
        ("sd3", dict(cfg_scale=2.0)),  # CFG batched: the pair's forward holds both branches
        ("qwen_image", dict(cfg_scale=2.0)),  # separate CFG: the negatives still run apart
        ("wan2_2", dict(cfg_scale=2.0)),  # both experts, each captured
        ("flux", dict(stream=True)),  # streamed: the pair runs in lockstep
    ],
)
def test_captured_steps_reuse_the_pairs_forwards_bit_for_bit(
    family_name: str, kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lab.rl import trajectory as trajectory_module

    plain = trajectory(family_name, steps=3, samples=2, progress=False, **kwargs)
    calls: list[str] = []
    real = trajectory_module.forward_side
    monkeypatch.setattr(
        trajectory_module,
        "forward_side",
        lambda *args, **kw: calls.append(args[2].name) or real(*args, **kw),
    )
    captured = trajectory(
        family_name, steps=3, samples=2, capture_steps=(0, 1, 2), progress=False, **kwargs
    )
    assert sorted(captured.captures) == [0, 1, 2]
    assert all(c.rows for c in captured.captures.values())
    for a, b in zip(plain.steps, captured.steps, strict=True):
        for name in ("noise_pred_old", "noise_pred_new", "x_prev", "log_prob_old", "log_prob_new"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or torch.equal(x, y), (a.step, name)
    # Each step's positive forwards came from its pair: plain forwards ran only for the
    # negative branch of a separate CFG layout.
    separate = lab.family(family_name).cfg_layout == "separate" and "cfg_scale" in kwargs
    assert len(calls) == (3 * 2 if separate else 0), calls
    # The pair compared the very forwards the step used: its root row is the step's velocity
    # difference when CFG does not mix the branches in.
    if "cfg_scale" not in kwargs:
        root = captured.captures[1].root_rows()[0].metrics
        step = captured.steps[1]
        diff = (step.noise_pred_old.double() - step.noise_pred_new.double()).abs()
        assert root.max_abs_diff == diff.max().item() > 0
        assert root.mean_abs_diff == pytest.approx(diff.mean().item(), rel=1e-9)


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
        "expected_log_ratio", "log_ratio_sd", "transition_kl", "transition_kl_max", "chi_square",
        "chi_square_max",
    }  # fmt: skip
    assert want <= set(df.columns)
    assert df["in_window"].tolist() == [False, True, True, False]
    assert df["ratio_mean"].isna().tolist() == [True, False, False, True]
    assert (df["model_output_rel_max"] > 0).all(), (
        "rollout and trainer should differ (fp16 vs autocast)"
    )
    assert (df.loc[df.in_window, "expected_log_ratio"] < 0).all()
    assert (df.loc[df.in_window, "transition_kl"] > 0).all()
    assert list(traj.captures) == [2] and traj.captures[2].rows
    path = traj.to_json(tmp_path / "t.json")
    back = Trajectory.from_json(path)
    assert back.per_step()["ratio_p50"].tolist()[1:3] == df["ratio_p50"].tolist()[1:3]
    assert back.per_step()["transition_kl"].tolist()[1:3] == df["transition_kl"].tolist()[1:3]
    assert back.noise_floor().verdict == traj.noise_floor().verdict
    # A file saved before the linear term existed: its predicted_log_ratio was the
    # noise-averaged part alone, which reads back as expected_log_ratio.
    old = json.loads(path.read_text())
    for row in old["per_step"] + old["per_sample"]:
        for key in ("expected_log_ratio", "log_ratio_sd", "transition_kl", "chi_square"):
            row.pop(key, None)
        row["predicted_log_ratio"] = -1.5
    (tmp_path / "old.json").write_text(json.dumps(old))
    legacy = Trajectory.from_json(tmp_path / "old.json").per_step()
    assert legacy["expected_log_ratio"].tolist()[1:3] == [-1.5, -1.5]
    assert legacy["predicted_log_ratio"].isna().all()
    assert json.loads(path.read_text())["overall"]["family"] == "sd3"


def _drift(**kwargs) -> dict:
    return trajectory("sd3", steps=6, samples=4, progress=False, **kwargs).overall()


def test_drift_grows_with_cfg_scale_and_lower_noise_level() -> None:
    low, high = _drift(cfg_scale=2.0), _drift(cfg_scale=4.5)
    # The expected log-ratio is -mean(dm^2)/(2 s^2), dm ~ s_cfg (pos - neg gap): quadratic in
    # the scale. Measured on tiny sd3: x5.9 for (4.5/2)^2 = 5.06; the factor 2 either way allows
    # for the positive branch's own gap, which does not scale with s.
    growth = high["expected_log_ratio"] / low["expected_log_ratio"]
    assert (4.5 / 2.0) ** 2 / 2 < growth < (4.5 / 2.0) ** 2 * 2, growth
    # The measured |d log_prob| is dominated by its zero-mean term z dm / s, linear in dm, so
    # it only has to grow (tiny sd3: x1.6).
    assert high["log_prob_mean_abs_diff"] > low["log_prob_mean_abs_diff"]
    assert high["model_output_mean_abs_diff"] > 2 * low["model_output_mean_abs_diff"]
    quiet = _drift(cfg_scale=4.5, noise_level=0.3)
    # Same velocity gap, smaller noise scale s: |d log_prob| ~ 1/s, E[log ratio] ~ 1/s^2.
    assert quiet["log_prob_mean_abs_diff"] > 1.3 * high["log_prob_mean_abs_diff"]
    assert quiet["expected_log_ratio"] < 2 * high["expected_log_ratio"] < 0


def test_bad_inputs_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="steps must be an int >= 2"):
        trajectory("sd3", steps=1)
    with pytest.raises(ValueError, match=r"strictly decreasing, but sigmas\[1\]"):
        trajectory("sd3", steps=3, sigmas=[1.0, 0.5, 0.6, 0.0])
    with pytest.raises(ValueError, match=r"sde_window \(2, 9\) is outside the schedule"):
        trajectory("sd3", steps=4, sde_window=(2, 9))
    for level in (0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="noise_level must be a finite number > 0"):
            trajectory("sd3", steps=4, noise_level=level)
    with pytest.raises(
        ValueError, match=r"cfg_scale must be a finite number >= 1 \(1 = no guidance\), got inf"
    ):
        trajectory("sd3", steps=4, cfg_scale=float("inf"))
    # A window of fractions was truncated ((0.5, 2.9) ran as [0, 2]); "02" read as (0, 2).
    for window in ((0.5, 2.9), "02", "[0, 2]", 2, (2, None), (True, 3)):
        with pytest.raises(ValueError, match=r"sde_window(\[\d\])? must be (an int|a tuple)"):
            trajectory("sd3", steps=4, sde_window=window)
    with pytest.raises(ValueError, match="guidance-distilled"):
        trajectory("flux", steps=4, cfg_scale=3.5)
    with pytest.raises(ValueError, match="capture_steps"):
        trajectory("sd3", steps=4, capture_steps=(4,))
    # Each of these ran to the end before (a clip range of 0 or below counted every ratio
    # clipped), or failed deep inside with another library's error.
    for clip in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"clip_range must be a finite number > 0"):
            trajectory("sd3", steps=4, clip_range=clip)
    with pytest.raises(ValueError, match=r"shift must be a finite number > 0, got -1"):
        trajectory("sd3", steps=4, shift=-1.0)
    with pytest.raises(ValueError, match=r"cfg_scale must be a number, got '4.5'"):
        trajectory("sd3", steps=4, cfg_scale="4.5")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda' asked for, but .* no CUDA GPU"):
            trajectory("sd3", steps=4, device="cuda")


def test_a_step_that_goes_non_finite_is_refused_keeping_the_steps_before() -> None:
    """noise_level=10 blew sd3's latents up at step 2; it read as a trajectory of NaN ratios."""
    with pytest.raises(lab.errors.TrajectoryError) as caught:
        trajectory("sd3", steps=3, noise_level=10.0, progress=False)
    err = caught.value
    assert err.step == 2 and err.trajectory.meta["completed_steps"] == 2
    assert "step 2 holds NaN/Inf: rollout velocity 2048, trainer velocity 2048" in str(err)
    assert "noise_level 10 and cfg_scale 1 scale the step" in str(err) and ".." not in str(err)
    kept = err.trajectory.per_step()
    assert len(kept) == 2 and kept["log_prob_mean_abs_diff"].notna().all()
    # numpy ints are whole step indices too.
    import numpy as np

    ok = trajectory("sd3", steps=3, sde_window=(np.int64(0), 2), samples=1, progress=False)
    assert ok.meta["sde_window"] == [0, 2]


def _failing_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Make the trajectory's `call`-th guided velocity (0-based; two a step) raise."""
    from lab.rl import trajectory as module

    real, calls = module._guided_velocity, []

    def guided(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == call + 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_guided_velocity", guided)


def test_a_failed_step_keeps_the_steps_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing lost on a fault: step 2 of 4 runs out of memory, steps 0-1 come back, the same
    numbers as the whole trajectory's, and save as a trajectory JSON."""
    import weakref

    from lab.families import Family

    kwargs = dict(steps=4, samples=2, progress=False, capture_steps=(1, 2))
    whole = trajectory("sd3", **kwargs)
    built, build = [], Family.build

    def tracked(self: Family, *args: object, **kw: object) -> torch.nn.Module:
        model = build(self, *args, **kw)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(Family, "build", tracked)
    _failing_at(monkeypatch, 5)  # step 2's trainer velocity, after step 2's captured pair
    with pytest.raises(lab.errors.TrajectoryError) as info:
        trajectory("sd3", **kwargs)
    err = info.value
    gc.collect()
    assert built and built[0]() is None, "the error (kept by a notebook) holds the model"
    assert isinstance(err, lab.errors.PairError) and err.step == 2 and err.result is None
    assert isinstance(err.__cause__, torch.cuda.OutOfMemoryError)
    assert str(err).startswith(
        "trajectory('sd3'): step 2 of 4 (sigma "
    ) and "OutOfMemoryError: CUDA out of memory (injected). The 2 step(s) before it" in str(err)
    done = err.trajectory
    assert done.meta["completed_steps"] == 2 and done.meta["failed"] == {
        "step": 2,
        "error": "OutOfMemoryError: CUDA out of memory (injected)",
    }
    assert done.step_drifts == whole.step_drifts[:2]
    assert done.sample_drifts == [s for s in whole.sample_drifts if s.step < 2]
    # Step 2's pair ran, but step 2 did not complete: only completed steps' captures are kept.
    assert list(done.captures) == [1] and done.captures[1].rows == whole.captures[1].rows
    back = Trajectory.from_json(done.to_json(tmp_path / "partial.json"))
    assert back.meta["failed"]["step"] == 2 and len(back.step_drifts) == 2
    assert done.describe().endswith(
        "FAILED at step 2: OutOfMemoryError: CUDA out of memory (injected); the figures above "
        "are the 2 step(s) before it"
    )
    assert "FAILED" not in whole.describe()
    # Before any step completed (step 0's captured pair ran): the error itself.
    _failing_at(monkeypatch, 0)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="injected"):
        trajectory("sd3", **{**kwargs, "capture_steps": (0,)})


def test_no_cyclic_collection_runs_inside_a_captured_trajectory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collector is off for the whole call (captures pile up rows), and back on after."""
    collections: list[int] = []
    at_pairs: list[int] = []
    real_pair = lab.rl.trajectory.pair

    def counted_pair(*args, **kwargs):
        at_pairs.append(len(collections))
        out = real_pair(*args, **kwargs)
        at_pairs.append(len(collections))
        return out

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    monkeypatch.setattr(lab.rl.trajectory, "pair", counted_pair)
    thresholds = gc.get_threshold()
    gc.callbacks.append(seen)
    # A young collection every 10 allocations: with the collector on between the steps, a
    # 3-step trajectory capturing each step runs hundreds (each step's Result: ~150 rows).
    gc.set_threshold(10, 2, 2)
    try:
        assert gc.isenabled()
        traj = trajectory("sd3", steps=3, samples=1, capture_steps=(0, 1, 2), progress=False)
        assert gc.isenabled(), "the collector must be on again after the call"
        with pytest.raises(ValueError, match="capture_steps"):
            trajectory("sd3", steps=3, capture_steps=(3,))
        assert gc.isenabled(), "the collector must be on again after a refusal"
        gc.disable()
        trajectory("sd3", steps=2, samples=1, progress=False)
        assert not gc.isenabled(), "a caller's own gc.disable() must survive the call"
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(seen)
    assert len(at_pairs) == 6, "three captured steps, one pair each"
    assert len(traj.captures[0].rows) > 100
    between = collections[at_pairs[0] : at_pairs[-1]]
    assert between == [], f"{len(between)} collections ran between the first and last pair"


# ---- policy-level metrics (issue 15): sd3 tiny at CFG 4.5, the setting ---------------


@pytest.fixture(scope="module")
def sd3_cfg45() -> Trajectory:
    return trajectory("sd3", steps=10, cfg_scale=4.5, samples=4, progress=False)


def _ulp_fp32(value: torch.Tensor) -> torch.Tensor:
    """The fp32 spacing at |value| (value a float64 tensor of normal fp32 magnitudes)."""
    return torch.finfo(torch.float32).eps * 2.0 ** torch.floor(torch.log2(value.abs()))


def test_transition_kl_and_chi_square_match_a_float64_closed_form(sd3_cfg45: Trajectory) -> None:
    traj, eta = sd3_cfg45, sd3_cfg45.meta["noise_level"]
    per_sample = traj.per_sample()
    per_step = traj.per_step().set_index("step")
    sigma_max = traj.sigmas[1]
    for rec in traj.steps:
        sigma, prev = rec.sigma, rec.sigma_prev
        # Flow-SDE, written out again: std from the schedule, s = std sqrt(sigma - sigma_prev),
        # mean_new - mean_old = (v_new - v_old) (1 + std^2 (1 - sigma) / (2 sigma)) dt.
        std = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * eta
        assert rec.std_dev_t == pytest.approx(std, rel=1e-6)
        std = rec.std_dev_t  # the fp32 value both log-probs used
        scale = std * math.sqrt(sigma - prev)
        factor = (1 + std**2 * (1 - sigma) / (2 * sigma)) * (prev - sigma)
        dm = (rec.noise_pred_new.double() - rec.noise_pred_old.double()) * factor
        kl = (dm**2).sum(dim=1) / (2 * scale**2)
        chi2 = torch.expm1((dm**2).sum(dim=1) / scale**2)
        rows = per_sample[per_sample["step"] == rec.step]
        got_kl = torch.tensor(rows["transition_kl"].to_numpy())
        got_chi2 = torch.tensor(rows["chi_square"].to_numpy())
        assert (kl > 0).all(), "rollout and trainer should differ (fp16 vs autocast)"
        torch.testing.assert_close(got_kl, kl, rtol=1e-12, atol=0)
        torch.testing.assert_close(got_chi2, chi2, rtol=1e-12, atol=0)
        row = per_step.loc[rec.step]
        assert row["transition_kl"] == pytest.approx(float(kl.mean()), rel=1e-12)
        assert row["transition_kl_max"] == pytest.approx(float(kl.max()), rel=1e-12)
        assert row["chi_square_max"] == pytest.approx(float(chi2.max()), rel=1e-12)
        # "sde": the noise-averaged log-ratio is exactly -KL / N.
        n = rec.x_t.shape[1]
        expected = torch.tensor(rows["expected_log_ratio"].to_numpy())
        torch.testing.assert_close(expected, -kl / n, rtol=1e-12, atol=0)
    # The KL grows towards the data end of the schedule (s shrinks faster than the gap).
    kls = per_step["transition_kl"].to_numpy()
    assert kls[-1] > 100 * kls[0]


def test_predicted_log_ratio_matches_the_measured_one_per_sample(sd3_cfg45: Trajectory) -> None:
    traj = sd3_cfg45
    per_sample = traj.per_sample()
    far = 0
    for rec in traj.steps:
        measured = (rec.log_prob_new - rec.log_prob_old).double()
        rows = per_sample[per_sample["step"] == rec.step]
        pred = torch.tensor(rows["predicted_log_ratio"].to_numpy())
        expected = torch.tensor(rows["expected_log_ratio"].to_numpy())
        assert (measured != 0).sum() >= 3, "no drift to predict: the check would be vacuous"
        # The prediction is exact in float64; what is left is the fp32 rounding of each
        # log-prob: of its mean of N Gaussian terms, and of the fp32 transition mean, which
        # 1 / s amplifies at the last step (s = 6e-3). Measured: 0.9-2.3 ulp of max
        # |log_prob_old| at steps 0-8, 2-4 ulp at step 9 (16 samples).
        bound = 4 * _ulp_fp32(rec.log_prob_old.double().abs().max()) + 1e-3 * measured.abs()
        assert ((pred - measured).abs() <= bound).all(), (rec.step, pred, measured)
        # The noise-averaged part alone is what was once called the prediction: it misses
        # the zero-mean linear term and sits far below at most steps.
        big = measured.abs() > 1e-6
        far += int((expected[big].abs() < 0.2 * measured[big].abs()).sum())
    assert far >= 10, f"only {far} sample-steps where the linear term dominates"
    df = traj.per_step()
    gap = (df["predicted_log_ratio"] - df["measured_log_ratio"]).abs()
    assert (gap <= 1e-6 + 1e-3 * df["measured_log_ratio"].abs()).all()


def test_cps_last_step_has_no_kl_and_says_why() -> None:
    traj = trajectory("sd3", steps=3, cfg_scale=2.0, samples=2, sde_type="cps", progress=False)
    df = traj.per_step()
    assert df["transition_kl"].iloc[:-1].gt(0).all()
    assert math.isnan(df["transition_kl"].iloc[-1]) and math.isnan(df["chi_square"].iloc[-1])
    assert traj.meta["metric_notes"] and traj.meta["metric_notes"][0].startswith("step 2:")
    assert "noise scale 0" in traj.describe()
    for rec in traj.steps:
        measured = (rec.log_prob_new - rec.log_prob_old).double()
        rows = traj.per_sample()[traj.per_sample()["step"] == rec.step]
        pred = torch.tensor(rows["predicted_log_ratio"].to_numpy())
        bound = 4 * _ulp_fp32(rec.log_prob_old.double().abs().max()) + 1e-3 * measured.abs()
        assert ((pred - measured).abs() <= bound).all(), (rec.step, pred, measured)


def test_metrics_by_step_are_flat_per_timestep_keys(sd3_cfg45: Trajectory) -> None:
    logged = sd3_cfg45.metrics_by_step(prefix="rollout_parity")
    assert len(logged) == 10 * len(STEP_LOG_METRICS)
    row = sd3_cfg45.per_step().iloc[3]
    assert logged["rollout_parity/step_3/transition_kl"] == row["transition_kl"]
    assert logged["rollout_parity/step_3/clip_frac"] == row["clip_frac"]


def _independent_floor(traj: Trajectory, clip: float) -> dict[int, tuple[int, float, float]]:
    """Step -> (clipped count, p50 |log ratio|, p99 |log ratio|) from the recorded log-probs."""
    import numpy as np

    out = {}
    for rec in traj.steps:
        lr = (rec.log_prob_new - rec.log_prob_old).double().numpy()
        clipped = int((np.abs(np.exp(lr) - 1) > clip).sum())
        out[rec.step] = (clipped, *np.percentile(np.abs(lr), [50, 99]).tolist())
    return out


def test_noise_floor_verdict_on_sd3_tiny_at_cfg_4_5(sd3_cfg45: Trajectory) -> None:
    traj = sd3_cfg45
    worst = max(
        float(((r.log_prob_new - r.log_prob_old).double().exp() - 1).abs().max())
        for r in traj.steps
    )
    assert worst > 0, "identical log-probs: the floor would be vacuous"
    for clip in (1e-4, worst / 3, worst * 2):
        floor = traj.noise_floor(clip)
        want = _independent_floor(traj, clip)
        table = floor.table().set_index("step")
        assert table.index.tolist() == sorted(want)
        for step, (clipped, p50, p99) in want.items():
            assert table.loc[step, "clipped"] == clipped
            assert table.loc[step, "clip_frac"] == clipped / 4
            assert table.loc[step, "log_ratio_abs_p50"] == pytest.approx(p50, rel=1e-12)
            assert table.loc[step, "log_ratio_abs_p99"] == pytest.approx(p99, rel=1e-12)
        below = [s for s, (c, _, _) in want.items() if c]
        assert floor.below_steps == below
        if below:
            cut = sum(want[s][0] for s in below)
            pct = 100 * cut / (4 * len(below))
            assert " is below the numeric noise floor at " in floor.verdict
            assert f"({cut} of {4 * len(below)} there;" in floor.verdict
            assert (f"{pct:.0f} %" if pct >= 1 else f"{pct:.2g} %") in floor.verdict
        else:
            assert "above the numeric noise floor at every step" in floor.verdict
            assert f"{clip / worst:.3g}x below it" in floor.verdict
    # Below the floor at the default clip range somewhere, at every step for a tiny one.
    assert traj.noise_floor(worst / 3).below_steps
    assert traj.noise_floor(1e-9).below_steps == list(range(10))
    assert "steps 0-9" in traj.noise_floor(1e-9).verdict
    assert str(traj.noise_floor()) == traj.noise_floor(traj.meta["clip_range"]).verdict
    assert traj.noise_floor(1e-4).verdict.startswith("clip_range 1e-4 is ")
    assert traj.noise_floor(2.5e-5).verdict.startswith("clip_range 2.5e-5 is ")
    with pytest.raises(ValueError, match=r"clip_range must be a finite number > 0.*got -0\.1"):
        traj.noise_floor(-0.1)


def test_noise_floor_plot_in_both_backends(sd3_cfg45: Trajectory) -> None:
    import matplotlib.pyplot as plt

    floor = sd3_cfg45.noise_floor(1e-5)
    fig = lab.plots.plot_noise_floor(sd3_cfg45, 1e-5)
    bars, p50, p99, top = fig.data
    assert p50.name.startswith("p50") and top.name.startswith("max")
    assert list(bars.y) == pytest.approx((100 * floor.table()["clip_frac"]).tolist())
    assert list(p99.y) == floor.table()["log_ratio_abs_p99"].tolist()
    assert floor.verdict in fig.layout.title.text
    assert [s.y0 for s in fig.layout.shapes] == [1e-5]
    colors = list(bars.marker.color)
    assert [c == "#d62728" for c in colors] == [s in floor.below_steps for s in bars.x]
    assert lab.plots.figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    mpl = lab.plots.plot_noise_floor(floor, backend="matplotlib")
    assert mpl.axes[0].get_yscale() == "log"
    assert floor.verdict[:40] in mpl._suptitle.get_text()
    plt.close(mpl)
    with pytest.raises(ValueError, match="this NoiseFloor was made for 1e-05"):
        lab.plots.plot_noise_floor(floor, 1e-4)


# ---- streamed weights (issue 16) -----------------------------------------------------------


def _assert_same_trajectory(a: Trajectory, b: Trajectory) -> None:
    assert a.per_step().equals(b.per_step())
    assert a.per_sample().equals(b.per_sample())
    for ra, rb in zip(a.steps, b.steps, strict=True):
        for name in ("x_prev", "noise_pred_old", "noise_pred_new", "log_prob_old", "log_prob_new"):
            assert torch.equal(getattr(ra, name), getattr(rb, name)), (ra.step, name)


@pytest.mark.parametrize(
    ("family_name", "kwargs"),
    [
        ("flux", dict(steps=3, capture_steps=(1,))),
        # Both experts: high_noise at step 0, low_noise after the boundary. Wan's default
        # sides agree bit for bit, so the rollout runs without its engine group `wan`.
        ("wan2_2", dict(steps=3, shift=1.0, cfg_scale=2.0, rollout={"engine_ops": ()})),
    ],
)
def test_streamed_trajectory_is_bit_identical(
    family_name: str, kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lab.rl.trajectory as module

    streamed_blocks: list[int] = []

    class CountingView(module.WeightView):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            streamed_blocks.append(len(self.streamed_ids))

    monkeypatch.setattr(module, "WeightView", CountingView)
    plain = trajectory(family_name, samples=2, progress=False, stream=False, **kwargs)
    assert streamed_blocks and not any(streamed_blocks)
    streamed_blocks.clear()
    streamed = trajectory(family_name, samples=2, progress=False, stream=True, **kwargs)
    # One view per side and expert, each casting its blocks one at a time.
    experts = 2 if family_name == "wan2_2" else 1
    assert len(streamed_blocks) == 2 * experts and min(streamed_blocks) >= 2, streamed_blocks
    assert plain.meta["stream"] is False and streamed.meta["stream"] is True
    assert (plain.per_step()["transition_kl"] > 0).all(), "the sides agree: vacuous check"
    _assert_same_trajectory(plain, streamed)
    if family_name == "wan2_2":
        assert [r.expert for r in streamed.steps] == ["high_noise", "low_noise", "low_noise"]
    for step, result in plain.captures.items():
        assert streamed.captures[step].meta["stream"] is True
        key = ["module", "call", "output"]
        t1 = result.table().set_index(key).sort_index()
        t2 = streamed.captures[step].table().set_index(key).sort_index()
        assert t1["max_ulp"].equals(t2["max_ulp"]) and len(t1)


def _cuda_peak_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _cuda_reset() -> None:
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family_name", "kwargs"),
    [
        ("qwen_image", dict(steps=3, cfg_scale=4.5)),
        # sigma 1.0 -> high_noise, 0.5 -> low_noise (boundary 0.875): both experts.
        ("wan2_2", dict(steps=2, cfg_scale=4.5, sigmas=[1.0, 0.5, 0.0])),
    ],
)
def test_streamed_reduced_trajectory_on_cuda(family_name: str, kwargs: dict) -> None:
    runs, peaks = {}, {}
    for stream in (False, True):
        _cuda_reset()
        runs[stream] = trajectory(
            family_name, "reduced", samples=1, device="cuda", capture_steps=(1,),
            stream=stream, progress=False, **kwargs,
        )  # fmt: skip
        peaks[stream] = _cuda_peak_gib()
    print(f"\n{family_name} reduced peak GiB: plain {peaks[False]:.2f}, streamed {peaks[True]:.2f}")
    _assert_same_trajectory(runs[False], runs[True])
    streamed = runs[True]
    assert streamed.meta["stream"] is True and streamed.captures[1].meta["stream"] is True
    assert all(torch.isfinite(r.log_prob_old).all() for r in streamed.steps)
    if family_name == "wan2_2":
        assert [r.expert for r in streamed.steps] == ["high_noise", "low_noise"]
    # Streaming holds one block's casts, not the whole model's.
    assert peaks[True] < peaks[False]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(
    ("family_name", "kwargs"),
    [
        # Out of memory before streaming: the fp32 master (82 GB) plus a bf16 copy per side.
        ("qwen_image", dict(steps=2, cfg_scale=4.5)),
        ("wan2_2", dict(steps=2, cfg_scale=4.5, sigmas=[1.0, 0.5, 0.0])),
    ],
)
def test_full_size_trajectory_streams_on_one_h200(family_name: str, kwargs: dict) -> None:
    import time

    _cuda_reset()
    start = time.perf_counter()
    traj = trajectory(family_name, "full", samples=1, device="cuda", progress=False, **kwargs)
    seconds, peak = time.perf_counter() - start, _cuda_peak_gib()
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(
        f"\n{family_name} full trajectory: {seconds:.1f} s (builds included), peak {peak:.1f} of "
        f"{total:.1f} GiB\n{traj.describe()}"
    )
    assert traj.meta["stream"] is True
    assert all(torch.isfinite(r.log_prob_new).all() for r in traj.steps)
    assert traj.per_step()["transition_kl"].notna().all()
    if family_name == "wan2_2":
        assert [r.expert for r in traj.steps] == ["high_noise", "low_noise"]
    assert peak < 0.95 * total


# Each papermill run starts a kernel and imports torch + diffusers (~8-12 s on 2 cores), so only
# sd3 runs by default; `pytest -m slow` runs every other family.
@pytest.mark.parametrize(
    "family_name",
    # Notebook 02 with its defaults runs in test_notebooks.py; every family here, under slow.
    [pytest.param(n, marks=pytest.mark.slow) for n in FAMILY_NAMES],
)
def test_ratio_drift_notebook_runs_for_every_family(family_name: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    execute_notebook(
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


def test_a_result_and_a_trajectory_each_name_the_reader_of_the_other(tmp_path: Path) -> None:
    result = lab.pair_family("flux").to_json(tmp_path / "pair.json")
    traj = trajectory("flux", steps=2, progress=False).to_json(tmp_path / "traj.json")
    with pytest.raises(ValueError, match=r"it is a paired forward's Result; read it with lab"):
        Trajectory.from_json(result)
    with pytest.raises(ValueError, match=r"ratio-drift trajectory .* lab.Trajectory.from_json"):
        lab.Result.from_json(traj)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"not valid JSON"):
        Trajectory.from_json(tmp_path / "bad.json")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_keeps_the_steps_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: str
) -> None:
    """Issue 42: a Ctrl-C (or a SIGTERM raised as `Terminated`) in step 2 of 4 lost the steps
    before it (only `Exception` was kept); now they come back on the interruption."""
    import _thread
    import signal

    from lab.base.processes import sigterm_raises
    from lab.families import Family
    from lab.rl.trajectory import TrajectoryInterrupted

    kwargs = dict(steps=4, samples=2, progress=False)
    whole = trajectory("sd3", **kwargs)
    build, forwards = Family.build, [0]

    def interrupting(self: Family, *args: object, **kw: object) -> torch.nn.Module:
        model = build(self, *args, **kw)

        def hook(module: torch.nn.Module, inputs: object, output: object) -> None:
            forwards[0] += 1
            if forwards[0] == 5:  # step 2's rollout forward (two forwards a step, no CFG)
                _thread.interrupt_main(getattr(signal, sig))

        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(Family, "build", interrupting)
    with sigterm_raises(), pytest.raises(TrajectoryInterrupted) as info:
        trajectory("sd3", **kwargs)
    err = info.value
    assert isinstance(err, KeyboardInterrupt) and err.signal_name == sig
    assert err.exit_code == {"SIGINT": 130, "SIGTERM": 143}[sig]
    done = err.trajectory
    assert done.meta["completed_steps"] == 2
    assert done.meta["interrupted"] == {"step": 2, "signal": sig}
    assert done.step_drifts == whole.step_drifts[:2]
    assert done.sample_drifts == [s for s in whole.sample_drifts if s.step < 2]
    assert str(err).startswith(f"trajectory('sd3'): stopped by {sig} in step 2 of 4;")
    assert done.describe().endswith(
        f"STOPPED by {sig} in step 2; the figures above are the 2 step(s) before it"
    )
    back = Trajectory.from_json(done.to_json(tmp_path / "partial.json"))
    assert back.meta["interrupted"]["step"] == 2 and len(back.step_drifts) == 2

"""Setting attribution: knobs between two sides, exact and sampled Shapley shares."""

from __future__ import annotations

import math

import pytest
import torch

import lab
from lab.causes.settings import (
    attribute_settings,
    forward_signature,
    knobs_between,
    shapley,
    side_with,
)
from lab.engine import scenarios
from lab.families import FAMILY_NAMES


def _model_inputs(family_name: str) -> tuple:
    fam = lab.family(family_name)
    return fam, fam.build("tiny", 0), fam.make_inputs("tiny", 0)


def test_knobs_split_dicts_and_tuples_and_group_dependent_fields() -> None:
    fam = lab.family("wan2_2")
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    names = {k.name: k for k in knobs_between(a, b)}
    assert "param_dtype_rules['*.norm2.*']" in names
    assert names["param_dtype_rules['*.norm2.*']"].value_b == "fp32"
    assert {"keep_fp32_modules['norm1']", "keep_fp32_modules['rope']"} <= set(names)
    assert (
        names["engine_ops['wan']"].value_a is True and names["engine_ops['wan']"].value_b is False
    )
    assert names["input_dtype_policy['cond']"].value_b is None
    autocast = names["autocast"]
    assert autocast.grouped == ("autocast_dtype", "autocast_policy")
    assert "mean nothing without autocast" in autocast.why_grouped
    # Every knob taken: side A becomes side B (bar the name).
    every = side_with(a, b, list(names.values()))
    assert {**every.to_dict(), "name": "x"} == {**b.to_dict(), "name": "x"}
    assert side_with(a, b, []).to_dict() == {**a.to_dict(), "name": b.name}


def test_forward_dtype_and_rollout_precision_are_one_knob() -> None:
    fam = lab.family("flux")
    a = lab.Side.rollout(fam)
    b = a.replace(name="fp16", forward_dtype="fp16", rollout_precision="fp16")
    (knob,) = knobs_between(a, b)
    assert knob.name == "forward_dtype" and knob.grouped == ("rollout_precision",)
    assert knob.value_a == ("bf16", "bf16") and knob.value_b == ("fp16", "fp16")


def test_sides_on_two_devices_are_refused() -> None:
    fam = lab.family("flux")
    with pytest.raises(ValueError, match=r"different devices \('cpu' vs 'cuda'\)"):
        knobs_between(lab.Side.rollout(fam), lab.Side.trainer(fam, device="cuda"))


def test_shapley_of_a_known_game_is_exact_and_efficient() -> None:
    # v(S) = 3 [0 in S] + 2 [1 in S] + 4 [0 and 1 in S]: the pair's 4 is split evenly.
    def v(members: frozenset[int]) -> float:
        return 3 * (0 in members) + 2 * (1 in members) + 4 * ({0, 1} <= members)

    values, errors, exact = shapley(3, v, max_exact=10, samples=0, seed=0)
    assert exact and values == [5.0, 4.0, 0.0] and errors == [0.0] * 3
    sampled, errs, exact = shapley(3, v, max_exact=2, samples=200, seed=1)
    assert not exact
    assert math.isclose(sum(sampled), 9.0, rel_tol=0, abs_tol=1e-12)  # every order sums exactly
    assert all(abs(s - t) < 4 * max(e, 1e-9) for s, t, e in zip(sampled, values, errs, strict=True))


def test_flux_default_pair_is_the_timestep_and_autocast_and_shares_sum_to_the_whole() -> None:
    fam, model, inputs = _model_inputs("flux")
    a, b = lab.Side.rollout(fam), lab.Side.trainer(fam)
    att = attribute_settings(model, inputs, a, b)
    # The engine hands its DiT the scheduler's fp32 t (the pipeline rounds it to bf16 first):
    # most of the tiny pair's divergence; the rest is the trainer's autocast.
    assert att.exact and att.top().name == "op_switches['timestep_from']"
    table = att.table().set_index("knob")
    assert table.loc["op_switches['timestep_from']", "share_pct"] == pytest.approx(98.0, abs=1)
    assert table.loc["autocast", "share_pct"] == pytest.approx(2.0, abs=1)
    for idle in ("cast_buffers", "engine_ops['flux_native']"):
        assert table.loc[idle, "share"] == 0.0, idle
    # Values as a user reads them: autocast on/off, an unset switch as its stock value.
    assert table.loc["autocast", ["value_a", "value_b"]].tolist() == ["off", "on"]
    timestep = table.loc["op_switches['timestep_from']", ["value_a", "value_b"]].tolist()
    assert timestep == ["scheduler", "pipeline (stock)"]
    on_cuda = lab.Side.trainer(fam).replace(autocast_policy="cuda")
    (knob,) = [k for k in knobs_between(a, on_cuda) if k.name == "autocast"]
    assert knob.label() == "autocast: off -> on (cuda op lists)"
    # The whole: the rel_l2 of the two model outputs, measured directly.
    out_a = lab.forward_side(model, inputs, a)[0].double()
    out_b = lab.forward_side(model, inputs, b)[0].double()
    whole = float((out_b - out_a).norm() / out_a.norm())
    assert att.total == pytest.approx(whole, rel=1e-12)
    assert math.fsum(att.shares) == pytest.approx(att.total, rel=1e-12, abs=0)
    # Knobs the forward never reads share one forward: 6 knobs, 3 read, 8 forwards.
    assert len(att.knobs) == 6 and att.forwards == 8
    text = att.describe()
    assert "op_switches['timestep_from'] explains 98 %; autocast explains 2 %" in text
    assert "the other 4 knob(s) change nothing" in text


def test_cancelling_knobs_are_described_when_the_total_is_zero() -> None:
    fam, model, inputs = _model_inputs("wan2_2")
    # Wan's aligned pair: the engine at a production width (its fused norm kernels; at the tiny
    # width it runs torch norms that round more) against a trainer taking its root sum.
    fused = {"wan_norm_path": "fused"}
    rollout, trainer = lab.Side.rollout(fam, op_switches=fused), lab.Side.trainer(fam)
    att = attribute_settings(model, inputs, rollout, trainer.replace(op_switches=fused))
    assert att.total == 0.0
    assert any(al != 0 for al in att.alone), "wan2_2 tiny's knobs no longer move it alone"
    assert math.fsum(att.shares) == pytest.approx(0.0, abs=1e-15)
    assert "the sides agree bit for bit, but not knob by knob" in att.describe()
    # Text passed through fp32 needs autocast: the two only run together, and say why.
    merged = next(k for k in att.knobs if k.parts)
    assert {p.name for p in merged.atoms()} == {"autocast", "input_dtype_policy['cond']"}
    assert "does not run" in merged.why_grouped


def test_signature_ignores_what_the_forward_never_reads() -> None:
    fam, model, _ = _model_inputs("flux")
    a = lab.Side.rollout(fam)
    assert forward_signature(model, a) == forward_signature(
        model, a.replace(name="other", fsdp_wrap_classes=fam.block_classes)
    )
    assert forward_signature(model, a) != forward_signature(model, a.replace(autocast=True))


def test_step_metrics_score_the_log_ratio_and_refuse_without_a_step() -> None:
    fam, model, inputs = _model_inputs("sd3")
    with pytest.raises(ValueError, match=r"metric 'log_ratio' scores a trajectory step"):
        attribute_settings(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam),
                           metric="log_ratio")  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown metric 'rel_l3'.*Did you mean 'rel_l2'"):
        attribute_settings(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam),
                           metric="rel_l3")  # fmt: skip
    traj = lab.trajectory("sd3", "tiny", steps=4, samples=1, progress=False)
    step = lab.StepScore.from_trajectory(traj, 1)
    rebuilt = fam.make_inputs("tiny", 0, 1, False, sigma=traj.steps[1].sigma,
                              latents=traj.steps[1].x_t.reshape(step.shapes[0]))  # fmt: skip
    att = attribute_settings(
        model, rebuilt, lab.Side.rollout(fam), lab.Side.trainer(fam), step=step
    )
    assert att.metric == "log_ratio" and att.total > 0
    # The trajectory's own exact (float64) log-ratio of that step's sample.
    samples = traj.per_sample()
    exact = samples.loc[samples["step"] == 1, "predicted_log_ratio"].abs().mean()
    assert att.total == pytest.approx(exact, rel=1e-9)
    assert math.fsum(att.shares) == pytest.approx(att.total, rel=1e-12)
    kl = attribute_settings(model, rebuilt, lab.Side.rollout(fam), lab.Side.trainer(fam),
                            step=step, metric="transition_kl")  # fmt: skip
    assert kl.total > 0 and kl.top().name == att.top().name


def test_plots_and_json() -> None:
    fam, model, inputs = _model_inputs("sd3")
    att = attribute_settings(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam))
    fig = att.plot()
    assert {t.name for t in fig.data} == {"Shapley share", "alone (A + it)", "removed (B - it)"}
    assert att.plot(backend="matplotlib").axes
    doc = att.to_dict()
    assert doc["schema"] == "precision-lab/setting-attribution/1"
    assert [k["name"] for k in doc["knobs"]] == [k.name for k in att.knobs]
    with pytest.raises(ValueError, match=r"expected what lab.attribute_settings returns"):
        lab.plots.plot_setting_shares(object())


@pytest.mark.slow
@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_shares_sum_to_the_whole_on_every_familys_default_pair(family_name: str) -> None:
    fam, model, inputs = _model_inputs(family_name)
    att = attribute_settings(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam))
    assert att.knobs
    assert math.fsum(att.shares) == pytest.approx(att.total, rel=1e-9, abs=1e-15)


def _scenario_case(name: str) -> tuple:
    sc = scenarios.get(name)
    fam = lab.family(sc.family_name)
    model = fam.build("tiny", 0, expert=fam.expert_for_sigma(0.75))
    inputs = sc.inputs(fam, "tiny", "cpu") if sc.inputs else fam.make_inputs("tiny", 0)
    bug_a, bug_b, fixed_a, fixed_b = sc.sides(fam, "cpu")
    if bug_a != fixed_a:  # the bug is in the reference side
        return model, inputs, bug_a, fixed_a, bug_b, "a"
    return model, inputs, bug_b, fixed_b, bug_a, "b"


CPU_SCENARIOS = [n for n in scenarios.names() if not scenarios.get(n).needs_gpu]


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_SCENARIOS)
def test_a_scenarios_own_setting_ranks_first_and_prescribe_finds_a_verified_fix(
    name: str,
) -> None:
    model, inputs, bug, fixed, other, movable = _scenario_case(name)
    own = {k.name for k in knobs_between(fixed, bug)}
    att = attribute_settings(model, inputs, fixed, bug)
    assert att.total > 0
    assert {a.name for a in att.top().atoms()} <= own
    assert math.fsum(att.shares) == pytest.approx(att.total, rel=1e-9)
    pair_sides = (bug, other) if movable == "a" else (other, bug)
    fixed_sides = (fixed, other) if movable == "a" else (other, fixed)
    level = lab.pair(model, inputs, *fixed_sides, check_outputs=False).output_metrics()
    target = (
        "bitexact"
        if level["model_output_max_abs_diff"] == 0
        else {"metric": "rel_max", "max": level["model_output_rel_max"]}
    )
    found = lab.prescribe(model, inputs, *pair_sides, movable=movable, target=target, repeats=1)
    best = found.best()
    assert best is not None, found.describe()
    # Verified by its own paired forward, not predicted.
    metrics = best.result.output_metrics()
    if target == "bitexact":
        assert metrics["model_output_max_abs_diff"] == 0.0
    else:
        assert metrics["model_output_rel_max"] <= target["max"]
    assert torch.isfinite(torch.tensor(best.time_ratio))

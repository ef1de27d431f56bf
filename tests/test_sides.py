"""Side presets and the weights each side runs with."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import lab
from lab.base.errors import PairError
from lab.pairing.weights import WeightView, plan_weights


def _param_seen(model, side, name):
    view = WeightView(model, side)
    param = dict(model.named_parameters())[name]
    with view.applied():
        return param.data.clone()


def test_rollout_keeps_fp32_modules_unrounded() -> None:
    fam = lab.family("wan2_2")
    model = fam.build("tiny", 0)
    with torch.no_grad():  # as a real checkpoint's norm weights are not all ones
        model.blocks[0].norm2.weight.add_(
            torch.linspace(0, 1e-3, model.blocks[0].norm2.weight.numel())
        )
    master = model.blocks[0].norm2.weight.detach().clone()
    seen = _param_seen(model, lab.Side.rollout(fam), "blocks.0.norm2.weight")
    assert seen.dtype == torch.float32
    assert torch.equal(seen, master)
    assert torch.equal(model.blocks[0].norm2.weight, master)


def test_forward_dtype_override_moves_the_weights() -> None:
    fam = lab.family("flux")
    trainer = lab.Side.trainer(fam, autocast=False, forward_dtype="fp32", rollout_precision="fp32")
    plan = plan_weights(fam.build("tiny", 0), trainer)
    counts = plan.dtype_counts()
    assert counts == {"fp32": len(plan.param_dtypes)}
    # Counted once a plan; each caller gets its own dict (a Result's meta may be edited).
    counts["fp32"] = 0
    assert plan.dtype_counts() == {"fp32": len(plan.param_dtypes)}
    rollout = lab.Side.rollout(fam, forward_dtype="fp16")
    assert rollout.rollout_precision == "fp16" and rollout.resolved_param_dtype == "fp16"


def test_rule_restating_default_carves_out_of_keeps() -> None:
    fam = lab.family("wan2_2")
    model = fam.build("tiny", 0)
    side = lab.Side.rollout(fam, param_dtype_rules={"blocks.0.norm2.*": "bf16"})
    dtypes = plan_weights(model, side).param_dtypes
    assert dtypes["blocks.0.norm2.weight"] == torch.bfloat16
    assert dtypes["blocks.1.norm2.weight"] == torch.float32


def test_local_mode_does_not_reuse_the_other_sides_autocast_cast() -> None:
    # torch's autocast caches casts of fp32 leaf weights by tensor object; swapping .data
    # between sides must not hand side B side A's cast (both use torch's own CPU autocast).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    inputs = lab.Inputs(kwargs={"input": torch.randn(4, 64)}, roles={"input": "latents"})
    common = dict(autocast=True, autocast_policy="cpu", param_dtype="fp32", forward_dtype="fp16",
                  rollout_precision="fp16")  # fmt: skip
    a = lab.Side(name="a", master_dtype="fp32", **common)
    b = lab.Side(name="b", master_dtype="bf16", **common)
    prop = lab.pair(model, inputs, a, b, "propagated", check_outputs=False)
    local = lab.pair(model, inputs, a, b, "local", check_outputs=False)
    first_local = next(r for r in local.rows if r.module == "0")
    first_prop = next(r for r in prop.rows if r.module == "0")
    assert first_prop.metrics.max_abs_diff > 0
    assert first_local.metrics.max_abs_diff == first_prop.metrics.max_abs_diff


def test_local_mode_failure_names_the_failing_side() -> None:
    fam = lab.family("wan2_2")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    bad = lab.Side.rollout(fam, input_dtype_policy={"cond": "fp32"})
    with pytest.raises(PairError, match=r"side 'rollout' failed"):
        lab.pair(model, inputs, lab.Side.trainer(fam), bad, "local")


# ---- every field is type-checked (issue 14 item 2) ----------------------------------------


@pytest.mark.parametrize("word", ["no", "False", "false", "0", "off"])
def test_a_string_for_autocast_is_refused_with_the_fix(word: str) -> None:
    trainer = lab.Side.trainer(lab.family("flux"))
    expected = (
        rf"Side\('trainer'\): autocast must be True or False, got '{word}' \(str\)\. "
        r"Pass autocast=False: "
    )
    with pytest.raises(ValueError, match=expected):
        trainer.replace(autocast=word)


def test_a_sweeps_autocast_override_string_is_refused() -> None:
    # What a notebook does with a sweep's trainer overrides: Side.trainer(fam, **overrides).
    fam = lab.family("wan2_2")
    with pytest.raises(ValueError, match=r"autocast must be True or False, got 'false'"):
        lab.Side.trainer(fam, **{"autocast": "false"})
    with pytest.raises(ValueError, match=r"cast_buffers must be True or False, got 1 \(int\)"):
        lab.Side.rollout(fam, cast_buffers=1)
    with pytest.raises(ValueError, match=r"op_switches\['drop_identity_mask'\] must be True"):
        lab.Side.rollout(fam, op_switches={"drop_identity_mask": "yes"})


def test_a_bare_string_for_a_tuple_of_names_is_refused() -> None:
    fam = lab.family("wan2_2")
    with pytest.raises(ValueError, match=r"Use keep_fp32_modules=\('norm2',\)"):
        lab.Side.rollout(fam, keep_fp32_modules="norm2")
    with pytest.raises(ValueError, match=r"fsdp_wrap_classes: every entry must be a string"):
        lab.Side.trainer(fam, fsdp_wrap_classes=[1])


def test_mappings_and_strings_are_type_checked() -> None:
    trainer = lab.Side.trainer(lab.family("flux"))
    with pytest.raises(ValueError, match=r"param_dtype_rules: expected a mapping"):
        trainer.replace(param_dtype_rules=[("*.norm*", "fp32")])
    with pytest.raises(ValueError, match=r"attention_backend: expected a string, got 3"):
        trainer.replace(attention_backend=3)
    with pytest.raises(ValueError, match=r"device: 'cuda:x' is not"):
        trainer.replace(device="cuda:x")
    with pytest.raises(ValueError, match=r"Side\.name: expected a non-empty string"):
        trainer.replace(name="")


def test_torch_dtypes_are_accepted_as_their_names_in_every_dtype_field() -> None:
    fam = lab.family("flux")
    by_name = lab.Side.trainer(
        fam,
        master_dtype="fp32",
        autocast_dtype="bf16",
        param_dtype="bf16",
        param_dtype_rules={"*.norm*": "fp32"},
        input_dtype_policy={"cond": "fp32"},
    )
    by_dtype = lab.Side.trainer(
        fam,
        master_dtype=torch.float32,
        forward_dtype=torch.bfloat16,
        rollout_precision=torch.bfloat16,
        reduce_dtype=torch.float32,
        autocast_dtype=torch.bfloat16,
        param_dtype=torch.bfloat16,
        param_dtype_rules={"*.norm*": torch.float32},
        input_dtype_policy={"cond": torch.float32},
        device=torch.device("cpu"),
    )
    assert by_dtype == by_name
    data = by_dtype.to_dict()
    assert data["forward_dtype"] == "bf16" and data["param_dtype_rules"] == {"*.norm*": "fp32"}
    assert data["input_dtype_policy"]["cond"] == "fp32" and data["device"] == "cpu"
    assert lab.Side.from_dict(json.loads(json.dumps(data))) == by_name
    with pytest.raises(ValueError, match=r"forward_dtype: Unsupported dtype 'torch.float64'"):
        by_name.replace(forward_dtype=torch.float64)


def test_parsed_torch_dtypes_are_exposed_without_changing_the_serialized_form() -> None:
    side = lab.Side.trainer(lab.family("flux"), reduce_dtype="bf16", autocast_dtype="fp16")
    assert side.forward_torch_dtype is torch.bfloat16
    assert side.master_torch_dtype is torch.float32
    assert side.reduce_torch_dtype is torch.bfloat16
    assert side.param_torch_dtype is torch.bfloat16  # param_dtype None: the forward dtype
    assert side.autocast_torch_dtype is torch.float16
    assert side.replace(param_dtype="fp32").param_torch_dtype is torch.float32
    assert set(side.to_dict()) == {f.name for f in dataclasses.fields(side)}


def test_from_dict_names_unknown_and_missing_fields() -> None:
    data = lab.Side.rollout(lab.family("flux")).to_dict()
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['autocst'\]"):
        lab.Side.from_dict({**data, "autocst": False})
    data.pop("name")
    with pytest.raises(ValueError, match=r"has no 'name' field"):
        lab.Side.from_dict(data)


@pytest.mark.parametrize("preset", ["rollout", "trainer", "fp32_reference"])
def test_preset_sides_refuse_an_unknown_field_naming_the_nearest(preset: str) -> None:
    make = getattr(lab.Side, preset)
    with pytest.raises(
        ValueError,
        match=rf"Side.{preset}: unknown field\(s\) \['autocst'\]. Did you mean 'autocast'",
    ):
        make(lab.family("flux"), autocst=False)
    assert make(lab.family("flux"), autocast=False).autocast is False


def test_sides_are_refused_or_made_from_what_a_user_hands_over() -> None:
    fam = lab.family("flux")
    assert lab.Side.trainer("flux") == lab.Side.trainer(fam), "a family's name is enough"
    with pytest.raises(
        ValueError, match=r"Side.trainer: family must be a Family or a family name .* got 3 \(int\)"
    ):
        lab.Side.trainer(3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"pair_family: rollout must be a mapping .* got 'bf16' \(str\)"
    ):
        lab.pair_family("flux", rollout="bf16")  # type: ignore[arg-type]
    model, inputs = fam.build("tiny", seed=0), fam.make_inputs("tiny", seed=0)
    with pytest.raises(ValueError, match=r"pair: side_a must be a Side, got .* \(dict\)"):
        lab.pair(model, inputs, {"autocast": False}, lab.Side.trainer(fam))  # type: ignore[arg-type]
    # A Side handed to pair_family is used as it is.
    exact = lab.pair_family("flux", trainer=lab.Side.trainer(fam, autocast=False))
    assert exact.side_b["autocast"] is False


def test_a_policy_override_is_merged_the_same_way_by_the_presets_and_replace() -> None:
    """`Side.trainer(wan, input_dtype_policy={"latents": "fp32"})` dropped the fp32 timestep."""
    wan = lab.family("wan2_2")
    assert wan.input_dtype_policy["timestep"] == "fp32"
    made = lab.Side.trainer(wan, input_dtype_policy={"latents": "fp32"})
    replaced = lab.Side.trainer(wan).replace(input_dtype_policy={"latents": "fp32"})
    assert dict(made.input_dtype_policy) == dict(replaced.input_dtype_policy)
    assert dict(made.input_dtype_policy) == {"latents": "fp32", "cond": None, "timestep": "fp32"}
    # The same through pair_family's dict of overrides; a key set to None is passed through.
    rollout = lab.Side.rollout(wan, input_dtype_policy={"timestep": None})
    assert rollout.input_dtype_policy["timestep"] is None
    assert (
        rollout.input_dtype_policy["latents"] == lab.Side.rollout(wan).input_dtype_policy["latents"]
    )
    ref = lab.Side.fp32_reference(wan, input_dtype_policy={"cond": "bf16"})
    assert dict(ref.input_dtype_policy) == {"latents": "fp32", "cond": "bf16", "timestep": "fp32"}
    side = lab.Side.from_overrides(
        {"input_dtype_policy": {"latents": "fp32"}}, wan, "trainer", "cpu", where="t"
    )
    assert side == made


def test_rollout_runs_the_familys_engine_switches_and_merges_an_override() -> None:
    flux = lab.family("flux")
    assert flux.engine_op_switches == {"timestep_from": "scheduler"}
    assert dict(lab.Side.rollout(flux).op_switches) == {"timestep_from": "scheduler"}
    # An override is merged over the family's switches, as an input_dtype_policy is.
    more = lab.Side.rollout(flux, op_switches={"drop_identity_mask": True})
    assert dict(more.op_switches) == {"timestep_from": "scheduler", "drop_identity_mask": True}
    off = lab.Side.rollout(flux, op_switches={"timestep_from": "pipeline"})
    assert dict(off.op_switches) == {"timestep_from": "pipeline"}
    made = lab.Side.from_overrides(
        {"op_switches": {"drop_identity_mask": True}}, flux, "rollout", "cpu", where="t"
    )
    assert made == more
    # The trainer runs the pipeline's timestep; a family without switches gets none.
    assert dict(lab.Side.trainer(flux).op_switches) == {}
    assert dict(lab.Side.rollout(lab.family("sd3")).op_switches) == {}

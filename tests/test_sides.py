"""Side presets and the weights each side runs with."""

from __future__ import annotations

import pytest
import torch

import lab
from lab.errors import PairError
from lab.weights import WeightView, plan_weights


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
    counts = plan_weights(fam.build("tiny", 0), trainer).dtype_counts()
    assert counts == {"fp32": sum(counts.values())}
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

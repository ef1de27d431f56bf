"""Engine patch groups and switches: bitwise parity where the record has it, no leaks, errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lab
from lab.pairing.capture import ROOT
from lab.precision.engine_ops import (
    PATCH_GROUPS,
    SWITCHES,
    check_engine_ops,
    check_groups_apply,
    ops_applied,
)


@pytest.fixture(scope="module")
def built() -> dict:
    return {}


def _model_inputs(built: dict, name: str):
    if name not in built:
        fam = lab.family(name)
        built[name] = (fam, fam.build("tiny", 0), fam.make_inputs("tiny", 0))
    return built[name]


def _aligned_sides(fam: lab.Family) -> tuple[lab.Side, lab.Side]:
    if fam.name == "qwen_image":
        # The record's aligned stack: an engine patched to round like the trainer, with the
        # pipeline's timestep (stock sglang rounds otherwise: tests/test_engine_sglang.py).
        return _aligned_qwen(fam), lab.Side.trainer(fam)
    if fam.name != "wan2_2":
        return lab.Side.rollout(fam), lab.Side.trainer(fam)
    # Wan's aligned stack, as the scenarios define it (one definition).
    from lab.engine.scenarios import _wan_aligned

    return _wan_aligned(fam, "cpu")


def _aligned_qwen(fam: lab.Family, groups: tuple[str, ...] = ("sgld", "qwen_image")) -> lab.Side:
    return lab.Side.rollout(fam, engine_ops=groups, op_switches={"timestep_from": "pipeline"})


@pytest.mark.parametrize("family_name", ["qwen_image", "wan2_2"])
@pytest.mark.parametrize("mode", ["propagated", "local"])
def test_aligned_pair_is_bitwise_on_every_module(built: dict, family_name: str, mode: str) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    rollout, trainer = _aligned_sides(fam)
    result = lab.pair(model, inputs, rollout, trainer, mode=mode)
    table = result.table()

    assert len(table) > 60, "too few modules captured"
    assert rollout.engine_ops, "the rollout runs no patch group: parity would be vacuous"
    # Rows where the trainer's autocast keeps fp32 and the engine rounds (the norm_out /
    # temb boundary) differ only by that rounding: 0 ULP in the coarser dtype.
    assert (table["max_ulp"] == 0).all(), table[table["max_ulp"] > 0][["module", "max_ulp"]]
    assert table[table["max_abs_diff"] > 0]["rounding_only"].all()
    root = table[table["module"] == ROOT]
    assert len(root) and (root["max_abs_diff"] == 0).all()
    assert (root["dtype_a"] == root["dtype_b"]).all()


@pytest.mark.parametrize(
    ("family_name", "groups"), [("qwen_image", ("sgld",)), ("wan2_2", ("sgld",)), ("wan2_2", ())]
)
def test_wrong_group_breaks_parity(built: dict, family_name: str, groups: tuple) -> None:
    fam, model, inputs = _model_inputs(built, family_name)
    rollout = (
        _aligned_qwen(fam, groups)
        if family_name == "qwen_image"
        else lab.Side.rollout(fam, engine_ops=groups)
    )
    out = lab.pair(model, inputs, rollout, lab.Side.trainer(fam)).output_metrics()

    assert out["model_output_rel_max"] > 1e-3


def test_groups_are_per_instance_and_restored(built: dict) -> None:
    _fam, model, _inputs = _model_inputs(built, "qwen_image")
    block_cls = type(model.transformer_blocks[0])
    class_forward = block_cls.forward
    with ops_applied(model, ("sgld", "qwen_image"), {}):
        patched = [m for m in model.modules() if "forward" in m.__dict__]
        names = {type(m).__name__ for m in patched}
        # Nested: an inner side without groups runs the class forwards again.
        with ops_applied(model, (), {}):
            assert not any("forward" in m.__dict__ for m in model.modules())
        assert all("forward" in m.__dict__ for m in patched)
    assert {"QwenImageTransformerBlock", "AdaLayerNormContinuous", "RMSNorm"} <= names
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert block_cls.forward is class_forward


def test_patch_groups_do_not_leak_into_the_other_side(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "qwen_image")
    plain = lab.Side.trainer(fam)
    before = lab.pairing.run.forward_side(model, inputs, plain)[0]
    lab.pair(model, inputs, lab.Side.rollout(fam, engine_ops=("sgld",)), plain, mode="local")
    after = lab.pairing.run.forward_side(model, inputs, plain)[0]

    assert torch.equal(before, after)


def test_later_group_wins(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "qwen_image")
    both = lab.Side.rollout(fam, engine_ops=("sgld", "qwen_image"))
    reversed_order = lab.Side.rollout(fam, engine_ops=("qwen_image", "sgld"))
    sgld = lab.Side.rollout(fam, engine_ops=("sgld",))
    y_both = lab.pairing.run.forward_side(model, inputs, both)[0]
    y_rev = lab.pairing.run.forward_side(model, inputs, reversed_order)[0]
    y_sgld = lab.pairing.run.forward_side(model, inputs, sgld)[0]

    assert not torch.equal(y_both, y_sgld)
    assert torch.equal(y_rev, y_sgld)


def test_sgld_rmsnorm_rounds_before_the_weight_and_wan_once_after_it() -> None:
    from diffusers.models.normalization import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.3 + 1)
    # Wan's q/k norms are torch.nn.RMSNorm: the wan group patches both classes alike.
    torch_norm = torch.nn.RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        torch_norm.weight.copy_(norm.weight)
    x = torch.randn(4, 64).to(torch.bfloat16)
    sgld = PATCH_GROUPS["sgld"].forwards["RMSNorm"](norm)(x)
    wan = PATCH_GROUPS["wan"].forwards["RMSNorm"](norm)(x)
    wan_torch = PATCH_GROUPS["wan"].forwards["RMSNorm"](torch_norm)(x)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    by_hand_sgld = normed.to(torch.bfloat16) * norm.weight
    # sglang's RMSNorm.forward_native: the weight multiplied in fp32, one rounding.
    by_hand_engine = (normed * norm.weight.float()).to(torch.bfloat16)

    assert sgld.dtype == wan.dtype == torch.bfloat16
    assert torch.equal(sgld, by_hand_sgld)
    assert torch.equal(wan, by_hand_engine) and torch.equal(wan_torch, by_hand_engine)
    assert not torch.equal(sgld, wan), "the two rounding orders must differ on this input"


def test_wan_group_follows_the_engines_norm_dispatch_by_width(built: dict) -> None:
    from diffusers import WanTransformer3DModel

    from lab.pairing.run import forward_side

    fam, model, inputs = _model_inputs(built, "wan2_2")

    def out(m: torch.nn.Module, x: lab.Inputs, path: str | None) -> torch.Tensor:
        switches = {"wan_norm_path": path} if path else {}
        return forward_side(m, x, lab.Side.rollout(fam, op_switches=switches))[0]

    # Tiny (D = 24): sglang's CUDA dispatch takes its norms' torch definitions (D % 256 != 0).
    default = out(model, inputs, None)
    assert torch.equal(default, out(model, inputs, "native"))
    assert not torch.equal(default, out(model, inputs, "fused"))
    # D = 256: the fused kernels run, rounding once.
    torch.manual_seed(0)
    config = {**fam.presets["tiny"], "attention_head_dim": 128, "ffn_dim": 64}
    wide = WanTransformer3DModel(**config).eval()
    wide_inputs = fam.make_inputs("tiny", 0, config=dict(wide.config))
    wide_default = out(wide, wide_inputs, None)
    assert torch.equal(wide_default, out(wide, wide_inputs, "fused"))
    assert not torch.equal(wide_default, out(wide, wide_inputs, "native"))


def test_wan_patchify_as_linear_equals_conv3d_in_fp64() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(4, 6, kernel_size=(1, 2, 2), stride=(1, 2, 2)).double()
    x = torch.randn(2, 4, 3, 8, 8, dtype=torch.float64)
    check_engine_ops((), {})  # loads the switch registry (run alone, nothing else has)
    linear = SWITCHES["wan_patchify"].forwards["linear"]["Conv3d"](conv)
    y = linear(x)

    assert y.shape == conv(x).shape
    # fp64 with 16-term sums: only the summation order differs.
    torch.testing.assert_close(y, conv(x), rtol=0, atol=1e-13)


def test_qwen_rope_rebuilt_on_cpu_equals_the_stock_tables_on_cpu(built: dict) -> None:
    _fam, model, _inputs = _model_inputs(built, "qwen_image")
    rope = model.pos_embed
    stock = rope([[(1, 8, 8)]], device=torch.device("cpu"), max_txt_seq_len=12)
    for where in ("cpu", "device"):
        factory = SWITCHES["rope_cache_device"].forwards[where]["QwenEmbedRope"]
        rebuilt = factory(rope)([[(1, 8, 8)]], device=torch.device("cpu"), max_txt_seq_len=12)
        assert rebuilt[0].shape == stock[0].shape == (64, 8)
        assert torch.equal(rebuilt[0], stock[0]) and torch.equal(rebuilt[1], stock[1])


def test_wan_rope_bf16_switch_rounds_the_tables(built: dict) -> None:
    _fam, model, inputs = _model_inputs(built, "wan2_2")
    rope = model.rope
    x = inputs.kwargs["hidden_states"]
    cos, _ = SWITCHES["rope_table_dtype"].forwards["bf16"]["WanRotaryPosEmbed"](rope)(x)
    stock_cos, _ = rope(x)

    assert stock_cos.dtype == torch.float32 and cos.dtype == torch.bfloat16
    assert torch.equal(cos, stock_cos.to(torch.bfloat16))
    assert not torch.equal(cos.float(), stock_cos)


def test_ltx_rope_bf16_rounds_x_cos_before_adding_the_sine_product() -> None:
    from diffusers.models.transformers import transformer_ltx2

    from lab.precision.engine_groups import _ltx2_interleaved_rotary, _ltx2_split_rotary

    bf16 = torch.bfloat16
    # One head of width 2. x1 * cos = 1 + 2^-6 + 2^-14 rounds to 1 + 2^-6 at bf16; the sine
    # product adds 2^-8 - 2^-15. Rounded once the sum is past the half-ULP (1 + 2^-6 + 2^-7);
    # with x * cos rounded first it falls short of it (1 + 2^-6), as the engine computes.
    x = torch.tensor([[[1.0078125, 0.00390625]]], dtype=bf16)
    split = (torch.tensor([1.0078125]).view(1, 1, 1, 1).to(bf16),)
    split += (torch.tensor([-0.9921875]).view(1, 1, 1, 1).to(bf16),)
    interleaved = (torch.tensor([[[1.0078125, 1.0078125]]], dtype=bf16),)
    interleaved += (torch.tensor([[[-0.9921875, -0.9921875]]], dtype=bf16),)
    assert _ltx2_split_rotary(x, split)[0, 0, 0].item() == 1.015625
    assert _ltx2_interleaved_rotary(x, interleaved)[0, 0, 0].item() == 1.015625
    assert transformer_ltx2.apply_split_rotary_emb(x, split)[0, 0, 0].item() == 1.0234375
    diffusers = transformer_ltx2.apply_interleaved_rotary_emb(x, interleaved)
    assert diffusers[0, 0, 0].item() == 1.0234375


def test_ltx2_rollout_runs_the_engines_bf16_rope_table(built: dict) -> None:
    fam, model, inputs = _model_inputs(built, "ltx2")
    assert lab.Side.rollout(fam).op_switches == {"ltx_rope": "bf16"}
    assert lab.Side.trainer(fam).op_switches == {}
    coords = inputs.kwargs["video_coords"]
    stock_cos, stock_sin = model.rope(coords)
    with ops_applied(model, (), {"ltx_rope": "bf16"}):
        cos, sin = model.rope(coords)
    assert stock_cos.dtype == torch.float32 and cos.dtype == torch.bfloat16
    assert torch.equal(cos, stock_cos.to(torch.bfloat16))
    assert torch.equal(sin, stock_sin.to(torch.bfloat16))
    assert "forward" not in model.rope.__dict__  # restored on exit


def test_unknown_group_and_switch_value_are_named() -> None:
    fam = lab.family("qwen_image")
    with pytest.raises(ValueError, match=r"unknown patch group\(s\) \['sglang'\].*Known: sgld"):
        lab.Side.rollout(fam, engine_ops=("sglang",))
    with pytest.raises(ValueError, match=r"unknown value 'gpu'. Allowed: 'as_built', 'cpu'"):
        lab.Side.rollout(fam, op_switches={"rope_cache_device": "gpu"})
    # Each message names the field that holds the bad value (a switch was under engine_ops).
    with pytest.raises(ValueError, match=r"\.engine_ops: unknown patch group"):
        lab.Side.rollout(fam, engine_ops=("sglang",))
    with pytest.raises(
        ValueError,
        match=r"\.op_switches: unknown op switch 'rope_cache_devce'. Did you mean "
        r"'rope_cache_device'\?",
    ):
        lab.Side.rollout(fam, op_switches={"rope_cache_devce": "cpu"})
    with pytest.raises(ValueError, match=r"\.op_switches\['rope_cache_device'\]: unknown value"):
        lab.Side.rollout(fam, op_switches={"rope_cache_device": "gpu"})


def test_a_group_that_patches_nothing_in_the_model_is_refused(built: dict) -> None:
    """ "qwen_image" on a Wan model ran the stock forwards and read as the engine's semantics."""
    for name in ("wan2_2", "cosmos3"):
        fam, model, inputs = _model_inputs(built, name)
        rollout = lab.Side.rollout(fam, engine_ops=("qwen_image",))
        trainer = lab.Side.trainer(fam)
        match = (
            r"Side\('rollout'\)\.engine_ops: patch group 'qwen_image' patches "
            r"AdaLayerNormContinuous, QwenImageTransformerBlock, and this model \("
            + type(model).__name__
            + r"\) has none of them: it would change nothing\. Groups that patch this model: "
            r"sgld, qwen_image_native, wan, cosmos3_native\."
        )
        with pytest.raises(ValueError, match=match):
            lab.pair(model, inputs, rollout, trainer)
        with pytest.raises(ValueError, match=match):
            lab.forward_side(model, inputs, rollout)
        with pytest.raises(ValueError, match=match):
            lab.attribute(model, inputs, rollout, trainer)
    # Later groups still win where both patch (the family's own default runs).
    fam, model, inputs = _model_inputs(built, "wan2_2")
    assert lab.pair(model, inputs, lab.Side.rollout(fam), lab.Side.trainer(fam)).rows
    # A model no group patches: engine_ops is refused as a whole, op_switches are not checked.
    with pytest.raises(ValueError, match=r"\(Linear\) has none .*No patch group patches this"):
        check_groups_apply(("sgld",), torch.nn.Linear(2, 2), "Side('x')")
    check_groups_apply((), torch.nn.Linear(2, 2), "Side('x')")


def test_qwen_image_native_rmsnorm_rounds_once_after_the_weight() -> None:
    """The engine's RMSNorm (sglang forward_native) vs sgld's (diffusers' rounding order)."""
    from diffusers.models.normalization import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.3 + 1)
    x = torch.randn(4, 64).to(torch.bfloat16)
    check_engine_ops((), {})  # loads the group registry (run alone, nothing else has)
    engine = PATCH_GROUPS["qwen_image_native"].forwards["RMSNorm"](norm)(x)
    sgld = PATCH_GROUPS["sgld"].forwards["RMSNorm"](norm)(x)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)

    assert engine.dtype == torch.bfloat16
    assert torch.equal(engine, (normed * norm.weight.float()).to(torch.bfloat16))
    assert not torch.equal(engine, sgld), "the two rounding orders must differ on this input"


def test_timestep_from_scheduler_hands_the_model_the_raw_fp32_t(built: dict) -> None:
    from lab.precision.engine_ops import transform_inputs

    fam, model, inputs = _model_inputs(built, "qwen_image")
    switched = transform_inputs(inputs, {"timestep_from": "scheduler"})
    # The pipeline rounds t = 750 to bf16 (752) before its /1000; the engine's t stays fp32.
    assert inputs.kwargs["timestep"].dtype == torch.bfloat16
    assert torch.equal(inputs.kwargs["timestep"], torch.tensor([750.0]).to(torch.bfloat16) / 1000)
    assert torch.tensor([750.0]).to(torch.bfloat16).item() == 752.0
    assert switched.kwargs["timestep"].dtype == torch.float32
    assert switched.kwargs["timestep"].tolist() == [750.0]
    # The CFG branch carries the step too (a trajectory runs it on its own).
    negative = fam.make_inputs("tiny", 0, cfg=True).negative
    assert transform_inputs(negative, {"timestep_from": "scheduler"}).kwargs[
        "timestep"
    ].tolist() == [750.0]
    # Qwen's root divides by 1000 (the engine's model does) and the stock forward casts: the
    # same as handing the stock model the engine's (t / 1000) by hand.
    engine_t = torch.tensor([750.0]) / 1000
    rollout = lab.Side.rollout(fam)
    assert rollout.op_switches["timestep_from"] == "scheduler"
    by_hand = inputs.replace_kwargs(timestep=engine_t)
    y = lab.pairing.run.forward_side(model, inputs, rollout)[0]
    y_hand = lab.pairing.run.forward_side(
        model, by_hand, rollout.replace(op_switches={"timestep_from": "pipeline"})
    )[0]
    y_pipeline = lab.pairing.run.forward_side(
        model, inputs, rollout.replace(op_switches={"timestep_from": "pipeline"})
    )[0]
    assert torch.equal(y, y_hand)
    assert not torch.equal(y, y_pipeline), "752 and 750 must give different outputs"


@pytest.mark.parametrize(("sigma", "same"), [(0.5, True), (0.75, False)])
def test_flux_root_differs_from_diffusers_only_in_the_timestep_cast(
    sigma: float, same: bool
) -> None:
    """t = 500 is exact in bf16, so both roots see the same t; 750 is not (bf16: 752)."""
    fam = lab.family("flux")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0, sigma=sigma)
    rollout = lab.Side.rollout(fam)
    y = lab.pairing.run.forward_side(model, inputs, rollout)[0]
    stock = rollout.replace(op_switches={"timestep_from": "pipeline"})
    y_stock = lab.pairing.run.forward_side(model, inputs, stock)[0]

    assert torch.equal(y, y_stock) is same


def test_timestep_from_scheduler_refuses_a_model_it_cannot_adapt() -> None:
    from lab.families import Inputs
    from lab.precision.engine_ops import transform_inputs

    inputs = lab.family("minimax_h3").make_inputs("tiny", 0)
    with pytest.raises(
        ValueError,
        match=r"minimax_h3's model takes the timestep as '1-sigma'.*"
        r"adapts only FluxTransformer2DModel, QwenImageTransformer2DModel",
    ):
        transform_inputs(inputs, {"timestep_from": "scheduler"})
    bare = Inputs(kwargs={"timestep": torch.ones(1)}, roles={"timestep": "timestep"})
    with pytest.raises(ValueError, match=r"carry no sigma.*make_inputs\(\.\.\., sigma=\.\.\.\)"):
        transform_inputs(bare, {"timestep_from": "scheduler"})
    # The stock value changes nothing.
    assert transform_inputs(bare, {"timestep_from": "pipeline"}) is bare


@pytest.mark.parametrize(
    ("family_name", "group", "attn_class"),
    [("qwen_image", "qwen_image_native", "Attention"), ("flux", "flux_native", "FluxAttention")],
)
def test_attention_projects_the_split_as_views_the_engines_way(
    family_name: str, group: str, attn_class: str
) -> None:
    """Batch 1: the split is contiguous, nothing changes; batch 2: the bias rounds apart."""
    fam = lab.family(family_name)
    model = fam.build("tiny", 0).to(torch.bfloat16)
    attn = model.transformer_blocks[0].attn
    check_engine_ops((), {})
    factory = PATCH_GROUPS[group].forwards[attn_class]
    calls = []
    handle = attn.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True
    )
    try:
        for batch in (1, 2):
            with torch.no_grad():
                model(**fam.make_inputs("tiny", 0, batch).kwargs)
    finally:
        handle.remove()
    for (args, kwargs), batch in zip(calls, (1, 2), strict=True):
        with torch.no_grad():
            stock, engine = attn(*args, **kwargs), factory(attn)(*args, **kwargs)
        assert stock[0].shape[0] == batch
        same = [torch.equal(a, b) for a, b in zip(stock, engine, strict=True)]
        assert all(same) if batch == 1 else not any(same), (batch, same)


def _engine_rms_norm(x32: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """sglang's RMSNorm.forward_native on an fp32 input: one rounding, after the weight."""
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(weight.dtype)


def test_cosmos3_native_fused_norm_normalizes_the_unrounded_sum() -> None:
    """The engine's fused residual add + norm reads the fp32 sum, not its bf16 rounding."""
    from diffusers.models.normalization import RMSNorm

    from lab.precision.engine_groups import _FUSED_NORM_INPUTS, _cosmos3_fused_norm

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.3 + 1)
    residual = torch.randn(8, 64).to(torch.bfloat16)
    branch = (torch.randn(8, 64) * 0.01).to(torch.bfloat16)
    rounded = residual + branch
    fp32_sum = residual.float() + branch.float()
    with ops_applied(norm, ("cosmos3_native",), {}):
        fused = _cosmos3_fused_norm(norm, rounded, fp32_sum)
        plain = norm(rounded)
    stock = norm(rounded)

    assert torch.equal(fused, _engine_rms_norm(fp32_sum, norm.weight, 1e-6))
    assert torch.equal(plain, _engine_rms_norm(rounded.float(), norm.weight, 1e-6))
    assert not torch.equal(fused, plain), "the rounded sum must normalize otherwise here"
    assert not torch.equal(plain, stock), "diffusers rounds before the weight: it must differ"
    assert len(_FUSED_NORM_INPUTS) == 0  # held only for the norm's call


def test_cosmos3_native_time_embedding_is_one_row_per_t_from_bf16_rounded_weights() -> None:
    """The engine embeds the step's one t (a CPU GEMM of one row) with bf16-rounded weights."""
    from diffusers.models.embeddings import TimestepEmbedding

    torch.manual_seed(0)
    emb = TimestepEmbedding(in_channels=256, time_embed_dim=64)
    first, second = torch.randn(1, 256), torch.randn(1, 256)

    def rounded(p: torch.Tensor) -> torch.Tensor:
        return p.to(torch.bfloat16).float()

    def engine(x: torch.Tensor) -> torch.Tensor:
        h = F.silu(F.linear(x, rounded(emb.linear_1.weight), rounded(emb.linear_1.bias)))
        return F.linear(h, rounded(emb.linear_2.weight), rounded(emb.linear_2.bias))

    calls = []
    emb.linear_1.register_forward_hook(lambda m, a, out: calls.append(tuple(out.shape)))
    sample = first.expand(16, -1)
    with ops_applied(emb, ("cosmos3_native",), {}):
        out = emb(sample)
        # Two distinct t (two modalities' tokens, say): one GEMM over the two rows.
        two = emb(torch.cat([first.expand(4, -1), second.expand(3, -1)]))
    stock = emb(sample)

    assert out.shape == stock.shape == (16, 64)
    assert torch.equal(out, engine(first).expand(16, -1))
    assert not torch.equal(out, stock), "diffusers embeds 16 rows from fp32 weights"
    assert calls[:2] == [(1, 64), (2, 64)]  # the hooked linear ran once a call, per distinct t
    assert torch.equal(two[:4], two[:1].expand(4, -1)) and torch.equal(
        two[4:], two[4:5].expand(3, -1)
    )
    assert not torch.equal(two[0], two[4])
    assert emb.linear_1.weight.dtype == torch.float32  # the fp32 weights are untouched


def test_cosmos3_rollout_runs_the_engines_group(built: dict) -> None:
    fam, model, _inputs = _model_inputs(built, "cosmos3")
    assert lab.Side.rollout(fam).engine_ops == ("cosmos3_native",)
    assert lab.Side.trainer(fam).engine_ops == ()
    layer = model.layers[0]
    with ops_applied(model, ("cosmos3_native",), {}):
        assert "forward" in layer.__dict__ and "forward" in model.time_embedder.__dict__
    assert "forward" not in layer.__dict__  # restored on exit


def test_flux_root_switch_keeps_the_stock_forwards_lora_handling(built: dict) -> None:
    # The engine's Flux root runs under diffusers' apply_lora_scale, as the stock forward: a
    # caller's joint_attention_kwargs is copied (never mutated) and its "scale" taken out.
    fam, model, inputs = _model_inputs(built, "flux")
    side = lab.Side.rollout(fam)
    assert side.op_switches.get("timestep_from") == "scheduler"
    plain = lab.forward_side(model, inputs, side)[0]
    kwargs = {"scale": 1.0}
    scaled = dataclasses.replace(
        inputs,
        kwargs={**inputs.kwargs, "joint_attention_kwargs": kwargs},
        roles={**inputs.roles, "joint_attention_kwargs": "aux"},
    )
    seen: list[Any] = []
    hook = model.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw.get("joint_attention_kwargs")), with_kwargs=True
    )
    try:
        out = lab.forward_side(model, scaled, side)[0]
    finally:
        hook.remove()
    assert kwargs == {"scale": 1.0}
    assert seen == [{}], "the blocks get the kwargs without the LoRA scale, as stock diffusers"
    assert torch.equal(out, plain)

"""The real sglang engine's DiTs against the lab's models (the `engine` extra, marker `engine`).

Run with `bash scripts/test.sh -m engine` after `bash scripts/install_engine.sh`; .ci/run does
both and sets LAB_REQUIRE_ENGINE so a missing engine fails instead of skipping.
"""

from __future__ import annotations

import os

import pytest
import torch

import lab

pytestmark = pytest.mark.engine


def _require_engine() -> None:
    from lab.engine.sglang import SUPPORTED_VERSION, engine_version

    version = engine_version()
    if version != SUPPORTED_VERSION:
        reason = (
            f"sglang {SUPPORTED_VERSION} is not installed (found {version}): "
            "bash scripts/install_engine.sh"
        )
        (pytest.fail if os.environ.get("LAB_REQUIRE_ENGINE") else pytest.skip)(reason)


@pytest.fixture(scope="module")
def sglang():
    _require_engine()
    from lab.engine import sglang as engine

    return engine


@pytest.fixture(scope="module")
def checks(sglang):
    return {name: sglang.check_emulation(name) for name in sglang.ENGINE_FAMILIES}


@pytest.mark.parametrize(
    "family_name", ["cosmos3", "flux", "ltx2", "minimax_h3", "qwen_image", "sd3", "wan2_2"]
)
def test_emulated_rollout_matches_the_engine_or_names_why(checks, family_name: str) -> None:
    check = checks[family_name]
    result = check.engine_vs_rollout
    assert len(result.rows) > 20, "too few aligned outputs: the alignment found little"
    root = result.root_rows()
    assert root, "the model outputs were not paired"
    assert check.unexplained() == [], check.unexplained()[:5]
    # Every engine module is aligned or listed with its reason.
    alignment = result.meta["alignment"]
    engine_modules = {n or "<root>" for n, _ in check_engine_modules(family_name, checks)}
    aligned = {m["a"] for m in alignment["modules"]}
    assert engine_modules == aligned | set(alignment["unaligned_a"])
    assert all(alignment["unaligned_a"].values())


def check_engine_modules(family_name: str, checks):
    return checks[family_name].engine.module.named_modules()


@pytest.mark.parametrize("family_name", ["flux", "ltx2", "minimax_h3", "qwen_image", "sd3"])
def test_emulation_is_bit_exact_with_the_engine(checks, family_name: str) -> None:
    result = checks[family_name].engine_vs_rollout
    summary = result.summary()
    assert result.first_divergence() is None, (family_name, result.describe())
    assert summary["bitexact_pairs"] == summary["pairs"] > 40
    assert result.root_rows()[0].metrics.numel > 0


@pytest.mark.parametrize("family_name", ["flux", "qwen_image"])
def test_emulation_stays_bit_exact_at_batch_3_seed_1_sigma_081(sglang, family_name: str) -> None:
    """Batch > 1 splits the joint attention output into non-contiguous views on the engine."""
    side = lab.Side.rollout(family_name)
    result = sglang.pair_engine(family_name, seed=1, sigma=0.81, batch=3, side=side)
    assert result.first_divergence() is None, result.describe()
    assert result.root_rows()[0].metrics.numel == 3 * 64 * 16


@pytest.mark.parametrize(
    ("family_name", "overrides", "first", "code"),
    [
        # Without the switch the model sees the pipeline's bf16-rounded t (752, not 750).
        ("flux", {"op_switches": {"timestep_from": "pipeline"}}, "time_text_embed.time_proj",
         "input_dtype"),
        # Without the patch groups: diffusers' RMSNorm rounds before its weight ...
        ("qwen_image", {"engine_ops": ()}, "txt_norm", "implementation"),
        # ... and the output projections take contiguous copies (one rounding at batch > 1).
        ("flux", {"engine_ops": ()}, "transformer_blocks.0.attn.to_out.0", "implementation"),
    ],
)  # fmt: skip
def test_each_engine_op_of_the_emulation_is_needed_and_named(
    sglang, family_name: str, overrides: dict, first: str, code: str
) -> None:
    side = lab.Side.rollout(family_name, **overrides)
    result = sglang.pair_engine(family_name, batch=2, side=side)
    row = result.first_divergence()
    assert row is not None and row.module == first, result.describe()
    assert code in result.whys()[result.rows.index(row)].codes
    unexplained = [
        r.label()
        for r, w in zip(result.rows, result.whys(), strict=True)
        if r.diverges and "unexplained" in w.codes
    ]
    assert unexplained == []


def test_engine_vs_trainer_names_the_engines_own_rmsnorm(checks) -> None:
    result = checks["qwen_image"].engine_vs_trainer
    assert result.first_divergent_module == "txt_norm"
    assert "the engine's RMSNorm (sglang RMSNorm.forward_native)" in result.why("txt_norm")


@pytest.mark.parametrize("family_name", ["flux", "qwen_image", "sd3"])
def test_engine_vs_trainer_reads_like_the_emulated_rollout_vs_trainer(
    checks, family_name: str
) -> None:
    check = checks[family_name]
    engine, emulated = check.engine_vs_trainer, check.rollout_vs_trainer
    assert engine.first_divergent_module == emulated.first_divergent_module
    if family_name == "sd3":
        why = engine.why(engine.first_divergence())
        assert why.startswith("autocast: layer_norm runs in fp32 on trainer"), why
    # The emulated rollout's output is the engine's, bit for bit: the same gap to the trainer.
    rel = engine.output_metrics()["model_output_rel_max"]
    assert rel > 0
    assert rel == emulated.output_metrics()["model_output_rel_max"]


def test_wan_emulation_is_bit_exact_with_the_engine_on_cpu(checks) -> None:
    check = checks["wan2_2"]
    result = check.engine_vs_rollout
    assert len(result.rows) >= 38 and result.root_rows()[0].metrics.numel > 0
    assert result.first_divergence() is None, result.describe()
    emulated = result.meta["emulated_on_cpu"]
    assert emulated["op_switches.rope_table_dtype"].startswith("'bf16': the self-attention RoPE")
    assert emulated["op_switches.wan_norm_path"].startswith("'native': norm1")
    assert emulated["autocast"].startswith("off, as the side runs (the engine autocasts")
    assert result.side_b["op_switches"] == {"rope_table_dtype": "bf16", "wan_norm_path": "native"}
    # The emulation is exact, so the two trainer pairs are one gap, module by module.
    by_engine = {r.label(): r.metrics.max_abs_diff for r in check.engine_vs_trainer.rows}
    by_emulation = {r.label(): r.metrics.max_abs_diff for r in check.rollout_vs_trainer.rows}
    assert by_engine and all(by_emulation[k] == v for k, v in by_engine.items())
    rel = check.engine_vs_trainer.output_metrics()["model_output_rel_max"]
    assert rel > 1e-3  # the trainer's fp32-once norms and fp32 RoPE against the engine's
    assert check.rollout_vs_trainer.output_metrics()["model_output_rel_max"] == rel


@pytest.fixture(scope="module")
def wan(sglang):
    from lab.engine.sglang.build import build_engine

    fam = lab.family("wan2_2")
    model = fam.build("tiny", 0, expert=fam.expert_for_sigma(0.75))
    inputs = fam.make_inputs("tiny", 0, 1, False, sigma=0.75)
    return fam, model, inputs, build_engine(model, sglang.engine_family("wan2_2"))


def test_wan_default_rollout_differs_from_the_cpu_engine_only_by_its_rope_fallback(
    sglang, wan
) -> None:
    fam, model, inputs, engine = wan
    default = sglang.pair_with_engine(engine, model, inputs, lab.Side.rollout(fam))
    # The default models the engine on a GPU, whose kernels rotate q/k in fp32: on this CPU the
    # engine's torch fallback rotates in bf16, so the first output after the attention kernel
    # (diffusers' attention runs as a function: no row between the q/k norms and to_out).
    assert default.first_divergent_module == "blocks.0.attn1.to_out.0"
    cpu_rope = lab.Side.rollout(fam, op_switches={"rope_table_dtype": "bf16"})
    assert sglang.pair_with_engine(engine, model, inputs, cpu_rope).first_divergence() is None


def test_wan_emulation_is_exact_with_no_autocast_and_under_either_list(sglang, wan) -> None:
    fam, model, inputs, engine = wan
    cpu = {"rope_table_dtype": "bf16"}
    # The engine autocasts, but casts explicitly wherever its autocast would act, except the
    # fp32 umT5 text at the text embedder, which the rollout's input policy casts instead.
    for side in (
        lab.Side.rollout(fam, op_switches=cpu),
        lab.Side.rollout(fam, op_switches=cpu, autocast=True, input_dtype_policy={"cond": None}),
        lab.Side.rollout(fam, op_switches=cpu, autocast=True, autocast_policy="cpu"),
    ):
        result = sglang.pair_with_engine(engine, model, inputs, side)
        assert result.first_divergence() is None, (side, result.describe())


def test_check_emulation_runs_an_autocast_side_with_the_cpu_lists(sglang) -> None:
    check = sglang.check_emulation("wan2_2", rollout={"autocast": True})
    side = check.engine_vs_rollout.side_b
    assert side["autocast"] is True and side["autocast_policy"] == "cpu"
    note = check.engine_vs_rollout.meta["emulated_on_cpu"]["autocast_policy"]
    assert note.startswith("'cpu' (was 'cuda'): on a CPU the engine's pipeline autocasts")
    assert check.engine_vs_rollout.first_divergence() is None
    assert "emulated as the engine runs on a CPU: autocast_policy='cpu'" in check.describe()


def test_wan_norms_at_a_fused_kernel_width_take_the_kernels_rounding(sglang) -> None:
    from diffusers import WanTransformer3DModel

    from lab.engine.sglang.build import build_engine
    from lab.precision.engine_groups import wan_fused_norm_width

    fam = lab.family("wan2_2")
    torch.manual_seed(0)
    # Two heads of 128: D = 256, the narrowest width sglang's fused CuTe norm kernels take.
    config = {**fam.presets["tiny"], "attention_head_dim": 128, "ffn_dim": 64}
    model = WanTransformer3DModel(**config).eval()
    assert wan_fused_norm_width(256) and not wan_fused_norm_width(24)
    inputs = fam.make_inputs("tiny", 0, 1, False, sigma=0.75, config=dict(model.config))
    engine = build_engine(model, sglang.engine_family("wan2_2"))
    on_gpu = lab.Side.rollout(fam, op_switches={"rope_table_dtype": "bf16"})
    on_cpu = on_gpu.replace(op_switches={"rope_table_dtype": "bf16", "wan_norm_path": "native"})
    # On this CPU the engine runs its torch forward_native at every width: the CPU choice is
    # exact, and the GPU dispatch (the kernels' fp32-once rounding) is not.
    assert sglang.pair_with_engine(engine, model, inputs, on_cpu).first_divergence() is None
    fused = sglang.pair_with_engine(engine, model, inputs, on_gpu)
    assert fused.first_divergent_module == "blocks.0.attn1.norm_q"


def test_ltx2_engine_in_fp32_is_the_diffusers_model_bit_for_bit(sglang) -> None:
    from lab.engine.sglang.build import build_engine

    fam = lab.family("ltx2")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0, 1, False, sigma=0.75)
    fp32 = {
        k: v.float()
        for k, v in inputs.kwargs.items()
        if torch.is_tensor(v) and v.dtype.is_floating_point
    }
    inputs = inputs.replace_kwargs(**fp32)
    engine = build_engine(model, sglang.engine_family("ltx2"), "fp32")
    # Every parameter is mapped (prompt_adaln -> prompt_adaln_single included) and equal.
    assert engine.weights["equal"] == engine.weights["parameters"] == 230
    video, audio = engine.forward(inputs)
    with torch.no_grad():
        ref_video, ref_audio = model(**inputs.kwargs)
    assert video.shape == (1, 36, 16) and audio.shape == (1, 18, 16)
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    assert ref_video.abs().max() > 0.1


def test_ltx2_rollout_without_the_engines_rope_differs_only_at_its_four_tables(
    sglang, checks
) -> None:
    # The default rollout runs the engine's RoPE (bit-exact above, on this CPU and the H100's
    # Triton kernel alike: the switch needs no CPU-only value).
    assert checks["ltx2"].engine_vs_rollout.side_b["op_switches"] == {"ltx_rope": "bf16"}
    assert "op_switches.ltx_rope" not in checks["ltx2"].engine_vs_rollout.meta["emulated_on_cpu"]
    fp32 = sglang.check_emulation("ltx2", rollout={"op_switches": {"ltx_rope": "fp32"}})
    result = fp32.engine_vs_rollout
    summary = result.summary()
    assert summary["pairs"] == 192 and summary["bitexact_pairs"] == 90
    assert result.first_divergent_module == "rope"
    # The differing outputs the engine computes itself are its four RoPE tables (bf16 there,
    # fp32 in diffusers); every other differing row inherits them (or contains a row that does).
    assert (result.rows[0].dtype_a, result.rows[0].dtype_b) == ("bf16", "fp32")
    own = {
        r.label()
        for r, w in zip(result.rows, result.whys(), strict=True)
        if r.diverges and not {"inherited", "submodule"} & set(w.codes)
    }
    ropes = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")
    assert own == {f"{m}:{i}" for m in ropes for i in (0, 1)}
    # Before the first attention everything (time, prompt and AV modulation embeddings, the
    # input projections) is bit-exact: the timestep and inputs are the engine's.
    exact = {r.module for r in result.rows if not r.diverges}
    assert {"proj_in", "audio_proj_in", "time_embed", "prompt_adaln", "audio_prompt_adaln",
            "av_cross_attn_video_a2v_gate"} <= exact  # fmt: skip
    rel = result.output_metrics()["model_output_rel_max"]
    assert 1e-3 < rel < 3e-2


def test_ltx2_engine_with_diffusers_rope_is_bit_exact_with_the_fp32_rope_switch(
    sglang, monkeypatch
) -> None:
    """ltx_rope="fp32" is diffusers' RoPE: the engine given diffusers' table and rotation."""
    from diffusers.models.transformers import transformer_ltx2
    from sglang.multimodal_gen.runtime.models.dits import ltx_2

    rope = ltx_2.LTX2AudioVideoRotaryPosEmbed
    table = rope.forward

    def fp32_table(self, coords, device=None, out_dtype=None):
        return table(self, coords, device=device, out_dtype=torch.float32)

    monkeypatch.setattr(rope, "forward", fp32_table)
    monkeypatch.setattr(ltx_2, "apply_split_rotary_emb", transformer_ltx2.apply_split_rotary_emb)
    fp32 = {"op_switches": {"ltx_rope": "fp32"}}
    result = sglang.check_emulation("ltx2", rollout=fp32).engine_vs_rollout
    assert result.first_divergence() is None, result.describe()
    assert result.summary()["bitexact_pairs"] == 192


def test_ltx2_interleaved_rope_emulation_is_bit_exact_at_batch_2_seed_1(sglang) -> None:
    """The class-default rope_type: the engine rotates in bf16 without a kernel there too."""
    from diffusers import LTX2VideoTransformer3DModel

    from lab.engine.sglang.build import build_engine

    fam = lab.family("ltx2")
    config = {**fam.config("tiny"), "rope_type": "interleaved"}
    torch.manual_seed(1)
    model = LTX2VideoTransformer3DModel(**config).eval()
    inputs = fam.make_inputs("tiny", 1, 2, False, sigma=0.81, config=config)
    engine = build_engine(model, sglang.engine_family("ltx2"), "bf16")
    result = sglang.pair_with_engine(engine, model, inputs, lab.Side.rollout(fam))
    assert result.first_divergence() is None, result.describe()
    assert result.summary()["bitexact_pairs"] == result.summary()["pairs"] > 150
    fp32 = lab.Side.rollout(fam, op_switches={"ltx_rope": "fp32"})
    assert sglang.pair_with_engine(engine, model, inputs, fp32).first_divergent_module == "rope"


def test_ltx2_config_the_engine_cannot_build_is_refused_by_name(sglang) -> None:
    from lab.engine.sglang.ltx2 import arch_config

    config = dict(lab.family("ltx2").build("tiny", 0).config)
    kwargs = arch_config(config)
    assert kwargs["apply_gated_attention"] and kwargs["cross_attention_adaln"]
    assert (
        kwargs["caption_proj_before_connector"] and kwargs["av_ca_timestep_scale_multiplier"] == 1
    )
    assert kwargs["positional_embedding_max_pos"] == [20, 2048, 2048]
    with pytest.raises(ValueError, match=r"audio_gated_attn=False.*one switch \(apply_gated"):
        arch_config({**config, "audio_gated_attn": False})
    with pytest.raises(ValueError, match=r"audio_sampling_rate=24000.*hard-codes 16000"):
        arch_config({**config, "audio_sampling_rate": 24000})
    with pytest.raises(ValueError, match=r"use_prompt_adaln_single=False"):
        arch_config({**config, "use_prompt_adaln_single": False})


def _cosmos3_fp32_engine(sglang, monkeypatch):
    """The engine's Cosmos3 DiT at fp32: its post-load step at target_dtype=fp32.

    sglang's loader calls post_load_weights() with its default bf16 (which casts embed_tokens,
    proj_in/out and the RMSNorms to bf16 whatever the DiT precision), and the class declares
    its embedding bf16; here the step runs at fp32 and the embedding gets the master back, so
    the engine's forward is compared with diffusers' at one precision.
    """
    from sglang.multimodal_gen.runtime.models.dits.cosmos3video import Cosmos3OmniTransformer

    from lab.engine.sglang.build import build_engine

    post_load = Cosmos3OmniTransformer.post_load_weights
    monkeypatch.setattr(
        Cosmos3OmniTransformer,
        "post_load_weights",
        lambda self, target_dtype=torch.float32: post_load(self, target_dtype),
    )
    fam = lab.family("cosmos3")
    model = fam.build("tiny", 0)
    engine = build_engine(model, sglang.engine_family("cosmos3"), "fp32")
    monkeypatch.undo()
    # The embedding is declared bf16 by the class: its values came back rounded.
    assert engine.weights["rounded_params"] == ["language_model.embed_tokens.weight"]
    engine.module.language_model.embed_tokens.weight.data.copy_(model.embed_tokens.weight)
    inputs = fam.make_inputs("tiny", 0, 1, False, sigma=0.75)
    inputs = inputs.replace_kwargs(vision_tokens=[inputs.kwargs["vision_tokens"][0].float()])
    return fam, model, inputs, engine


def test_cosmos3_engine_in_fp32_runs_the_text_pathway_bit_for_bit(sglang, monkeypatch) -> None:
    """The adapter's inputs (token ids, the engine's own mRoPE ids, the step's t) are right."""
    fam, model, inputs, engine = _cosmos3_fp32_engine(sglang, monkeypatch)
    result = sglang.pair_with_engine(engine, model, inputs, lab.Side.fp32_reference(fam))
    exact = {r.module for r in result.rows if not r.diverges}
    # Every module of the text (UND) pathway, and the vision input projection, bit-exact.
    und = {r.module for r in result.rows if r.module_a.startswith("language_model.")}
    assert len(und) == 21 and und <= exact
    assert {"embed_tokens", "proj_in"} <= exact
    # The vision (GEN) pathway starts from proj_in + the time embedding, which the engine
    # computes for one row where diffusers computes one per token (a GEMM of another shape).
    first = result.first_divergence()
    assert first.module == "layers.0.input_layernorm_moe_gen", result.describe()
    assert "inherited" in result.whys()[result.rows.index(first)].codes
    assert any(s.module == "time_embedder" and "(1, 64)" in s.reason for s in result.skipped)
    rel = result.output_metrics()["model_output_rel_max"]
    assert 0 < rel < 1e-5


def test_cosmos3_engine_refuses_a_precision_it_cannot_run(sglang) -> None:
    from lab.engine.sglang.build import build_engine

    fam = lab.family("cosmos3")
    model = fam.build("tiny", 0)
    engine = build_engine(model, sglang.engine_family("cosmos3"), "fp32")
    inputs = fam.make_inputs("tiny", 0, 1, False, sigma=0.75)
    with pytest.raises(ValueError, match=r"post_load_weights.*bf16 only.*dtype='bf16'"):
        engine.forward(inputs)


def test_cosmos3_emulated_rollout_is_the_engine_bit_for_bit(checks) -> None:
    check = checks["cosmos3"]
    result = check.engine_vs_rollout
    # No autocast: Cosmos3DenoisingStage runs its DiT without one (Cosmos3Config's inherited
    # enable_autocast is never read).
    assert check.engine.description()["autocast"] is False
    # The rollout's cosmos3_native group computes every named difference the engine's way.
    assert lab.Side.rollout(lab.family("cosmos3")).engine_ops == ("cosmos3_native",)
    # The differences from diffusers' stock classes stay named (the engine vs the trainer),
    # each reproduced by the rollout's group.
    assert check.engine.spec.differences
    assert all("'cosmos3_native'" in why for why in check.engine.spec.differences.values())
    summary = result.summary()
    assert summary["pairs"] == summary["bitexact_pairs"] == 45, check.describe()
    assert result.first_divergence() is None
    assert result.output_metrics()["model_output_rel_max"] == 0
    # The time embedding pairs too: one row for the step's t, as the engine embeds it.
    rows = {r.module: r for r in result.rows}
    assert {"time_embedder.linear_1", "time_embedder.linear_2"} <= set(rows)
    # The projections fused in the engine pair piece by piece.
    fused = {r.module: r.module_a for r in result.rows}
    assert fused["layers.0.self_attn.add_k_proj"] == "gen_layers.0.cross_attention.to_qkv[2/3]"
    assert fused["layers.1.mlp_moe_gen.up_proj"] == "gen_layers.1.mlp.gate_up_proj[2/2]"
    # The loader rounds the time embedder to bf16 before widening it to fp32 again.
    weights = check.engine.weights
    assert sorted(weights["rounded_params"]) == sorted(weights["fp32_params"])
    assert len(weights["rounded_params"]) == 4
    # The engine drops diffusers' lm_head and text-final norm.
    unaligned_b = result.meta["alignment"]["unaligned_b"]
    assert unaligned_b["lm_head"].startswith("the engine's parameter mapping drops")


def test_cosmos3_rollout_without_its_group_differs_from_the_first_norm(sglang) -> None:
    """The stock diffusers forward at bf16: the engine's RMSNorm rounds once, diffusers twice."""
    check = sglang.check_emulation("cosmos3", rollout={"engine_ops": ()})
    result = check.engine_vs_rollout
    assert [r.module for r in result.rows if not r.diverges] == ["embed_tokens", "proj_in"]
    assert result.first_divergence().module == "layers.0.input_layernorm"
    # diffusers embeds one t per token: those rows do not pair with the engine's one row.
    assert any(s.module == "time_embedder" and "(1, 64)" in s.reason for s in result.skipped)
    rel = result.output_metrics()["model_output_rel_max"]
    assert 1e-3 < rel < 5e-2


@pytest.fixture(scope="module")
def minimax(sglang):
    from lab.engine.sglang.build import build_engine

    fam = lab.family("minimax_h3")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0, 1, False, sigma=0.75)
    return fam, model, inputs, build_engine(model, sglang.engine_family("minimax_h3"))


def test_minimax_h3_engine_inputs_are_the_stages_packing(minimax) -> None:
    _, model, inputs, engine = minimax
    kw, lab_kw = engine.forward_kwargs(inputs), inputs.kwargs
    # [text 8 | audio 74 | video 42] = 124 rows, padded to 128 as a second cu_seqlens segment.
    assert kw["x"].shape == (1, 128, 96) and kw["audio_x"].shape == (1, 128, 32)
    assert kw["packed_seq_params"]["cu_seqlens_q_host"] == (0, 124, 128)
    # Its stage runs its own loop with no autocast (the pipeline config's enable_autocast is
    # True): under CPU autocast its fp32 input heads would run in bf16.
    assert engine.description()["autocast"] is False
    assert torch.equal(kw["x"][0, lab_kw["video_indices"]], lab_kw["hidden_states"][0])
    assert torch.equal(kw["audio_x"][0, lab_kw["audio_indices"]], lab_kw["audio_hidden_states"][0])
    assert kw["x"][0, 124:].abs().sum() == 0
    # The step's distinct t and each row's index are the ones diffusers is given; the pad rows
    # take the video t and (tag -1 clamped) the video AdaLN row.
    assert torch.equal(kw["unique_timesteps"], lab_kw["timestep"])
    assert torch.equal(kw["inverse_indices"][:124], lab_kw["timestep_indices"])
    video_t = lab_kw["timestep_indices"][lab_kw["video_indices"][0]]
    assert (kw["inverse_indices"][124:] == video_t).all()
    assert torch.equal(kw["block_token_tags"][:124], lab_kw["token_tags"])
    assert (kw["block_token_tags"][124:] == 0).all()
    assert torch.equal(kw["img_position_ids"][0, :124], lab_kw["position_ids"].float())
    # The SwiGLU rows were loaded [gate, value] from diffusers' [value, gate].
    value, gate = model.transformer_blocks[0].ff.net[0].proj.weight.chunk(2)
    fc1 = engine.module.blocks[0].mlp.fc1.weight
    assert torch.equal(fc1, torch.cat((gate, value)).to(fc1.dtype))


def test_minimax_h3_inputs_the_engine_cannot_take_are_refused_by_name(sglang, minimax) -> None:
    from lab.engine.sglang.build import build_engine

    fam, model, inputs, engine = minimax
    moved = inputs.kwargs["position_ids"].clone()
    moved[:, 0] += 1.0
    with pytest.raises(ValueError, match=r"position_ids are not the engine's t2va packing"):
        engine.forward_kwargs(inputs.replace_kwargs(position_ids=moved))
    two = fam.make_inputs("tiny", 0, 2, False, sigma=0.75)
    with pytest.raises(ValueError, match=r"batch 2, but the engine's DiT takes one packed"):
        engine.forward_kwargs(two)
    fp32 = build_engine(model, sglang.engine_family("minimax_h3"), "fp32")
    with pytest.raises(ValueError, match=r"hard-codes its precision.*dtype='bf16'"):
        fp32.forward_kwargs(inputs)


def test_minimax_h3_emulation_is_bit_exact_at_seed_1_sigma_031(sglang) -> None:
    """Another step: video t 0.69, audio t from its shift-3 grid, two distinct values."""
    check = sglang.check_emulation("minimax_h3", seed=1, sigma=0.31)
    result = check.engine_vs_rollout
    assert result.first_divergence() is None, result.describe()
    summary = result.summary()
    assert summary["bitexact_pairs"] == summary["pairs"] == 79
    assert [r.metrics.numel for r in result.root_rows()] == [42 * 96, 74 * 32]
    # The only aligned outputs not paired: the RoPE (the engine returns the angles, diffusers
    # cos and sin) and the final AdaLN (the engine's wrapper returns its two chunks).
    assert {s.module for s in result.skipped if "aligned with" in s.reason} == {
        "rope",
        "norm_out.linear",
    }
    # The engine against the trainer: the same gap as the emulated rollout's, first at the
    # trainer's autocast bf16 input projection.
    engine, emulated = check.engine_vs_trainer, check.rollout_vs_trainer
    assert engine.first_divergent_module == emulated.first_divergent_module == "proj_in"
    rel = engine.output_metrics()["model_output_rel_max"]
    assert 1e-3 < rel == emulated.output_metrics()["model_output_rel_max"] < 0.1


def test_minimax_h3_output_view_takes_the_real_rows_of_the_padded_sequence() -> None:
    from lab.engine.sglang.minimax_h3 import output_view

    packed = torch.arange(128 * 4, dtype=torch.float32).reshape(128, 4)
    rows = output_view("blocks.0", packed, torch.zeros(1, 124, 4))
    assert rows.shape == (1, 124, 4) and torch.equal(rows[0], packed[:124])
    assert output_view("blocks.0", packed[:42], torch.zeros(1, 42, 4)).shape == (1, 42, 4)
    # Not the padded length (128 rows for 60): left as it is, reported as a shape difference.
    assert output_view("blocks.0", packed, torch.zeros(1, 60, 4)).shape == (128, 4)
    swapped = output_view("blocks.0.mlp.fc1", packed, torch.zeros(1, 124, 4))
    assert torch.equal(swapped[0, :, :2], packed[:124, 2:])


def test_engine_weights_are_the_lab_models_cast_by_the_engines_loader(checks) -> None:
    for name, check in checks.items():
        weights = check.engine.weights
        assert weights["equal"] == weights["parameters"] > 0, name
    # SD3's pos_embed table is built fp32 by its class; the engine's loader keeps it.
    assert checks["sd3"].engine.weights["fp32_params"] == ["pos_embed.pos_embed"]


def test_unsupported_family_is_refused_with_the_reason(sglang, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"unknown family 'flx'.*Did you mean 'flux'"):
        sglang.engine_family("flx")
    # Every lab family has an adapter with sglang 0.5.23; a family without one is refused
    # naming the reason (the mechanism, on a stand-in entry).
    assert sglang.UNSUPPORTED == {}
    monkeypatch.setitem(sglang.UNSUPPORTED, "flux", "no adapter for this engine release")
    with pytest.raises(ValueError, match=r"family .flux. is not supported.*no adapter for this"):
        sglang.engine_family("flux")


def test_cli_pairs_the_engine_against_the_trainer(sglang, tmp_path) -> None:
    from lab.views.cli import main

    out = tmp_path / "engine"
    code = main(["pair", "--engine", "sglang", "--family", "flux", "--out-dir", str(out)])
    assert code == 0
    result = lab.Result.from_json(out / "results.json")
    assert result.side_a["name"] == "sglang" and result.side_b["name"] == "trainer"
    assert result.meta["alignment"]["counts"]["same"] > 100
    assert any(r.module_a for r in result.rows)
    assert main(["pair", "--engine", "sglang", "--family", "flux", "--rollout-overrides",
                 '{"autocast": true}', "--out-dir", str(out)]) == 2  # fmt: skip


def test_a_dump_written_inside_the_engine_pairs_against_the_trainer(sglang, tmp_path) -> None:
    from lab.engine.dump import DumpError, attach
    from lab.engine.sglang.build import build_engine

    fam = lab.family("flux")
    model = fam.build("tiny", 0)
    inputs = fam.make_inputs("tiny", 0)
    engine = build_engine(model, sglang.engine_family("flux"))
    with attach(engine.module, tmp_path / "dump"):
        engine.forward(inputs)
    trainer = lab.Side.trainer(fam)
    from_dump = sglang.pair_engine_dump(tmp_path / "dump", engine, model, inputs, trainer)
    live = sglang.pair_with_engine(engine, model, inputs, trainer)
    assert from_dump.meta["dump_checks"]["weights"] == "match"
    assert [r.label() for r in from_dump.rows] == [r.label() for r in live.rows]
    assert [r.metrics.max_abs_diff for r in from_dump.rows] == [
        r.metrics.max_abs_diff for r in live.rows
    ]
    assert from_dump.first_divergent_module == live.first_divergent_module
    # Other weights: refused by the fingerprints, or flagged when allowed.
    other = fam.build("tiny", 1)
    with pytest.raises(DumpError, match="ran with other weights"):
        sglang.pair_engine_dump(tmp_path / "dump", engine, other, inputs, trainer)
    flagged = sglang.pair_engine_dump(
        tmp_path / "dump", engine, other, inputs, trainer, allow_mismatch=True
    )
    assert flagged.meta["dump_checks"]["weights"] == "differ" and flagged.meta["dump_mismatch"]


@pytest.mark.parametrize(
    "family_name", ["flux", "ltx2", "minimax_h3", "qwen_image", "sd3", "wan2_2"]
)
def test_notebook_12_pairs_the_engine_and_checks_the_emulation(
    sglang, family_name: str, tmp_path
) -> None:
    import json

    import nbformat

    from lab.views.notebooks import execute_notebook
    from tests.test_notebooks import NOTEBOOKS, _check_clean_with_figures

    out = tmp_path / "executed.ipynb"
    execute_notebook(
        NOTEBOOKS / "12_real_engine.ipynb",
        out,
        {"family": family_name, "out_dir": str(tmp_path / "run")},
        cwd=tmp_path,
    )
    nb = nbformat.read(out, as_version=4)
    _check_clean_with_figures(nb)
    data = json.loads((tmp_path / "run" / "engine_vs_trainer.json").read_text())
    assert data["side_a"]["name"] == "sglang" and data["side_b"]["name"] == "trainer"
    assert data["meta"]["alignment"]["counts"]["same"] > 20
    table = (tmp_path / "run" / "emulation.csv").read_text().splitlines()
    assert len(table) == 4 and table[1].startswith(f"{family_name},engine vs emulated rollout")
    assert (tmp_path / "run" / "divergence_by_layer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""Wan2.2-T2V-A14B (diffusers WanTransformer3DModel x2). Each expert: 40 blocks, 40 heads x 128."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab.families._family import Family, Inputs, SamplerSettings

# The Wan2.1 VAE that A14B uses (and the pipeline's fallback when it has no VAE): 4x in time,
# 8x in space.
_VAE_SCALE_TEMPORAL, _VAE_SCALE_SPATIAL = 4, 8

# Both A14B experts (transformer/ and transformer_2/) share this config; it equals the class
# defaults, spelled out so a diffusers default change cannot move the preset.
_A14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
    added_kv_proj_dim=None, rope_max_seq_len=1024, pos_embed_seq_len=None,
)  # fmt: skip


# The Wan2.1 tiny config: A14B's experts use the same block class. Head dim 12 splits into
# 4 + 4 + 4 RoPE channels (t, h, w).
_TINY = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
    out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
    rope_max_seq_len=32,
)  # fmt: skip

# The pipeline's 480p default: 81 frames at 480 x 832 -> latents (B, 16, 21, 60, 104), 32760
# tokens after the 1x2x2 patch. umT5 output is padded to 512 tokens; the prompt lengths are
# illustrative (a short caption; Wan's long default negative prompt).
_480P = dict(num_frames=81, height=480, width=832, text_len=512, prompt_len=32,
             negative_prompt_len=96)  # fmt: skip


def _umt5_embeds(
    batch: int, text_len: int, prompt_len: int, text_dim: int, gen: torch.Generator
) -> torch.Tensor:
    """umT5 output as the pipeline hands it: `prompt_len` real tokens, zeros up to `text_len`."""
    embeds = torch.zeros(batch, text_len, text_dim)
    embeds[:, :prompt_len] = torch.randn(batch, prompt_len, text_dim, generator=gen)
    return embeds


def make_inputs(
    config: Mapping[str, Any],
    geometry: Mapping[str, Any],
    *,
    batch: int,
    cfg: bool,
    gen: torch.Generator,
    dtype: torch.dtype,
    sigma: float,
    latents: torch.Tensor | None,
) -> Inputs:
    """Latents (B, C, F/4+1, H/8, W/8) at `dtype`; fp32 umT5 text (B, 512, text_dim); fp32 t (B,).

    The rollout casts the latent to the forward dtype but hands the zero-padded umT5 embeddings
    over in fp32 and keeps the raw timestep fp32 (the record's paired sglang-d dumps). The
    diffusers WanPipeline instead casts the text to the transformer dtype, so a bf16 model run
    without autocast cannot take these inputs: cast `encoder_hidden_states` first, or run the
    forward under autocast as both the engine and the trainer do. CFG is a second forward on the
    same latents and timestep, returned as `negative`.

    Raises:
        ValueError: If given `latents` are not shaped (batch, C, F, H, W) for this geometry.
    """
    c = config["in_channels"]
    f = (geometry["num_frames"] - 1) // _VAE_SCALE_TEMPORAL + 1
    h, w = geometry["height"] // _VAE_SCALE_SPATIAL, geometry["width"] // _VAE_SCALE_SPATIAL
    text_len, text_dim = geometry["text_len"], config["text_dim"]
    if latents is None:
        latents = torch.randn(batch, c, f, h, w, generator=gen)
    elif tuple(latents.shape) != (batch, c, f, h, w):
        raise ValueError(
            f"wan2_2 make_inputs: latents have shape {tuple(latents.shape)}, expected "
            f"{(batch, c, f, h, w)} (batch, in_channels, latent frames, height/8, width/8)."
        )
    pos_text = _umt5_embeds(batch, text_len, geometry["prompt_len"], text_dim, gen)
    # Flow-GRPO steps a flow-matching SDE, so the rollout presents t = sigma * 1000 as a float.
    # The shipped UniPC pipeline passes int64 timesteps instead; that path is not modelled here.
    t = torch.tensor(sigma * 1000.0, dtype=torch.float32)
    sample = latents.to(dtype)
    roles = dict(
        hidden_states="latents",
        encoder_hidden_states="cond",
        timestep="timestep",
        return_dict="aux",
    )
    negative = None
    if cfg:
        neg_text = _umt5_embeds(batch, text_len, geometry["negative_prompt_len"], text_dim, gen)
        negative = Inputs(
            kwargs=dict(
                hidden_states=sample.clone(),
                encoder_hidden_states=neg_text,
                timestep=t.expand(batch).clone(),
                return_dict=False,
            ),
            roles=dict(roles),
            sigma=sigma,
        )
    return Inputs(
        kwargs=dict(
            hidden_states=sample,
            encoder_hidden_states=pos_text,
            timestep=t.expand(batch).clone(),
            return_dict=False,
        ),
        roles=roles,
        negative=negative,
    )


FAMILY = Family(
    name="wan2_2",
    title="Wan2.2-T2V-A14B",
    model_class="WanTransformer3DModel",
    block_classes=("WanTransformerBlock",),
    presets={"tiny": _TINY, "reduced": {**_A14B, "num_layers": 2}, "full": _A14B},
    geometry={
        # 9 frames at 64 x 64 -> latents (B, 4, 3, 8, 8); 7 prompt tokens zero-padded to 12.
        "tiny": dict(
            num_frames=9, height=64, width=64, text_len=12, prompt_len=7, negative_prompt_len=5
        ),
        "reduced": _480P,
        "full": _480P,
    },
    # WanPipeline ships UniPCMultistepScheduler(flow_shift=...); Flow-GRPO's Wan recipes step
    # FlowMatchEulerDiscreteScheduler with the same shift instead (the SDE needs an Euler grid).
    # 12.0 is Wan2.2-T2V-A14B's sample_shift (wan/configs/wan_t2v_A14B.py); diffusers' Wan2.1
    # docs use 3.0 at 480p and 5.0 at 720p. Pass shift= to sigma_schedule to try another.
    sampler=SamplerSettings(
        scheduler_config=dict(shift=12.0),
        notes="UniPC in the shipped pipeline; Euler with the same shift for the SDE.",
    ),
    make_inputs_fn=make_inputs,
    timestep_presentation="t",
    cfg_layout="separate",
    cfg_scale=5.0,  # WanPipeline's guidance_scale default
    experts=("high_noise", "low_noise"),
    # WanPipeline(boundary_ratio=0.875) runs the high-noise expert while t >= 0.875 * 1000; with
    # flow-matching t = sigma * 1000 that is sigma >= 0.875, as expert_for_sigma compares.
    expert_boundary=0.875,
    rollout_dtype="bf16",
    # The record's TrainPipelineConfig: the rollout casts the latent, passes the umT5 embeds fp32
    # and keeps t fp32 (a later config declares none).
    input_dtype_policy={"latents": "default", "cond": None, "timestep": "fp32"},
    # sglang runs Wan's DiT under autocast (its pipeline config's enable_autocast) and hands it
    # the fp32 umT5 text. The emulation runs without autocast: the engine's Wan code casts
    # explicitly wherever its autocast would act, except its first text linear, whose fp32
    # input autocast rounds to bf16, which this boundary cast does instead (as diffusers'
    # WanPipeline casts). lab.engine.sglang.check_emulation: bit-exact with the engine either
    # way, under CPU or CUDA autocast lists or none (tests/test_engine_sglang.py).
    engine_input_dtype_policy={"latents": "default", "cond": "default", "timestep": "fp32"},
    # The record's FSDP plan. scale_shift_table and time_embedder were once pinned too, then
    # dropped: sglang-d loads them in bf16, and pinning them left blocks.0's output 1.45e-2 off.
    param_dtype_rules={"*.norm2.*": "fp32"},
    # The plan's norm2, the condition embedder (time MLP, time_proj modulation, text MLP), the
    # patch embedding and the head. Not the scale_shift_tables nor the q/k RMSNorms: sglang
    # holds both at bf16 (see param_dtype_rules above), so pinning them adds a trainer-only
    # difference (tiny at a production width's rounding, wan_norm_path="fused" on both sides,
    # trained init, median of seeds 0-3: 6.0e-3 and 5.5e-3 where these give 0).
    fp32_rule_suggestions={
        "*.norm2.*": "fp32",
        "condition_embedder.*": "fp32",
        "patch_embedding.*": "fp32",
        "proj_out.*": "fp32",
    },
    # sglang keeps every FP32LayerNorm's affine params fp32 (norm2 is the only one with params;
    # norm1/norm3 are affine-free, listed so a from_pretrained-like cast treats them as diffusers'
    # keep list does). scale_shift_table and time_embedder are loaded in bf16, unlike diffusers'
    # _keep_in_fp32_modules. rope holds only non-persistent tables the engine computes in fp32;
    # listing it stops a `.to(bf16)` emulation from rounding them. The `wan` group runs sglang
    # 0.5.23's norm + modulation ops as its CUDA dispatch places them (the torch definitions at
    # the tiny width, its fused kernels' rounding at D % 256 == 0), its q/k RMSNorm and its
    # bf16 root table + temb sum; RoPE rotates in fp32 as its GPU kernels do.
    engine_ops=("wan",),
    engine_fp32_modules=("norm1", "norm2", "norm3", "rope"),
    notes=(
        "At the tiny width sglang runs its norms' torch definitions, which round the LayerNorm "
        "output before the modulation and norm2 the unrounded residual: the rollout differs "
        "from the trainer's fp32-once blocks from blocks.0.norm1 on. At a production width "
        "(fused kernels, `wan_norm_path='fused'` at tiny) the rollout matches a trainer whose "
        "umT5 text enters at the DiT dtype bit for bit; fed fp32 text, diffusers ties temb to "
        "it and the trainer's root table + temb sum skips the engine's bf16 rounding."
    ),
)

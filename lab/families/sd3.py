"""SD3.5 (diffusers SD3Transformer2DModel). Medium: 24 layers, 24 heads x 64; Large a variant."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab.families._family import Family, Inputs, SamplerSettings

_TINY = dict(
    sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
    attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
    caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=96,
    dual_attention_layers=(0,), qk_norm="rms_norm",
)  # fmt: skip
_LARGE = dict(num_attention_heads=38, caption_projection_dim=2432, pos_embed_max_size=192,
              dual_attention_layers=())  # fmt: skip
# Large at tiny differs from tiny the way Large differs from Medium: ~1.6x the heads (38 vs 24)
# at the same head dim, the caption projection at the new width, half the positional table, no
# dual-attention (attn2) block. Three layers still give a plain and the context_pre_only block.
_TINY_LARGE = dict(num_attention_heads=6, caption_projection_dim=48, pos_embed_max_size=48,
                   dual_attention_layers=())  # fmt: skip
_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
    attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
    caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)  # fmt: skip


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
    """Latents (B, C, H/8, W/8), text (B, 77+256, joint_dim), pooled (B, pooled), raw t (B,).

    The SD3 pipeline casts latents and prompt embeddings to the transformer dtype, concatenates
    CFG as [negative, positive] and passes `t.expand(B)` with t = sigma * 1000 in fp32.
    """
    c, h, w = config["in_channels"], geometry["height"] // 8, geometry["width"] // 8
    text_len, joint, pooled = (
        geometry["text_len"],
        config["joint_attention_dim"],
        config["pooled_projection_dim"],
    )
    # Always draw the noise, so the conditioning below is the same whether latents are given.
    drawn = torch.randn(batch, c, h, w, generator=gen)
    if latents is None:
        latents = drawn
    elif tuple(latents.shape) != tuple(drawn.shape):
        raise ValueError(
            f"sd3 make_inputs: latents shape {tuple(latents.shape)} != {tuple(drawn.shape)}."
        )
    pos_text = torch.randn(batch, text_len, joint, generator=gen)
    pos_pooled = torch.randn(batch, pooled, generator=gen)
    if cfg:
        neg_text = torch.randn(batch, text_len, joint, generator=gen)
        neg_pooled = torch.randn(batch, pooled, generator=gen)
        text, pooled_proj = torch.cat([neg_text, pos_text]), torch.cat([neg_pooled, pos_pooled])
        sample = torch.cat([latents, latents])
    else:
        text, pooled_proj, sample = pos_text, pos_pooled, latents
    # The scheduler computes t = sigmas * 1000 in fp32.
    t = torch.tensor(sigma, dtype=torch.float32) * 1000
    return Inputs(
        kwargs=dict(
            hidden_states=sample.to(dtype),
            encoder_hidden_states=text.to(dtype),
            pooled_projections=pooled_proj.to(dtype),
            timestep=t.expand(sample.shape[0]).clone(),
            return_dict=False,
        ),
        roles=dict(
            hidden_states="latents",
            encoder_hidden_states="cond",
            pooled_projections="cond",
            timestep="timestep",
            return_dict="aux",
        ),
    )


FAMILY = Family(
    name="sd3",
    title="SD3.5-Medium",
    model_class="SD3Transformer2DModel",
    block_classes=("JointTransformerBlock",),
    presets={
        # Three layers give every JointTransformerBlock kind: dual-attention, plain, and the
        # last context_pre_only block.
        "tiny": _TINY,
        # Real width; two dual-attention blocks, two plain ones, then the context_pre_only block.
        "reduced": {**_MEDIUM, "num_layers": 5, "dual_attention_layers": (0, 1)},
        "full": _MEDIUM,
    },
    variants={
        "large": {
            "tiny": _TINY_LARGE,
            "reduced": {**_LARGE, "num_layers": 5},
            "full": {**_LARGE, "num_layers": 38},
        }
    },
    geometry={
        "tiny": dict(height=128, width=128, text_len=12),
        # 1024 x 1024 -> 128 x 128 x 16 latents; 77 CLIP + 256 T5 tokens.
        "reduced": dict(height=1024, width=1024, text_len=333),
        "full": dict(height=1024, width=1024, text_len=333),
    },
    # StableDiffusion3Pipeline: the scheduler's own grid (no sigmas passed), shift 3.0 from
    # stabilityai/stable-diffusion-3.5-medium scheduler_config.json; Flow-GRPO uses it as is.
    sampler=SamplerSettings(scheduler_config=dict(shift=3.0)),
    make_inputs_fn=make_inputs,
    timestep_presentation="t",
    cfg_layout="batched",
    cfg_scale=7.0,  # StableDiffusion3Pipeline's guidance_scale default
    # The SD3 Flow-GRPO recipe runs fp16 on both sides.
    rollout_dtype="fp16",
    input_dtype_policy={"latents": None, "cond": None, "timestep": None},
    param_dtype_rules={},
    # Norm1 / norm1_context / norm_out LayerNorms are affine-free: the norms with parameters are
    # the q/k RMSNorms (attn, attn2 and the added context stream).
    fp32_rule_suggestions={
        "*.norm_q.*": "fp32",
        "*.norm_k.*": "fp32",
        "*.norm_added_*": "fp32",
        "*.norm1.linear.*": "fp32",  # adaLN-Zero modulation (6 or 9 chunks)
        "*.norm1_context.linear.*": "fp32",
        "norm_out.linear.*": "fp32",
        "pos_embed.*": "fp32",  # the patch conv (the positional table is a buffer)
        "time_text_embed.*": "fp32",
        "context_embedder.*": "fp32",
        "proj_out.*": "fp32",
    },
    engine_ops=("sgld",),
    engine_fp32_modules=(),
    notes="No FSDP plan overrides; the engine's sgld patch group is the SD3-shaped one.",
)

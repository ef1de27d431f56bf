"""Flux.1-dev (diffusers FluxTransformer2DModel): 19 double + 38 single blocks, 24 heads x 128."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab.families._family import Family, Inputs, SamplerSettings

# The public Flux.1-dev transformer config (out_channels unset = in_channels).
_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip

# Two double-stream and two single-stream blocks; the RoPE axes (4, 6, 6) sum to the head dim.
_TINY = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)  # fmt: skip

_VAE_SCALE = 8
"""FluxPipeline.vae_scale_factor: 2 ** (len(vae block_out_channels) - 1) for the Flux VAE."""
_GUIDANCE_SCALE = 3.5
"""FluxPipeline's default guidance_scale: the distilled guidance Flux.1-dev embeds."""


def _pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """FluxPipeline._pack_latents: (B, C, H, W) -> (B, (H/2)(W/2), 4C), 2x2 patches channel-last."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def _latent_image_ids(height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """FluxPipeline._prepare_latent_image_ids: (h*w, 3) rows (0, row, col), built fp32, cast."""
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(width)[None, :]
    return ids.reshape(height * width, 3).to(dtype)


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
    """Packed latents (B, (H/16)(W/16), in_ch), T5 text (B, 512, joint), CLIP pooled (B, pooled).

    FluxPipeline draws (B, in_ch/4, H/8, W/8) noise and packs 2x2 patches into channels; the
    latents, T5 embeddings and CLIP pooled projection are all in the transformer dtype. It
    passes `timestep = t.expand(B).to(latents.dtype) / 1000` (t = sigma*1000 in fp32 from the
    scheduler, so t is rounded to the latent dtype before the divide), `guidance =
    full([1], 3.5, fp32).expand(B)`, `img_ids` (N, 3) in the latent dtype and `txt_ids` (L, 3)
    zeros. The transformer multiplies timestep and guidance by 1000 after casting them to the
    hidden-state dtype.

    Raises:
        ValueError: If `cfg` is asked for (Flux.1-dev is guidance-distilled), or `latents` do not
            have the packed shape (B, N, in_channels).
    """
    if cfg:
        raise ValueError(
            "flux: cfg=True asked for, but Flux.1-dev is guidance-distilled: its pipeline runs one "
            "forward per step and has no unconditional branch; the guidance scale enters the "
            f"model as the `guidance` input ({_GUIDANCE_SCALE}, a 'timestep'-role kwarg). Call "
            "make_inputs with cfg=False."
        )
    in_ch = config["in_channels"]
    # prepare_latents: 2 * (H // (vae_scale * 2)) keeps the latent grid even for the packing.
    h = 2 * (geometry["height"] // (_VAE_SCALE * 2))
    w = 2 * (geometry["width"] // (_VAE_SCALE * 2))
    text_len, joint = geometry["text_len"], config["joint_attention_dim"]
    # Noise is always drawn, so the same seed gives the same conditioning whether or not the
    # caller hands in the latents of a later step.
    noise = _pack_latents(torch.randn(batch, in_ch // 4, h, w, generator=gen))
    if latents is None:
        latents = noise
    elif tuple(latents.shape) != tuple(noise.shape):
        raise ValueError(
            f"flux: latents of shape {tuple(latents.shape)} given, expected the packed model "
            f"layout {tuple(noise.shape)} (batch, tokens, in_channels) for this geometry."
        )
    text = torch.randn(batch, text_len, joint, generator=gen)
    pooled = torch.randn(batch, config["pooled_projection_dim"], generator=gen)
    # FlowMatchEulerDiscreteScheduler: timesteps = sigmas (fp32) * num_train_timesteps.
    t = torch.tensor(sigma, dtype=torch.float32) * 1000
    return Inputs(
        kwargs=dict(
            hidden_states=latents.to(dtype),
            encoder_hidden_states=text.to(dtype),
            pooled_projections=pooled.to(dtype),
            timestep=t.expand(batch).to(dtype) / 1000,
            guidance=torch.full([1], _GUIDANCE_SCALE, dtype=torch.float32).expand(batch),
            img_ids=_latent_image_ids(h // 2, w // 2, dtype),
            # encode_prompt builds them in the text encoder's dtype (= the pipeline dtype).
            txt_ids=torch.zeros(text_len, 3, dtype=dtype),
            return_dict=False,
        ),
        roles=dict(
            hidden_states="latents",
            encoder_hidden_states="cond",
            pooled_projections="cond",
            timestep="timestep",
            guidance="timestep",
            img_ids="aux",
            txt_ids="aux",
            return_dict="aux",
        ),
    )


FAMILY = Family(
    name="flux",
    title="Flux.1-dev",
    model_class="FluxTransformer2DModel",
    block_classes=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    presets={
        "tiny": _TINY,
        # Real width; two blocks of each kind.
        "reduced": {**_DEV, "num_layers": 2, "num_single_layers": 2},
        "full": _DEV,
    },
    geometry={
        # 128 x 128 -> 16 x 16 x 4 latents -> 64 packed tokens of 16 channels.
        "tiny": dict(height=128, width=128, text_len=12),
        # 1024 x 1024 -> 128 x 128 x 16 latents -> (B, 4096, 64) packed; the T5 prompt is always
        # padded to max_sequence_length = 512 (no attention mask).
        "reduced": dict(height=1024, width=1024, text_len=512),
        "full": dict(height=1024, width=1024, text_len=512),
    },
    # FluxPipeline: sigmas = np.linspace(1, 1/N, N) in float64, mu = calculate_shift(image_seq_len)
    # with the FLUX.1-dev scheduler config (dynamic shifting, 256 -> 4096 tokens, 0.5 -> 1.15).
    sampler=SamplerSettings(
        scheduler_config=dict(
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
            shift=3.0,
        ),
        pipeline_sigmas=True,
    ),
    make_inputs_fn=make_inputs,
    timestep_presentation="t/1000",
    # Guidance-distilled: the scale is an input. (FluxPipeline's optional true CFG,
    # true_cfg_scale > 1 with a negative prompt, is not part of the Flux.1-dev recipe.)
    cfg_layout="none",
    rollout_dtype="bf16",
    # Not in the record: passthrough, i.e. exactly what FluxPipeline hands the transformer
    # (latents and text already in the transformer dtype, guidance fp32).
    input_dtype_policy={"latents": None, "cond": None, "timestep": None},
    param_dtype_rules={},
    # The block LayerNorms are affine-free: the norms with parameters are the q/k RMSNorms.
    fp32_rule_suggestions={
        "*.norm_q.*": "fp32",
        "*.norm_k.*": "fp32",
        "*.norm_added_*": "fp32",
        "*.norm1.linear.*": "fp32",  # double-stream adaLN-Zero modulation
        "*.norm1_context.linear.*": "fp32",
        "single_transformer_blocks.*.norm.linear.*": "fp32",
        "norm_out.linear.*": "fp32",
        "x_embedder.*": "fp32",
        "time_text_embed.*": "fp32",  # timestep, guidance and pooled-text embedders
        "context_embedder.*": "fp32",
        "proj_out.*": "fp32",
    },
    # FluxTransformer2DModel._keep_in_fp32_modules is None: a bf16 load keeps nothing in fp32.
    engine_fp32_modules=(),
    engine_ops=("flux_native",),
    # The engine's denoising stage hands the DiT the scheduler's fp32 t (sigma * 1000) with no
    # cast; diffusers' pipeline rounds it to bf16 first (750 -> 752).
    engine_op_switches={"timestep_from": "scheduler"},
    notes=(
        "The model casts timestep and guidance to the hidden dtype before its *1000, so in bf16 "
        "guidance 3.5 enters as 3504 (not 3500) and t rounds likewise: a ~4% bf16-vs-fp32 output "
        "gap on tiny random weights that is inherent to the model, not the harness. The engine "
        "feeds its time embedding the scheduler's fp32 t instead (the rollout's "
        "timestep_from='scheduler'): 750 vs 752 alone moves the tiny output by 9% (rel_max)."
    ),
)

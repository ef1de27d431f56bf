"""Qwen-Image (diffusers QwenImageTransformer2DModel): 60 dual-stream layers x 24 heads x 128."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab.families._family import Family, Inputs, SamplerSettings

# The public Qwen-Image transformer config. The newer switches (zero_cond_t,
# use_additional_t_cond, use_layer3d_rope: Edit-2511 / Layered) stay at their False defaults.
_QWEN_IMAGE = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)  # fmt: skip

# Two dual-stream blocks (the only block kind); the RoPE axes (8, 4, 4) sum to the head dim.
_TINY = dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
    num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
)  # fmt: skip

_VAE_SCALE = 8
"""QwenImagePipeline.vae_scale_factor: 2 ** len(vae.temperal_downsample) for the Qwen VAE."""


def _pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """QwenImagePipeline._pack_latents: (B, 1, C, H, W) -> (B, (H/2)(W/2), 4C)."""
    b, _, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


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
    """Packed latents (B, (H/16)(W/16), in_ch), Qwen2.5-VL text (B, L, joint), t/1000 (B,).

    QwenImagePipeline draws (B, 1, in_ch/4, H/8, W/8) noise and packs 2x2 patches into channels;
    latents and prompt embeddings are in the transformer dtype. It passes `timestep =
    t.expand(B).to(latents.dtype) / 1000` (t = sigma*1000 in fp32 from the scheduler, rounded to
    the latent dtype before the divide), `img_shapes = [[(1, H/16, W/16)]] * B` for the RoPE and
    `guidance=None`. True CFG (true_cfg_scale > 1 with a negative prompt) is a second forward
    with the same latents and timestep and the negative prompt's own embeddings: returned as
    `negative`.

    Raises:
        ValueError: If `latents` do not have the packed shape (B, N, in_channels).
    """
    in_ch = config["in_channels"]
    # prepare_latents: 2 * (H // (vae_scale * 2)) keeps the latent grid even for the packing.
    h = 2 * (geometry["height"] // (_VAE_SCALE * 2))
    w = 2 * (geometry["width"] // (_VAE_SCALE * 2))
    joint = config["joint_attention_dim"]
    # Noise is always drawn, so the same seed gives the same conditioning whether or not the
    # caller hands in the latents of a later step.
    noise = _pack_latents(torch.randn(batch, 1, in_ch // 4, h, w, generator=gen))
    if latents is None:
        latents = noise
    elif tuple(latents.shape) != tuple(noise.shape):
        raise ValueError(
            f"qwen_image: latents of shape {tuple(latents.shape)} given, expected the packed model "
            f"layout {tuple(noise.shape)} (batch, tokens, in_channels) for this geometry."
        )
    pos_text = torch.randn(batch, geometry["text_len"], joint, generator=gen)
    # FlowMatchEulerDiscreteScheduler: timesteps = sigmas (fp32) * num_train_timesteps.
    t = torch.tensor(sigma, dtype=torch.float32) * 1000
    # Both branches share the latents, timestep and img_shapes, as the pipeline's two calls do.
    hidden = latents.to(dtype)
    timestep = t.expand(batch).to(dtype) / 1000
    img_shapes = [[(1, h // 2, w // 2)]] * batch
    roles = dict(
        hidden_states="latents",
        timestep="timestep",
        # encode_prompt drops an all-ones mask (`if prompt_embeds_mask.all(): None`), and every
        # row here is a full-length prompt, so the pipeline passes None. Kept as a kwarg so a
        # study can hand in an explicit mask (the one that blocks the flash attention path).
        encoder_hidden_states_mask="aux",
        encoder_hidden_states="cond",
        img_shapes="aux",
        return_dict="aux",
    )

    def branch(text: torch.Tensor, negative: Inputs | None = None) -> Inputs:
        return Inputs(
            kwargs=dict(
                hidden_states=hidden,
                timestep=timestep,
                encoder_hidden_states_mask=None,
                encoder_hidden_states=text.to(dtype),
                img_shapes=img_shapes,
                return_dict=False,
            ),
            roles=dict(roles),
            negative=negative,
            sigma=sigma,
        )

    negative = None
    if cfg:
        neg_len = geometry["neg_text_len"]
        negative = branch(torch.randn(batch, neg_len, joint, generator=gen))
    return branch(pos_text, negative)


FAMILY = Family(
    name="qwen_image",
    title="Qwen-Image",
    model_class="QwenImageTransformer2DModel",
    block_classes=("QwenImageTransformerBlock",),
    presets={
        "tiny": _TINY,
        # Real width; two blocks.
        "reduced": {**_QWEN_IMAGE, "num_layers": 2},
        "full": _QWEN_IMAGE,
    },
    geometry={
        # 128 x 128 -> 16 x 16 x 4 latents -> 64 packed tokens of 16 channels.
        "tiny": dict(height=128, width=128, text_len=12, neg_text_len=6),
        # 1024 x 1024 -> 128 x 128 x 16 latents -> (B, 4096, 64) packed. The text is not padded
        # to a fixed length: the template's 34-token system prefix is dropped and a batch pads
        # only to its longest prompt, so L = the prompt's tokens + ~5 closing template tokens.
        # 256 stands for a long descriptive (prompt-enhanced) prompt, the kind Qwen-Image is used
        # with; short RL prompts give a smaller text stream. The negative prompt " " (the
        # Qwen-Image README's default) encodes to about 6 tokens.
        "reduced": dict(height=1024, width=1024, text_len=256, neg_text_len=6),
        "full": dict(height=1024, width=1024, text_len=256, neg_text_len=6),
    },
    # QwenImagePipeline: as Flux, with Qwen/Qwen-Image's scheduler config (exponential dynamic
    # shift 256 -> 8192 tokens, 0.5 -> 0.9, terminal sigma stretched to 0.02; recalled, not read
    # from the hub), plus true-CFG's rescale to the positive branch's norm.
    sampler=SamplerSettings(
        scheduler_config=dict(
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
        pipeline_sigmas=True,
        cfg_rescale_to_pos_norm=True,
    ),
    make_inputs_fn=make_inputs,
    timestep_presentation="t/1000",
    cfg_layout="separate",
    cfg_scale=4.0,  # QwenImagePipeline's true_cfg_scale default
    rollout_dtype="bf16",
    input_dtype_policy={"latents": None, "cond": None, "timestep": None},
    param_dtype_rules={},
    fp32_rule_suggestions={
        "txt_norm.*": "fp32",
        "*.norm_q.*": "fp32",
        "*.norm_k.*": "fp32",
        "*.norm_added_*": "fp32",
        "*.img_mod.*": "fp32",  # per-stream modulation linears (6 chunks each)
        "*.txt_mod.*": "fp32",
        "norm_out.linear.*": "fp32",
        "img_in.*": "fp32",
        "txt_in.*": "fp32",
        "time_text_embed.*": "fp32",
        "proj_out.*": "fp32",
    },
    # QwenImageTransformer2DModel._keep_in_fp32_modules is None: a bf16 load keeps nothing fp32.
    engine_ops=("qwen_image_native",),
    engine_fp32_modules=(),
    # The engine's denoising stage hands the DiT the scheduler's fp32 t (sigma * 1000) with no
    # cast; diffusers' pipeline rounds it to bf16 first (750 -> 752).
    engine_op_switches={"timestep_from": "scheduler"},
    notes=(
        "The pipeline's t.to(bf16) rounds t before the /1000 (750 -> 752); the engine divides "
        "the scheduler's fp32 t and rounds once (the rollout's timestep_from='scheduler'). The "
        "engine's RMSNorm rounds after its weight multiply (the 'qwen_image_native' group). "
        "Bit-exact with the engine's CPU path (lab.engine.sglang.check_emulation); on a GPU at "
        "real width its fused norm+modulation CUDA kernels round once in fp32, which is not "
        "modelled. The record's aligned stack (an engine patched to round like the trainer) is "
        "engine_ops=('sgld', 'qwen_image') with timestep_from='pipeline'. The RoPE tables are "
        "plain attributes computed where the model is constructed (build() on the GPU, load() on "
        "the CPU, then copied): CPU- vs GPU-built tables are the known trainer/engine mismatch."
    ),
)

"""LTX-2.3 (diffusers LTX2VideoTransformer3DModel): 48 audio-video blocks, video 32 heads x 128."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab.families._family import Family, Inputs, SamplerSettings

# What LTX-2.3 switches on over LTX-2.0 (scripts/convert_ltx2_to_diffusers.py, "2.3"): per-head
# attention gates, 9-parameter AdaLN with sigma-driven prompt modulation, no caption projection
# (the connector already emits inner_dim / audio_inner_dim wide text), STG-capable attention.
_LTX23_SWITCHES = dict(
    gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
    use_prompt_embeddings=False, perturbed_attn=True,
)  # fmt: skip

# The converter's 2.3 config. It equals the class defaults plus the switches, except rope_type:
# every real LTX-2 checkpoint uses "split", while the class default is "interleaved".
_LTX23 = dict(
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
    attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20, base_height=2048, base_width=2048, audio_in_channels=128,
    audio_out_channels=128, audio_patch_size=1, audio_patch_size_t=1, audio_num_attention_heads=32,
    audio_attention_head_dim=64, audio_cross_attention_dim=2048, audio_scale_factor=4,
    audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160, num_layers=48,
    activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840, attention_bias=True,
    attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
    timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
    ff_bias=True, audio_ff_bias=True, use_prompt_adaln_single=True,
    use_keyframes_abs_pos_embedding=False, **_LTX23_SWITCHES,
)  # fmt: skip

# The LTX-2.0 tiny config of the reference notes plus the 2.3 switches. Cross-attention widths
# must equal the inner dims (32 = 2 x 16, 16 = 2 x 8); video and audio head counts must match.
_TINY = dict(
    in_channels=16, out_channels=16, patch_size=1, patch_size_t=1, num_attention_heads=2,
    attention_head_dim=16, cross_attention_dim=32, vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20, base_height=2048, base_width=2048, audio_in_channels=16,
    audio_out_channels=16, audio_patch_size=1, audio_patch_size_t=1, audio_num_attention_heads=2,
    audio_attention_head_dim=8, audio_cross_attention_dim=16, audio_scale_factor=4,
    audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160, num_layers=2,
    activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=24, attention_bias=True,
    attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
    timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
    **_LTX23_SWITCHES,
)  # fmt: skip


def _coords(
    config: Mapping[str, Any],
    batch: int,
    latent_fhw: tuple[int, int, int],
    fps: float,
    audio_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 RoPE patch bounds (B, 3, N_video, 2) and (B, 1, N_audio, 2), built as the pipeline does.

    The pipeline calls `transformer.rope.prepare_video_coords` and
    `transformer.audio_rope.prepare_audio_coords`; these ropes hold no weights, so two throwaway
    instances built with the model's own arguments give the identical tensors without a model.
    """
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    video_rope = LTX2AudioVideoRotaryPosEmbed(
        dim=config["num_attention_heads"] * config["attention_head_dim"],
        patch_size=config["patch_size"],
        patch_size_t=config["patch_size_t"],
        scale_factors=config["vae_scale_factors"],
        causal_offset=config["causal_offset"],
        modality="video",
    )
    audio_rope = LTX2AudioVideoRotaryPosEmbed(
        dim=config["audio_num_attention_heads"] * config["audio_attention_head_dim"],
        patch_size=config["audio_patch_size"],
        patch_size_t=config["audio_patch_size_t"],
        sampling_rate=config["audio_sampling_rate"],
        hop_length=config["audio_hop_length"],
        scale_factors=[config["audio_scale_factor"]],
        causal_offset=config["causal_offset"],
        modality="audio",
    )
    cpu = torch.device("cpu")
    video = video_rope.prepare_video_coords(batch, *latent_fhw, cpu, fps=fps)
    audio = audio_rope.prepare_audio_coords(batch, audio_len, cpu)
    return video, audio


def make_inputs(
    config: Mapping[str, Any],
    geometry: Mapping[str, Any],
    *,
    batch: int,
    cfg: bool,
    gen: torch.Generator,
    dtype: torch.dtype,
    sigma: float,
    latents: tuple[torch.Tensor, torch.Tensor] | None,
) -> Inputs:
    """Packed video (B, F*H*W, C) and audio (B, L, C_a) latents, connector text, fp32 t and coords.

    Follows LTX2Pipeline's T2V loop: both latents and both connector outputs (inner_dim and
    audio_inner_dim wide for 2.3) at `dtype`; all-ones int64 text masks (the connector's
    learnable registers fill every padding slot); `timestep`, `audio_timestep` and `sigma` all
    the raw t = sigma * 1000 in fp32 (the kwarg named `sigma` is not a sigma); fp32 RoPE patch
    bounds; latent sizes as python ints; CFG as one [negative, positive] batch.

    `latents`, when given, is the `(video, audio)` pair in the model's packed layout, the tuple
    a `return_dict=False` forward returns, each of batch `batch`.

    Raises:
        ValueError: If given `latents` are not a (video, audio) pair shaped for this geometry.
    """
    vae_t, vae_h, vae_w = config["vae_scale_factors"]
    f = (geometry["num_frames"] - 1) // vae_t + 1
    h, w = geometry["height"] // vae_h, geometry["width"] // vae_w
    fps = float(geometry["fps"])
    # LTX2Pipeline: round(duration * sampling_rate / hop_length / audio temporal compression).
    audio_len = round(
        geometry["num_frames"] / fps * config["audio_sampling_rate"] / config["audio_hop_length"]
        / config["audio_scale_factor"]
    )  # fmt: skip
    # in_channels is already the packed width (C * p_t * p * p); every LTX-2 checkpoint has p = 1.
    pt, p = config["patch_size_t"], config["patch_size"]
    video_shape = (batch, (f // pt) * (h // p) * (w // p), config["in_channels"])
    audio_shape = (batch, audio_len, config["audio_in_channels"])
    if latents is None:
        video = torch.randn(*video_shape, generator=gen)
        audio = torch.randn(*audio_shape, generator=gen)
    else:
        if not isinstance(latents, (tuple, list)) or len(latents) != 2:
            raise ValueError(
                "ltx2 make_inputs: latents must be a (video, audio) pair of packed tensors, got "
                f"{type(latents).__name__}."
            )
        video, audio = latents
        if tuple(video.shape) != video_shape or tuple(audio.shape) != audio_shape:
            raise ValueError(
                f"ltx2 make_inputs: latents shaped {tuple(video.shape)}, {tuple(audio.shape)}; "
                f"expected packed {video_shape} (video) and {audio_shape} (audio)."
            )
    text_len = geometry["text_len"]
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    audio_inner = config["audio_num_attention_heads"] * config["audio_attention_head_dim"]
    text = torch.randn(batch, text_len, inner, generator=gen)
    audio_text = torch.randn(batch, text_len, audio_inner, generator=gen)
    video_coords, audio_coords = _coords(config, batch, (f, h, w), fps, audio_len)
    if cfg:
        neg_text = torch.randn(batch, text_len, inner, generator=gen)
        neg_audio_text = torch.randn(batch, text_len, audio_inner, generator=gen)
        text, audio_text = torch.cat([neg_text, text]), torch.cat([neg_audio_text, audio_text])
        video, audio = torch.cat([video, video]), torch.cat([audio, audio])
        video_coords = video_coords.repeat(2, 1, 1, 1)
        audio_coords = audio_coords.repeat(2, 1, 1, 1)
    n = video.shape[0]
    mask = torch.ones(n, text_len, dtype=torch.int64)
    t = torch.tensor(sigma * 1000.0, dtype=torch.float32).expand(n)
    return Inputs(
        kwargs=dict(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=text.to(dtype),
            audio_encoder_hidden_states=audio_text.to(dtype),
            timestep=t.clone(),
            audio_timestep=t.clone(),
            sigma=t.clone(),
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask.clone(),
            num_frames=f,
            height=h,
            width=w,
            fps=fps,
            audio_num_frames=audio_len,
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=False,
            spatio_temporal_guidance_blocks=None,
            perturbation_mask=None,
            use_cross_timestep=True,
            return_dict=False,
        ),
        roles=dict(
            hidden_states="latents",
            audio_hidden_states="latents",
            encoder_hidden_states="cond",
            audio_encoder_hidden_states="cond",
            timestep="timestep",
            audio_timestep="timestep",
            sigma="timestep",
            encoder_attention_mask="aux",
            audio_encoder_attention_mask="aux",
            num_frames="aux",
            height="aux",
            width="aux",
            fps="aux",
            audio_num_frames="aux",
            video_coords="aux",
            audio_coords="aux",
            isolate_modalities="aux",
            spatio_temporal_guidance_blocks="aux",
            perturbation_mask="aux",
            use_cross_timestep="aux",
            return_dict="aux",
        ),
    )


FAMILY = Family(
    name="ltx2",
    title="LTX-2.3",
    model_class="LTX2VideoTransformer3DModel",
    # The class declares no _no_split_modules (None); its one repeated block is this.
    block_classes=("LTX2VideoTransformerBlock",),
    presets={"tiny": _TINY, "reduced": {**_LTX23, "num_layers": 2}, "full": _LTX23},
    geometry={
        # 17 frames at 96 x 128 -> 3 x 3 x 4 = 36 video tokens; 18 audio tokens; 8 text tokens.
        "tiny": dict(num_frames=17, height=96, width=128, fps=24.0, text_len=8),
        # LTX2Pipeline defaults: 121 frames at 512 x 768, 24 fps -> 16 x 16 x 24 = 6144 video
        # tokens, 126 audio tokens; max_sequence_length 1024 text tokens.
        "reduced": dict(num_frames=121, height=512, width=768, fps=24.0, text_len=1024),
        "full": dict(num_frames=121, height=512, width=768, fps=24.0, text_len=1024),
    },
    # LTX2Pipeline: sigmas = np.linspace(1, 1/N, N) in float64, mu = calculate_shift(video tokens)
    # with the pipeline's fallbacks (1024 -> 4096 tokens, 0.95 -> 2.05). shift_terminal 0.1 is the
    # LTX-Video scheduler config's; check it against the LTX-2 checkpoint's scheduler_config.json.
    # Video and audio share the grid (the pipeline deep-copies the scheduler). The pipeline's CFG
    # (x0-space guidance, rescale 0.7, STG) is not modelled: velocity-space CFG as Flow-GRPO.
    sampler=SamplerSettings(
        scheduler_config=dict(
            use_dynamic_shifting=True,
            base_shift=0.95,
            max_shift=2.05,
            base_image_seq_len=1024,
            max_image_seq_len=4096,
            shift_terminal=0.1,
        ),
        pipeline_sigmas=True,
    ),
    make_inputs_fn=make_inputs,
    timestep_presentation="t",
    cfg_layout="batched",
    cfg_scale=3.0,  # LTX2Pipeline's guidance_scale default
    rollout_dtype="bf16",
    # The record's TrainPipelineConfig: the native forward anchors element-wise math (RoPE
    # positions included) on the latent dtype, and the rollout runs it bf16.
    input_dtype_policy={"latents": "default", "cond": "default", "timestep": None},
    param_dtype_rules={},
    # The block norms are affine-free (norm_elementwise_affine=False): the norms with parameters
    # are the q/k RMSNorms. Modulation: every scale_shift_table and the AdaLayerNormSingle
    # linears (time, prompt, audio-video cross-attention); embeddings: their timestep MLPs.
    fp32_rule_suggestions={
        "*.norm_q.*": "fp32",
        "*.norm_k.*": "fp32",
        "*scale_shift_table": "fp32",
        "*time_embed.linear.*": "fp32",
        "*prompt_adaln.linear.*": "fp32",
        "av_cross_attn_*.linear.*": "fp32",
        "*.emb.timestep_embedder.*": "fp32",
        "*proj_in.*": "fp32",
        "*proj_out.*": "fp32",
    },
    engine_fp32_modules=(),
    # sglang 0.5.23 rounds its RoPE (cos, sin) table to bf16 and rotates q and k in bf16 (its
    # torch path and its H100 Triton kernel alike); its coords stay fp32, as diffusers' do
    # (quantize_video_rope_coords_to_hidden_dtype is off by default).
    engine_op_switches={"ltx_rope": "bf16"},
    notes=(
        "sglang-d's native LTX forward builds RoPE positions in the latent dtype (bf16), while "
        "diffusers always builds fp32 coords (aux here, never cast): bf16 positions put rel ~0.5 "
        "into high-frequency RoPE bands. A bf16 rather than fp32 sigma into the AdaLN adds ~1e-3."
    ),
)

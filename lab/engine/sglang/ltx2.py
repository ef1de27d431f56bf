"""LTX-2.3 in the engine: sglang's LTX2VideoTransformer3DModel under its LTX-2.5 arch config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily, scheduler_timestep
from lab.families import Inputs

# diffusers config values the engine's class hard-codes (runtime/models/dits/ltx_2.py:
# LTX2VideoTransformer3DModel.__init__ and LTX2TransformerBlock): a config with another value
# would build a different model there, so it is refused rather than paired.
_FIXED = dict(
    vae_scale_factors=(8, 32, 32), audio_scale_factor=4, audio_sampling_rate=16000,
    audio_hop_length=160, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False, attention_bias=True, attention_out_bias=True,
)  # fmt: skip

# diffusers switch -> the engine's, where one engine switch covers the video and audio pair.
_PAIRED = {
    "apply_gated_attention": ("gated_attn", "audio_gated_attn"),
    "cross_attention_adaln": ("cross_attn_mod", "audio_cross_attn_mod"),
}

# Same name and meaning in both configs.
_SAME = (
    "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
    "cross_attention_dim", "norm_eps", "caption_channels", "timestep_scale_multiplier",
    "audio_num_attention_heads", "audio_attention_head_dim", "audio_in_channels",
    "audio_out_channels", "audio_cross_attention_dim", "ff_bias", "audio_ff_bias",
    "use_keyframes_abs_pos_embedding",
)  # fmt: skip


def _refuse(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"ltx2 (sglang): the diffusers config has {key}={value!r}; {why}")


def arch_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's LTX25ArchConfig kwargs for a diffusers LTX2VideoTransformer3DModel config.

    The engine's own config translation (`update_model_arch`) setattr's diffusers' keys onto
    the arch config, so its switches, named otherwise, keep their defaults; this does the
    translation by name. LTX25ArchConfig is the engine's arch config whose parameter mapping
    covers the 2.3 modules (`prompt_adaln -> prompt_adaln_single`); its 2.5-only fields
    (ff_bias, the keyframe embedding) are set from the diffusers config.

    Raises:
        ValueError: A config the engine's class cannot build as diffusers does (a value it
            hard-codes, video and audio switches that differ, prompt AdaLN without its
            modules), naming the key and the value the engine needs.
    """
    from sglang.multimodal_gen.configs.models.dits.ltx_2 import LTX2RopeType

    for key, want in _FIXED.items():
        got = config.get(key)
        if (tuple(got) if isinstance(got, (list, tuple)) else got) != want:
            raise _refuse(
                key, got, f"the engine's class hard-codes {want!r}: build the model with that."
            )
    kwargs: dict[str, Any] = {k: config[k] for k in _SAME if k in config}
    for engine_key, (video, audio) in _PAIRED.items():
        if bool(config.get(video)) != bool(config.get(audio)):
            raise _refuse(
                audio, config.get(audio),
                f"the engine has one switch ({engine_key}) for {video} and {audio}: set both "
                f"to {config.get(video)!r}.",
            )  # fmt: skip
        kwargs[engine_key] = bool(config.get(video))
    if kwargs["cross_attention_adaln"] and not config.get("use_prompt_adaln_single", True):
        raise _refuse(
            "use_prompt_adaln_single", False,
            "with cross_attn_mod the engine always builds prompt_adaln_single (its "
            "KV-cacheable 2.5 cross-attention without it is not in sglang 0.5.23).",
        )  # fmt: skip
    kwargs["caption_proj_before_connector"] = not config.get("use_prompt_embeddings", True)
    kwargs["rope_type"] = LTX2RopeType(config.get("rope_type", "interleaved"))
    kwargs["double_precision_rope"] = bool(config.get("rope_double_precision", True))
    kwargs["positional_embedding_theta"] = float(config.get("rope_theta", 10000.0))
    kwargs["positional_embedding_max_pos"] = [
        int(config["pos_embed_max_pos"]), int(config["base_height"]), int(config["base_width"])
    ]  # fmt: skip
    kwargs["audio_positional_embedding_max_pos"] = [int(config["audio_pos_embed_max_pos"])]
    # Outside the ltx_2_3 native variant the engine scales the AV cross-attention gates' t by
    # av_ca_timestep_scale_multiplier; diffusers by cross_attn / timestep scale multiplier.
    ratio = config["cross_attn_timestep_scale_multiplier"] / config["timestep_scale_multiplier"]
    if ratio != int(ratio):
        raise _refuse(
            "cross_attn_timestep_scale_multiplier", config["cross_attn_timestep_scale_multiplier"],
            "the engine's av_ca_timestep_scale_multiplier is an integer factor on t; make it a "
            "multiple of timestep_scale_multiplier.",
        )  # fmt: skip
    kwargs["av_ca_timestep_scale_multiplier"] = int(ratio)
    kwargs["patch_size"] = (config["patch_size_t"], config["patch_size"], config["patch_size"])
    return kwargs


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The kwargs sglang's LTX-2 denoising stage hands its DiT for one one-stage T2V step.

    `LTX2DenoisingStage._prepare_ltx2_model_inputs` / `_build_ltx2_base_model_kwargs` outside
    the ltx_2_3 native variant (a diffusers checkpoint's): both latents cast to the DiT
    precision; `timestep` and `audio_timestep` the scheduler's fp32 t = sigma * 1000 over the
    batch, no prompt timestep (the DiT takes the collapsed t); the connector's text as encoded;
    the text mask (the video one for both modalities), which the model turns into an additive
    SDPA bias; latent sizes and fps. No coords: without sequence parallelism or a captured CUDA
    graph the stage passes None and the model builds them itself (`rope.prepare_video_coords`,
    `audio_rope.prepare_audio_coords`, fp32, not quantized to the hidden dtype).
    """
    kw = inputs.kwargs
    hidden = kw["hidden_states"]
    t = scheduler_timestep(inputs, hidden.shape[0])
    return dict(
        hidden_states=hidden.to(dtype),
        audio_hidden_states=kw["audio_hidden_states"].to(dtype),
        encoder_hidden_states=kw["encoder_hidden_states"],
        audio_encoder_hidden_states=kw["audio_encoder_hidden_states"],
        timestep=t,
        audio_timestep=t.clone(),
        encoder_attention_mask=kw["encoder_attention_mask"],
        audio_encoder_attention_mask=kw["encoder_attention_mask"],
        num_frames=kw["num_frames"],
        height=kw["height"],
        width=kw["width"],
        fps=kw["fps"],
        audio_num_frames=kw["audio_num_frames"],
        video_coords=None,
        audio_coords=None,
        return_latents=False,
        return_dict=False,
    )


_ROPE = (
    "the engine's LTX2AudioVideoRotaryPosEmbed.forward rounds its (cos, sin) table to the "
    "activation dtype (bf16, on a GPU as well) and its rotation writes x * cos in that dtype "
    "before adding the sine product; diffusers keeps the table fp32 and upcasts q and k, "
    "rounding once (the 'ltx_rope' op switch runs the engine's way)"
)

ENGINE = EngineFamily(
    family_name="ltx2",
    dit="sglang.multimodal_gen.runtime.models.dits.ltx_2:LTX2VideoTransformer3DModel",
    config="sglang.multimodal_gen.configs.models.dits.ltx_2_5:LTX25Config",
    arch="sglang.multimodal_gen.configs.models.dits.ltx_2_5:LTX25ArchConfig",
    pipeline="sglang.multimodal_gen.configs.pipeline_configs.ltx_2:LTX2PipelineConfig",
    arch_config=arch_config,
    forward_kwargs=forward_kwargs,
    # Against diffusers' classes (the trainer); the emulated rollout reproduces it with the
    # family's op switch ltx_rope="bf16", and the emulation check is bit-exact (tiny, bf16).
    differences={
        "rope": _ROPE,
        "audio_rope": _ROPE,
        "cross_attn_rope": _ROPE,
        "cross_attn_audio_rope": _ROPE,
    },
    parameterless={
        "*.rms_norm": "the engine's one affine-free RMSNorm per block, called before each "
        "attention and feed-forward (diffusers holds one parameterless norm module for each: "
        "norm1, norm2, ..., audio_norm3)",
        "*.attn": "the engine's attention-kernel module; diffusers calls the kernel as a "
        "function inside its Attention",
        "*.ff.act": "the feed-forward's tanh-GELU; diffusers applies it inside ff.net.0, the "
        "module that also holds the input projection (the engine's ff.proj_in)",
        "*.audio_ff.act": "the audio feed-forward's tanh-GELU; diffusers applies it inside "
        "audio_ff.net.0, the module that also holds the input projection",
    },
    source="runtime/pipelines_core/stages/model_specific_stages/ltx_2/denoising.py:"
    "_prepare_ltx2_model_inputs, _build_ltx2_base_model_kwargs (one-stage, not the ltx_2_3 "
    "native variant); runtime/models/dits/ltx_2.py:LTX2VideoTransformer3DModel.forward",
)

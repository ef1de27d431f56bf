"""Cosmos3 in the engine: sglang's Cosmos3OmniTransformer (UND text + GEN vision pathways)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily, scheduler_timestep
from lab.families import Inputs

# diffusers config values the engine's class hard-codes (runtime/models/dits/cosmos3video.py):
# a config with another value would build or run a different model there, so it is refused.
_FIXED = dict(
    # Cosmos3CausalAttention / Cosmos3CrossAttention build their projections without bias.
    attention_bias=False,
    # compute_mrope_position_ids_vision always resets h/w per vision segment.
    unified_3d_mrope_reset_spatial_ids=True,
    # The engine modulates the temporal ids of video (T > 1) whenever the stage passes fps.
    enable_fps_modulation=True,
)

# Same name and meaning in both configs.
_SAME = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "qk_norm_for_text",
    "use_und_k_norm_for_gen", "latent_patch_size", "latent_channel", "rope_theta",
    "base_fps", "unified_3d_mrope_temporal_modality_margin", "timestep_scale", "vocab_size",
    "rms_norm_eps", "sound_gen", "sound_latent_fps", "action_gen", "num_embodiment_domains",
)  # fmt: skip


def _refuse(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"cosmos3 (sglang): the diffusers config has {key}={value!r}; {why}")


def arch_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's Cosmos3VideoArchConfig kwargs for a diffusers Cosmos3OmniTransformer config.

    Most fields mirror diffusers' names; the mRoPE sections are `rope_axes_dim` in diffusers
    and `mrope_section` in the engine (which reads them from `rope_scaling` only), and the
    engine's `out_channels` (default 48) must be the latent channel count.

    Raises:
        ValueError: A config the engine's class cannot build as diffusers does (a value it
            hard-codes, a patch width that is not p * p * latent_channel), naming the key.
    """
    for key, want in _FIXED.items():
        got = config.get(key, want)
        if got != want:
            raise _refuse(key, got, f"the engine's class hard-codes {want!r}: build with that.")
    p, c = int(config["latent_patch_size"]), int(config["latent_channel"])
    if int(config.get("patch_latent_dim", p * p * c)) != p * p * c:
        raise _refuse(
            "patch_latent_dim", config["patch_latent_dim"],
            f"the engine derives it as latent_patch_size**2 * latent_channel = {p * p * c}.",
        )  # fmt: skip
    kwargs: dict[str, Any] = {k: config[k] for k in _SAME if k in config}
    axes = config.get("rope_axes_dim") or (config.get("rope_scaling") or {}).get("mrope_section")
    if axes is not None:
        kwargs["mrope_section"] = tuple(int(a) for a in axes)
    kwargs["out_channels"] = c
    for key in ("sound_dim", "action_dim"):
        if config.get(key) is not None:
            kwargs[key] = int(config[key])
    return kwargs


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The kwargs sglang's Cosmos3 denoising stage hands its DiT for one T2I/T2V step.

    `Cosmos3DenoisingStage._run_transformer` (cond branch, `cache_key="cond"`): the latents
    (1, C, T, H, W) at the DiT precision (the latent stage draws them in bf16); the
    scheduler's fp32 t over the batch (`t.unsqueeze(0).expand(B)`), not diffusers' per-token
    `vision_timesteps`; the prompt's token ids (`Cosmos3TokenizationStage._tokenize_prompt`:
    chat template, EOS, `<|vision_start|>`; the lab's `input_ids` are that sequence) as a
    (1, S) batch with an all-ones mask and `max_text_seq_len` = S (one prompt: no padding);
    fps 24 (unused for one latent frame); no frame mask (T2I/T2V: every frame noisy).
    The model builds the text and vision mRoPE ids itself (`_compute_rope_position_ids`).

    The stage drops the cached UND K/V at each request (`transformer.reset_cache()`); it is
    dropped here too, so every forward is a request's first step and runs the text pathway.

    Raises:
        ValueError: A DiT precision other than bf16 (the engine's `post_load_weights` casts
            embed_tokens, proj_in, proj_out and every RMSNorm to bf16 whatever the precision:
            the loader calls it with its default target_dtype, so an fp32 or fp16 DiT fails at
            proj_in on mixed dtypes), or inputs that are not the packed single-sample T2I/T2V
            layout the engine's stage builds (conditioning frames, text not at the front).
    """
    held = model.proj_in.weight.dtype
    if held != dtype:
        raise ValueError(
            f"cosmos3 (sglang): the DiT was loaded at {dtype} but its proj_in holds {held}: "
            "sglang 0.5.23's Cosmos3OmniTransformer.post_load_weights (runtime/models/dits/"
            "cosmos3video.py) casts embed_tokens, proj_in, proj_out and the RMSNorms to bf16 "
            "whatever the DiT precision, so the engine runs Cosmos3 at bf16 only; build it with "
            "dtype='bf16'."
        )
    kw = inputs.kwargs
    ids = kw["input_ids"]
    und_len = int(kw["und_len"])
    latents = kw["vision_tokens"]
    if len(latents) != 1:
        raise ValueError(
            f"cosmos3 (sglang): {len(latents)} vision items; the engine's stage runs one "
            "(1, C, T, H, W) latent per forward."
        )
    latent = latents[0]
    noisy = kw["vision_noisy_frame_indexes"][0]
    if not torch.equal(noisy.cpu(), torch.arange(latent.shape[2])):
        raise ValueError(
            f"cosmos3 (sglang): noisy frames {noisy.tolist()} of {latent.shape[2]}; the adapter "
            "builds the T2I/T2V step (every frame noisy, noisy_frame_mask=None)."
        )
    if not torch.equal(kw["text_indexes"].cpu(), torch.arange(und_len)) or ids.numel() != und_len:
        raise ValueError(
            "cosmos3 (sglang): the text tokens are not the packed sequence's first und_len "
            "rows; the engine's UND pathway takes the prompt's ids as one (1, S) batch."
        )
    model.reset_cache()
    text_ids = ids.reshape(1, -1)
    return dict(
        hidden_states=latent.to(dtype),
        encoder_hidden_states=None,
        timestep=scheduler_timestep(inputs, latent.shape[0]),
        text_ids=text_ids,
        text_mask=torch.ones_like(text_ids),
        fps=24.0,
        cache_key="cond",
        noisy_frame_mask=None,
        max_text_seq_len=und_len,
    )


# Against diffusers' stock classes (the trainer). The rollout's cosmos3_native group
# (lab.precision.engine_groups) runs each of these the engine's way, so the emulation check is
# bit-exact at tiny on a CPU. The mRoPE table is no difference: the engine rebuilds inv_freq in
# fp32, and the lab's sides never cast that non-persistent buffer either. Not modelled, as they
# do not run on a CPU: the GPU kernels (fused_add_rmsnorm, and at T == 1 on Hopper/Blackwell the
# fused q/k norm + RoPE kernels, which round the normed q/k before the rotation).
_GROUP = " (the rollout's 'cosmos3_native' group runs the engine's way)"
_NORM = (
    "the engine's RMSNorm (sglang RMSNorm.forward_native): x in fp32, times rsqrt, times the "
    "weight in fp32, rounded once; diffusers' RMSNorm rounds to the weight's dtype before the "
    "weight, a second rounding at bf16" + _GROUP
)
_FUSED_NORM = (
    "the engine's fused residual add + RMSNorm (RMSNorm.forward_native(x, residual)): it "
    "normalizes the fp32 sum of the residual and the branch output (the bf16-rounded sum is "
    "only the carried residual) and rounds once after the weight; diffusers adds in bf16, then "
    "normalizes the rounded sum and rounds before the weight" + _GROUP
)
_QK_NORM = (
    "the engine's text q/k norms run torch F.rms_norm (fp32 inside, one rounding after the "
    "weight); diffusers' RMSNorm rounds before the weight" + _GROUP
)
_TIME = (
    "the engine embeds the step's one t (a batch of 1) where diffusers embeds every noisy "
    "token's t ((tokens, 256)): the same sinusoid, but the linears' CPU kernels accumulate in "
    "another order for one row than for many; at bf16 the engine's time_embedder also holds "
    "bf16-rounded weights in fp32 (its loader casts them to the DiT precision before "
    "post_load_weights widens them)" + _GROUP
)


def output_view(name: str, engine: torch.Tensor, diffusers: torch.Tensor) -> torch.Tensor:
    """One engine output laid out as diffusers' (`EngineFamily.output_view`).

    The engine runs the packed single-sample sequence as a batch of one, (1, L, D), where
    diffusers computes (L, D): the same values, row for row.
    """
    if (
        engine.dim() == diffusers.dim() + 1
        and engine.shape[0] == 1
        and engine.shape[1:] == diffusers.shape
    ):
        return engine[0]
    return engine


ENGINE = EngineFamily(
    family_name="cosmos3",
    # Cosmos3Config inherits enable_autocast=True from PipelineConfig, but the stage that runs
    # its DiT (Cosmos3DenoisingStage._run_transformer) calls it with no autocast context.
    stage_autocast=False,
    output_view=output_view,
    # post_load_weights casts embed_tokens to bf16 whatever the DiT precision.
    loader_rounds={"language_model.embed_tokens.weight": "bf16"},
    dit="sglang.multimodal_gen.runtime.models.dits.cosmos3video:Cosmos3OmniTransformer",
    config="sglang.multimodal_gen.configs.models.dits.cosmos3video:Cosmos3VideoConfig",
    arch="sglang.multimodal_gen.configs.models.dits.cosmos3video:Cosmos3VideoArchConfig",
    pipeline="sglang.multimodal_gen.configs.pipeline_configs.cosmos3:Cosmos3Config",
    arch_config=arch_config,
    forward_kwargs=forward_kwargs,
    differences={
        "layers.*.input_layernorm_moe_gen": _FUSED_NORM,
        "layers.*.post_attention_layernorm_moe_gen": _FUSED_NORM,
        "layers.*.input_layernorm": _NORM,
        "layers.*.post_attention_layernorm": _NORM,
        "layers.*.self_attn.norm_added_q": _NORM,
        "layers.*.self_attn.norm_added_k": _NORM,
        "layers.*.self_attn.norm_q": _QK_NORM,
        "layers.*.self_attn.norm_k": _QK_NORM,
        "norm_moe_gen": _NORM,
        "time_embedder*": _TIME,
    },
    parameterless={
        "language_model.rotary_emb": "the engine's mRoPE table builder; it runs as a method "
        "(build_rope_cache_inputs), not as a module call",
        "*.mlp.act_fn": "the engine's SiLU-and-multiply on the fused gate/up output; diffusers "
        "applies SiLU (mlp.act_fn) to gate_proj's output and multiplies inside mlp.forward",
        "*.cross_attention.attn": "the engine's attention-kernel module (USPAttention); "
        "diffusers calls the kernel as a function inside its attention processor",
        "time_embedder.act": "the timestep MLP's SiLU on the step's one row; diffusers' "
        "TimestepEmbedding holds it as time_embedder.act too, and applies it to one row per "
        "noisy token (the cosmos3_native rollout: one row per distinct t, as the engine)",
    },
    source="runtime/pipelines_core/stages/model_specific_stages/cosmos3.py:"
    "Cosmos3DenoisingStage._run_transformer (cond, T2I/T2V), Cosmos3TokenizationStage; "
    "runtime/models/dits/cosmos3video.py:Cosmos3OmniTransformer.forward",
)

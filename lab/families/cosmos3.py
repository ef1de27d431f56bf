"""Cosmos3 (diffusers Cosmos3OmniTransformer). Nano: 36 MoT layers, 32 heads x 128; packed T2I."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lab.families._family import Family, Inputs, SamplerSettings

# Qwen3/Nano style at toy width; mRoPE sections 4/2/2 sum to head_dim // 2, and
# patch_latent_dim = 2 * 2 * latent_channel.
_TINY = dict(
    attention_bias=False, head_dim=16, hidden_size=64, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, rms_norm_eps=1e-6,
    rope_theta=5e6, rope_axes_dim=(4, 2, 2), latent_channel=4, latent_patch_size=2,
    patch_latent_dim=16, base_fps=24, enable_fps_modulation=True,
    unified_3d_mrope_reset_spatial_ids=True, unified_3d_mrope_temporal_modality_margin=15000,
    timestep_scale=0.001, vocab_size=128, hidden_act="silu", qk_norm_for_text=True,
    use_und_k_norm_for_gen=False, sound_gen=False, action_gen=False,
)  # fmt: skip
# Every number is the class default of Cosmos3OmniTransformer in diffusers 0.42.1, which its docs
# page loads as `from_pretrained("nvidia/Cosmos3-Nano", subfolder="transformer")`: the Qwen3-VL-8B
# text backbone (4096 wide, 36 layers, 32 query / 8 key-value heads of 128, SwiGLU 12288, vocab
# 151936, rope_theta 5e6, mRoPE sections 24/20/20) duplicated into understanding and generation
# pathways, fed by the 48-channel Wan2.2 VAE in 2x2 patches (192 = 2*2*48). That is ~15.1 B
# parameters, the "16B" Nano of the model card. The released checkpoint also carries sound and
# action heads; their widths are not in the diffusers tree, and the T2I forward never reads them,
# so they are left off.
_NANO = dict(
    attention_bias=False, head_dim=128, hidden_size=4096, intermediate_size=12288,
    num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36, rms_norm_eps=1e-6,
    rope_theta=5e6, rope_axes_dim=(24, 20, 20), latent_channel=48, latent_patch_size=2,
    patch_latent_dim=192, base_fps=24, enable_fps_modulation=True,
    unified_3d_mrope_reset_spatial_ids=True, unified_3d_mrope_temporal_modality_margin=15000,
    timestep_scale=0.001, vocab_size=151936, hidden_act="silu", qk_norm_for_text=True,
    use_und_k_norm_for_gen=False, sound_gen=False, action_gen=False,
)  # fmt: skip

# The Edge (Nemotron dense) block structure: non-gated ReLU^2 MLP with Nemotron RMSNorms, no
# text-stream q/k norm, and a separate k norm on the understanding keys the generation pathway
# reads (covers Cosmos3NemotronRMSNorm and k_norm_und_for_gen).
_EDGE_FLAGS = dict(
    hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-5
)  # fmt: skip

_VAE_SPATIAL = 16
"""Wan2.2 VAE spatial compression (the pipeline's `vae_scale_factor_spatial`)."""
_VAE_TEMPORAL = 4
"""Wan2.2 VAE temporal compression (`vae_scale_factor_temporal`)."""
_FPS = 24.0
"""The pipeline's default `fps`; it only enters the mRoPE of video (grid_t > 1) latents."""


def _text_mrope_ids(und_len: int, float_positions: bool) -> torch.Tensor:
    """Text mRoPE ids: `arange(und_len)` on all 3 axes, as `get_3d_mrope_ids_text_tokens`."""
    dtype = torch.float32 if float_positions else torch.long
    return torch.arange(und_len, dtype=dtype).unsqueeze(0).expand(3, -1).contiguous()


def _vae_mrope_ids(
    grid: tuple[int, int, int], temporal_offset: int, config: Mapping[str, Any]
) -> torch.Tensor:
    """Vision mRoPE ids, as `get_3d_mrope_ids_vae_tokens` builds them for the pipeline.

    The pipeline's helper lives in a module that imports transformers, which the lab does not
    depend on, so it is reproduced here. fps modulation only applies to video (grid_t > 1); a
    T2I grid gives int64 ids whose temporal id is `und_len + margin`.
    """
    grid_t, grid_h, grid_w = grid
    if config["enable_fps_modulation"] and grid_t > 1:
        tps, base_tps = _FPS / _VAE_TEMPORAL, float(config["base_fps"]) / _VAE_TEMPORAL
        scaled_t = torch.arange(grid_t, dtype=torch.float32) / tps * base_tps + temporal_offset
        t_index = scaled_t.view(-1, 1).expand(-1, grid_h * grid_w).flatten()
        index_dtype = torch.float32
    else:
        t_index = torch.arange(grid_t, dtype=torch.long).view(-1, 1).expand(-1, grid_h * grid_w)
        t_index = t_index.flatten() + int(temporal_offset)
        index_dtype = torch.long
    h_index = torch.arange(grid_h).view(1, -1, 1).expand(grid_t, -1, grid_w).flatten()
    w_index = torch.arange(grid_w).view(1, 1, -1).expand(grid_t, grid_h, -1).flatten()
    if not config["unified_3d_mrope_reset_spatial_ids"]:
        h_index, w_index = h_index + int(temporal_offset), w_index + int(temporal_offset)
    return torch.stack([t_index, h_index.to(index_dtype), w_index.to(index_dtype)], dim=0)


def _packed_statics(
    input_ids: torch.Tensor, latent_shape: tuple[int, ...], config: Mapping[str, Any]
) -> dict[str, Any]:
    """The per-prompt packed fields (`_prepare_text_segment` + `_prepare_vision_segment`), T2I."""
    und_len = int(input_ids.numel())
    _, _, latent_t, latent_h, latent_w = latent_shape
    p = config["latent_patch_size"]
    grid = (latent_t, math.ceil(latent_h / p), math.ceil(latent_w / p))
    n_vision = math.prod(grid)
    # Text to image: no conditioning frame, so every latent frame is noisy and read back.
    noisy_frames = torch.arange(latent_t, dtype=torch.long)
    vision_rows = torch.arange(und_len, und_len + n_vision, dtype=torch.long)
    vision_offset = und_len + config["unified_3d_mrope_temporal_modality_margin"]
    position_ids = torch.cat(
        [
            _text_mrope_ids(und_len, config["enable_fps_modulation"]),
            _vae_mrope_ids(grid, vision_offset, config),
        ],
        dim=1,
    )
    return dict(
        input_ids=input_ids,
        text_indexes=torch.arange(und_len, dtype=torch.long),
        position_ids=position_ids,
        und_len=und_len,
        sequence_length=und_len + n_vision,
        vision_token_shapes=[grid],
        vision_sequence_indexes=vision_rows,
        vision_mse_loss_indexes=vision_rows.clone(),
        vision_noisy_frame_indexes=[noisy_frames],
    )


def _draw_input_ids(n: int, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """A chat-templated prompt of `n` ids: random, then eos and <|vision_start|> stand-ins."""
    if n < 3:
        raise ValueError(f"cosmos3: a prompt needs 3+ tokens (text, eos, vision start), got {n}.")
    body = torch.randint(0, vocab_size, (n - 2,), generator=gen, dtype=torch.long)
    return torch.cat([body, torch.tensor([vocab_size - 2, vocab_size - 1], dtype=torch.long)])


_ROLES: dict[str, str] = dict(
    input_ids="aux", text_indexes="aux", position_ids="aux", und_len="aux", sequence_length="aux",
    vision_tokens="latents", vision_token_shapes="aux", vision_sequence_indexes="aux",
    vision_mse_loss_indexes="aux", vision_timesteps="timestep", vision_noisy_frame_indexes="aux",
    return_dict="aux",
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
    latents: torch.Tensor | list[torch.Tensor] | None,
) -> Inputs:
    """Packed single-sample T2I statics, vision_tokens [(1, C, 1, H/16, W/16)], t (n_noisy,).

    Cosmos3OmniPipeline runs one sample per call: token ids packed with the patchified latents
    into one sequence, with 3-axis mRoPE ids (text `arange`, float32 with fps modulation on;
    vision `[und_len + 15000, h, w]`, int64, promoted to float32 by the concat). It casts the
    fp32 latents to the transformer dtype and passes `torch.full((n_noisy_tokens,), t)`; the
    shipped UniPC scheduler makes t int64, but the RL recipe steps a non-integer Karras grid
    (t = sigma * 1000, fp32; bf16 would round 993.25 to 992). CFG is a second forward with the
    uncond prompt's own packed statics and the same vision tokens and timesteps.

    Raises:
        ValueError: For batch > 1 (the packed forward holds one sample), or latents that are not
            one (1, C, T, H, W) tensor.
    """
    if batch != 1:
        raise ValueError(
            f"cosmos3: batch must be 1, got {batch}. Cosmos3OmniPipeline packs one sample per "
            "forward (vision_tokens is a per-item list over one joint sequence); run one forward "
            "per sample."
        )
    vocab, c = config["vocab_size"], config["latent_channel"]
    frames = geometry["frames"]
    latent_t = 1 + (frames - 1) // _VAE_TEMPORAL
    h, w = geometry["height"] // _VAE_SPATIAL, geometry["width"] // _VAE_SPATIAL
    # Token ids first (the prompt is tokenized before the noise is drawn); the uncond ids are
    # always drawn so that cfg on/off never changes the latents a seed gives.
    pos_ids = _draw_input_ids(geometry["text_len"], vocab, gen)
    neg_ids = _draw_input_ids(geometry["neg_text_len"], vocab, gen)
    if latents is None:
        latents = torch.randn(1, c, latent_t, h, w, generator=gen)
    elif isinstance(latents, (list, tuple)) and len(latents) == 1:
        latents = latents[0]  # the transformer's own output: a one-item list
    if latents.ndim != 5 or latents.shape[0] != 1:
        raise ValueError(f"cosmos3: latents must be (1, C, T, H, W), got {tuple(latents.shape)}.")
    statics = _packed_statics(pos_ids, tuple(latents.shape), config)
    n_noisy = len(statics["vision_mse_loss_indexes"])
    step = dict(
        vision_tokens=[latents.to(dtype)],
        vision_timesteps=torch.full((n_noisy,), sigma * 1000.0, dtype=torch.float32),
        return_dict=False,
    )
    negative = None
    if cfg:
        neg_statics = _packed_statics(neg_ids, tuple(latents.shape), config)
        negative = Inputs(
            kwargs={**neg_statics, **{k: _clone(v) for k, v in step.items()}}, roles=dict(_ROLES)
        )
    return Inputs(kwargs={**statics, **step}, roles=dict(_ROLES), negative=negative)


def _clone(value: Any) -> Any:
    """Copy tensors (also inside lists) so the two CFG branches share no storage."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


class _CastToEmbedDtype:
    """Forward hook: cast an input projection's output to `embed_tokens.weight.dtype`.

    Held as an object rather than a closure so that `copy.deepcopy(model)` rebinds `embed` to the
    copy's own embedding (deepcopy's memo), and a bf16 copy casts to bf16.
    """

    def __init__(self, embed: torch.nn.Module) -> None:
        self.embed = embed

    def __call__(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.embed.weight.dtype)


def prepare_model(model: torch.nn.Module) -> None:
    """Make the model run under autocast: cast the input projections back to the embed dtype.

    Under autocast `proj_in` emits bf16 while the time embedding is cast to `embed_tokens`' dtype
    (fp32), and `scatter_add` in `_apply_timestep_embeds_to_noisy_tokens` rejects the mix. The
    cast is exactly a no-op without autocast. Idempotent: a projection already hooked is skipped.
    """
    for name in ("proj_in", "audio_proj_in", "action_proj_in"):
        proj = getattr(model, name, None)
        if proj is None:
            continue
        if any(isinstance(h, _CastToEmbedDtype) for h in proj._forward_hooks.values()):
            continue
        proj.register_forward_hook(_CastToEmbedDtype(model.embed_tokens))


FAMILY = Family(
    name="cosmos3",
    title="Cosmos3-Nano",
    model_class="Cosmos3OmniTransformer",
    block_classes=("Cosmos3VLTextMoTDecoderLayer",),
    presets={
        "tiny": _TINY,
        # Real Nano width (embedding and lm_head included) with two MoT decoder layers.
        "reduced": {**_NANO, "num_hidden_layers": 2},
        "full": _NANO,
    },
    variants={
        # The tiny entry is the Nemotron flavour of the tiny preset. The Edge checkpoint's own
        # widths are not in the diffusers tree, so reduced/full "edge" is the Edge block
        # structure at the Nano width: it exercises the Nemotron code path at real width, it is
        # not the Cosmos3-Edge checkpoint's shape.
        "edge": {"tiny": _EDGE_FLAGS, "reduced": _EDGE_FLAGS, "full": _EDGE_FLAGS},
    },
    geometry={
        # 128 x 128 -> 8 x 8 latents -> 4 x 4 = 16 vision tokens after the 12 prompt tokens.
        "tiny": dict(height=128, width=128, frames=1, text_len=12, neg_text_len=8),
        # 1024 x 1024 T2I -> 64 x 64 x 48 latents -> 32 x 32 = 1024 vision tokens. The prompt
        # lengths are estimates: system prompt, chat template and the resolution sentence come to
        # ~45 tokens (the empty negative prompt is about that), plus an upsampled prompt.
        "reduced": dict(height=1024, width=1024, frames=1, text_len=256, neg_text_len=48),
        "full": dict(height=1024, width=1024, frames=1, text_len=256, neg_text_len=48),
    },
    # Cosmos3OmniPipeline ships UniPCMultistepScheduler on a Karras grid; the closest
    # flow-matching scheduler is FlowMatchEulerDiscreteScheduler with Karras sigmas (starts at
    # sigma 1, ends at 0), which gives the non-integer t = sigma * 1000 the RL recipe steps.
    sampler=SamplerSettings(
        scheduler_config=dict(use_karras_sigmas=True),
        notes="UniPC (Karras) in the shipped pipeline; Euler on a Karras grid for the SDE.",
    ),
    make_inputs_fn=make_inputs,
    timestep_presentation="t",
    cfg_layout="separate",
    cfg_scale=6.0,  # Cosmos3OmniPipeline's guidance_scale default
    # One sample per forward (vision_tokens is a per-item list over one packed sequence): a
    # trajectory runs each sample of a prompt as its own forward, as the pipeline does.
    max_batch=1,
    rollout_dtype="bf16",
    # The record: cast the latents to the forward dtype, pass the token ids through (no floating
    # cond exists here), keep the Karras-grid timestep in fp32. mRoPE ids are role "aux".
    input_dtype_policy={"latents": "default", "cond": None, "timestep": "fp32"},
    # No FSDP param-dtype plan for Cosmos3 in the record.
    param_dtype_rules={},
    # No adaLN: the timestep embedding is added to the noisy tokens. "*norm*" is every RMSNorm
    # (layer norms of both pathways, q/k norms, the final norms; the edge variant's too).
    fp32_rule_suggestions={
        "*norm*": "fp32",
        "embed_tokens.*": "fp32",
        "proj_in.*": "fp32",
        "time_embedder.*": "fp32",
        "proj_out.*": "fp32",
    },
    # Cosmos3OmniTransformer._keep_in_fp32_modules.
    engine_fp32_modules=("time_embedder",),
    # The engine's own rounding (lab.precision.engine_groups): its native RMSNorm, the fused
    # residual-add norms of its generation layers, one time embedding per t from bf16-rounded
    # weights. check_emulation("cosmos3") pairs it with the real engine.
    engine_ops=("cosmos3_native",),
    prepare_model=prepare_model,
    notes=(
        "Plain autocast crashes the forward (scatter_add dtype mismatch); prepare_model casts the "
        "input projections back to the embed dtype. mRoPE ids reach ~15000 (fp32, never cast), and "
        "with random weights the timestep path is weak (t/2 moves the output ~2%)."
    ),
)

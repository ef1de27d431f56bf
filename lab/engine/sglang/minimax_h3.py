"""MiniMax H3 in the engine: sglang's MiniMaxH3DiTModel on its packed sequence."""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily
from lab.families import Inputs

_STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3"


def arch_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's MiniMaxH3DiTArchConfig kwargs for a diffusers MiniMaxH3Transformer3DModel.

    The engine's own translation (`MiniMaxH3DiTConfig.update_model_arch`) renames diffusers'
    keys; its loader also sets `checkpoint_uses_diffusers_layout` when the checkpoint's
    `_class_name` is diffusers' (`transformer_loader.py`), which installs
    `_diffusers_h3_checkpoint` (fused q/k/v, SwiGLU halves swapped). The AdaLN widths, which
    the arch config hard-codes for the 5376-wide release, follow the hidden size (18 and 2
    vectors per row, as diffusers' `adaln_proj` and `norm_out.linear` hold).
    """
    import dataclasses

    from sglang.multimodal_gen.configs.models.dits.minimax_h3 import MiniMaxH3DiTConfig

    engine = MiniMaxH3DiTConfig()
    engine.update_model_arch(
        {
            **{k: v for k, v in config.items() if not k.startswith("_")},
            "checkpoint_uses_diffusers_layout": True,
            "adaln_out_features": 18 * int(config["hidden_size"]),
            "final_adaln_out_features": 2 * int(config["hidden_size"]),
        }
    )
    arch = engine.arch_config
    return {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch) if f.init}


def _stage_module(name: str) -> types.ModuleType:
    """Import one module of the engine's MiniMax H3 stage package.

    `pipelines_core/__init__` imports the whole serving stack (it needs `openai`, which the
    engine extra does not install), so the parent packages are stood in for by empty
    namespace packages while the module imports, and removed again afterwards.
    """
    dotted = f"{_STAGES}.{name}"
    if dotted in sys.modules:
        return sys.modules[dotted]
    import sglang.multimodal_gen.runtime as runtime

    added = []
    package, path = "sglang.multimodal_gen.runtime", next(iter(runtime.__path__))
    for part in _STAGES.removeprefix(package + ".").split("."):
        package, path = f"{package}.{part}", os.path.join(path, part)
        if package not in sys.modules:
            stub = types.ModuleType(package)
            stub.__path__ = [path]
            sys.modules[package] = stub
            added.append(package)
    try:
        return importlib.import_module(dotted)
    finally:
        for package in added:
            sys.modules.pop(package, None)


def _axis_count(values: torch.Tensor) -> int:
    return int(torch.unique(values).numel())


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The kwargs sglang's MiniMax H3 denoising stage hands its DiT for one t2va step.

    Built with the stage's own code (`MiniMaxH3DenoisingStage._run_full_loop`): the packed
    layout from `minimax_h3_packed_sequence` ([text | audio | video | pad to 64], no keyframe
    rows), the text rows' tags from the text encoder (all 1 for t2va), one
    `MiniMaxH3DenoiseBranch` and its `prepare_timestep_plan` for the step's video and audio t
    (as the loop computes them, 1 - sigma), and `forward_kwargs` with the fp32 video and audio
    rows scattered into the padded sequence buffers. The stage then refines the text once
    (`_precompute_refined_prompt_embeds`) and builds the RoPE cache once
    (`_precompute_rope_cache`); this passes neither, so the forward runs the same two methods
    on the same tensors itself (`refine_prompt_embeds`, `rope` + `_rope_cos_sin_cache`),
    where the lab captures their modules. The inputs' layout is checked against the engine's:
    the same rows, tags and float64 position grid.

    Raises:
        ValueError: A precision other than bf16 (the engine's class hard-codes it), batch > 1
            (the engine denoises one packed sequence per request), or inputs whose layout is
            not the engine's t2va packing.
    """
    if dtype != torch.bfloat16:
        raise ValueError(
            f"minimax_h3 (sglang): DiT precision {dtype}, but the engine's MiniMaxH3DiTModel "
            "hard-codes its precision (bf16 activations and weights, fp32 input/output heads "
            "and time MLP: _BF16_DTYPE, MINIMAX_H3_FP32_PARAM_NAMES in "
            "runtime/models/dits/minimax_h3.py), so at another precision it would run the bf16 "
            "model under that name; build it with dtype='bf16'."
        )
    kw = inputs.kwargs
    video, audio, text = kw["hidden_states"], kw["audio_hidden_states"], kw["encoder_hidden_states"]
    if video.shape[0] != 1:
        raise ValueError(
            f"minimax_h3 (sglang): batch {video.shape[0]}, but the engine's DiT takes one packed "
            "sequence per request (x [1, S, C]); make the inputs with batch=1."
        )
    packed_sequence = _stage_module("packed_sequence")
    denoise_loop = _stage_module("denoise_loop")
    pos = kw["position_ids"]
    video_pos = pos[kw["video_indices"]]
    text_len, n_audio = kw["text_indices"].numel(), kw["audio_indices"].numel()
    patch = tuple(model.arch.patch_size)
    latent_t = _axis_count(video_pos[:, 0])
    latent_h = _axis_count(video_pos[:, 1]) * patch[1]
    latent_w = _axis_count(video_pos[:, 2]) * patch[2]
    packed = packed_sequence.minimax_h3_packed_sequence(
        text_len=text_len,
        latent_t=latent_t,
        latent_h=latent_h,
        latent_w=latent_w,
        audio_t=n_audio // 2,
        include_keyframe_cond=False,
    )
    used = int(packed["cu_seqlens"][1])
    checks = {
        "video_indices": torch.equal(packed["img_pos"], kw["video_indices"]),
        "audio_indices": torch.equal(packed["audio_pos"], kw["audio_indices"]),
        "text_indices": torch.equal(packed["text_pos"], kw["text_indices"]),
        "token_tags": torch.equal(packed["token_tags"][:used], kw["token_tags"]),
        "position_ids": torch.equal(packed["img_position_ids"][:used], pos),
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(
            f"minimax_h3 (sglang): the inputs' {', '.join(bad)} are not the engine's t2va packing "
            f"for text {text_len}, latents {latent_t}x{latent_h}x{latent_w}, audio "
            f"{n_audio // 2}x2 (packed_sequence.minimax_h3_packed_sequence); make them with "
            "Family.make_inputs of the minimax_h3 family."
        )
    tags = packed["token_tags"]
    tags[packed["text_pos"]] = kw["token_tags"][kw["text_indices"]]
    branch = denoise_loop.MiniMaxH3DenoiseBranch(
        packed=packed,
        text_embeddings=text[0],
        token_tags=tags,
        device=torch.device("cpu"),
    )
    t, index = kw["timestep"], kw["timestep_indices"]
    t_video = float(t[index[kw["video_indices"][0]]])
    t_audio = float(t[index[kw["audio_indices"][0]]])
    (plan,) = branch.prepare_timestep_plan(
        video_timesteps=[t_video],
        audio_timesteps=[t_audio],
        imgvid_cond_noise_aug=denoise_loop.MINIMAX_H3_IMGVID_COND_TIMESTEP,
        audio_ref_cond_noise_aug=denoise_loop.MINIMAX_H3_AUDIO_REF_COND_TIMESTEP,
    )
    return branch.forward_kwargs(
        video_rows=video[0].to(torch.float32),
        audio_rows=audio[0].to(torch.float32),
        step_timesteps=plan,
    )


def output_view(name: str, engine: torch.Tensor, diffusers: torch.Tensor) -> torch.Tensor:
    """One engine output laid out as diffusers' (`EngineFamily.output_view`).

    - The engine's SwiGLU input projections (`mlp.fc1`) hold diffusers' `[value, gate]` rows
      as `[gate, value]` (`_diffusers_h3_checkpoint`): their output halves are swapped back.
    - The engine runs one unbatched packed sequence, padded up to a multiple of 64 rows
      (`MINIMAX_H3_PACKED_SEQUENCE_ALIGNMENT`; the pad rows are a cu_seqlens segment of their
      own, attended only among themselves); diffusers' rows are `(1, rows, ...)`. A row axis
      of diffusers' length, or of it padded to 64, takes the leading rows and the batch axis.
    Anything else is returned as it is (a shape that still differs is reported as such).
    """
    if name.endswith("mlp.fc1") and engine.shape[-1] % 2 == 0:
        gate, value = engine.chunk(2, dim=-1)
        engine = torch.cat((value, gate), dim=-1)
    if engine.shape == diffusers.shape:
        return engine
    if diffusers.dim() == engine.dim() + 1 and diffusers.shape[0] == 1 and engine.dim():
        rows = diffusers.shape[1]
        padded = -(-rows // 64) * 64
        if engine.shape[1:] == diffusers.shape[2:] and engine.shape[0] in (rows, padded):
            return engine[:rows].unsqueeze(0)
    return engine


ENGINE = EngineFamily(
    family_name="minimax_h3",
    dit="sglang.multimodal_gen.runtime.models.dits.minimax_h3:MiniMaxH3DiTModel",
    config="sglang.multimodal_gen.configs.models.dits.minimax_h3:MiniMaxH3DiTConfig",
    arch="sglang.multimodal_gen.configs.models.dits.minimax_h3:MiniMaxH3DiTArchConfig",
    pipeline="sglang.multimodal_gen.configs.pipeline_configs.minimax_h3:MiniMaxH3PipelineConfig",
    arch_config=arch_config,
    forward_kwargs=forward_kwargs,
    output_view=output_view,
    # The engine's RoPE frequencies are a persistent buffer it loads
    # (MINIMAX_H3_FP32_BUFFER_NAMES); diffusers' is non-persistent, out of its state dict.
    loaded_buffers=("rope.inv_freq",),
    # MiniMaxH3DenoisingStage.forward runs its own loop (minimax_h3_denoise_loop) with no
    # autocast, whatever MiniMaxH3PipelineConfig.enable_autocast says; the DiT casts itself
    # (bf16 activations, its fp32 heads).
    stage_autocast=False,
    source="runtime/pipelines_core/stages/model_specific_stages/minimax_h3/stages/denoising.py:"
    "MiniMaxH3DenoisingStage._run_full_loop; packed_sequence.py:minimax_h3_packed_sequence; "
    "denoise_loop.py:MiniMaxH3DenoiseBranch; runtime/models/dits/minimax_h3.py:"
    "MiniMaxH3DiTModel.forward",
)

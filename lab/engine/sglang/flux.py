"""Flux.1-dev in the engine: sglang's FluxTransformer2DModel (the same module names)."""

from __future__ import annotations

from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily, scheduler_timestep
from lab.families import Inputs


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The kwargs `FluxPipelineConfig` and the denoising stage build for one step.

    The scheduler's fp32 t = sigma * 1000 goes in raw and the engine's model does not scale it
    (diffusers' pipeline rounds t to the latent dtype, divides by 1000, and its model casts to
    the activation dtype and multiplies back); guidance is `full(B, 3.5 * 1000)` in the latent
    dtype; RoPE (cos, sin) comes from the model's `rotary_emb` over cat(txt_ids, img_ids).
    """
    kw = inputs.kwargs
    hidden = kw["hidden_states"].to(dtype)
    ids = torch.cat([kw["txt_ids"], kw["img_ids"]], dim=0).float()
    return dict(
        hidden_states=hidden,
        encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
        pooled_projections=kw["pooled_projections"].to(dtype),
        timestep=scheduler_timestep(inputs, hidden.shape[0]),
        guidance=(kw["guidance"].float() * 1000).to(hidden.dtype),
        freqs_cis=model.rotary_emb(ids),
    )


_SPLIT_VIEWS = (
    "the engine projects the [text | image] split of the joint attention output as views "
    "(split_seqs): at batch > 1 they are not contiguous and torch's F.linear adds the bias after "
    "the matmul rounds; diffusers makes them contiguous first, one rounding (the 'flux_native' "
    "patch group runs the engine's way)"
)

ENGINE = EngineFamily(
    family_name="flux",
    dit="sglang.multimodal_gen.runtime.models.dits.flux:FluxTransformer2DModel",
    config="sglang.multimodal_gen.configs.models.dits.flux:FluxConfig",
    arch="sglang.multimodal_gen.configs.models.dits.flux:FluxArchConfig",
    pipeline="sglang.multimodal_gen.configs.pipeline_configs.flux:FluxPipelineConfig",
    forward_kwargs=forward_kwargs,
    differences={
        "transformer_blocks.*.attn.to_out.0": _SPLIT_VIEWS,
        "transformer_blocks.*.attn.to_add_out": _SPLIT_VIEWS,
    },
    parameterless={
        "rotary_emb*": "builds the RoPE table outside the blocks (diffusers: pos_embed)",
        "*.attn.attn": "the engine's attention-kernel module; diffusers calls the kernel as a "
        "function inside its Attention",
    },
    source="runtime/models/dits/flux.py:FluxTransformer2DModel.forward",
)

"""Flux.1-dev in the engine: sglang's FluxTransformer2DModel (the same module names)."""

from __future__ import annotations

from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily
from lab.families import Inputs


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The engine passes timestep and guidance already x1000 and RoPE built outside the model.

    diffusers' FluxPipeline passes t/1000 and guidance 3.5 and the model multiplies both by
    1000 after casting them to the hidden dtype; the engine's pipeline multiplies first. The
    RoPE (cos, sin) comes from the model's own `rotary_emb` over cat(txt_ids, img_ids).
    """
    kw = inputs.kwargs
    ids = torch.cat([kw["txt_ids"], kw["img_ids"]], dim=0)
    return dict(
        hidden_states=kw["hidden_states"].to(dtype),
        encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
        pooled_projections=kw["pooled_projections"].to(dtype),
        timestep=(kw["timestep"] * 1000).to(dtype),
        guidance=(kw["guidance"] * 1000).to(dtype),
        freqs_cis=model.rotary_emb(ids),
    )


ENGINE = EngineFamily(
    family_name="flux",
    dit="sglang.multimodal_gen.runtime.models.dits.flux:FluxTransformer2DModel",
    config="sglang.multimodal_gen.configs.models.dits.flux:FluxConfig",
    arch="sglang.multimodal_gen.configs.models.dits.flux:FluxArchConfig",
    forward_kwargs=forward_kwargs,
    parameterless={
        "rotary_emb*": "builds the RoPE table outside the blocks (diffusers: pos_embed)",
        "*.attn.attn": "the engine's attention-kernel module; diffusers calls the kernel as a "
        "function inside its Attention",
    },
    source="runtime/models/dits/flux.py:FluxTransformer2DModel.forward",
)

"""SD3.5 in the engine: sglang's SD3Transformer2DModel (diffusers' module names)."""

from __future__ import annotations

from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily
from lab.families import Inputs


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The engine hands SD3's DiT what diffusers' StableDiffusion3Pipeline does."""
    kw = inputs.kwargs
    return dict(
        hidden_states=kw["hidden_states"].to(dtype),
        encoder_hidden_states=kw["encoder_hidden_states"].to(dtype),
        pooled_projections=kw["pooled_projections"].to(dtype),
        timestep=kw["timestep"],
    )


ENGINE = EngineFamily(
    family_name="sd3",
    dit="sglang.multimodal_gen.runtime.models.dits.stablediffusion3:SD3Transformer2DModel",
    config="sglang.multimodal_gen.configs.models.dits.stablediffusion3:"
    "StableDiffusion3TransformerConfig",
    arch="sglang.multimodal_gen.configs.models.dits.stablediffusion3:"
    "StableDiffusion3TransformerArchConfig",
    pipeline="sglang.multimodal_gen.configs.pipeline_configs.stablediffusion3:StableDiffusion3PipelineConfig",
    forward_kwargs=forward_kwargs,
    parameterless={
        "*.attn.attn": "the engine's attention-kernel module; diffusers calls the kernel as a "
        "function inside its Attention",
    },
    source="runtime/models/dits/stablediffusion3.py:SD3Transformer2DModel.forward",
)

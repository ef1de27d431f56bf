"""Wan2.2 in the engine: sglang's WanTransformer3DModel (most modules renamed)."""

from __future__ import annotations

from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily, scheduler_timestep
from lab.families import Inputs


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The kwargs the engine's denoising stage hands Wan's DiT for one (rollout) step.

    Latents cast to the DiT precision, the umT5 text in fp32 as encoded, the scheduler's fp32
    t = sigma * 1000 (a rollout maps Wan's UniPC scheduler to flow-match Euler); RoPE is built
    inside the model.
    """
    kw = inputs.kwargs
    hidden = kw["hidden_states"]
    batch = hidden.shape[0]
    return dict(
        hidden_states=hidden.to(dtype),
        encoder_hidden_states=kw["encoder_hidden_states"],
        timestep=scheduler_timestep(inputs, batch),
        encoder_hidden_states_image=None,
    )


ENGINE = EngineFamily(
    family_name="wan2_2",
    dit="sglang.multimodal_gen.runtime.models.dits.wanvideo:WanTransformer3DModel",
    config="sglang.multimodal_gen.configs.models.dits.wanvideo:WanVideoConfig",
    arch="sglang.multimodal_gen.configs.models.dits.wanvideo:WanVideoArchConfig",
    pipeline="sglang.multimodal_gen.configs.pipeline_configs.wan:Wan2_2_T2V_A14B_Config",
    forward_kwargs=forward_kwargs,
    parameterless={
        "*.attn1": "the engine's self-attention kernel module (diffusers' attn1 also holds "
        "the projections, which the engine keeps on the block)",
        "*.attn2.attn": "the engine's cross-attention kernel module; diffusers calls the "
        "kernel as a function inside its Attention",
        "rotary_emb*": "the engine's RoPE module (diffusers: rope)",
    },
    source="runtime/pipelines_core/stages/denoising.py (timestep = scheduler t, latents cast "
    "to the DiT precision); runtime/models/dits/wanvideo.py:WanTransformer3DModel.forward",
)

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
    # No `differences`: with these switches the CPU check is bit-exact (tiny, bf16, seeds 0-3,
    # both experts). Without them the two ops differ inside what the engine exposes as no
    # aligned output (its fused norm ops, its attention kernel), so their rows read as inherited
    # inputs and these switches are where the cause is named.
    cpu_op_switches={
        "rope_table_dtype": (
            "bf16",
            "the self-attention RoPE: on a GPU the engine rotates q and k in fp32 (FlashInfer's "
            "apply_rope_with_cos_sin_cache_inplace, or its CuTe RMSNorm + RoPE kernel) and "
            "rounds once, as the emulation does by default; on a CPU it runs the torch "
            "fallback apply_rotary_embedding_native, which casts cos/sin to the activation "
            "dtype and rotates in bf16 (each product and sum rounds)",
        ),
        "wan_norm_path": (
            "native",
            "norm1, the residual norms, MulAdd and norm_out: the emulation follows the "
            "engine's CUDA dispatch, its fused CuTe kernels ('fp32 once') at D % 256 == 0 and "
            "its torch forward_native elsewhere; on a CPU the engine runs forward_native at "
            "every width (its sgl_kernel CPU kernels are not installed here, so lab's "
            "cpu_routing sends them to forward_native)",
        ),
    },
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

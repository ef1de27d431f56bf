"""Qwen-Image in the engine: sglang's QwenImageTransformer2DModel (add_{q,k,v}_proj fused)."""

from __future__ import annotations

from typing import Any

import torch

from lab.engine.sglang.adapter import EngineFamily, scheduler_timestep
from lab.families import Inputs


def forward_kwargs(model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype) -> dict[str, Any]:
    """The kwargs `QwenImagePipelineConfig` and the denoising stage build for one step.

    The scheduler's fp32 t = sigma * 1000 goes in raw (the model divides by 1000 and casts to
    the activation dtype itself); RoPE tables come from the pipeline config's static
    `get_freqs_cis` over the model's `rotary_emb`; the text mask is None for one prompt.
    """
    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import QwenImagePipelineConfig

    kw = inputs.kwargs
    hidden = kw["hidden_states"]
    text = kw["encoder_hidden_states"]
    batch, text_len = text.shape[:2]
    img_shapes = kw["img_shapes"]
    txt_seq_lens = [text_len] * batch
    freqs_cis, freqs_complex = QwenImagePipelineConfig.get_freqs_cis(
        img_shapes, txt_seq_lens, model.rotary_emb, hidden.device, dtype
    )
    return dict(
        hidden_states=hidden.to(dtype),
        encoder_hidden_states=text,
        encoder_hidden_states_mask=kw.get("encoder_hidden_states_mask") if batch > 1 else None,
        timestep=scheduler_timestep(inputs, batch),
        img_shapes=img_shapes,
        txt_seq_lens=txt_seq_lens,
        freqs_cis=freqs_cis,
        freqs_complex=freqs_complex,
        guidance=None,
    )


_RMS_NORM = (
    "the engine's RMSNorm (sglang RMSNorm.forward_native) multiplies the fp32-normalised value "
    "by the weight in fp32 and rounds once; diffusers' RMSNorm rounds to the activation dtype "
    "before the weight multiply (the 'qwen_image_native' patch group runs the engine's way)"
)
_SPLIT_VIEWS = (
    "the engine projects the [text | image] split of the joint attention output as views "
    "(split_seqs): at batch > 1 they are not contiguous and torch's F.linear adds the bias after "
    "the matmul rounds; diffusers makes them contiguous first, one rounding (the "
    "'qwen_image_native' patch group runs the engine's way)"
)

ENGINE = EngineFamily(
    family_name="qwen_image",
    dit="sglang.multimodal_gen.runtime.models.dits.qwen_image:QwenImageTransformer2DModel",
    config="sglang.multimodal_gen.configs.models.dits.qwenimage:QwenImageDitConfig",
    arch="sglang.multimodal_gen.configs.models.dits.qwenimage:QwenImageArchConfig",
    pipeline="sglang.multimodal_gen.configs.pipeline_configs.qwen_image:QwenImagePipelineConfig",
    forward_kwargs=forward_kwargs,
    differences={
        "txt_norm": _RMS_NORM,
        "transformer_blocks.*.attn.norm_*": _RMS_NORM,
        "transformer_blocks.*.attn.to_out.0": _SPLIT_VIEWS,
        "transformer_blocks.*.attn.to_add_out": _SPLIT_VIEWS,
    },
    parameterless={
        "rotary_emb*": "builds the RoPE tables outside the blocks (diffusers: pos_embed)",
        "*.attn.attn": "the engine's attention-kernel module; diffusers calls the kernel as a "
        "function inside its Attention",
    },
    source="configs/pipeline_configs/qwen_image.py:_prepare_cond_kwargs, get_freqs_cis; "
    "runtime/pipelines_core/stages/denoising.py (timestep = scheduler t)",
)

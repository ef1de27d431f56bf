"""The engine patch groups and module-level switches, as forwards.

Each replacement forward is the diffusers 0.42.1 forward of its class with the rounding points
written out, so a reader can see where each side rounds. Shape legend: B batch, L tokens,
D model width, H heads, K head dim, F/Hh/Ww latent frames/height/width.

Where the stock diffusers forward already rounds where the engine does, the group says so in its
description instead of installing a copy (diffusers RoPE is computed in fp32/fp64 and rounded
once in `apply_rotary_emb*`, as sglang-d's is and as sglang's GPU kernels are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from lab.precision.engine_registry import (
    SWITCHES,
    PatchGroup,
    Switch,
    register_group,
    register_switch,
)

if TYPE_CHECKING:
    from lab.families import Inputs

# ---- shared rounding helpers -----------------------------------------------------------------


def _rms_norm_round_before_weight(module: torch.nn.Module) -> Callable[..., Any]:
    """RMSNorm as sgld runs it: fp32 normalise, round to the input dtype, then the weight."""
    dims = _normalized_ndim(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        x32 = x.float()
        variance = x32.pow(2).mean(dim=tuple(range(-dims, 0)), keepdim=True)
        # The engine's fused kernel writes the normalised value at the activation dtype first.
        out = (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
        if module.weight is not None:
            out = out * module.weight
        bias = getattr(module, "bias", None)
        if bias is not None:
            out = out + bias
        return out

    return forward


def _rms_norm_native(module: torch.nn.Module) -> Callable[..., Any]:
    """RMSNorm as sglang's `RMSNorm.forward_native` runs it: one rounding, after the weight.

    x in fp32, times rsqrt(mean(x^2) + eps), times the weight promoted to fp32, rounded once to
    x's dtype (sglang 0.5.23, runtime/layers/layernorm.py). The wan group's q/k norms and the
    qwen_image_native group's RMSNorms.
    """
    dims = _normalized_ndim(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        x32 = x.float()
        variance = x32.pow(2).mean(dim=tuple(range(-dims, 0)), keepdim=True)
        out = x32 * torch.rsqrt(variance + eps)
        if module.weight is not None:
            out = out * module.weight
        bias = getattr(module, "bias", None)
        if bias is not None:
            out = out + bias
        return out.to(x.dtype)

    return forward


def _normalized_ndim(module: torch.nn.Module) -> int:
    shape = getattr(module, "normalized_shape", None) or getattr(module, "dim", None)
    return len(tuple(shape)) if shape is not None else 1


def _select_mod(
    mod_params: torch.Tensor, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QwenImageTransformerBlock._modulate's parameter selection: (shift, scale, gate) (B, 1, D)."""
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    if index is None:
        return shift.unsqueeze(1), scale.unsqueeze(1), gate.unsqueeze(1)
    half = shift.size(0) // 2
    idx = index.unsqueeze(-1)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return torch.where(idx == 0, t[:half].unsqueeze(1), t[half:].unsqueeze(1))

    return pick(shift), pick(scale), pick(gate)


# ---- Qwen-Image block: two rounding recipes ---------------------------------------------------


def _qwen_block(autocast_points: bool) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """QwenImageTransformerBlock.forward with sgld (eager) or trainer-autocast rounding points.

    eager (sgld, LayerNormScaleShift): LayerNorm output rounded to the activation dtype, then
    `x * (1 + scale) + shift` in that dtype (three roundings).
    autocast (qwen_image): LayerNorm computes and returns fp32, `(1 + scale)` rounds once in
    bf16, the product and the shift promote to fp32, and the single rounding happens at the next
    matmul input (done here, since the engine side's matmul has no autocast to do it).
    """

    def factory(block: torch.nn.Module) -> Callable[..., Any]:
        def norm_mod(
            norm: torch.nn.Module, x_BLD: torch.Tensor, params: torch.Tensor, index: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            shift, scale, gate = _select_mod(params, index)
            if autocast_points:
                normed = norm(x_BLD.float())
                modulated = (normed * (1 + scale) + shift).to(x_BLD.dtype)
            else:
                dt = x_BLD.dtype
                normed = norm(x_BLD).to(dt)
                modulated = normed * (1 + scale.to(dt)) + shift.to(dt)
            return modulated, gate

        def forward(
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            encoder_hidden_states_mask: torch.Tensor | None,
            temb: torch.Tensor,
            image_rotary_emb: Any = None,
            joint_attention_kwargs: dict[str, Any] | None = None,
            modulate_index: Any = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            b = block
            img_params = b.img_mod(temb)
            if b.zero_cond_t:
                temb = torch.chunk(temb, 2, dim=0)[0]
            txt_params = b.txt_mod(temb)
            img_mod1, img_mod2 = img_params.chunk(2, dim=-1)
            txt_mod1, txt_mod2 = txt_params.chunk(2, dim=-1)

            img_in, img_gate1 = norm_mod(b.img_norm1, hidden_states, img_mod1, modulate_index)
            txt_in, txt_gate1 = norm_mod(b.txt_norm1, encoder_hidden_states, txt_mod1, None)
            img_attn, txt_attn = b.attn(
                hidden_states=img_in,
                encoder_hidden_states=txt_in,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                image_rotary_emb=image_rotary_emb,
                **(joint_attention_kwargs or {}),
            )
            # Gated residuals: `c + a * k` in the activation dtype on both engine and trainer.
            hidden_states = hidden_states + img_gate1 * img_attn
            encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn

            img_in2, img_gate2 = norm_mod(b.img_norm2, hidden_states, img_mod2, modulate_index)
            hidden_states = hidden_states + img_gate2 * b.img_mlp(img_in2)
            txt_in2, txt_gate2 = norm_mod(b.txt_norm2, encoder_hidden_states, txt_mod2, None)
            encoder_hidden_states = encoder_hidden_states + txt_gate2 * b.txt_mlp(txt_in2)

            if encoder_hidden_states.dtype == torch.float16:
                encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
            if hidden_states.dtype == torch.float16:
                hidden_states = hidden_states.clip(-65504, 65504)
            return encoder_hidden_states, hidden_states

        return forward

    return factory


def _ada_continuous(autocast_points: bool) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """AdaLayerNormContinuous (final norm_out) with eager or trainer-autocast rounding points."""

    def factory(module: torch.nn.Module) -> Callable[..., Any]:
        def forward(x_BLD: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
            dt = x_BLD.dtype
            emb = module.linear(module.silu(conditioning_embedding).to(dt))
            scale, shift = torch.chunk(emb, 2, dim=1)
            if autocast_points:
                normed = module.norm(x_BLD.float())
                return (normed * (1 + scale)[:, None, :] + shift[:, None, :]).to(dt)
            normed = module.norm(x_BLD).to(dt)
            return normed * (1 + scale.to(dt))[:, None, :] + shift.to(dt)[:, None, :]

        return forward

    return factory


# ---- joint attention projecting the [text | image] split as views (Qwen-Image, Flux) ----------
#
# The engine splits the joint attention output with `split_seqs` (narrowed views) and hands the
# views to its output projections; diffusers makes each part contiguous first. At batch > 1 the
# views are not contiguous, and torch's F.linear then runs matmul and adds the bias afterwards
# (a second bf16 rounding; aten's linear fuses the bias in addmm only for a contiguous input).
# At batch 1 the views are contiguous and both ways are the same addmm.


def _qwen_attention_on_views(module: torch.nn.Module) -> Callable[..., Any]:
    """Attention.forward with QwenDoubleStreamAttnProcessor2_0, output projections on the views.

    diffusers 0.42.1's processor without its two `.contiguous()` calls; any other processor
    runs the class's own forward.
    """
    from diffusers.models.transformers.transformer_qwenimage import (
        QwenDoubleStreamAttnProcessor2_0,
        apply_rotary_emb_qwen,
    )

    processor = module.processor
    if type(processor) is not QwenDoubleStreamAttnProcessor2_0:
        return type(module).forward.__get__(module)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    attn = module

    def forward(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **ignored: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Unknown kwargs are dropped, as Attention.forward drops what its processor does not take.
        if encoder_hidden_states is None:
            raise ValueError("QwenDoubleStreamAttnProcessor2_0 requires encoder_hidden_states")
        if attention_mask is not None:
            raise ValueError(
                "QwenDoubleStreamAttnProcessor2_0 does not accept an external attention_mask; "
                "pass encoder_hidden_states_mask."
            )
        if encoder_hidden_states_mask is not None:
            image_mask = torch.ones(
                hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device
            )
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
            attention_mask = attention_mask[:, None, None, :]
        seq_txt = encoder_hidden_states.shape[1]
        head_dim = attn.inner_dim // attn.heads
        img_q, img_k, img_v = (
            p(hidden_states).unflatten(-1, (-1, head_dim))
            for p in (attn.to_q, attn.to_k, attn.to_v)
        )
        txt_q, txt_k, txt_v = (
            p(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q = apply_rotary_emb_qwen(img_q, img_freqs, use_real=False)
            img_k = apply_rotary_emb_qwen(img_k, img_freqs, use_real=False)
            txt_q = apply_rotary_emb_qwen(txt_q, txt_freqs, use_real=False)
            txt_k = apply_rotary_emb_qwen(txt_k, txt_freqs, use_real=False)
        joint_q = torch.cat([txt_q, img_q], dim=1)
        joint = dispatch_attention_fn(
            joint_q,
            torch.cat([txt_k, img_k], dim=1),
            torch.cat([txt_v, img_v], dim=1),
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=processor._attention_backend,
            parallel_config=processor._parallel_config,
        )
        joint = joint.flatten(2, 3).to(joint_q.dtype)
        img_out = attn.to_out[0](joint[:, seq_txt:, :])
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(joint[:, :seq_txt, :])

    return forward


def _flux_attention_on_views(module: torch.nn.Module) -> Callable[..., Any]:
    """FluxAttention.forward with FluxAttnProcessor, the output projections on the views.

    diffusers 0.42.1's processor without its two `.contiguous()` calls (the double-stream
    blocks; a single-stream block has no split and runs the same ops as the stock forward);
    any other processor runs the class's own forward.
    """
    from diffusers.models.transformers.transformer_flux import (
        FluxAttnProcessor,
        _get_qkv_projections,
    )

    processor = module.processor
    if type(processor) is not FluxAttnProcessor:
        return type(module).forward.__get__(module)
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb

    attn = module

    def forward(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
        **ignored: Any,
    ) -> Any:
        # Unknown kwargs are dropped, as FluxAttention.forward drops what its processor does not.
        q, k, v, enc_q, enc_k, enc_v = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        q = attn.norm_q(q.unflatten(-1, (-1, attn.head_dim)))
        k = attn.norm_k(k.unflatten(-1, (-1, attn.head_dim)))
        v = v.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:
            enc_q = attn.norm_added_q(enc_q.unflatten(-1, (-1, attn.head_dim)))
            enc_k = attn.norm_added_k(enc_k.unflatten(-1, (-1, attn.head_dim)))
            enc_v = enc_v.unflatten(-1, (-1, attn.head_dim))
            q, k, v = (
                torch.cat([enc_q, q], dim=1),
                torch.cat([enc_k, k], dim=1),
                torch.cat([enc_v, v], dim=1),
            )
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = dispatch_attention_fn(
            q,
            k,
            v,
            attn_mask=attention_mask,
            backend=processor._attention_backend,
            parallel_config=processor._parallel_config,
        )
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        seq_txt = encoder_hidden_states.shape[1]
        txt, img = out.split_with_sizes([seq_txt, out.shape[1] - seq_txt], dim=1)
        img = attn.to_out[1](attn.to_out[0](img))
        return img, attn.to_add_out(txt)

    return forward


# ---- SD3-shaped AdaLN-Zero (sgld: plain bf16/fp16 eager) ------------------------------------


def _ada_zero_eager(module: torch.nn.Module) -> Callable[..., Any]:
    """AdaLayerNormZero: LayerNorm rounded to the activation dtype, scale/shift in that dtype."""

    def forward(
        x: torch.Tensor,
        timestep: Any = None,
        class_labels: Any = None,
        hidden_dtype: Any = None,
        emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        if module.emb is not None:
            emb = module.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = module.linear(module.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        dt = x.dtype
        normed = module.norm(x).to(dt)
        x = normed * (1 + scale_msa.to(dt)[:, None]) + shift_msa.to(dt)[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp

    return forward


def _ada_zero_x_eager(module: torch.nn.Module) -> Callable[..., Any]:
    """SD35AdaLayerNormZeroX: as AdaLayerNormZero, with the second (dual-attention) modulation."""

    def forward(hidden_states: torch.Tensor, emb: torch.Tensor | None = None) -> tuple:
        emb = module.linear(module.silu(emb))
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2,
         gate_msa2) = emb.chunk(9, dim=1)  # fmt: skip
        dt = hidden_states.dtype
        normed = module.norm(hidden_states).to(dt)
        out = normed * (1 + scale_msa.to(dt)[:, None]) + shift_msa.to(dt)[:, None]
        out2 = normed * (1 + scale_msa2.to(dt)[:, None]) + shift_msa2.to(dt)[:, None]
        return out, gate_msa, shift_mlp, scale_mlp, gate_mlp, out2, gate_msa2

    return forward


# ---- Wan: the engine's blocks and root (by width), sgld's anti-parity blocks ------------------

WAN_NORM_PATHS: tuple[str, ...] = ("by_width", "native", "fused")
"""How the wan group runs Wan's norm + modulation ops (the `wan_norm_path` switch)."""


def wan_fused_norm_width(width: int) -> bool:
    """Whether sglang's CUDA dispatch runs its fused norm kernels at this model width.

    `_NormScaleShift.forward_cuda` and `_ScaleResidualNormScaleShift.forward_cuda` (sglang
    0.5.23, runtime/layers/layernorm.py) call their CuTe kernels only for D % 256 == 0 and
    D <= 8192 and fall back to their torch `forward_native` otherwise: at the tiny preset's
    D = 24 a GPU runs the engine's torch definitions, as a CPU does at every width.
    """
    return width % 256 == 0 and width <= 8192


def _wan_block(fp32_once: bool) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """WanTransformerBlock.forward (wan2.1 / A14B temb layout (B, 6, D)).

    fp32 once: LayerNorm, modulation, gated residual and mul-add in fp32, one cast back
    (diffusers' own block, and the rounding points of sglang's fused CuTe norm kernels).
    eager (sgld): the SD3-shaped fused ops on Wan: table + temb, LayerNorm, scale/shift and the
    gated residual each round to the activation dtype; the record calls this anti-parity.
    """

    def factory(block: torch.nn.Module) -> Callable[..., Any]:
        def forward(
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            temb: torch.Tensor,
            rotary_emb: Any,
        ) -> torch.Tensor:
            b = block
            dt = hidden_states.dtype
            if temb.ndim == 4:
                table = b.scale_shift_table.unsqueeze(0)
                chunks = [c.squeeze(2) for c in _wan_table(table, temb, fp32_once, dt).chunk(6, 2)]
            else:
                chunks = list(_wan_table(b.scale_shift_table, temb, fp32_once, dt).chunk(6, dim=1))
            shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = chunks

            if fp32_once:
                normed = b.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa
                attn = b.attn1(normed.type_as(hidden_states), None, None, rotary_emb)
                hidden_states = (hidden_states.float() + attn * gate_msa).type_as(hidden_states)
            else:
                normed = b.norm1(hidden_states).to(dt) * (1 + scale_msa) + shift_msa
                attn = b.attn1(normed, None, None, rotary_emb)
                hidden_states = hidden_states + attn * gate_msa

            normed = b.norm2(hidden_states.float()).type_as(hidden_states)
            hidden_states = hidden_states + b.attn2(normed, encoder_hidden_states, None, None)

            if fp32_once:
                normed = b.norm3(hidden_states.float()) * (1 + c_scale) + c_shift
                ff = b.ffn(normed.type_as(hidden_states))
                hidden_states = (hidden_states.float() + ff.float() * c_gate).type_as(hidden_states)
            else:
                normed = b.norm3(hidden_states).to(dt) * (1 + c_scale) + c_shift
                hidden_states = hidden_states + b.ffn(normed) * c_gate
            return hidden_states

        return forward

    return factory


def _wan_table(
    table: torch.Tensor, temb: torch.Tensor, fp32_once: bool, dt: torch.dtype
) -> torch.Tensor:
    if fp32_once:
        return table + temb.float()
    return (table.to(dt) + temb.to(dt)).to(dt)


def _wan_fused(path: str, width: int) -> bool:
    return path == "fused" or (path == "by_width" and wan_fused_norm_width(width))


def _wan_engine_block(path: str) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """WanTransformerBlock.forward as sglang 0.5.23's WanTransformerBlock computes it.

    The modulation is `e = scale_shift_table + temb.float()` (the table at the DiT dtype, the
    sum fp32) in every path. Then, path "native" (the engine's torch `forward_native` of its
    fused ops: on a CPU, and on a GPU at widths its kernels refuse):

    - norm1 (LayerNormScaleShift): the fp32 LayerNorm rounded to the activation dtype, then
      `* (1 + scale) + shift` in fp32 (fp32 modulation), rounded again;
    - self_attn_residual_norm: `hs + attn * gate` in fp32, norm2 (fp32 affine) of that fp32
      sum, both rounded;
    - cross_attn_residual_norm: `hs + attn2` in the activation dtype, its LayerNorm rounded,
      the fp32 modulation, rounded;
    - mlp_residual (MulAdd): `hs + ff * gate` in fp32, rounded.

    Path "fused": the rounding points of the CuTe kernels (`_wan_block(fp32_once=True)`).
    Path "by_width": "fused" where `wan_fused_norm_width(D)`, else "native": as the engine's
    CUDA dispatch chooses.
    """

    def factory(block: torch.nn.Module) -> Callable[..., Any]:
        if _wan_fused(path, block.scale_shift_table.shape[-1]):
            return _wan_block(fp32_once=True)(block)

        def forward(
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            temb: torch.Tensor,
            rotary_emb: Any,
        ) -> torch.Tensor:
            b = block
            dt = hidden_states.dtype
            if temb.ndim == 4:
                table = b.scale_shift_table.unsqueeze(0)
                chunks = [c.squeeze(2) for c in _wan_table(table, temb, True, dt).chunk(6, 2)]
            else:
                chunks = list(_wan_table(b.scale_shift_table, temb, True, dt).chunk(6, dim=1))
            shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = chunks

            # norm1 is an FP32LayerNorm: fp32 inside, its output at the input's dtype.
            normed = (b.norm1(hidden_states) * (1 + scale_msa) + shift_msa).to(dt)
            attn = b.attn1(normed, None, None, rotary_emb)
            residual = hidden_states + attn * gate_msa
            normed = b.norm2(residual).to(dt)
            hidden_states = residual.to(dt)
            hidden_states = hidden_states + b.attn2(normed, encoder_hidden_states, None, None)
            normed = (b.norm3(hidden_states) * (1 + c_scale) + c_shift).to(dt)
            return (hidden_states + b.ffn(normed) * c_gate).to(dt)

        return forward

    return factory


def _wan_root(path: str) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """WanTransformer3DModel.forward with the output norm and table as sglang 0.5.23 runs them.

    sglang's `_unpatchify` adds its scale_shift_table (held at the DiT dtype) and temb (the time
    MLP's output, at the activation dtype) in that dtype, so shift and scale are rounded sums.
    norm_out (LayerNormScaleShift) then: path "native" rounds the fp32 LayerNorm to the
    activation dtype and modulates with those bf16 tensors in bf16 (`(1 + scale)`, the product
    and the shift each round); path "fused" keeps the LayerNorm fp32 and rounds once.
    "by_width" picks as `_wan_engine_block` does.
    """
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    def factory(module: torch.nn.Module) -> Callable[..., Any]:
        fused = _wan_fused(path, module.scale_shift_table.shape[-1])

        def forward(
            hidden_states: torch.Tensor,
            timestep: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            encoder_hidden_states_image: torch.Tensor | None = None,
            return_dict: bool = True,
            attention_kwargs: dict[str, Any] | None = None,
        ) -> Any:
            m = module
            b, _, f, h, w = hidden_states.shape
            p_t, p_h, p_w = m.config.patch_size
            ppf, pph, ppw = f // p_t, h // p_h, w // p_w
            rotary_emb = m.rope(hidden_states)
            x_BLD = m.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
            ts_seq_len = None
            if timestep.ndim == 2:
                ts_seq_len = timestep.shape[1]
                timestep = timestep.flatten()
            temb, timestep_proj, encoder_hidden_states, image_states = m.condition_embedder(
                timestep,
                encoder_hidden_states,
                encoder_hidden_states_image,
                timestep_seq_len=ts_seq_len,
            )
            timestep_proj = timestep_proj.unflatten(2 if ts_seq_len is not None else 1, (6, -1))
            if image_states is not None:
                encoder_hidden_states = torch.concat([image_states, encoder_hidden_states], dim=1)
            for block in m.blocks:
                x_BLD = block(x_BLD, encoder_hidden_states, timestep_proj, rotary_emb)

            dt = x_BLD.dtype
            table, temb = m.scale_shift_table.to(dt), temb.to(dt)
            if temb.ndim == 3:
                shift, scale = (table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
                shift, scale = shift.squeeze(2), scale.squeeze(2)
            else:
                shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)
            normed = m.norm_out(x_BLD.float()) if fused else m.norm_out(x_BLD)
            x_BLD = (normed * (1 + scale) + shift).to(dt)
            x_BLD = m.proj_out(x_BLD)
            x = x_BLD.reshape(b, ppf, pph, ppw, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
            output = x.flatten(6, 7).flatten(4, 5).flatten(2, 3)
            if not return_dict:
                return (output,)
            return Transformer2DModelOutput(sample=output)

        return forward

    return factory


def _dispatch_rms(
    diffusers_style: Callable[[torch.nn.Module], Callable[..., Any]],
    torch_style: Callable[[torch.nn.Module], Callable[..., Any]] | None,
) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """One factory for the two classes named "RMSNorm" (diffusers' and torch.nn's)."""

    def factory(module: torch.nn.Module) -> Callable[..., Any]:
        if isinstance(module, torch.nn.RMSNorm):
            if torch_style is None:
                return type(module).forward.__get__(module)
            return torch_style(module)
        return diffusers_style(module)

    return factory


register_group(
    PatchGroup(
        name="sgld",
        description=(
            "sglang-d's SD3-shaped fused ops in bf16 eager: RMSNorm rounds to the activation "
            "dtype before the weight multiply; LayerNorm + scale/shift in plain bf16; the gated "
            "residual c + a*k in bf16. RoPE stays diffusers' (fp32 complex, rounded once)."
        ),
        forwards={
            "RMSNorm": _dispatch_rms(_rms_norm_round_before_weight, _rms_norm_round_before_weight),
            "QwenImageTransformerBlock": _qwen_block(autocast_points=False),
            "AdaLayerNormContinuous": _ada_continuous(autocast_points=False),
            "AdaLayerNormZero": _ada_zero_eager,
            "SD35AdaLayerNormZeroX": _ada_zero_x_eager,
            "WanTransformerBlock": _wan_block(fp32_once=False),
        },
    )
)
register_group(
    PatchGroup(
        name="qwen_image",
        description=(
            "Trainer-autocast rounding points for Qwen-Image's norm + modulation: LayerNorm in "
            "fp32 in and out, (1 + scale) rounds in bf16, the modulation promotes to fp32, one "
            "rounding at the next matmul input. Applied after sgld (later groups win). The "
            "record's aligned stack (an engine patched to match the trainer); stock sglang "
            "rounds otherwise (qwen_image_native)."
        ),
        forwards={
            "QwenImageTransformerBlock": _qwen_block(autocast_points=True),
            "AdaLayerNormContinuous": _ada_continuous(autocast_points=True),
        },
    )
)
register_group(
    PatchGroup(
        name="qwen_image_native",
        description=(
            "Qwen-Image as the engine's own DiT computes it (sglang QwenImageTransformer2DModel, "
            "its native torch ops): RMSNorm (txt_norm, the q/k norms) normalises in fp32, "
            "multiplies the weight in fp32 and rounds once; the attention output projections "
            "take the [text | image] split of the joint output as views, so at batch > 1 their "
            "bias is added after the bf16 matmul rounds. The rest is diffusers' stock forward, "
            "which rounds where the engine's native ops do: LayerNormScaleShift and "
            "ScaleResidualLayerNormScaleShift (LayerNorm rounded to bf16, then x * (1 + scale) + "
            "shift and the gated residual in bf16), MulAdd, the final norm_out, and RoPE as a "
            "complex fp32 product rounded once. On a GPU at widths the engine's fused CUDA "
            "kernels take (hidden % 256 == 0, so real Qwen-Image), LayerNormScaleShift and "
            "ScaleResidualLayerNormScaleShift run fused_norm_scale_shift kernels that compute in "
            "fp32 and round once instead: this group does not model those."
        ),
        forwards={
            "RMSNorm": _dispatch_rms(_rms_norm_native, _rms_norm_native),
            "Attention": _qwen_attention_on_views,
        },
    )
)
register_group(
    PatchGroup(
        name="flux_native",
        description=(
            "Flux.1 as the engine's own DiT computes it (sglang FluxTransformer2DModel, its native "
            "torch ops): the attention output projections take the [text | image] split of the "
            "joint output as views, so at batch > 1 their bias is added after the bf16 matmul "
            "rounds. Everything else is diffusers' stock forward, bit-exact with the engine's "
            "CPU path."
        ),
        forwards={"FluxAttention": _flux_attention_on_views},
    )
)
register_group(
    PatchGroup(
        name="wan",
        description=(
            "sglang 0.5.23's Wan DiT: norm + modulation, gated residuals and mul-add where its "
            "CUDA dispatch puts them (its torch definitions at widths its fused kernels refuse, "
            "e.g. tiny; the kernels' 'fp32 once' at D % 256 == 0; see the wan_norm_path "
            "switch); q/k RMSNorm rounded once after the weight; the root scale_shift_table "
            "plus temb summed in the activation dtype. RoPE stays diffusers' fp32 rotation "
            "(the engine's GPU kernels; its CPU fallback is rope_table_dtype='bf16')."
        ),
        forwards={
            "RMSNorm": _dispatch_rms(_rms_norm_native, _rms_norm_native),
            "WanTransformerBlock": _wan_engine_block("by_width"),
            "WanTransformer3DModel": _wan_root("by_width"),
        },
    )
)


# ---- Cosmos3: the engine's RMSNorms, fused residual-add + norm, and time embedding ------------
#
# sglang 0.5.23's Cosmos3OmniTransformer (runtime/models/dits/cosmos3video.py) runs every
# RMSNorm as `RMSNorm.forward_native` on a CPU (the text q/k norms as torch's F.rms_norm, which
# rounds at the same point): x in fp32, the weight multiplied in fp32, one rounding. Its
# generation layers thread the residual: from the second layer on, `input_layernorm(h,
# residual)` and every `post_attention_layernorm(h, residual)` add the two in fp32, keep the
# bf16-rounded sum as the next residual and normalize the *fp32* sum. diffusers adds in bf16
# and normalizes the rounded sum. The fp32 sums are carried from the layer that forms them to
# the norm that reads them keyed by the rounded tensor itself (weakly: they go with it).

_GEN_SUMS: Any = torch.utils.weak.WeakTensorKeyDictionary()
"""A generation-stream tensor a Cosmos3 layer returned -> the fp32 sum it is the rounding of."""
_FUSED_NORM_INPUTS: Any = torch.utils.weak.WeakTensorKeyDictionary()
"""Held only while a layer calls a fused norm: its bf16 input -> the fp32 sum to normalize."""


def _cosmos3_rms_norm(module: torch.nn.Module) -> Callable[..., Any]:
    """RMSNorm (diffusers' or Cosmos3NemotronRMSNorm) as sglang's `RMSNorm.forward_native`.

    Normalizes the fp32 sum a fused residual-add norm hands it (`_cosmos3_fused_norm`), else x
    in fp32; times the weight in fp32; rounded once to x's dtype.
    """
    dims = _normalized_ndim(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        x32 = _FUSED_NORM_INPUTS.get(x)
        if x32 is None:
            x32 = x.float()
        variance = x32.pow(2).mean(dim=tuple(range(-dims, 0)), keepdim=True)
        out = x32 * torch.rsqrt(variance + module.eps)
        if module.weight is not None:
            out = out * module.weight
        return out.to(x.dtype)

    return forward


def _cosmos3_fused_norm(
    norm: torch.nn.Module, x: torch.Tensor, fp32_sum: torch.Tensor | None
) -> torch.Tensor:
    """Call `norm` on the bf16 residual `x` as the engine's fused add + norm: on `fp32_sum`.

    The module is called on `x` itself, so its hooks see the tensor diffusers hands it.
    """
    if fp32_sum is None:
        return norm(x)
    _FUSED_NORM_INPUTS[x] = fp32_sum
    try:
        return norm(x)
    finally:
        del _FUSED_NORM_INPUTS[x]


def _cosmos3_decoder_layer(layer: torch.nn.Module) -> Callable[..., Any]:
    """Cosmos3VLTextMoTDecoderLayer.forward with the engine's fused residual norms on GEN.

    The understanding stream is the engine's Cosmos3UndDecoderLayer: plain norms, bf16 adds.
    The generation stream is its Cosmos3GenDecoderLayer: both norms read the fp32 sum of the
    residual and the branch output (the first layer's input norm has none: it normalizes its
    input), and the rounded sums are the residuals diffusers carries too. The final
    norm_moe_gen normalizes the rounded `hidden + residual`, as diffusers' does.
    """
    b = layer

    def forward(
        und_seq: torch.Tensor,
        gen_seq: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        und_norm = b.input_layernorm(und_seq)
        gen_norm = _cosmos3_fused_norm(b.input_layernorm_moe_gen, gen_seq, _GEN_SUMS.get(gen_seq))
        und_attn_out, gen_attn_out = b.self_attn(und_norm, gen_norm, rotary_emb)
        residual_und = und_seq + und_attn_out
        residual_gen = gen_seq + gen_attn_out
        gen_sum = gen_seq.float() + gen_attn_out.float()
        mlp_out_und = b.mlp(b.post_attention_layernorm(residual_und))
        gen_normed = _cosmos3_fused_norm(b.post_attention_layernorm_moe_gen, residual_gen, gen_sum)
        mlp_out_gen = b.mlp_moe_gen(gen_normed)
        out_gen = residual_gen + mlp_out_gen
        _GEN_SUMS[out_gen] = residual_gen.float() + mlp_out_gen.float()
        return residual_und + mlp_out_und, out_gen

    return forward


def _cosmos3_time_embedder(module: torch.nn.Module) -> Callable[..., Any]:
    """TimestepEmbedding.forward as the engine's Cosmos3TimestepEmbedder runs it at bf16.

    One row per distinct t: the engine embeds the step's t once (a batch of one) and
    broadcasts it over the tokens, where diffusers embeds one row per noisy token; a CPU GEMM
    accumulates one row in another order than sixteen (several distinct t: one GEMM over
    those rows, as the engine's batch of one t per sample). And the linears' weights rounded to
    bf16, held in fp32: sglang's loader casts every weight to the DiT precision (bf16, the
    only one the engine runs Cosmos3 at) before `post_load_weights` widens the time embedder
    back to fp32. The linears are called as modules (weights swapped in for the call by
    `torch.func.functional_call`), so their hooks still see each call.
    """
    stock = type(module).forward.__get__(module)

    def rounded(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        held = {
            name: p.to(torch.bfloat16).to(p.dtype)
            for name, p in linear.named_parameters(recurse=False)
        }
        return torch.func.functional_call(linear, held, (x,))

    def forward(sample: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        if condition is not None or module.cond_proj is not None or module.post_act is not None:
            return stock(sample, condition)  # not the shape the engine's embedder has
        rows, inverse = torch.unique(sample, dim=0, return_inverse=True)
        x = rounded(module.linear_1, rows)
        if module.act is not None:
            x = module.act(x)
        return rounded(module.linear_2, x)[inverse]

    return forward


register_group(
    PatchGroup(
        name="cosmos3_native",
        description=(
            "Cosmos3 as the engine's own DiT computes it on a CPU (sglang "
            "Cosmos3OmniTransformer, its native torch ops): every RMSNorm (layer norms, q/k "
            "norms, final norms) normalizes in fp32, multiplies the weight in fp32 and rounds "
            "once; the generation layers' norms after the first are fused residual-add norms "
            "that normalize the fp32 sum of residual and branch (the rounded sum is carried, "
            "as in diffusers); the time embedding is computed once per distinct t (the engine "
            "embeds the step's one t) with the linears' weights rounded to bf16 and held in "
            "fp32, as the engine's loader leaves them. RoPE, attention and the MLPs are "
            "diffusers' stock forward, which rounds where the engine's torch path does."
        ),
        forwards={
            "RMSNorm": _dispatch_rms(_cosmos3_rms_norm, None),
            "Cosmos3NemotronRMSNorm": _cosmos3_rms_norm,
            "Cosmos3VLTextMoTDecoderLayer": _cosmos3_decoder_layer,
            "TimestepEmbedding": _cosmos3_time_embedder,
        },
    )
)


# ---- module-level switches ---------------------------------------------------------------------


def _conv3d_as_linear(module: torch.nn.Module) -> Callable[..., Any]:
    """A patchify Conv3d (kernel == stride, no padding) as reshape + linear, as the engine does."""
    conv = module
    k = tuple(conv.kernel_size)
    patchify = (
        tuple(conv.stride) == k
        and tuple(conv.padding) == (0, 0, 0)
        and tuple(conv.dilation) == (1, 1, 1)
        and conv.groups == 1
    )
    if not patchify:
        return type(conv).forward.__get__(conv)

    def forward(x: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = x.shape
        kt, kh, kw = k
        patches = x.view(b, c, f // kt, kt, h // kh, kh, w // kw, kw)
        patches = patches.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(
            b, f // kt, h // kh, w // kw, c * kt * kh * kw
        )
        out = F.linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)
        return out.permute(0, 4, 1, 2, 3)

    return forward


def _rope_tables_bf16(module: torch.nn.Module) -> Callable[..., Any]:
    """A RoPE module with its fp32 (cos, sin) outputs rounded to bf16.

    Wan's WanRotaryPosEmbed as a plain `.to(bf16)` leaves its tables (its forward only slices,
    expands and concatenates them, so rounding the outputs equals rounding the buffers first);
    LTX-2's LTX2AudioVideoRotaryPosEmbed as the engine's rounds the table it builds.
    """
    stock = type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = stock(*args, **kwargs)
        return cos.to(torch.bfloat16), sin.to(torch.bfloat16)

    return forward


# LTX-2's RoPE as sglang 0.5.23 runs it (runtime/models/dits/ltx_2.py). Its
# LTX2AudioVideoRotaryPosEmbed.forward builds the (cos, sin) table from fp32 coords as diffusers
# does, then rounds it to the activation dtype (out_dtype=hidden_states.dtype). Its rotation
# never upcasts q or k: split RoPE writes x * cos at the activation dtype, then adds the sine
# product with addcmul_ (computed in fp32, rounded once more); interleaved RoPE is plain
# activation-dtype arithmetic. That is the torch path the engine runs on a CPU, and on an
# H100 its Triton kernel (apply_ltx2_split_rotary_emb) writes the same rounding points, so the
# same value models both. diffusers keeps the table fp32 and rotates in fp32, rounding once.
# Not modelled: the fused Q/K-norm + split-RoPE CUDA kernel sglang runs by default on sm100+
# (and on sm90 only at a non-"exact" quality), which rotates in fp32 from the bf16 table.


def _ltx2_split_rotary(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Sglang's apply_split_rotary_emb, torch path: x (B, L, H*K), cos/sin (B, H, L, K/2)."""
    cos, sin = freqs
    x_dtype = x.dtype
    needs_reshape = x.ndim != 4 and cos.ndim == 4
    if needs_reshape:
        b, (_, h, t, _) = x.shape[0], cos.shape
        x = x.reshape(b, t, h, -1).swapaxes(1, 2)
    last = x.shape[-1]
    if last % 2 != 0:
        raise ValueError(f"Expected x.shape[-1] to be even for split rotary, got {last}.")
    split_x = x.reshape(*x.shape[:-1], 2, last // 2)
    first_x, second_x = split_x[..., :1, :], split_x[..., 1:, :]
    cos_u, sin_u = cos.unsqueeze(-2), sin.unsqueeze(-2)
    # Rounded to the activation dtype here (diffusers upcasts x first: no rounding).
    out = split_x * cos_u
    # addcmul_ computes self + t1 * t2 in fp32 and rounds once to the activation dtype.
    out[..., :1, :].addcmul_(-sin_u, second_x)
    out[..., 1:, :].addcmul_(sin_u, first_x)
    out = out.reshape(*out.shape[:-2], last)
    if needs_reshape:
        out = out.swapaxes(1, 2).reshape(b, t, -1)
    return out.to(dtype=x_dtype)


def _ltx2_interleaved_rotary(
    x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Sglang's apply_interleaved_rotary_emb: x (B, L, D), cos/sin (B, L, D), in x's dtype."""
    cos, sin = freqs
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return x * cos + x_rotated * sin


def _ltx2_attention_engine_rope(module: torch.nn.Module) -> Callable[..., Any]:
    """LTX2Attention.forward rotating q and k as the engine does (`_ltx2_split_rotary`).

    diffusers 0.42.1's LTX2PerturbedAttnProcessor with the rotation swapped; with the plain
    LTX2AudioVideoAttnProcessor it runs without the perturbation kwargs (which that processor
    does not take), the same ops. Any other processor runs the class's own forward.
    """
    from diffusers.models.transformers.transformer_ltx2 import (
        LTX2AudioVideoAttnProcessor,
        LTX2PerturbedAttnProcessor,
    )

    processor = module.processor
    if type(processor) not in (LTX2AudioVideoAttnProcessor, LTX2PerturbedAttnProcessor):
        return type(module).forward.__get__(module)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    attn = module
    perturbed = type(processor) is LTX2PerturbedAttnProcessor
    rotate = _ltx2_interleaved_rotary if attn.rope_type == "interleaved" else _ltx2_split_rotary

    def forward(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: Any = None,
        **ignored: Any,
    ) -> torch.Tensor:
        # Unknown kwargs are dropped, as LTX2Attention.forward drops what its processor does not.
        if not perturbed:
            perturbation_mask, all_perturbed = None, None
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(
                attention_mask, sequence_length, batch_size
            )
            attention_mask = attention_mask.view(
                batch_size, attn.heads, -1, attention_mask.shape[-1]
            )
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        if attn.to_gate_logits is not None:
            gate_logits = attn.to_gate_logits(hidden_states)
        value = attn.to_v(encoder_hidden_states)
        if all_perturbed is None:
            all_perturbed = (
                torch.all(perturbation_mask == 0) if perturbation_mask is not None else False
            )
        if all_perturbed:
            out = value
        else:
            query = attn.norm_q(attn.to_q(hidden_states))
            key = attn.norm_k(attn.to_k(encoder_hidden_states))
            if query_rotary_emb is not None:
                query = rotate(query, query_rotary_emb)
                key = rotate(
                    key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
                )
            query = query.unflatten(2, (attn.heads, -1))
            out = dispatch_attention_fn(
                query,
                key.unflatten(2, (attn.heads, -1)),
                value.unflatten(2, (attn.heads, -1)),
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=processor._attention_backend,
                parallel_config=processor._parallel_config,
            )
            out = out.flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if attn.to_gate_logits is not None:
            out = out.unflatten(2, (attn.heads, -1))  # (B, L, H, K)
            out = (out * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))

    return forward


def _qwen_rope_built_on(where: str) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    """QwenEmbedRope.forward with its freqs tables rebuilt on `where` ("cpu" or "device").

    diffusers builds the tables once, where the model is constructed, as plain attributes; the
    engine builds them on the GPU. cos/sin of large fp32 angles differ between the CPU and CUDA
    math libraries by fp32 ULPs, so the two choices are bitwise different on a GPU run.
    """

    def factory(module: torch.nn.Module) -> Callable[..., Any]:
        if type(module).__name__ != "QwenEmbedRope":
            return type(module).forward.__get__(module)

        def tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            build = torch.device("cpu") if where == "cpu" else device

            def params(index: torch.Tensor, dim: int) -> torch.Tensor:
                inv = 1.0 / torch.pow(
                    module.theta, torch.arange(0, dim, 2, device=build).to(torch.float32).div(dim)
                )
                freqs = torch.outer(index, inv)
                return torch.polar(torch.ones_like(freqs), freqs)

            pos = torch.arange(4096, device=build)
            neg = torch.arange(4096, device=build).flip(0) * -1 - 1
            axes = module.axes_dim
            pos_f = torch.cat([params(pos, d) for d in axes], dim=1).to(device)
            neg_f = torch.cat([params(neg, d) for d in axes], dim=1).to(device)
            return pos_f, neg_f

        def video_freqs(
            pos_f: torch.Tensor, neg_f: torch.Tensor, frame: int, height: int, width: int, idx: int
        ) -> torch.Tensor:
            split = [x // 2 for x in module.axes_dim]
            fp, fn = pos_f.split(split, dim=1), neg_f.split(split, dim=1)
            shape = (frame, height, width, -1)
            f_t = fp[0][idx : idx + frame].view(frame, 1, 1, -1).expand(*shape)
            if module.scale_rope:
                f_h = torch.cat([fn[1][-(height - height // 2) :], fp[1][: height // 2]], dim=0)
                f_w = torch.cat([fn[2][-(width - width // 2) :], fp[2][: width // 2]], dim=0)
            else:
                f_h, f_w = fp[1][:height], fp[2][:width]
            f_h = f_h.view(1, height, 1, -1).expand(*shape)
            f_w = f_w.view(1, 1, width, -1).expand(*shape)
            return torch.cat([f_t, f_h, f_w], dim=-1).reshape(frame * height * width, -1)

        def forward(
            video_fhw: Any, device: torch.device | None = None, max_txt_seq_len: Any = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if max_txt_seq_len is None:
                raise ValueError("`max_txt_seq_len` must be provided.")
            device = torch.device(device) if device is not None else torch.device("cpu")
            pos_f, neg_f = tables(device)
            if isinstance(video_fhw, list):
                video_fhw = video_fhw[0]
            if not isinstance(video_fhw, list):
                video_fhw = [video_fhw]
            vid, max_vid_index = [], 0
            for idx, (frame, height, width) in enumerate(video_fhw):
                vid.append(video_freqs(pos_f, neg_f, frame, height, width, idx))
                span = (height // 2, width // 2) if module.scale_rope else (height, width)
                max_vid_index = max(*span, max_vid_index)
            txt = pos_f[max_vid_index : max_vid_index + int(max_txt_seq_len), ...]
            return torch.cat(vid, dim=0), txt

        return forward

    return factory


def flux_root_fp32_timestep(module: torch.nn.Module) -> Callable[..., Any]:
    """FluxTransformer2DModel.forward taking the scheduler's raw fp32 t, as the engine's does.

    diffusers' forward rounds the timestep it is given to the activation dtype and multiplies
    by 1000 (`timestep.to(hidden_states.dtype) * 1000`); the engine's FluxTransformer2DModel
    hands the scheduler's fp32 t straight to `time_text_embed`, whose sinusoid is computed in
    fp32 before its one cast. Only that line differs here; guidance keeps diffusers' handling
    (`guidance.to(dtype) * 1000`: 3.5 -> 3504 in bf16, the value the engine builds).
    """
    import numpy as np
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    from diffusers.utils.peft_utils import apply_lora_scale

    # Under diffusers' own decorator, as the stock forward: LoRA scale applied, and the
    # caller's joint_attention_kwargs copied before the IP-adapter embeds are popped.
    @apply_lora_scale("joint_attention_kwargs")
    def forward(
        m: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None,
        timestep: torch.Tensor | None = None,
        img_ids: torch.Tensor | None = None,
        txt_ids: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        controlnet_block_samples: Any = None,
        controlnet_single_block_samples: Any = None,
        return_dict: bool = True,
        controlnet_blocks_repeat: bool = False,
    ) -> Any:
        hidden_states = m.x_embedder(hidden_states)
        timestep = timestep.float()
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = (
            m.time_text_embed(timestep, pooled_projections)
            if guidance is None
            else m.time_text_embed(timestep, guidance, pooled_projections)
        )
        encoder_hidden_states = m.context_embedder(encoder_hidden_states)
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        image_rotary_emb = m.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        if (
            joint_attention_kwargs is not None
            and "ip_adapter_image_embeds" in joint_attention_kwargs
        ):
            embeds = joint_attention_kwargs.pop("ip_adapter_image_embeds")
            joint_attention_kwargs.update({"ip_hidden_states": m.encoder_hid_proj(embeds)})
        checkpointing = torch.is_grad_enabled() and m.gradient_checkpointing
        for index, block in enumerate(m.transformer_blocks):
            args = (hidden_states, encoder_hidden_states, temb, image_rotary_emb)
            if checkpointing:
                encoder_hidden_states, hidden_states = m._gradient_checkpointing_func(
                    block, *args, joint_attention_kwargs
                )
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    temb=temb,
                    image_rotary_emb=image_rotary_emb,
                    joint_attention_kwargs=joint_attention_kwargs,
                )
            if controlnet_block_samples is not None:
                interval = int(np.ceil(len(m.transformer_blocks) / len(controlnet_block_samples)))
                pick = (
                    index % len(controlnet_block_samples)
                    if controlnet_blocks_repeat
                    else index // interval
                )
                hidden_states = hidden_states + controlnet_block_samples[pick]
        for index, block in enumerate(m.single_transformer_blocks):
            args = (hidden_states, encoder_hidden_states, temb, image_rotary_emb)
            if checkpointing:
                encoder_hidden_states, hidden_states = m._gradient_checkpointing_func(
                    block, *args, joint_attention_kwargs
                )
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    temb=temb,
                    image_rotary_emb=image_rotary_emb,
                    joint_attention_kwargs=joint_attention_kwargs,
                )
            if controlnet_single_block_samples is not None:
                samples = controlnet_single_block_samples
                interval = int(np.ceil(len(m.single_transformer_blocks) / len(samples)))
                hidden_states = hidden_states + samples[index // interval]
        output = m.proj_out(m.norm_out(hidden_states, temb))
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)

    return forward.__get__(module)


def qwen_root_scheduler_timestep(module: torch.nn.Module) -> Callable[..., Any]:
    """QwenImageTransformer2DModel.forward taking the scheduler's raw fp32 t, as the engine's does.

    The engine's model computes `(timestep / 1000).to(hidden_states.dtype)`; diffusers' casts the
    `t/1000` its pipeline presents. Dividing here, on the timestep's device, and letting the
    stock forward cast is the engine's arithmetic, op for op.
    """
    import inspect

    stock = type(module).forward.__get__(module)
    signature = inspect.signature(stock)

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["timestep"] = bound.arguments["timestep"] / 1000
        return stock(*bound.args, **bound.kwargs)

    return forward


def timestep_from_scheduler(inputs: Inputs, value: Any) -> Inputs:
    """The `timestep` kwarg as the engine's DiT receives it: the scheduler's fp32 t, raw.

    Flow-match Euler computes t = sigma * 1000 in fp32 (sigma rounded to fp32 first) and the
    engine's denoising stage repeats it over the batch and hands it to its DiT with no cast
    and no division; each engine DiT scales it itself. diffusers' pipelines present it their
    own way: `t.to(latents.dtype) / 1000` for a "t/1000" family, so in bf16 sigma 0.75 gives
    t = 750, rounded to 752, before the model sees it.

    A family presenting "t" takes the raw t as it is. Any other presentation needs the
    switch's forward for the family's model class, which makes the diffusers root consume the
    raw t the way the engine's model does (below); without one the model
    would read t where it expects its pipeline's presentation, so that is refused.

    Raises:
        ValueError: Inputs without the sigma or the family they were made for, without a
            `timestep` tensor, or of a family whose model has no forward for the raw t.
    """
    if inputs.sigma is None or inputs.origin is None:
        raise ValueError(
            "op_switches['timestep_from']='scheduler': these Inputs carry no "
            f"{'sigma' if inputs.sigma is None else 'origin'}, so the scheduler's timestep "
            "cannot be rebuilt; make them with Family.make_inputs(..., sigma=...)."
        )
    stock = inputs.kwargs.get("timestep")
    if not isinstance(stock, torch.Tensor):
        raise ValueError(
            "op_switches['timestep_from']='scheduler': the inputs have no 'timestep' tensor "
            f"(kwargs: {', '.join(inputs.kwargs)}); the switch replaces that kwarg only."
        )
    from lab.families import family

    fam = family(inputs.origin[0])
    adapted = SWITCHES["timestep_from"].forwards.get(value, {})
    if fam.timestep_presentation != "t" and fam.model_class not in adapted:
        raise ValueError(
            f"op_switches['timestep_from']={value!r}: {fam.name}'s model takes the timestep "
            f"as {fam.timestep_presentation!r}, and the switch adapts only "
            f"{', '.join(sorted(adapted)) or 'no model'} to the scheduler's raw t. Drop the "
            "switch for this family, or add its root's forward in lab.precision.engine_groups."
        )
    # The scheduler's arithmetic, on the inputs' device: fp32 sigma, times 1000 in fp32.
    t = torch.full(stock.shape, inputs.sigma, dtype=torch.float32, device=stock.device) * 1000
    kwargs = dict(inputs.kwargs)
    kwargs["timestep"] = t
    neg = timestep_from_scheduler(inputs.negative, value) if inputs.negative is not None else None
    return replace(inputs, kwargs=kwargs, negative=neg)


register_switch(
    Switch(
        name="timestep_from",
        description="The DiT's timestep: 'pipeline' (diffusers: the scheduler's t rounded to "
        "the latent dtype and presented the pipeline's way) or 'scheduler' (the engine: the "
        "scheduler's raw fp32 t, scaled inside the model as the engine's model scales it).",
        values=("pipeline", "scheduler"),
        transform_inputs=timestep_from_scheduler,
        forwards={
            "scheduler": {
                "FluxTransformer2DModel": flux_root_fp32_timestep,
                "QwenImageTransformer2DModel": qwen_root_scheduler_timestep,
            }
        },
    )
)
register_switch(
    Switch(
        name="wan_patchify",
        description="Wan's patch embedding: 'conv3d' (diffusers) or 'linear' (reshape + linear, "
        "the engine's patch embed).",
        values=("conv3d", "linear"),
        forwards={"linear": {"Conv3d": _conv3d_as_linear}},
    )
)
register_switch(
    Switch(
        name="rope_table_dtype",
        description="Wan RoPE tables: 'as_built' (fp32, what from_pretrained keeps; the rotation "
        "in fp32, as the engine's GPU kernels rotate) or 'bf16' (what a plain model.to(bf16) "
        "does to the non-persistent rope buffers; then the rotation runs in bf16, exactly as "
        "the engine's CPU fallback apply_rotary_embedding_native does).",
        values=("as_built", "bf16"),
        forwards={"bf16": {"WanRotaryPosEmbed": _rope_tables_bf16}},
    )
)
register_switch(
    Switch(
        name="ltx_rope",
        description="LTX-2 RoPE: 'fp32' (diffusers: the (cos, sin) table fp32, q and k rotated "
        "in fp32 and rounded once) or 'bf16' (sglang: the table rounded to bf16, the rotation "
        "in bf16 as its torch path and its H100 Triton kernel do: x * cos rounded, then the "
        "sine product added in fp32 and rounded again).",
        values=("fp32", "bf16"),
        forwards={
            "bf16": {
                "LTX2AudioVideoRotaryPosEmbed": _rope_tables_bf16,
                "LTX2Attention": _ltx2_attention_engine_rope,
            }
        },
    )
)
register_switch(
    Switch(
        name="wan_norm_path",
        description="The wan group's norm + modulation ops: 'by_width' (as sglang's CUDA "
        "dispatch picks: its fused kernels' 'fp32 once' at D % 256 == 0 and D <= 8192, its "
        "torch definitions elsewhere), 'native' (its torch definitions at every width: the "
        "engine on a CPU) or 'fused' (the fused kernels' rounding at every width).",
        values=WAN_NORM_PATHS,
        forwards={
            path: {
                "WanTransformerBlock": _wan_engine_block(path),
                "WanTransformer3DModel": _wan_root(path),
            }
            for path in WAN_NORM_PATHS[1:]
        },
    )
)
register_switch(
    Switch(
        name="rope_cache_device",
        description="Qwen-Image RoPE freqs tables: 'as_built' (where the model was constructed), "
        "'cpu' (built on the CPU, then copied) or 'device' (built on the model's device).",
        values=("as_built", "cpu", "device"),
        forwards={
            "cpu": {"QwenEmbedRope": _qwen_rope_built_on("cpu")},
            "device": {"QwenEmbedRope": _qwen_rope_built_on("device")},
        },
    )
)

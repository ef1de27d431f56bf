"""MiniMax-H3 (diffusers MiniMaxH3Transformer3DModel). 50 layers x 56 heads x 128, packed T2VA."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lab.families._family import Family, Inputs, SamplerSettings

# heads * head_dim > hidden_size as in the real model; RoPE rotates 2*3*4 = 24 of the 32 head
# channels (real: 96 of 128), keeping the partial-rotary pass-through; the real latent channel
# counts (24 video, 32 audio).
_TINY = dict(
    num_attention_heads=2, attention_head_dim=32, hidden_size=48, num_layers=2,
    num_refiner_layers=2, ffn_dim=96, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2),
    text_dim=64, freq_dim=256, time_embed_hidden_dim=48, time_embed_dim=24, rope_freq_dim=4,
    rope_theta=10000.0, norm_eps=1e-5, qk_norm_eps=1e-5, final_norm_eps=1e-5,
)  # fmt: skip
# The class defaults of MiniMaxH3Transformer3DModel in diffusers 0.42.1 (its docstring: the
# released checkpoint): 5376 wide, 56 heads x 128 (7168 > 5376), SwiGLU 14336, Qwen3-VL text
# features of 5120, 24-channel video and 32-channel audio latents.
_H3 = dict(
    num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50,
    num_refiner_layers=2, ffn_dim=14336, in_channels=24, audio_in_channels=32,
    patch_size=(1, 2, 2), text_dim=5120, freq_dim=256, time_embed_hidden_dim=5376,
    time_embed_dim=2688, rope_freq_dim=16, rope_theta=10000.0, norm_eps=1e-5, qk_norm_eps=1e-5,
    final_norm_eps=1e-5,
)  # fmt: skip

# Pipeline constants (modular_pipelines/minimax_h3; the helpers there import transformers, which
# the lab does not depend on, so the ones used below are reproduced and cited).
_VIDEO_TAG, _TEXT_TAG, _AUDIO_TAG = 0, 1, 2
"""Per-row modality tags: they index the AdaLN table, a checkpoint contract."""
_FPS, _AUDIO_LATENTS_PER_SECOND, _AUDIO_CHANNELS = 24, 40, 2
_VAE_SPATIAL, _VAE_FRAMES_PER_CHUNK, _VAE_LATENTS_PER_CHUNK = 16, 17, 5
_VIDEO_SHIFT, _AUDIO_SHIFT = 12.0, 3.0
"""The two MiniMaxH3Scheduler shifts of MiniMaxH3SetTimestepsStep."""
_ROPE_FRAME_RESCALE, _ROPE_FRAMES_PER_LATENT, _ROPE_SPATIAL_SCALE = 5.0 / 3.0, (1, 4, 4, 4, 4), 32
_KEEP_IN_FP32 = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")
"""MiniMaxH3Transformer3DModel._keep_in_fp32_modules (the checkpoint's own mixed precision)."""


def _patchify(latents: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """`patchify_video_latents`: (B, C, F, H, W) -> (B * rows, C * prod(patch)), frame-major."""
    pt, ph, pw = patch_size
    b, c, f, h, w = latents.shape
    if f % pt or h % ph or w % pw:
        shape = tuple(latents.shape)
        raise ValueError(f"minimax_h3: latents {shape} not divisible by the patch {patch_size}.")
    latents = latents.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return latents.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(-1, c * pt * ph * pw).contiguous()


def _spatial_grid(dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    """`_spatial_position_grid`: an aspect-normalised axis x 32, numpy linspace, float64."""
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    grid = np.linspace(left, left + ratio, dim // patch, endpoint=False) * _ROPE_SPATIAL_SCALE
    return torch.from_numpy(grid).to(torch.float64)


def _temporal_grid(num_latent_frames: int, origin: float) -> torch.Tensor:
    """`_temporal_position_grid`: rotary time per latent frame, spans 5/3 * (1, 4, 4, 4, 4)."""
    spans = torch.tensor(
        [
            _ROPE_FRAME_RESCALE * _ROPE_FRAMES_PER_LATENT[i % len(_ROPE_FRAMES_PER_LATENT)]
            for i in range(num_latent_frames)
        ],
        dtype=torch.float64,
    )
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def _packed_layout(
    num_text: int, frames: int, lh: int, lw: int, num_audio: int, patch_size: tuple[int, int, int]
) -> dict[str, torch.Tensor]:
    """`MiniMaxH3PrepareLayoutStep.build_packed_sequence` for t2va: `[text | audio | video]`.

    No keyframe conditioning rows (t2va). Position ids are float64 `(seq, 3)`: text `(i, 0, 0)`,
    audio channel-major on the text-continued clock with w pinned to the width grid's ends, video
    on the non-uniform temporal grid with aspect-normalised `(h, w)`.
    """
    _, ph, pw = patch_size
    rows_per_frame = (lh // ph) * (lw // pw)
    n_audio_rows, n_video_rows = num_audio * _AUDIO_CHANNELS, frames * rows_per_frame
    audio_start = num_text
    video_start = audio_start + n_audio_rows
    seq = video_start + n_video_rows

    position_ids = torch.zeros(seq, 3, dtype=torch.float64)
    position_ids[:num_text, 0] = torch.arange(num_text, dtype=torch.float64)
    sqrt_area = np.sqrt(lh * lw)
    h_grid, w_grid = _spatial_grid(lh, ph, sqrt_area), _spatial_grid(lw, pw, sqrt_area)
    grids = torch.meshgrid(h_grid, w_grid, indexing="ij")
    frame_grid = torch.stack([g.reshape(-1) for g in grids], dim=-1)
    audio_time = float(num_text) + torch.arange(num_audio, dtype=torch.float64)
    position_ids[audio_start:video_start, 0] = audio_time.repeat(_AUDIO_CHANNELS)
    position_ids[audio_start:video_start, 2] = torch.cat(
        [
            torch.full((num_audio,), float(w_grid[0]), dtype=torch.float64),
            torch.full((n_audio_rows - num_audio,), float(w_grid[-1]), dtype=torch.float64),
        ]
    )
    video_pos = torch.empty(frames, rows_per_frame, 3, dtype=torch.float64)
    video_pos[:, :, 0] = _temporal_grid(frames, float(num_text))[:, None]
    video_pos[:, :, 1:] = frame_grid[None]
    position_ids[video_start:] = video_pos.reshape(-1, 3)

    video_indices = torch.arange(video_start, seq)
    audio_indices = torch.arange(audio_start, video_start)
    text_indices = torch.arange(num_text)
    token_tags = torch.empty(seq, dtype=torch.long)
    token_tags[text_indices], token_tags[audio_indices] = _TEXT_TAG, _AUDIO_TAG
    token_tags[video_indices] = _VIDEO_TAG
    return dict(
        token_tags=token_tags,
        position_ids=position_ids,
        video_indices=video_indices,
        audio_indices=audio_indices,
        text_indices=text_indices,
    )


def _step_times(sigma: float) -> tuple[float, float]:
    """Video and audio t (= 1 - sigma, 1 = clean) of the step whose video sigma is `sigma`.

    Both MiniMaxH3Scheduler grids shift the same base point u of `linspace(1, 0, n)` in fp32
    (`s * u / (1 + (s - 1) * u)`, video s = 12, audio s = 3); u is recovered from the video sigma
    and pushed through the audio shift in fp32, as the scheduler computes it. The video t is
    exact; the audio t is within ~2 fp32 ulp of the audio schedule's own entry (several fp32 u
    share one video sigma, so sigma alone does not pin the grid point).
    """
    u = torch.tensor(sigma / (_VIDEO_SHIFT - (_VIDEO_SHIFT - 1.0) * sigma), dtype=torch.float32)
    sigma_audio = _AUDIO_SHIFT * u / (1 + (_AUDIO_SHIFT - 1) * u)
    return float(1.0 - torch.tensor(sigma, dtype=torch.float32)), float(1.0 - sigma_audio)


def _row_timesteps(
    layout: Mapping[str, torch.Tensor], t_video: float, t_audio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`MiniMaxH3SetTimestepsStep.build_row_timesteps` without conditioning rows (t2va).

    Text rows inherit the video t; returns the distinct values, sorted, and each row's index.
    """
    row_t = torch.full((layout["token_tags"].numel(),), t_video, dtype=torch.float32)
    row_t[layout["audio_indices"]] = t_audio
    return torch.unique(row_t, sorted=True, return_inverse=True)


def _latent_sizes(geometry: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """Latent frames, height, width and audio latents per channel (pipeline arithmetic).

    Raises:
        ValueError: If `frames` is not `17 * n + 5` (what the video VAE encodes).
    """
    frames = geometry["frames"]
    if frames % _VAE_FRAMES_PER_CHUNK != _VAE_LATENTS_PER_CHUNK:
        raise ValueError(f"minimax_h3: frames must be 17 * n + 5, got {frames}.")
    chunks = (frames - _VAE_LATENTS_PER_CHUNK) // _VAE_FRAMES_PER_CHUNK
    latent_frames = chunks * _VAE_LATENTS_PER_CHUNK + 2
    num_audio = round(frames / _FPS * _AUDIO_LATENTS_PER_SECOND)
    lh, lw = geometry["height"] // _VAE_SPATIAL, geometry["width"] // _VAE_SPATIAL
    return latent_frames, lh, lw, num_audio


def _as_rows(x: torch.Tensor, batch: int, rows: int, width: int, what: str) -> torch.Tensor:
    """Given rows as (rows, width) or (batch, rows, width): check and return them 3-D, fp32."""
    x = x[None] if x.ndim == 2 else x
    if tuple(x.shape) != (batch, rows, width):
        want = (batch, rows, width)
        raise ValueError(f"minimax_h3: {what} must be {want}, got {tuple(x.shape)}.")
    return x.to(torch.float32)


def make_inputs(
    config: Mapping[str, Any],
    geometry: Mapping[str, Any],
    *,
    batch: int,
    cfg: bool,
    gen: torch.Generator,
    dtype: torch.dtype,
    sigma: float,
    latents: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
) -> Inputs:
    """Packed rows: video (B, F*h*w, C*4) and audio (B, 2*A, 32) fp32, text (B, L, text_dim), t.

    MiniMaxH3 denoises one packed `[text | audio | video]` sequence per request; the video and
    audio rows stay fp32 (the model casts to its fp32 input projections), the text features are
    at the text encoder's dtype. `timestep` is the *distinct* fp32 `t = 1 - sigma` values present
    (video t, audio t from its own shift-3 schedule; text rows take the video t), with per-row
    `timestep_indices`. The pipeline runs batch 1; the batch axis is a pure replication axis of
    one layout, so batch > 1 here means prompts of equal length. `latents` may be the video rows
    (or a (B, 24, F, H, W) latent), or a (video rows, audio rows) pair as the scheduler steps them;
    a lone video tensor draws fresh audio noise.

    Raises:
        ValueError: cfg=True (guidance-distilled: no uncond pass), or latents of the wrong shape.
    """
    if cfg:
        raise ValueError(
            "minimax_h3: cfg=True, but MiniMax-H3 is guidance-distilled: guidance is baked into "
            "the weights and every step runs exactly one forward (no negative prompt)."
        )
    patch_size = tuple(config["patch_size"])
    frames, lh, lw, num_audio = _latent_sizes(geometry)
    layout = _packed_layout(geometry["text_len"], frames, lh, lw, num_audio, patch_size)
    video_width = config["in_channels"] * int(np.prod(patch_size))
    n_video, n_audio = layout["video_indices"].numel(), layout["audio_indices"].numel()
    # The prompt is encoded before the noise is drawn; then video noise, then audio noise.
    text = torch.randn(batch, geometry["text_len"], config["text_dim"], generator=gen)
    video, audio = latents if isinstance(latents, (tuple, list)) else (latents, None)
    if video is None:
        video = torch.randn(batch, config["in_channels"], frames, lh, lw, generator=gen)
    if video.ndim == 5:
        rows = _patchify(video.to(torch.float32), patch_size)
        video = rows.reshape(video.shape[0], -1, video_width)
    video = _as_rows(video, batch, n_video, video_width, "video rows")
    if audio is None:
        audio = torch.randn(batch, n_audio, config["audio_in_channels"], generator=gen)
    audio = _as_rows(audio, batch, n_audio, config["audio_in_channels"], "audio rows")
    timestep, timestep_indices = _row_timesteps(layout, *_step_times(sigma))
    return Inputs(
        kwargs=dict(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=text.to(dtype),
            timestep=timestep,
            timestep_indices=timestep_indices,
            **layout,
            return_dict=False,
        ),
        roles=dict(
            hidden_states="latents",
            audio_hidden_states="latents",
            encoder_hidden_states="cond",
            timestep="timestep",
            timestep_indices="aux",
            token_tags="aux",
            position_ids="aux",
            video_indices="aux",
            audio_indices="aux",
            text_indices="aux",
            return_dict="aux",
        ),
    )


def init_weights(model: torch.nn.Module) -> None:
    """Scale `time_embedder.linear_1.weight` by 30 so the timestep path is alive.

    t in [0, 1] enters a 256-channel sinusoid unscaled (max frequency 1), so its features are
    ~(cos 1, sin t*f) and a default-initialised Linear barely propagates them: at random init,
    halving t moves the tiny model's output by ~4e-4, after the x30 scale by several percent.
    Applied to every preset (seeded weights only, never to a loaded checkpoint).
    """
    model.time_embedder.linear_1.weight.mul_(30.0)


FAMILY = Family(
    name="minimax_h3",
    title="MiniMax-H3",
    model_class="MiniMaxH3Transformer3DModel",
    block_classes=(
        "MiniMaxH3TransformerBlock",
        "MiniMaxH3TokenRefinerBlock",
        "MiniMaxH3AdaLayerNormOut",
    ),
    presets={
        "tiny": _TINY,
        # Real width; two blocks and the two refiner blocks.
        "reduced": {**_H3, "num_layers": 2},
        "full": _H3,
    },
    geometry={
        # 22 frames (17n+5), 64 x 96 -> 7 x 4 x 6 latents -> 42 video rows; 37 audio latents x 2
        # channels = 74 rows; 8 text rows: seq 124.
        "tiny": dict(height=64, width=96, frames=22, text_len=8),
        # The pipeline defaults: its 16:9 canvas (short edge 768, area cap 768 * 1344 -> 768 x
        # 1344) and num_frames=124 -> 37 x 48 x 84 latents -> 37296 video rows; 207 audio latents
        # -> 414 rows. The prompt (tokenized verbatim, no template) is an estimate: 128 tokens.
        "reduced": dict(height=768, width=1344, frames=124, text_len=128),
        "full": dict(height=768, width=1344, frames=124, text_len=128),
    },
    # MiniMaxH3Scheduler is itself a rectified-flow Euler scheduler: linspace(1, 0, N + 1)
    # shifted by 12 (video). Its transformer predicts the data-ward velocity (sign -1). The
    # audio rows run their own shift-3 grid in the pipeline; the SDE here steps every latent
    # row with the video sigma (the model is still told the audio t by make_inputs).
    sampler=SamplerSettings(
        scheduler="minimax_h3",
        scheduler_config=dict(shift=12.0),
        velocity_sign=-1.0,
        notes="Audio rows stepped on the video sigma grid (their own grid is shift 3).",
    ),
    make_inputs_fn=make_inputs,
    timestep_presentation="1-sigma",
    cfg_layout="none",
    rollout_dtype="bf16",
    # "Casts internally": proj_in / audio_proj_in take the fp32 rows, context_embedder casts text.
    input_dtype_policy={"latents": None, "cond": None, "timestep": None},
    # The record's FSDP plan: input and output heads and the timestep MLP in fp32.
    param_dtype_rules={"*proj_in.*": "fp32", "*time_embedder.*": "fp32", "*proj_out.*": "fp32"},
    # The plan's heads and time MLP plus every RMSNorm, the per-block adaLN projection and the
    # output modulation.
    fp32_rule_suggestions={
        "*.norm1.*": "fp32",
        "*.norm2.*": "fp32",
        "*.norm_q.*": "fp32",
        "*.norm_k.*": "fp32",
        "*final_norm.*": "fp32",
        "norm_out.norm.*": "fp32",
        "*.adaln_proj.*": "fp32",
        "norm_out.linear.*": "fp32",
        "*proj_in.*": "fp32",
        "context_embedder.*": "fp32",
        "time_embedder.*": "fp32",
        "*proj_out.*": "fp32",
    },
    engine_fp32_modules=_KEEP_IN_FP32,
    init_weights=init_weights,
    notes=(
        "t = 1 - sigma (1 = clean), passed as distinct values plus per-row indices; video and "
        "audio step different shifts, so one forward carries two t. On random weights the "
        "timestep path is nearly dead without init_weights' x30 time_embedder scale."
    ),
)

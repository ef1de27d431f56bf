"""Model inputs and outputs as flat per-sample latents: what the SDE step and its log-prob see.

Families hand their DiT one or several latent tensors (LTX-2 video + audio, MiniMax H3 video +
audio, Cosmos3 a list); the Flow-GRPO step treats each sample's latents as one vector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lab.families import Inputs


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor in `value` (a tensor, or lists/tuples of them), depth first."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensor_leaves(v)]
    return []


def latent_leaves(inputs: Inputs) -> list[torch.Tensor]:
    """The latent tensors of `inputs`, in kwargs order (lists such as Cosmos3's unwrapped)."""
    return [t for k in inputs.keys_with_role("latents") for t in tensor_leaves(inputs.kwargs[k])]


def flatten_samples(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """(B, ...) tensors -> one fp32 (B, N) matrix, each sample's tensors concatenated."""
    return torch.cat([t.reshape(t.shape[0], -1).to(torch.float32) for t in leaves], dim=1)


def unflatten_samples(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> Any:
    """Inverse of `flatten_samples`, shaped as make_inputs takes `latents`: a tensor or a tuple."""
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape[1:])
        out.append(flat[:, start : start + n].reshape(flat.shape[0], *shape[1:]))
        start += n
    return out[0] if len(out) == 1 else tuple(out)


def output_leaves(
    output: Any, like: Sequence[torch.Tensor], rows: int, family_name: str
) -> list[torch.Tensor]:
    """The first len(like) tensors of a model output, checked against the latent shapes.

    Raises:
        ValueError: If they do not have the latents' shapes (with `rows` samples), naming both.
    """
    leaves = tensor_leaves(output)[: len(like)]
    want = [(rows, *t.shape[1:]) for t in like]
    got = [tuple(t.shape) for t in leaves]
    if got != want:
        raise ValueError(
            f"{family_name}: the model output tensors {got} do not match the "
            f"latents {want}; the family's output does not map onto its latents in order."
        )
    return leaves

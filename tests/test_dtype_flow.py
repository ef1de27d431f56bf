"""The CPU runs show the GPU trainer's rounding points (CUDA autocast emulated on CPU)."""

from __future__ import annotations

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES

# The trainer fed the engine's fp32 timestep, as Flux's rollout is (the default trainer's
# bf16-rounded one diverges first, at the time embedding): what is left is autocast.
ENGINE_T = {"op_switches": {"timestep_from": "scheduler"}}


def test_flux_first_divergence_is_a_norm_in_the_first_block() -> None:
    result = lab.pair_family("flux", "tiny", trainer=ENGINE_T)
    first = result.first_divergence()

    assert result.meta["autocast_policy_b"] == "cuda"
    assert first is not None
    assert first.module.startswith("transformer_blocks.0.") and first.module_class == "LayerNorm"
    # Under CUDA's policy layer_norm returns fp32 where the bf16 engine returns bf16.
    assert (first.dtype_a, first.dtype_b) == ("bf16", "fp32")


def test_plain_cpu_autocast_hides_the_divergence() -> None:
    # The measured trap: CPU autocast keeps layer_norm in bf16, so the pair looks bit-exact.
    result = lab.pair_family("flux", "tiny", trainer={"autocast_policy": "cpu", **ENGINE_T})
    assert result.meta["autocast_policy_b"] == "cpu"
    assert result.first_divergence() is None
    assert result.output_metrics()["model_output_max_abs_diff"] == 0.0


def test_sd3_first_divergence_is_the_autocast_norm_whatever_the_buffer_setting() -> None:
    # SD3's pos_embed table is built fp32 by its class: an engine load keeps it fp32 (the
    # real engine does), FSDP2 never casts buffers, so the first difference is the autocast
    # rounding point of the first block's norm, as for Flux, with or without cast_buffers.
    engine_like = lab.pair_family("sd3", "tiny")
    assert engine_like.first_divergent_module == "transformer_blocks.0.norm1.norm"
    assert engine_like.output_metrics()["model_output_rel_max"] > 0
    kept = lab.pair_family("sd3", "tiny", rollout={"cast_buffers": False})
    assert [(r.label(), r.metrics.max_abs_diff) for r in kept.rows] == [
        (r.label(), r.metrics.max_abs_diff) for r in engine_like.rows
    ]


def test_unknown_autocast_policy_lists_known() -> None:
    with pytest.raises(ValueError, match=r"Unknown autocast policy 'gpu'. Known: 'cuda', 'cpu'"):
        lab.Side.trainer(lab.family("flux"), autocast_policy="gpu")


def _dtype_rows(family_name: str, device: str) -> dict[str, str]:
    fam = lab.family(family_name)
    model = fam.build("tiny", 0, device=device)
    inputs = fam.make_inputs("tiny", 0, device=device)
    trainer = lab.Side.trainer(fam, device=device)
    result = lab.pair(model, inputs, trainer, trainer)
    return {r.label(): r.dtype_a for r in result.rows}


@pytest.mark.gpu
@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_cpu_emulation_dtype_flow_equals_real_cuda_autocast(family_name: str) -> None:
    assert torch.cuda.is_available()
    cpu, gpu = _dtype_rows(family_name, "cpu"), _dtype_rows(family_name, "cuda")
    assert set(cpu) == set(gpu)
    differing = {k: (cpu[k], gpu[k]) for k in cpu if cpu[k] != gpu[k]}
    assert not differing, f"{len(differing)} of {len(cpu)} rows differ: {differing}"

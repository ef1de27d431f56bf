"""Every family's sigma grid against its diffusers pipeline's, bit for bit (diffusers 0.42.1).

`pipeline_grid` rebuilds each grid as the pipeline's `__call__` does, with the real scheduler
class and the scheduler config the family records, and without calling any `lab` code: the
pipeline modules themselves import transformers (not installed), so their few lines are written
out here, each with the file it follows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import lab
from lab.causes.checks import sigma_parity
from lab.pairing.metrics import ulp_distance
from lab.rl.flow_grpo import sigma_schedule

STEPS = (10, 28, 40)


def _calculate_shift(
    image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float
) -> float:
    # diffusers/pipelines/flux/pipeline_flux.py calculate_shift (Qwen-Image's and LTX-2's are
    # copies of it).
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def _packed_tokens(family_name: str, preset: str) -> int:
    """`latents.shape[1]` after the pipeline's prepare_latents, from the preset's geometry."""
    g = lab.family(family_name).geometry[preset]
    if family_name in ("flux", "qwen_image"):
        # vae_scale_factor 8; height = 2 * (height // 16), then 2 x 2 patches are packed.
        return (g["height"] // 16) * (g["width"] // 16)
    # LTX2Pipeline: VAE 32x spatial, 8x temporal ((F - 1) // 8 + 1), patch size 1 x 1 x 1.
    return ((g["num_frames"] - 1) // 8 + 1) * (g["height"] // 32) * (g["width"] // 32)


def pipeline_grid(family_name: str, steps: int, preset: str = "tiny") -> torch.Tensor:
    """The grid `scheduler.sigmas` holds after the family's pipeline set its timesteps."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    config = dict(lab.family(family_name).sampler.scheduler_config)
    if family_name == "minimax_h3":
        # modular_pipelines/minimax_h3/before_denoise.py: set_timesteps(num_inference_steps),
        # whose num_inference_steps counts the grid's points, terminal 0 included.
        scheduler = MiniMaxH3Scheduler(**config)
        scheduler.set_timesteps(steps + 1)
        return scheduler.sigmas
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    if family_name in ("flux", "qwen_image", "ltx2"):
        # pipeline_flux.py / pipeline_qwenimage.py / pipeline_ltx2.py __call__, "5. Prepare
        # timesteps": a float64 numpy grid, mu from the packed token count with the scheduler
        # config's values (LTX-2's fallbacks differ, but the config always holds the keys).
        sigmas = np.linspace(1.0, 1 / steps, steps)
        c = scheduler.config
        mu = _calculate_shift(
            _packed_tokens(family_name, preset),
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=sigmas, device=None, mu=mu)
    else:
        # sd3: StableDiffusion3Pipeline passes no sigmas (retrieve_timesteps -> set_timesteps(N)).
        # wan2_2, cosmos3: the Flow-GRPO recipes step this Euler scheduler on its own grid.
        scheduler.set_timesteps(steps, device=None)
    return scheduler.sigmas


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_sigma_schedule_equals_the_pipeline_grid_bit_for_bit(family_name: str, steps: int) -> None:
    ours = sigma_schedule(family_name, steps)
    theirs = pipeline_grid(family_name, steps)

    assert theirs.dtype == torch.float32 and theirs.shape == (steps + 1,)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    ulp = ulp_distance(ours, theirs)
    assert int(ulp.max()) == 0, f"{family_name} at {steps} steps: {ulp.tolist()} fp32 ULP"


@pytest.mark.parametrize("family_name", ["flux", "qwen_image", "ltx2"])
def test_dynamic_shift_reads_the_pipeline_token_count_at_full_geometry(family_name: str) -> None:
    # At "reduced" (the full-size geometry) mu is another value than at tiny: the token count
    # the grid is built from must be the pipeline's there too.
    ours = sigma_schedule(family_name, 28, preset="reduced")
    theirs = pipeline_grid(family_name, 28, preset="reduced")

    assert not torch.equal(theirs, pipeline_grid(family_name, 28)), "mu did not move the grid"
    assert torch.equal(ours, theirs), ulp_distance(ours, theirs).tolist()


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_sigma_parity_passes_against_the_pipeline_grid(family_name: str, steps: int) -> None:
    grid = pipeline_grid(family_name, steps)
    result = sigma_parity(family_name, None, {"sigmas": grid.tolist()}, steps=steps, samples=1)
    table = result.table()

    assert len(table) == steps
    assert result.passed, result.verdict
    assert (table["sigma_ulp"] == 0).all() and (table["log_prob_bias"] == 0).all()


def test_a_one_ulp_grid_fails_sigma_parity() -> None:
    # The check is not blind to the size of difference the fp32 linspace made (1-4 ULP).
    grid = pipeline_grid("flux", 10)
    nudged = grid.clone()
    nudged[3] = torch.nextafter(grid[3], torch.tensor(0.0))
    result = sigma_parity("flux", None, {"sigmas": nudged.tolist()}, steps=10, samples=1)

    assert not result.passed
    assert result.table()["sigma_ulp"].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]


def test_dynamic_shifting_on_unpacked_latents_is_refused() -> None:
    # SD3's latents are (B, C, H, W): shape[1] is a channel count, not the token count mu needs.
    fam = lab.family("sd3")
    config = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    shifted = dataclasses.replace(
        fam, sampler=dataclasses.replace(fam.sampler, scheduler_config=config)
    )
    with pytest.raises(ValueError, match=r"'hidden_states' is shaped \(1, 4, 16, 16\)"):
        sigma_schedule(shifted, 10)

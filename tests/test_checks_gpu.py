"""On the H200: the four pipeline parity checks on every family at the reduced preset.

Run on the device machine: `LAB_GPU_OUT=docs/figures/checks pytest -m gpu
tests/test_checks_gpu.py -q -s`. Each family writes <check>.json (CheckResult.to_json) and
<check>.png (plot_check, matplotlib) to $LAB_GPU_OUT/<family>/, and the test prints each
verdict; LAB_GPU_OUT defaults to a temporary folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

import lab
from lab.causes.checks import (
    CheckResult,
    batch_invariance,
    cfg_batching,
    sigma_parity,
    weight_sync,
)
from lab.pairing.weights import plan_weights
from lab.views.plots import plot_check, save_figure

pytestmark = pytest.mark.gpu


def _out_dir() -> Path:
    out = os.environ.get("LAB_GPU_OUT") or tempfile.mkdtemp(prefix="lab_checks_gpu_")
    return Path(out)


@pytest.mark.parametrize("family_name", lab.FAMILY_NAMES)
def test_checks_at_reduced_on_the_gpu(family_name: str) -> None:
    import matplotlib.pyplot as plt

    fam = lab.family(family_name)
    sigma = 0.75
    model = fam.build("reduced", 0, device="cuda", expert=fam.expert_for_sigma(sigma))
    rollout = lab.Side.rollout(fam, device="cuda")
    trainer = lab.Side.trainer(fam, device="cuda")
    inputs = fam.make_inputs("reduced", 0, sigma=sigma, device="cuda")
    cfg_inputs = (
        inputs
        if fam.cfg_layout == "none"
        else fam.make_inputs("reduced", 0, 1, True, sigma=sigma, device="cuda")
    )
    # The engine's weights as it loads them: each parameter cast to the rollout side's dtype.
    plan = plan_weights(model, rollout)
    engine = {name: p.detach().to(plan.param_dtypes[name]) for name, p in model.named_parameters()}
    results = {
        # Block outputs only: every module of a real-width batch would not fit twice.
        "batch_invariance": batch_invariance(model, inputs, rollout, batch=2, capture_depth=1),
        "cfg_batching": cfg_batching(model, cfg_inputs, trainer, capture_depth=1),
        "sigma_parity": sigma_parity(fam, rollout, trainer, steps=10, preset="reduced"),
        "weight_sync": weight_sync(
            dict(model.named_parameters()),
            engine,
            expect_dtype=fam.rollout_dtype,
            keep_fp32_modules=fam.engine_fp32_modules,
        ),
    }
    out = _out_dir() / family_name
    for name, result in results.items():
        print(f"\n{result.describe()}")
        path = result.to_json(out / f"{name}.json")
        back = CheckResult.from_json(path)
        assert back.passed == result.passed and len(back.rows) == len(result.rows)
        fig = plot_check(result, backend="matplotlib")
        save_figure(fig, out / f"{name}.png")
        plt.close(fig)
        assert (out / f"{name}.png").stat().st_size > 0
        if result.applicable:
            assert result.rows, f"{name}: applicable but nothing compared"
    assert results["batch_invariance"].meta["device"].startswith("cuda")
    # The engine's load is a cast of the master: every parameter arrives, rounded or equal.
    assert results["weight_sync"].passed, results["weight_sync"].verdict
    torch.cuda.empty_cache()

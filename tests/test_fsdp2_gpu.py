"""FSDP2 on NCCL (1 and 2 GPUs): every family's real FSDP2 trainer side is bitwise the
in-process trainer side built on the same GPU.

Run on the device machine: `pytest -m gpu tests/test_fsdp2_gpu.py -s` (-s prints the figures);
the 2-GPU case needs the nvidia-h200-x2 kind.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lab
from lab.engine.fsdp import Fsdp2Job, pair_capture, run_fsdp2_forwards
from lab.families import FAMILY_NAMES
from lab.pairing.capture import ROOT

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[1, 2], ids=["1gpu", "2gpus"])
def gpu_captures(request: pytest.FixtureRequest) -> dict[str, Any]:
    nproc = request.param
    if not torch.cuda.is_available() or torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPU(s): run on the device machine (nvidia-h200-x2)")
    jobs = [
        Fsdp2Job(family_name=n, side=lab.Side.trainer(lab.family(n), device="cuda"))
        for n in FAMILY_NAMES
    ]
    captures = run_fsdp2_forwards(jobs, nproc=nproc, device="cuda", timeout_s=600)
    return {c.job.family_name: c for c in captures}


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_nccl_fsdp2_trainer_is_bitwise_the_in_process_trainer(
    gpu_captures: dict, family_name: str
) -> None:
    capture = gpu_captures[family_name]
    model, inputs = capture.job.build("cuda")
    reference = lab.Side.trainer(lab.family(family_name), device="cuda")
    result = pair_capture(model, inputs, reference, capture)
    table = result.table()
    fsdp = capture.meta
    print(
        f"{family_name}: {fsdp['world_size']} NCCL rank(s), FSDP2 forward "
        f"{fsdp['forward_s'] * 1e3:.1f} ms, in-process {result.meta['timings_s']['a_s'] * 1e3:.1f} "
        f"ms, {len(table)} pairs, patched={fsdp['plan']['patched']}"
    )

    assert fsdp["backend"] == "nccl"
    assert len(table) > 20, "too few modules captured: the hooks never fired"
    assert (table["module"] == ROOT).any()
    assert (table["max_ulp"] == 0).all() and (table["bitexact_frac"] == 1.0).all(), (
        result.describe()
    )
    assert all("identical" in s.reason for s in result.skipped), result.skipped
    assert not result.root_rows()[0].metrics.degenerate

"""On the H200: Qwen-Image's aligned pair is bitwise at reduced size; GPU scenarios find culprits.

Run on the device machine: `pytest -m gpu tests/test_parity_gpu.py -q -s` (prints the figures).
"""

from __future__ import annotations

import pytest

import lab
import lab.engine.scenarios as scenarios
from lab.pairing.capture import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["tiny", "reduced"])
def test_qwen_image_aligned_pair_is_bitwise_on_the_gpu(preset: str) -> None:
    fam = lab.family("qwen_image")
    model = fam.build(preset, 0, device="cuda")
    inputs = fam.make_inputs(preset, 0, device="cuda")
    # The PR's aligned stack: the engine, patched to round like the trainer (sgld + qwen_image,
    # the pipeline's timestep), runs SDPA flash and builds the RoPE cache on the GPU; the
    # trainer pins flash and rebuilds its cache on the GPU.
    pinned = {"attention_backend": "flash", "op_switches": {"rope_cache_device": "device"}}
    rollout = lab.Side.rollout(
        fam,
        device="cuda",
        attention_backend="flash",
        engine_ops=("sgld", "qwen_image"),
        op_switches={"rope_cache_device": "device", "timestep_from": "pipeline"},
    )
    trainer = lab.Side.trainer(fam, device="cuda", **pinned)
    result = lab.pair(model, inputs, rollout, trainer)
    table = result.table()
    print(f"\n{preset}: {result.describe()}")

    assert len(table) > 60
    assert (table["max_ulp"] == 0).all(), table[table["max_ulp"] > 0][["module", "max_ulp"]]
    root = table[table["module"] == ROOT]
    assert len(root) and (root["max_abs_diff"] == 0).all()


@pytest.mark.parametrize("name", scenarios.names("cuda"))
def test_scenarios_find_their_culprits_on_the_gpu(name: str) -> None:
    # GPU-only scenarios run at real width: a 1-ULP RoPE-table difference or a kernel switch
    # needs real sequence lengths and head sizes to reach the output.
    gpu_only = scenarios.get(name).needs_gpu
    run = scenarios.run(name, preset="reduced" if gpu_only else "tiny", device="cuda")
    print(f"\n{run.summary()}")

    assert run.found_culprit == run.expected_culprit, run.summary()
    bug = run.bug.output_metrics()["model_output_rel_max"]
    fixed = run.fixed.output_metrics()["model_output_rel_max"]
    assert bug > 0 and fixed < bug / 5

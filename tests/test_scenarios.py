"""Scenarios: the lab names each known culprit itself, and the fix removes or shrinks it."""

from __future__ import annotations

import pytest
import torch

import lab
import lab.engine.scenarios as scenarios
from lab.pairing.side_context import side_inputs
from lab.views.notebooks import execute_notebook

CPU_NAMES = scenarios.names("cpu")
# Families whose fixed pair is the record's bitwise-aligned stack.
ALIGNED = {"qwen_image", "wan2_2"}


@pytest.fixture(scope="module")
def runs() -> dict:
    return {}


def _run(runs: dict, name: str) -> scenarios.ScenarioRun:
    if name not in runs:
        runs[name] = scenarios.run(name, preset="tiny", device="cpu")
    return runs[name]


def test_cpu_scenarios_cover_the_issue_list() -> None:
    assert len(CPU_NAMES) >= 6
    assert set(scenarios.names()) - set(CPU_NAMES) == {
        "qwen_identity_mask",
        "qwen_attention_kernel",
        "qwen_rope_cache_device",
        "wan_patchify_conv3d",
    }


@pytest.mark.parametrize("name", CPU_NAMES)
def test_scenario_finds_its_culprit_and_the_fix_shrinks_it(runs: dict, name: str) -> None:
    run = _run(runs, name)
    bug = run.bug.output_metrics()["model_output_rel_max"]
    fixed = run.fixed.output_metrics()["model_output_rel_max"]

    assert run.found_culprit == run.expected_culprit, run.summary()
    assert run.bug.first_divergence() is not None and bug > 1e-3
    if run.scenario.family_name in ALIGNED:
        assert fixed == 0.0
        assert run.fixed.summary()["max_ulp"] == 0
    else:
        # LTX-2.3 and SD3 have no bitwise-aligned stack in the record: the fix must cut the
        # output error at least fivefold (SD3's fixed pair keeps its sgld-vs-autocast norm gap,
        # 7.9e-4 against 7.3e-3 for the bf16 bug).
        assert fixed < bug / 5


def test_ltx_positions_diverge_in_the_high_frequency_bands(runs: dict) -> None:
    extra = _run(runs, "ltx_positions_dtype").extra

    assert extra["high_band_max_bug"] > 0.5  # cos lives in [-1, 1]
    assert extra["high_band_max_bug"] > 20 * extra["low_band_max_bug"]
    assert max(extra["band_max_abs_diff_fixed"]) == 0.0


def test_identity_mask_is_a_bitwise_no_op_on_cpu() -> None:
    fam = lab.family("qwen_image")
    model = fam.build("tiny", 0)
    inputs = scenarios.get("qwen_identity_mask").inputs(fam, "tiny", "cpu")
    with_mask = lab.Side.trainer(fam)
    dropped = lab.Side.trainer(fam, op_switches={"drop_identity_mask": True})
    cpu = torch.device("cpu")

    assert side_inputs(inputs, with_mask, cpu).kwargs["encoder_hidden_states_mask"] is not None
    assert side_inputs(inputs, dropped, cpu).kwargs["encoder_hidden_states_mask"] is None
    table = lab.pair(model, inputs, with_mask, dropped).table()
    assert len(table) > 60 and (table["max_abs_diff"] == 0).all()


def test_unknown_and_gpu_only_scenarios_explain_themselves() -> None:
    with pytest.raises(ValueError, match=r"unknown scenario 'qwen_fused_norm'.*Did you mean"):
        scenarios.run("qwen_fused_norm")
    with pytest.raises(ValueError, match=r"needs a CUDA device: The efficient kernel"):
        scenarios.run("qwen_attention_kernel", device="cpu")


def test_scenarios_notebook_runs_headless(tmp_path) -> None:
    import json

    notebook = scenarios.__file__.replace("lab/engine/scenarios.py", "notebooks/06_scenarios.ipynb")
    out_dir = tmp_path / "out"
    only = ["qwen_fused_norm_rounding", "wan_root_table_rounding"]
    execute_notebook(
        notebook,
        str(tmp_path / "06.ipynb"),
        parameters=dict(device="cpu", preset="tiny", only=only, out_dir=str(out_dir)),
        cwd=str(tmp_path),
    )
    summary = json.loads((out_dir / "scenarios.json").read_text())

    assert [s["scenario"] for s in summary] == only
    assert all(s["culprit_matches"] for s in summary)
    assert all(s["bug_output_rel_max"] > 1e-3 and s["fixed_output_rel_max"] == 0.0 for s in summary)
    assert (out_dir / "qwen_fused_norm_rounding" / "bug.json").is_file()
    assert (out_dir / "bug_vs_fixed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""Gradient mode: in-process side gradients, FSDP2's reduce dtype at 1 and 2 gloo ranks against an
unsharded reference, and notebook 07 headless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lab
from lab.engine.fsdp import compare_reduce_dtypes
from lab.rl.gradients import (
    LogProbLoss,
    gradient_pair,
    master_gradients,
    pair_gradients,
)
from lab.views.notebooks import execute_notebook
from lab.views.plots import plot_gradient_divergence

# wan2_2 pins norm2 to fp32 on the trainer side: the FSDP2 runs take the patched path and mix
# bf16 and fp32 gradients in one reduce.
FAMILY = "wan2_2"


def _model_and_inputs(seed: int = 0) -> tuple[torch.nn.Module, lab.Inputs]:
    fam = lab.family(FAMILY)
    return fam.build("tiny", 0), fam.make_inputs("tiny", seed, sigma=0.75)


def test_identical_sides_give_bitwise_identical_gradients() -> None:
    model, inputs = _model_and_inputs()
    trainer = lab.Side.trainer(lab.family(FAMILY))
    loss = LogProbLoss(family_name=FAMILY)
    a = master_gradients(model, inputs, trainer, loss)
    b = master_gradients(model, inputs, trainer, loss)
    result = pair_gradients(a, b)
    table = result.table()

    assert len(table) == sum(1 for _ in model.parameters())
    assert (table["max_abs_diff"] == 0).all() and (table["bitexact_frac"] == 1.0).all()
    assert (table["max_ulp"] == 0).all()
    # Non-vacuous: real, non-zero gradients in fp32, computed at the side's gather dtypes.
    assert all(g is not None and g.dtype == torch.float32 for g in a.grads.values())
    assert all(g.abs().max() > 0 for g in a.grads.values())
    assert set(table["compute_dtype_a"]) == {"bf16", "fp32"}
    assert all(p.grad is None for p in model.parameters()), "the model's .grad was not restored"
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_rollout_vs_trainer_gradient_table_and_plot(tmp_path: Path) -> None:
    result = gradient_pair("sd3", "tiny")
    table = result.table()

    assert {"parameter", "shape", "dtype", "rel_max", "max_abs_diff", "cosine_dist", "max_ulp"} <= (
        set(table.columns)
    )
    assert (table["dtype"] == "fp32").all()
    assert set(table["compute_dtype_a"]) == {"fp16"}, "sd3's rollout computes in fp16"
    assert (table["rel_max"] > 0).sum() > len(table) // 2, "rollout and trainer should differ"
    assert result.summary()["worst_parameter"] in set(table["parameter"])
    fig = plot_gradient_divergence(result)
    png = tmp_path / "g.png"
    fig.savefig(png)
    assert png.stat().st_size > 10_000
    doc = json.loads(result.to_json(tmp_path / "g.json").read_text())
    assert len(doc["rows"]) == len(table)


def test_loss_rejects_a_step_that_goes_up() -> None:
    model, inputs = _model_and_inputs()
    with pytest.raises(ValueError, match="above sigma_prev"):
        master_gradients(
            model, inputs, lab.Side.trainer(lab.family(FAMILY)),
            LogProbLoss(family_name=FAMILY, sigma_prev=0.9),
        )  # fmt: skip


@pytest.fixture(scope="module")
def reduce_runs() -> dict[int, dict]:
    """compare_reduce_dtypes at 1 rank (fp32) and 2 ranks (fp32, bf16): one launch each."""
    return {
        1: compare_reduce_dtypes(FAMILY, nproc=1, reduce_dtypes=("fp32",)),
        2: compare_reduce_dtypes(FAMILY, nproc=2, reduce_dtypes=("fp32", "bf16")),
    }


def _assert_bitwise(result) -> None:
    table = result.table()
    assert len(table) == result.summary()["parameters"] > 50
    assert not result.skipped, result.skipped
    assert (table["max_abs_diff"] == 0).all() and (table["max_ulp"] == 0).all(), table[
        table["max_abs_diff"] > 0
    ][["parameter", "rel_max"]]
    assert (table["max_abs_a"] > 0).all(), "zero gradients would make bitwise equality vacuous"


def test_fsdp2_fp32_reduce_at_one_rank_is_bitwise_the_in_process_gradients(
    reduce_runs: dict,
) -> None:
    result = reduce_runs[1]["reduce fp32"]
    _assert_bitwise(result)
    fsdp2 = result.meta["run_b"]
    assert fsdp2["world_size"] == 1 and fsdp2["plan"]["patched"], "wan2_2's rules must patch"
    assert result.meta["loss_a"] == result.meta["loss_b"]


def test_fsdp2_fp32_reduce_at_two_ranks_is_bitwise_the_unsharded_mean(reduce_runs: dict) -> None:
    # Two ranks' fp32 gradients sum exactly in either order, and /2 is exact.
    _assert_bitwise(reduce_runs[2]["reduce fp32"])
    assert reduce_runs[2]["reduce fp32"].meta["run_b"]["world_size"] == 2


def test_bf16_reduce_at_two_ranks_differs_and_the_table_shows_it(reduce_runs: dict) -> None:
    bf16 = reduce_runs[2]["reduce bf16"].table()
    fp32 = reduce_runs[2]["reduce fp32"].table()
    assert list(bf16["parameter"]) == list(fp32["parameter"])
    assert (bf16["max_abs_diff"] > 0).sum() > len(bf16) // 2
    assert bf16["rel_max"].max() > 1e-4 and fp32["rel_max"].max() == 0
    # The rounding is at most a bf16 rounding of each term and of the sum: well under 1 %.
    assert bf16["rel_max"].max() < 1e-2


@pytest.mark.parametrize("nproc,reduce", [(1, "fp32"), (2, "fp32"), (2, "bf16")])
def test_real_reduce_is_bitwise_its_in_process_emulation(
    reduce_runs: dict, nproc: int, reduce: str
) -> None:
    # Per-rank gradients cast to the reduce dtype, summed in rank order, halved, cast to fp32.
    emulation = reduce_runs[nproc][f"reduce {reduce}"].meta["emulation"]
    assert emulation["parameters"] > 50
    assert emulation["bitexact_parameters"] == emulation["parameters"], emulation


@pytest.mark.slow
def test_notebook_07_runs_headless_and_the_emulation_matches_real_fsdp2(tmp_path: Path) -> None:
    notebook = Path(__file__).resolve().parent.parent / "notebooks" / "07_fsdp2.ipynb"
    out_dir = tmp_path / "out"
    execute_notebook(
        str(notebook),
        str(tmp_path / "07.ipynb"),
        parameters={"out_dir": str(out_dir)},
        cwd=str(tmp_path),
    )
    real = json.loads((out_dir / "results.json").read_text())
    emulated = json.loads((out_dir / "in_process.json").read_text())
    assert real["meta"]["runtime_b"] == "fsdp2" and real["meta"]["fsdp2"]["world_size"] == 1
    assert real["side_a"]["name"] == "rollout" and real["side_b"]["name"] == "trainer"
    assert real["summary"]["pairs"] > 20
    assert [r["module"] for r in real["rows"]] == [r["module"] for r in emulated["rows"]]
    for a, b in zip(emulated["rows"], real["rows"], strict=True):
        assert a["max_abs_diff"] == b["max_abs_diff"] and a["ulp_hist"] == b["ulp_hist"]
    grads = json.loads((out_dir / "gradients.json").read_text())
    assert set(grads) == {"rollout vs trainer", "reduce fp32", "reduce bf16"}
    fp32 = grads["reduce fp32"]["summary"]
    assert fp32["bitexact_parameters"] == fp32["parameters"] > 50
    # One rank: bf16 only rounds wan2_2's fp32-computed norm2 gradients.
    bf16 = grads["reduce bf16"]["summary"]
    assert 0 < fp32["parameters"] - bf16["bitexact_parameters"] < 10
    for png in ("emulation_vs_fsdp2", "gradient_divergence", "reduce_dtypes"):
        assert (out_dir / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

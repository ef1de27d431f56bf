"""Both sides sharded under FSDP2 (`lab.engine.fsdp.pair_sharded`): the same per-module table as the
in-process pair, bit for bit on tiny, and Qwen-Image `full` (20 B parameters; both sides fit only
sharded) across 2 GPUs with a row for every block.

GPU: `pytest -m gpu tests/test_fsdp2_sharded_gpu.py -s` on the nvidia-h200-x2 kind (-s prints
time and peak memory per rank). One CPU case (2 gloo ranks, two families whose rollout side needs
the engine-load emulation) runs in the default suite.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import lab
from lab.engine.fsdp import pair_sharded, pair_sharded_captures, run_fsdp2_forwards, sharded_jobs
from lab.families import FAMILY_NAMES
from lab.pairing.capture import ROOT

# minimax_h3: keep_fp32_modules plus rules; qwen_image: engine ops (sgld, qwen_image).
CPU_FAMILIES = ("minimax_h3", "qwen_image")


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs: run on the device machine (nvidia-h200-x2)")


def _sharded_results(families: tuple[str, ...], device: str) -> dict[str, lab.Result]:
    """Every family's two sharded jobs in one 2-rank launch, paired."""
    jobs = [j for f in families for j in sharded_jobs(f, "tiny", device=device)]
    start = time.perf_counter()
    captures = run_fsdp2_forwards(jobs, nproc=2, device=device, timeout_s=300)
    print(f"\n{len(families)} families x 2 sharded sides on 2 {device} ranks: "
          f"{time.perf_counter() - start:.1f} s (one launch)")  # fmt: skip
    return {
        f: pair_sharded_captures(captures[2 * i], captures[2 * i + 1])
        for i, f in enumerate(families)
    }


def _assert_rows_bitwise_in_process(sharded: lab.Result, family_name: str, device: str) -> None:
    in_process = lab.pair_family(family_name, "tiny", device=device, capture_depth=1)
    assert len(sharded.rows) == len(in_process.rows) > 10
    assert [s.reason for s in sharded.skipped] == [s.reason for s in in_process.skipped]
    for a, b in zip(in_process.rows, sharded.rows, strict=True):
        assert (a.module, a.call, a.output) == (b.module, b.call, b.output)
        assert (a.dtype_a, a.dtype_b, a.shape) == (b.dtype_a, b.dtype_b, b.shape), a.label()
        assert a.metrics == b.metrics, (a.label(), a.metrics, b.metrics)
    # Non-vacuous: the two sides do differ, and the sharded rollout ran as the engine would.
    assert any(r.diverges for r in sharded.rows), "rollout and trainer agree: nothing compared"
    assert sharded.meta["fsdp2_a"]["world_size"] == 2


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, lab.Result]:
    return _sharded_results(CPU_FAMILIES, "cpu")


@pytest.mark.parametrize("family_name", CPU_FAMILIES)
def test_sharded_pair_on_gloo_is_bitwise_the_in_process_pair(
    cpu_results: dict, family_name: str
) -> None:
    torch.set_num_threads(1)  # the ranks' thread count
    _assert_rows_bitwise_in_process(cpu_results[family_name], family_name, "cpu")


@pytest.fixture(scope="module")
def gpu_results() -> dict[str, lab.Result]:
    _need_gpus(2)
    return _sharded_results(FAMILY_NAMES, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_sharded_pair_on_nccl_is_bitwise_the_in_process_pair(
    gpu_results: dict, family_name: str
) -> None:
    _assert_rows_bitwise_in_process(gpu_results[family_name], family_name, "cuda")


def _figures(result: lab.Result) -> str:
    t = result.meta["timings_s"]
    lines = [
        f"{result.meta['family']} [{result.meta['preset']}] both sides sharded: launch "
        f"{t.get('launch_s', float('nan')):.1f} s, pairing {t['pair_s']:.1f} s, "
        f"{len(result.rows)} rows"
    ]
    for key in ("fsdp2_a", "fsdp2_b"):
        m: dict[str, Any] = result.meta[key]
        peaks = ", ".join(f"{p:.1f}" for p in m["peak_memory_gib_per_rank"])
        lines.append(
            f"  {key[-1]}: build {m['build_s']:.1f} s, shard {m['shard_s']:.2f} s, forward "
            f"{m['forward_s']:.2f} s, peak GiB per rank [{peaks}]"
        )
    return "\n".join(lines)


@pytest.mark.gpu
def test_qwen_image_full_sharded_over_two_gpus_has_every_block_row() -> None:
    _need_gpus(2)
    result = pair_sharded("qwen_image", "full", nproc=2, device="cuda", capture_depth=1)
    print("\n" + _figures(result))
    table = result.table()
    blocks = lab.family("qwen_image").config("full")["num_layers"]

    assert blocks == 60
    for i in range(blocks):
        rows = table[table["module"] == f"transformer_blocks.{i}"]
        # A dual-stream block returns (encoder_hidden_states, hidden_states).
        assert set(rows["output"]) == {"0", "1"}, f"transformer_blocks.{i}: {list(rows['output'])}"
    assert (table["module"] == ROOT).any()
    assert not result.root_rows()[0].metrics.degenerate
    assert (table["nonfinite_a"] == 0).all() and (table["nonfinite_b"] == 0).all()
    assert all("identical" in s.reason for s in result.skipped), result.skipped
    assert table["rel_max"].max() > 0, "rollout and trainer agree bit for bit: nothing compared"
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    for key in ("fsdp2_a", "fsdp2_b"):
        peaks = result.meta[key]["peak_memory_gib_per_rank"]
        assert len(peaks) == 2 and all(0 < p < total_gib for p in peaks)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("fault", "module"),
    [
        # Rank 1 raises after block 0's all-gather: rank 0 runs block 0, then waits in block
        # 1's all-gather for good (NCCL): the parent's ABORT_KEY has it save its outputs.
        ("raise@1:trainer:transformer_blocks.0", "transformer_blocks.0"),
        ("raise@0:trainer:transformer_blocks.1", "transformer_blocks.1"),  # rank 0 raises
    ],
    ids=["rank1", "rank0"],
)
def test_a_failed_nccl_rank_keeps_the_pairs_compared_before_it(
    fault: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing lost on a fault on NCCL: rank 0's outputs up to the failure come back and pair."""
    from lab.engine.fsdp import ShardedPairError

    _need_gpus(2)
    monkeypatch.setenv("LAB_FSDP2_FAULT", fault)
    start = time.perf_counter()
    with pytest.raises(ShardedPairError) as info:
        pair_sharded("qwen_image", "tiny", nproc=2, device="cuda", timeout_s=300)
    err = info.value
    print(f"\n{fault}: failed in {time.perf_counter() - start:.1f} s; {str(err).splitlines()[0]}")
    assert (err.side, err.module, err.rank) == ("trainer", module, int(fault[6]))
    rollout, trainer = err.captures
    assert not rollout.meta.get("partial") and trainer.meta["partial"]
    in_process = lab.pair_family("qwen_image", "tiny", device="cuda", capture_depth=1).rows
    rows = err.result.rows
    assert 0 < len(rows) == len(trainer.leaves) < len(in_process)
    for a, b in zip(in_process, rows, strict=False):
        assert (a.module, a.call, a.output, a.metrics) == (b.module, b.call, b.output, b.metrics)

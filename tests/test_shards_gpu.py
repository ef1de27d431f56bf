"""One FSDP2 rank's rows on CUDA (`lab.families.shards`): bitwise the whole build's rows at reduced
on every family, and MiniMax H3 full's rank 1 of 2 built on one H200 in half the memory, bitwise
the same rows of the whole 123.4 GiB build.

GPU: `pytest -m gpu tests/test_shards_gpu.py -s` on the device machine (one H200; -s prints the
peak memory and seconds).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

import lab
from lab.families import FAMILY_NAMES
from lab.families.shards import shard_rows

pytestmark = pytest.mark.gpu


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _fresh() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_reduced_rows_on_cuda_are_bitwise_the_whole_build(family_name: str) -> None:
    fam = lab.family(family_name)
    expert = fam.experts[0] if fam.experts else None
    _fresh()
    whole = fam.build("reduced", 0, device="cuda", expert=expert, master="fp32")
    params = dict(whole.named_parameters())
    for world in (2, 3):
        for rank in range(world):
            shard = fam.build_shard(
                "reduced", 0, rank=rank, world=world, device="cuda", expert=expert
            )
            assert list(shard.rows) == list(params)
            for name, param in params.items():
                start, end = shard_rows(param.shape[0], rank, world)
                assert torch.equal(_bits(shard.rows[name]), _bits(param[start:end])), (
                    f"{family_name} {name} rank {rank} of {world}"
                )
            del shard


def test_minimax_h3_full_rank_builds_half_the_master_bitwise() -> None:
    fam = lab.family("minimax_h3")
    gib = 2**30
    _fresh()
    start = time.perf_counter()
    shard = fam.build_shard("full", 0, rank=1, world=2, device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / gib
    rows, largest = shard.held_bytes["rows"] / gib, shard.held_bytes["largest_module"] / gib
    print(
        f"\nminimax_h3 full, rank 1 of 2 on one H200: rows {rows:.2f} GiB, largest module "
        f"{largest:.2f} GiB, peak {peak:.2f} GiB, {build_s:.1f} s"
    )
    # Half of 123.4 GiB, plus the module being built; the whole build needed all of it.
    assert 61.0 < rows < 62.0
    assert peak < rows + largest + 0.3
    host = {name: t.cpu() for name, t in shard.rows.items()}
    del shard
    _fresh()
    start = time.perf_counter()
    whole = fam.build("full", 0, device="cuda", master="fp32")
    torch.cuda.synchronize()
    whole_s = time.perf_counter() - start
    whole_peak = torch.cuda.max_memory_allocated() / gib
    print(f"  whole fp32 build: peak {whole_peak:.2f} GiB, {whole_s:.1f} s")
    assert whole_peak > 123.0
    for name, param in whole.named_parameters():
        start_row, end_row = shard_rows(param.shape[0], 1, 2)
        mine = host.pop(name).to("cuda")
        assert torch.equal(_bits(mine), _bits(param[start_row:end_row])), name
        del mine
    assert host == {}


def test_reduced_rank_forwards_built_from_rows_are_bitwise_the_in_process_trainer() -> None:
    from lab.engine.fsdp import Fsdp2Job, pair_capture, run_fsdp2_forwards

    # Real-width tensors through build_shard -> fully_shard on meta -> load_shards on one NCCL
    # rank (tests/test_fsdp2_gpu.py does the same at tiny), block outputs and the model output.
    jobs = [
        Fsdp2Job(
            family_name=n,
            side=lab.Side.trainer(lab.family(n), device="cuda"),
            preset="reduced",
            capture_depth=1,
        )
        for n in FAMILY_NAMES
    ]
    _fresh()
    for capture in run_fsdp2_forwards(jobs, nproc=1, device="cuda", timeout_s=500):
        name = capture.job.family_name
        model, inputs = capture.job.build("cuda")
        reference = lab.Side.trainer(lab.family(name), device="cuda")
        table = pair_capture(model, inputs, reference, capture).table()
        print(f"{name} reduced, 1 NCCL rank from rows: {len(table)} block pairs, peak GiB "
              f"{capture.meta['peak_memory_gib_per_rank']}")  # fmt: skip
        assert len(table) > 2
        assert (table["max_ulp"] == 0).all() and (table["bitexact_frac"] == 1.0).all(), name
        del model
        _fresh()

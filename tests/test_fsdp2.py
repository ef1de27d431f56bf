"""FSDP2 per-parameter dtypes: the patch on a toy model (1 and 2 gloo ranks), its errors, and
every family's real FSDP2 trainer side against the in-process trainer side, bit for bit."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lab
from lab.base.errors import PairError
from lab.engine.fsdp import (
    Fsdp2Job,
    Fsdp2RankError,
    Fsdp2TimeoutError,
    ShardedPairError,
    apply_fsdp2,
    pair_capture,
    pair_fsdp2,
    pair_sharded,
    run_fsdp2_forwards,
)
from lab.families import FAMILY_NAMES
from lab.pairing.capture import ROOT
from lab.precision.fsdp2_patch import (
    ParamDtypeMixedPrecisionPolicy,
    apply_param_dtype_map_patch,
    check_trainable_dtypes,
    resolve_wrap_param_dtypes,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
IMPL = "lab.precision._fsdp2_patch_torch2_11"

# ---- a toy model with the shapes that matter: blocks, a norm to pin, a root-owned layer ------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.norm2 = torch.nn.LayerNorm(8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.norm2(self.a(x)))


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


def _x() -> torch.Tensor:
    # 7 rows: odd sizes keep the 2-rank shards uneven (padding exercised).
    return torch.randn(7, 5, generator=torch.Generator().manual_seed(1))


# Three gather dtypes in one block group (bf16 default, fp16, fp32) exercise the copy-in buckets;
# a root entry exercises the root map.
MIXED_BLOCK_MAP = {"a.weight": FP16, "norm2.weight": FP32, "norm2.bias": FP32}
MIXED_ROOT_MAP = {"out.weight": FP32}
COMMON = dict(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)


def _expected_dtypes(block_map: dict, root_map: dict) -> dict[str, torch.dtype]:
    out = {}
    for name, _ in _toy().named_parameters():
        if name.startswith("blocks."):
            local = name.split(".", 2)[2]
            out[name] = block_map.get(local, BF16)
        else:
            out[name] = root_map.get(name, BF16)
    return out


def _forward_backward(model: torch.nn.Module, full_grad: bool) -> dict[str, Any]:
    """Output, fp32 gradients and the dtype every parameter had when its module ran."""
    seen: dict[str, str] = {}
    handles = []
    for prefix, module in model.named_modules():

        def hook(mod: torch.nn.Module, args: Any, prefix: str = prefix) -> None:
            for k, p in mod.named_parameters(recurse=False):
                seen[f"{prefix}.{k}" if prefix else k] = str(p.dtype)

        handles.append(module.register_forward_pre_hook(hook))
    with torch.autocast("cpu", dtype=BF16):
        y = model(_x())
    y.float().square().mean().backward()
    for h in handles:
        h.remove()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if full_grad else p.grad
        grads[name] = g.detach().float().clone()
    return {"out": y.detach().clone(), "grads": grads, "seen": seen}


def _sharded(mesh: Any, policy_for: Any, grouped: bool = False) -> Toy:
    from torch.distributed.fsdp import fully_shard

    model = _toy()
    if grouped:
        fully_shard(list(model.blocks), mesh=mesh, mp_policy=policy_for("block"))
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy_for("block"))
    fully_shard(model, mesh=mesh, mp_policy=policy_for("root"))
    return model


def _patch_checks(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """One rank of the toy checks; rank 0 saves every result for the asserting test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    mesh = init_device_mesh("cpu", (world_size,))
    results: dict[str, Any] = {}

    # Stock first, before anything is patched: the yardstick for the empty and restating maps.
    results["stock"] = _forward_backward(
        _sharded(mesh, lambda _: MixedPrecisionPolicy(**COMMON)), True
    )
    results["applied"] = (apply_param_dtype_map_patch(), apply_param_dtype_map_patch())
    impl = sys.modules[IMPL]
    results["applied_twice_same_fn"] = (
        impl.FSDPParamGroup.__init__ is impl._param_group_init
        and impl._fsdp_collectives._get_param_all_gather_inputs is impl._get_param_all_gather_inputs
    )

    def param_policy(block_map: dict, root_map: dict, **kw: Any) -> Any:
        def policy_for(kind: str) -> ParamDtypeMixedPrecisionPolicy:
            chosen = block_map if kind == "block" else root_map
            return ParamDtypeMixedPrecisionPolicy(**{**COMMON, **kw}, param_dtype_map=chosen)

        return policy_for

    results["empty"] = _forward_backward(_sharded(mesh, param_policy({}, {})), True)
    every_block = {n: BF16 for n, _ in Block().named_parameters()}
    every_root = {n: BF16 for n, _ in _toy().named_parameters() if not n.startswith("blocks.")}
    results["restate"] = _forward_backward(
        _sharded(mesh, param_policy(every_block, every_root)), True
    )
    mixed = _sharded(mesh, param_policy(MIXED_BLOCK_MAP, MIXED_ROOT_MAP))
    results["mixed"] = _forward_backward(mixed, True)
    # Non-vacuity of the copy-in buckets: the stock copy-in casts the whole block group to the
    # first casting parameter's dtype.
    group = mixed.blocks[0]._get_fsdp_state()._fsdp_param_group
    stock_inputs = impl._originals["_fsdp_collectives._get_param_all_gather_inputs"](
        group.fsdp_params
    )
    results["stock_copy_in_dtypes"] = sorted({str(t[0].dtype) for t in stock_inputs})
    results["patched_copy_in_dtypes"] = sorted(
        {str(t[0].dtype) for t in impl._get_param_all_gather_inputs(group.fsdp_params)}
    )
    grouped_map = {"norm2.weight": FP32, "norm2.bias": FP32}
    results["grouped"] = _forward_backward(
        _sharded(mesh, param_policy(grouped_map, {}), grouped=True), True
    )
    # Computed here, not in the pytest process: CPU kernels may sum in another order with
    # another thread count, and the comparison is bitwise.
    results["mixed_reference"] = _hand_cast_reference(MIXED_BLOCK_MAP, MIXED_ROOT_MAP)
    results["grouped_reference"] = _hand_cast_reference(grouped_map, {})

    # The errors, raised through fully_shard itself.
    errors = {}
    for label, kwargs, block_map in (
        ("unknown", {}, {"norm_2.weight": FP32}),
        ("mixed_no_reduce", {"reduce_dtype": None}, {"norm2.weight": FP32, "norm2.bias": FP32}),
        ("alias", {}, {"a.weight": FP32, "b.weight": FP16}),
    ):
        model = _toy()
        if label == "alias":
            model.blocks[0].b.weight = model.blocks[0].a.weight
        try:
            fully_shard(
                model.blocks[0],
                mesh=mesh,
                mp_policy=ParamDtypeMixedPrecisionPolicy(
                    **{**COMMON, **kwargs}, param_dtype_map=block_map
                ),
            )
            errors[label] = None
        except ValueError as err:
            errors[label] = str(err)
    results["errors"] = errors
    dist.barrier()
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    dist.destroy_process_group()


def _hand_cast_reference(block_map: dict, root_map: dict) -> dict[str, Any]:
    """The unsharded model with every parameter cast by hand to the dtype the map gives it."""
    model = _toy()
    want = _expected_dtypes(block_map, root_map)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(want[name])
    return _forward_backward(model, False)


@pytest.fixture(
    scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"]
)
def toy_results(request: pytest.FixtureRequest) -> dict[str, Any]:
    import torch.multiprocessing as mp

    world_size = request.param
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _patch_checks,
            args=(world_size, str(Path(tmp) / "pg"), tmp),
            nprocs=world_size,
            start_method="spawn",
        )
        results = torch.load(Path(tmp) / "results.pt", weights_only=False)
    results["world_size"] = world_size
    return results


def _assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["out"].dtype == b["out"].dtype
    assert torch.equal(a["out"], b["out"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    # Guard against a vacuous pass: the toy must produce non-trivial outputs and gradients.
    assert a["out"].float().abs().max() > 0
    assert all(g.abs().max() > 0 for g in a["grads"].values())


def test_applying_twice_is_a_no_op(toy_results: dict) -> None:
    assert toy_results["applied"] == (True, False)
    assert toy_results["applied_twice_same_fn"]


@pytest.mark.parametrize("variant", ["empty", "restate"])
def test_empty_and_restating_maps_are_bitwise_stock(toy_results: dict, variant: str) -> None:
    _assert_bitwise(toy_results[variant], toy_results["stock"])
    assert set(toy_results[variant]["seen"].values()) == {str(BF16)}


def test_mixed_map_is_bitwise_the_hand_cast_unsharded_reference(toy_results: dict) -> None:
    _assert_bitwise(toy_results["mixed"], toy_results["mixed_reference"])
    assert not torch.equal(toy_results["mixed"]["out"], toy_results["stock"]["out"]), (
        "the mixed map changed nothing: the overrides were not honoured"
    )


def test_pre_hook_sees_the_intended_gathered_dtype_for_every_parameter(toy_results: dict) -> None:
    want = {k: str(v) for k, v in _expected_dtypes(MIXED_BLOCK_MAP, MIXED_ROOT_MAP).items()}
    assert toy_results["mixed"]["seen"] == want
    assert len(set(want.values())) == 3


def test_mixed_gather_dtypes_get_one_copy_in_bucket_each(toy_results: dict) -> None:
    # Stock FSDP2 copies every casting parameter into one buffer of the first one's dtype
    # (fp16 here), so the bf16 parameters would be gathered at fp16; fp32 ones do not cast.
    assert toy_results["stock_copy_in_dtypes"] == sorted(str(d) for d in (FP16, FP32))
    assert toy_results["patched_copy_in_dtypes"] == sorted(str(d) for d in (BF16, FP16, FP32))


def test_duplicate_local_name_in_a_grouped_call_reaches_every_member(toy_results: dict) -> None:
    seen = toy_results["grouped"]["seen"]
    for i in (0, 1):
        assert seen[f"blocks.{i}.norm2.weight"] == str(FP32)
        assert seen[f"blocks.{i}.norm2.bias"] == str(FP32)
        assert seen[f"blocks.{i}.a.weight"] == str(BF16)
    _assert_bitwise(toy_results["grouped"], toy_results["grouped_reference"])


def test_fully_shard_raises_the_policy_errors(toy_results: dict) -> None:
    errors = toy_results["errors"]
    assert errors["unknown"] and "unknown name 'norm_2.weight'" in errors["unknown"]
    assert "'norm2.weight'" in errors["unknown"], "nearest names are listed"
    assert errors["mixed_no_reduce"] and "reduce_dtype is None" in errors["mixed_no_reduce"]
    assert errors["alias"] and "alias conflict" in errors["alias"]


# ---- the policy's checks on their own (no process group needed) ------------------------------


def _policy(block_map: dict, **kw: Any) -> ParamDtypeMixedPrecisionPolicy:
    return ParamDtypeMixedPrecisionPolicy(**{**COMMON, **kw}, param_dtype_map=block_map)


def test_unknown_name_lists_the_nearest_names() -> None:
    block = Block()
    with pytest.raises(ValueError, match=r"unknown name 'norm2.weigth'.*'norm2.weight'"):
        resolve_wrap_param_dtypes(
            _policy({"norm2.weigth": FP32}), [block], list(block.parameters())
        )


def test_name_of_a_parameter_a_nested_call_manages_is_unknown_here() -> None:
    model = _toy()
    root_params = [*model.inp.parameters(), *model.out.parameters()]
    with pytest.raises(ValueError, match="earlier \\(nested\\) fully_shard call"):
        resolve_wrap_param_dtypes(_policy({"blocks.0.a.weight": FP32}), [model], root_params)


def test_aliases_with_different_dtypes_conflict_and_with_one_dtype_do_not() -> None:
    block = Block()
    block.b.weight = block.a.weight
    params = list(block.parameters())
    with pytest.raises(ValueError, match=r"alias conflict.*'a.weight'.*'b.weight'"):
        resolve_wrap_param_dtypes(_policy({"a.weight": FP32, "b.weight": FP16}), [block], params)
    resolved = resolve_wrap_param_dtypes(
        _policy({"a.weight": FP32, "b.weight": FP32}), [block], params
    )
    assert resolved == {block.a.weight: FP32}


def test_grouped_call_broadcasts_a_shared_local_name() -> None:
    blocks = [Block(), Block()]
    params = [p for b in blocks for p in b.parameters()]
    resolved = resolve_wrap_param_dtypes(_policy({"norm2.weight": FP32}), blocks, params)
    assert resolved == {blocks[0].norm2.weight: FP32, blocks[1].norm2.weight: FP32}


def test_map_restating_the_group_dtype_resolves_to_nothing() -> None:
    block = Block()
    every = {n: BF16 for n, _ in block.named_parameters()}
    assert resolve_wrap_param_dtypes(_policy(every), [block], list(block.parameters())) == {}


def test_mixed_trainable_dtypes_need_an_explicit_reduce_dtype() -> None:
    block = Block()
    params = list(block.parameters())
    policy = _policy({"norm2.weight": FP32}, reduce_dtype=None)
    overrides = resolve_wrap_param_dtypes(policy, [block], params)
    with pytest.raises(ValueError, match=r"mixed dtypes.*reduce_dtype is None"):
        check_trainable_dtypes(policy, params, overrides)
    block.norm2.weight.requires_grad_(False)
    check_trainable_dtypes(policy, params, overrides)  # frozen: no gradient to reduce


def test_policy_rejects_a_bad_dtype_name() -> None:
    with pytest.raises(ValueError, match=r"param_dtype_map\['x'\].*Unsupported dtype 'bfloat16'"):
        _policy({"x": "bfloat16"})


def test_other_torch_version_raises_without_importing_the_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, IMPL, raising=False)
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    with pytest.raises(RuntimeError, match=r"torch 2.11.0 only; this is torch '2.10.1\+cu128'"):
        apply_param_dtype_map_patch()
    assert IMPL not in sys.modules


def test_source_hash_drift_refuses_to_patch_and_names_the_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    impl = importlib.import_module(IMPL)
    if impl.is_applied():
        pytest.skip("patch already applied in this process; the drift check runs before it")
    before = dict(impl._targets())
    drifted = {**impl.EXPECTED_SOURCE_SHA256, "FSDPParam.init_dtype_attrs": "0" * 64}
    monkeypatch.setattr(impl, "EXPECTED_SOURCE_SHA256", drifted)
    with pytest.raises(RuntimeError, match=r"FSDPParam.init_dtype_attrs.*Nothing was patched"):
        apply_param_dtype_map_patch()
    assert impl._targets() == before
    assert not impl.is_applied()


# ---- apply_fsdp2's choice of path, and every family against the in-process trainer side ------


def test_apply_fsdp2_refuses_an_engine_like_side() -> None:
    fam = lab.family("wan2_2")
    with pytest.raises(ValueError, match="keep_fp32_modules"):
        apply_fsdp2(
            torch.nn.Linear(2, 2), fam, lab.Side.rollout(fam, keep_fp32_modules=("norm2",)), None
        )


def test_run_fsdp2_forwards_checks_its_arguments() -> None:
    fam = lab.family("wan2_2")
    job = Fsdp2Job(family_name="wan2_2", side=lab.Side.trainer(fam))
    with pytest.raises(ValueError, match="nproc must be an int >= 1"):
        run_fsdp2_forwards([job], nproc=0)
    with pytest.raises(ValueError, match="no jobs given"):
        run_fsdp2_forwards([])
    gpu_side = lab.Side.trainer(fam).replace(device="cuda") if torch.cuda.is_available() else None
    if gpu_side is not None:
        with pytest.raises(ValueError, match="device='cuda' but the ranks run on 'cpu'"):
            run_fsdp2_forwards([Fsdp2Job(family_name="wan2_2", side=gpu_side)])


@pytest.fixture(scope="module")
def family_captures() -> dict[int, dict[str, Any]]:
    """Every family's FSDP2 trainer capture at 1 and 2 gloo ranks (one torchrun launch each)."""
    jobs = [Fsdp2Job(family_name=n, side=lab.Side.trainer(lab.family(n))) for n in FAMILY_NAMES]
    out = {}
    for nproc in (1, 2):
        captures = run_fsdp2_forwards(jobs, nproc=nproc, device="cpu", timeout_s=300)
        out[nproc] = {c.job.family_name: c for c in captures}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_fsdp2_trainer_is_bitwise_the_in_process_trainer(
    family_captures: dict, family_name: str
) -> None:
    capture = family_captures[1][family_name]
    model, inputs = capture.job.build("cpu")
    result = pair_capture(model, inputs, lab.Side.trainer(lab.family(family_name)), capture)
    table = result.table()

    assert len(table) > 20, "too few modules captured: the hooks never fired"
    assert len(table) + len(result.skipped) == len(capture.leaves)
    assert (table["module"] == ROOT).any()
    assert (table["max_ulp"] == 0).all() and (table["bitexact_frac"] == 1.0).all()
    assert result.first_divergence() is None
    assert all("identical" in s.reason for s in result.skipped), result.skipped
    assert not result.root_rows()[0].metrics.degenerate
    plan = capture.meta["plan"]
    assert plan["wrap_count"] > 0
    fam = lab.family(family_name)
    assert plan["patched"] == bool(fam.param_dtype_rules), "stock path must run without rules"


def test_a_family_without_rules_runs_the_unpatched_stock_path(family_captures: dict) -> None:
    # Jobs run in FAMILY_NAMES order in one rank process, so the first family ran before any
    # rule could have applied the patch.
    first = FAMILY_NAMES[0]
    assert not lab.family(first).param_dtype_rules, f"{first} has rules; pick another family"
    for nproc in (1, 2):
        assert family_captures[nproc][first].meta["patch_applied"] is False
        assert family_captures[nproc][first].meta["plan"]["patched"] is False
    patched = [n for n in FAMILY_NAMES if family_captures[1][n].meta["plan"]["patched"]]
    assert patched, "no family exercised the patched path"


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_two_ranks_capture_is_bitwise_the_one_rank_capture(
    family_captures: dict, family_name: str
) -> None:
    # Bitwise equality is transitive: with the test above, 2 ranks == the in-process trainer,
    # without running the in-process forward a second time.
    one, two = family_captures[1][family_name], family_captures[2][family_name]
    assert two.meta["world_size"] == 2 and one.meta["world_size"] == 1
    assert [k[:3] for k in two.leaves] == [k[:3] for k in one.leaves]
    for (module, call, output, a), (*_, b) in zip(one.leaves, two.leaves, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), (module, call, output)
        else:
            assert a == b


# ---- launches end cleanly: failures, timeouts, SIGTERM, loopback only (issue 14 items 9-11) ----

FAULT = "LAB_FSDP2_FAULT"


def _wan_job() -> Fsdp2Job:
    return Fsdp2Job(family_name="wan2_2", side=lab.Side.trainer(lab.family("wan2_2")))


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (the launch's folder names them)."""
    from lab.base.processes import alive

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _leftovers(folder: Path) -> list[str]:
    return sorted(
        p.name for p in folder.iterdir() if p.name.startswith(("lab-fsdp2-", "torchelastic_"))
    )


def test_a_failing_rank_reaches_the_caller_with_its_own_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT, "raise@1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(Fsdp2RankError) as info:
        run_fsdp2_forwards([_wan_job()], nproc=2, device="cpu", timeout_s=300)
    err = info.value
    assert (err.rank, err.error_type) == (1, "RuntimeError")
    assert str(err).startswith(
        "run_fsdp2_forwards: rank 1 of 2 failed first, in job 0: RuntimeError: injected fault "
        "in rank 1"
    )
    # Raised as the job started, outside any forward: no module, and nothing captured.
    assert (err.job, err.module, err.module_class, err.captures) == (0, None, None, [None])
    assert "_injected_fault" in err.traceback, "the rank's own traceback"
    assert _leftovers(tmp_path) == [], "the launch folder was not removed"
    assert _processes_naming(str(tmp_path)) == [], "a rank outlived the failed launch"


@pytest.mark.slow
def test_a_reused_launch_folder_passes_nothing_old_off_as_this_launchs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files of an earlier launch in `workdir` are removed first; a capture file that cannot be
    read counts as none on a failed launch (its own error comes first), and raises otherwise."""
    from lab.engine import fsdp

    for name in ("job0.pt", "job0.partial.pt", "job0.pt.tmp", "rank1.error.json"):
        (tmp_path / name).write_bytes(b"stale")
    monkeypatch.setenv(FAULT, "raise@1")
    with pytest.raises(Fsdp2RankError, match="injected fault in rank 1") as info:
        run_fsdp2_forwards([_wan_job()], nproc=2, device="cpu", timeout_s=300, workdir=tmp_path)
    assert info.value.captures == [None]
    assert not list(tmp_path.glob("job0*")), "an old capture stayed in the folder"
    (tmp_path / "job0.pt").write_bytes(b"half a file")
    assert fsdp._written_captures([_wan_job()], tmp_path, lenient=True) == [None]
    with pytest.raises(Exception):  # noqa: B017 (torch.load's own error, whichever it is)
        fsdp._written_captures([_wan_job()], tmp_path)


def test_a_launch_past_its_timeout_ends_every_rank_and_removes_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT, "hang@0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(
        RuntimeError, match=r"the 2-rank launch ran past 8 s; every rank was ended"
    ) as info:
        run_fsdp2_forwards([_wan_job()], nproc=2, device="cpu", timeout_s=8)
    assert isinstance(info.value, Fsdp2TimeoutError) and info.value.captures == [None]
    assert _leftovers(tmp_path) == []
    assert _processes_naming(str(tmp_path)) == []


def _block_rows(family: str) -> list[tuple]:
    """The in-process pair's block-level rows (key and metrics), as the sharded pair gives them."""
    rows = lab.pair_family(family, "tiny", capture_depth=1).rows
    return [(r.module, r.call, r.output, r.metrics) for r in rows]


@pytest.mark.parametrize(
    ("fault", "reached"),
    [
        # Rank 0 itself raises as transformer_blocks.1 starts: blocks before it are kept.
        ("raise@0:trainer:transformer_blocks.1", {"transformer_blocks.0"}),
        # Rank 1 raises there, after that block's all-gather (FSDP2's pre-forward hook runs
        # first): rank 0 runs the block and stops at the next all-gather, its peer gone.
        pytest.param(
            "raise@1:trainer:transformer_blocks.1",
            {"transformer_blocks.0", "transformer_blocks.1"},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["rank0", "rank1"],
)
def test_a_sharded_pair_that_fails_part_way_keeps_the_pairs_compared_before(
    fault: str, reached: set[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing lost on a fault: a rank failing inside the trainer's forward leaves the rollout's
    whole capture, the trainer's outputs up to the failure, and their pairs."""
    monkeypatch.setenv(FAULT, fault)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ShardedPairError) as info:
        pair_sharded("sd3", "tiny", nproc=2, device="cpu", timeout_s=300)
    err = info.value
    assert isinstance(err, PairError) and isinstance(err, RuntimeError)
    failing_rank = int(fault[len("raise@")])
    assert (err.side, err.module, err.module_class) == (
        "trainer",
        "transformer_blocks.1",
        "JointTransformerBlock",
    )  # the class's own name, not FSDP2's FSDPJointTransformerBlock
    assert (err.rank, err.error_type) == (failing_rank, "RuntimeError")
    assert "injected fault in rank" in err.traceback
    rollout, trainer = err.captures
    assert rollout is not None and not rollout.meta.get("partial")
    assert trainer is not None and trainer.meta["partial"] is True
    assert trainer.meta["failed"]["module_class"] == "JointTransformerBlock"
    # The pairs: exactly the in-process block-level pair's, up to where the trainer stopped.
    rows = [(r.module, r.call, r.output, r.metrics) for r in err.result.rows]
    expected = _block_rows("sd3")
    assert rows == expected[: len(rows)] and rows[-1][0] in reached
    assert len(rows) == len(trainer.leaves) < len(expected)
    assert err.result.skipped == [], "outputs the trainer never reached are not 'only on' a side"
    assert str(err).startswith(
        "pair_sharded: side 'trainer' failed under FSDP2, in module 'transformer_blocks.1' "
        f"(JointTransformerBlock); the {len(rows)} pair(s) compared before the failure are in "
        f"err.result; the ranks' captures (rollout: {len(expected)} output(s), trainer: "
        f"{len(rows)} output(s) (partial)) are in err.captures.\nrun_fsdp2_forwards: rank "
        f"{failing_rank} of 2 failed first, in job 1 in module 'transformer_blocks.1'"
    )
    assert _leftovers(tmp_path) == [] and _processes_naming(str(tmp_path)) == []


@pytest.mark.slow
def test_a_stuck_rank_0_saves_its_outputs_when_another_rank_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NCCL a rank whose peer died waits in its collective for good, and raises nothing:
    the parent tells rank 0 the launch failed (ABORT_KEY), and it saves what it captured."""
    # Rank 0 stalls as transformer_blocks.1 starts (it never raises); rank 1 raises there.
    monkeypatch.setenv(
        FAULT, "raise@1:trainer:transformer_blocks.1,hang@0:trainer:transformer_blocks.1"
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(ShardedPairError) as info:
        pair_sharded("sd3", "tiny", nproc=2, device="cpu", timeout_s=300)
    err = info.value
    assert time.monotonic() - start < 60, "the launch waited for its timeout"
    assert (err.rank, err.side, err.module) == (1, "trainer", "transformer_blocks.1")
    trainer = err.captures[1]
    assert trainer.meta["partial"] and trainer.meta["failed"] == {
        "module": None,
        "module_class": None,
        "error": "ended: rank 1 of 2 exited with 1",
    }
    rows = [(r.module, r.call, r.output, r.metrics) for r in err.result.rows]
    assert rows == _block_rows("sd3")[: len(rows)] and rows[-1][0] == "transformer_blocks.0"
    assert "rank 0: ended on the launch's failure (what its forward had captured saved)" in str(err)
    assert _leftovers(tmp_path) == [] and _processes_naming(str(tmp_path)) == []


@pytest.mark.slow
def test_a_launch_that_times_out_mid_forward_keeps_rank_0s_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT, "hang@0:trainer:transformer_blocks.1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    job = Fsdp2Job(family_name="sd3", side=lab.Side.trainer(lab.family("sd3")), capture_depth=1)
    # 40 s: rank 0 has to start, build and run up to the stall first, on a busy 2-core machine.
    with pytest.raises(Fsdp2TimeoutError, match="the 2-rank launch ran past 40 s") as info:
        run_fsdp2_forwards([job], nproc=2, device="cpu", timeout_s=40)
    (capture,) = info.value.captures
    assert capture is not None, f"rank 0 never reached the stall: {info.value}"
    assert capture.meta["failed"]["error"] == "ended: the launch ran past 40 s"
    keys = [leaf[:3] for leaf in capture.leaves]
    assert keys == [row[:3] for row in _block_rows("sd3")][: len(keys)]
    assert keys[-1][0] == "transformer_blocks.0"
    assert _leftovers(tmp_path) == [] and _processes_naming(str(tmp_path)) == []


@pytest.mark.slow
def test_a_rank_failing_after_rank_0s_forward_finished_keeps_the_whole_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen-Image tiny's last block: rank 1 raises after its all-gather, rank 0 runs the block
    and the root's last modules (no collective left) and fails after, gathering the peaks."""
    monkeypatch.setenv(FAULT, "raise@1:trainer:transformer_blocks.1")
    with pytest.raises(ShardedPairError) as info:
        pair_sharded("qwen_image", "tiny", nproc=2, device="cpu", timeout_s=300)
    err = info.value
    trainer = err.captures[1]
    # Rank 0 learns of it from gloo (a connection error) or from the parent (ABORT_KEY).
    error = trainer.meta["failed"]["error"]
    assert trainer.meta["partial"] is False
    assert "Connection" in error or error == "ended: rank 1 of 2 exited with 1", error
    rows = [(r.module, r.call, r.output, r.metrics) for r in err.result.rows]
    assert rows == _block_rows("qwen_image"), "every pair, as the in-process pair has them"
    assert "trainer: 18 output(s))" in str(err)


@pytest.mark.slow
def test_a_failed_rollout_side_keeps_its_capture_and_pairs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULT, "raise@0:rollout:transformer_blocks.0")
    with pytest.raises(ShardedPairError) as info:
        pair_sharded("sd3", "tiny", nproc=2, device="cpu", timeout_s=300)
    err = info.value
    assert (err.side, err.module, err.result) == ("rollout", "transformer_blocks.0", None)
    rollout, trainer = err.captures
    assert trainer is None and rollout.meta["partial"] is True
    # Everything before the first block: the embedders' outputs, as the in-process pair has them.
    assert [leaf[:3] for leaf in rollout.leaves] == [k[:3] for k in _block_rows("sd3")][:7]
    assert "nothing could be paired (err.result is None)" in str(err)


@pytest.mark.slow
def test_pair_fsdp2_failing_part_way_pairs_the_reference_with_what_was_captured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULT, "raise@0:trainer:transformer_blocks.1")
    with pytest.raises(ShardedPairError) as info:
        pair_fsdp2("sd3", "tiny", nproc=2, device="cpu", capture_depth=1)
    err = info.value
    (trainer,) = err.captures
    rows = [(r.module, r.call, r.output, r.metrics) for r in err.result.rows]
    assert rows == _block_rows("sd3")[: len(rows)] and len(rows) == len(trainer.leaves) == 9
    assert err.result.skipped == []
    assert str(err).startswith("pair_fsdp2: side 'trainer' failed under FSDP2, in module")


@pytest.mark.slow
def test_a_timed_out_sharded_pair_says_which_side_was_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULT, "hang@0")
    with pytest.raises(ShardedPairError) as info:
        pair_sharded("sd3", "tiny", nproc=2, device="cpu", timeout_s=8)
    err = info.value
    assert (err.side, err.result, err.captures, err.rank) == ("rollout", None, [None, None], None)
    assert "the 2-rank launch ran past 8 s" in str(err)


@pytest.mark.parametrize("value", ["raise@x", "boom@0", "raise@0:trainer", "raise@0,hang@y"])
def test_a_bad_fault_hook_is_named(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lab.engine import fsdp

    monkeypatch.setenv(FAULT, value)
    with pytest.raises(ValueError, match=re.escape(f"LAB_FSDP2_FAULT={value!r}")):
        fsdp._faults()
    monkeypatch.setenv(FAULT, "raise@1:trainer:transformer_blocks.1,hang@0")
    assert fsdp._faults() == [("raise", 1, "trainer", "transformer_blocks.1"),
                              ("hang", 0, None, None)]  # fmt: skip


_CALLER = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
import lab
from lab.engine.fsdp import Fsdp2Job, run_fsdp2_forwards
job = Fsdp2Job(family_name="wan2_2", side=lab.Side.trainer(lab.family("wan2_2")))
run_fsdp2_forwards([job], nproc=2, device="cpu", timeout_s=600)
"""


def _listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (`ss -ltnp`)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    addresses = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            addresses.append(line.split()[3])
    return addresses


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_a_signalled_caller_ends_its_ranks_removes_its_folder_and_listened_on_loopback(
    tmp_path: Path, sig: signal.Signals
) -> None:
    caller = subprocess.Popen(
        [sys.executable, "-c", _CALLER, str(tmp_path)],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, FAULT: "hang@1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        # Rank 1 hangs after joining the process group; rank 0 then waits for it in a collective.
        while not list(tmp_path.glob("lab-fsdp2-*/tmp/hang1")):
            assert caller.poll() is None, caller.communicate()
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        folder = next(tmp_path.glob("lab-fsdp2-*"))
        ranks = json.loads((folder / "ranks.json").read_text())
        if shutil.which("ss"):
            addresses = _listening({caller.pid, *ranks})
            assert addresses, "nothing of the launch listens: the check would pass vacuously"
            assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
        caller.send_signal(sig)
        _, stderr = caller.communicate(timeout=120)
    finally:
        if caller.poll() is None:
            caller.kill()
    assert caller.returncode != 0
    assert ("Terminated: SIGTERM" if sig == signal.SIGTERM else "KeyboardInterrupt") in stderr
    assert _leftovers(tmp_path) == [], "the launch folder (or a torchelastic one) stayed"
    assert _processes_naming(str(tmp_path)) == [], "a rank outlived its caller"


def test_a_rank_holds_its_rows_and_too_few_ranks_are_refused_before_any_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lab.engine import fsdp
    from lab.engine.fsdp import pair_sharded, rank_build_bytes

    launched = []
    monkeypatch.setattr(fsdp, "_launch_ranks", lambda *a, **k: launched.append(a))
    # MiniMax H3 full on an H200's memory. A rank builds only its rows of the fp32 master
    # (Fsdp2Job.build_shard) plus the largest module whole while it is built; counted on meta.
    monkeypatch.setenv("LAB_MEMORY_BUDGET_GIB", "139.8")
    job = Fsdp2Job(family_name="minimax_h3", side=lab.Side.trainer(lab.family("minimax_h3")),
                   preset="full")  # fmt: skip
    largest = 96768 * 2688 * 4 + 96768 * 4  # a block's adaln_proj.linear, weight and bias
    assert rank_build_bytes(job, 1) == 33_122_992_896 * 4 + largest + 16 * 4  # + rope.inv_freq
    fam = lab.family("minimax_h3")
    with torch.device("meta"):
        meta = fam.model_cls()(**fam.config("full"))
    rows = sum(-(-p.shape[0] // 2) * p[0].numel() * 4 for p in meta.parameters())
    assert rank_build_bytes(job, 2) == rows + largest + 16 * 4
    assert 61.5 < rows / 2**30 < 62.0  # half of the 123.4 GiB master
    with pytest.raises(ValueError) as err:
        pair_sharded("minimax_h3", "full", nproc=1, device="cpu")
    message = str(err.value)
    assert "minimax_h3 full does not fit one rank's cpu (139.8 GiB) at nproc=1" in message
    assert "its 1/1 of the seeded fp32 model, 124.4 GiB" in message
    assert "nproc=2 fits (62.7 GiB a rank)" in message
    # Two ranks hold it: the check passes (rank 1 ran out of memory when each built it whole).
    fsdp.check_rank_build_fits(job, "cpu", 2)
    # A tiny model under a budget no rank count fits, through run_fsdp2_forwards itself.
    tiny = Fsdp2Job(family_name="sd3", side=lab.Side.trainer(lab.family("sd3")))
    monkeypatch.setenv("LAB_MEMORY_BUDGET_GIB", repr(rank_build_bytes(tiny, 8) / 2 / 2**30))
    with pytest.raises(ValueError, match=r"sd3 tiny does not fit one rank's cpu") as err:
        run_fsdp2_forwards([tiny], nproc=2, device="cpu")
    assert "No nproc up to 8 fits" in str(err.value) and "master='compact'" in str(err.value)
    assert launched == [], "a rank was launched before the refusal"
    # No budget on a CPU: no check.
    monkeypatch.delenv("LAB_MEMORY_BUDGET_GIB")
    fsdp.check_rank_build_fits(job, "cpu", 1)


_THREAD_CALLER = """
import sys, tempfile, threading, time
tempfile.tempdir = sys.argv[1]
import lab
from lab.engine.fsdp import Fsdp2Job, run_fsdp2_forwards
job = Fsdp2Job(family_name="wan2_2", side=lab.Side.trainer(lab.family("wan2_2")))
worker = threading.Thread(target=run_fsdp2_forwards, args=([job],),
                          kwargs=dict(nproc=2, device="cpu", timeout_s=600), daemon=True)
worker.start()
if sys.argv[2] == "wait":
    worker.join()
else:  # the main thread ends while the launch runs in its daemon thread
    from pathlib import Path
    while not list(Path(sys.argv[1]).glob("lab-fsdp2-*/tmp/hang1")):
        time.sleep(0.2)
    print(next(Path(sys.argv[1]).glob("lab-fsdp2-*")))
"""


def _start_thread_caller(tmp_path: Path, how: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _THREAD_CALLER, str(tmp_path), how],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, FAULT: "hang@1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_hang(caller: subprocess.Popen, tmp_path: Path) -> Path:
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("lab-fsdp2-*/tmp/hang1")):
        assert caller.poll() is None, caller.communicate()
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    return next(tmp_path.glob("lab-fsdp2-*"))


@pytest.mark.slow
def test_a_caller_killed_in_a_worker_thread_leaves_a_folder_the_next_launch_removes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42: SIGTERM reaches no handler while the launch runs in a worker thread (Python
    runs handlers in the main thread only), and kill -9 none at all: the process dies on the
    spot and its `lab-fsdp2-<pid>-*` folder stays. The next launch in any process removes it
    (its lock died with its process); a live caller's folder is left alone."""
    from lab.base.processes import owned_temp_dir, remove_stale_temp_dirs

    killed = _start_thread_caller(tmp_path, "wait")
    try:
        folder = _wait_for_hang(killed, tmp_path)
        assert folder.name.startswith(f"lab-fsdp2-{killed.pid}-"), folder.name
        ranks = json.loads((folder / "ranks.json").read_text())
        # A caller that is alive keeps its folder, however many cleaners look.
        assert remove_stale_temp_dirs("lab-fsdp2-", tmp_path) == []
        assert folder.is_dir()
        killed.send_signal(signal.SIGTERM)  # its worker thread holds the launch: no handler
        killed.communicate(timeout=120)
    finally:
        if killed.poll() is None:
            killed.kill()
    assert killed.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 60
    while any(_processes_naming(str(folder))) and time.monotonic() < deadline:
        time.sleep(0.2)  # the ranks die with their caller (parent-death signal)
    assert _processes_naming(str(folder)) == [], f"a rank of {ranks} outlived its caller"
    assert folder.is_dir(), "the folder was removed: nothing left for the next launch to do"
    # The next launch's folder, in this process: the stale one goes first.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with owned_temp_dir("lab-fsdp2-") as mine:
        assert not folder.exists(), "the dead caller's folder stayed"
        assert mine.name.startswith(f"lab-fsdp2-{os.getpid()}-") and mine.is_dir()
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_launch_in_a_daemon_thread_removes_its_folder_when_the_main_thread_ends(
    tmp_path: Path,
) -> None:
    caller = _start_thread_caller(tmp_path, "exit")
    try:
        stdout, stderr = caller.communicate(timeout=300)
    finally:
        if caller.poll() is None:
            caller.kill()
    assert caller.returncode == 0, stderr
    folder = Path(stdout.strip())
    assert folder.name.startswith(f"lab-fsdp2-{caller.pid}-"), stdout
    assert not folder.exists() and _leftovers(tmp_path) == [], "the launch folder stayed"
    deadline = time.monotonic() + 60
    while _processes_naming(str(folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_naming(str(folder)) == [], "a rank outlived its caller"

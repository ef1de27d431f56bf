"""The trainer side under real FSDP2: apply_fsdp2, its ranks, and pairing their capture.

`apply_fsdp2` shards a family model the way the trainer does (one `fully_shard` per no-split
block, then the root). `run_fsdp2_forwards` launches N rank processes (gloo on CPU, NCCL on
GPU) around a rendezvous store bound to 127.0.0.1; each rank builds the same seeded model and
inputs, shards it and runs the side's forward; rank 0 captures every module output and writes it
to a file. The ranks die with the caller; a timeout, Ctrl-C, SIGTERM or a failing rank ends
every rank's process group and removes the launch's temporary folder, and a failing rank's own
exception reaches the caller (`Fsdp2RankError`).
`pair_capture` pairs such a capture against an in-process side in the parent and returns the
usual `Result`. `pair_fsdp2` does all of it for one family.

Two more uses of the same ranks: a job with a `loss` also runs the backward and returns rank 0's
gathered fp32 gradients (`compare_reduce_dtypes`: FSDP2's reduce dtype against an unsharded
reference), and `pair_sharded` runs *both* sides sharded, for models whose two sides do not
fit on one device (the engine-like rollout side expressed as FSDP2; see its docstring).

Run as a module (`-m lab.engine.fsdp --spec SPEC --out DIR`, with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set) this file is the rank entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.base.devices import DeviceName
from lab.base.dtypes import DtypeName, dtype_name
from lab.base.errors import PairError
from lab.base.processes import Interrupted
from lab.families import Family, FamilyName, Inputs
from lab.families.shards import ShardBuild, load_shards
from lab.pairing.capture import ROOT, ModuleHooks, depth_filter, flatten_output
from lab.pairing.collect import pair_leaves
from lab.pairing.result import Result
from lab.pairing.sides import Side
from lab.precision.fsdp2_patch import (
    ParamDtypeMixedPrecisionPolicy,
    apply_param_dtype_map_patch,
    is_param_dtype_map_patch_applied,
)
from lab.precision.param_rules import ParamDtypeMaps, block_wraps, compile_param_dtype_maps
from lab.rl.gradients import (
    GradientResult,
    LogProbLoss,
    SideGradients,
    master_gradients,
    mean_gradients,
    pair_gradients,
)

__all__ = [
    "Fsdp2Capture",
    "Fsdp2Job",
    "Fsdp2Plan",
    "Fsdp2RankError",
    "ParamDtypeMixedPrecisionPolicy",
    "apply_fsdp2",
    "apply_param_dtype_map_patch",
    "compare_reduce_dtypes",
    "express_engine_load",
    "pair_capture",
    "pair_fsdp2",
    "pair_sharded",
    "pair_sharded_captures",
    "run_fsdp2_forwards",
    "sharded_jobs",
]


_RANK_THREADS = "1"
"""CPU threads per rank unless OMP_NUM_THREADS is set (the ranks share the cores)."""

# ---- sharding -------------------------------------------------------------------------------


@checked_arguments
@dataclass(frozen=True)
class Fsdp2Plan:
    """What `apply_fsdp2` did to a model."""

    wrap_count: int
    """fully_shard calls on blocks (the root call comes on top)."""
    patched: bool
    """Whether ParamDtypeMixedPrecisionPolicy (and the FSDP2 patch) was used."""
    maps: ParamDtypeMaps | None
    """The compiled per-wrap maps (None without rules)."""
    param_dtype: str
    reduce_dtype: str

    def summary(self) -> dict[str, Any]:
        """JSON-ready fields for Result.meta."""
        return {
            "wrap_count": self.wrap_count,
            "patched": self.patched,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "override_count": self.maps.override_count if self.maps else 0,
            "override_numel": self.maps.override_numel if self.maps else 0,
        }


def _check_fsdp2_side(side: Side) -> None:
    where = f"apply_fsdp2: Side({side.name!r})"
    if side.keep_fp32_modules:
        raise ValueError(
            f"{where}.keep_fp32_modules={list(side.keep_fp32_modules)}: FSDP2 has no notion of "
            "modules kept in fp32 (that is engine load semantics); express them as "
            "param_dtype_rules (e.g. {'*.norm2.*': 'fp32'}) or use Side.trainer."
        )
    if side.cast_buffers:
        raise ValueError(
            f"{where}.cast_buffers=True: FSDP2 casts parameters only, buffers stay at the "
            "master dtype. Use cast_buffers=False (Side.trainer does)."
        )


@checked_arguments
def apply_fsdp2(model: torch.nn.Module, family: Family, side: Side, mesh: Any) -> Fsdp2Plan:
    """Shard `model` as the trainer does: one fully_shard per no-split block, then the root.

    Every call gets MixedPrecisionPolicy(param_dtype=side's param dtype, reduce_dtype=side's
    reduce dtype, cast_forward_inputs=False); the model boundary is input_dtype_policy's job.
    When the side's param_dtype_rules leave any override after compilation, every call gets
    a ParamDtypeMixedPrecisionPolicy with its own wrap-local map (the root takes the root map)
    and the FSDP2 patch is applied; otherwise the stock path runs and nothing is patched.
    Parameters are first cast to the side's master dtype (the sharded copy FSDP2 keeps).

    Args:
        model: The fp32 model from `Family.build`, on the mesh's device type.
        family: Its family (block classes come from `family.block_classes`).
        side: The trainer-like side.
        mesh: A 1-D DeviceMesh.

    Returns:
        What was done (wrap count, whether the patch was used, the compiled maps).

    Raises:
        ValueError: A side FSDP2 cannot express (keep_fp32_modules, cast_buffers), or bad
            rules (see `compile_param_dtype_maps`).
        RuntimeError: Overrides on a torch other than 2.11.0 (see
            `apply_param_dtype_map_patch`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _check_fsdp2_side(side)
    param_dtype = side.param_torch_dtype
    reduce_dtype = side.reduce_torch_dtype
    master = side.master_torch_dtype
    wraps = block_wraps(model, family.block_classes)
    maps = (
        compile_param_dtype_maps(model, wraps, side.param_dtype_rules, param_dtype)
        if side.param_dtype_rules
        else None
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != master:
                p.data = p.data.to(master)
    common = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    patched = False
    if maps is not None and maps.override_count:
        patched = True
        apply_param_dtype_map_patch()
        for wrap, wrap_map in zip(wraps, maps.wrap_maps, strict=True):
            fully_shard(
                wrap,
                mesh=mesh,
                mp_policy=ParamDtypeMixedPrecisionPolicy(**common, param_dtype_map=wrap_map),
            )
        root_policy: MixedPrecisionPolicy = ParamDtypeMixedPrecisionPolicy(
            **common, param_dtype_map=maps.root_map
        )
    else:
        for wrap in wraps:
            fully_shard(wrap, mesh=mesh, mp_policy=MixedPrecisionPolicy(**common))
        root_policy = MixedPrecisionPolicy(**common)
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    return Fsdp2Plan(
        wrap_count=len(wraps),
        patched=patched,
        maps=maps,
        param_dtype=dtype_name(param_dtype),
        reduce_dtype=dtype_name(reduce_dtype),
    )


@checked_arguments
def express_engine_load(model: torch.nn.Module, side: Side) -> tuple[Side, dict[str, torch.dtype]]:
    """Express an engine-like side in FSDP2's terms: keep-fp32 modules as rules, buffer casts.

    An engine loads each weight straight to its dtype and keeps named modules in fp32;
    FSDP2 gathers parameters from the sharded master at a policy dtype and never touches
    buffers. Both give the same values (a gathered cast of the fp32 master is the rounding the
    engine's load does), once the keep-fp32 components become `param_dtype_rules` (placed
    before the side's own rules, which keep winning) and the persistent floating buffers are
    cast in place before sharding (buffers are replicated, not sharded).

    Args:
        model: The unsharded fp32 model.
        side: An engine-like side (e.g. `Side.rollout`).

    Returns:
        (the side with keep_fp32_modules=() and cast_buffers=False and the rules added,
        buffer name -> dtype to cast before sharding).

    Raises:
        ValueError: The rules would not reproduce the side's per-parameter dtypes exactly
            (named: the first parameter that differs), so the FSDP2 side would not be the side.
    """
    from lab.pairing.weights import plan_weights

    want = plan_weights(model, side)
    names = [n for n, _ in model.named_parameters()]
    keep_rules: dict[str, str] = {}
    for component in side.keep_fp32_modules:
        for pattern in (component, f"{component}.*", f"*.{component}", f"*.{component}.*"):
            # A rule that matches nothing is an error in compile_param_dtype_maps: only the
            # shapes of the component that occur are kept.
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                keep_rules[pattern] = "fp32"
    rules = {p: d for p, d in keep_rules.items() if p not in side.param_dtype_rules}
    rules.update(side.param_dtype_rules)
    expressed = side.replace(keep_fp32_modules=(), cast_buffers=False, param_dtype_rules=rules)
    got = plan_weights(model, expressed).param_dtypes
    for name, dtype in want.param_dtypes.items():
        if got.get(name) != dtype:
            raise ValueError(
                f"express_engine_load: Side({side.name!r}) cannot be expressed as FSDP2 rules: "
                f"{name!r} is {dtype_name(dtype)} on the side but "
                f"{dtype_name(got[name]) if name in got else 'absent'} under rules {rules}. "
                "Pin it with an explicit param_dtype_rules entry on the side."
            )
    return expressed, dict(want.buffer_dtypes)


# ---- launching ranks ------------------------------------------------------------------------


@checked_arguments
@dataclass(frozen=True, kw_only=True)
class Fsdp2Job:
    """One forward for the ranks to run: which model, which inputs, which side."""

    family_name: FamilyName
    side: Side
    preset: str = "tiny"
    seed: int = 0
    batch: int = 1
    cfg: bool = False
    sigma: float = 0.75
    variant: str | None = None
    capture_depth: int | None = None
    """Capture only modules this many levels deep (None: every module)."""
    loss: LogProbLoss | None = None
    """Also run the backward of this loss; rank 0 returns the gathered fp32 gradients."""
    data_parallel: bool = False
    """Rank r draws its inputs with seed + r (its own samples), as a data-parallel step does;
    FSDP2's reduce then averages the ranks' gradients."""
    emulate_engine_load: bool = False
    """Run an engine-like side (keep_fp32_modules, cast_buffers) by `express_engine_load`;
    False refuses such a side, as `apply_fsdp2` does."""

    def __post_init__(self) -> None:
        # Checked here, in the caller's process: a rank would only fail with a bare error.
        from lab.families import family as get_family
        from lab.families._family import check_seed

        check_seed(self.seed, where=f"Fsdp2Job({self.family_name!r}).seed")
        # An unknown family, preset or variant: named here, not by a rank after the launch.
        get_family(self.family_name).config(self.preset, self.variant)
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(
                f"Fsdp2Job({self.family_name!r}).batch: must be an int >= 1, got {self.batch!r}."
            )
        if not isinstance(self.side, Side):
            raise ValueError(
                f"Fsdp2Job({self.family_name!r}).side: expected a Side, got "
                f"{type(self.side).__name__}."
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the side as `Side.to_dict`)."""
        return {
            "family_name": self.family_name,
            "side": self.side.to_dict(),
            "preset": self.preset,
            "seed": self.seed,
            "batch": self.batch,
            "cfg": self.cfg,
            "sigma": self.sigma,
            "variant": self.variant,
            "capture_depth": self.capture_depth,
            "loss": self.loss.to_dict() if self.loss is not None else None,
            "data_parallel": self.data_parallel,
            "emulate_engine_load": self.emulate_engine_load,
        }

    @classmethod
    @checked_arguments
    def from_dict(cls, data: dict[str, Any]) -> Fsdp2Job:
        """Inverse of `to_dict`."""
        loss = LogProbLoss.from_dict(data["loss"]) if data.get("loss") else None
        return cls(**{**data, "side": Side.from_dict(data["side"]), "loss": loss})

    @checked_arguments
    def build(
        self, device: DeviceName | torch.device, rank: int = 0
    ) -> tuple[torch.nn.Module, Inputs]:
        """The whole seeded model and the inputs, as the in-process pair builds them."""
        return self.model(device), self.inputs(device, rank)

    @checked_arguments
    def model(self, device: DeviceName | torch.device) -> torch.nn.Module:
        """The whole seeded model (`Family.build`)."""
        from lab.families import family as get_family

        fam = get_family(self.family_name)
        expert = fam.expert_for_sigma(self.sigma)
        return fam.build(self.preset, self.seed, variant=self.variant, device=device, expert=expert)

    def meta_model(self) -> torch.nn.Module:
        """The job's model on the meta device: shapes only, no memory, no random draws."""
        from lab.families import family as get_family

        fam = get_family(self.family_name)
        with torch.device("meta"):
            return fam.model_cls()(**fam.config(self.preset, self.variant))

    @checked_arguments
    def build_shard(self, device: DeviceName | torch.device, rank: int, world: int) -> ShardBuild:
        """Rank `rank`'s rows of the same seeded model (what a rank shards).

        The whole model is never held (`Family.build_shard`).
        """
        from lab.families import family as get_family

        fam = get_family(self.family_name)
        return fam.build_shard(
            self.preset,
            self.seed,
            rank=rank,
            world=world,
            variant=self.variant,
            device=device,
            expert=fam.expert_for_sigma(self.sigma),
        )

    @checked_arguments
    def inputs(self, device: DeviceName | torch.device, rank: int = 0) -> Inputs:
        """The job's inputs; with data_parallel, rank r's use seed + r."""
        from lab.families import family as get_family

        return get_family(self.family_name).make_inputs(
            self.preset,
            self.seed + (rank if self.data_parallel else 0),
            self.batch,
            self.cfg,
            variant=self.variant,
            sigma=self.sigma,
            device=device,
        )


@checked_arguments
@dataclass
class Fsdp2Capture:
    """Rank 0's module outputs of one job, in forward completion order."""

    job: Fsdp2Job
    leaves: list[tuple[str, int, str, Any]]
    """(module path or ROOT, call index, output index path, CPU tensor or a type marker)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """World size, backend, device, the Fsdp2Plan summary, seconds, peak memory per rank."""
    grads: dict[str, torch.Tensor | None] | None = None
    """With a loss: parameter name -> full fp32 gradient after FSDP2's reduce (CPU)."""


def rank_build_bytes(job: Fsdp2Job, nproc: int) -> int:
    """Bytes one of `nproc` FSDP2 ranks holds building `job`'s model.

    `guards.rank_build_bytes`: its rows of the fp32 master, the largest module whole while it
    is built, the buffers. Counted on the meta device: no memory, no random draws.
    """
    from lab.pairing.guards import rank_build_bytes as held_bytes

    return held_bytes(job.meta_model(), nproc)


def check_rank_build_fits(job: Fsdp2Job, device: str, nproc: int) -> None:
    """Refuse, before any rank starts, a job whose rows one of `nproc` ranks cannot hold.

    A rank builds only its rows of the seeded fp32 master (`Fsdp2Job.build_shard`), so it needs
    about 1/nproc of it, plus `ACTIVATION_RESERVE_SHARE` of the budget for the forward
    (`device_memory_bytes`: $LAB_MEMORY_BUDGET_GIB, or GPU 0's memory; no check on a CPU
    without the variable). MiniMax H3 full is the case: 123.4 GiB of fp32 parameters, which one
    H200 cannot hold and two can (61.7 GiB each).

    Raises:
        ValueError: Naming the family and preset, the bytes a rank needs and has, and the
            fewest ranks that fit (or that none up to `SHARDED_MOST_RANKS` do, and what to do).
    """
    from lab.pairing.guards import (
        ACTIVATION_RESERVE_SHARE,
        MEMORY_BUDGET_ENV,
        SHARDED_MOST_RANKS,
        device_memory_bytes,
        rank_build_fits,
        sharded_world,
    )
    from lab.pairing.guards import rank_build_bytes as held_bytes

    budget = device_memory_bytes(
        torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    )
    if budget is None:
        return
    whole = build_mode() == "whole"
    meta = job.meta_model()  # one meta build for every count below
    need = held_bytes(meta, 1 if whole else nproc)
    if rank_build_fits(need, budget):
        return
    world = sharded_world(meta, budget)
    reserve = int(budget * ACTIVATION_RESERVE_SHARE)
    gib = 2**30
    if world is not None:
        fix = f"nproc={world} fits ({held_bytes(meta, world) / gib:.1f} GiB a rank"
        fix += f"; {world} GPUs)." if device == "cuda" else ")."
    else:
        fix = (
            f"No nproc up to {SHARDED_MOST_RANKS} fits. Where the master is exact at bf16 (a "
            "checkpoint shipped in bf16, or build(init='bf16_shipped')), pair it on one GPU "
            "with a compact master (lab.pair; build/load with master='compact'); otherwise "
            "use a smaller preset."
        )
    held = (
        f"every rank builds the whole seeded fp32 model (${BUILD_ENV}=whole), {need / gib:.1f} GiB"
        if whole
        else f"a rank builds and holds its 1/{nproc} of the seeded fp32 model, {need / gib:.1f} GiB"
    )
    if whole:
        fix = f"Unset ${BUILD_ENV} so each rank builds only its rows: " + fix[0].lower() + fix[1:]
    raise ValueError(
        f"run_fsdp2_forwards: {job.family_name} {job.preset} does not fit one rank's {device} "
        f"({budget / gib:.1f} GiB) at nproc={nproc}: {held}, plus {reserve / gib:.1f} GiB kept "
        f"for the forward. {fix} ${MEMORY_BUDGET_ENV} overrides the budget this check uses."
    )


@checked_arguments
def run_fsdp2_forwards(
    jobs: Sequence[Fsdp2Job],
    *,
    nproc: int = 1,
    device: DeviceName = "cpu",
    timeout_s: float = 600.0,
    workdir: str | Path | None = None,
) -> list[Fsdp2Capture]:
    """Run each job's forward under real FSDP2 in `nproc` ranks (one launch for all).

    Ranks use gloo on CPU and NCCL on GPU (one GPU per rank). Every rank builds only its rows of
    the same seeded model (`Fsdp2Job.build_shard`: the whole model is never on one rank) and
    checks that it drew rank 0's weights, shards the model on the meta device and fills its
    shards from its rows (`load_shards`); every rank runs the forward (the collectives need all
    of them) and rank 0 writes its capture. CPU ranks run one thread each unless OMP_NUM_THREADS
    is set: the ranks share the cores, and the forward kernels used here give the same bits at
    any thread count (tests/test_fsdp2.py checks every family against a 2-thread in-process
    forward).

    Args:
        jobs: The forwards to run, in order.
        nproc: Ranks (1..N); on GPU at most the visible GPU count.
        device: "cpu" or "cuda".
        timeout_s: Wall-clock limit for the whole launch.
        workdir: Where the spec, captures and rank logs go (default: a temporary
            `lab-fsdp2-*` directory, removed on every way out).

    Returns:
        One Fsdp2Capture per job, in order.

    Raises:
        ValueError: nproc < 1, no jobs, an unknown device, a job whose side names another
            device, more ranks than GPUs, or a model a rank cannot build on its device
            (`check_rank_build_fits`).
        Fsdp2RankError: A rank failed: the first failing rank's own exception and traceback,
            the job and module it failed in (every rank ended). Its `captures` keep what rank 0
            wrote: each finished job's capture, the failing job's outputs up to the failure.
        Fsdp2TimeoutError: The launch ran past timeout_s (every rank ended, the rank logs
            quoted); `captures` as above.
        Fsdp2Interrupted: Ctrl-C or SIGTERM (a KeyboardInterrupt): every rank ended, the
            launch's folder removed; `captures` as above.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"run_fsdp2_forwards: nproc must be an int >= 1, got {nproc!r}.")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"run_fsdp2_forwards: device must be 'cpu' or 'cuda', got {device!r}.")
    if not jobs:
        raise ValueError("run_fsdp2_forwards: no jobs given; pass at least one Fsdp2Job.")
    for job in jobs:
        if job.side.device.split(":")[0] != device:
            raise ValueError(
                f"run_fsdp2_forwards: job {job.family_name!r} has Side({job.side.name!r}).device="
                f"{job.side.device!r} but the ranks run on {device!r}. Build the side with "
                f"device={device!r} so the in-process side it is paired with runs there too."
            )
    if device == "cuda":
        from lab.base.devices import resolve_device

        resolve_device("cuda")
        if nproc > torch.cuda.device_count():
            raise ValueError(
                f"run_fsdp2_forwards: nproc={nproc} NCCL ranks need {nproc} GPUs; "
                f"{torch.cuda.device_count()} visible."
            )
    # One meta build a model: both sides' jobs of one pair build the same one.
    for job in {(j.family_name, j.preset, j.variant): j for j in jobs}.values():
        check_rank_build_fits(job, device, nproc)
    if workdir is None:
        from lab.base.processes import owned_temp_dir

        # Removed on every way out; one left by a caller that died without removing it
        # (kill -9, or SIGTERM while it ran in a worker thread, where no handler can run) is
        # removed by the next launch of any process (its lock is free once its process died).
        with owned_temp_dir("lab-fsdp2-") as tmp:
            return run_fsdp2_forwards(
                jobs, nproc=nproc, device=device, timeout_s=timeout_s, workdir=tmp
            )
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {"device": device, "jobs": [j.to_dict() for j in jobs]}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    # A reused folder: nothing of an earlier launch may pass for this one's.
    for pattern in ("job*.pt", "job*.tmp", "rank*.error.json", "rank*.tmp"):
        for stale in workdir.glob(pattern):
            stale.unlink()
    try:
        _launch_ranks(spec_path, workdir, nproc=nproc, device=device, timeout_s=timeout_s)
    except Fsdp2LaunchError as err:
        # Read before the launch's folder goes: what each job had finished, or begun (a file
        # that cannot be read counts as none: the launch's own error comes first).
        err.captures = _written_captures(jobs, workdir, lenient=True)
        raise
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM as Terminated: every rank ended
        from lab.base.processes import signal_name

        captures = _written_captures(jobs, workdir, lenient=True)
        name = signal_name(err)
        raise Fsdp2Interrupted(
            f"run_fsdp2_forwards: stopped by {name}; every rank was ended and the launch's "
            f"temporaries removed; what rank 0 had captured ({_kept_text(jobs, captures)}) is "
            "in err.captures.",
            name,
            captures,
        ) from err
    captures = _written_captures(jobs, workdir)
    missing = [i for i, c in enumerate(captures) if c is None or c.meta.get("partial")]
    if missing:
        raise RuntimeError(
            f"run_fsdp2_forwards: every rank exited 0 but rank 0 wrote no capture of job(s) "
            f"{missing} in {workdir}."
        )
    return captures  # type: ignore[return-value]


def _written_captures(
    jobs: Sequence[Fsdp2Job], workdir: Path, lenient: bool = False
) -> list[Fsdp2Capture | None]:
    """Each job's capture as rank 0 wrote it: whole, partial (its forward failed), or None.

    `lenient`: a file that cannot be read counts as None instead of raising.
    """
    captures: list[Fsdp2Capture | None] = []
    for i, job in enumerate(jobs):
        found = None
        for path in (workdir / f"job{i}.pt", workdir / f"job{i}.partial.pt"):
            if path.exists():
                try:
                    saved = torch.load(path, weights_only=True)
                except Exception:
                    if not lenient:
                        raise
                    continue
                found = Fsdp2Capture(
                    job=job, leaves=saved["leaves"], meta=saved["meta"], grads=saved.get("grads")
                )
                break
        captures.append(found)
    return captures


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


class Fsdp2LaunchError(RuntimeError):
    """An FSDP2 launch that did not finish (a rank failed, or it ran past its timeout).

    `captures` holds, per job of the launch in order, what rank 0 had written when it ended:
    the job's whole capture, the outputs its forward captured before it failed (a capture
    whose `meta["partial"]` is True, with `meta["failed"]` naming the module and the error),
    the whole forward's outputs of a job that failed after its forward (`meta["partial"]`
    False beside `meta["failed"]`; no gradients, loss or peaks), or None. Nothing a finished
    job computed is lost with the launch.
    """

    def __init__(self, message: str) -> None:
        """The message; `captures` is filled in by `run_fsdp2_forwards`."""
        super().__init__(message)
        self.captures: list[Fsdp2Capture | None] = []


class Fsdp2RankError(Fsdp2LaunchError):
    """A rank of an FSDP2 launch failed: the first failing rank's own exception, as text.

    `rank` is that rank, `error_type` its exception class name, `traceback` its formatted
    traceback (empty when the rank died without one, e.g. killed by a signal); `job` the index
    of the job it was running, `module` and `module_class` the innermost module whose forward
    was running (None when unknown, or when it failed outside a forward).
    """

    def __init__(
        self,
        message: str,
        rank: int,
        error_type: str,
        traceback: str,
        *,
        job: int | None = None,
        module: str | None = None,
        module_class: str | None = None,
    ) -> None:
        """Keep the failing rank's details next to the message."""
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.traceback = traceback
        self.job = job
        self.module = module
        self.module_class = module_class


class Fsdp2TimeoutError(Fsdp2LaunchError):
    """An FSDP2 launch ran past its timeout (every rank was ended)."""


class ShardedPairError(PairError, Fsdp2LaunchError):
    """`pair_sharded` or `pair_fsdp2` failed in a rank: the pairs compared before the failure.

    A `PairError` (`result`: the pairs of what both sides computed before the failure, or None
    where nothing can be paired; `side`, `module`, `module_class`: where it failed) that also
    keeps the launch's `captures` and, where a rank raised, its `rank`, `error_type` and
    `traceback` (None, "" where the launch timed out).
    """

    def __init__(
        self,
        message: str,
        result: Result | None,
        launch: Fsdp2LaunchError,
        *,
        side: str | None,
    ) -> None:
        """The message, the partial Result and the launch error's details."""
        module = getattr(launch, "module", None)
        super().__init__(
            message,
            result,
            side=side,
            module=module,
            module_class=getattr(launch, "module_class", None),
        )
        self.captures = launch.captures
        self.rank: int | None = getattr(launch, "rank", None)
        self.error_type: str = getattr(launch, "error_type", "")
        self.traceback: str = getattr(launch, "traceback", "")


class Fsdp2Interrupted(Interrupted):
    """Ctrl-C or SIGTERM stopped an FSDP2 launch: every rank was ended, what it had kept here.

    `captures` as `Fsdp2LaunchError.captures` (rank 0 saves its running forward's outputs on
    the way out); `result`, set by `pair_sharded`, the pairs of what both sides had captured
    (None where nothing could be paired, and for a bare launch).
    """

    def __init__(self, message: str, signal_name: str, captures: list[Fsdp2Capture | None]) -> None:
        """The message, "SIGINT" or "SIGTERM", and rank 0's captures per job."""
        super().__init__(message, signal_name)
        self.captures = captures
        self.result: Result | None = None


def _kept_text(jobs: Sequence[Fsdp2Job], captures: Sequence[Fsdp2Capture | None]) -> str:
    """`rollout: 12 output(s), trainer: 5 output(s) (partial)`: what a launch kept per job."""
    captures = (*captures, *[None] * len(jobs))[: len(jobs)]
    return ", ".join(
        f"{j.side.name}: "
        + ("none" if c is None else f"{len(c.leaves)} output(s)")
        + (" (partial)" if c is not None and c.meta.get("partial") else "")
        for j, c in zip(jobs, captures, strict=True)
    )


LOOPBACK = "127.0.0.1"
"""Every socket of a single-node launch listens here only: the rendezvous store, gloo, NCCL."""

BUILD_ENV = "LAB_FSDP2_BUILD"
"""How a rank builds its model: "rows" (the default: only its rows, `Fsdp2Job.build_shard`) or
"whole" (the whole seeded model on every rank, rank 0's broadcast, as before stop 30)."""
_BUILDS = {
    "rows": "each rank builds only its rows of the seeded master",
    "whole": "each rank builds the whole model and takes rank 0's weights",
}


def build_mode() -> str:
    """`$LAB_FSDP2_BUILD`: "rows" (default) or "whole"; anything else is refused, named."""
    from lab.base.switches import env_choice

    return env_choice(BUILD_ENV, _BUILDS, "rows")


_FAULT_ENV = "LAB_FSDP2_FAULT"
"""Test hook honoured by the ranks: "raise@R" makes rank R raise, "hang@R" makes it sleep."""

_FAILED_GRACE_S = 10.0
"""After one rank fails, how long the others get to fail on their own (writing their errors)."""


def _launch_ranks(
    spec_path: Path, workdir: Path, *, nproc: int, device: str, timeout_s: float
) -> None:
    """Run `nproc` ranks of `-m lab.engine.fsdp` and wait; end them all on every way out.

    The parent hosts the rendezvous store on a socket bound to 127.0.0.1 (TCPStore would bind
    every interface if it opened the port itself; torchrun's agent store does). Each rank is a
    process group of its own (start_new_session) that dies with this process; timeout, Ctrl-C,
    SIGTERM and a failing rank all end every rank's group before this returns or raises.

    Raises:
        Fsdp2RankError: A rank failed: the first failing rank's exception and traceback.
        Fsdp2TimeoutError: The launch ran past `timeout_s`.
    """
    import datetime
    import socket

    import torch.distributed as dist

    from lab.base.processes import end_child, sigterm_raises, start_child

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, 0))
    listener.listen(max(128, nproc))
    port = listener.getsockname()[1]
    try:
        store = dist.TCPStore(
            LOOPBACK,
            port,
            None,
            True,
            datetime.timedelta(seconds=max(timeout_s, 1.0)),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now and closes it when it goes
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": _repo_root() + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        # Whatever a rank writes to the temporary folder goes with the launch's folder.
        "TMPDIR": str(tmp),
    }
    # One thread per rank on CPU: the ranks share the cores, and oversubscription only slows.
    env.setdefault("OMP_NUM_THREADS", _RANK_THREADS)
    loopback = _loopback_interface()
    if loopback is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    cmd = [sys.executable, "-m", "lab.engine.fsdp", "--spec", str(spec_path), "--out", str(workdir)]
    procs: list[subprocess.Popen] = []
    try:
        with sigterm_raises():
            for rank in range(nproc):
                with open(workdir / f"rank{rank}.log", "wb") as log:
                    procs.append(
                        start_child(
                            cmd,
                            new_group=True,
                            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
            (workdir / "ranks.json").write_text(json.dumps([p.pid for p in procs]))
            try:
                _wait_for_ranks(procs, workdir, timeout_s, store)
            except KeyboardInterrupt:
                # As on a failure: rank 0 saves what its running forward captured first
                # (a second Ctrl-C skips the wait; the `finally` ends every rank either way).
                _abort(store, "the caller was stopped (Ctrl-C or SIGTERM)")
                grace = time.monotonic() + _FAILED_GRACE_S
                while procs and procs[0].poll() is None and time.monotonic() < grace:
                    time.sleep(0.05)
                raise
    finally:
        for proc in procs:
            end_child(proc, group=True, grace_s=2.0)
        del store
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_for_ranks(
    procs: list[subprocess.Popen], workdir: Path, timeout_s: float, store: Any
) -> None:
    """Wait until every rank exits 0; raise on the first failure or past the deadline.

    Either way the launch failed, `store` (the launch's) gets ABORT_KEY first: rank 0 saves
    what its running forward captured and exits (`_watch_for_abort`), also where it is stuck
    in a collective whose peer is gone.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        if any(c not in (None, 0) for c in codes):
            failed = next(r for r, c in enumerate(codes) if c not in (None, 0))
            _abort(store, f"rank {failed} of {len(procs)} {_exit_text(codes[failed])}")
            # The others usually fail within moments (a collective loses its peer); give them
            # that long to write their own errors, so the first failure can be told apart.
            grace = min(deadline, time.monotonic() + _FAILED_GRACE_S)
            while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                time.sleep(0.05)
            raise _rank_failure(procs, workdir)
        if time.monotonic() > deadline:
            _abort(store, f"the launch ran past {timeout_s:g} s")
            grace = time.monotonic() + _FAILED_GRACE_S
            while procs[0].poll() is None and time.monotonic() < grace:
                time.sleep(0.05)  # rank 0 saving its forward's outputs so far
            if all(p.poll() == 0 for p in procs):
                return  # every rank finished within the grace after all
            tails = "\n".join(
                f"--- rank {r} (log tail)\n{_tail(workdir / f'rank{r}.log')}"
                for r in range(len(procs))
            )
            raise Fsdp2TimeoutError(
                f"run_fsdp2_forwards: the {len(procs)}-rank launch ran past {timeout_s:g} s; "
                "every rank was ended and the launch's temporaries removed. Use a smaller "
                f"preset, fewer jobs, or a larger timeout_s.\n{tails}"
            )
        time.sleep(0.05)


def _abort(store: Any, why: str) -> None:
    """Tell rank 0 the launch failed (ABORT_KEY), if the store still answers."""
    with contextlib.suppress(Exception):
        store.set(ABORT_KEY, why)


def _rank_failure(procs: list[subprocess.Popen], workdir: Path) -> Fsdp2RankError:
    """The error of the rank that failed first (by the time its exception was raised)."""
    errors = []
    for rank in range(len(procs)):
        path = workdir / f"rank{rank}.error.json"
        with contextlib.suppress(OSError, ValueError):
            errors.append(json.loads(path.read_text()))
    codes = [p.poll() for p in procs]
    others = ", ".join(
        f"rank {r}: " + ("still running, ended" if c is None else _exit_text(c))
        for r, c in enumerate(codes)
    )
    if errors:
        first = min(errors, key=lambda e: e["time"])
        rank = first["rank"]
        module = first.get("module")
        where = f" in module {module!r} ({first.get('module_class')})" if module else ""
        job = first.get("job")
        return Fsdp2RankError(
            f"run_fsdp2_forwards: rank {rank} of {len(procs)} failed first"
            + (f", in job {job}" if job is not None else "")
            + f"{where}: {first['type']}: {first['message']}\n{first['traceback']}({others}; "
            "every rank was ended.)",
            rank,
            first["type"],
            first["traceback"],
            job=job,
            module=module,
            module_class=first.get("module_class"),
        )
    ended = [r for r, c in enumerate(codes) if c not in (None, 0)]
    # Rank 0 ending on the parent's word (`_ABORTED`) came after the failure, not before it.
    rank = next((r for r in ended if codes[r] != _ABORTED), ended[0])
    return Fsdp2RankError(
        f"run_fsdp2_forwards: rank {rank} of {len(procs)} {_exit_text(codes[rank])} without a "
        f"Python exception (killed? out of host memory?). Its log (tail):\n"
        f"{_tail(workdir / f'rank{rank}.log')}\n({others}; every rank was ended.)",
        rank,
        "",
        "",
    )


def _exit_text(code: int) -> str:
    if code == _ABORTED:
        return "ended on the launch's failure (what its forward had captured saved)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with {code}"


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux), for gloo's and NCCL's sockets."""
    import socket

    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name in ("lo", "lo0"):
                return name
    return None


# ---- pairing in the parent ------------------------------------------------------------------


@checked_arguments
def pair_capture(
    model: torch.nn.Module,
    inputs: Inputs,
    reference: Side,
    capture: Fsdp2Capture,
    *,
    meta: dict[str, Any] | None = None,
) -> Result:
    """Pair an in-process side's forward (reference) against an FSDP2 capture (candidate).

    The reference runs like one side of `lab.pair` (weights view, input policy and switches,
    autocast, kernel, engine ops), with the same names_filter as the capture; leaves are
    paired by exact (module, call, output) key. A key on one side only, or a pair that
    cannot be compared, becomes a Skipped.

    Returns:
        A Result with side_a = reference, side_b = the capture's side; rows in the
        reference's completion order.
    """
    from lab.pairing.guards import check_fp32_master, check_inputs, model_in_use
    from lab.pairing.side_context import check_side_device

    with model_in_use(model, "pair_capture"):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        check_side_device(reference, device, model)
        check_fp32_master(model, "pair_capture")
        check_inputs(model, inputs, "pair_capture")
        return _pair_capture(model, inputs, reference, capture, device, meta)


def _pair_capture(
    model: torch.nn.Module,
    inputs: Inputs,
    reference: Side,
    capture: Fsdp2Capture,
    device: torch.device,
    meta: dict[str, Any] | None,
) -> Result:
    from lab.families.master import master_summary
    from lab.pairing.side_context import side_context, side_inputs
    from lab.pairing.weights import WeightView

    job = capture.job
    names_filter = depth_filter(job.capture_depth) if job.capture_depth is not None else None
    view = WeightView(model, reference)
    cast = side_inputs(inputs, reference, device)
    leaves_a: list[tuple[str, int, str, Any]] = []
    hooks = ModuleHooks(model, _capture_into(leaves_a), names_filter=names_filter)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        # With the model as root: the reference's engine ops (a rollout side's) apply, as in pair.
        with (
            torch.no_grad(),
            hooks.attached(),
            view.applied(),
            side_context(reference, device, model),
        ):
            model(**cast.kwargs)
    finally:
        model.train(was_training)
    seconds_a = time.perf_counter() - start
    classes = {(n or ROOT): type(m).__name__ for n, m in model.named_modules()}
    if capture.meta.get("partial"):
        # The FSDP2 forward stopped part-way: only what it reached is compared.
        reached = {(m, c, o) for m, c, o, _ in capture.leaves}
        leaves_a = [leaf for leaf in leaves_a if leaf[:3] in reached]
    rows, skipped = pair_leaves(leaves_a, capture.leaves, classes, reference.name, job.side.name)
    result_meta = {
        **(meta or {}),
        "device": str(device),
        "autocast_policy_a": reference.resolved_autocast_policy,
        "autocast_policy_b": job.side.resolved_autocast_policy,
        "runtime_b": "fsdp2",
        "fsdp2": {k: v for k, v in capture.meta.items() if k != "module_classes"},
        "master": master_summary(model),  # the in-process reference's (compact or fp32)
        "capture_depth": job.capture_depth,
        "timings_s": {"a_s": seconds_a, "b_s": capture.meta.get("forward_s")},
    }
    return Result("propagated", reference.to_dict(), job.side.to_dict(), rows, skipped, result_meta)


def _capture_into(leaves: list[tuple[str, int, str, Any]]) -> Callable[..., None]:
    def on_output(label: str, call: int, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        for idx, leaf in flatten_output(output):
            if isinstance(leaf, torch.Tensor):
                # Copied now: a later in-place op of the forward must not edit what we compare.
                leaves.append((label, call, idx, leaf.detach().to("cpu", copy=True)))
            else:
                leaves.append((label, call, idx, f"<{type(leaf).__name__}>"))

    return on_output


@checked_arguments
def pair_fsdp2(
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    seed: int = 0,
    nproc: int = 1,
    device: DeviceName = "cpu",
    reference: Side | None = None,
    trainer: Side | None = None,
    batch: int = 1,
    cfg: bool = False,
    sigma: float = 0.75,
    variant: str | None = None,
    capture_depth: int | None = None,
    timeout_s: float = 600.0,
) -> Result:
    """Pair an in-process side against the trainer side run under real FSDP2 in `nproc` ranks.

    Args:
        family_name: One of `lab.families()`.
        preset: "tiny", "reduced" or "full".
        seed: Weight and input seed (the same in every rank and in this process).
        nproc: FSDP2 ranks (gloo on CPU, NCCL on GPU).
        device: "cpu" or "cuda".
        reference: The in-process side; default `Side.rollout(family)`.
        trainer: The side run under FSDP2; default `Side.trainer(family)`.
        batch: Samples per forward.
        cfg: Use the family's CFG layout.
        sigma: The step's flow-matching sigma.
        variant: A family variant.
        capture_depth: Capture only modules this many levels deep (None: every module).
        timeout_s: Wall-clock limit for the launch (every rank is ended past it).

    Returns:
        The Result (reference first, FSDP2 trainer second), with the FSDP2 plan in
        meta["fsdp2"].

    Raises:
        ShardedPairError: A rank failed or the launch timed out (a `PairError`): `err.result`
            pairs the reference with what the FSDP2 forward captured before the failure
            (None where it captured nothing), `err.captures` keeps that capture.
        Fsdp2Interrupted: Ctrl-C or SIGTERM during the launch: every rank ended, the
            trainer's capture in `err.captures` (the reference side, run after the launch in
            this process, is not run).
    """
    from lab.families import family as get_family

    fam = get_family(family_name)
    reference = reference or Side.rollout(fam, device=device)
    trainer = trainer or Side.trainer(fam, device=device)
    job = Fsdp2Job(
        family_name=family_name,
        side=trainer,
        preset=preset,
        seed=seed,
        batch=batch,
        cfg=cfg,
        sigma=sigma,
        variant=variant,
        capture_depth=capture_depth,
    )
    failed = None
    try:
        (capture,) = run_fsdp2_forwards([job], nproc=nproc, device=device, timeout_s=timeout_s)
    except Fsdp2LaunchError as err:
        failed, capture = err, (err.captures or [None])[0]
        if capture is None:
            raise _launch_failure("pair_fsdp2", err, [job], None) from err
    model, inputs = job.build(device)
    meta = dict(
        family=family_name,
        preset=preset,
        seed=seed,
        sigma=sigma,
        batch=batch,
        cfg=cfg,
        variant=variant,
        expert=fam.expert_for_sigma(sigma),
    )
    result = pair_capture(model, inputs, reference, capture, meta=meta)
    if failed is not None:
        # The reference against what the FSDP2 forward captured before it failed.
        raise _launch_failure("pair_fsdp2", failed, [job], result) from failed
    return result


# ---- gradients under FSDP2's reduce ---------------------------------------------------------


@checked_arguments
def compare_reduce_dtypes(
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    nproc: int = 2,
    device: DeviceName = "cpu",
    reduce_dtypes: Sequence[DtypeName] = ("fp32", "bf16"),
    seed: int = 0,
    sigma: float = 0.75,
    batch: int = 1,
    trainer: Side | None = None,
    loss: LogProbLoss | None = None,
    timeout_s: float = 600.0,
) -> dict[str, GradientResult]:
    """Gradients of one data-parallel step under real FSDP2 at each reduce dtype, vs unsharded.

    Every rank r runs the trainer side on its own inputs (seed + r) and backs the loss
    through FSDP2, whose reduce-scatter averages the ranks' gradients at the reduce dtype and
    stores them in fp32. The reference is the same step unsharded, in this process: each
    rank's inputs through `master_gradients` (fp32 reduce), averaged in fp32. At one rank and
    fp32 reduce the two are the same arithmetic; at two ranks the fp32 sum of two ranks is
    exact whatever the order, so only a coarser reduce dtype should move the gradients.

    Args:
        family_name: One of `lab.families()`.
        preset: "tiny", "reduced" or "full".
        nproc: FSDP2 ranks (gloo on CPU, NCCL on GPU).
        device: "cpu" or "cuda".
        reduce_dtypes: The reduce dtypes to run (one job each, one launch for all).
        seed: Weight seed; rank r's inputs use seed + r.
        sigma: The step's sigma.
        batch: Samples per rank.
        trainer: The side run under FSDP2; default `Side.trainer(family)`.
        loss: Default `LogProbLoss(family_name, sigma_prev=sigma - 0.1, seed=seed)`.
        timeout_s: Wall-clock limit for the launch (every rank is ended past it).

    Returns:
        "reduce <dtype>" -> GradientResult (unsharded reference first, FSDP2 second); its
        meta["emulation"] summarises FSDP2 against the same reduce emulated in process
        (`mean_gradients(per_rank, reduce_dtype)`), bit-exact when the emulation is exact.

    Raises:
        ValueError: Bad arguments (see `run_fsdp2_forwards`), or a bad reduce dtype name.
    """
    from lab.families import family as get_family

    fam = get_family(family_name)
    trainer = trainer or Side.trainer(fam, device=device)
    loss = loss or LogProbLoss(family_name=family_name, sigma_prev=sigma - 0.1, seed=seed)
    jobs = [
        Fsdp2Job(
            family_name=family_name,
            side=trainer.replace(name=f"fsdp2_reduce_{name}", reduce_dtype=name),
            preset=preset,
            seed=seed,
            batch=batch,
            sigma=sigma,
            capture_depth=0,
            loss=loss,
            data_parallel=True,
        )
        for name in reduce_dtypes
    ]
    captures = run_fsdp2_forwards(jobs, nproc=nproc, device=device, timeout_s=timeout_s)
    model, _ = jobs[0].build(device)
    reference_side = trainer.replace(name="unsharded", reduce_dtype="fp32")
    with _rank_threads(device):
        per_rank = [
            master_gradients(model, jobs[0].build(device, rank)[1], reference_side, loss)
            for rank in range(nproc)
        ]
    reference = mean_gradients(per_rank)
    out = {}
    for job, capture in zip(jobs, captures, strict=True):
        meta = {k: v for k, v in capture.meta.items() if k != "module_classes"}
        fsdp2 = SideGradients(
            job.side.to_dict(),
            capture.grads or {},
            reference.compute_dtypes,
            capture.meta["loss"],
            {"runtime": "fsdp2", "reduce_dtype": job.side.reduce_dtype, **meta},
        )
        # The same reduce emulated in process: cast, sum in rank order, divide, cast back.
        emulated = mean_gradients(per_rank, job.side.reduce_dtype)
        run_meta = dict(
            family=family_name,
            preset=preset,
            seed=seed,
            sigma=sigma,
            nproc=nproc,
            emulation=pair_gradients(emulated, fsdp2).summary(),
        )
        out[f"reduce {job.side.reduce_dtype}"] = pair_gradients(reference, fsdp2, meta=run_meta)
    return out


@contextlib.contextmanager
def _rank_threads(device: str) -> Iterator[None]:
    """Run CPU kernels at the ranks' thread count while computing a bitwise reference.

    Forward kernels give the same bits at any thread count, but some backward reductions
    (layer_norm's weight gradient) split the sum per thread.
    """
    if device != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", _RANK_THREADS)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- both sides sharded ----------------------------------------------------------------------


@checked_arguments
def pair_sharded(
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    nproc: int = 2,
    device: DeviceName = "cuda",
    capture_depth: int | None = 1,
    seed: int = 0,
    sigma: float = 0.75,
    batch: int = 1,
    variant: str | None = None,
    rollout: Side | None = None,
    trainer: Side | None = None,
    timeout_s: float = 600.0,
) -> Result:
    """Pair the rollout and trainer sides with BOTH run sharded under FSDP2 across `nproc` ranks.

    For models whose two sides do not fit on one device (Qwen-Image full: 20 B parameters, 80 GB
    of fp32 master; MiniMax H3 full: 33 B, 123.4 GiB). Each side is one job of one launch: every
    rank builds only its rows of the seeded fp32 model (`Fsdp2Job.build_shard`, so a rank holds
    1/nproc of the master), shards it (one fully_shard per block, then the root) and runs the
    side's forward; rank 0 captures the module outputs (block level by default, to bound memory)
    and moves them to the CPU; the parent pairs them with `pair_leaves`, on `device`.

    The rollout side as FSDP2: the fp32 master is sharded and each block is gathered at
    param_dtype = the rollout dtype, with no autocast and the engine's input policy. Where
    the in-process rollout side (`Side.rollout`, a WeightView) has semantics FSDP2 lacks, they
    are emulated exactly or refused (`express_engine_load`):
      - keep_fp32_modules (engine load keeps named modules fp32) -> param_dtype_rules,
        checked to give every parameter the same dtype as the in-process plan, else refused;
      - cast_buffers (the engine holds persistent buffers at its dtype) -> those buffers are
        cast in place before sharding (FSDP2 replicates buffers and never casts them);
      - engine_ops / op_switches (rounding-point patches matched by class name) -> installed
        before fully_shard renames the classes, and the input switches applied as usual.
    What stays different from a real engine is what the in-process rollout side does not
    model either: the engine's own loader and fused kernels. Gathering a shard is a copy, so
    the gathered bf16 weights are bitwise the engine's resident cast of the same master.

    Args:
        family_name: One of `lab.families()`.
        preset: "tiny", "reduced" or "full".
        nproc: Ranks (gloo on CPU, NCCL on GPU, one GPU each).
        device: "cuda" or "cpu".
        capture_depth: Capture only modules this many levels deep (1 = every block's output;
            None = every module, which at full size may not fit in host memory).
        seed: Weight and input seed.
        sigma: The step's sigma (also picks the expert of MoE families).
        batch: Samples per forward.
        variant: A named variant of the family (e.g. sd3's "large").
        rollout: Reference side; default `Side.rollout(family)`.
        trainer: Candidate side; default `Side.trainer(family)`.
        timeout_s: Wall-clock limit for the launch.

    Returns:
        A Result like `lab.pair`'s (rollout first, trainer second, propagated), with both
        jobs' FSDP2 plans, seconds and per-rank peak memory in meta["fsdp2_a"/"fsdp2_b"].

    Raises:
        ValueError: Bad arguments, or a side FSDP2 cannot express.
        ShardedPairError: A rank failed or the launch timed out (a `PairError`): `err.result`
            pairs what both sides captured before the failure (None where the rollout side
            did not finish), `err.captures` keeps both jobs' captures, whole or partial,
            `err.side`/`err.module` say where it failed, `err.rank`/`err.traceback` which rank
            raised and how.
        Fsdp2Interrupted: Ctrl-C or SIGTERM (a KeyboardInterrupt): every rank ended;
            `err.result` pairs what both sides had captured (as on a failure), `err.captures`.
    """
    jobs = sharded_jobs(
        family_name,
        preset,
        device=device,
        capture_depth=capture_depth,
        seed=seed,
        sigma=sigma,
        batch=batch,
        variant=variant,
        rollout=rollout,
        trainer=trainer,
    )
    start = time.perf_counter()
    try:
        capture_a, capture_b = run_fsdp2_forwards(
            jobs, nproc=nproc, device=device, timeout_s=timeout_s
        )
    except (Fsdp2LaunchError, Fsdp2Interrupted) as err:
        a, b = (*err.captures, None, None)[:2]
        partial = None
        if a is not None and not a.meta.get("partial") and b is not None:
            partial = pair_sharded_captures(_reached(a, b), b)
        if isinstance(err, Fsdp2Interrupted):
            err.result = partial
            raise
        raise _launch_failure("pair_sharded", err, jobs, partial) from err
    result = pair_sharded_captures(capture_a, capture_b)
    result.meta["timings_s"]["launch_s"] = time.perf_counter() - start
    return result


def _reached(capture: Fsdp2Capture, other: Fsdp2Capture) -> Fsdp2Capture:
    """`capture` with only the outputs `other` reached, when `other` stopped part-way.

    A side that failed captured its outputs up to the failure; the other side's later outputs
    were never compared, not "only on" that side.
    """
    if not other.meta.get("partial"):
        return capture
    reached = {(m, c, o) for m, c, o, _ in other.leaves}
    leaves = [leaf for leaf in capture.leaves if leaf[:3] in reached]
    return Fsdp2Capture(job=capture.job, leaves=leaves, meta=capture.meta, grads=capture.grads)


def _launch_failure(
    caller: str, err: Fsdp2LaunchError, jobs: Sequence[Fsdp2Job], partial: Result | None
) -> ShardedPairError:
    """The `ShardedPairError` of a failed launch: where it failed, what was kept."""
    captures = (*err.captures, *[None] * len(jobs))[: len(jobs)]
    finished = all(c is not None and not c.meta.get("failed") for c in captures)
    job = getattr(err, "job", None)
    if job is None and not finished:  # a timeout: the first job that did not finish was running
        job = next((i for i, c in enumerate(captures) if c is None or c.meta.get("partial")), None)
    side = jobs[job].side.name if job is not None and job < len(jobs) else None
    module = getattr(err, "module", None)
    return ShardedPairError(
        (
            f"{caller}: every job finished and the launch failed after them"
            if finished
            else f"{caller}: side {side!r} failed under FSDP2"
        )
        + (f", in module {module!r} ({getattr(err, 'module_class', None)})" if module else "")
        + (
            f"; the {len(partial.rows)} pair(s) compared before the failure are in err.result"
            if partial is not None
            else "; nothing could be paired (err.result is None)"
        )
        + f"; the ranks' captures ({_kept_text(jobs, captures)}) are in err.captures.\n{err}",
        partial,
        err,
        side=side,
    )


@checked_arguments
def sharded_jobs(
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    device: DeviceName = "cuda",
    capture_depth: int | None = 1,
    seed: int = 0,
    sigma: float = 0.75,
    batch: int = 1,
    variant: str | None = None,
    rollout: Side | None = None,
    trainer: Side | None = None,
) -> list[Fsdp2Job]:
    """The two jobs of `pair_sharded` (rollout, trainer), to batch several in one launch."""
    from lab.families import family as get_family

    fam = get_family(family_name)
    rollout = rollout or Side.rollout(fam, device=device)
    trainer = trainer or Side.trainer(fam, device=device)
    common = dict(
        family_name=family_name,
        preset=preset,
        seed=seed,
        batch=batch,
        sigma=sigma,
        capture_depth=capture_depth,
        variant=variant,
    )
    return [
        Fsdp2Job(side=rollout, emulate_engine_load=True, **common),
        Fsdp2Job(side=trainer, **common),
    ]


@checked_arguments
def pair_sharded_captures(capture_a: Fsdp2Capture, capture_b: Fsdp2Capture) -> Result:
    """Pair two sharded captures (the jobs of `sharded_jobs`) on their ranks' device type."""
    from lab.families import family as get_family

    job = capture_a.job
    family_name, preset, seed, sigma = job.family_name, job.preset, job.seed, job.sigma
    batch, capture_depth = job.batch, job.capture_depth
    rollout, trainer = job.side, capture_b.job.side
    device = capture_a.meta["device"].split(":")[0]
    fam = get_family(family_name)
    classes = capture_a.meta["module_classes"]
    start = time.perf_counter()
    pair_device = torch.device("cuda" if device == "cuda" else "cpu")
    rows, skipped = pair_leaves(
        _leaves_on(capture_a.leaves, pair_device),
        _leaves_on(capture_b.leaves, pair_device),
        classes,
        rollout.name,
        trainer.name,
    )
    pair_s = time.perf_counter() - start

    def job_meta(capture: Fsdp2Capture) -> dict[str, Any]:
        return {k: v for k, v in capture.meta.items() if k != "module_classes"}

    meta = dict(
        family=family_name,
        preset=preset,
        variant=job.variant,
        seed=seed,
        sigma=sigma,
        batch=batch,
        expert=fam.expert_for_sigma(sigma),
        device=device,
        capture_depth=capture_depth,
        runtime_a="fsdp2",
        runtime_b="fsdp2",
        autocast_policy_a=rollout.resolved_autocast_policy,
        autocast_policy_b=trainer.resolved_autocast_policy,
        fsdp2_a=job_meta(capture_a),
        fsdp2_b=job_meta(capture_b),
        timings_s={
            "a_s": capture_a.meta["forward_s"],
            "b_s": capture_b.meta["forward_s"],
            "pair_s": pair_s,
        },
    )
    return Result("propagated", rollout.to_dict(), trainer.to_dict(), rows, skipped, meta)


def sharded_ranks_table(result: Result) -> Any:
    """What each side's FSDP2 job of a sharded pair took, a row per side (pandas DataFrame).

    Columns: side, ranks, backend, build_s (the rank's rows: `Fsdp2Job.build_shard`), shard_s
    (fully_shard on meta, then the rows loaded), forward_s (rank 0's clocks; every rank runs
    the same steps), then peak_gib_rank0, peak_gib_rank1, ... (each rank's peak GPU memory;
    absent on a CPU).

    Raises:
        ValueError: `result` is not from `pair_sharded` (no meta["fsdp2_a"/"fsdp2_b"]).
    """
    import pandas as pd

    meta = result.meta
    if "fsdp2_a" not in meta or "fsdp2_b" not in meta:
        raise ValueError(
            "sharded_ranks_table: this Result has no meta['fsdp2_a'] / meta['fsdp2_b']; pass "
            "one from lab.fsdp.pair_sharded (or pair_sharded_captures)."
        )
    rows = []
    for key, side in (("fsdp2_a", result.side_a), ("fsdp2_b", result.side_b)):
        job = meta[key]
        row = {
            "side": side.get("name", key[-1]),
            "ranks": job["world_size"],
            "backend": job["backend"],
            "build_s": job.get("build_s"),
            "shard_s": job.get("shard_s"),
            "forward_s": job.get("forward_s"),
        }
        for rank, peak in enumerate(job.get("peak_memory_gib_per_rank") or []):
            if peak is not None:  # measured on GPUs only
                row[f"peak_gib_rank{rank}"] = peak
        rows.append(row)
    return pd.DataFrame(rows)


def _leaves_on(
    leaves: list[tuple[str, int, str, Any]], device: torch.device
) -> list[tuple[str, int, str, Any]]:
    return [(m, c, o, v.to(device) if isinstance(v, torch.Tensor) else v) for m, c, o, v in leaves]


# ---- the rank entry point -------------------------------------------------------------------


def _store_client(world: int | None, timeout: Any) -> Any:
    """A client of the parent's store (bound to 127.0.0.1): no rank opens a listening store."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout
    )


def _run_rank(spec_path: Path, out_dir: Path) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    spec = json.loads(spec_path.read_text())
    if spec["device"] == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _store_client(world, datetime.timedelta(minutes=30))
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        device_id=device if backend == "nccl" else None,
    )
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            threading.Thread(target=_watch_for_abort, name="lab-abort", daemon=True).start()
        mesh = init_device_mesh(device.type, (world,))
        for index, data in enumerate(spec["jobs"]):
            job = Fsdp2Job.from_dict(data)
            partial = out_dir / f"job{index}.partial.pt"
            # `live` holds rank 0's forward in progress until the job returns or raises.
            with contextlib.ExitStack() as live:
                try:
                    saved = _run_rank_job(job, device, mesh, rank, world, backend, partial, live)
                except BaseException as err:
                    _failing(err)
                    _mark(err, job=index)
                    where = getattr(err, _WHERE, {})
                    _write_partial({"module": where.get("module"),
                                    "module_class": where.get("module_class"),
                                    "error": f"{type(err).__name__}: {err}"})  # fmt: skip
                    raise
            if rank == 0:
                # Whole or not at all, and not cut off by the watcher's exit (it takes the lock).
                with _LIVE_LOCK:
                    _save_atomic(saved, out_dir / f"job{index}.pt")
        dist.barrier()
    except BaseException as err:
        _failing(err)
        # Now: on NCCL, destroy_process_group can wait for good on a peer that died.
        _write_rank_error(out_dir, err)
        raise
    finally:
        dist.destroy_process_group()


_LIVE: dict[str, Any] = {}
"""Rank 0's forward in progress: where its partial capture goes, its outputs so far, its meta."""
_LIVE_LOCK = threading.Lock()
ABORT_KEY = "lab/abort"
"""The store key the parent sets when a launch failed: rank 0 saves what its forward captured."""
_ABORTED = 3
"""Rank 0's exit code after it saved its partial capture on the parent's word."""
_OWN_FAILURE = threading.Event()
"""Set as soon as this rank's own job raised: the watcher then leaves the exit to it."""


def _failing(err: BaseException) -> None:
    """This rank's job raised `err`: note when (first-come) and keep the watcher's hands off."""
    _OWN_FAILURE.set()
    _mark(err, raised_at=time.time())


def _save_atomic(obj: Any, path: Path) -> None:
    """`torch.save` to a temporary name beside `path`, then renamed: never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@contextlib.contextmanager
def _live_capture(
    path: Path | None, leaves: list[Any], meta: Callable[[], dict[str, Any]]
) -> Iterator[None]:
    """While rank 0 runs a forward, what `_write_partial` saves if the forward never finishes."""
    if path is None:
        yield
        return
    with _LIVE_LOCK:
        _LIVE.update(path=path, leaves=leaves, meta=meta)
    try:
        yield
    finally:
        with _LIVE_LOCK:
            _LIVE.clear()


def _forward_done() -> None:
    """Rank 0's forward finished: what `_write_partial` saves from here on is its whole capture."""
    with _LIVE_LOCK:
        if _LIVE:
            _LIVE["done"] = True


def _write_partial(failed: dict[str, Any]) -> None:
    """Save rank 0's forward as a capture: partial, or whole once the forward finished.

    Once a job; a no-op on other ranks and before the forward starts. Called by the job's
    own exception, and by `_watch_for_abort` when the parent says the launch failed while this
    rank is stuck (an NCCL collective whose peer died never returns).
    """
    with _LIVE_LOCK:
        _write_partial_locked(failed)


def _write_partial_locked(failed: dict[str, Any]) -> None:
    """`_write_partial` with `_LIVE_LOCK` held by the caller."""
    path = _LIVE.get("path")
    if path is None or path.exists():
        return
    meta = {**_LIVE["meta"](), "partial": not _LIVE.get("done"), "failed": failed}
    with contextlib.suppress(Exception):  # the rank's own error goes first
        _save_atomic({"leaves": list(_LIVE["leaves"]), "meta": meta}, path)


def _watch_for_abort() -> None:
    """Rank 0's watcher thread: save the forward's outputs when the parent says it failed.

    When the parent sets ABORT_KEY, `_write_partial`, then end the process (`_ABORTED`).
    """
    import datetime

    store = _store_client(None, datetime.timedelta(seconds=60))
    while not store.check([ABORT_KEY]):
        time.sleep(0.1)
    why = store.get(ABORT_KEY).decode()
    # Under the lock: a capture being saved is saved whole before the process ends.
    with _LIVE_LOCK:
        if _OWN_FAILURE.is_set():
            return  # this rank failed itself: it writes its error and exits on its own
        _write_partial_locked({"module": None, "module_class": None, "error": f"ended: {why}"})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_ABORTED)


_WHERE = "_lab_fsdp2_where"
"""The attribute of a rank's exception that says where it was raised (job, module)."""


def _mark(err: BaseException, **where: Any) -> None:
    """Note where `err` was raised on it (kept first-come: the innermost place wins)."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(err, _WHERE, {**where, **getattr(err, _WHERE, {})})


def _run_rank_job(
    job: Fsdp2Job,
    device: torch.device,
    mesh: Any,
    rank: int,
    world: int,
    backend: str,
    partial: Path,
    live: contextlib.ExitStack,
) -> dict[str, Any]:
    """One job on one rank: build, shard, forward (rank 0 captures), backward if asked.

    Once the forward starts, rank 0 enters its outputs so far into `live` (`_live_capture`):
    where the job then fails, `_write_partial` saves them to `partial` (partial, or whole
    where the forward had finished and a later step failed).
    """
    import torch.distributed as dist

    from lab.families import family as get_family
    from lab.pairing.side_context import side_context, side_inputs
    from lab.precision.engine_ops import ops_applied

    _injected_fault(rank)
    fam = get_family(job.family_name)
    seconds: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model, shard, build = _rank_model(job, device, rank, world)
    inputs = job.inputs(device, rank)
    module_classes = {(n or ROOT): type(m).__name__ for n, m in model.named_modules()}
    seconds["build_s"] = _elapsed(start, device)
    side = job.side
    if job.emulate_engine_load:
        side, buffer_dtypes = express_engine_load(model, job.side)
        _cast_buffers(model, buffer_dtypes, job.side)
    leaves: list[tuple[str, int, str, Any]] = []
    names_filter = depth_filter(job.capture_depth) if job.capture_depth is not None else None
    on_output = _capture_into(leaves) if rank == 0 else (lambda *a: None)
    loss_value = None
    # Engine ops match modules by class name, and fully_shard renames every sharded class
    # (FSDP<Class>): install them first; the instance-level forwards survive the rename.
    with ops_applied(model, job.side.engine_ops, job.side.op_switches):
        start = time.perf_counter()
        plan = apply_fsdp2(model, fam, side, mesh)
        if shard is not None:
            load_shards(model, shard.rows, device)
        seconds["shard_s"] = _elapsed(start, device)
        cast = side_inputs(inputs, job.side, device)
        grad_mode = torch.enable_grad() if job.loss is not None else torch.no_grad()
        start = time.perf_counter()

        def partial_meta() -> dict[str, Any]:
            return {"world_size": world, "backend": backend, "device": str(device),
                    "plan": plan.summary(), **seconds,
                    "forward_s": seconds.get("forward_s", time.perf_counter() - start),
                    "build": build, "module_classes": module_classes}  # fmt: skip

        # From here on rank 0 keeps what its forward captured whatever happens (`_write_partial`).
        live.enter_context(_live_capture(partial if rank == 0 else None, leaves, partial_meta))
        with grad_mode:
            try:
                with (
                    ModuleHooks(model, on_output, names_filter=names_filter).attached(),
                    side_context(job.side, device),
                    _forward_fault(model, rank, job),
                ):
                    output = model(**cast.kwargs)
            except BaseException as err:
                from lab.pairing.guards import failing_module

                # Where it failed, for the error record and the partial capture (`_run_rank`).
                where = failing_module(err, model)
                if where is not None:  # the class's own name, not FSDP2's FSDP<Class>
                    _mark(err, module=where[0], module_class=module_classes.get(*where))
                raise
            seconds["forward_s"] = _elapsed(start, device)
            _forward_done()  # its capture is whole now, whatever fails after
            if job.loss is not None:
                # Loss and backward outside autocast, as master_gradients runs them.
                value = job.loss(output, inputs)
                start = time.perf_counter()
                value.backward()
                seconds["backward_s"] = _elapsed(start, device)
                total = value.detach().reshape(1).clone()
                dist.all_reduce(total)
                loss_value = float(total) / world
        del output
    grads = _gather_grads(model, rank) if job.loss is not None else None
    peaks: list[Any] = [None] * world
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    dist.all_gather_object(peaks, peak)
    del model
    meta = {
        "world_size": world,
        "backend": backend,
        "device": str(device),
        "plan": plan.summary(),
        **seconds,
        "peak_memory_gib_per_rank": peaks,
        "loss": loss_value,
        "patch_applied": is_param_dtype_map_patch_applied(),
        "build": build,
        "torch": str(torch.__version__),
        "module_classes": module_classes,
    }
    return {"leaves": leaves, "meta": meta, "grads": grads}


def _rank_model(
    job: Fsdp2Job, device: torch.device, rank: int, world: int
) -> tuple[torch.nn.Module, ShardBuild | None, str]:
    """The rank's model before sharding: (model, its rows or None, how it was built).

    By default only the rank's rows (`Fsdp2Job.build_shard`: meta parameters, rows beside),
    checked to be rank 0's draws. Where the class cannot be built in rows (`ShardBuildError`:
    the same on every rank) or `$LAB_FSDP2_BUILD` is "whole", the whole seeded model, with
    rank 0's weights broadcast so every rank shards identical ones; the third item then says
    why ("whole: ...").
    """
    import torch.distributed as dist

    from lab.families.shards import ShardBuildError

    if build_mode() == "rows":
        try:
            shard = job.build_shard(device, rank, world)
        except ShardBuildError as err:
            why = f"whole: {err}"
        else:
            if world > 1:
                _check_same_draws(shard, world)
            return shard.model, shard, "rows"
    else:
        why = f"whole: {BUILD_ENV}=whole"
    model = job.model(device)
    if world > 1:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
    return model, None, why


def _check_same_draws(shard: ShardBuild, world: int) -> None:
    """Every rank drew the same seeded model (each builds its own rows from the same seed).

    Compares each parameter's float64 sum as the class drew it with rank 0's.

    Raises:
        RuntimeError: Naming the first rank and parameter that differ.
    """
    import torch.distributed as dist

    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, shard.digests)
    names = list(shard.rows)
    ours = digests[0].view(torch.int64)  # bits: a NaN sum equals itself
    for rank, theirs in enumerate(digests):
        if not torch.equal(theirs.view(torch.int64), ours):
            first = int((theirs.view(torch.int64) != ours).nonzero()[0])
            raise RuntimeError(
                f"rank {rank} drew other seeded weights than rank 0 for {names[first]!r} "
                f"(sum {float(theirs[first])!r} vs {float(digests[0][first])!r}): the ranks' "
                "devices give different random draws (different GPU models?). Run every rank "
                "on the same kind of device."
            )


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _gather_grads(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor | None]:
    """Full gradients on rank 0 (every rank joins each all-gather, in the same order)."""
    grads: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        g = p.grad
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        if rank == 0:
            grads[name] = None if full is None else full.detach().to("cpu", copy=True)
    return grads


def _cast_buffers(
    model: torch.nn.Module, buffer_dtypes: dict[str, torch.dtype], side: Side
) -> None:
    """Cast buffers in place as the side's WeightView would (master dtype first)."""
    master = side.master_torch_dtype
    modules = dict(model.named_modules())
    for full, dtype in buffer_dtypes.items():
        owner, _, name = full.rpartition(".")
        module = modules[owner]
        module._buffers[name] = module._buffers[name].to(master).to(dtype)


_Fault = tuple[str, int, str | None, str | None]
"""(kind, rank, side, module) of one LAB_FSDP2_FAULT entry."""


def _faults() -> list[_Fault]:
    """LAB_FSDP2_FAULT parsed: its comma-separated entries, each (kind, rank, side, module).

    "raise@R" / "hang@R": rank R raises (hangs) as each job starts; "raise@R:SIDE:MODULE" /
    "hang@R:SIDE:MODULE": rank R raises (hangs) in the forward of the job whose side is named
    SIDE, as module MODULE (its `named_modules()` path) starts. Tests fail a rank part-way
    through a forward with it, or stall one as a rank stuck in an NCCL collective would be.
    """
    value = os.environ.get(_FAULT_ENV, "")
    faults = []
    for entry in filter(None, value.split(",")):
        kind, _, target = entry.partition("@")
        rank, *place = target.split(":", 2)
        if kind not in ("raise", "hang") or not rank.isdigit() or len(place) not in (0, 2):
            raise ValueError(
                f"{_FAULT_ENV}={value!r}: expected entries 'raise@RANK', 'hang@RANK', "
                "'raise@RANK:SIDE:MODULE' or 'hang@RANK:SIDE:MODULE', comma-separated."
            )
        side, module = place if place else (None, None)
        faults.append((kind, int(rank), side, module))
    return faults


def _hang(rank: int) -> None:
    """Sleep for good (a test's stalled rank), leaving a file that says so."""
    Path(os.environ.get("TMPDIR", "."), f"hang{rank}").write_text("hanging")
    while True:
        time.sleep(60)


def _injected_fault(rank: int) -> None:
    """Honour LAB_FSDP2_FAULT's "raise@R" and "hang@R" entries as a job starts on rank R."""
    for kind, target, side, _ in _faults():
        if side is not None or target != rank:
            continue
        if kind == "raise":
            raise RuntimeError(
                f"injected fault in rank {rank} ({_FAULT_ENV}={os.environ[_FAULT_ENV]!r})"
            )
        _hang(rank)


@contextlib.contextmanager
def _forward_fault(model: torch.nn.Module, rank: int, job: Fsdp2Job) -> Iterator[None]:
    """Raise (hang) as a module's forward starts: this rank's "raise@R:SIDE:MODULE" entries.

    And "hang@R:SIDE:MODULE" (LAB_FSDP2_FAULT, `_faults`).
    """
    mine = [f for f in _faults() if f[1] == rank and f[2] == job.side.name]
    modules = dict(model.named_modules())
    unknown = [name for _, _, _, name in mine if name not in modules]
    if unknown:
        raise ValueError(f"{_FAULT_ENV}: no module {unknown[0]!r} in {job.family_name}.")
    handles = []
    for kind, _, _, name in mine:

        def fault(module: torch.nn.Module, args: Any, kind: str = kind, name: str = name) -> None:
            if kind == "hang":
                _hang(rank)
            raise RuntimeError(
                f"injected fault in rank {rank}, side {job.side.name!r}, module {name!r} "
                f"({_FAULT_ENV}={os.environ[_FAULT_ENV]!r})"
            )

        handles.append(modules[name].register_forward_pre_hook(fault))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _write_rank_error(out_dir: Path, err: BaseException) -> None:
    """Leave this rank's exception for the parent (`_rank_failure` picks the earliest).

    Written once (the first call wins: `_run_rank` writes it before tearing the process group
    down, `main` for what failed outside it), stamped with when it was raised (`_failing`).
    """
    import traceback

    where = dict(getattr(err, _WHERE, {}))
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "type": type(err).__name__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(err)),
        "time": where.pop("raised_at", time.time()),
        # The job it was running and the module whose forward raised (`_run_rank`).
        **where,
    }
    path = out_dir / f"rank{rank}.error.json"
    if path.exists():
        return
    with contextlib.suppress(OSError):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> None:
    """Rank entry point: `python -m lab.engine.fsdp --spec S --out D` (see `_launch_ranks`)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        _run_rank(args.spec, args.out)
    except BaseException as err:
        _write_rank_error(args.out, err)
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # The work is done and its files are written; skip the interpreter teardown. Seen in CI on
    # 2 CPU cores: a gloo rank occasionally aborted at exit ("terminate called without an
    # active exception", exit -6) after destroy_process_group, failing a launch that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

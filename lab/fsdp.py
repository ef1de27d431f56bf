"""The trainer side under real FSDP2: apply_fsdp2, torchrun ranks, and pairing their capture.

`apply_fsdp2` shards a family model the way the trainer does (one `fully_shard` per no-split
block, then the root). `run_fsdp2_forwards` launches `python -m torch.distributed.run` with N
ranks (gloo on CPU, NCCL on GPU); each rank builds the same seeded model and inputs, shards it
and runs the side's forward; rank 0 captures every module output and writes it to a file.
`pair_capture` pairs such a capture against an in-process side in the parent and returns the
usual `Result`. `pair_fsdp2` does all of it for one family.

Run as a module (`-m lab.fsdp --spec SPEC --out DIR`) this file is the rank entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.capture import ROOT, ModuleHooks, depth_filter, flatten_output
from lab.families import Family, Inputs
from lab.pairing import pair_leaves
from lab.precision.dtypes import dtype_name, parse_dtype
from lab.precision.fsdp2_patch import (
    ParamDtypeMixedPrecisionPolicy,
    apply_param_dtype_map_patch,
    is_param_dtype_map_patch_applied,
)
from lab.precision.input_policy import apply_input_dtype_policy
from lab.precision.param_rules import ParamDtypeMaps, block_wraps, compile_param_dtype_maps
from lab.result import Result
from lab.sides import Side

__all__ = [
    "Fsdp2Capture",
    "Fsdp2Job",
    "Fsdp2Plan",
    "ParamDtypeMixedPrecisionPolicy",
    "apply_fsdp2",
    "apply_param_dtype_map_patch",
    "pair_capture",
    "pair_fsdp2",
    "run_fsdp2_forwards",
]


# ---- sharding -------------------------------------------------------------------------------


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
    param_dtype = parse_dtype(side.resolved_param_dtype, where=f"Side({side.name!r}).param_dtype")
    reduce_dtype = parse_dtype(side.reduce_dtype, where=f"Side({side.name!r}).reduce_dtype")
    master = parse_dtype(side.master_dtype, where=f"Side({side.name!r}).master_dtype")
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


# ---- launching ranks ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Fsdp2Job:
    """One forward for the ranks to run: which model, which inputs, which side."""

    family_name: str
    side: Side
    preset: str = "tiny"
    seed: int = 0
    batch: int = 1
    cfg: bool = False
    sigma: float = 0.75
    variant: str | None = None
    capture_depth: int | None = None
    """Capture only modules this many levels deep (None: every module)."""

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
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fsdp2Job:
        """Inverse of `to_dict`."""
        return cls(**{**data, "side": Side.from_dict(data["side"])})

    def build(self, device: torch.device | str) -> tuple[torch.nn.Module, Inputs]:
        """The seeded model and inputs, exactly as the in-process pair would build them."""
        from lab.families import family as get_family

        fam = get_family(self.family_name)
        expert = fam.expert_for_sigma(self.sigma)
        model = fam.build(
            self.preset, self.seed, variant=self.variant, device=device, expert=expert
        )
        inputs = fam.make_inputs(
            self.preset,
            self.seed,
            self.batch,
            self.cfg,
            variant=self.variant,
            sigma=self.sigma,
            device=device,
        )
        return model, inputs


@dataclass
class Fsdp2Capture:
    """Rank 0's module outputs of one job, in forward completion order."""

    job: Fsdp2Job
    leaves: list[tuple[str, int, str, Any]]
    """(module path or ROOT, call index, output index path, CPU tensor or a type marker)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """World size, backend, device, the Fsdp2Plan summary, forward seconds."""


def run_fsdp2_forwards(
    jobs: Sequence[Fsdp2Job],
    *,
    nproc: int = 1,
    device: str = "cpu",
    timeout_s: float = 600.0,
    workdir: str | Path | None = None,
) -> list[Fsdp2Capture]:
    """Run each job's forward under real FSDP2 in `nproc` torchrun ranks (one launch for all).

    Ranks use gloo on CPU and NCCL on GPU (one GPU per rank). Every rank builds the same seeded
    model and inputs; rank 0's parameters are broadcast so every rank shards identical
    weights; every rank runs the forward (the collectives need all of them) and rank 0 writes
    its capture. CPU ranks run one thread each unless OMP_NUM_THREADS is set: the ranks share
    the cores, and the forward kernels used here give the same bits at any thread count
    (tests/test_fsdp2.py checks every family against a 2-thread in-process forward).

    Args:
        jobs: The forwards to run, in order.
        nproc: Ranks (1..N); on GPU at most the visible GPU count.
        device: "cpu" or "cuda".
        timeout_s: Wall-clock limit for the whole launch.
        workdir: Where the spec and captures go (default: a temporary directory, removed).

    Returns:
        One Fsdp2Capture per job, in order.

    Raises:
        ValueError: nproc < 1, no jobs, an unknown device, a job whose side names another
            device, or more ranks than GPUs.
        RuntimeError: A rank failed or the launch timed out (the rank output is quoted).
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
        from lab.devices import resolve_device

        resolve_device("cuda")
        if nproc > torch.cuda.device_count():
            raise ValueError(
                f"run_fsdp2_forwards: nproc={nproc} NCCL ranks need {nproc} GPUs; "
                f"{torch.cuda.device_count()} visible."
            )
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="lab-fsdp2-") as tmp:
            return run_fsdp2_forwards(
                jobs, nproc=nproc, device=device, timeout_s=timeout_s, workdir=tmp
            )
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {"device": device, "jobs": [j.to_dict() for j in jobs]}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",
        "--module",
        "lab.fsdp",
        "--spec",
        str(spec_path),
        "--out",
        str(workdir),
    ]
    env = {**os.environ, "PYTHONPATH": _repo_root() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # One thread per rank on CPU: the ranks share the cores, and oversubscription only slows.
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(
            f"run_fsdp2_forwards: the {nproc}-rank launch ran past {timeout_s:g} s. Use a "
            "smaller preset, fewer jobs, or a larger timeout_s."
        ) from err
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(
            f"run_fsdp2_forwards: the {nproc}-rank torchrun launch exited with "
            f"{proc.returncode}. Rank output (tail):\n{tail}"
        )
    captures = []
    for i, job in enumerate(jobs):
        saved = torch.load(workdir / f"job{i}.pt", weights_only=True)
        captures.append(Fsdp2Capture(job=job, leaves=saved["leaves"], meta=saved["meta"]))
    return captures


def _repo_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


# ---- pairing in the parent ------------------------------------------------------------------


def pair_capture(
    model: torch.nn.Module,
    inputs: Inputs,
    reference: Side,
    capture: Fsdp2Capture,
    *,
    meta: dict[str, Any] | None = None,
) -> Result:
    """Pair an in-process side's forward (reference) against an FSDP2 capture (candidate).

    The reference runs like one side of `lab.pair` (weights view, input policy, autocast,
    kernel), with the same names_filter as the capture; leaves are paired by exact
    (module, call, output) key. A key on one side only, or a pair that cannot be compared,
    becomes a Skipped.

    Returns:
        A Result with side_a = reference, side_b = the capture's side; rows in the
        reference's completion order.
    """
    from lab.run import check_side_device, side_context
    from lab.weights import WeightView

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    check_side_device(reference, device)
    job = capture.job
    names_filter = depth_filter(job.capture_depth) if job.capture_depth is not None else None
    view = WeightView(model, reference)
    cast = apply_input_dtype_policy(
        reference.input_dtype_policy, inputs.to(device), reference.forward_dtype
    )
    leaves_a: list[tuple[str, int, str, Any]] = []
    hooks = ModuleHooks(model, _capture_into(leaves_a), names_filter=names_filter)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with torch.no_grad(), hooks.attached(), view.applied(), side_context(reference, device):
            model(**cast.kwargs)
    finally:
        model.train(was_training)
    seconds_a = time.perf_counter() - start
    classes = {(n or ROOT): type(m).__name__ for n, m in model.named_modules()}
    rows, skipped = pair_leaves(leaves_a, capture.leaves, classes, reference.name, job.side.name)
    result_meta = {
        **(meta or {}),
        "device": str(device),
        "autocast_policy_a": reference.resolved_autocast_policy,
        "autocast_policy_b": job.side.resolved_autocast_policy,
        "runtime_b": "fsdp2",
        "fsdp2": capture.meta,
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


def pair_fsdp2(
    family_name: str,
    preset: str = "tiny",
    *,
    seed: int = 0,
    nproc: int = 1,
    device: str = "cpu",
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
        timeout_s: Wall-clock limit for the torchrun launch.

    Returns:
        The Result (reference first, FSDP2 trainer second), with the FSDP2 plan in
        meta["fsdp2"].
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
    (capture,) = run_fsdp2_forwards([job], nproc=nproc, device=device, timeout_s=timeout_s)
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
    return pair_capture(model, inputs, reference, capture, meta=meta)


# ---- the rank entry point -------------------------------------------------------------------


def _run_rank(spec_path: Path, out_dir: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lab.families import family as get_family
    from lab.run import side_context

    spec = json.loads(spec_path.read_text())
    if spec["device"] == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device.type, (world,))
        for index, data in enumerate(spec["jobs"]):
            job = Fsdp2Job.from_dict(data)
            fam = get_family(job.family_name)
            model, inputs = job.build(device)
            if world > 1:
                # Identical weights on every rank whatever the device's RNG did.
                with torch.no_grad():
                    for t in [*model.parameters(), *model.buffers()]:
                        dist.broadcast(t.data, src=0)
            plan = apply_fsdp2(model, fam, job.side, mesh)
            cast = apply_input_dtype_policy(
                job.side.input_dtype_policy, inputs, job.side.forward_dtype
            )
            leaves: list[tuple[str, int, str, Any]] = []
            names_filter = (
                depth_filter(job.capture_depth) if job.capture_depth is not None else None
            )
            on_output = _capture_into(leaves) if rank == 0 else (lambda *a: None)
            start = time.perf_counter()
            with (
                torch.no_grad(),
                ModuleHooks(model, on_output, names_filter=names_filter).attached(),
                side_context(job.side, device),
            ):
                model(**cast.kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            if rank == 0:
                meta = {
                    "world_size": world,
                    "backend": backend,
                    "device": str(device),
                    "plan": plan.summary(),
                    "forward_s": seconds,
                    "patch_applied": is_param_dtype_map_patch_applied(),
                    "torch": str(torch.__version__),
                }
                torch.save({"leaves": leaves, "meta": meta}, out_dir / f"job{index}.pt")
            del model
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    """Rank entry point: `python -m torch.distributed.run ... -m lab.fsdp --spec S --out D`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    _run_rank(args.spec, args.out)


if __name__ == "__main__":
    main()

"""One FSDP2 rank's rows of a seeded model, built without ever holding the whole model.

`Family.build` constructs the whole fp32 model on its device and then reshapes it
(`apply_init`). An FSDP2 rank that does that and shards after needs the whole master at once:
MiniMax H3 full is 123.4 GiB of fp32 parameters, and on two H200s rank 1 ran out of memory at
136 GiB building it (data/gpu/sharded_size_h200x2_b99d0e4.log).

`build_shard` makes the same model with the same random draws in the same order on the same
device, and keeps only what a rank holds. The class constructs itself as usual; each time a
finished submodule is registered on its parent (a global module-registration hook), its
parameters are cut to the rank's rows of dim 0 (FSDP2's chunk: rows [r*c, (r+1)*c) with c =
ceil(n / world)) and the parameter becomes a meta tensor of the whole shape. The family's
`init_weights` then runs on the rows, and the trained-like reshaping draws over each whole
parameter and keeps the rows (`init_rows`), so every row is bitwise the row `Family.build`
gives. A rank holds its rows plus, briefly, the submodule being built (MiniMax H3 full: 61.7 GiB
a rank on two GPUs, peak 62.6 GiB on the H200).

What it cannot replay it refuses (`ShardBuildError`), never guesses: any op on a parameter once
its submodule is registered (a write, a cast, a random fill, a buffer computed from it: a
dispatch mode watches while the class builds), tied parameters, 0-dim ones, ones made on meta.
`lab.fsdp`'s ranks then build the whole model instead. Each rank also keeps the float64 sum of
every parameter as the class drew it (`ShardBuild.digests`); `lab.fsdp` checks that every rank
drew the same.

`load_shards` then fills a model that `fully_shard` sharded on the meta device: module by module
it allocates the rank's local shards (`to_empty`) and copies the rows in, freeing each as it
goes, so the rows and the shards never coexist whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lab.families._trained_init import (
    _CHUNK,
    DEFAULT_INIT,
    INIT_ATTRIBUTE,
    _owned_parameters,
    init_rows,
)

if TYPE_CHECKING:
    from lab.families._family import Family


class ShardBuildError(RuntimeError):
    """A model `build_shard` cannot build in rows (what the class did, and which tensor)."""


def shard_rows(length: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, end) of a dim of `length` that FSDP2 gives `rank` of `world` (may be empty).

    FSDP2 chunks dim 0 as `torch.chunk` does: every chunk holds ceil(length / world) rows but
    the last non-empty one, and ranks past the end hold none.
    """
    chunk = -(-length // world)
    return min(rank * chunk, length), min((rank + 1) * chunk, length)


@dataclass
class _Kept:
    """One parameter as the keeper cut it."""

    param: torch.nn.Parameter
    rows: torch.Tensor
    shape: tuple[int, ...]
    start: int
    contiguous: bool


@dataclass
class ShardBuild:
    """One rank's seeded model: the structure on the meta device and the rank's rows."""

    model: torch.nn.Module
    """The model with every parameter a meta tensor of its whole shape; buffers are real."""
    rows: dict[str, torch.Tensor]
    """Parameter name -> the rank's rows of it, fp32, seeded and reshaped as `Family.build`."""
    rank: int
    world: int
    digests: torch.Tensor
    """float64 sum of every parameter as the class drew it (whole), in `rows` order."""
    held_bytes: dict[str, int] = field(default_factory=dict)
    """{"rows": bytes of the rows, "largest_module": the largest module's own parameters}."""


_WHOLE = "Build the whole model instead (lab.fsdp's ranks do so by themselves)."


def _digest(whole: torch.Tensor) -> torch.Tensor:
    """float64 sum of a tensor, in `_CHUNK` pieces (never a float64 copy of all of it)."""
    if not whole.is_contiguous():
        return whole.sum(dtype=torch.float64)
    flat = whole.reshape(-1)
    parts = [flat[i : i + _CHUNK].sum(dtype=torch.float64) for i in range(0, flat.numel(), _CHUNK)]
    return torch.stack(parts).sum() if parts else whole.new_zeros((), dtype=torch.float64)


class _NoOpsOnCut(TorchDispatchMode):
    """While the class builds: refuse any op that reads or writes a parameter already cut.

    A cut parameter is a meta tensor: an op on it computes nothing, and a random fill on it
    draws nothing, so every later draw would shift. Shape, dtype and device reads do not
    dispatch and stay allowed.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
                raise ShardBuildError(
                    f"build_shard: the class runs {func} on a parameter of a module it already "
                    "registered (a write, copy, cast or random fill after the module was built); "
                    f"its rows cannot replay that. {_WHOLE}"
                )
        return func(*args, **kwargs)


class _RowKeeper:
    """Cuts each finished submodule's parameters to a rank's rows while the class builds."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.kept: dict[int, _Kept] = {}
        self.digests: dict[int, torch.Tensor] = {}
        self.largest = 0

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Cut every submodule as it is registered on its parent, while the block runs."""
        register = torch.nn.modules.module.register_module_module_registration_hook
        handle = register(lambda parent, name, child: self.keep(child) if child else None)
        try:
            with _NoOpsOnCut():
                yield
        finally:
            handle.remove()

    def keep(self, module: torch.nn.Module) -> None:
        """Cut every parameter of `module` not cut yet (a finished module's are final)."""
        own = sum(p.numel() * 4 for p in module.parameters(recurse=False))
        self.largest = max(self.largest, own)
        for local, param in module.named_parameters():
            if id(param) in self.kept or param.device.type == "meta":
                continue
            if param.ndim == 0:
                raise ShardBuildError(
                    f"build_shard: {type(module).__name__}.{local} is a 0-dim parameter; FSDP2 "
                    f"shards dim 0, so it cannot be cut into rows. {_WHOLE}"
                )
            whole = param.detach()
            start, end = shard_rows(whole.shape[0], self.rank, self.world)
            self.digests[id(param)] = _digest(whole)
            rows = whole[start:end].clone()
            placeholder = torch.nn.Parameter(
                torch.empty(whole.shape, dtype=whole.dtype, device="meta"),
                requires_grad=param.requires_grad,
            )
            contiguous = whole.is_contiguous()
            del whole
            torch.utils.swap_tensors(param, placeholder)  # `param` is now the meta tensor
            del placeholder  # the whole values
            self.kept[id(param)] = _Kept(param, rows, tuple(param.shape), start, contiguous)

    def to_rows(self, model: torch.nn.Module) -> None:
        """Check every parameter was cut once, then make each one its rows.

        (Any op on a cut parameter while the class built was refused by `_NoOpsOnCut`.)
        """
        self.keep(model)  # the root's own parameters: final once the class returns
        what = type(model).__name__
        for name, buf in model.named_buffers():
            if buf.device.type == "meta":
                raise ShardBuildError(
                    f"build_shard: {what} holds buffer {name!r} on the meta device; it has no "
                    f"values to build. {_WHOLE}"
                )
        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        for key, held in names.items():
            if len(held) > 1:
                raise ShardBuildError(
                    f"build_shard: {what} ties parameters {' and '.join(map(repr, held))} (one "
                    f"tensor in two modules); a rank's rows of a tied tensor are not placed. "
                    f"{_WHOLE}"
                )
            if key not in self.kept:
                raise ShardBuildError(
                    f"build_shard: {what}'s parameter {held[0]!r} was not built by the class "
                    "in its modules (made from another parameter, or after the class returned); "
                    f"its rows cannot be cut. {_WHOLE}"
                )
        for kept in self.kept.values():
            swap = torch.nn.Parameter(kept.rows, requires_grad=kept.param.requires_grad)
            torch.utils.swap_tensors(kept.param, swap)
            kept.rows = kept.param.data


def build_shard(
    family: Family, preset: str, seed: int, *, rank: int, world: int, **build: Any
) -> ShardBuild:
    """Build rank `rank`'s rows of every parameter of `family.build(preset, seed, **build)`.

    Every row is bitwise the same row of the whole build on the same device (fp32: the whole
    build's compact master, if any, is exact, and FSDP2 upcasts it to fp32 anyway). Called as
    `Family.build_shard`.

    Args:
        family: The family.
        preset: As `Family.build`.
        seed: As `Family.build`.
        rank: This rank, 0 <= rank < world.
        world: The ranks the model is sharded over.
        **build: variant, expert, device and init, as `Family.build` takes them.

    Returns:
        The ShardBuild (meta structure, rows, digests).

    Raises:
        ValueError: Bad rank or world, a meta device, or what `Family.build` refuses.
        ShardBuildError: A class whose construction cannot be replayed in rows (named).
    """
    build = {"variant": None, "expert": None, "device": "cpu", "init": DEFAULT_INIT, **build}
    for what, value in (("world", world), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"build_shard: {what} must be an int, got {value!r}.")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"build_shard: need 0 <= rank < world with world >= 1, got rank={rank}, world={world}."
        )
    if torch.device(build["device"]).type == "meta":
        raise ValueError(
            "build_shard: device='meta' has no values to cut; build rows on 'cpu' or 'cuda' "
            "(a meta model for counting: Family.model_cls()(**config) under torch.device('meta'))."
        )
    keeper = _RowKeeper(rank, world)
    model, seed = family._construct(preset, seed, keeper=keeper, **build)
    init = build["init"]
    for name, param, owner in _owned_parameters(model):
        kept = keeper.kept[id(param)]
        init_rows(
            name,
            param.data,
            owner,
            seed,
            init,
            shape=kept.shape,
            start=kept.start,
            contiguous=kept.contiguous,
        )
    setattr(model, INIT_ATTRIBUTE, init)
    rows: dict[str, torch.Tensor] = {}
    digests = []
    for name, param in model.named_parameters():
        kept = keeper.kept[id(param)]
        rows[name] = kept.rows
        digests.append(keeper.digests[id(param)])
        meta = torch.nn.Parameter(
            torch.empty(kept.shape, dtype=kept.rows.dtype, device="meta"),
            requires_grad=param.requires_grad,
        )
        torch.utils.swap_tensors(param, meta)
    keeper.kept.clear()
    held = sum(r.numel() * r.element_size() for r in rows.values())
    return ShardBuild(
        model=model,
        rows=rows,
        rank=rank,
        world=world,
        digests=torch.stack(digests).cpu() if digests else torch.zeros(0, dtype=torch.float64),
        held_bytes={"rows": held, "largest_module": keeper.largest},
    )


def load_shards(
    model: torch.nn.Module, rows: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Fill a model `fully_shard` sharded on the meta device with a rank's rows, in place.

    Module by module: allocate its own parameters' local shards on `device` (`to_empty`,
    buffers kept), copy the rows in (cast to the shard's dtype, as FSDP2's master cast does)
    and drop them from `rows`. FSDP2 pads the shards at its lazy init.

    Raises:
        ShardBuildError: A shard whose shape is not the rows' (another world size or sharding),
            a parameter without rows, or rows without a parameter (named).
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for prefix, module in model.named_modules():
            own = [(n, p) for n, p in module._parameters.items() if p is not None]
            if not own or not all(p.device.type == "meta" for _, p in own):
                continue
            buffers = dict(module._buffers)
            module.to_empty(device=device, recurse=False)
            module._buffers.update(buffers)
            for local_name, param in module._parameters.items():
                if param is None:
                    continue
                name = f"{prefix}.{local_name}" if prefix else local_name
                if name not in rows:
                    raise ShardBuildError(f"load_shards: no rows for parameter {name!r}.")
                piece = rows.pop(name)
                local = param.to_local() if isinstance(param, DTensor) else param
                if tuple(local.shape) != tuple(piece.shape):
                    raise ShardBuildError(
                        f"load_shards: {name!r} shards to {tuple(local.shape)} on this rank but "
                        f"its rows are {tuple(piece.shape)}: rows built for another world size "
                        "or sharding."
                    )
                local.copy_(piece)
                del piece
    if rows:
        left = ", ".join(list(rows)[:3])
        raise ShardBuildError(f"load_shards: {len(rows)} rows have no parameter: {left}.")


def shard_bytes(model: torch.nn.Module, world: int) -> dict[str, int]:
    """What one rank of `world` holds building `model`'s rows (count on a meta build).

    Returns:
        {"rows": fp32 bytes of the largest rank's rows (rank 0's), "largest_module": fp32
        bytes of the largest module's own parameters (held whole while it is built),
        "buffers": bytes of the buffers}.
    """
    seen: set[int] = set()
    rows = largest = 0
    for module in model.modules():
        own = 0
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            own += param.numel() * 4
            if param.ndim:
                rows += shard_rows(param.shape[0], 0, world)[1] * math.prod(param.shape[1:]) * 4
        largest = max(largest, own)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"rows": rows, "largest_module": largest, "buffers": buffers}

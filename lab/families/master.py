"""The master a model holds: fp32, with each tensor exact at bf16 held at bf16 (compact).

Every side casts from the model's fp32 master. A checkpoint shipped in bf16 and upcast to
fp32 (before any optimizer step) carries no information below bf16, so holding such a tensor
at bf16 and upcasting it when a side needs fp32 gives bit-identical values at half the bytes:
MiniMax H3 full (33.1 B parameters) is 123.3 GiB as an fp32 master and 61.6 GiB compact,
which is what lets it pair on one H200.

Nothing is assumed: `compact_master` checks every parameter on its own (a bitwise
fp32 -> bf16 -> fp32 round trip on the int32 view, so a NaN whose payload bf16 cannot carry
counts as off the grid) and holds only the exact ones. It records what it did on the model as
`model.lab_master` (a `MasterRecord`) with a guard per held tensor (its data_ptr, dtype, shape
and device), so a later `model.to(...)`, `.bfloat16()` or a replaced `.data` is caught rather
than read as a master (`held_parameters`, `stale_held`). A later `load_state_dict` whose value
for a held parameter is off the bf16 grid (fp32 weights after optimizer steps) would be rounded
into the bf16 tensor; instead that parameter is upcast to fp32 first (exact), holds the loaded
value bit for bit, and a warning says how many were (`_hold_loads_exactly`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

MasterMode = Literal["auto", "fp32", "compact"]
MASTER_MODES: tuple[str, ...] = ("auto", "fp32", "compact")
"""build/load(master=...): "compact" holds exact tensors at bf16, "fp32" keeps every tensor
fp32, "auto" compacts the "full" preset and loaded checkpoints (where the bytes matter)."""
MASTER_ATTRIBUTE = "lab_master"
"""Attribute a compacted model carries: its `MasterRecord`."""
_HELD_HERE = "_lab_held"
"""Attribute of a module owning held parameters: the local names of those it owns."""
CHECK = "bitwise fp32->bf16->fp32 per tensor"
"""How each tensor was found exact (recorded in meta["master"]["check"])."""
_LOGICAL = torch.float32
_HELD = torch.bfloat16

Guard = tuple[int, torch.dtype, tuple[int, ...], str]
"""(data_ptr, dtype, shape, device) of a held tensor when it was compacted."""


@dataclass(frozen=True)
class MasterRecord:
    """What `compact_master` did to a model: which parameters it holds at a lower dtype."""

    logical: str
    """The dtype every parameter's value is in ("fp32"): what sides cast from."""
    held: Mapping[str, str]
    """Canonical parameter name -> dtype it is held at ("bf16"), for the exact ones."""
    kept: tuple[str, ...]
    """fp32 parameters off the bf16 grid, held fp32."""
    guards: Mapping[str, Guard]
    """Held parameter name -> its tensor's (data_ptr, dtype, shape, device) at compaction."""
    check: str = CHECK


def check_master_mode(master: str, *, where: str) -> MasterMode:
    """Validate a master mode name.

    Raises:
        ValueError: Anything but "auto", "fp32" or "compact", quoting it.
    """
    if isinstance(master, str) and master in MASTER_MODES:
        return master  # type: ignore[return-value]
    raise ValueError(
        f"{where}: unknown master {master!r}. Known: 'auto' (compact at the full preset and for "
        "checkpoints), 'fp32' (every tensor fp32) or 'compact' (each tensor exact at bf16 held "
        "at bf16, the rest fp32; results are bit-identical either way)."
    )


def canonical_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Each parameter once, under its first name (as `WeightView` names them)."""
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def exact_at_bf16(tensor: torch.Tensor) -> bool:
    """Whether an fp32 tensor survives fp32 -> bf16 -> fp32 bit for bit (on its own device)."""
    return _held_copy(tensor) is not None


def _held_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """`tensor` at bf16 when that is exact (compared on the int32 view), else None."""
    if tensor.dtype != _LOGICAL or tensor.device.type == "meta":
        return None
    held = tensor.to(_HELD)
    same = torch.equal(held.to(_LOGICAL).view(torch.int32), tensor.view(torch.int32))
    return held if same else None


def _guard(tensor: torch.Tensor) -> Guard:
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), str(tensor.device))


def compact_master(model: torch.nn.Module) -> MasterRecord:
    """Hold every fp32 parameter that is exact at bf16 at bf16; record it as `model.lab_master`.

    Per tensor, never assumed: a parameter is held at bf16 only when its fp32 -> bf16 -> fp32
    round trip is bitwise equal (int32 view). Each is converted and swapped in on its own, so
    the peak is the fp32 model plus one bf16 tensor. Buffers and non-fp32 parameters stay as
    they are. Calling it again keeps the tensors already held (their guards still match) and
    checks the rest; a held tensor whose guard no longer matches is refused (`stale_held`).

    Returns:
        The record (also set as `model.lab_master`).

    Raises:
        ValueError: A parameter the previous record held has changed since (see `stale_held`).
    """
    stale = stale_held(model)
    if stale:
        raise ValueError(f"compact_master: {_stale_words(model, stale)}")
    previous = getattr(model, MASTER_ATTRIBUTE, None)
    held: dict[str, str] = dict(previous.held) if previous is not None else {}
    guards: dict[str, Guard] = dict(previous.guards) if previous is not None else {}
    kept: list[str] = []
    with torch.no_grad():
        for name, p in canonical_parameters(model):
            if name in held or p.dtype != _LOGICAL or p.device.type == "meta":
                continue  # meta tensors (shape-only builds) have no value to check
            copy = _held_copy(p.data)
            if copy is None:
                kept.append(name)
                continue
            p.data = copy
            held[name] = "bf16"
            guards[name] = _guard(p.data)
    record = MasterRecord(logical="fp32", held=held, kept=tuple(kept), guards=guards)
    setattr(model, MASTER_ATTRIBUTE, record)
    _guard_loads(model, held)
    return record


def _guard_loads(model: torch.nn.Module, held: Mapping[str, str]) -> None:
    """Mark each module owning held parameters, and hook it (and the model) for state loads."""
    owners: dict[str, set[str]] = {}
    for name in held:
        path, _, local = name.rpartition(".")
        owners.setdefault(path, set()).add(local)
    for path, names in owners.items():
        module = model.get_submodule(path)
        setattr(module, _HELD_HERE, set(getattr(module, _HELD_HERE, set())) | names)
    for module in {id(m): m for m in [model, *(model.get_submodule(p) for p in owners)]}.values():
        if not getattr(module, "_lab_load_hooked", False):
            module.register_load_state_dict_pre_hook(_hold_loads_exactly)
            module._lab_load_hooked = True


def _hold_loads_exactly(
    module: torch.nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any
) -> None:
    """Before `load_state_dict` copies values into held (bf16) tensors: upcast those it cannot.

    `copy_` into a bf16 tensor rounds, so a loaded fp32 value off the bf16 grid would become
    its bf16 rounding while the record still says the model is an fp32 master. Each held
    parameter of `module`'s subtree whose incoming value bf16 cannot hold exactly is upcast to
    fp32 (exact) first, so the load stores it bit for bit; values on the grid stay compact.
    Runs on the model first (the whole state, before any copy), then on each owning module
    (a load of that module alone).
    """
    upcast: list[str] = []
    with torch.no_grad():
        for path, owner in module.named_modules():
            for local in getattr(owner, _HELD_HERE, ()):
                param = owner._parameters.get(local)
                key = f"{prefix}{path + '.' if path else ''}{local}"
                value = state_dict.get(key)
                if param is None or param.dtype != _HELD or not isinstance(value, torch.Tensor):
                    continue
                if not value.is_floating_point() or value.shape != param.shape:
                    continue  # load_state_dict refuses these in its own words
                fp32 = value.detach().to(device=param.device, dtype=_LOGICAL)
                if _held_copy(fp32) is None:
                    param.data = param.data.to(_LOGICAL)
                    upcast.append(key)
    if upcast:
        warnings.warn(
            f"load_state_dict: {len(upcast)} parameter(s) that compact_master held at bf16 were "
            f"given values bf16 cannot hold exactly (e.g. {upcast[0]!r}): each was upcast to fp32 "
            "(exact) first and holds its loaded value bit for bit, no longer compact.",
            stacklevel=4,
        )


def held_parameters(
    model: torch.nn.Module, params: Iterable[tuple[str, torch.Tensor]] | None = None
) -> dict[str, torch.dtype]:
    """Held parameters whose guard still matches: name -> logical dtype (fp32).

    `params`: the model's `canonical_parameters`, when the caller has them already.
    """
    record = getattr(model, MASTER_ATTRIBUTE, None)
    if record is None or not record.guards:
        return {}
    out: dict[str, torch.dtype] = {}
    for name, p in canonical_parameters(model) if params is None else params:
        guard = record.guards.get(name)
        if guard is not None and _guard(p.data) == guard:
            out[name] = _LOGICAL
    return out


def stale_held(model: torch.nn.Module) -> dict[str, str]:
    """Parameters the record holds at bf16 whose tensor changed since: name -> what changed."""
    record = getattr(model, MASTER_ATTRIBUTE, None)
    if record is None:
        return {}
    out: dict[str, str] = {}
    for name, p in canonical_parameters(model):
        guard = record.guards.get(name)
        if guard is None:
            continue
        now = _guard(p.data)
        if now == guard:
            continue
        if now[1] == _LOGICAL:
            continue  # model.float() (or an fp32 tensor put back): a plain fp32 master again
        changed = [
            what
            for what, a, b in zip(("data_ptr", "dtype", "shape", "device"), guard, now, strict=True)
            if a != b
        ]
        out[name] = ", ".join(changed)
    return out


def _stale_words(model: torch.nn.Module, stale: Mapping[str, str]) -> str:
    name, what = next(iter(stale.items()))
    return (
        f"{len(stale)} parameter(s) of {type(model).__name__} that model.lab_master holds at bf16 "
        f"(exact copies of the fp32 master) have changed since compact_master (e.g. {name!r}: "
        f"{what}). A model.to(...), .bfloat16(), .half() or a replaced .data after compaction "
        "makes the held tensor something the record cannot vouch for. Build or load the model "
        "where it will run (Family.build/load(device=...)), or call model.float() to make every "
        "tensor an fp32 master again."
    )


def stale_held_message(model: torch.nn.Module) -> str | None:
    """The error text for `stale_held(model)`, or None when every held tensor is intact."""
    stale = stale_held(model)
    return _stale_words(model, stale) if stale else None


def master_summary(
    model: torch.nn.Module, params: Iterable[tuple[str, torch.Tensor]] | None = None
) -> dict[str, Any]:
    """meta["master"]: the logical dtype, tensors held per dtype, bytes held, the check used.

    `params`: the model's `canonical_parameters`, when the caller has them already.
    """
    params = list(canonical_parameters(model) if params is None else params)
    held = held_parameters(model, params)
    counts: dict[str, int] = {}
    nbytes = 0
    for name, p in params:
        label = "bf16" if name in held else _dtype_label(p.dtype)
        counts[label] = counts.get(label, 0) + 1
        nbytes += p.numel() * p.element_size()
    return {
        "logical": "fp32",
        "held": dict(sorted(counts.items())),
        "held_gib": nbytes / 2**30,
        "check": CHECK if held or hasattr(model, MASTER_ATTRIBUTE) else None,
    }


def off_grid(model: torch.nn.Module) -> dict[str, int]:
    """Counts for a refusal: fp32 tensors off the bf16 grid, on it but held fp32, and totals.

    Checks every fp32 parameter now (the same bitwise round trip), so it costs one pass over
    the weights: call it only when the answer is about to be shown.
    """
    held = held_parameters(model)
    keys = ("tensors", "elements", "off_tensors", "off_elements", "on_fp32_tensors")
    out = dict.fromkeys((*keys, "on_fp32_saved_bytes"), 0)
    with torch.no_grad():
        for name, p in canonical_parameters(model):
            out["tensors"] += 1
            out["elements"] += p.numel()
            if name in held or p.dtype != _LOGICAL:
                continue
            if exact_at_bf16(p.data):
                out["on_fp32_tensors"] += 1
                out["on_fp32_saved_bytes"] += p.numel() * 2
            else:
                out["off_tensors"] += 1
                out["off_elements"] += p.numel()
    return out


def _dtype_label(dtype: torch.dtype) -> str:
    from lab.base.dtypes import DTYPES

    return next((n for n, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))

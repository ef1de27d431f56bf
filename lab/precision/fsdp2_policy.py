"""The per-parameter MixedPrecisionPolicy for FSDP2 and its resolution (any torch version).

`ParamDtypeMixedPrecisionPolicy` adds an exact `param_dtype_map` (wrap-local parameter name ->
dtype) to FSDP2's `MixedPrecisionPolicy`; `resolve_wrap_param_dtypes` maps it onto the
parameters of one `fully_shard` call. The patch that makes FSDP2 honour it is
`lab.precision.fsdp2_patch` (the torch 2.11.0 gate) + `_fsdp2_patch_torch2_11` (the code).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from lab.base.arguments import checked_arguments
from lab.base.dtypes import DtypeName, dtype_name, parse_dtype


@checked_arguments
@dataclass(frozen=True)
class ParamDtypeMixedPrecisionPolicy(MixedPrecisionPolicy):
    """A MixedPrecisionPolicy whose gather dtype can differ per parameter.

    A parameter whose wrap-local name is in `param_dtype_map` is gathered (and computes) at the
    mapped dtype; every other parameter of the call uses `param_dtype`. Names are those of
    `member.named_parameters()` for each module passed to this `fully_shard` call, so one name
    shared by several members of a grouped call applies to each of them. Only honoured after
    `apply_param_dtype_map_patch()`; `lab.fsdp.apply_fsdp2` applies it when a map is non-empty.
    """

    param_dtype_map: Mapping[str, DtypeName] = field(default_factory=dict)
    """Wrap-local parameter name -> gather dtype ("bf16"/"fp16"/"fp32" names are accepted)."""

    def __post_init__(self) -> None:
        resolved: dict[str, torch.dtype] = {}
        for name, value in dict(self.param_dtype_map).items():
            if not isinstance(name, str):
                raise TypeError(
                    f"ParamDtypeMixedPrecisionPolicy.param_dtype_map: key {name!r} is not a "
                    "string; keys are wrap-local parameter names such as 'norm2.weight'."
                )
            where = f"ParamDtypeMixedPrecisionPolicy.param_dtype_map[{name!r}]"
            resolved[name] = parse_dtype(value, where=where)
        # A private copy: the caller's dict may change later, the policy must not.
        object.__setattr__(self, "param_dtype_map", resolved)

    def __hash__(self) -> int:
        # The dataclass hash would hash the dict field and fail; hash its items instead.
        items = tuple(sorted((k, str(v)) for k, v in self.param_dtype_map.items()))
        return hash(
            (
                self.param_dtype,
                self.reduce_dtype,
                self.output_dtype,
                self.cast_forward_inputs,
                items,
            )
        )


def resolve_wrap_param_dtypes(
    policy: ParamDtypeMixedPrecisionPolicy,
    modules: Sequence[torch.nn.Module],
    params: Sequence[torch.nn.Parameter],
) -> dict[torch.nn.Parameter, torch.dtype]:
    """Resolve one call's wrap-local map onto the parameters that call manages.

    Every member module is searched under its own local names, with duplicates (aliases) kept,
    so a name several members share is broadcast to each member's parameter. Entries equal to
    the group dtype (`policy.param_dtype`, or the parameter's own dtype when that is None) are
    dropped: a map that only restates the group dtype resolves to nothing and leaves the
    stock code path in charge.

    Args:
        policy: The call's policy.
        modules: The modules passed to this `fully_shard` call (one, or a group).
        params: The parameters the call manages (those no earlier call claimed).

    Returns:
        Parameter -> gather dtype, only for parameters whose dtype differs from the group's.

    Raises:
        ValueError: A map name that is no managed parameter's local name ("unknown name",
            with the nearest names), or one parameter reached under two map names that want
            different dtypes ("alias conflict").
    """
    managed = {id(p) for p in params}
    chosen: dict[int, tuple[str, torch.dtype]] = {}
    by_id: dict[int, torch.nn.Parameter] = {}
    used: set[str] = set()
    local_names: list[str] = []
    claimed_elsewhere: set[str] = set()
    for member in modules:
        for name, param in member.named_parameters(remove_duplicate=False):
            if id(param) not in managed:
                claimed_elsewhere.add(name)
                continue
            local_names.append(name)
            want = policy.param_dtype_map.get(name)
            if want is None:
                continue
            used.add(name)
            previous = chosen.get(id(param))
            if previous is not None and previous[1] != want:
                raise ValueError(
                    f"ParamDtypeMixedPrecisionPolicy: alias conflict: one parameter is named "
                    f"both {previous[0]!r} ({dtype_name(previous[1])}) and {name!r} "
                    f"({dtype_name(want)}) in this fully_shard call. A shared parameter has "
                    "one gather dtype: give every alias the same dtype, or name only one."
                )
            chosen.setdefault(id(param), (name, want))
            by_id[id(param)] = param
    unknown = [n for n in policy.param_dtype_map if n not in used]
    if unknown:
        name = unknown[0]
        if name in claimed_elsewhere:
            why = (
                "it names a parameter an earlier (nested) fully_shard call already manages; "
                "put it in that call's map"
            )
        else:
            near = difflib.get_close_matches(name, sorted(set(local_names)), 3, 0.5)
            why = "no parameter of this call has that local name" + (
                f"; nearest names: {', '.join(repr(n) for n in near)}" if near else ""
            )
        raise ValueError(
            f"ParamDtypeMixedPrecisionPolicy: unknown name {name!r} in param_dtype_map "
            f"({len(unknown)} unknown: {unknown[:5]}): {why}. Names are local to the modules "
            "passed to fully_shard (e.g. 'norm2.weight' for a block, not 'blocks.0.norm2.weight')."
        )
    out: dict[torch.nn.Parameter, torch.dtype] = {}
    for pid, (_, dtype) in chosen.items():
        param = by_id[pid]
        default = policy.param_dtype or param.dtype
        if dtype != default:
            out[param] = dtype
    return out


def check_trainable_dtypes(
    policy: ParamDtypeMixedPrecisionPolicy,
    params: Sequence[torch.nn.Parameter],
    overrides: Mapping[torch.nn.Parameter, torch.dtype],
) -> None:
    """Refuse a call whose trainable parameters compute at several dtypes without a reduce dtype.

    Gradients come out in each parameter's gathered dtype and one reduce-scatter carries one
    dtype, so a mixed group needs `reduce_dtype` to say which one (stock FSDP2 would fail at
    the first backward with "uniform gradient dtype").

    Raises:
        ValueError: Mixed trainable gather dtypes and `policy.reduce_dtype is None`.
    """
    if policy.reduce_dtype is not None:
        return
    dtypes: dict[torch.dtype, int] = {}
    for p in params:
        if p.requires_grad:
            d = overrides.get(p, policy.param_dtype or p.dtype)
            dtypes[d] = dtypes.get(d, 0) + 1
    if len(dtypes) > 1:
        counts = ", ".join(f"{n} at {dtype_name(d)}" for d, n in dtypes.items())
        raise ValueError(
            f"ParamDtypeMixedPrecisionPolicy: the trainable parameters of this fully_shard call "
            f"compute at mixed dtypes ({counts}) but reduce_dtype is None. One reduce-scatter "
            "carries one dtype: set reduce_dtype explicitly (torch.float32 keeps every gradient "
            "exact), or freeze the parameters that differ."
        )

"""The torch 2.11.0 half of the per-parameter FSDP2 patch: four internals, each hash-checked.

Import only through `lab.precision.fsdp2_patch.apply_param_dtype_map_patch`, which checks the
torch version first. What is patched, and why each is needed for a group whose parameters
gather at different dtypes:

- `FSDPParamGroup.__init__` (wrapped): the one place that sees both the modules of a
  `fully_shard` call and the parameters it manages. Resolves the policy's wrap-local map onto
  those parameters (unknown names and alias conflicts raise; a name shared by members of a
  grouped call is broadcast), refuses mixed trainable dtypes without a reduce dtype, then tags
  every FSDPParam of a group that has an override with its gather dtype.
- `FSDPParam.init_dtype_attrs` (wrapped): a tagged parameter takes its own param dtype, and its
  reduce dtype stays the policy's explicit value. Stock code clamps reduce_dtype to None when
  it equals the param dtype, which in a mixed group gives the fp32 parameters None and the
  bf16 ones fp32, and `_init_mp_dtypes` then rejects the group as non-uniform.
- `_fsdp_collectives._get_param_all_gather_inputs` (replaced): the fast path copies every
  casting parameter into ONE flat buffer of the first parameter's param dtype, silently
  re-casting the others. The replacement keeps one flat buffer per destination dtype. With
  one dtype it does exactly what the stock code does.
- `foreach_reduce`, as `_fsdp_param_group` calls it (wrapped): gradients come out in each
  parameter's gather dtype and the stock code asserts they are uniform. With an explicit
  reduce dtype the wrapper casts them to it first (bf16/fp16 -> fp32 is exact; the stock
  copy-in performs the same conversion for a uniform group).

Untagged groups and stock policies run the original code paths (the replaced copy-in is
identical for a single dtype), so an empty map is bitwise equal to the stock policy.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_common import compiled_autograd_enabled
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from lab.precision.fsdp2_policy import (
    ParamDtypeMixedPrecisionPolicy,
    check_trainable_dtypes,
    resolve_wrap_param_dtypes,
)

EXPECTED_SOURCE_SHA256: dict[str, str] = {
    "FSDPParamGroup.__init__": "96869b76ce8d27e998c7aebdeb4f22495fa6b057387cff48f35a9da2bc687ca2",
    "FSDPParam.init_dtype_attrs": (
        "bc99fcfc9dcac82c0d99a6f4d9ace5c69096383b9609e52f4fd72a8c3d6fd015"
    ),
    "_fsdp_collectives._get_param_all_gather_inputs": (
        "a70fbae57b8aa3dc669d01a409d30c74428546bc4d69635a90cffe9380a5785f"
    ),
    "_fsdp_collectives.foreach_reduce": (
        "46bcdaa0df40823e13922359db131cf329f8adf12eefa72ff16ceb41f9650d90"
    ),
}
"""sha256 of each patched function's dedented source in torch 2.11.0."""

_GATHER_DTYPE_ATTR = "_lab_gather_dtype"
"""Set on every FSDPParam of a group with an override: its gather dtype (None = its own)."""

_originals: dict[str, Callable[..., Any]] = {}


def source_sha256(fn: Callable[..., Any]) -> str:
    """sha256 hex digest of a function's dedented source (decorators included)."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()


def _targets() -> dict[str, Callable[..., Any]]:
    return {
        "FSDPParamGroup.__init__": FSDPParamGroup.__init__,
        "FSDPParam.init_dtype_attrs": FSDPParam.init_dtype_attrs,
        "_fsdp_collectives._get_param_all_gather_inputs": (
            _fsdp_collectives._get_param_all_gather_inputs
        ),
        "_fsdp_collectives.foreach_reduce": _fsdp_collectives.foreach_reduce,
    }


def is_applied() -> bool:
    """Whether `apply()` has patched FSDP2 in this process."""
    return bool(_originals)


def apply() -> bool:
    """Check every target's source hash, then patch all four (or none).

    Returns:
        True if patched now, False if already patched.

    Raises:
        RuntimeError: A target whose source differs from torch 2.11.0's, named with both hashes.
    """
    if _originals:
        return False
    targets = _targets()
    drift = []
    for name, fn in targets.items():
        actual = source_sha256(fn)
        if actual != EXPECTED_SOURCE_SHA256[name]:
            drift.append(
                f"{name} (expected {EXPECTED_SOURCE_SHA256[name][:12]}, got {actual[:12]})"
            )
    if _fsdp_param_group.foreach_reduce is not _fsdp_collectives.foreach_reduce:
        drift.append("_fsdp_param_group.foreach_reduce (not the _fsdp_collectives function)")
    if drift:
        raise RuntimeError(
            "apply_param_dtype_map_patch: refusing to patch FSDP2: the source of "
            f"{'; '.join(drift)} differs from the torch 2.11.0 code the patch was written "
            "against (another patch, or a modified torch install). Nothing was patched. "
            "Reinstall torch==2.11.0, or review the patch against the new source and update "
            "EXPECTED_SOURCE_SHA256 in lab/precision/_fsdp2_patch_torch2_11.py."
        )
    _originals.update(targets)
    FSDPParamGroup.__init__ = _param_group_init  # type: ignore[method-assign]
    FSDPParam.init_dtype_attrs = _init_dtype_attrs  # type: ignore[method-assign]
    _fsdp_collectives._get_param_all_gather_inputs = _get_param_all_gather_inputs
    _fsdp_param_group.foreach_reduce = _foreach_reduce
    return True


# ---- the patched functions ---------------------------------------------------------------


def _param_group_init(
    self: FSDPParamGroup,
    params: list[torch.nn.Parameter],
    modules: tuple[torch.nn.Module, ...],
    mesh_info: Any,
    post_forward_mesh_info: Any,
    device: torch.device,
    shard_placement_fn: Any,
    mp_policy: Any,
    offload_policy: Any,
) -> None:
    overrides: dict[torch.nn.Parameter, torch.dtype] = {}
    if isinstance(mp_policy, ParamDtypeMixedPrecisionPolicy):
        # Checked before the original init shards anything, so an error leaves the module as is.
        overrides = resolve_wrap_param_dtypes(mp_policy, modules, params)
        check_trainable_dtypes(mp_policy, params, overrides)
    _originals["FSDPParamGroup.__init__"](
        self,
        params,
        modules,
        mesh_info,
        post_forward_mesh_info,
        device,
        shard_placement_fn,
        mp_policy,
        offload_policy,
    )
    if overrides:
        # fsdp_params is built from `params` in order; tag every member so the whole group
        # keeps an explicit reduce dtype (see init_dtype_attrs below).
        for fsdp_param, param in zip(self.fsdp_params, params, strict=True):
            setattr(fsdp_param, _GATHER_DTYPE_ATTR, overrides.get(param, mp_policy.param_dtype))


def _init_dtype_attrs(self: FSDPParam, mp_policy: Any) -> None:
    if not hasattr(self, _GATHER_DTYPE_ATTR):
        _originals["FSDPParam.init_dtype_attrs"](self, mp_policy)
        return
    gather_dtype = getattr(self, _GATHER_DTYPE_ATTR)
    self.orig_dtype = self.sharded_param.dtype
    # None means "no cast", as in the stock code.
    self.param_dtype = None if gather_dtype in (None, self.orig_dtype) else gather_dtype
    # Never clamped to None: every member of a mixed group must agree on the reduce dtype.
    self.reduce_dtype = mp_policy.reduce_dtype


@torch.no_grad()
def _get_param_all_gather_inputs(fsdp_params: list[FSDPParam]) -> list[list[torch.Tensor]]:
    if compiled_autograd_enabled():
        return [fsdp_param.all_gather_inputs for fsdp_param in fsdp_params]

    def use_foreach_copy(fsdp_param: FSDPParam) -> bool:
        return (
            fsdp_param.param_dtype is not None
            and not fsdp_param.offload_to_cpu
            and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
        )

    inputs: list[list[torch.Tensor]] = [[] for _ in fsdp_params]
    buckets: dict[torch.dtype, list[int]] = {}
    for i, fsdp_param in enumerate(fsdp_params):
        if use_foreach_copy(fsdp_param):
            buckets.setdefault(cast(torch.dtype, fsdp_param.param_dtype), []).append(i)
        else:
            inputs[i] = fsdp_param.all_gather_inputs
    # One flat cast buffer per destination dtype; in a single-dtype group this is the stock
    # single buffer, the same copy kernel over the same tensors.
    for dtype, indices in buckets.items():
        sources = []
        for i in indices:
            fsdp_param = fsdp_params[i]
            sources.append(
                fsdp_param._sharded_param_data
                if fsdp_param.sharded_state == ShardedState.SHARDED
                else cast(torch.Tensor, fsdp_param._sharded_post_forward_param_data)
            )
        numels = [t.numel() for t in sources]
        flat = torch.empty((sum(numels),), device=fsdp_params[indices[0]].device, dtype=dtype)
        splits = torch.split(flat, numels)
        torch._foreach_copy_(splits, sources)
        for i, split in zip(indices, splits, strict=True):
            inputs[i] = [split]
    return inputs


def _foreach_reduce(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    reduce_scatter_group: Any,
    reduce_scatter_stream: Any,
    reduce_scatter_comm: Any,
    orig_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if reduce_dtype is not None and len({g.dtype for g in unsharded_grads}) > 1:
        with torch.no_grad():
            for i, grad in enumerate(unsharded_grads):
                if grad.dtype != reduce_dtype:
                    unsharded_grads[i] = grad.to(reduce_dtype)
    return _originals["_fsdp_collectives.foreach_reduce"](
        fsdp_params,
        unsharded_grads,
        reduce_scatter_group,
        reduce_scatter_stream,
        reduce_scatter_comm,
        orig_dtype,
        reduce_dtype,
        *args,
        **kwargs,
    )

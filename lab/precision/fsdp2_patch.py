"""Per-parameter MixedPrecisionPolicy for FSDP2 and the patch that honours it (torch 2.11.0 only).

Stock FSDP2 gathers every parameter of one `fully_shard` call at that call's
`MixedPrecisionPolicy.param_dtype`. `ParamDtypeMixedPrecisionPolicy` adds an exact
`param_dtype_map` (wrap-local parameter name -> dtype); `apply_param_dtype_map_patch()` teaches
FSDP2's internals to honour it. The patch reaches into private FSDP2 code, so it is gated on
torch 2.11.0 and the version-specific code lives in `_fsdp2_patch_torch2_11.py`, imported only
after the version check passes. What it touches, and why, is in that module's docstring.

The version-independent half (the policy and the resolution of a wrap-local map onto the
parameters of one `fully_shard` call) is `lab.precision.fsdp2_policy`, re-exported here.
"""

from __future__ import annotations

import torch

from lab.precision.fsdp2_policy import (
    ParamDtypeMixedPrecisionPolicy,
    check_trainable_dtypes,
    resolve_wrap_param_dtypes,
)

__all__ = [
    "SUPPORTED_TORCH_VERSION",
    "ParamDtypeMixedPrecisionPolicy",
    "apply_param_dtype_map_patch",
    "check_trainable_dtypes",
    "is_param_dtype_map_patch_applied",
    "resolve_wrap_param_dtypes",
]

SUPPORTED_TORCH_VERSION = "2.11.0"
"""The only torch release whose FSDP2 internals the patch was written and hashed against."""


def apply_param_dtype_map_patch() -> bool:
    """Patch FSDP2 (torch 2.11.0) to honour `ParamDtypeMixedPrecisionPolicy.param_dtype_map`.

    Safe to call more than once: a second call changes nothing. Policies other than
    `ParamDtypeMixedPrecisionPolicy`, and ones whose map resolves to no override, keep the
    stock behaviour bit for bit.

    Returns:
        True if this call applied the patch, False if it was already applied.

    Raises:
        RuntimeError: On any torch other than 2.11.0 (the version-specific module is then not
            imported), or when a patched function's source hash differs from the one the patch
            was written against (names the function; nothing is patched).
    """
    version = torch.__version__.split("+")[0]
    if version != SUPPORTED_TORCH_VERSION:
        raise RuntimeError(
            f"apply_param_dtype_map_patch: the per-parameter FSDP2 patch reaches into FSDP2 "
            f"internals and is written for torch {SUPPORTED_TORCH_VERSION} only; this is torch "
            f"{torch.__version__!r}. Install torch=={SUPPORTED_TORCH_VERSION} (pyproject.toml "
            "pins it), or drop the param_dtype_rules so the stock MixedPrecisionPolicy runs."
        )
    from lab.precision import _fsdp2_patch_torch2_11 as impl

    return impl.apply()


def is_param_dtype_map_patch_applied() -> bool:
    """Whether `apply_param_dtype_map_patch()` has patched FSDP2 in this process."""
    import sys

    impl = sys.modules.get("lab.precision._fsdp2_patch_torch2_11")
    return bool(impl is not None and impl.is_applied())

"""Errors that carry what was computed before they happened (partial results survive)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lab.result import Result
    from lab.sides import Side


class PairError(RuntimeError):
    """A paired forward failed part-way; `result` holds every pair compared before that."""

    def __init__(
        self,
        message: str,
        result: Result | None = None,
        *,
        side: str | None = None,
        module: str | None = None,
        module_class: str | None = None,
        fix: str | None = None,
    ) -> None:
        """Keep the partial result, and where the failure happened, next to the message."""
        super().__init__(message)
        self.result = result
        self.side = side
        """Name of the side whose forward failed (None when no forward failed)."""
        self.module = module
        """`named_modules()` path of the innermost module that was running, or None."""
        self.module_class = module_class
        self.fix = fix
        """What would most likely make the pair run, or None when nothing specific is known."""


class NonFiniteOutputError(PairError, ValueError):
    """A side's model output holds NaN or Inf."""


class DegenerateOutputError(PairError, ValueError):
    """Both sides' model outputs are all zero or constant: agreement there proves nothing."""


def failing_module(err: BaseException, model: Any) -> tuple[str, str] | None:
    """The innermost module of `model` whose `forward` was on the stack when `err` was raised.

    Walks the traceback (it survives the lockstep thread hand-over, which re-raises the same
    exception object) for frames whose `self` is one of the model's modules.

    Returns:
        (module path, class name), the path as in `named_modules()` with "<root>" for the
        model itself; None when the failure happened outside every module.
    """
    from lab.capture import ROOT

    names = {id(m): n or ROOT for n, m in model.named_modules()}
    found = None
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names:
            found = (names[id(owner)], type(owner).__name__)
        tb = tb.tb_next
    return found


_DTYPE_MISMATCH = re.compile(r"dtype|scalar type|should be the same", re.IGNORECASE)


def dtype_mismatch_fix(
    err: BaseException, side: Side, module: str, param_dtypes: Mapping[str, Any]
) -> str | None:
    """Say how to fix a dtype mismatch inside `module` on `side`, or None if it is not one.

    The common case: a rule (or keep_fp32_modules) pins a module's parameters to fp32 on a
    side that runs bf16 without autocast, so the module's bf16 input meets fp32 weights.

    Args:
        err: The exception the forward raised.
        side: The side whose forward raised it.
        module: The failing module's path (see `failing_module`).
        param_dtypes: That side's parameter name -> dtype (torch dtype or name).
    """
    if not _DTYPE_MISMATCH.search(str(err)):
        return None
    from lab.capture import ROOT
    from lab.precision.dtypes import dtype_name, parse_dtype

    forward = side.resolved_param_dtype
    prefix = "" if module == ROOT else f"{module}."
    own = {
        name: d if isinstance(d, str) else dtype_name(d)
        for name, d in param_dtypes.items()
        if name.startswith(prefix) and "." not in name[len(prefix) :]
    }
    pinned = {n: d for n, d in own.items() if parse_dtype(d) != parse_dtype(forward)}
    if pinned and not side.autocast:
        rules = [
            f"'{p}: {v}'"
            for p, v in side.param_dtype_rules.items()
            if any(fnmatch.fnmatchcase(n, p) for n in pinned)
        ]
        why = f"rule {rules[-1]}" if rules else "keep_fp32_modules"
        held = "/".join(sorted(set(pinned.values())))
        return (
            f"Fix: {module}'s parameters are {held} on side {side.name!r} ({why}) while that "
            f"side runs {forward} without autocast, so a {forward} input meets {held} weights. "
            f"Turn autocast on for side {side.name!r}, or drop that rule or narrow it so that "
            f"it misses {module!r}."
        )
    return (
        f"Fix: check side {side.name!r}'s dtypes at {module!r}: its input_dtype_policy, "
        "param_dtype, param_dtype_rules and autocast (autocast casts matmul inputs to one dtype)."
    )


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked (the message names the file)."""


class ModelInUseError(RuntimeError):
    """A second thread asked to pair or run a model another thread is pairing or running."""

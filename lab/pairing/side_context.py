"""One side's forward context: autocast, attention kernel, engine ops, inputs at its boundary.

Every way of running a side (`forward_side`, `pair`'s two passes, lockstep's threads, the
trajectory) enters the same context, so a side means the same thing everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from lab.base.devices import resolve_device
from lab.families import Inputs
from lab.pairing.sides import Side
from lab.precision.input_policy import apply_input_dtype_policy

_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def sdpa_context(backend: str) -> contextlib.AbstractContextManager:
    """The SDPA kernel selection of a side's `attention_backend` (global flags, restored)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        # Every kernel allowed, torch's own priority: what an unpinned forward would pick.
        return sdpa_kernel(
            [
                SDPBackend.FLASH_ATTENTION,
                SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH,
            ]
        )
    return sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[backend]))


def side_autocast(side: Side, device: torch.device) -> contextlib.AbstractContextManager:
    """The side's autocast (thread-local), or autocast switched off for a side without it."""
    if not side.autocast:
        # Switch off any autocast active around us (an outer side in local mode).
        return torch.autocast(device.type, enabled=False)
    from lab.precision.autocast import autocast_context

    dtype = side.autocast_torch_dtype
    if dtype == torch.float32:
        # Autocast to fp32 changes nothing an fp32 forward would not do by itself.
        return torch.autocast(device.type, enabled=False)
    return autocast_context(side.resolved_autocast_policy, device, dtype)


@contextlib.contextmanager
def side_context(
    side: Side,
    device: torch.device,
    root: torch.nn.Module | None = None,
    modules: Iterable[torch.nn.Module] | None = None,
) -> Iterator[None]:
    """Autocast, attention kernel and (on `root`) engine op semantics of one side.

    Weights are `WeightView`'s job. With `root`, every module under it runs the forward the
    side's engine_ops / op_switches ask for (or its class's own, undoing an outer side's).
    `modules`: `root.modules()` when the caller has them already (a view's list: no walk).
    """
    from lab.precision.engine_ops import ops_applied

    with contextlib.ExitStack() as stack:
        if root is not None:
            ops = ops_applied(root, side.engine_ops, side.op_switches, modules)
            stack.enter_context(ops)
        stack.enter_context(sdpa_context(side.attention_backend))
        stack.enter_context(side_autocast(side, device))
        yield


def side_inputs(inputs: Inputs, side: Side, device: torch.device) -> Inputs:
    """The inputs as `side` hands them to its DiT: policy at the boundary, then op switches."""
    from lab.precision.engine_ops import transform_inputs

    cast = apply_input_dtype_policy(side.input_dtype_policy, inputs.to(device), side.forward_dtype)
    return transform_inputs(cast, side.op_switches)


def check_side_device(
    side: Side, device: torch.device, model: torch.nn.Module | None = None
) -> None:
    """Refuse a side that cannot run where the model lives, or that asks for nothing there.

    The side's device or attention kernel; given `model`, its engine patch groups, each of
    which must patch some module of it.

    Raises:
        ValueError: CUDA asked for without a GPU, a side on another device than the model, a
            CUDA-only attention kernel on CPU, or a patch group that would change nothing.
    """
    if device.type == "meta":
        raise ValueError(
            "The model is on the meta device (shapes only, no weights), which no side can run. "
            "Build it with device='cpu' or 'cuda' (fam.build(preset, seed, device=...)) or load "
            "real weights (fam.load(path, device=...))."
        )
    want = resolve_device(side.device)
    if want.type != device.type:
        raise ValueError(
            f"Side({side.name!r}).device is {side.device!r} but the model is on {device}. Build "
            f"the model with device={side.device!r} or use side.replace(device={device.type!r})."
        )
    if device.type == "cpu" and side.attention_backend in ("efficient", "cudnn"):
        raise ValueError(
            f"Side({side.name!r}).attention_backend={side.attention_backend!r} has no CPU kernel; "
            "on CPU use 'default', 'math' or 'flash'."
        )
    if model is not None:
        from lab.precision.engine_ops import check_groups_apply

        check_groups_apply(side.engine_ops, model, f"Side({side.name!r})")

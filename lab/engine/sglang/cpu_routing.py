"""Every change the lab makes to sglang to run its DiTs on a CPU without sgl_kernel: one place.

On a CPU, sglang 0.5.23 sends two kinds of op to `sgl_kernel`'s CPU kernels, which are not
installed here (the `sglang-kernel` wheel is built for sm90/sm100 against torch 2.14.1 and does
not load beside torch 2.11):

- `norm_scale_shift`: the fused norm + modulation CustomOps (`_NormScaleShift`: LayerNorm- and
  RMSNormScaleShift; `_ScaleResidualNormScaleShift`: the gated residual + norm + modulation)
  dispatch `forward_cpu` to `torch.ops.sgl_kernel.fused_*_cpu`. Routed to the class's own
  `forward_native`, the engine's pure-torch definition of the same op (the one its MPS/MUSA
  builds and its tests run).
- `fuse_scale_shift_kernel`: the engine binds `fuse_scale_shift_kernel` to
  `_fuse_scale_shift_kernel_cpu` (`torch.ops.sgl_kernel.fused_scale_shift_cpu`) on a CPU;
  rebound, in every module that imported the name, to `fuse_scale_shift_kernel_native`, the
  torch fallback the engine selects for MPS and MUSA.

- `eager`: sglang marks its native norm forwards `@torch.compile` (inductor) on a CPU; the lab runs
  them eagerly (their definition), because inductor's fused CPU code rounds differently, is slow
  to compile, and needs a C compiler. `EngineModel.forward` runs inside `eager()`.

So on this machine the engine's forward is its native (pure torch) semantics. On a GPU the same
ops are Triton/CUDA kernels with their own rounding: that difference is named, never silent
(`ROUTED_WHY`). Nothing else of the engine is changed: attention falls back to torch SDPA by the
engine's own CPU platform choice, and its norms and RoPE take the torch fallbacks its
`select_impl` picks for a CPU. When `sgl_kernel` does import (a machine that has it), nothing is
routed and the engine's own CPU kernels run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator

WRITTEN_FOR = "0.5.23"
"""The sglang release whose CPU dispatch this routing reads (runtime.SUPPORTED_VERSION names the
one the lab supports; a test holds the two equal)."""

ROUTED_WHY = (
    "sglang's CPU kernel for this op (sgl_kernel) is not installed here, so the engine's "
    "native torch definition of it ran (on a GPU the engine runs a fused Triton/CUDA kernel)"
)

# Classes whose forward_cpu calls torch.ops.sgl_kernel (sglang 0.5.23,
# runtime/layers/layernorm.py). Subclasses inherit the routed method.
_CUSTOM_OPS = (
    ("sglang.multimodal_gen.runtime.layers.layernorm", "_NormScaleShift"),
    ("sglang.multimodal_gen.runtime.layers.layernorm", "_ScaleResidualNormScaleShift"),
)
_SCALE_SHIFT = "fuse_scale_shift_kernel"
_SCALE_SHIFT_CPU = "_fuse_scale_shift_kernel_cpu"
_NATIVE = ("sglang.kernels.ops.diffusion.common.fallback_torch", "fuse_scale_shift_kernel_native")


def sgl_kernel_present() -> bool:
    """Whether sglang's compiled kernels import here (then nothing needs routing)."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        importlib.import_module("sgl_kernel")
    except Exception:  # any failure to load means its ops are unavailable
        return False
    return True


def apply_cpu_routing(version: str) -> tuple[str, ...]:
    """Route the engine's sgl_kernel CPU ops to its native torch paths (once, process-wide).

    Args:
        version: The installed engine version (must be the one this routing was written for).

    Returns:
        The names of the routings applied, e.g. ("norm_scale_shift", "fuse_scale_shift_kernel"),
        each with the count of places it changed; empty where sgl_kernel is present.

    Raises:
        RuntimeError: On another engine version, or when a routed name is no longer where this
            module expects it (the engine moved its code: the routing must be re-read).
    """
    if version != WRITTEN_FOR:
        raise RuntimeError(
            f"lab.engine.sglang.cpu_routing was written for sglang {WRITTEN_FOR}, not "
            f"{version}; re-read the engine's CPU dispatch before routing it."
        )
    if sgl_kernel_present():
        return ()
    applied = []
    for module_name, class_name in _CUSTOM_OPS:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if cls is None or "forward_cpu" not in vars(cls) or "forward_native" not in vars(cls):
            raise RuntimeError(
                f"cpu_routing: {module_name}.{class_name}.forward_cpu/forward_native not found "
                f"in sglang {version}; the engine moved its fused norm ops."
            )
        if not getattr(cls.forward_cpu, "__lab_routed__", False):
            routed = cls.forward_native

            def forward_cpu(self, *args, _native=routed, **kwargs):  # type: ignore[no-untyped-def]
                return _native(self, *args, **kwargs)

            forward_cpu.__lab_routed__ = True  # type: ignore[attr-defined]
            forward_cpu.__doc__ = f"lab.engine.sglang.cpu_routing: {class_name}.forward_native"
            cls.forward_cpu = forward_cpu
    applied.append("norm_scale_shift")

    native = getattr(importlib.import_module(_NATIVE[0]), _NATIVE[1])
    rebound = 0
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if not name.startswith("sglang"):
            continue
        bound = getattr(module, _SCALE_SHIFT, None)
        if getattr(bound, "__name__", None) == _SCALE_SHIFT_CPU:
            setattr(module, _SCALE_SHIFT, native)
            rebound += 1
    already = any(
        getattr(getattr(m, _SCALE_SHIFT, None), "__name__", None) == _NATIVE[1]
        for m in list(sys.modules.values())
        if (getattr(m, "__name__", "") or "").startswith("sglang.multimodal_gen")
    )
    if not rebound and not already:
        raise RuntimeError(
            f"cpu_routing: no sglang module binds {_SCALE_SHIFT} to {_SCALE_SHIFT_CPU} in "
            f"sglang {version}; the engine moved its scale/shift kernel selection."
        )
    applied.append(_SCALE_SHIFT)
    return tuple(applied)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """The engine's `torch.compile`-marked native ops run eagerly inside the block."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield

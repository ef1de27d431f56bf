"""autocast_context(): torch.autocast for a side, with CUDA's per-op policy also on CPU tensors.

Why this exists: torch 2.11's CPU autocast(bf16) has its own op lists, not CUDA's. It leaves
layer_norm, rms_norm, softmax and gelu in bf16 (bf16 in, bf16 out), where CUDA autocast runs
layer_norm, softmax and the rest of its float32 list in fp32. A tiny Flux in bf16 eager and the
same fp32 model under CPU autocast gave bit-identical outputs, while on an H200 the same pair
diverged from transformer_blocks.0.norm1.norm on (shared/reference/precision-facts.md, section
10). So a CPU run that should show what the GPU trainer does must apply CUDA's lists itself.

Policies (`AUTOCAST_POLICIES`):

- ``"cuda"``: CUDA autocast's op lists. On a CUDA device this is plain ``torch.autocast("cuda")``;
  on CPU tensors it is `CudaAutocastEmulation`. The default on both devices.
- ``"cpu"``: torch's own CPU autocast, for showing what CPU autocast itself does. CPU only.

Where the lists come from: torch 2.11.0, ``aten/src/ATen/autocast_mode.h`` (the macros
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``, read from the header shipped
in the installed wheel) and ``aten/src/ATen/autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten,
Autocast, m)``, which adds ``cudnn_convolution``, ``cudnn_convolution_transpose`` and bans
``binary_cross_entropy``), plus ``_cudnn_rnn`` from ``aten/src/ATen/cudnn/AutocastRNN.cpp``.
tests/test_autocast.py checks that their union is exactly the set of operators that have an
AutocastCUDA kernel in the installed torch, so a torch upgrade that changes them fails loudly.
Neither ``rms_norm`` nor ``gelu`` nor ``cat``/``stack`` is on any CUDA list in 2.11: rms_norm
and gelu keep their input dtype on CUDA too, and cat/stack promote natively (bf16 + fp32 gives
fp32 without autocast's help).

How the emulation works: a `torch.overrides.TorchFunctionMode` sees every Python-level torch call
(torch.*, torch.nn.functional.*, Tensor methods, torch.ops.aten.*), looks its name up in the lists
and casts the floating arguments the way CUDA's autocast wrapper would, then runs the call. It sits
above autograd, so the casts are recorded in the graph and gradients flow through them back to
fp32 parameters (a TorchDispatchMode sits below autograd and could not do that). As on CUDA, a
tensor is cast only if it is floating and not float64 (here: a floating CPU tensor); integer,
bool, complex and float64 tensors are left alone, calls with ``out=`` are left alone (autocast
wraps only functional overloads), and an explicit ``dtype`` argument is kept.

Nested ``torch.autocast(..., enabled=False)``: diffusers switches autocast off around rotary
embeddings, some models with ``torch.autocast(device_type=x.device.type, enabled=False)`` (which
is "cpu" here) and some with ``torch.amp.autocast("cuda", enabled=False)``. So on entry the
emulation switches torch's own autocast flags on for both "cpu" and "cuda" (dtype set to its
dtype), restores them on exit, and casts only while both flags are still on: a nested disable of
either device switches the emulation off for that region, exactly as on the GPU. A nested
``torch.autocast("cpu", dtype=torch.float16)`` changes the dtype used, as CUDA's would. torch's
real CPU autocast kernels never run inside the emulation: every intercepted call runs with the
"cpu" flag cleared, and torch.is_autocast_enabled() reads True there, as on the GPU, which also
keeps nn.MultiheadAttention off its fused fast path as CUDA autocast does.

Known differences from real CUDA autocast:

- CUDA casts at every aten call inside the dispatcher; the emulation sees only the outermost
  Python-level call. An op that is on no list but whose C++ or Python body calls one that is (a
  composite, e.g. ``1 / x`` calls reciprocal, F.normalize calls norm) is cast on CUDA at that
  inner call; here only where `PYTHON_COMPOSITE_POLICIES` names it. Composites not named there
  run in their input dtypes. Only Flux has been checked module by module (below).
- ``multi_head_attention_forward`` and the RNN functions are cast wholesale to the autocast dtype;
  on CUDA their inner softmax runs in fp32 and RNNs are cast inside cuDNN's ``_cudnn_rnn``.
- Kernels are CPU kernels: an op sees the dtypes it would see on CUDA, but values within an op
  (accumulation order, fused attention) are the CPU kernel's, not cuBLAS's or flash attention's.
- ``norm`` (CUDA's fp32_append_dtype policy, which appends dtype=float) casts its input to fp32
  instead; bf16 to fp32 is exact, so the result dtype and the fp32 arithmetic are the same.
- No cast cache: CUDA caches the bf16 copy of each fp32 leaf parameter within a region. That
  saves time and memory only; the values are identical.
- Backward called inside the region runs with no autocast; on CUDA the lists would also apply to
  backward ops (torch advises against backward inside autocast). torch.utils.checkpoint records
  the "cpu" flag as on and recomputes during backward, outside the mode, under torch's own CPU
  autocast, so recomputed activations follow CPU's lists, not CUDA's.
- On a machine without CUDA, torch itself disables a nested ``torch.autocast("cuda")`` (with a
  warning), so such a region runs without the emulation.

Checked against the real thing on an H200 (torch 2.11.0+cu130): 62 calls (matmuls, attention,
convolutions, norms, softmax, reductions, pointwise ops, the composites above, cat/stack, promote
ops, float64, integer, explicit-dtype and out= calls, nested disables) gave the same output dtype
under CUDA autocast on CUDA tensors as under the emulation on CPU tensors, and a tiny Flux
(diffusers 0.42.1) gave the same output dtype at all 121 modules; torch's CPU autocast differed
at 18 of them (every norm). At transformer_blocks.0.norm1.norm the emulation was 4.8e-7 from the
GPU (max abs), CPU autocast 7.8e-3.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from types import FunctionType
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode

AutocastPolicy = Literal["cuda", "cpu"]

AUTOCAST_POLICIES: tuple[AutocastPolicy, ...] = ("cuda", "cpu")
"""Autocast op lists a side may use: CUDA's (emulated on CPU tensors) or torch's CPU autocast."""

AUTOCAST_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
"""Dtypes torch.autocast supports as its lower-precision dtype on both devices."""

# The op lists below are torch 2.11.0's CUDA autocast registrations, entry for entry, written as
# "name" or "name.overload" exactly as aten names them. Sources: aten/src/ATen/autocast_mode.h
# (AT_FORALL_* macros) and autocast_mode.cpp (TORCH_LIBRARY_IMPL(aten, Autocast, m)); _cudnn_rnn
# from aten/src/ATen/cudnn/AutocastRNN.cpp. Matching is by name: every overload of a listed name
# is treated alike (the unlisted overloads of these names are out= variants, or are composites
# such as conv2d.padding whose inner convolution CUDA casts anyway). Kept dense, like the header.
# fmt: off

CUDA_LOWER_PRECISION_FP_OPS: tuple[str, ...] = (
    # AT_FORALL_LOWER_PRECISION_FP: inputs cast to the autocast dtype (bf16 or fp16).
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    # autocast_mode.cpp, CUDA only.
    "cudnn_convolution", "cudnn_convolution_transpose",
    # cudnn/AutocastRNN.cpp.
    "_cudnn_rnn",
)
"""Ops CUDA autocast runs in the autocast dtype: every eligible input is cast to it."""

CUDA_FP32_OPS: tuple[str, ...] = (
    # AT_FORALL_FP32: floating inputs cast to float32.
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
"""Ops CUDA autocast runs in float32: every eligible input is cast up to it."""

CUDA_FP32_SET_OPT_DTYPE_OPS: tuple[str, ...] = (
    # AT_FORALL_FP32_SET_OPT_DTYPE: if the first argument is eligible and no dtype was given,
    # call with dtype=float32 (inputs are not cast; the kernel reads them and computes in fp32).
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname",
    "log_softmax.int", "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum",
    "cumsum.dimname", "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
    "sum", "sum.dim_IntList", "sum.dim_DimnameList",
)
"""Ops CUDA autocast calls with dtype=float32 unless the caller passed a dtype."""

CUDA_FP32_APPEND_DTYPE_OPS: tuple[str, ...] = (
    # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: redispatched to the overload with a dtype, float32.
    "norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim",
)
"""Ops CUDA autocast redirects to their dtype=float32 overload (emulated by an fp32 cast)."""

CUDA_PROMOTE_OPS: tuple[str, ...] = (
    # AT_FORALL_PROMOTE: all eligible inputs cast to the widest floating input dtype.
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)
"""Ops CUDA autocast runs in the widest floating dtype among their inputs."""

CUDA_BANNED_OPS: tuple[str, ...] = ("binary_cross_entropy",)
"""Ops CUDA autocast refuses with an error (autocast_mode.cpp, binary_cross_entropy_banned)."""
# fmt: on

_LOWER, _FP32, _SET_OPT_DTYPE, _APPEND_DTYPE, _PROMOTE, _BANNED = (
    "lower_precision_fp",
    "fp32",
    "fp32_set_opt_dtype",
    "fp32_append_dtype",
    "promote",
    "banned",
)

PYTHON_COMPOSITE_POLICIES: Mapping[str, str] = {
    # Python-level names whose body reaches a listed op, which CUDA casts at that inner call
    # (see "Known differences" above). Each line names the inner op that decides the policy.
    "__matmul__": _LOWER,  # torch.matmul
    "__rmatmul__": _LOWER,  # torch.matmul
    "__rdiv__": _FP32,  # also __rtruediv__: self.reciprocal() * other
    "__rtruediv__": _FP32,
    "__rpow__": _FP32,  # torch.pow(other, self), pow.Scalar
    "normalize": _FP32,  # input / input.norm(...): the norm is fp32, so the quotient is too
    "pairwise_distance": _FP32,  # at::norm
    "cross_entropy": _FP32,  # log_softmax, then nll_loss
    "softmin": _SET_OPT_DTYPE,  # (-input).softmax(dim, dtype)
    "linalg_norm": _SET_OPT_DTYPE,  # linalg_vector_norm / linalg_matrix_norm
    "interpolate": _FP32,  # upsample_* (mode="area" is adaptive_avg_pool: see _policy_of)
    "upsample": _FP32,
    "upsample_nearest": _FP32,
    "upsample_bilinear": _FP32,
    "grid_sample": _PROMOTE,  # grid_sampler
    "multi_head_attention_forward": _LOWER,  # linear/bmm/sdpa; CUDA keeps its softmax in fp32
    "lstm": _LOWER,  # on CUDA these reach _cudnn_rnn
    "gru": _LOWER,
    "rnn_tanh": _LOWER,
    "rnn_relu": _LOWER,
}
"""Python-level composites the emulation casts as CUDA would cast the op inside them."""


def _policies_by_name() -> dict[str, str]:
    table: dict[str, str] = {}
    for names, policy in (
        (CUDA_LOWER_PRECISION_FP_OPS, _LOWER),
        (CUDA_FP32_OPS, _FP32),
        (CUDA_FP32_SET_OPT_DTYPE_OPS, _SET_OPT_DTYPE),
        (CUDA_FP32_APPEND_DTYPE_OPS, _APPEND_DTYPE),
        (CUDA_PROMOTE_OPS, _PROMOTE),
        (CUDA_BANNED_OPS, _BANNED),
    ):
        for name in names:
            table[name.partition(".")[0]] = policy
    table.update(PYTHON_COMPOSITE_POLICIES)
    return table


_POLICY_BY_NAME: dict[str, str] = _policies_by_name()


def cuda_op_list(op_name: str) -> str | None:
    """Which CUDA autocast list an op name is on, as the emulation applies it.

    Args:
        op_name: An aten-style name ("linear", "layer_norm", "softmax"); an overload suffix
            (".int") is ignored.

    Returns:
        "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote",
        "banned", or None for an op on no list (it runs in its inputs' dtype).
    """
    return _POLICY_BY_NAME.get(op_name.partition(".")[0])


def default_autocast_policy(device: torch.device | str) -> AutocastPolicy:
    """Return the autocast policy a side uses on `device` unless it says otherwise.

    Both devices default to "cuda": lab runs should show what the GPU trainer does, so a CPU run
    emulates CUDA autocast rather than using torch's CPU autocast.

    Args:
        device: A torch.device or device string ("cpu", "cuda", "cuda:1").

    Returns:
        "cuda".

    Raises:
        ValueError: For a device type other than "cpu" or "cuda".
    """
    _device_type(device, where="default_autocast_policy")
    return "cuda"


def autocast_context(
    policy: str, device: torch.device | str, dtype: torch.dtype
) -> contextlib.AbstractContextManager:
    """Return the autocast context a forward on `device` runs under with `policy`.

    Args:
        policy: "cuda" (CUDA autocast's op lists; emulated on CPU tensors) or "cpu" (torch's CPU
            autocast; CPU only). See `AUTOCAST_POLICIES`.
        device: Device the model and inputs are on: a torch.device or a string like "cuda:0".
        dtype: Lower-precision dtype, torch.bfloat16 or torch.float16.

    Returns:
        ``torch.autocast("cuda", dtype=dtype)`` on CUDA; ``torch.autocast("cpu", dtype=dtype)``
        on CPU with policy "cpu"; a `CudaAutocastEmulation` on CPU with policy "cuda".

    Raises:
        ValueError: On an unknown policy, an unsupported device type or dtype, or policy "cpu"
            with a CUDA device.
    """
    if policy not in AUTOCAST_POLICIES:
        known = ", ".join(repr(p) for p in AUTOCAST_POLICIES)
        raise ValueError(
            f"Unknown autocast policy {policy!r}. Known: {known}. 'cuda' applies CUDA autocast's "
            "op lists (emulated on CPU tensors); 'cpu' is torch's own CPU autocast."
        )
    device_type = _device_type(device, where="autocast_context")
    if dtype not in AUTOCAST_DTYPES:
        allowed = ", ".join(str(d) for d in AUTOCAST_DTYPES)
        raise ValueError(
            f"autocast_context: Unsupported autocast dtype {dtype!r}. Allowed: {allowed}."
        )
    if device_type == "cuda":
        if policy != "cuda":
            raise ValueError(
                f"autocast_context: autocast policy {policy!r} is torch's CPU autocast and does "
                f"not apply to device {str(device)!r}. On CUDA use policy 'cuda'."
            )
        # No weight-cast cache: the lab swaps parameter .data between sides under one autocast
        # region, and the cache is keyed by tensor object, so it would hand one side the other's
        # cast. Values are identical without it; only re-casting time is spent.
        return torch.autocast("cuda", dtype=dtype, cache_enabled=False)
    if policy == "cpu":
        return torch.autocast("cpu", dtype=dtype, cache_enabled=False)
    return CudaAutocastEmulation(dtype)


def _device_type(device: torch.device | str, *, where: str) -> str:
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{where}: Invalid device {device!r}. Allowed: 'cpu', 'cuda'.") from error
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"{where}: Unsupported device type {device_type!r} (from {device!r}). Allowed: 'cpu', "
            "'cuda'."
        )
    return device_type


class CudaAutocastEmulation(TorchFunctionMode):
    """CUDA autocast's per-op casting policy, applied to CPU tensors.

    Use through ``autocast_context("cuda", "cpu", dtype)``; see the module docstring for how
    nested disabling works and what differs from real CUDA autocast.

    Args:
        dtype: Lower-precision dtype, torch.bfloat16 or torch.float16.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._saved_state: tuple[bool, torch.dtype, bool, torch.dtype] | None = None

    def __enter__(self) -> CudaAutocastEmulation:
        if self._saved_state is not None:
            raise RuntimeError(
                "CudaAutocastEmulation is already active; call autocast_context() again for a "
                "nested region."
            )
        self._saved_state = (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
        )
        # Both flags on: a nested torch.autocast(<either device>, enabled=False) clears one, and
        # __torch_function__ then stops casting until that region exits and restores it.
        for device_type in ("cpu", "cuda"):
            torch.set_autocast_enabled(device_type, True)
            torch.set_autocast_dtype(device_type, self.dtype)
        torch.autocast_increment_nesting()
        super().__enter__()
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        saved_state, self._saved_state = self._saved_state, None
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            if saved_state is not None:
                self._restore(saved_state)

    @staticmethod
    def _restore(saved_state: tuple[bool, torch.dtype, bool, torch.dtype]) -> None:
        cpu_enabled, cpu_dtype, cuda_enabled, cuda_dtype = saved_state
        torch.set_autocast_enabled("cpu", cpu_enabled)
        torch.set_autocast_dtype("cpu", cpu_dtype)
        torch.set_autocast_enabled("cuda", cuda_enabled)
        torch.set_autocast_dtype("cuda", cuda_dtype)
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Cast `func`'s arguments as CUDA autocast would, then call it."""
        kwargs = dict(kwargs or {})
        cpu_enabled = torch.is_autocast_enabled("cpu")
        active = cpu_enabled and torch.is_autocast_enabled("cuda")
        # torch's CPU autocast kernels must not act on top of the CUDA policy: the "cpu" flag is
        # only this emulation's on/off signal, so it is cleared while the call runs.
        torch.set_autocast_enabled("cpu", False)
        try:
            if active:
                args, kwargs = _apply_cuda_policy(
                    func, args, kwargs, torch.get_autocast_dtype("cpu")
                )
            return func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled("cpu", cpu_enabled)


def _op_name(func: Callable[..., Any]) -> str | None:
    """Aten-style name of a Python-level torch callable, or None for anything else."""
    if isinstance(func, torch._ops.OpOverload):
        return func._opname if func.namespace == "aten" else None
    if isinstance(func, torch._ops.OpOverloadPacket):
        namespace, _, name = func._qualified_op_name.partition("::")
        return name if namespace == "aten" else None
    if isinstance(func, FunctionType) and not func.__module__.startswith("torch"):
        return None  # a user function that overrides torch functions, not a torch op
    name = getattr(func, "__name__", None)
    return name.removeprefix("special_") if isinstance(name, str) else None


def _policy_of(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    name = _op_name(func)
    policy = _POLICY_BY_NAME.get(name) if name is not None else None
    if policy is not None and name in ("interpolate", "upsample"):
        mode = kwargs.get("mode", args[3] if len(args) > 3 else "nearest")
        if mode == "area":
            return None  # adaptive_avg_pool, on no CUDA list
    return policy


def _is_eligible(value: Any) -> bool:
    """Stand-in for CUDA's is_eligible: a floating, non-float64 tensor on the emulated device."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == "cpu"
    )


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _is_eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        cast = [_cast(v, dtype) for v in value]
        return cast if isinstance(value, list) else tuple(cast)
    return value


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _promote_dtype(tensors: list[torch.Tensor], lower: torch.dtype) -> torch.dtype:
    """CUDA's autocast::promote_type: fp32 if any eligible input is fp32, else `lower`."""
    current = lower
    for tensor in tensors:
        if not _is_eligible(tensor):
            continue  # float64 and non-floating inputs take no part, as in prioritize()
        if current == torch.float32 or tensor.dtype == torch.float32:
            current = torch.float32
        elif tensor.dtype != lower:
            raise RuntimeError(
                f"CUDA autocast ({lower}) refuses to promote a {tensor.dtype} input together with "
                "its other inputs (at::autocast::prioritize: Unexpected floating ScalarType). Cast "
                f"it to {lower} or torch.float32 first."
            )
    return current


def _has_explicit_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _apply_cuda_policy(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], lower: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return `func`'s arguments as CUDA autocast's wrapper for its op would pass them on."""
    policy = _policy_of(func, args, kwargs)
    if policy is None or kwargs.get("out") is not None:
        return args, kwargs  # unlisted ops and out= overloads are not autocast on CUDA either
    if policy == _BANNED:
        raise RuntimeError(
            f"{_op_name(func)} is unsafe to autocast, and CUDA autocast refuses it. Use "
            "torch.nn.functional.binary_cross_entropy_with_logits (or nn.BCEWithLogitsLoss), "
            "which CUDA autocast runs in float32."
        )
    if policy in (_SET_OPT_DTYPE, _APPEND_DTYPE):
        first = args[0] if args else kwargs.get("input", kwargs.get("self"))
        if _has_explicit_dtype(args, kwargs) or not _is_eligible(first):
            return args, kwargs
        if policy == _SET_OPT_DTYPE:
            return args, {**kwargs, "dtype": torch.float32}
        to_dtype = torch.float32
    elif policy == _LOWER:
        to_dtype = lower
    elif policy == _FP32:
        to_dtype = torch.float32
    else:
        to_dtype = _promote_dtype(_tensors(args, kwargs), lower)
    cast_args = tuple(_cast(a, to_dtype) for a in args)
    return cast_args, {k: _cast(v, to_dtype) for k, v in kwargs.items()}

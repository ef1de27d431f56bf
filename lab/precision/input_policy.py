"""input_dtype_policy at the model boundary (latents / cond / timestep), seed 000 section 2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lab.base.dtypes import DTYPES, parse_dtype

if TYPE_CHECKING:
    pass

POLICY_KEYS: tuple[str, ...] = ("latents", "cond", "timestep")
POLICY_VALUES: tuple[str | None, ...] = ("default", *DTYPES, None)
PASSTHROUGH: dict[str, str | None] = dict.fromkeys(POLICY_KEYS)
"""The base-class default: keep whatever dtype the rollout handed over, on all three."""

T = TypeVar("T")


def check_input_dtype_policy(
    policy: Mapping[str, str | None] | None, *, where: str = "input_dtype_policy"
) -> dict[str, str | None]:
    """Validate a policy and fill absent keys with passthrough (None).

    Raises:
        ValueError: On unknown keys ("unknown keys") or values, naming them and the allowed ones.
    """
    policy = dict(policy or {})
    unknown = sorted(set(policy) - set(POLICY_KEYS), key=str)
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown}. Allowed keys: {list(POLICY_KEYS)} (a kwarg's role; "
            "masks, ids and coordinates are never cast)."
        )
    for key, value in policy.items():
        if value not in POLICY_VALUES:
            allowed = ", ".join(repr(v) for v in POLICY_VALUES)
            raise ValueError(f"{where}[{key!r}]: unknown value {value!r}. Allowed: {allowed}.")
    return {**PASSTHROUGH, **policy}


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list):
        return [_cast_floating(v, dtype) for v in value]
    if isinstance(value, tuple):
        return tuple(_cast_floating(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def target_dtype(value: str | None, default_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype one policy value casts to (None for passthrough)."""
    if value is None:
        return None
    if value == "default":
        return default_dtype
    return parse_dtype(value, where="input_dtype_policy")


def apply_input_dtype_policy(
    policy: Mapping[str, str | None] | None, inputs: T, default_dtype: torch.dtype | str
) -> T:
    """Cast the floating tensors of each boundary input as the policy says.

    "default" casts to `default_dtype` (the run's forward dtype), "fp32"/"bf16"/"fp16" to that
    dtype, None passes through. Integer tensors (masks, ids) and non-tensors are never cast;
    tensors nested in lists, tuples and dicts are.

    Args:
        policy: Mapping over "latents", "cond", "timestep"; absent keys pass through.
        inputs: Either an `Inputs` record (its kwargs are cast by role; "aux" never is) or a
            mapping keyed by "latents", "cond", "timestep" (other keys are rejected).
        default_dtype: What "default" means: the forward dtype of the run.

    Returns:
        A new object of the same kind; the argument is not modified.

    Raises:
        ValueError: Unknown policy keys or values, or unknown keys in a plain mapping.
    """
    from lab.families import Inputs

    full = check_input_dtype_policy(policy)
    default = parse_dtype(default_dtype, where="apply_input_dtype_policy(default_dtype)")
    if isinstance(inputs, Inputs):
        kwargs = {}
        for key, value in inputs.kwargs.items():
            role = inputs.roles[key]
            dtype = target_dtype(full[role], default) if role in full else None
            kwargs[key] = _cast_floating(value, dtype) if dtype is not None else value
        neg = (
            apply_input_dtype_policy(full, inputs.negative, default)
            if inputs.negative is not None
            else None
        )
        from dataclasses import replace

        return replace(inputs, kwargs=kwargs, negative=neg)  # type: ignore[return-value]
    if isinstance(inputs, Mapping):
        unknown = sorted(set(inputs) - set(POLICY_KEYS), key=str)
        if unknown:
            raise ValueError(
                f"apply_input_dtype_policy: unknown keys {unknown} in inputs; a plain mapping "
                f"must be keyed by {list(POLICY_KEYS)} (or pass an Inputs record)."
            )
        out = {}
        for key, value in inputs.items():
            dtype = target_dtype(full[key], default)
            out[key] = _cast_floating(value, dtype) if dtype is not None else value
        return out  # type: ignore[return-value]
    raise TypeError(
        f"apply_input_dtype_policy: inputs must be an Inputs record or a mapping, got "
        f"{type(inputs).__name__}."
    )

"""parse_dtype(): the only place a dtype name becomes a torch.dtype."""

from __future__ import annotations

import difflib
from typing import Annotated

import torch

from lab.base.arguments import Parsed

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""The dtype names a user may write, in every config, rule and policy of the lab."""

_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def parse_dtype(dtype_name: str | torch.dtype, *, where: str = "dtype") -> torch.dtype:
    """Turn a dtype name ("bf16", "fp16", "fp32") into a torch.dtype.

    Args:
        dtype_name: One of the names in `DTYPES`, or a torch.dtype among their values.
        where: What the value configures, for the error message.

    Returns:
        The torch.dtype.

    Raises:
        ValueError: For any other name, quoting it and listing the allowed ones.
    """
    if isinstance(dtype_name, torch.dtype):
        if dtype_name in _NAMES:
            return dtype_name
        bad = str(dtype_name)
    elif isinstance(dtype_name, str) and dtype_name in DTYPES:
        return DTYPES[dtype_name]
    else:
        bad = dtype_name
    allowed = ", ".join(repr(n) for n in DTYPES)
    hint = ""
    if isinstance(bad, str):
        aliases = {
            "bfloat16": "bf16",
            "float16": "fp16",
            "half": "fp16",
            "float32": "fp32",
            "float": "fp32",
            "torch.bfloat16": "bf16",
            "torch.float16": "fp16",
            "torch.float32": "fp32",
        }
        guess = aliases.get(bad.lower()) or next(
            iter(difflib.get_close_matches(bad, DTYPES, 1)), None
        )
        if guess:
            hint = f" Did you mean {guess!r}?"
    raise ValueError(f"{where}: Unsupported dtype {bad!r}.{hint} Allowed: {allowed}.")


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a torch.dtype: "bf16", "fp16", "fp32", or str(dtype) for any other."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def check_dtype_name(value: str | torch.dtype, where: str = "dtype") -> None:
    """Refuse what `parse_dtype` refuses (the message names `where` and the nearest name)."""
    parse_dtype(value, where=where)


DtypeName = Annotated[
    str | torch.dtype, Parsed(check_dtype_name, "a dtype name ('bf16', 'fp16', 'fp32')")
]
"""A dtype as a parameter's hint: a name in DTYPES or its torch.dtype, checked by parse_dtype."""

"""resolve_device(): turn a device name into a torch.device, refusing CUDA where there is none."""

from __future__ import annotations

from typing import Annotated

import torch

from lab.base.arguments import Parsed


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse `device` ("cpu", "cuda", "cuda:1"; "meta" for shape checks) and check that it exists.

    Raises:
        ValueError: CUDA asked for on a machine without a usable GPU, or a bad device string.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device {device!r} is not a torch device name; use 'cpu' or 'cuda'."
        ) from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r} asked for, but torch {torch.__version__} sees no CUDA GPU "
                "here. Use device='cpu' (tiny preset), or run on the GPU machine."
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) visible."
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"device {str(device)!r} is not supported; use 'cpu' or 'cuda'.")
    return dev


def check_device_name(name: str, where: str = "device") -> None:
    """Refuse a name that is not a device the lab runs on ("cpu", "cuda", "cuda:N", "meta").

    Only the spelling: whether a GPU is there is `resolve_device`'s question, asked by the
    code that uses the device (listing what would run on "cuda" needs none).

    Raises:
        ValueError: Naming `where`, the name and the names that work.
    """
    try:
        kind = torch.device(name).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{where}: {name!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'.")


DeviceName = Annotated[str, Parsed(check_device_name, "a device name ('cpu', 'cuda', 'cuda:N')")]
"""A device as a parameter's hint: its spelling checked by `check_device_name` at the call."""

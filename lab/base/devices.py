"""resolve_device(): turn a device name into a torch.device, refusing CUDA where there is none."""

from __future__ import annotations

import torch


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

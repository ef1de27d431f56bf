"""Environment switches of the lab (LAB_*): read, checked against their allowed values."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


def env_choice(name: str, choices: Mapping[str, str], default: str) -> str:
    """The value of environment variable `name`, one of `choices` (`default` when unset).

    Args:
        name: The variable, e.g. "LAB_METRICS_STREAM".
        choices: Allowed value -> what it does, in the order the error lists them.
        default: The value when the variable is unset (one of `choices`).

    Raises:
        ValueError: Any other value, naming it and every allowed one with its meaning.
    """
    value = os.environ.get(name, default)
    if value not in choices:
        allowed = " or ".join(
            f"'{v}' ({what}{', the default' if v == default else ''})"
            for v, what in choices.items()
        )
        raise ValueError(f"{name}={value!r}: use {allowed}.")
    return value


@contextlib.contextmanager
def env_set(name: str, value: str | None) -> Iterator[None]:
    """Environment variable `name` set to `value` (None: unset) for the block, then restored.

    For benches and notebooks that compare a switch's settings side by side in one process.
    """
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved

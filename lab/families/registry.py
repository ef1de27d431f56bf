"""The one registry of DiT families: FAMILY_NAMES and family(name)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lab.families._family import Family

FAMILY_NAMES: tuple[str, ...] = (
    "cosmos3",
    "flux",
    "ltx2",
    "minimax_h3",
    "qwen_image",
    "sd3",
    "wan2_2",
)


def family(name: str) -> Family:
    """Import lab/families/<name>.py and return its FAMILY.

    Raises:
        ValueError: For an unknown name, listing the known ones and how to add one.
    """
    if not isinstance(name, str):
        raise ValueError(
            f"family: expected a family name (str), got {name!r} ({type(name).__name__}). "
            f"Known: {', '.join(FAMILY_NAMES)}."
        )
    if name not in FAMILY_NAMES:
        import difflib

        close = [n for n in FAMILY_NAMES if n == name.lower()] or difflib.get_close_matches(
            name.lower(), FAMILY_NAMES, 1
        )
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown family {name!r}.{hint} Known: {', '.join(FAMILY_NAMES)}. To add one, create "
            f"lab/families/{name}.py defining FAMILY and add {name!r} to FAMILY_NAMES."
        )
    return importlib.import_module(f"lab.families.{name}").FAMILY


def families() -> tuple[str, ...]:
    """Names of every registered family."""
    return FAMILY_NAMES

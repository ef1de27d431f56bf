"""The one registry of DiT families: FAMILY_NAMES and family(name)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Annotated

from lab.base.arguments import Parsed, checked_arguments

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


def check_family_name(name: str, where: str = "family") -> None:
    """Refuse a name that is not in FAMILY_NAMES.

    Raises:
        ValueError: Naming `where`, the nearest known name, every known one and how to add one.
    """
    if name not in FAMILY_NAMES:
        import difflib

        close = [n for n in FAMILY_NAMES if n == name.lower()] or difflib.get_close_matches(
            name.lower(), FAMILY_NAMES, 1
        )
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{where}: Unknown family {name!r}.{hint} Known: {', '.join(FAMILY_NAMES)}. To add "
            f"one, create lab/families/{name}.py defining FAMILY and add {name!r} to FAMILY_NAMES."
        )


FamilyName = Annotated[str, Parsed(check_family_name, "a family name (lab.families())")]
"""A family's name as a parameter's hint: checked by `check_family_name` at the call."""


@checked_arguments
def family(name: FamilyName) -> Family:
    """Import lab/families/<name>.py and return its FAMILY.

    Raises:
        ValueError: For an unknown name, listing the known ones and how to add one.
    """
    return importlib.import_module(f"lab.families.{name}").FAMILY


def families() -> tuple[str, ...]:
    """Names of every registered family."""
    return FAMILY_NAMES

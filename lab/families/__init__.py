"""The DiT families: one file per family, the `Family` contract, and the registry."""

from __future__ import annotations

from lab.families._family import PRESETS, Family, Inputs, SamplerSettings
from lab.families.registry import FAMILY_NAMES, FamilyName, families, family

__all__ = [
    "FAMILY_NAMES",
    "PRESETS",
    "Family",
    "FamilyName",
    "Inputs",
    "SamplerSettings",
    "families",
    "family",
]

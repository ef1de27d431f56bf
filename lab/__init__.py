"""Precision Lab: paired rollout-vs-trainer forwards of diffusers DiTs, module by module.

Public API: family, families, Side, pair, pair_family, forward_side, trajectory, Result.
"""

from __future__ import annotations

from lab.families import FAMILY_NAMES, Family, Inputs, families, family
from lab.result import LayerDivergence, Result, Skipped
from lab.run import forward_side, pair, pair_family
from lab.sides import PrecisionWarning, Side
from lab.trajectory import Trajectory, trajectory

__all__ = [
    "FAMILY_NAMES",
    "Family",
    "Inputs",
    "LayerDivergence",
    "PrecisionWarning",
    "Result",
    "Side",
    "Skipped",
    "Trajectory",
    "families",
    "family",
    "forward_side",
    "pair",
    "pair_family",
    "trajectory",
]

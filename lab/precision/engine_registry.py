"""The registry of engine op semantics: patch groups and switches, filled at import time.

`lab.precision.engine_groups` (the sglang-diffusion forwards) and `lab.precision.engine_ops`
(the input-level switches and `ops_applied`) register here; `engine_ops` reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lab.families import Inputs

ForwardFactory = Callable[[torch.nn.Module], Callable[..., Any]]
"""Given a module instance, return the forward to run instead of its class's."""


@dataclass(frozen=True)
class PatchGroup:
    """One engine patch group: module class name -> replacement forward factory."""

    name: str
    description: str
    forwards: Mapping[str, ForwardFactory] = field(default_factory=dict)


@dataclass(frozen=True)
class Switch:
    """One engine behaviour a side can choose; `values[0]` is the stock behaviour."""

    name: str
    description: str
    values: tuple[Any, ...]
    forwards: Mapping[Any, Mapping[str, ForwardFactory]] = field(default_factory=dict)
    """Per switch value: module class name -> forward factory (module-level switches)."""
    transform_inputs: Callable[[Inputs, Any], Inputs] | None = None
    """Input-level switches rewrite the kwargs after the side's input_dtype_policy."""


PATCH_GROUPS: dict[str, PatchGroup] = {}
SWITCHES: dict[str, Switch] = {}


def register_group(group: PatchGroup) -> PatchGroup:
    """Add a patch group to the registry (module import time)."""
    PATCH_GROUPS[group.name] = group
    return group


def register_switch(switch: Switch) -> Switch:
    """Add a switch to the registry (module import time)."""
    SWITCHES[switch.name] = switch
    return switch

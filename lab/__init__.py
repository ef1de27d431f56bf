"""Precision Lab: paired rollout-vs-trainer forwards of diffusers DiTs, module by module.

Public API: family, families, Side, pair, pair_family, forward_side, trajectory, Result,
attribute, attribute_step (grafting attribution of the output divergence or of a
trajectory step's log-prob drift), attribute_settings (which differing setting causes it) and
prescribe (the cheapest verified change that removes it).

The package is laid out by role (docs/notes/layout.md): `families/` (one file per DiT family),
`precision/` (dtypes, input policy, parameter rules, autocast, engine ops, the FSDP2 patch),
`pairing/` (sides, weights, capture, the paired run, metrics, Result, why), `rl/` (Flow-GRPO
SDE, trajectories, gradients), `engine/` (dumps, scenarios, search, real FSDP2 launches),
`causes/` (experiments that say why: rule effect, grafting attribution, pipeline checks),
`views/` (figures, report, widgets, saved runs, sweeps, CLI, notebooks) and `base/` (files,
devices, processes, errors).

The modules users call by their short name are importable from `lab` itself, loaded on first
use: `lab.plots`, `lab.widgets`, `lab.report`, `lab.scenarios`, `lab.dump`, ... (`PUBLIC_MODULES`).
`import lab.plots` and `from lab.plots import show` give the same module as `lab.views.plots`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

from lab.causes.attribute import Attribution, attribute, attribute_step
from lab.causes.prescribe import Prescription, Prescriptions, prescribe
from lab.causes.settings import SettingAttribution, attribute_settings
from lab.families import FAMILY_NAMES, Family, Inputs, families, family
from lab.pairing.result import LayerDivergence, Result, Skipped
from lab.pairing.run import forward_side, pair, pair_family
from lab.pairing.sides import PrecisionWarning, Side
from lab.rl.step_score import StepScore
from lab.rl.trajectory import Trajectory, trajectory

PUBLIC_MODULES: dict[str, str] = {
    "atomic": "lab.base.atomic",
    "baselines": "lab.views.baselines",
    "capture": "lab.pairing.capture",
    "checks": "lab.causes.checks",
    "contract": "lab.views.contract",
    "dump": "lab.engine.dump",
    "errors": "lab.base.errors",
    "flow_grpo": "lab.rl.flow_grpo",
    "fsdp": "lab.engine.fsdp",
    "gradients": "lab.rl.gradients",
    "metrics": "lab.pairing.metrics",
    "notebooks": "lab.views.notebooks",
    "parameters": "lab.views.parameters",
    "plots": "lab.views.plots",
    "report": "lab.views.report",
    "result": "lab.pairing.result",
    "rule_effect": "lab.causes.rule_effect",
    "runs": "lab.views.runs",
    "scenarios": "lab.engine.scenarios",
    "search": "lab.engine.search",
    "sides": "lab.pairing.sides",
    "sweep": "lab.views.sweep",
    "weights": "lab.pairing.weights",
    "why": "lab.pairing.why",
    "widgets": "lab.views.widgets",
}
"""Short name -> the module in its room. Each is loaded on first use (widgets pulls ipywidgets,
plots pulls plotly), and is the same module object under both names."""


def __getattr__(name: str) -> ModuleType:
    target = PUBLIC_MODULES.get(name)
    if target is None:
        raise AttributeError(f"module 'lab' has no attribute {name!r}")
    module = importlib.import_module(target)
    sys.modules.setdefault(f"lab.{name}", module)
    globals()[name] = module
    return module


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC_MODULES})


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Lets `import lab.plots` / `from lab.scenarios import run` find the module in its room."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        prefix, _, short = fullname.partition(".")
        if prefix != "lab" or short not in PUBLIC_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(PUBLIC_MODULES[spec.name.partition(".")[2]])
        # importlib sets __spec__ to this alias spec next; exec_module puts the real one back.
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The real module ran when it was imported under its own name: only undo the alias.
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _ShortNames) for f in sys.meta_path):
    sys.meta_path.append(_ShortNames())

__all__ = [
    "FAMILY_NAMES",
    "PUBLIC_MODULES",
    "Attribution",
    "Family",
    "Inputs",
    "LayerDivergence",
    "PrecisionWarning",
    "Prescription",
    "Prescriptions",
    "Result",
    "SettingAttribution",
    "Side",
    "Skipped",
    "StepScore",
    "Trajectory",
    "attribute",
    "attribute_settings",
    "attribute_step",
    "families",
    "family",
    "forward_side",
    "pair",
    "pair_family",
    "prescribe",
    "trajectory",
]

"""`PairRun`: what every pairing strategy (two passes, local, lockstep) works with."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.families import Inputs
from lab.pairing.capture import ModuleHooks, OutputReports
from lab.pairing.collect import Collector
from lab.pairing.dtype_flow import FlowRecorder
from lab.pairing.side_context import side_context
from lab.pairing.sides import Side
from lab.pairing.weights import WeightView


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on CPU); `device` may be a name ("cuda:0")."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class PairRun:
    """What every pairing strategy works with, plus the one way a side's forward is run."""

    model: torch.nn.Module
    inputs_a: Inputs
    inputs_b: Inputs
    side_a: Side
    side_b: Side
    view_a: WeightView
    view_b: WeightView
    device: torch.device
    collector: Collector
    names_filter: Callable[[str], bool] | None
    timings: dict[str, float]
    phase: dict[str, str]
    flow: FlowRecorder
    """Input dtypes (and side A's producers) of every captured call, for `lab.pairing.why`."""
    outputs: dict[str, Any] | None = None
    """When set, each side's model output lands here under "a" and "b" (`pair(outputs=)`)."""
    core: dict[str, Any] = field(default_factory=dict)
    """Lockstep: which per-output path ran ("cxx" or "python"), how many outputs each took, the
    hand-overs between the sides and the park budget in bytes (`Result.meta["pair_core"]`)."""

    def forward(
        self, which: str, hooks: ModuleHooks | None, reports: OutputReports | None = None
    ) -> None:
        """Run side `which` ("a" or "b") over the whole model with `hooks`, timed.

        `hooks=None`: the caller has attached its hooks already. `reports`: instance forwards
        reporting outputs, wrapped around the forwards this side's engine ops install.
        """
        side, view, inputs = (
            (self.side_a, self.view_a, self.inputs_a)
            if which == "a"
            else (self.side_b, self.view_b, self.inputs_b)
        )
        self.phase["side"] = side.name
        start = time.perf_counter()
        attached = hooks.attached() if hooks is not None else contextlib.nullcontext()
        reported = reports.attached() if reports is not None else contextlib.nullcontext()
        modules = (m for _, m in view.named_modules)
        with attached, view.applied(), side_context(side, self.device, self.model, modules):
            with reported:
                out = self.model(**inputs.kwargs)
        if self.outputs is not None:
            self.outputs[which] = out
        sync(self.device)
        self.timings[f"{which}_s"] = time.perf_counter() - start

"""EngineFamily: what the lab needs to know to run one family's DiT the way sglang runs it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.families import Inputs

ForwardKwargs = Callable[[torch.nn.Module, Inputs, torch.dtype], dict[str, Any]]
"""(engine model, the lab's Inputs as the diffusers pipeline builds them, DiT dtype) -> the
keyword arguments sglang's denoising stage hands that DiT."""


def scheduler_timestep(inputs: Inputs, batch: int) -> torch.Tensor:
    """The timestep sglang's denoising stage hands the DiT: the scheduler's fp32 t.

    Flow-match Euler computes `timesteps = sigmas * 1000` in fp32 and the stage repeats the
    step's t over the batch, with no cast and no division (the DiT classes scale it).

    Raises:
        ValueError: Inputs that do not carry the sigma they were built for.
    """
    if inputs.sigma is None:
        raise ValueError(
            "lab.engine.sglang: these Inputs carry no sigma, so the engine's timestep (the "
            "scheduler's fp32 sigma * 1000) cannot be built; make them with "
            "Family.make_inputs(..., sigma=...)."
        )
    t = torch.tensor(inputs.sigma, dtype=torch.float32) * 1000
    return t.repeat(batch)


def _resolve(path: str) -> Any:
    import warnings

    module, _, name = path.partition(":")
    with warnings.catch_warnings():
        # Import-time notes that only concern GPUs (AWQ / GGUF quantization on CUDA).
        warnings.filterwarnings("ignore", message=r"Only CUDA.*support.*")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, kw_only=True)
class EngineFamily:
    """One family's engine DiT: its classes, config mapping, inputs and known differences.

    Declarations, like a family file: the engine's own classes and mapping do the work.
    """

    family_name: str
    """The lab family (`lab.family(name)`)."""
    dit: str
    """The engine's DiT class, "module:Class" (sglang/multimodal_gen/runtime/models/dits/)."""
    config: str
    """Its DiTConfig class, "module:Class" (sglang/multimodal_gen/configs/models/dits/)."""
    arch: str
    """Its DiTArchConfig class, "module:Class"."""
    pipeline: str
    """Its PipelineConfig class, "module:Class": whether the denoising loop runs under
    autocast (`enable_autocast`) is read from it."""
    arch_config: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    """diffusers config -> arch config kwargs, where the names differ (None: same names)."""
    forward_kwargs: ForwardKwargs
    """How the engine's pipeline presents one step's inputs to its DiT."""
    differences: Mapping[str, str] = field(default_factory=dict)
    """diffusers module glob -> how the engine computes that module differently (a named
    cause: an op the engine implements its own way on the CPU path)."""
    cpu_op_switches: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    """Op switch -> (value, why): where the engine's CPU path runs a torch fallback that
    computes otherwise than the GPU kernel the family's rollout emulation models, the switch
    value that makes the emulation compute as the fallback does. `check_emulation` (on a CPU)
    sets them, so it compares like with like, and records them in the Result."""
    parameterless: Mapping[str, str] = field(default_factory=dict)
    """engine module glob -> why a parameterless engine module has no diffusers counterpart."""
    output_view: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """(engine module, its output leaf, diffusers' leaf) -> the engine's leaf laid out as
    diffusers' (`pair_aligned`'s view_a), where the engine lays the same values out otherwise;
    None: as they are."""
    stage_autocast: bool | None = None
    """Whether the engine's denoising stage autocasts the DiT, where its stage ignores the
    pipeline config's `enable_autocast` (None: that field decides)."""
    loaded_buffers: tuple[str, ...] = ()
    """Non-persistent buffers of the diffusers model that the engine loads as checkpoint
    entries (persistent there), handed to its loader with the state dict."""
    loader_rounds: Mapping[str, str] = field(default_factory=dict)
    """Parameter glob -> dtype name the engine's loader rounds those parameters to whatever the
    DiT precision, before its post-load step widens them again (Cosmos3's embed_tokens, held
    bf16-valued); `check_weights` accepts exactly that rounding there, and nowhere else."""
    source: str = ""
    """Where in the engine the input conventions were read (file:function), for the docs."""

    def autocast(self) -> bool:
        """Whether the engine's denoising loop runs the DiT under torch.autocast.

        Its pipeline config's `enable_autocast`; the stage then autocasts to the DiT precision.
        A family whose stage ignores that field says so in `stage_autocast`.
        """
        import dataclasses

        if self.stage_autocast is not None:
            return self.stage_autocast
        fields = {f.name: f for f in dataclasses.fields(_resolve(self.pipeline))}
        return bool(fields["enable_autocast"].default)

    def dit_class(self) -> type[torch.nn.Module]:
        """The engine's DiT class (imports sglang)."""
        return _resolve(self.dit)

    def make_config(self, diffusers_config: Mapping[str, Any]) -> Any:
        """The engine's DiTConfig for a diffusers config (the same architecture)."""
        arch_cls, config_cls = _resolve(self.arch), _resolve(self.config)
        fields = getattr(arch_cls, "__dataclass_fields__", {})
        kwargs = (
            self.arch_config(diffusers_config)
            if self.arch_config is not None
            else {k: v for k, v in diffusers_config.items() if k in fields}
        )
        unknown = sorted(k for k in kwargs if k not in fields)
        if unknown:
            raise ValueError(
                f"{self.family_name}: the engine's {arch_cls.__name__} has no field(s) {unknown}."
            )
        return config_cls(arch_config=arch_cls(**kwargs))

"""build_engine(): the engine's DiT for a lab model, loaded the engine's way from its weights."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.base.dtypes import dtype_name, parse_dtype
from lab.engine.sglang.adapter import EngineFamily
from lab.engine.sglang.runtime import (
    cpu_routing_applied,
    forward_context,
    start_engine,
)
from lab.families import Inputs
from lab.pairing.alignment import Alignment, derive_alignment


@dataclass
class EngineModel:
    """The engine's DiT built from a lab model's weights, with how its modules align to them."""

    family_name: str
    module: torch.nn.Module
    """The engine's model (sglang's DiT class), weights in `dtype` as its loader left them."""
    dtype: torch.dtype
    """The DiT precision it was loaded at (the engine's --dit-precision)."""
    version: str
    alignment: Alignment
    """Engine module -> diffusers module(s), derived from the engine's parameter mapping."""
    weights: dict[str, Any]
    """How the loaded weights compare with the lab model's (see `check_weights`)."""
    spec: EngineFamily = field(repr=False)

    def forward_kwargs(self, inputs: Inputs) -> dict[str, Any]:
        """The kwargs the engine's pipeline hands this DiT for the lab's `inputs`."""
        return self.spec.forward_kwargs(self.module, inputs, self.dtype)

    def forward(self, inputs: Inputs) -> Any:
        """One forward, as the engine's denoising stage runs it.

        No grad, inside the engine's forward context and, where its pipeline config enables
        it, under `torch.autocast(cpu, dit precision)` (the engine's own `autocast_context`).
        The engine's native ops run eagerly (`cpu_routing.eager`).
        """
        from sglang.multimodal_gen.runtime.utils.precision import autocast_context

        from lab.engine.sglang.cpu_routing import eager

        kwargs = self.forward_kwargs(inputs)
        with (
            torch.no_grad(),
            eager(),
            autocast_context(self.dtype, disable_autocast=not self.spec.autocast()),
            forward_context(),
        ):
            return self.module(**kwargs)

    def description(self) -> dict[str, Any]:
        """What a Result records as this side (its `side_a`)."""
        return {
            "engine": f"sglang {self.version}",
            "dit_class": type(self.module).__name__,
            "dit_precision": dtype_name(self.dtype),
            "autocast": self.spec.autocast(),
            "fp32_params": self.weights["fp32_params"],
            "cpu_routing": list(cpu_routing_applied()),
            "inputs": self.spec.source,
        }


def _master_state(model: torch.nn.Module, buffers: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The lab model's fp32 master values by diffusers name (a compact master upcast exactly).

    `buffers`: non-persistent buffers the engine loads as checkpoint entries
    (`EngineFamily.loaded_buffers`), added to the state dict.
    """
    held = dict(model.named_buffers())
    state = {}
    for name, t in [*model.state_dict().items(), *((b, held[b]) for b in buffers)]:
        state[name] = t.float() if t.is_floating_point() and t.dtype != torch.float32 else t
    return state


def build_engine(
    model: torch.nn.Module,
    spec: EngineFamily,
    dtype: str = "bf16",
) -> EngineModel:
    """Build the engine's DiT for `model` (a lab-built or loaded diffusers model).

    The engine's own loader does it (`maybe_load_fsdp_model`, as its DiT component loader calls
    it for one process without FSDP): the class is constructed on the meta device under the
    DiT precision (parameters it declares fp32 stay fp32), the diffusers state dict is mapped
    with the class's `param_names_mapping` (fusing what it fuses) and cast to each parameter's
    dtype, then its post-load steps run. The loaded weights are then checked, parameter by
    parameter, against the lab model's cast the same way.

    Args:
        model: The fp32 master (from `Family.build` or `Family.load`).
        spec: The family's engine declaration (`engine_family(name)`).
        dtype: The DiT precision: "bf16" (the engine's default), "fp16" or "fp32".

    Returns:
        The EngineModel.

    Raises:
        EngineUnavailable: sglang missing or another version.
        ValueError: A bad dtype, or loaded weights that differ from the lab model's.
    """
    version = start_engine(f"build_engine({spec.family_name!r})")
    torch_dtype = parse_dtype(dtype, where="build_engine dtype")
    from sglang.multimodal_gen.runtime.loader.fsdp_load import maybe_load_fsdp_model
    from sglang.multimodal_gen.runtime.loader.utils import get_param_names_mapping

    config = spec.make_config(dict(model.config))
    cls = spec.dit_class()
    state = _master_state(model, spec.loaded_buffers)
    engine = maybe_load_fsdp_model(
        cls,
        # The engine's transformer loader hands the class the checkpoint's config.json too.
        dict(config=config, hf_config=dict(model.config)),
        [],
        torch.device("cpu"),
        1,
        1,
        torch_dtype,
        torch.float32,
        weights_iterator=iter(state.items()),
        strict=True,
        pin_cpu_memory=False,
    )
    mapping = get_param_names_mapping(
        engine.param_names_mapping, valid_target_names=set(engine.state_dict())
    )
    alignment = derive_alignment(
        engine,
        model,
        mapping,
        name_a=f"sglang {version} {cls.__name__}",
        name_b=f"diffusers {type(model).__name__}",
        parameterless=spec.parameterless,
    )
    weights = check_weights(engine, model, alignment, torch_dtype, spec.loader_rounds)
    return EngineModel(
        family_name=spec.family_name,
        module=engine,
        dtype=torch_dtype,
        version=version,
        alignment=alignment,
        weights=weights,
        spec=spec,
    )


def _pieces(
    model: torch.nn.Module, alignment: Alignment
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    params_b = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for name_a, sources in alignment.params.items():
        yield name_a, [params_b[b].detach() for b, _ in sources]


def check_weights(
    engine: torch.nn.Module,
    model: torch.nn.Module,
    alignment: Alignment,
    dtype: torch.dtype,
    loader_rounds: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Compare every engine parameter with the lab model's (pieces fused, cast to its dtype).

    Returns:
        {"parameters", "equal", "dtype", "fp32_params" (engine parameters held fp32 at a lower
        DiT precision), "rounded_params" (those of them whose values the loader rounded to the
        DiT precision before its post-load step widened them again: equal to the lab model's
        cast to the DiT precision), "fingerprint" (of the lab model's weights)}.

    Raises:
        ValueError: Any parameter that is not the lab model's value cast to the engine's dtype.
    """
    from lab.engine.dump import weight_fingerprints

    params_a = dict(engine.named_parameters())
    # Where the engine lays a checkpoint out its own way before loading (MiniMax H3's
    # `_diffusers_h3_checkpoint` swaps the SwiGLU halves), its own code lays ours out too.
    preprocess = getattr(engine, "preprocess_loaded_state_dict", None)
    laid_out = dict(preprocess(iter(_master_state(model).items()))) if preprocess else {}
    differ = []
    rounded = []
    equal = 0
    for name_a, pieces in _pieces(model, alignment):
        held = params_a[name_a].detach()
        want = laid_out.get(name_a)
        if want is None:
            want = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        want = want.float()
        if torch.equal(held, want.to(held.dtype)):
            equal += 1
        elif any(
            low != held.dtype and torch.equal(held, want.to(low).to(held.dtype))
            for low in _loaded_at(name_a, dtype, loader_rounds or {})
        ):
            # Loaded at the DiT precision (or the dtype its loader declares for it), then
            # widened by its post-load step: Cosmos3's time_embedder and embed_tokens.
            rounded.append(name_a)
            equal += 1
        else:
            differ.append(name_a)
    if differ:
        raise ValueError(
            f"build_engine: {len(differ)} engine parameter(s) are not the lab model's weights "
            f"cast to their dtype: {', '.join(repr(n) for n in differ[:4])}. The engine's "
            "loader changed values it should only have cast."
        )
    fingerprints, _ = weight_fingerprints(model)
    digest = hashlib.blake2b(
        json.dumps(fingerprints, sort_keys=True, default=str).encode(), digest_size=8
    ).hexdigest()
    return {
        "parameters": len(params_a),
        "equal": equal,
        "dtype": dtype_name(dtype),
        "fp32_params": sorted(
            n for n, p in params_a.items() if p.dtype == torch.float32 and dtype != torch.float32
        ),
        "rounded_params": rounded,
        "fingerprint": digest,
    }


def _loaded_at(name: str, dtype: torch.dtype, loader_rounds: Mapping[str, str]) -> set[torch.dtype]:
    """The dtypes an engine parameter may have been loaded at (before a post-load widening).

    The DiT precision, and the one `EngineFamily.loader_rounds` declares for the parameter.
    """
    from fnmatch import fnmatchcase

    from lab.base.dtypes import parse_dtype

    declared = {
        parse_dtype(d, where="EngineFamily.loader_rounds")
        for glob, d in loader_rounds.items()
        if fnmatchcase(name, glob)
    }
    return {dtype, *declared}

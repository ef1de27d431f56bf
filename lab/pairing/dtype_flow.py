"""DtypeFlow: what each captured module call was handed and held on each side (for `lab.why`).

Two parts. The static part needs no forward: both sides' `WeightPlan`s (each parameter's and
buffer's dtype and what decided it) and the model's module tree (each module's own parameters
and buffers, whether it is an attention module). The recorded part is what the forwards did:
the dtypes of the tensors each captured module call received on each side and, on side A in
propagated mode, which captured output (or model input) each of those tensors was. The hooks
that pair the outputs record it as they pass (a tuple a call, no tensor kept); nothing is
explained until a Result is asked for its `why`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lab.base.dtypes import dtype_name
from lab.pairing.capture import ROOT

if TYPE_CHECKING:
    from lab.pairing.collect import Aliases
    from lab.pairing.weights import WeightPlan, WeightView

MODEL_INPUT = "<input>"
"""Producer label of a tensor the model was called with (the output index is the kwarg)."""

Producer = tuple[str, int, str]
"""(module path, call, output index) of the captured output a tensor was, or
(MODEL_INPUT, 0, kwarg) for a model input."""

InputEntry = tuple[Any, torch.dtype, Producer | None, int]
"""One tensor a module call received: (argument, dtype, producer on side A or None, id).

The argument is a positional index, a kwarg name, or (either, index) inside a tuple/list.
The id tells a tensor handed on unchanged from the enclosing call's own inputs (that call's
arguments stay alive while it runs, so no other tensor can hold their ids meanwhile)."""


@dataclass(frozen=True)
class ModuleTensors:
    """One module's own parameters and buffers (not its submodules'), and what kind it is."""

    params: tuple[tuple[str, str], ...]
    """(canonical parameter name, dtype name of its master) for each parameter it owns."""
    buffers: tuple[tuple[str, str, bool], ...]
    """(full buffer name, dtype name, persistent) for each floating buffer it owns."""
    attention: bool
    """It computes attention itself (a diffusers attention module or nn.MultiheadAttention):
    the side's attention_backend picks its kernel."""


@dataclass
class DtypeFlow:
    """Static plans plus what the pair's forwards recorded; `lab.pairing.why.explain` reads it."""

    mode: str
    plan_a: WeightPlan
    plan_b: WeightPlan
    modules: Mapping[str, ModuleTensors]
    """Module path (ROOT for the model) -> its own tensors."""
    input_roles: Mapping[str, str]
    """The model's kwargs -> role ("latents", "cond", "timestep", "aux")."""
    inputs_a: dict[tuple[str, int], tuple[InputEntry, ...]] = field(default_factory=dict)
    """(module path, call) -> the tensors side A's call received (with producers)."""
    inputs_b: dict[tuple[str, int], tuple[InputEntry, ...]] = field(default_factory=dict)
    """(module path, call) -> the tensors side B's call received (producers not tracked)."""


class FlowRecorder:
    """Collects the recorded part of a DtypeFlow from inside the pairing hooks.

    Cost per captured call: one pass over its arguments (dtype reads, and on side A one dict
    lookup a tensor for its producer), stored as a tuple.
    """

    def __init__(self) -> None:
        """Record nothing yet; `track` ties producer lookup to side A's tensor names."""
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded (a run that starts over); `track` again before use."""
        self.inputs: dict[str, dict[tuple[str, int], tuple[InputEntry, ...]]] = {"a": {}, "b": {}}
        self.produced: dict[int, Producer] = {}
        """Side A's `Aliases` name of an output (or model input) -> where it was produced."""
        self._bases: dict[int, tuple[weakref.ref, int, Producer]] = {}
        self._aliases: Aliases | None = None

    def track(self, aliases_a: Aliases, model_inputs: Mapping[str, Any]) -> None:
        """Look producers up among side A's named tensors; name the model inputs first."""
        self._aliases = aliases_a
        for key, value in model_inputs.items():
            if isinstance(value, torch.Tensor):
                name = aliases_a.name(value)
                if name is not None:
                    self.produced.setdefault(name, (MODEL_INPUT, 0, key))

    def note_output(self, name: int | None, key: Producer, leaf: Any) -> None:
        """Side A's output `leaf` (named `name` by its Aliases) came from capture `key`.

        Its storage base is noted too: a Linear's output on CPU is a view of a 2-D matmul
        result, and the next module often receives another view of that same base.
        """
        if name is None:
            return
        self.produced.setdefault(name, key)
        base = leaf._base
        if base is not None:
            noted = self._bases.get(id(base))
            # A dead entry is an earlier base whose id was reused.
            if noted is None or noted[0]() is not base:
                self._bases[id(base)] = (weakref.ref(base), base._version, key)

    def record(self, which: str, label: str, call: int, args: tuple, kwargs: dict) -> None:
        """Note the dtypes (and on side A the producers) of one call's tensor arguments."""
        track = which == "a" and self._aliases is not None
        producer = self._producer
        tensor = torch.Tensor
        if not kwargs and len(args) == 1 and isinstance(args[0], tensor):
            # Most captured calls (linears, norms, activations) take one tensor: its entry
            # is the loop's below, without the loop.
            value = args[0]
            found = producer(value) if track else None
            self.inputs[which][(label, call)] = ((0, value.dtype, found, id(value)),)
            return
        entries: list[InputEntry] = []
        for items in (enumerate(args), kwargs.items()):
            for key, value in items:
                if isinstance(value, tensor):
                    found = producer(value) if track else None
                    entries.append((key, value.dtype, found, id(value)))
                elif type(value) is tuple or type(value) is list:
                    for j, item in enumerate(value):
                        if isinstance(item, tensor):
                            found = producer(item) if track else None
                            entries.append(((key, j), item.dtype, found, id(item)))
        self.inputs[which][(label, call)] = tuple(entries)

    def _producer(self, tensor: torch.Tensor) -> Producer | None:
        known = self._aliases.known  # type: ignore[union-attr]
        name = known(tensor)
        if name is not None:
            return self.produced.get(name)
        # A view (reshape, transpose, chunk) of a captured output holds that output's values.
        base = tensor._base
        if base is None:
            return None
        name = known(base)
        if name is not None:
            return self.produced.get(name)
        noted = self._bases.get(id(base))
        if noted is not None and noted[0]() is base and noted[1] == base._version:
            return noted[2]
        return None

    def flow(
        self,
        mode: str,
        view_a: WeightView,
        view_b: WeightView,
        input_roles: Mapping[str, str],
    ) -> DtypeFlow:
        """The DtypeFlow of this pair (the static part is shared per model and view)."""
        return DtypeFlow(
            mode=mode,
            plan_a=view_a.plan,
            plan_b=view_b.plan,
            modules=module_tensors(view_a),
            input_roles=dict(input_roles),
            inputs_a=self.inputs["a"],
            inputs_b=self.inputs["b"],
        )


def module_tensors(view: WeightView) -> Mapping[str, ModuleTensors]:
    """Every module's own parameters and buffers, from the view's model (cached per view).

    Cached per view layout (the plan, shared by every view of a model and side while its
    module tree is the same) unless a parameter is held compact, so repeated pairs walk the
    modules once.
    """
    key = view if view._logical_params else view.layout
    cached = _MODULE_TENSORS.get(key)
    if cached is not None:
        return cached
    model = view.model
    canonical: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(param), name)
    out: dict[str, ModuleTensors] = {}
    for name, module in model.named_modules():
        params = tuple(
            (canonical[id(p)], dtype_name(view.logical_dtype(p)))
            for p in module._parameters.values()
            if p is not None
        )
        buffers = tuple(
            (
                f"{name}.{b}" if name else b,
                dtype_name(t.dtype),
                b not in module._non_persistent_buffers_set,
            )
            for b, t in module._buffers.items()
            if t is not None and t.is_floating_point()
        )
        out[name or ROOT] = ModuleTensors(params, buffers, _is_attention(module))
    _MODULE_TENSORS[key] = out
    return out


def _is_attention(module: torch.nn.Module) -> bool:
    # diffusers' attention modules (Attention, FluxAttention, WanAttention, ...) carry the
    # processor that calls scaled_dot_product_attention.
    return isinstance(module, torch.nn.MultiheadAttention) or callable(
        getattr(module, "set_processor", None)
    )


_MODULE_TENSORS: weakref.WeakKeyDictionary[Any, Mapping[str, ModuleTensors]] = (
    weakref.WeakKeyDictionary()
)

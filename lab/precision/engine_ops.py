"""Rollout-engine op semantics on one side: patch groups and switches, per instance, reversible.

A patch group ("sgld", "qwen_image_native", "wan", ...) names where sglang-diffusion's ops
round, as module-class -> replacement-forward factories. Switches are single behaviours a side can
turn on (the scheduler's fp32 timestep, drop an all-True attention mask, ...). Both are
applied by `ops_applied(root, groups, switches)`: every module in `root` gets the forward its
side asks for as an *instance* attribute (or loses an outer side's one), and everything is
restored on exit, so nothing leaks into the other side, a nested re-run, or the process.
"""

from __future__ import annotations

import contextlib
import difflib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from lab.precision.engine_registry import (
    PATCH_GROUPS,
    SWITCHES,
    ForwardFactory,
    PatchGroup,
    Switch,
    register_group,
    register_switch,
)

if TYPE_CHECKING:
    from lab.families import Inputs

__all__ = [
    "PATCH_GROUPS",
    "SWITCHES",
    "ForwardFactory",
    "PatchGroup",
    "Switch",
    "check_engine_ops",
    "check_groups_apply",
    "forward_source",
    "ops_applied",
    "ops_dispatched",
    "register_group",
    "register_switch",
    "switch_derived_inputs",
    "transform_inputs",
]


def check_engine_ops(
    groups: tuple[str, ...], switches: Mapping[str, Any], *, where: str = "Side"
) -> None:
    """Validate group names and switch names/values; errors name `where`.engine_ops or .op_switches.

    Raises:
        ValueError: An unknown group, switch or switch value, listing the known ones.
    """
    _load_definitions()
    unknown = [g for g in groups if g not in PATCH_GROUPS]
    if unknown:
        raise ValueError(
            f"{where}.engine_ops: unknown patch group(s) {unknown}. Known: "
            f"{', '.join(PATCH_GROUPS)}."
        )
    for name, value in switches.items():
        if name not in SWITCHES:
            close = difflib.get_close_matches(name, list(SWITCHES), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{where}.op_switches: unknown op switch {name!r}.{hint} Known: "
                f"{', '.join(SWITCHES)}."
            )
        if value not in SWITCHES[name].values:
            allowed = ", ".join(repr(v) for v in SWITCHES[name].values)
            raise ValueError(
                f"{where}.op_switches[{name!r}]: unknown value {value!r}. Allowed: {allowed}."
            )


_CLASS_NAMES: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]] = (
    weakref.WeakKeyDictionary()
)
"""A model's module class names, walked once per model (`check_groups_apply` runs on every
plain forward: a full-size model has 1000-3600 modules)."""


def check_groups_apply(groups: tuple[str, ...], model: torch.nn.Module, where: str) -> None:
    """Refuse a patch group that patches no module of `model` (it would change nothing).

    A side asking for "wan" on a Flux model ran the stock forwards and read as the engine's
    semantics; the groups that do patch this model's classes are named instead.

    Raises:
        ValueError: Naming the group, the classes it patches and the groups that fit.
    """
    if not groups:
        return
    _load_definitions()
    classes = _CLASS_NAMES.get(model)
    if classes is None:
        classes = _CLASS_NAMES[model] = frozenset(type(m).__name__ for m in model.modules())
    for g in groups:
        if g in PATCH_GROUPS and not classes & set(PATCH_GROUPS[g].forwards):
            fits = [k for k, grp in PATCH_GROUPS.items() if classes & set(grp.forwards)]
            raise ValueError(
                f"{where}.engine_ops: patch group {g!r} patches "
                f"{', '.join(sorted(PATCH_GROUPS[g].forwards))}, and this model "
                f"({type(model).__name__}) has none of them: it would change nothing. "
                + (
                    f"Groups that patch this model: {', '.join(fits)}."
                    if fits
                    else "No patch group patches this model; drop engine_ops (op_switches "
                    "still apply)."
                )
            )


def forward_source(
    class_name: str, groups: tuple[str, ...], switches: Mapping[str, Any]
) -> tuple[str, str, Any] | None:
    """Which patch group or switch installs the forward a module of `class_name` runs.

    Returns:
        ("group", group name, None), ("switch", switch name, its value), or None when the
        module runs its class's own forward on this side.
    """
    _load_definitions()
    return _source(class_name, groups, switches)


def _source(
    class_name: str, groups: tuple[str, ...], switches: Mapping[str, Any]
) -> tuple[str, str, Any] | None:
    chosen = None
    # Later groups win over earlier ones (a family group appends after the CLI group);
    # module-level switches win over groups.
    for g in groups:
        if class_name in PATCH_GROUPS[g].forwards:
            chosen = ("group", g, None)
    for name, value in switches.items():
        if class_name in SWITCHES[name].forwards.get(value, {}):
            chosen = ("switch", name, value)
    return chosen


def _forward_for(
    module: torch.nn.Module, groups: tuple[str, ...], switches: Mapping[str, Any]
) -> ForwardFactory | None:
    cls = type(module).__name__
    source = _source(cls, groups, switches)
    if source is None:
        return None
    kind, name, value = source
    if kind == "group":
        return PATCH_GROUPS[name].forwards[cls]
    return SWITCHES[name].forwards[value][cls]


@contextlib.contextmanager
def ops_applied(
    root: torch.nn.Module,
    groups: tuple[str, ...],
    switches: Mapping[str, Any],
    modules: Iterable[torch.nn.Module] | None = None,
) -> Iterator[None]:
    """Give every module in `root` the forward this side asks for; restore all on exit.

    A module an outer side patched runs this side's forward (its patch, or the class's own).
    `modules`: `root.modules()`, when the caller has them already (no walk).
    """
    with ops_dispatched(root, {"": (groups, switches)}, lambda: "", modules):
        yield


@contextlib.contextmanager
def ops_dispatched(
    root: torch.nn.Module,
    per_side: Mapping[str, tuple[tuple[str, ...], Mapping[str, Any]]],
    current: Callable[[], str],
    modules: Iterable[torch.nn.Module] | None = None,
) -> Iterator[None]:
    """Several sides' forwards on one model at once, chosen per call by `current()`.

    For two forwards interleaved module by module (threads in lockstep): every module that
    some side patches gets one instance forward that asks `current()` which side is calling
    and runs that side's forward (its patch, or the class's own). Restored on exit.

    Args:
        root: The model.
        per_side: Side key -> (patch groups, switches) of that side.
        current: Returns the key of the side whose forward is running now.
        modules: `root.modules()`, when the caller has them already (no walk).
    """
    _load_definitions()
    saved: list[tuple[torch.nn.Module, Any]] = []
    missing = object()
    # What each side runs depends on the module's class only: looked up once a class (a
    # full-size model has ~1000 modules of ~30 classes).
    # Class -> (each side's factory, whether no side patches the class).
    by_class: dict[type, tuple[dict[str, ForwardFactory | None], bool]] = {}
    try:
        for module in root.modules() if modules is None else modules:
            looked_up = by_class.get(type(module))
            if looked_up is None:
                factories = {k: _forward_for(module, g, s) for k, (g, s) in per_side.items()}
                looked_up = by_class[type(module)] = (
                    factories,
                    all(f is None for f in factories.values()),
                )
            factories, unpatched = looked_up
            current_forward = module.__dict__.get("forward", missing)
            if unpatched and current_forward is missing:
                continue
            saved.append((module, current_forward))
            if unpatched:
                # An outer side's patch: every side here runs the class's own forward.
                del module.__dict__["forward"]
                continue
            own = type(module).forward.__get__(module)
            forwards = {k: own if f is None else f(module) for k, f in factories.items()}
            if len(forwards) == 1:
                (module.forward,) = forwards.values()
                continue

            def dispatch(*args: Any, _forwards: dict = forwards, **kwargs: Any) -> Any:
                return _forwards[current()](*args, **kwargs)

            module.forward = dispatch
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is missing:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous


def transform_inputs(inputs: Inputs, switches: Mapping[str, Any]) -> Inputs:
    """Apply the input-level switches (after the side's input_dtype_policy)."""
    _load_definitions()
    for name, value in switches.items():
        switch = SWITCHES[name]
        if switch.transform_inputs is not None and value != switch.values[0]:
            inputs = switch.transform_inputs(inputs, value)
    return inputs


def switch_derived_inputs(inputs: Inputs) -> list[Inputs]:
    """`inputs` as each input-level switch's non-stock values derive them, one switch at a time.

    The forms a forward of these inputs may have seen on a side that runs a switch (the
    scheduler's timestep, a dropped identity mask): a dump's provenance check accepts them as
    these inputs. A switch that does not apply to the inputs is left out.
    """
    _load_definitions()
    derived = []
    for switch in SWITCHES.values():
        if switch.transform_inputs is None:
            continue
        for value in switch.values[1:]:
            try:
                derived.append(switch.transform_inputs(inputs, value))
            except ValueError:
                continue  # not these inputs' switch (no sigma, another family's model)
    return derived


# ---- input-level switches -------------------------------------------------------------------


def _drop_identity_mask(inputs: Inputs, value: Any) -> Inputs:
    kwargs = dict(inputs.kwargs)
    for key, tensor in inputs.kwargs.items():
        if (
            "mask" in key
            and isinstance(tensor, torch.Tensor)
            and tensor.dtype == torch.bool
            and bool(tensor.all())
        ):
            kwargs[key] = None
    neg = _drop_identity_mask(inputs.negative, value) if inputs.negative is not None else None
    return replace(inputs, kwargs=kwargs, negative=neg)


def _positions_in_latent_dtype(inputs: Inputs, value: Any) -> Inputs:
    latents = [inputs.kwargs[k] for k in inputs.keys_with_role("latents")]
    dtype = next((t.dtype for t in latents if isinstance(t, torch.Tensor)), None)
    if dtype is None:
        return inputs
    kwargs = dict(inputs.kwargs)
    for key in ("video_coords", "audio_coords"):
        if isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = kwargs[key].to(dtype)
    neg = (
        _positions_in_latent_dtype(inputs.negative, value) if inputs.negative is not None else None
    )
    return replace(inputs, kwargs=kwargs, negative=neg)


register_switch(
    Switch(
        name="drop_identity_mask",
        description="Drop an all-True boolean attention mask (bitwise no-op; unlocks flash).",
        values=(False, True),
        transform_inputs=_drop_identity_mask,
    )
)
register_switch(
    Switch(
        name="positions_dtype",
        description="LTX-2.3 RoPE positions: 'fp32' (diffusers) or 'latent' (native forward: "
        "the latent's dtype, e.g. bf16).",
        values=("fp32", "latent"),
        transform_inputs=_positions_in_latent_dtype,
    )
)


def _load_definitions() -> None:
    """Import the module that registers the patch groups (imported lazily: it imports diffusers).

    A failure to import it is an error, never an empty registry.
    """
    import lab.precision.engine_groups  # noqa: F401

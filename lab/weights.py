"""WeightView: one side's view of the fp32 master weights, swapped in for a forward and back out.

A side never gets its own copy of the model: for the duration of a forward, each parameter's
`.data` (and, for engine-like sides, each persistent floating buffer) is replaced by the tensor
that side would hold or gather (master -> master_dtype -> per-parameter dtype), and restored
afterwards. The model object, its hooks and its parameters stay the same objects throughout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lab.precision.dtypes import dtype_name, parse_dtype
from lab.precision.param_rules import (
    ParamDtypeMaps,
    block_wraps,
    compile_param_dtype_maps,
    ruled_param_dtypes,
)
from lab.sides import Side


@dataclass(frozen=True)
class WeightPlan:
    """Per-parameter and per-buffer dtypes one side runs with."""

    param_dtypes: dict[str, torch.dtype]
    """Canonical parameter name -> dtype for the forward."""
    buffer_dtypes: dict[str, torch.dtype]
    """Buffer name -> dtype, only for buffers the side casts."""
    master_dtype: torch.dtype
    maps: ParamDtypeMaps | None
    """The FSDP2 lowering of the side's rules (None without rules)."""

    def dtype_counts(self) -> dict[str, int]:
        """How many parameters run at each dtype (for summaries)."""
        counts: dict[str, int] = {}
        for d in self.param_dtypes.values():
            counts[dtype_name(d)] = counts.get(dtype_name(d), 0) + 1
        return counts


def _has_component(name: str, components: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return any(c in parts for c in components)


def plan_weights(model: torch.nn.Module, side: Side) -> WeightPlan:
    """Decide the dtype of every parameter and buffer for `side`.

    Order: the side's param_dtype, then keep_fp32_modules (engine load semantics: any dotted
    component equal to a listed module name), then param_dtype_rules (later rules win).

    Raises:
        ValueError: A keep_fp32_modules entry naming no module, or a bad rule (see
            `compile_param_dtype_maps`).
    """
    default = parse_dtype(side.resolved_param_dtype, where=f"Side({side.name!r}).param_dtype")
    fp32 = torch.float32
    names = [n for n, _ in _unique_named(model.named_parameters(remove_duplicate=False))]
    dtypes = {n: default for n in names}
    if side.keep_fp32_modules:
        module_parts = {part for n, _ in model.named_modules() for part in n.split(".")}
        missing = [m for m in side.keep_fp32_modules if m not in module_parts]
        if missing:
            raise ValueError(
                f"Side({side.name!r}).keep_fp32_modules: {missing} name no module of "
                f"{type(model).__name__}. Entries are module-name components such as 'norm2'."
            )
        for n in names:
            if _has_component(n, side.keep_fp32_modules):
                dtypes[n] = fp32
    maps = None
    if side.param_dtype_rules:
        wraps = block_wraps(model, side.fsdp_wrap_classes) if side.fsdp_wrap_classes else []
        maps = compile_param_dtype_maps(model, wraps, side.param_dtype_rules, default)
        # Every parameter a rule matched takes that rule's dtype, also when it equals the
        # default: such a rule carves a parameter back out of keep_fp32_modules.
        for n, d in ruled_param_dtypes(model, side.param_dtype_rules).items():
            dtypes[n] = d
    buffers: dict[str, torch.dtype] = {}
    if side.cast_buffers:
        for mod_name, module in model.named_modules():
            for buf_name, buf in module._buffers.items():
                full = f"{mod_name}.{buf_name}" if mod_name else buf_name
                persistent = buf_name not in module._non_persistent_buffers_set
                if buf is None or not buf.is_floating_point() or not persistent:
                    continue
                buffers[full] = fp32 if _has_component(full, side.keep_fp32_modules) else default
    master = parse_dtype(side.master_dtype, where=f"Side({side.name!r}).master_dtype")
    return WeightPlan(param_dtypes=dtypes, buffer_dtypes=buffers, master_dtype=master, maps=maps)


def _unique_named(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


class WeightView:
    """The tensors one side runs with, cast lazily from the master and cached if asked.

    With `stream_classes`, the blocks of those classes are not cast when the view is applied:
    each block's tensors are cast by a forward pre-hook right before it runs and dropped by a
    forward hook right after, so the side never holds a second full copy of the weights, only
    the master plus one block (what FSDP2's per-block all-gather holds).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        side: Side,
        *,
        cache: bool = False,
        stream_classes: tuple[str, ...] = (),
    ) -> None:
        """Plan the side's dtypes for `model` (validating its rules) without casting yet."""
        self.model = model
        self.side = side
        self.plan = plan_weights(model, side)
        self.cache = cache
        self._cached: dict[int, torch.Tensor] = {}
        named = list(_unique_named(model.named_parameters(remove_duplicate=False)))
        self._param_names = {id(p): n for n, p in named}
        # Masters are taken now, before any view is applied, so a view nested inside another
        # side's view still casts from the fp32 master rather than from the outer side's copy.
        self._masters = {id(p): p.data for _, p in named}
        self._buffer_masters = {
            f"{m}.{b}" if m else b: t
            for m, module in model.named_modules()
            for b, t in module._buffers.items()
            if t is not None
        }
        self._module_names = {id(m): n for n, m in model.named_modules()}
        self.streamed_ids = _outermost(model, stream_classes)
        """Ids of the blocks whose weights are cast by hooks (outermost of stream_classes)."""

    def _cast(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if master.dtype == dtype and self.plan.master_dtype in (dtype, master.dtype):
            return master
        return master.to(self.plan.master_dtype).to(dtype)

    def _swap_in(self, root: torch.nn.Module, skip: set[int], undo: list[tuple[Any, ...]]) -> None:
        """Swap this side's tensors into `root`, except inside modules whose id is in `skip`."""
        prefix = self._module_names[id(root)]
        seen: set[int] = set()
        for mod_name, module in _named_modules_skipping(root, skip):
            for param in module._parameters.values():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                dtype = self.plan.param_dtypes[self._param_names[id(param)]]
                tensor = self._cached.get(id(param))
                if tensor is None:
                    tensor = self._cast(self._masters[id(param)], dtype)
                    if self.cache:
                        self._cached[id(param)] = tensor
                if tensor is not param.data:
                    undo.append(("param", param, param.data))
                    param.data = tensor
            for buf_name, buf in list(module._buffers.items()):
                full = ".".join(p for p in (prefix, mod_name, buf_name) if p)
                if buf is None or full not in self._buffer_masters:
                    continue
                master = self._buffer_masters[full]
                dtype = self.plan.buffer_dtypes.get(full)
                # A side that does not cast buffers still restores the master's, in case an
                # outer view (another side) cast them.
                tensor = master if dtype is None else self._cast(master, dtype)
                if tensor is not buf:
                    undo.append(("buffer", module, buf_name, buf))
                    module._buffers[buf_name] = tensor

    @staticmethod
    def _undo(undo: list[tuple[Any, ...]]) -> None:
        for entry in reversed(undo):
            if entry[0] == "param":
                entry[1].data = entry[2]
            else:
                entry[1]._buffers[entry[2]] = entry[3]
        undo.clear()

    @contextlib.contextmanager
    def applied(self, root: torch.nn.Module | None = None) -> Iterator[None]:
        """Swap this side's tensors into `root` (default: the whole model), restore on exit.

        Nesting is allowed: the outer view's tensors come back when an inner one exits.
        """
        root = self.model if root is None else root
        if id(root) not in self._module_names:
            raise ValueError(f"WeightView: {type(root).__name__} is not a submodule of the model.")
        streamed = [m for m in root.modules() if id(m) in self.streamed_ids and m is not root]
        undo: list[tuple[Any, ...]] = []
        block_undo: list[list[tuple[Any, ...]]] = []
        handles = []

        def pre(module: torch.nn.Module, args: Any) -> None:
            block_undo.append([])
            self._swap_in(module, set(), block_undo[-1])

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._undo(block_undo.pop())

        try:
            self._swap_in(root, {id(m) for m in streamed}, undo)
            for module in streamed:
                handles.append(module.register_forward_pre_hook(pre, prepend=True))
                handles.append(module.register_forward_hook(post))
            yield
        finally:
            for h in handles:
                h.remove()
            while block_undo:  # a block that raised never reached its post-hook
                self._undo(block_undo.pop())
            self._undo(undo)


def _outermost(model: torch.nn.Module, classes: tuple[str, ...]) -> set[int]:
    """Ids of the modules of `classes` not nested inside another such module."""
    if not classes:
        return set()
    found: set[int] = set()

    def visit(module: torch.nn.Module) -> None:
        if type(module).__name__ in classes:
            found.add(id(module))
            return
        for child in module.children():
            visit(child)

    for child in model.children():
        visit(child)
    return found


def _named_modules_skipping(
    root: torch.nn.Module, skip: set[int], prefix: str = ""
) -> Iterator[tuple[str, torch.nn.Module]]:
    """named_modules() of `root`, not descending into modules whose id is in `skip`."""
    yield prefix, root
    for name, child in root.named_children():
        if id(child) in skip:
            continue
        yield from _named_modules_skipping(child, skip, f"{prefix}.{name}" if prefix else name)

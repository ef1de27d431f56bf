"""WeightView: one side's view of the fp32 master weights, swapped in for a forward and back out.

A side never gets its own copy of the model: for the duration of a forward, each parameter's
`.data` (and, for engine-like sides, each persistent floating buffer) is replaced by the tensor
that side would hold or gather (master -> master_dtype -> per-parameter dtype), and restored
afterwards. The model object, its hooks and its parameters stay the same objects throughout.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.base.dtypes import dtype_name
from lab.families.master import held_parameters
from lab.pairing.capture import ROOT
from lab.pairing.sides import Side
from lab.precision.param_rules import (
    ParamDtypeMaps,
    block_wraps,
    compile_param_dtype_maps,
    ruled_param_sources,
)

# A parameter a rule pins to fp32 meets a bf16 activation in torch's rms_norm / layer_norm, which
# then warns "Mismatch dtype between input and weight ... Cannot dispatch to fused
# implementation" (ATen layer_norm.cpp) and runs the unfused kernel. That mix is the rule applied
# as FSDP2 applies it, not something a lab user can change, so this one message is ignored.
warnings.filterwarnings(
    "ignore",
    message=r"Mismatch dtype between input and weight.*Cannot dispatch to fused implementation",
    category=UserWarning,
)


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
    param_sources: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Parameter name -> what decided its dtype: ("forward_dtype" | "param_dtype", None),
    ("keep_fp32_modules", component) or ("param_dtype_rules", glob). Read by `lab.pairing.why`."""
    buffer_sources: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Buffer name -> ("cast_buffers", None), ("keep_fp32_modules", component) or
    ("constructed", dtype name): a buffer the class builds in its own dtype (not the default),
    which the side holds at that dtype (listed in `buffer_dtypes` only when that is not the
    master's)."""

    def dtype_counts(self) -> dict[str, int]:
        """How many parameters run at each dtype (for summaries; a fresh dict each call)."""
        return dict(self._dtype_counts)

    @functools.cached_property
    def _dtype_counts(self) -> dict[str, int]:
        # Counted once a plan (plans are kept between pairs), by dtype in C, named once a dtype
        # (first-seen order).
        counts = collections.Counter(self.param_dtypes.values())
        return {dtype_name(d): n for d, n in counts.items()}


def _component(name: str, components: tuple[str, ...]) -> str | None:
    """The first of `components` that is a dotted component of `name` (None: none is)."""
    parts = name.split(".")
    return next((c for c in components if c in parts), None)


@functools.lru_cache(maxsize=32)
def _constructed(cls: type, config_json: str, dtype: torch.dtype) -> dict[str, torch.dtype] | None:
    import json

    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            built = cls.from_config(json.loads(config_json))
    except Exception:  # a class that cannot be built on meta: no answer
        return None
    finally:
        torch.set_default_dtype(previous)
    return {
        (f"{m}.{b}" if m else b): t.dtype
        for m, module in built.named_modules()
        for b, t in module._buffers.items()
        if t is not None
    }


def constructed_buffer_dtypes(
    model: torch.nn.Module, dtype: torch.dtype
) -> dict[str, torch.dtype] | None:
    """Each buffer's dtype when `model`'s class is built with `dtype` as torch's default.

    That is the dtype an engine load holds a buffer at: sglang constructs its DiT under
    `set_default_torch_dtype(dit_precision)` on the meta device and casts what it loads to each
    tensor's constructed dtype, so a buffer the class builds explicitly in fp32 (SD3's
    `pos_embed.pos_embed`) stays fp32 at a bf16 or fp16 precision. Built on the meta device
    (no memory), once per class, config and dtype. None for a model without a diffusers
    config, or one that cannot be built on meta.
    """
    import json

    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "from_config") or not dtype.is_floating_point:
        return None
    try:
        text = json.dumps(dict(config), sort_keys=True, default=str)
    except TypeError:
        return None
    return _constructed(type(model), text, dtype)


def plan_weights(model: torch.nn.Module, side: Side) -> WeightPlan:
    """Decide the dtype of every parameter and buffer for `side`.

    Order: the side's param_dtype, then keep_fp32_modules (engine load semantics: any dotted
    component equal to a listed module name), then param_dtype_rules (later rules win).

    Raises:
        ValueError: A keep_fp32_modules entry naming no module, or a bad rule (see
            `compile_param_dtype_maps`).
    """
    default = side.param_torch_dtype
    fp32 = torch.float32
    names = [n for n, _ in _unique_named(model.named_parameters(remove_duplicate=False))]
    dtypes = {n: default for n in names}
    decided: tuple[str, str | None] = ("param_dtype" if side.param_dtype else "forward_dtype", None)
    sources = dict.fromkeys(names, decided)
    if side.keep_fp32_modules:
        module_parts = {part for n, _ in model.named_modules() for part in n.split(".")}
        missing = [m for m in side.keep_fp32_modules if m not in module_parts]
        if missing:
            raise ValueError(
                f"Side({side.name!r}).keep_fp32_modules: {missing} name no module of "
                f"{type(model).__name__}. Entries are module-name components such as 'norm2'."
            )
        for n in names:
            keep = _component(n, side.keep_fp32_modules)
            if keep is not None:
                dtypes[n] = fp32
                sources[n] = ("keep_fp32_modules", keep)
    maps = None
    if side.param_dtype_rules:
        wraps = block_wraps(model, side.fsdp_wrap_classes) if side.fsdp_wrap_classes else []
        maps = compile_param_dtype_maps(model, wraps, side.param_dtype_rules, default)
        # Every parameter a rule matched takes that rule's dtype, also when it equals the
        # default: such a rule carves a parameter back out of keep_fp32_modules.
        for n, (d, pattern) in ruled_param_sources(model, side.param_dtype_rules).items():
            dtypes[n] = d
            sources[n] = ("param_dtype_rules", pattern)
    buffers: dict[str, torch.dtype] = {}
    buffer_sources: dict[str, tuple[str, str | None]] = {}
    if side.cast_buffers:
        built = constructed_buffer_dtypes(model, default)
        for mod_name, module in model.named_modules():
            for buf_name, buf in module._buffers.items():
                full = f"{mod_name}.{buf_name}" if mod_name else buf_name
                persistent = buf_name not in module._non_persistent_buffers_set
                if buf is None or not buf.is_floating_point() or not persistent:
                    continue
                keep = _component(full, side.keep_fp32_modules)
                own = built.get(full) if built is not None else default
                if keep is None and own is not None and own != default:
                    # The class builds it in another dtype whatever the default (SD3's
                    # pos_embed table: numpy float64 -> .float()): an engine load keeps that.
                    buffer_sources[full] = ("constructed", dtype_name(own))
                    if own != buf.dtype:
                        buffers[full] = own
                    continue
                buffers[full] = fp32 if keep is not None else default
                buffer_sources[full] = (
                    ("keep_fp32_modules", keep) if keep is not None else ("cast_buffers", None)
                )
    master = side.master_torch_dtype
    return WeightPlan(
        param_dtypes=dtypes,
        buffer_dtypes=buffers,
        master_dtype=master,
        maps=maps,
        param_sources=sources,
        buffer_sources=buffer_sources,
    )


def _unique_named(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


@dataclass(frozen=True)
class Entry:
    """One tensor slot a side fills: a parameter, or a buffer of a module."""

    owner: Any
    """The parameter (whose .data is set), or the module holding the buffer."""
    buffer: str | None
    """The buffer's name in `owner._buffers`; None for a parameter."""
    master: torch.Tensor
    dtype: torch.dtype | None

    @property
    def slot(self) -> tuple[int, str | None]:
        """Identity of the slot (the same for both sides' entries of one tensor)."""
        return (id(self.owner), self.buffer)

    def get(self) -> torch.Tensor:
        """The tensor the slot holds now."""
        return self.owner.data if self.buffer is None else self.owner._buffers[self.buffer]

    def put(self, tensor: torch.Tensor) -> None:
        """Make the slot hold `tensor`."""
        if self.buffer is None:
            self.owner.data = tensor
        else:
            self.owner._buffers[self.buffer] = tensor


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
        tree: tuple[_Tree, list[torch.nn.Module]] | None = None,
    ) -> None:
        """Plan the side's dtypes for `model` (validating its rules) without casting yet.

        The plan and the model's names are read once per (model, side, stream_classes) and
        reused while the model's module tree is the same (`_Layout`); the tensors are taken
        now, so a parameter whose `.data` was replaced since is cast from its new tensor.
        `tree`: `_Tree.current(model)` when the caller checked it already (`WeightView.both`).
        """
        self.model = model
        self.side = side
        self.tree, modules = tree if tree is not None else _Tree.current(model)
        self.layout, params = _Layout.of(model, side, stream_classes, (self.tree, modules))
        self._tree_modules = modules
        self._named_modules: list[tuple[str, torch.nn.Module]] | None = None
        layout = self.layout
        self.plan = layout.plan
        self.cache = cache
        self._cached: dict[int, torch.Tensor] = {}
        self._param_names = {id(p): n for n, p in zip(layout.param_names, params, strict=True)}
        # Masters are taken now, before any view is applied, so a view nested inside another
        # side's view still casts from the fp32 master rather than from the outer side's copy.
        self._slots = [(p, p.data) for p in params]
        self._masters = {id(p): master for p, master in self._slots}
        # A compacted model holds some fp32 masters at bf16 (exact, guarded; see
        # lab/families/master.py): id of the held tensor -> the dtype its value is in (fp32).
        held = held_parameters(model, zip(layout.param_names, params, strict=True))
        self._logical = {
            id(master): held[n]
            for n, (_, master) in zip(layout.param_names, self._slots, strict=True)
            if n in held
        }
        self._logical_params = {
            id(p): held[n] for n, p in zip(layout.param_names, params, strict=True) if n in held
        }
        self._module_names = layout.module_names
        self.module_classes = layout.module_classes
        """Module path (ROOT for the model) -> class name, for result rows."""
        self._buffer_slots = []
        self._buffer_masters = {}
        for ref, name, full in layout.buffers:
            module = ref()
            tensor = module._buffers[name]
            self._buffer_slots.append((module, name, tensor))
            self._buffer_masters[full] = tensor
        self.streamed_ids = layout.streamed_ids
        """Ids of the blocks whose weights are cast by hooks (outermost of stream_classes)."""

    @classmethod
    def shared(
        cls, model: torch.nn.Module, side: Side, *, stream_classes: tuple[str, ...] = ()
    ) -> WeightView:
        """A view for (model, side): the same as `WeightView(model, side)`.

        Kept for its callers' intent (a view per call, planned once): planning a side's dtypes
        walks every module and parameter (~0.5-1 ms on a tiny model, ~25 ms on flux full), so
        every view reuses its (model, side) `_Layout` while the module tree is unchanged, and
        takes the tensors afresh.
        """
        return cls(model, side, stream_classes=stream_classes)

    @classmethod
    def both(
        cls,
        model: torch.nn.Module,
        side_a: Side,
        side_b: Side,
        *,
        stream_classes: tuple[str, ...] = (),
        cache_b: bool = False,
    ) -> tuple[WeightView, WeightView]:
        """The two views of a pair, with the module tree checked once for both (`_Tree`)."""
        tree = _Tree.current(model)
        view_a = cls(model, side_a, stream_classes=stream_classes, tree=tree)
        view_b = cls(model, side_b, cache=cache_b, stream_classes=stream_classes, tree=tree)
        return view_a, view_b

    @property
    def named_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """`model.named_modules()` as of this view, from its checked tree (no walk)."""
        if self._named_modules is None:
            paths, modules = self.tree.paths, self._tree_modules
            self._named_modules = [(paths[i], modules[i]) for i in self.tree.unique]
        return self._named_modules

    def memo(self) -> dict[Any, Any]:
        """A dict for what is read off the model's tensors' kinds alone (guards, summaries).

        It lasts while the module tree and every parameter's and buffer's tensor keep their
        address, dtype and shape (what a compact master's guard checks, too) and the model
        keeps its master record; any change, or a view of another state, starts an empty one.
        Costs one pass over the tensors (~0.5 ms for ~1000 parameters), not a module walk.
        """
        record = getattr(self.model, "lab_master", None)
        state = (
            tuple((m.data_ptr(), m.dtype, m.shape) for _, m in self._slots),
            tuple((t.data_ptr(), t.dtype, t.shape) for _, _, t in self._buffer_slots),
            id(record),
            len(record.guards) if record is not None else 0,
        )
        return self.tree.memo(state)

    def parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters, each once under its first name (`canonical_parameters`).

        Read from the cached layout: no walk through the module tree.
        """
        return list(zip(self.layout.param_names, (p for p, _ in self._slots), strict=True))

    def logical_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype of `param`'s master value: fp32 for a held (compact) tensor, else its own."""
        return self._logical_params.get(id(param), param.dtype)

    def cast_key(self, master: torch.Tensor, dtype: torch.dtype | None) -> tuple[Any, ...]:
        """What `cast` computes from `master`: equal keys give bit-identical tensors.

        Two sides whose keys agree for a tensor can share one cast of it.
        """
        # Each view holds its own alias of a master; the memory it points at names it.
        source = (master.data_ptr(), master.dtype, tuple(master.shape))
        logical = self._logical.get(id(master))
        if logical is not None:
            # Held at bf16, exact: its fp32 value goes through an fp32 or bf16 master without
            # rounding, so a bf16 target is the held tensor itself and an fp32 one its upcast.
            # Through an fp16 master it rounds: `cast` then upcasts first and rounds as always.
            if self.plan.master_dtype in (logical, master.dtype) and dtype in (None, logical):
                return (source, "upcast")
            if self.plan.master_dtype in (logical, master.dtype) and dtype == master.dtype:
                return (source,)
            return (source, "upcast", self.plan.master_dtype, dtype)
        if dtype is None or (
            master.dtype == dtype and self.plan.master_dtype in (dtype, master.dtype)
        ):
            return (source,)
        return (source, self.plan.master_dtype, dtype)

    def cast(self, master: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """`master` as this side holds it: through the master dtype to `dtype` (None: as is).

        A held (compact) master is upcast to its fp32 value first, which is exact, so every
        side gets the bits it would get from the fp32 master.
        """
        key = self.cast_key(master, dtype)
        if len(key) == 1:
            return master
        logical = self._logical.get(id(master))
        if logical is not None:
            value = master.to(logical)
            return value if len(key) == 2 else value.to(self.plan.master_dtype).to(dtype)
        return master.to(self.plan.master_dtype).to(dtype)

    def entries(self, root: torch.nn.Module, skip: set[int]) -> Iterator[Entry]:
        """Every parameter and buffer slot in `root`, not inside modules in `skip`.

        Each comes with the master it is cast from and the dtype this side wants (None: the
        master as is). Which slots, in which order, is worked out once per layout, root and
        skip (`_entry_plan`); each view fills in its own tensors.
        """
        key = (id(root), frozenset(skip))
        plan = self.layout.entry_plans.get(key)
        if plan is None:
            plan = self.layout.entry_plans[key] = self._entry_plan(root, skip)
        slots, buffers = self._slots, self._buffer_slots
        for kind, index, dtype in plan:
            if kind:
                module, buf_name, master = buffers[index]
                if module._buffers.get(buf_name) is not None:
                    yield Entry(module, buf_name, master, dtype)
            else:
                param, master = slots[index]
                yield Entry(param, None, master, dtype)

    def _entry_plan(
        self, root: torch.nn.Module, skip: set[int]
    ) -> list[tuple[bool, int, torch.dtype | None]]:
        """`entries` as (is a buffer, its index in the view's slots, dtype), in walk order."""
        prefix = self._module_names[id(root)]
        param_index = {id(p): i for i, (p, _) in enumerate(self._slots)}
        buffer_index = {full: j for j, (_, _, full) in enumerate(self.layout.buffers)}
        seen: set[int] = set()
        plan: list[tuple[bool, int, torch.dtype | None]] = []
        for mod_name, module in _named_modules_skipping(root, skip):
            for param in module._parameters.values():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                dtype = self.plan.param_dtypes[self._param_names[id(param)]]
                plan.append((False, param_index[id(param)], dtype))
            for buf_name, buf in module._buffers.items():
                full = ".".join(p for p in (prefix, mod_name, buf_name) if p)
                if buf is None or full not in self._buffer_masters:
                    continue
                # A side that does not cast buffers still restores the master's, in case an
                # outer view (another side) cast them.
                plan.append((True, buffer_index[full], self.plan.buffer_dtypes.get(full)))
        return plan

    def _swap_in(self, root: torch.nn.Module, skip: set[int], undo: list[tuple[Any, ...]]) -> None:
        """Swap this side's tensors into `root`, except inside modules whose id is in `skip`."""
        for entry in self.entries(root, skip):
            tensor = self._cached.get(id(entry.master)) if entry.buffer is None else None
            if tensor is None:
                tensor = self.cast(entry.master, entry.dtype)
                if self.cache and entry.buffer is None:
                    self._cached[id(entry.master)] = tensor
            if entry.buffer is None:
                if tensor is not entry.owner.data:
                    undo.append(("param", entry.owner, entry.owner.data))
                    entry.owner.data = tensor
            elif tensor is not entry.get():
                undo.append(("buffer", entry.owner, entry.buffer, entry.get()))
                entry.put(tensor)

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
        streamed = (
            [m for m in root.modules() if id(m) in self.streamed_ids and m is not root]
            if self.streamed_ids
            else []  # nothing streams: no walk through the module tree
        )
        undo: list[tuple[Any, ...]] = []
        block_undo: list[list[tuple[Any, ...]]] = []
        handles = []

        # The block hooks run inside the side's forward, where the autocast emulation's
        # torch-function mode would see each of their tensor calls (`data_ptr`, casts, `.data`
        # swaps; ~5 us each on a tiny CPU model): none of them is the forward's arithmetic.
        no_function_mode = torch._C.DisableTorchFunction

        def pre(module: torch.nn.Module, args: Any) -> None:
            block_undo.append([])
            with no_function_mode():
                self._swap_in(module, set(), block_undo[-1])

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            with no_function_mode():
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


def outermost(model: torch.nn.Module, classes: tuple[str, ...]) -> set[int]:
    """Ids of the modules of `classes` not nested inside another such module (the blocks)."""
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


class _Layout:
    """What a side's view reads from the model's structure alone: the plan, names, classes.

    No tensor and no strong reference to a module is kept (weak references only), so a cached
    layout keeps neither a model nor replaced parameter tensors alive. `of` reuses it while
    every module is alive with the same class, children, parameter objects (which also fixes
    which names are aliases of one tensor) and buffer names, and the same buffers are floating
    and persistent: one flat pass, no recursion through `named_modules`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        side: Side,
        stream_classes: tuple[str, ...],
        every: list[tuple[str, torch.nn.Module]],
    ) -> None:
        """`every`: the model's `named_modules(remove_duplicate=False)`, as its `_Tree` holds."""
        self.plan = plan_weights(model, side)
        # Each parameter once, under its first name, as `_unique_named(named_parameters(
        # remove_duplicate=False))` meets them: (position in `every`, local name).
        seen: set[int] = set()
        self._params: list[tuple[int, str]] = []
        self.param_names: list[str] = []
        for i, (path, module) in enumerate(every):
            for local, p in module._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    self._params.append((i, local))
                    self.param_names.append(f"{path}.{local}" if path else local)
        modules = list(model.named_modules())
        self.module_names = {id(m): n for n, m in modules}
        self.module_classes = {(n or ROOT): type(m).__name__ for n, m in modules}
        self.buffers = [
            (weakref.ref(m), b, f"{n}.{b}" if n else b)
            for n, m in modules
            for b, t in m._buffers.items()
            if t is not None
        ]
        self.streamed_ids = outermost(model, stream_classes)
        self.entry_plans: dict[tuple[int, frozenset[int]], list[tuple[Any, ...]]] = {}
        """`WeightView.entries` per (root id, skipped ids): the slots in walk order."""

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        side: Side,
        stream_classes: tuple[str, ...],
        tree: tuple[_Tree, list[torch.nn.Module]] | None = None,
    ) -> tuple[_Layout, list[torch.nn.Parameter]]:
        """The layout of (model, side, stream_classes) and the parameters it names now.

        Planned again only if the module tree changed (see `_Tree`). `tree`:
        `_Tree.current(model)` when the caller checked it already.
        """
        checked, modules = tree if tree is not None else _Tree.current(model)
        key = (repr(side), stream_classes)
        layout = checked.layouts.get(key)
        if layout is None:
            every = list(zip(checked.paths, modules, strict=True))
            layout = checked.layouts[key] = cls(model, side, stream_classes, every)
        return layout, [modules[i]._parameters[local] for i, local in layout._params]


class _Tree:
    """A model's module tree as its layouts read it, and the layouts planned on it.

    `current` checks it in one flat pass (`_signature` per module, no recursion through
    `named_modules`) and starts a new tree, with no layouts, when anything changed. A pair
    checks it once for both sides' views (`WeightView.both`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        every = list(model.named_modules(remove_duplicate=False))
        self.paths = [path for path, _ in every]
        self._refs = [weakref.ref(m) for _, m in every]
        self._signatures = [_signature(m) for _, m in every]
        first: dict[int, int] = {}
        for i, (_, m) in enumerate(every):
            first.setdefault(id(m), i)
        self.unique = sorted(first.values())
        """Positions of each module's first visit: `named_modules()` (no duplicates) in order."""
        self.layouts: dict[Any, _Layout] = {}
        """(repr(side), stream classes) -> its `_Layout`."""
        self._state: Any = None
        self._memo: dict[Any, Any] = {}

    @classmethod
    def current(cls, model: torch.nn.Module) -> tuple[_Tree, list[torch.nn.Module]]:
        """The model's tree (the cached one while unchanged) and its modules, in walk order."""
        tree = _SHARED.get(model)
        modules = tree._modules() if tree is not None else None
        if tree is None or modules is None:
            tree = _SHARED[model] = cls(model)
            modules = [ref() for ref in tree._refs]
        return tree, modules

    def _modules(self) -> list[torch.nn.Module] | None:
        """Every module (named_modules(remove_duplicate=False) order); None if any changed."""
        modules = []
        for ref, signature in zip(self._refs, self._signatures, strict=True):
            module = ref()
            if module is None or _signature(module) != signature:
                return None
            modules.append(module)
        return modules

    def memo(self, state: Any) -> dict[Any, Any]:
        """The memo dict of `state` (`WeightView.memo`): a new, empty one when it changed."""
        if state != self._state:
            self._state, self._memo = state, {}
        return self._memo


def _signature(module: torch.nn.Module) -> tuple[Any, ...]:
    """What a layout reads from one module: class, children, parameters, buffer names and kinds.

    Parameters by id: a parameter whose `.data` is replaced keeps it (its new tensor is read
    afresh by every view); a new Parameter object, or a tie between two names, changes it.
    """
    children, params, buffers = module._modules, module._parameters, module._buffers
    return (
        type(module),
        tuple(children),
        tuple(map(id, children.values())),
        tuple(params),
        tuple(map(id, params.values())),
        tuple(
            (k, v.is_floating_point(), k in module._non_persistent_buffers_set)
            for k, v in buffers.items()
            if v is not None
        )
        if buffers
        else (),
    )


_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, _Tree] = weakref.WeakKeyDictionary()
"""Each model's `_Tree` and, on it, its `_Layout`s (dropped with the model)."""


class PairedWeights:
    """Two sides' views filled into one model at once, for two forwards run in lockstep.

    Each side's tensors are cast from the same masters; where both sides would compute the
    same cast (same master, master dtype and dtype) they share one tensor, so e.g. two bf16
    sides hold one bf16 copy. Outside the streamed blocks the casts are made once, up front.
    A streamed block is cast when the first side enters it and dropped once both sides have
    run it: the side that leaves it first keeps its casts for the other (one such block at a
    time, so at most one block more than a streamed plain forward holds; lockstep hands over
    at block boundaries, so the other side runs that block next and casts nothing). Before a
    side runs (and each time it resumes after the other side ran), `activate` fills in its
    tensors wherever the two sides differ: outside the blocks and in the block the side is
    in. The two forwards must never run at the same time.
    """

    def __init__(self, views: dict[str, WeightView], blocks: set[int], *, stream: bool) -> None:
        """`views`: side key -> that side's WeightView (same model); `blocks`: ids of blocks.

        With `stream`, a block's casts live only while a side runs it; without, each block
        is cast once and kept for the run (the blocks still scope what a switch refills).

        Raises:
            ValueError: The views belong to different models.
        """
        models = {id(v.model) for v in views.values()}
        if len(models) != 1:
            raise ValueError("PairedWeights: the views were made for different models.")
        self.views = views
        self.model = next(iter(views.values())).model
        self.stream = stream
        self._outside: dict[str, list[tuple[Entry, torch.Tensor]]] = {}
        self._inside: dict[str, dict[int, list[tuple[Entry, torch.Tensor]]]] = {
            k: {} for k in views
        }
        self._block_cache: dict[int, dict[tuple[Any, ...], torch.Tensor]] = {}
        self._exits: dict[int, dict[str, int]] = {}
        """Block id -> how many times each side has left it."""
        self._kept: tuple[int, list[tuple[Entry, torch.Tensor]]] | None = None
        """The block whose casts wait for the side that has not run it yet, with its entries."""
        self.casts = 0
        """Tensors cast so far (a miss in the shared caches; read by tests and benches)."""
        self._current: dict[tuple[int, str | None], torch.Tensor] = {}
        self._originals: dict[tuple[int, str | None], tuple[Entry, torch.Tensor]] = {}
        first = next(iter(views.values()))
        self.block_modules = {
            id(m): m for _, m in first.named_modules if id(m) in blocks and m is not self.model
        }

    def _resolve(
        self, key: str, entries: Iterator[Entry], cache: dict[tuple[Any, ...], torch.Tensor]
    ) -> list[tuple[Entry, torch.Tensor]]:
        view = self.views[key]
        out = []
        for entry in entries:
            cast_key = view.cast_key(entry.master, entry.dtype)
            tensor = cache.get(cast_key)
            if tensor is None:
                tensor = cache[cast_key] = view.cast(entry.master, entry.dtype)
                # The master handed as it is (a buffer a side holds uncast) is no cast.
                self.casts += len(cast_key) > 1
            out.append((entry, tensor))
        return out

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Cast everything outside the blocks for every side; restore every slot on exit."""
        cache: dict[tuple[Any, ...], torch.Tensor] = {}
        skip = set(self.block_modules)
        try:
            for key, view in self.views.items():
                self._outside[key] = self._resolve(key, view.entries(self.model, skip), cache)
            yield
        finally:
            for entry, original in self._originals.values():
                entry.put(original)
            self._originals.clear()
            self._current.clear()
            self._outside.clear()
            self._block_cache.clear()
            self._exits.clear()
            self._kept = None
            for inside in self._inside.values():
                inside.clear()

    def _put(self, entry: Entry, tensor: torch.Tensor) -> None:
        # A slot already holding this side's tensor (shared with the other side, or not
        # touched since) is left alone, so a switch costs a dict lookup per slot.
        slot = entry.slot
        if self._current.get(slot) is tensor:
            return
        if slot not in self._originals:
            self._originals[slot] = (entry, entry.get())
        entry.put(tensor)
        self._current[slot] = tensor

    def enter_block(self, key: str, module: torch.nn.Module) -> None:
        """Side `key` starts running block `module`: cast (or share) its tensors and fill them."""
        if self._kept is not None and self._kept[0] == id(module):
            self._kept = None  # in use again: dropped when its last side leaves
        cache = self._block_cache.setdefault(id(module), {})
        entries = self._resolve(key, self.views[key].entries(module, set()), cache)
        self._inside[key][id(module)] = entries
        for entry, tensor in entries:
            self._put(entry, tensor)

    def exit_block(self, key: str, module: torch.nn.Module) -> None:
        """Side `key` left block `module`; when streaming, drop its casts once all sides ran it.

        A side that leaves first keeps them for the other side (the one block kept; keeping
        another drops it), so the two forwards cast each block once if the other side runs it
        next (`keeps`).
        """
        block = id(module)
        entries = self._inside[key].pop(block, [])
        if not self.stream:
            return
        exits = self._exits.setdefault(block, dict.fromkeys(self.views, 0))
        exits[key] += 1
        if any(block in inside for inside in self._inside.values()):
            return  # the other side is inside: it drops them when it leaves
        if any(n < exits[key] for n in exits.values()):
            # A side has yet to run this call of the block: keep the casts for it.
            if self._kept is not None and self._kept[0] != block:
                self._drop(*self._kept)
            self._kept = (block, entries)
            return
        if self._kept is not None and self._kept[0] == block:
            self._kept = None
        self._drop(block, entries)

    def keeps(self, module: torch.nn.Module) -> bool:
        """Whether `module`'s casts are kept for a side that has yet to run it."""
        return self._kept is not None and self._kept[0] == id(module)

    def _drop(self, block: int, entries: list[tuple[Entry, torch.Tensor]]) -> None:
        """Drop block `block`'s casts and put the masters back into its slots."""
        self._block_cache.pop(block, None)
        for entry, _ in entries:  # the block's slots, as a side filled them on entry
            saved = self._originals.pop(entry.slot, None)
            if saved is not None:
                entry.put(saved[1])
                self._current.pop(entry.slot, None)

    def activate(self, key: str) -> None:
        """Fill side `key`'s tensors where the other side may have filled its own."""
        put = self._put
        for entry, tensor in self._outside.get(key, ()):
            put(entry, tensor)
        for entries in self._inside[key].values():
            for entry, tensor in entries:
                put(entry, tensor)

"""pair(): model + inputs + two sides -> Result, comparing every module output as it is produced."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lab.capture import ModuleHooks, flatten_output
from lab.devices import resolve_device
from lab.dtype_flow import FlowRecorder
from lab.errors import (
    DegenerateOutputError,
    ModelInUseError,
    NonFiniteOutputError,
    PairError,
    dtype_mismatch_fix,
    failing_module,
)
from lab.families import Inputs
from lab.metrics import metrics_kernel
from lab.pairing import Aliases, Collector, metrics_on_side_stream
from lab.precision.dtypes import dtype_name
from lab.precision.input_policy import apply_input_dtype_policy
from lab.result import Result, Skipped
from lab.sides import Side
from lab.weights import WeightView, outermost

Mode = Literal["propagated", "local"]
MODES: tuple[str, ...] = ("propagated", "local")

_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


# ---- one side's forward context ----------------------------------------------------------


def sdpa_context(backend: str) -> contextlib.AbstractContextManager:
    """The SDPA kernel selection of a side's `attention_backend` (global flags, restored)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        # Every kernel allowed, torch's own priority: what an unpinned forward would pick.
        return sdpa_kernel(
            [
                SDPBackend.FLASH_ATTENTION,
                SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH,
            ]
        )
    return sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[backend]))


def side_autocast(side: Side, device: torch.device) -> contextlib.AbstractContextManager:
    """The side's autocast (thread-local), or autocast switched off for a side without it."""
    if not side.autocast:
        # Switch off any autocast active around us (an outer side in local mode).
        return torch.autocast(device.type, enabled=False)
    from lab.precision.autocast import autocast_context

    dtype = side.autocast_torch_dtype
    if dtype == torch.float32:
        # Autocast to fp32 changes nothing an fp32 forward would not do by itself.
        return torch.autocast(device.type, enabled=False)
    return autocast_context(side.resolved_autocast_policy, device, dtype)


@contextlib.contextmanager
def side_context(
    side: Side, device: torch.device, root: torch.nn.Module | None = None
) -> Iterator[None]:
    """Autocast, attention kernel and (on `root`) engine op semantics of one side.

    Weights are `WeightView`'s job. With `root`, every module under it runs the forward the
    side's engine_ops / op_switches ask for (or its class's own, undoing an outer side's).
    """
    from lab.precision.engine_ops import ops_applied

    with contextlib.ExitStack() as stack:
        if root is not None:
            stack.enter_context(ops_applied(root, side.engine_ops, side.op_switches))
        stack.enter_context(sdpa_context(side.attention_backend))
        stack.enter_context(side_autocast(side, device))
        yield


def side_inputs(inputs: Inputs, side: Side, device: torch.device) -> Inputs:
    """The inputs as `side` hands them to its DiT: policy at the boundary, then op switches."""
    from lab.precision.engine_ops import transform_inputs

    cast = apply_input_dtype_policy(side.input_dtype_policy, inputs.to(device), side.forward_dtype)
    return transform_inputs(cast, side.op_switches)


def check_side_device(side: Side, device: torch.device) -> None:
    """Refuse a side whose device or attention kernel cannot run where the model lives.

    Raises:
        ValueError: CUDA asked for without a GPU, a side on another device than the model, or
            a CUDA-only attention kernel on CPU.
    """
    if device.type == "meta":
        raise ValueError(
            "The model is on the meta device (shapes only, no weights), which no side can run. "
            "Build it with device='cpu' or 'cuda' (fam.build(preset, seed, device=...)) or load "
            "real weights (fam.load(path, device=...))."
        )
    want = resolve_device(side.device)
    if want.type != device.type:
        raise ValueError(
            f"Side({side.name!r}).device is {side.device!r} but the model is on {device}. Build "
            f"the model with device={side.device!r} or use side.replace(device={device.type!r})."
        )
    if device.type == "cpu" and side.attention_backend in ("efficient", "cudnn"):
        raise ValueError(
            f"Side({side.name!r}).attention_backend={side.attention_backend!r} has no CPU kernel; "
            "on CPU use 'default', 'math' or 'flash'."
        )


# ---- what a pair or forward refuses before it starts ----------------------------------------

_IN_USE: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_IN_USE_GUARD = threading.Lock()


@contextlib.contextmanager
def model_in_use(model: torch.nn.Module, where: str) -> Iterator[None]:
    """Hold `model` for one pair or forward; another thread's call is refused, not queued.

    Each side swaps the model's parameter tensors in place, so a second thread pairing the same
    model meanwhile takes the first side's casts for the fp32 masters and "restores" them (seen:
    every parameter left bf16 for later runs). The holding thread may nest calls (a trajectory
    pairs between its forwards); lockstep's two side threads run inside the holder's call.

    Raises:
        ModelInUseError: Another thread holds the model, naming its class and the fix.
    """
    with _IN_USE_GUARD:
        lock = _IN_USE.get(model)
        if lock is None:
            lock = _IN_USE[model] = threading.RLock()
    if not lock.acquire(blocking=False):
        raise ModelInUseError(
            f"{where}: this {type(model).__name__} is being paired or run in another thread right "
            "now. Its sides swap the parameter tensors in place, so a second call at the same "
            "time would corrupt it. Wait for the other call to finish, or give this thread its "
            "own model (copy.deepcopy(model), or fam.build(...) again)."
        )
    try:
        yield
    finally:
        lock.release()


def _holding_model(where: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated function (model first) inside `model_in_use(model, where)`."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def holding(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            with model_in_use(model, where):
                return fn(model, *args, **kwargs)

        return holding

    return wrap


def check_fp32_master(model: torch.nn.Module, where: str) -> None:
    """Refuse a model whose parameters are not (at least) fp32: sides cast from an fp32 master.

    A bf16 model taken as the master would be run by `Side.fp32_reference` on bf16-rounded
    weights while its record says fp32 (issue 14: rel_max 0.06415 instead of 0.06326).

    Raises:
        ValueError: Naming how many parameters are in which dtype, one of them, and the fix.
    """
    if not any(p.is_floating_point() and p.element_size() < 4 for p in model.parameters()):
        return
    low: dict[str, list[str]] = {}
    total = 0
    for name, p in model.named_parameters():
        total += 1
        if p.is_floating_point() and p.element_size() < 4:
            low.setdefault(dtype_name(p.dtype), []).append(name)
    if not low:
        return
    counts = ", ".join(f"{len(names)} {d}" for d, names in low.items())
    first = next(iter(low.values()))[0]
    raise ValueError(
        f"{where}: {type(model).__name__} holds {counts} parameter(s) of {total} (e.g. {first!r}), "
        "but the model must be the fp32 master every side casts from: a side's master_dtype "
        "'fp32' (and Side.fp32_reference) would otherwise run on weights already rounded while "
        "its record says fp32. Keep the model in fp32 (Family.build and Family.load give fp32); "
        "if the rounded weights are what you mean to compare, call model.float() first, so both "
        "sides cast from exactly those values."
    )


def check_inputs(model: torch.nn.Module, inputs: Inputs, where: str) -> None:
    """Refuse inputs `model` cannot run: not an Inputs record, meta tensors, another family's.

    Raises:
        ValueError: Naming the bad kwarg, or the model's class and the inputs' family.
    """
    if not isinstance(inputs, Inputs):
        raise ValueError(
            f"{where}: inputs must be an Inputs record (fam.make_inputs(preset, seed), or "
            f"lab.Inputs(kwargs=..., roles=...)), got {type(inputs).__name__}."
        )
    for label, record in (("inputs", inputs), ("inputs.negative", inputs.negative)):
        if record is None:
            continue
        for key, value in record.kwargs.items():
            if any(t.device.type == "meta" for t in _tensors(value)):
                raise ValueError(
                    f"{where}: {label}[{key!r}] is on the meta device (a shape without values). "
                    "Make the inputs with device='cpu' or 'cuda' (fam.make_inputs(preset, seed, "
                    "device=...))."
                )
    if inputs.origin is None:
        return
    from lab.families import family as get_family

    family_name, preset, _ = inputs.origin
    made_for = get_family(family_name).model_class
    model_class = type(model).__name__
    if model_class != made_for and any(
        get_family(n).model_class == model_class for n in _family_names()
    ):
        raise ValueError(
            f"{where}: the model is a {model_class} but the inputs were made by family "
            f"{family_name!r} (preset {preset!r}), whose model is a {made_for}. Make both from one "
            "family: fam.build(preset, seed) and fam.make_inputs(preset, seed)."
        )


def _inputs_mismatch_hint(model: torch.nn.Module, inputs: Inputs) -> str:
    """After a failed forward: name the model's and the inputs' sizes where they differ."""
    if not isinstance(inputs, Inputs) or inputs.origin is None:
        return ""
    from lab.families import family as get_family

    family_name, preset, variant = inputs.origin
    try:
        made_for = get_family(family_name).config(preset, variant)
    except ValueError:
        return ""
    config = getattr(model, "config", None)
    if not isinstance(config, dict):
        return ""
    differ = [k for k, v in made_for.items() if k in config and config[k] != v]
    widths = [k for k in differ if k != "num_layers" and "layers" not in k]
    if not widths:
        return ""
    shown = ", ".join(f"{k}={made_for[k]!r} vs {config[k]!r}" for k in widths[:4])
    return (
        f" The inputs were made for {family_name} preset {preset!r}"
        + (f" variant {variant!r}" if variant else "")
        + f" and the model ({type(model).__name__}) has other widths ({shown}, inputs vs model):"
        " build the model and the inputs from one preset."
    )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _family_names() -> tuple[str, ...]:
    from lab.families import FAMILY_NAMES

    return FAMILY_NAMES


@_holding_model("forward_side")
def forward_side(
    model: torch.nn.Module,
    inputs: Inputs,
    side: Side,
    *,
    view: WeightView | None = None,
) -> Any:
    """One plain forward of `model` as `side` runs it: input policy, weights, autocast, kernel.

    Nothing is captured and the model is restored afterwards. Pass a `WeightView` built once
    for (model, side) to skip re-planning the dtypes on every call (e.g. per denoising step).

    Raises:
        ValueError: The side cannot run where the model lives (see `check_side_device`).
    """
    device = model_device(model)
    check_side_device(side, device)
    check_inputs(model, inputs, "forward_side")
    if view is not None and (view.side != side or view.model is not model):
        raise ValueError(
            f"forward_side: the WeightView was made for Side({view.side.name!r}) on another "
            f"model or side; build it as WeightView(model, side) for Side({side.name!r})."
        )
    view = view if view is not None else WeightView.shared(model, side)
    cast = side_inputs(inputs, side, device)
    with torch.no_grad(), view.applied(), side_context(side, device, model):
        return model(**cast.kwargs)


# ---- pairing ------------------------------------------------------------------------------


def _clone_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_clone_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone_tree(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    return value


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


@_holding_model("pair")
def pair(
    model: torch.nn.Module,
    inputs: Inputs,
    side_a: Side,
    side_b: Side,
    mode: Mode = "propagated",
    *,
    names_filter: Callable[[str], bool] | None = None,
    check_outputs: bool = True,
    meta: dict[str, Any] | None = None,
    stream: bool = False,
    lockstep: bool | None = None,
) -> Result:
    """Run the same weights and inputs under two sides and compare every module output.

    `propagated`: each side runs its own forward, so differences accumulate as in the real
    system. `local`: during side A's forward, each module is re-run under side B on the exact
    inputs side A gave it, which shows which op introduces the error. Side A's activations
    are held until side B's matching output arrives; each pair is reduced to a few numbers on
    the device and dropped, so memory never holds every activation of both sides. The model,
    autocast, SDPA kernel selection and parameter dtypes are all restored afterwards.

    Args:
        model: An fp32 master model (from `Family.build` or `Family.load`).
        inputs: The pipeline's tensors, tagged by role (each side applies its own policy).
        side_a: The reference side (rollout by default convention).
        side_b: The candidate side.
        mode: "propagated" or "local".
        names_filter: Capture only modules whose path (ROOT for the model) passes this.
        check_outputs: Raise on non-finite or all-zero model outputs (the error carries the
            Result as `.result`).
        meta: Extra fields for `Result.meta` (family, preset, seed, ...).
        stream: Bound memory for full-size models: both sides cast their weights block by
            block from the master (one block's casts per side alive, shared where the two
            sides' casts are equal) instead of once for the whole model. Propagated mode then
            always runs in lockstep. In local mode only side A's weights stream (side B's
            casts are cached).
        lockstep: Propagated mode only. True: the two forwards run in two threads taking turns
            module by module (`lab.lockstep`), so memory holds one forward's activations per
            side and no copies. False: side A runs first and keeps a copy of every captured
            output until side B reaches it (cheaper per module when tensors are tiny). None
            (default): lockstep on CUDA or when streaming, two passes otherwise. Both give
            identical Results.

    Returns:
        The Result, rows in forward completion order.

    Raises:
        ValueError: Unknown mode, a side that cannot run on this device, bad rules.
        NonFiniteOutputError: NaN/Inf in a side's model output (check_outputs).
        DegenerateOutputError: Both model outputs all zero or constant (check_outputs).
        PairError: A side's forward failed (out of memory, dtype error); `.result` holds the
            pairs compared before the failure.
    """
    if mode not in MODES:
        raise ValueError(f"pair: unknown mode {mode!r}. Known: {', '.join(MODES)}.")
    if lockstep and mode != "propagated":
        raise ValueError(
            "pair: lockstep=True pairs propagated forwards; local mode re-runs each module "
            "under side B inside side A's forward. Use mode='propagated' or lockstep=None."
        )
    device = model_device(model)
    for side in (side_a, side_b):
        check_side_device(side, device)
    check_fp32_master(model, "pair")
    check_inputs(model, inputs, "pair")
    # The metric switches are read inside the forwards: refuse a bad one before they start.
    metrics_kernel()
    metrics_on_side_stream()
    blocks = _block_classes(model, side_a, side_b) if stream else ()
    if stream and not blocks:
        raise ValueError(
            f"pair: stream=True needs block classes; neither side names fsdp_wrap_classes and "
            f"{type(model).__name__} declares no _no_split_modules. Set "
            "side.replace(fsdp_wrap_classes=(...)) on one side."
        )
    view_a = WeightView.shared(model, side_a, stream_classes=blocks)
    if mode == "local":
        view_b = WeightView(model, side_b, cache=True, stream_classes=blocks)
    else:
        view_b = WeightView.shared(model, side_b, stream_classes=blocks)
    inputs_a = side_inputs(inputs, side_a, device)
    inputs_b = side_inputs(inputs, side_b, device)
    collector = Collector(view_a.module_classes)
    recorder = FlowRecorder()
    timings: dict[str, float] = {}
    result_meta = {
        **(meta or {}),
        "device": str(device),
        "autocast_policy_a": side_a.resolved_autocast_policy,
        "autocast_policy_b": side_b.resolved_autocast_policy,
        "param_dtypes_a": view_a.plan.dtype_counts(),
        "param_dtypes_b": view_b.plan.dtype_counts(),
        "versions": dict(_versions()),
        "stream": stream,
    }
    if lockstep is None:
        lockstep = mode == "propagated" and (stream or device.type == "cuda")
    result_meta["lockstep"] = bool(lockstep)

    def partial() -> Result:
        return Result(
            mode,
            side_a.to_dict(),
            side_b.to_dict(),
            collector.rows(),
            list(collector.skipped),
            {**result_meta, "timings_s": dict(timings), "repeated_pairs": collector.repeats},
            flow=recorder.flow(mode, view_a, view_b, inputs.roles),
        )

    phase = {"side": side_a.name}
    # Eval mode for the pair, and back: only the modules that were training are touched (a
    # recursive model.eval()/train() walk costs as much as a tiny model's module).
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        with torch.no_grad():
            run = _PairRun(
                model,
                inputs_a,
                inputs_b,
                side_a,
                side_b,
                view_a,
                view_b,
                device,
                collector,
                names_filter,
                timings,
                phase,
                recorder,
            )
            if lockstep:
                from lab.lockstep import run_lockstep

                block_ids = outermost(model, _block_classes(model, side_a, side_b))
                run_lockstep(run, block_ids, stream=stream)
            elif mode == "propagated":
                _run_propagated(run)
            else:
                _run_local(run)
    except Exception as err:
        result = partial()
        side = phase["side"]
        hint = ""
        if isinstance(err, torch.cuda.OutOfMemoryError):
            hint = (
                " Out of GPU memory: use a smaller preset, names_filter to capture fewer "
                "modules, or mode='propagated' (local mode caches side B's weights)."
            )
        where = failing_module(err, model)
        module, module_class = where if where is not None else (None, None)
        failed, view = (side_b, view_b) if side == side_b.name else (side_a, view_a)
        fix = dtype_mismatch_fix(err, failed, module, view.plan.param_dtypes) if module else None
        raise PairError(
            f"pair: side {side!r} failed after {len(result.rows)} compared pair(s)"
            + (f", in module {module!r} ({module_class})" if module else "")
            + f": {type(err).__name__}: {err}.{hint}"
            + (f" {fix}" if fix else "")
            + _inputs_mismatch_hint(model, inputs)
            + " The pairs compared so far are in err.result.",
            result,
            side=side,
            module=module,
            module_class=module_class,
            fix=fix,
        ) from err
    finally:
        for m in training:
            m.training = True
    result = partial()
    if check_outputs:
        _check_outputs(result, side_a, side_b)
    return result


@dataclass
class _PairRun:
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
    """Input dtypes (and side A's producers) of every captured call, for `lab.why`."""

    def forward(self, which: str, hooks: ModuleHooks | None) -> None:
        """Run side `which` ("a" or "b") over the whole model with `hooks`, timed.

        `hooks=None`: the caller has attached its hooks already.
        """
        side, view, inputs = (
            (self.side_a, self.view_a, self.inputs_a)
            if which == "a"
            else (self.side_b, self.view_b, self.inputs_b)
        )
        self.phase["side"] = side.name
        start = time.perf_counter()
        attached = hooks.attached() if hooks is not None else contextlib.nullcontext()
        with attached, view.applied(), side_context(side, self.device, self.model):
            self.model(**inputs.kwargs)
        _sync(self.device)
        self.timings[f"{which}_s"] = time.perf_counter() - start


class _Store:
    """Side A's outputs, held until side B's matching output arrives (then compared, dropped)."""

    def __init__(self, flow: FlowRecorder) -> None:
        self.tensors: dict[tuple[str, int, str], Any] = {}
        self.order: dict[tuple[str, int, str], int] = {}
        self.names: dict[tuple[str, int, str], int | None] = {}
        self.aliases_a, self.aliases_b = Aliases(), Aliases()
        self.flow = flow
        # One copy per tensor object, alive while some kept output still refers to it.
        self._copies: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def keep(self, label: str, call: int, args: tuple, kwargs: dict, output: Any) -> None:
        with torch._C.DisableTorchFunction():  # see `compare`
            self.flow.record("a", label, call, args, kwargs)
            self._keep(label, call, output)

    def _keep(self, label: str, call: int, output: Any) -> None:
        for idx, leaf in flatten_output(output):
            key = (label, call, idx)
            self.order.setdefault(key, len(self.order))
            name = self.names[key] = self.aliases_a.name(leaf)
            self.flow.note_output(name, key, leaf)
            if not isinstance(leaf, torch.Tensor) or name is None:
                self.tensors[key] = leaf
                continue
            # Copied: a later in-place op of the forward must not edit what we compare.
            copy = self._copies.get(name)
            if copy is None:
                copy = self._copies[name] = leaf.detach().clone()
            self.tensors[key] = copy

    def compare(
        self, run: _PairRun, label: str, call: int, args: tuple, kwargs: dict, output: Any
    ) -> None:
        # Bookkeeping, copies and metrics are no part of the side's forward: no autocast
        # emulation (a Python torch-function mode) between them and torch, which would cost
        # ~5 us a tensor call (a `.dtype` read included) on a tiny CPU model.
        with torch._C.DisableTorchFunction():
            self.flow.record("b", label, call, args, kwargs)
            self._compare(run, label, call, output)

    def _compare(self, run: _PairRun, label: str, call: int, output: Any) -> None:
        for idx, leaf in flatten_output(output):
            key = (label, call, idx)
            if key not in self.tensors:
                reason = f"only on side {run.side_b.name!r}"
                run.collector.skipped.append(Skipped(label, call, idx, reason))
                continue
            names = (self.names.pop(key), self.aliases_b.name(leaf))
            a = self.tensors.pop(key)
            run.collector.compare(self.order[key], key, a, leaf, a_owned=True, names=names)

    def report_leftovers(self, run: _PairRun) -> None:
        for module, call, idx in sorted(self.tensors, key=self.order.__getitem__):
            reason = f"only on side {run.side_a.name!r}"
            run.collector.skipped.append(Skipped(module, call, idx, reason))


def _run_propagated(run: _PairRun) -> None:
    store = _Store(run.flow)
    run.flow.track(store.aliases_a, run.inputs_a.kwargs)
    # One set of hooks for both passes: side A's outputs are kept, side B's compared.
    on = {"output": lambda lb, c, a, k, out: store.keep(lb, c, a, k, out)}
    hooks = ModuleHooks(
        run.model,
        lambda lb, c, m, a, k, out: on["output"](lb, c, a, k, out),
        names_filter=run.names_filter,
    )
    with hooks.attached():
        run.forward("a", None)
        hooks.calls.clear()  # side B's calls count from zero again
        on["output"] = lambda lb, c, a, k, out: store.compare(run, lb, c, a, k, out)
        run.forward("b", None)
    store.report_leftovers(run)


def _run_local(run: _PairRun) -> None:
    # Pass 1: side B's own forward, recording only the dtypes each module call receives, so the
    # re-runs below hand B side A's values in the dtypes B's forward would have handed it.
    b_dtypes: dict[tuple[str, int], Any] = {}

    def record_dtypes(label: str, call: int, module: Any, args: tuple, kwargs: dict) -> None:
        with torch._C.DisableTorchFunction():
            b_dtypes[(label, call)] = (_dtype_tree(args), _dtype_tree(kwargs))
            run.flow.record("b", label, call, args, kwargs)

    run.forward(
        "b",
        ModuleHooks(
            run.model, lambda *a: None, on_input=record_dtypes, names_filter=run.names_filter
        ),
    )

    saved: list[tuple[tuple, dict]] = []
    counter = [0]
    side_b, collector = run.side_b, run.collector
    hooks: ModuleHooks

    def on_input(label: str, call: int, module: Any, args: tuple, kwargs: dict) -> None:
        with torch._C.DisableTorchFunction():
            run.flow.record("a", label, call, args, kwargs)
        # Cloned (and cast): the module may edit its inputs in place before B re-runs it.
        want = b_dtypes.get((label, call))
        if want is None:
            saved.append((_clone_tree(args), _clone_tree(kwargs)))
        else:
            saved.append((_cast_tree(args, want[0]), _cast_tree(kwargs, want[1])))

    def on_output(label: str, call: int, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        a_args, a_kwargs = saved.pop()
        with hooks.paused(), run.view_b.applied(module), side_context(side_b, run.device, module):
            try:
                out_b = module(*a_args, **a_kwargs)
            except torch.cuda.OutOfMemoryError:
                raise
            except (RuntimeError, ValueError, TypeError) as err:
                for idx, _ in flatten_output(output):
                    collector.skipped.append(
                        Skipped(label, call, idx, f"side {side_b.name!r} re-run failed: {err}")
                    )
                return
        leaves_b = dict(flatten_output(out_b))
        for idx, leaf in flatten_output(output):
            order = counter[0]
            counter[0] += 1
            if idx not in leaves_b:
                reason = f"only on side {run.side_a.name!r}"
                collector.skipped.append(Skipped(label, call, idx, reason))
                continue
            collector.compare(order, (label, call, idx), leaf, leaves_b[idx])

    hooks = ModuleHooks(run.model, on_output, on_input=on_input, names_filter=run.names_filter)
    run.forward("a", hooks)


def _block_classes(model: torch.nn.Module, side_a: Side, side_b: Side) -> tuple[str, ...]:
    declared = getattr(model, "_no_split_modules", None) or ()
    return tuple(side_b.fsdp_wrap_classes or side_a.fsdp_wrap_classes or declared)


def _dtype_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, list | tuple):
        return [_dtype_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: _dtype_tree(v) for k, v in value.items()}
    return None


def _cast_tree(value: Any, dtypes: Any) -> Any:
    """Clone `value`, casting floating tensors to the dtype at the same place in `dtypes`."""
    if isinstance(value, torch.Tensor):
        want = dtypes if isinstance(dtypes, torch.dtype) else None
        if want is not None and value.is_floating_point() and want.is_floating_point:
            return value.detach().to(want, copy=True)
        return value.detach().clone()
    if isinstance(value, list | tuple):
        subs = (
            dtypes
            if isinstance(dtypes, list) and len(dtypes) == len(value)
            else [None] * len(value)
        )
        out = [_cast_tree(v, d) for v, d in zip(value, subs, strict=True)]
        return out if isinstance(value, list) else tuple(out)
    if isinstance(value, dict):
        subs = dtypes if isinstance(dtypes, dict) else {}
        return {k: _cast_tree(v, subs.get(k)) for k, v in value.items()}
    return value


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_outputs(result: Result, side_a: Side, side_b: Side) -> None:
    if not result.rows:
        reasons = "; ".join(f"{s.module}: {s.reason}" for s in result.skipped[:3])
        raise PairError(
            f"pair: no module output could be compared ({len(result.skipped)} skipped"
            f"{': ' + reasons if reasons else ''}). Check names_filter and the sides' dtypes.",
            result,
        )
    roots = result.root_rows()
    if not roots:
        return
    for name, attr in ((side_a.name, "nonfinite_a"), (side_b.name, "nonfinite_b")):
        bad = [r for r in roots if getattr(r.metrics, attr)]
        if bad:
            first = next((r for r in result.rows if getattr(r.metrics, attr)), bad[0])
            raise NonFiniteOutputError(
                f"pair: side {name!r} produced {getattr(bad[0].metrics, attr)} NaN/Inf value(s) "
                f"in its model output; the first module with non-finite output is "
                f"{first.label()!r} ({first.module_class}). Check that side's dtypes (fp16 "
                "overflows above 65504) and inputs. The Result is in err.result; pass "
                "check_outputs=False to get it returned.",
                result,
            )
    main = roots[0].metrics
    if main.degenerate:
        what = "all zero" if main.max_abs_a == 0 and main.max_abs_b == 0 else "constant"
        raise DegenerateOutputError(
            f"pair: both sides' model outputs are {what}, so their agreement proves nothing "
            "(zero-initialised output layers, as some checkpoints ship them?). Use seeded random "
            "weights (Family.build) or real weights. The Result is in err.result; pass "
            "check_outputs=False to get it returned.",
            result,
        )


@functools.cache
def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    with contextlib.suppress(md.PackageNotFoundError):
        out["diffusers"] = md.version("diffusers")
    return out


def pair_family(
    family_name: str,
    preset: str = "tiny",
    *,
    seed: int = 0,
    device: str = "cpu",
    mode: Mode = "propagated",
    batch: int = 1,
    cfg: bool = False,
    sigma: float = 0.75,
    variant: str | None = None,
    rollout: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    checkpoint: str | None = None,
    capture_depth: int | None = None,
    stream: bool | None = None,
    lockstep: bool | None = None,
    init: str | None = None,
) -> Result:
    """Build (or load) a family model and pair its rollout side against its trainer side.

    Args:
        family_name: One of `lab.families()`.
        preset: "tiny", "reduced" or "full".
        seed: Weight and input seed.
        device: "cpu" or "cuda".
        mode: "propagated" or "local".
        batch: Samples per forward.
        cfg: Use the family's CFG layout (the positive forward is paired).
        sigma: The step's flow-matching sigma.
        variant: A family variant (e.g. sd3 "large").
        rollout: Field overrides for `Side.rollout(family)` (e.g. {"attention_backend": "math"}).
        trainer: Field overrides for `Side.trainer(family)`.
        checkpoint: A local diffusers checkpoint directory to load instead of seeded weights.
        capture_depth: Capture only modules this many levels deep (1 = every block's output);
            None captures every module.
        stream: Cast weights block by block (see `pair`); None: for "full" and checkpoints.
        lockstep: Two forwards in lockstep (see `pair`); None: on CUDA or when streaming.
        init: Seeded-weight regime for `Family.build` ("trained", "bf16_shipped", "plain");
            None = the build default. Recorded as meta["init"] ("checkpoint" when loaded).

    Returns:
        The Result, with family, preset, seed and sigma in its meta.
    """
    from lab.families import family as get_family

    fam = get_family(family_name)
    resolve_device(device)
    side_a = Side.rollout(fam, device=device, **(rollout or {}))
    side_b = Side.trainer(fam, device=device, **(trainer or {}))
    if checkpoint:
        model = fam.load(checkpoint, device=device)
    else:
        model = fam.build(
            preset,
            seed,
            variant=variant,
            device=device,
            expert=fam.expert_for_sigma(sigma),
            **({} if init is None else {"init": init}),
        )
    # A checkpoint's own config sets the input widths: the preset's may be another size.
    own_config = dict(model.config) if checkpoint else None
    inputs = fam.make_inputs(
        preset, seed, batch, cfg, variant=variant, sigma=sigma, device=device, config=own_config
    )
    meta = dict(
        family=family_name,
        preset=preset,
        seed=seed,
        sigma=sigma,
        batch=batch,
        cfg=cfg,
        variant=variant,
        checkpoint=checkpoint,
        expert=fam.expert_for_sigma(sigma),
        init="checkpoint" if checkpoint else getattr(model, "lab_init", None),
    )
    if checkpoint:
        # Which files, index, variant and stored dtypes the load read (Family.load records it).
        meta["checkpoint_files"] = getattr(model, "lab_checkpoint", None)
    from lab.capture import depth_filter

    names_filter = depth_filter(capture_depth) if capture_depth is not None else None
    meta["capture_depth"] = capture_depth
    if stream is None:
        stream = preset == "full" or bool(checkpoint)
    return pair(
        model,
        inputs,
        side_a,
        side_b,
        mode,
        meta=meta,
        names_filter=names_filter,
        stream=stream,
        lockstep=lockstep,
    )

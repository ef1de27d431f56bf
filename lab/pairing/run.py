"""pair(): model + inputs + two sides -> Result, comparing every module output as it is produced."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch

from lab.base.arguments import checked_arguments
from lab.base.devices import DeviceName, resolve_device
from lab.base.errors import (
    DegenerateOutputError,
    NonFiniteOutputError,
    PairError,
)
from lab.families import FamilyName, Inputs
from lab.families.master import master_summary
from lab.pairing.capture import ROOT, ModuleHooks, OutputReports, flatten_output, output_leaves
from lab.pairing.collect import (
    Aliases,
    Collector,
    OutputEdited,
    metric_batch_bytes,
    metrics_on_side_stream,
)
from lab.pairing.dtype_flow import FlowRecorder
from lab.pairing.guards import (
    _holding_model,
    check_fp32_master,
    check_inputs,
    check_master_fits,
    device_memory_bytes,
    dtype_mismatch_fix,
    failing_module,
    inputs_mismatch_hint,
)
from lab.pairing.lockstep import check_switches, run_lockstep
from lab.pairing.metrics import metrics_kernel
from lab.pairing.result import Result, Skipped
from lab.pairing.side_context import (
    check_side_device,
    side_context,
    side_inputs,
)
from lab.pairing.sides import Side
from lab.pairing.state import PairRun
from lab.pairing.weights import WeightView, outermost

Mode = Literal["propagated", "local"]
MODES: tuple[str, ...] = ("propagated", "local")

_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


@checked_arguments
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
        PairError: The forward raised (a dtype clash from a rule, out of memory): names the
            side, the innermost module that was running and, where known, the fix
            (`err.module`, `err.fix`; `err.result` is None: nothing is compared here).
    """
    device = model_device(model)
    check_side_device(side, device, model)
    check_inputs(model, inputs, "forward_side")
    if view is not None and (view.side != side or view.model is not model):
        raise ValueError(
            f"forward_side: the WeightView was made for Side({view.side.name!r}) on another "
            f"model or side; build it as WeightView(model, side) for Side({side.name!r})."
        )
    view = view if view is not None else WeightView.shared(model, side)
    cast = side_inputs(inputs, side, device)
    try:
        with torch.no_grad(), view.applied(), side_context(side, device, model):
            return model(**cast.kwargs)
    except OSError:
        raise  # a hook's I/O (a dump's full disk): no side setting to name, its own words
    except Exception as err:
        raise _side_failure("forward_side", err, model, inputs, side, view) from err


def _side_failure(
    where: str, err: Exception, model: torch.nn.Module, inputs: Inputs, side: Side, view: Any
) -> PairError:
    """What failed in one side's plain forward, where, and the fix (as `pair` says it)."""
    found = failing_module(err, model)
    module, module_class = found if found is not None else (None, None)
    fix = dtype_mismatch_fix(err, side, module, view.plan.param_dtypes) if module else None
    hint = (
        " Out of GPU memory: use a smaller preset or fewer samples a forward."
        if isinstance(err, torch.cuda.OutOfMemoryError)
        else ""
    )
    return PairError(
        f"{where}: side {side.name!r} failed"
        + (f" in module {module!r} ({module_class})" if module else "")
        + f": {type(err).__name__}: {err}.{hint}"
        + (f" {fix}" if fix else "")
        + inputs_mismatch_hint(model, inputs),
        None,
        side=side.name,
        module=module,
        module_class=module_class,
        fix=fix,
    )


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


def check_mode(mode: str, where: str) -> None:
    """Refuse a pairing mode other than MODES, listing them."""
    if mode not in MODES:
        raise ValueError(f"{where}: unknown mode {mode!r}. Known: {', '.join(MODES)}.")


@checked_arguments
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
    outputs: dict[str, Any] | None = None,
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
            module by module (`lab.pairing.lockstep`), so memory holds one forward's activations per
            side and no copies. False: side A runs first and keeps a copy of every captured
            output until side B reaches it (cheaper per module when tensors are tiny). None
            (default): lockstep on CUDA or when streaming, two passes otherwise. Both give
            identical Results.
        outputs: Propagated mode only. A dict that receives each side's model output, as
            `forward_side` would return it, under "a" and "b" (the same tensors, bit for bit:
            a caller that needs both the outputs and the Result runs the forwards once).

    Returns:
        The Result, rows in forward completion order.

    Raises:
        ValueError: Unknown mode, a side that cannot run on this device, bad rules.
        NonFiniteOutputError: NaN/Inf in a side's model output (check_outputs).
        DegenerateOutputError: Both model outputs all zero or constant (check_outputs).
        PairError: A side's forward failed (out of memory, dtype error); `.result` holds the
            pairs compared before the failure.
    """
    entered = time.perf_counter()
    check_mode(mode, "pair")
    if outputs is not None and mode != "propagated":
        raise ValueError(
            "pair: outputs= needs mode='propagated'; local mode runs side B module by module, "
            "with no whole forward of its own to hand back."
        )
    if lockstep and mode != "propagated":
        raise ValueError(
            "pair: lockstep=True pairs propagated forwards; local mode re-runs each module "
            "under side B inside side A's forward. Use mode='propagated' or lockstep=None."
        )
    for name, side in (("side_a", side_a), ("side_b", side_b)):
        if not isinstance(side, Side):
            raise ValueError(
                f"pair: {name} must be a lab.Side, got {type(side).__name__} {side!r:.80}. Make "
                "one with lab.Side.rollout(fam) / lab.Side.trainer(fam), and .replace(...) to "
                "change fields (pair_family takes dicts of overrides)."
            )
    device = model_device(model)
    for side in (side_a, side_b):
        check_side_device(side, device, model)
    check_inputs(model, inputs, "pair")
    # The metric switches are read inside the forwards: refuse a bad one before they start.
    metrics_kernel()
    metrics_on_side_stream()
    metric_batch_bytes()
    check_switches()
    blocks = block_classes(model, side_a, side_b) if stream else ()
    if stream and not blocks:
        raise ValueError(
            f"pair: stream=True needs block classes; neither side names fsdp_wrap_classes and "
            f"{type(model).__name__} declares no _no_split_modules. Set "
            "side.replace(fsdp_wrap_classes=(...)) on one side."
        )
    # The views plan without casting (one module-tree check for both); their cached layout
    # lists the parameters, so the guards and the master summary walk no module tree, and
    # while no tensor changed kind since the last pair of this model they are not run again
    # (`WeightView.memo`).
    view_a, view_b = WeightView.both(
        model, side_a, side_b, stream_classes=blocks, cache_b=mode == "local"
    )
    params = view_a.parameters()
    memo = view_a.memo()
    fits = ("fits", (side_a.param_torch_dtype, side_b.param_torch_dtype), blocks,
            device_memory_bytes(device))  # fmt: skip
    if fits not in memo:
        check_master_fits(model, inputs, (side_a, side_b), blocks, "pair")
        memo[fits] = True
    if "fp32_master" not in memo:
        check_fp32_master(model, "pair", [p for _, p in params])
        memo["fp32_master"] = True
    if "master_summary" not in memo:
        memo["master_summary"] = master_summary(model, params)
    summary = memo["master_summary"]
    inputs_a = side_inputs(inputs, side_a, device)
    inputs_b = side_inputs(inputs, side_b, device)
    collector = Collector(
        view_a.module_classes,
        copies=model in _EDITS_OUTPUTS,
        master_bytes=int(summary["held_gib"] * 2**30),
    )
    recorder = FlowRecorder()
    timings: dict[str, float] = {}
    core: dict[str, Any] = {}
    # Inputs from `make_inputs` know their family and preset (`Inputs.origin`, checked against
    # the model above): a bare `pair` names them too, so its figures and summary read
    # "flux [tiny]", not "model [?]"; what the caller's meta says wins.
    origin = inputs.origin if isinstance(inputs, Inputs) else None
    named = dict(zip(("family", "preset", "variant"), origin, strict=True)) if origin else {}
    result_meta = {
        **{k: v for k, v in named.items() if v is not None},
        **(meta or {}),
        "device": str(device),
        "autocast_policy_a": side_a.resolved_autocast_policy,
        "autocast_policy_b": side_b.resolved_autocast_policy,
        "param_dtypes_a": view_a.plan.dtype_counts(),
        "param_dtypes_b": view_b.plan.dtype_counts(),
        "versions": _versions(str(device)),
        "stream": stream,
        "master": {**summary, "held": dict(summary["held"])},
    }
    if lockstep is None:
        lockstep = mode == "propagated" and (stream or device.type == "cuda")
    result_meta["lockstep"] = bool(lockstep)

    def partial() -> Result:
        start = time.perf_counter()
        rows = collector.rows()
        # The rows, from the last metric batch's transfer to the sorted LayerDivergences.
        timings["rows_s"] = time.perf_counter() - start
        meta = {**result_meta, "timings_s": dict(timings), "repeated_pairs": collector.repeats}
        batches = collector.metric_batches()
        if batches is not None:
            meta["metric_batches"] = batches
        if core:
            meta["pair_core"] = dict(core)
        return Result(
            mode,
            side_a.to_dict(),
            side_b.to_dict(),
            rows,
            list(collector.skipped),
            meta,
            flow=recorder.flow(mode, view_a, view_b, inputs.roles),
        )

    phase = {"side": side_a.name}
    # Eval mode for the pair, and back: only the modules that were training are touched (a
    # recursive model.eval()/train() walk costs as much as a tiny model's module).
    training = [m for _, m in view_a.named_modules if m.training]
    for m in training:
        m.training = False
    # Before the sides run: the checks, the views, the guards (memoized), the sides' inputs.
    timings["setup_s"] = time.perf_counter() - entered
    try:
        with torch.no_grad():
            run = PairRun(
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
                outputs,
                core,
            )
            try:
                _run_strategy(run, mode, lockstep, stream)
            except OutputEdited:
                # The forward edits a captured output in place: run again copying outputs as
                # they arrive, and from now on for this model.
                _EDITS_OUTPUTS[model] = True
                collector.reset(copies=True)
                recorder.reset()
                _run_strategy(run, mode, lockstep, stream)
    except Exception as err:
        collector.drop_edited()
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
            + inputs_mismatch_hint(model, inputs)
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
        _check_outputs(result, side_a, side_b, inputs)
    return result


_EDITS_OUTPUTS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
"""Models whose forward edited a captured output in place: their pairs copy outputs."""


def _run_strategy(run: PairRun, mode: str, lockstep: bool, stream: bool) -> None:
    """Run both sides and pair their outputs, then reduce what is still deferred.

    Raises:
        OutputEdited: A captured output was edited in place before it was compared (run
            again with `run.collector.copies` set).
    """
    if lockstep:
        block_ids = outermost(run.model, block_classes(run.model, run.side_a, run.side_b))
        run_lockstep(run, block_ids, stream=stream)
    elif mode == "propagated":
        _run_propagated(run)
    else:
        _run_local(run)
    run.collector.flush()


class _Store:
    """Side A's outputs, held until side B's matching output arrives (then compared, dropped).

    Held as they are, with their `_version`: a forward that edits one in place before side B
    compares it raises `OutputEdited`, and `pair` runs again with copies (`copies=True`).
    """

    def __init__(self, flow: FlowRecorder, copies: bool) -> None:
        self.tensors: dict[tuple[str, int, str], Any] = {}
        self.order: dict[tuple[str, int, str], int] = {}
        self.names: dict[tuple[str, int, str], int | None] = {}
        self.versions: dict[tuple[str, int, str], int] = {}
        self.aliases_a, self.aliases_b = Aliases(), Aliases()
        self.flow = flow
        self.copies = copies
        # One copy per tensor object, alive while some kept output still refers to it.
        self._copies: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def keep(self, label: str, call: int, args: tuple, kwargs: dict, output: Any) -> None:
        with torch._C.DisableTorchFunction():  # see `compare`
            self.flow.record("a", label, call, args, kwargs)
            self._keep(label, call, output)

    def _keep(self, label: str, call: int, output: Any) -> None:
        for idx, leaf in output_leaves(output):
            key = (label, call, idx)
            self.order.setdefault(key, len(self.order))
            name = self.names[key] = self.aliases_a.name(leaf)
            self.flow.note_output(name, key, leaf)
            if not isinstance(leaf, torch.Tensor) or name is None or not self.copies:
                self.tensors[key] = leaf
                if name is not None:
                    self.versions[key] = leaf._version
                continue
            # Copied: a later in-place op of the forward must not edit what we compare.
            copy = self._copies.get(name)
            if copy is None:
                copy = self._copies[name] = leaf.detach().clone()
            self.tensors[key] = copy

    def compare(
        self, run: PairRun, label: str, call: int, args: tuple, kwargs: dict, output: Any
    ) -> None:
        # Bookkeeping, copies and metrics are no part of the side's forward: no autocast
        # emulation (a Python torch-function mode) between them and torch, which would cost
        # ~5 us a tensor call (a `.dtype` read included) on a tiny CPU model.
        with torch._C.DisableTorchFunction():
            self.flow.record("b", label, call, args, kwargs)
            self._compare(run, label, call, output)

    def _compare(self, run: PairRun, label: str, call: int, output: Any) -> None:
        for idx, leaf in output_leaves(output):
            key = (label, call, idx)
            if key not in self.tensors:
                reason = f"only on side {run.side_b.name!r}"
                run.collector.skipped.append(Skipped(label, call, idx, reason))
                continue
            names = (self.names.pop(key), self.aliases_b.name(leaf))
            a = self.tensors.pop(key)
            version = self.versions.pop(key, None)
            if version is not None and a._version != version:
                raise OutputEdited(*key)
            run.collector.compare(self.order[key], key, a, leaf, a_owned=self.copies, names=names)

    def report_leftovers(self, run: PairRun) -> None:
        for module, call, idx in sorted(self.tensors, key=self.order.__getitem__):
            reason = f"only on side {run.side_a.name!r}"
            run.collector.skipped.append(Skipped(module, call, idx, reason))


def _run_propagated(run: PairRun) -> None:
    store = _Store(run.flow, run.collector.copies)
    run.flow.track(store.aliases_a, run.inputs_a.kwargs)
    # One set of hooks for both passes: side A's outputs are kept, side B's compared.
    on = [store.keep]

    def on_output(label: str, call: int, module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        on[0](label, call, args, kwargs, out)

    # Reported from instance forwards, not hooks (`OutputReports`): the same calls, without
    # `Module._call_impl`'s slow path on every captured call. Each side's forward wraps its
    # own engine-op forwards, and its calls count from zero.
    keep = run.names_filter
    labelled = [(module, name or ROOT) for name, module in run.view_a.named_modules]
    modules = [(m, label) for m, label in labelled if keep is None or keep(label)]
    reports = OutputReports(modules, on_output)
    run.forward("a", None, reports)
    on[0] = functools.partial(store.compare, run)
    run.forward("b", None, reports)
    store.report_leftovers(run)


def _run_local(run: PairRun) -> None:
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


def block_classes(model: torch.nn.Module, side_a: Side, side_b: Side) -> tuple[str, ...]:
    """The block classes `pair` and `trajectory` stream: the sides' wrap classes, else the model's.

    The model's are its own `_no_split_modules`.
    """
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


def _nonfinite_inputs(inputs: Inputs) -> str:
    """' The inputs already hold ...' naming each floating kwarg with NaN/Inf, or ''."""
    found = []
    for key, value in inputs.kwargs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            count = int((~torch.isfinite(value)).sum())
            if count:
                found.append(f"{key!r} ({inputs.roles.get(key, 'aux')}): {count}")
    if not found:
        return ""
    return (
        f" The inputs already hold NaN/Inf ({', '.join(found)}): the model only carried them "
        "through; fix the inputs, not the sides."
    )


def _check_outputs(result: Result, side_a: Side, side_b: Side, inputs: Inputs) -> None:
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
                f"{first.label()!r} ({first.module_class})."
                + (
                    _nonfinite_inputs(inputs)
                    or " Check that side's dtypes (fp16 overflows above 65504) and inputs."
                )
                + " The Result is in err.result; pass check_outputs=False to get it returned.",
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


def _versions(device: str = "cpu") -> dict[str, str]:
    """What the numbers depend on besides the settings: packages, CPU kernel set, GPU."""
    out = dict(_software())
    if device.startswith("cuda"):
        # Another GPU or CUDA build picks other kernels (and tile sizes): other low bits.
        out["cuda"] = str(torch.version.cuda)
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


@functools.cache
def _software() -> dict[str, str]:
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    with contextlib.suppress(md.PackageNotFoundError):
        out["diffusers"] = md.version("diffusers")
    # ATen's CPU kernel set (AVX512, AVX2, ...; ATEN_CPU_CAPABILITY can lower it): its
    # vectorized reductions round differently, so CPU results are bit-exact only within one.
    out["cpu"] = torch.backends.cpu.get_cpu_capability()
    return out


@checked_arguments
def pair_family(
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    seed: int = 0,
    device: DeviceName = "cpu",
    mode: Mode = "propagated",
    batch: int = 1,
    cfg: bool = False,
    sigma: float = 0.75,
    variant: str | None = None,
    rollout: dict[str, Any] | Side | None = None,
    trainer: dict[str, Any] | Side | None = None,
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
        rollout: Field overrides for `Side.rollout(family)` (e.g. {"attention_backend": "math"}),
            or a Side used as it is.
        trainer: Field overrides for `Side.trainer(family)`, or a Side.
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
    side_a = Side.from_overrides(rollout, fam, "rollout", device, where="pair_family")
    side_b = Side.from_overrides(trainer, fam, "trainer", device, where="pair_family")
    # What pair() would refuse only after the model is built (seconds at full size).
    check_mode(mode, "pair_family")
    if capture_depth is not None and (
        isinstance(capture_depth, bool) or not isinstance(capture_depth, int) or capture_depth < 0
    ):
        raise ValueError(
            f"pair_family: capture_depth must be None (every module) or an int >= 0 (0: the "
            f"model's own children, 1: every block's output too), got {capture_depth!r}."
        )
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
    from lab.pairing.capture import depth_filter

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

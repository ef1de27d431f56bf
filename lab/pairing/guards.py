"""What a pair or forward refuses before it starts, and what a failure says afterwards.

Before: a model another thread is running (`model_in_use`), a master that is not fp32 (or a
compact one whose held tensors changed), a master too large to pair on the device, inputs that
do not fit the model. After: the module that was running when a forward raised, and how
to fix a dtype mismatch there.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import gc
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from lab.base.dtypes import dtype_name, parse_dtype
from lab.base.errors import ModelInUseError
from lab.families import Inputs
from lab.families.master import canonical_parameters, held_parameters, stale_held_message
from lab.pairing.capture import ROOT
from lab.pairing.sides import Side


class _Holds:
    """Which thread holds each parameter and storage a pair or forward may swap, and how often.

    Keyed on what the sides actually touch, not on the Module object: a `copy.copy` of a model
    (or any other Module built around the same Parameters, or Parameters viewing the same
    storage) is a second Module over the same tensors, and a pair of it in another thread would
    take the first pair's casts for its masters (seen: a wrong Result, and the master left
    bf16).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owners: dict[tuple[Any, ...], list[Any]] = {}
        """Key -> [holding thread id, how many holds, the holding model (its id, its class)]."""
        self.keys: dict[tuple[int, int], tuple[tuple[Any, ...], ...]] = {}
        """(thread id, id(model)) of an outermost hold -> the keys it took."""


_HOLDS = _Holds()


def _tensor_keys(model: torch.nn.Module) -> tuple[tuple[Any, ...], ...]:
    """The model's parameters and buffers by identity, and the storages they view.

    Storage by address (and device): two Parameter objects over one storage are one master.
    A meta or empty tensor has no storage to share (address 0).
    """
    keys: dict[tuple[Any, ...], None] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        keys[("tensor", id(tensor))] = None
        try:
            address = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a subclass without one storage (DTensor)
            address = 0
        if address:
            keys[("storage", str(tensor.device), address)] = None
    return tuple(keys)


@contextlib.contextmanager
def model_in_use(model: torch.nn.Module, where: str) -> Iterator[None]:
    """Hold `model`'s parameters for one pair or forward; another thread's call is refused.

    Each side swaps the parameter tensors in place, so a second thread pairing the same
    parameters meanwhile takes the first side's casts for the fp32 masters and "restores"
    them (seen: every parameter left bf16 for later runs). What is held is every parameter
    and buffer and the storage each views, so a second Module over the same tensors (a
    `copy.copy` of the model) is refused as the model itself is. The holding thread may
    nest calls (a trajectory pairs between its forwards); lockstep's two side threads run
    inside the holder's call.

    Raises:
        ModelInUseError: Another thread holds the model or a tensor of it, naming its class
            and the fix.
    """
    me = threading.get_ident()
    hold = (me, id(model))
    with _HOLDS.lock:
        keys = None if hold in _HOLDS.keys else _tensor_keys(model)
        if keys is not None:
            other = next((_HOLDS.owners[k] for k in keys if k in _HOLDS.owners
                          and _HOLDS.owners[k][0] != me), None)  # fmt: skip
            if other is not None:
                raise ModelInUseError(_in_use_message(model, where, other[2]))
            holder = (id(model), type(model).__name__)
            for key in keys:
                owner = _HOLDS.owners.setdefault(key, [me, 0, holder])
                owner[1] += 1
            _HOLDS.keys[hold] = keys
    try:
        yield
    finally:
        if keys is not None:
            with _HOLDS.lock:
                del _HOLDS.keys[hold]
                for key in keys:
                    owner = _HOLDS.owners[key]
                    owner[1] -= 1
                    if not owner[1]:
                        del _HOLDS.owners[key]


def _in_use_message(model: torch.nn.Module, where: str, holder: tuple[int, str]) -> str:
    name = type(model).__name__
    what = (
        f"this {name} is being paired or run in another thread right now"
        if holder[0] == id(model)
        else f"this {name} shares parameter tensors with a {holder[1]} another thread is pairing "
        "or running right now (a copy.copy of a model shares them)"
    )
    return (
        f"{where}: {what}. Its sides swap the parameter tensors in place, so a second call at "
        "the same time would corrupt it. Wait for the other call to finish, or give this "
        "thread its own model (copy.deepcopy(model), or fam.build(...) again)."
    )


def _holding_model(where: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated function (model first) inside `model_in_use(model, where)`.

    The model is checked as the fp32 master every side casts from (`check_fp32_master`) once
    held: every plain forward of a side goes through here, so none takes a bf16 model for the
    master. `pair` checks its own (memoized with its other guards, `WeightView.memo`).
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def holding(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            with model_in_use(model, where), gc_paused():
                if where not in _CHECKS_ITS_OWN_MASTER and isinstance(model, torch.nn.Module):
                    check_fp32_master(model, where)  # (not a module: the function names it)
                return fn(model, *args, **kwargs)

        return holding

    return wrap


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the call, and back on (if it was) after.

    A pair makes many short-lived objects (hook arguments, records, pending pairs). With the
    collector on, those alive when a young collection runs are promoted, and enough promotions
    start a full collection, which walks every object of the process: 0.17 s with a flux
    full model loaded (334k objects), and it landed inside pairs on the H200 twice a pair
    (cProfile: WeightView.__init__ 0.33 s, decode_stats 0.33 s of self time). Off for the
    call, they die before any collection sees them; what the call keeps (a Result's rows, ~2
    objects a row) is collected as usual afterwards. Plain forwards (`forward_side`) run the
    same way, so pairing is compared with forwards under the same rule.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_CHECKS_ITS_OWN_MASTER = frozenset({"pair"})
"""Callers of `_holding_model` that run `check_fp32_master` themselves."""

_MASTER_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, ...]] = (
    weakref.WeakKeyDictionary()
)
"""Compact masters that passed `check_fp32_master`, with the state they passed in."""


def check_fp32_master(
    model: torch.nn.Module, where: str, params: Iterable[torch.Tensor] | None = None
) -> None:
    """Refuse a model whose parameters are not (at least) fp32: sides cast from an fp32 master.

    A bf16 model taken as the master would be run by `Side.fp32_reference` on bf16-rounded
    weights while its record says fp32 (issue 14: rel_max 0.06415 instead of 0.06326). The
    exception is a compact master (lab/families/master.py): a parameter `compact_master` found
    exact at bf16 and holds at bf16, whose tensor is still the one it recorded.

    `params`: the model's parameters when the caller has them already (a `WeightView`'s),
    so the common case (every parameter fp32) walks no module tree.

    Raises:
        ValueError: Naming how many parameters are in which dtype, one of them, and the fix;
            or a held parameter changed since compaction (a later .to(), .bfloat16(), ...).
    """
    params = list(model.parameters() if params is None else params)
    if not any(p.is_floating_point() and p.element_size() < 4 for p in params):
        return
    # A compact master passes the same way while none of its tensors changed: checked once.
    record = getattr(model, "lab_master", None)
    state = (id(record), tuple((p.data_ptr(), p.dtype) for p in params))
    if _MASTER_CHECKED.get(model) == state:
        return
    stale = stale_held_message(model)
    if stale is not None:
        raise ValueError(f"{where}: {stale}")
    held = held_parameters(model)
    low: dict[str, list[str]] = {}
    total = 0
    for name, p in canonical_parameters(model):
        total += 1
        if p.is_floating_point() and p.element_size() < 4 and name not in held:
            low.setdefault(dtype_name(p.dtype), []).append(name)
    if not low:
        _MASTER_CHECKED[model] = state
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


MEMORY_BUDGET_ENV = "LAB_MEMORY_BUDGET_GIB"
"""Environment variable: the device memory (GiB) a pair may plan for, instead of the CUDA
device's total (CPU pairs are checked only when it is set)."""
ACTIVATION_RESERVE_SHARE = 0.15
"""Share of the budget kept for the two forwards' activations and the pairing buffers. Measured
on one H200 (data/gpu): MiniMax H3 at its real width and full-size inputs (reduced preset) took
11.2 GiB above its master and casts for two lockstep forwards, the most of any family (Wan2.2
full 7.0 GiB, Flux full 1.5 GiB); 15% of an H200 is 21 GiB."""


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory a pair on `device` may plan for (bytes; None: no check).

    $LAB_MEMORY_BUDGET_GIB when set, else a CUDA device's total memory, else None.

    Raises:
        ValueError: $LAB_MEMORY_BUDGET_GIB is not a positive number.
    """
    import os

    text = os.environ.get(MEMORY_BUDGET_ENV)
    if text:
        try:
            gib = float(text)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ValueError(
                f"${MEMORY_BUDGET_ENV}={text!r}: expected a positive number of GiB (e.g. 139.8)."
            )
        return int(gib * 2**30)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def rank_build_bytes(model: torch.nn.Module, world: int) -> int:
    """Bytes one FSDP2 rank of `world` holds building `model` (`lab.families.shards`).

    Its rows of the fp32 master (the largest rank's), the largest module's own parameters whole
    (held while that module is built) and the buffers. Counts a meta build as well as a real one.
    """
    from lab.families.shards import shard_bytes

    held = shard_bytes(model, world)
    return held["rows"] + held["largest_module"] + held["buffers"]


def rank_build_fits(need: int, budget: int) -> bool:
    """Whether one FSDP2 rank that holds `need` bytes fits `budget` with a forward.

    ACTIVATION_RESERVE_SHARE of the budget is kept for the forward.
    """
    return need + int(budget * ACTIVATION_RESERVE_SHARE) <= budget


SHARDED_MOST_RANKS = 8
"""The most ranks `sharded_world` considers: one host's GPUs."""


def sharded_world(model: torch.nn.Module, budget: int) -> int | None:
    """The fewest FSDP2 ranks (up to SHARDED_MOST_RANKS) that build and run `model` in `budget`.

    Each rank within `budget` bytes; None if even that many ranks do not fit.
    """
    for world in range(1, SHARDED_MOST_RANKS + 1):
        if rank_build_fits(rank_build_bytes(model, world), budget):
            return world
    return None


def estimate_pair_bytes(
    model: torch.nn.Module, sides: tuple[Side, ...], stream_classes: tuple[str, ...]
) -> dict[str, int]:
    """Bytes a pair holds besides activations: the master as held, and the sides' weight casts.

    A side casts each parameter to its param dtype (rules ignored: they pin few tensors); a
    tensor already held at that dtype costs nothing, and two sides casting it to one dtype
    share the cast (as lockstep does; two passes hold one side's casts at a time, less).
    Streamed, the casts are those outside the blocks plus one block's (the largest);
    otherwise all of them.

    Returns:
        {"master": bytes held, "casts": bytes of the weight casts}.
    """
    from lab.pairing.weights import outermost

    params = list(canonical_parameters(model))
    master = sum(p.numel() * p.element_size() for _, p in params)
    master += sum(b.numel() * b.element_size() for b in model.buffers())
    block_ids = outermost(model, stream_classes)
    blocks = [m for m in model.modules() if id(m) in block_ids]
    in_block = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    targets = {side.param_torch_dtype for side in sides}
    sizes = {d: torch.empty((), dtype=d).element_size() for d in targets}
    outside, per_block = 0, [0] * len(blocks)
    for _, p in params:
        if not p.is_floating_point():
            continue
        nbytes = p.numel() * sum(sizes[d] for d in targets if d != p.dtype)
        if id(p) in in_block:
            per_block[in_block[id(p)]] += nbytes
        else:
            outside += nbytes
    casts = outside + (max(per_block, default=0) if stream_classes else sum(per_block))
    return {"master": master, "casts": casts}


def check_master_fits(
    model: torch.nn.Module,
    inputs: Inputs,
    sides: tuple[Side, ...],
    stream_classes: tuple[str, ...],
    where: str,
) -> None:
    """Refuse, before any side is built, a pair whose master and casts leave no room to run.

    The estimated peak is the master as held, the sides' weight casts (`estimate_pair_bytes`)
    and `ACTIVATION_RESERVE_SHARE` of the budget (`device_memory_bytes`; no check without
    one). MiniMax H3 full is the case: 123.3 GiB as an fp32 master, 61.6 GiB compact.

    Raises:
        ValueError: The estimate exceeds the budget, naming the bytes, how many tensors and
            elements are off the bf16 grid (so cannot be held compact), and what to do instead.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    budget = device_memory_bytes(device)
    if budget is None:
        return
    need = estimate_pair_bytes(model, sides, stream_classes)
    reserve = int(budget * ACTIVATION_RESERVE_SHARE)
    peak = need["master"] + need["casts"] + reserve
    if peak <= budget:
        return
    from lab.families.master import off_grid

    grid = off_grid(model)
    gib = 2**30
    origin = inputs.origin if isinstance(inputs, Inputs) else None
    family_name, preset = (origin[0], origin[1]) if origin else ("<family>", "<preset>")
    what = f"{type(model).__name__}" + (f" ({family_name} {preset})" if origin else "")
    on_grid = (
        f" {grid['on_fp32_tensors']} fp32 tensor(s) ARE on the bf16 grid but held fp32: "
        f"lab.families.master.compact_master(model) (or build/load with master='compact') "
        f"holds them at bf16 exactly and saves {grid['on_fp32_saved_bytes'] / gib:.1f} GiB."
        if grid["on_fp32_tensors"]
        else ""
    )
    fp32 = grid["elements"] * 4
    world = sharded_world(model, budget)
    if world is not None:
        # An FSDP2 rank builds only its rows of the fp32 master (lab.families.shards); one
        # rank would only move the two sides into one process.
        nproc = max(world, 2)
        rank_gib = rank_build_bytes(model, nproc) / gib
        instead = (
            f"Pair it sharded across GPUs instead: lab.fsdp.pair_sharded({family_name!r}, "
            f"{preset!r}, nproc={nproc}) on {nproc} GPUs (each rank builds and holds 1/{nproc} "
            f"of the fp32 master, {rank_gib:.1f} GiB), or use a smaller preset."
        )
    else:
        instead = (
            f"lab.fsdp.pair_sharded cannot pair it on up to {SHARDED_MOST_RANKS} GPUs of this "
            f"size either (the fp32 master is {fp32 / gib:.1f} GiB). Use a smaller preset."
        )
    raise ValueError(
        f"{where}: {what} does not fit {device} ({budget / gib:.1f} GiB) with pairing: "
        f"estimated peak {peak / gib:.1f} GiB = master {need['master'] / gib:.1f} GiB as held "
        f"(fp32 master {fp32 / gib:.1f} GiB) + weight casts "
        f"{need['casts'] / gib:.1f} GiB + {reserve / gib:.1f} GiB kept for two forwards' "
        f"activations. {grid['off_tensors']} of {grid['tensors']} parameter tensors "
        f"({grid['off_elements']:,} of {grid['elements']:,} elements) are off the bf16 grid "
        "(an fp32 master after optimizer steps), so they cannot be held at bf16 exactly."
        f"{on_grid} {instead} ${MEMORY_BUDGET_ENV} overrides the budget this check uses."
    )


def check_inputs(model: torch.nn.Module, inputs: Inputs, where: str) -> None:
    """Refuse inputs `model` cannot run: not an Inputs record, meta tensors, another family's.

    Also inputs no DiT forward runs: a latents or timestep kwarg set to None, one that the
    model's lab family passes missing (Flux's `timestep`), and an empty batch (a latents, cond
    or timestep tensor with no element); torch would otherwise fail deep inside the model, in
    its own words.

    Raises:
        ValueError: Naming the bad kwarg, or the model's class and the inputs' family.
    """
    if not isinstance(inputs, Inputs):
        raise ValueError(
            f"{where}: inputs must be an Inputs record (fam.make_inputs(preset, seed), or "
            f"lab.Inputs(kwargs=..., roles=...)), got {type(inputs).__name__}."
        )
    # Another family's inputs first: their kwargs differ from what the model needs (sd3's lack
    # Flux's `guidance`), and naming both families says why, where a missing kwarg would not.
    _check_inputs_family(model, inputs, where)
    for label, record in (("inputs", inputs), ("inputs.negative", inputs.negative)):
        if record is None:
            continue
        _check_forward_inputs(record, label, where, type(model).__name__)
        for key, value in record.kwargs.items():
            if any(t.device.type == "meta" for t in _tensors(value)):
                raise ValueError(
                    f"{where}: {label}[{key!r}] is on the meta device (a shape without values). "
                    "Make the inputs with device='cpu' or 'cuda' (fam.make_inputs(preset, seed, "
                    "device=...))."
                )


def _check_inputs_family(model: torch.nn.Module, inputs: Inputs, where: str) -> None:
    """Refuse inputs a lab family made for another lab family's model class, naming both."""
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


_NEEDED_ROLES: tuple[str, ...] = ("latents", "timestep")
"""Roles every DiT forward needs at least one value of: what it denoises, and at which step."""


def _check_forward_inputs(record: Inputs, label: str, where: str, model_class: str) -> None:
    """Refuse a latents or timestep kwarg set to None or missing, or an empty tensor.

    For a model of a lab family's class, every latents and timestep kwarg the family's own
    inputs carry must be there (Flux's `timestep` and `guidance` both); other models (a test's
    toy module) are held only to the None and empty checks.
    """
    needed = _family_needs(model_class)
    for role in _NEEDED_ROLES:
        keys = record.keys_with_role(role)  # type: ignore[arg-type]
        unset = [k for k in keys if record.kwargs[k] is None]
        unset += [k for k, r in needed.items() if r == role and k not in record.kwargs]
        if unset or (not keys and role in needed.values()):
            given = ", ".join(f"{k!r} ({r})" for k, r in record.roles.items()) or "none"
            what = (
                f"no {role!r} kwarg"
                if not unset
                else f"{unset[0]!r} (role {role!r}) "
                + ("is None" if unset[0] in record.kwargs else f"missing ({model_class} needs it)")
            )
            raise ValueError(
                f"{where}: {label} has {what}; a DiT forward needs its {role}. Given: {given}. "
                "Make the inputs with fam.make_inputs(preset, seed), or add the kwarg with "
                f"roles[name] = {role!r}."
            )
    for key, value in record.kwargs.items():
        if record.roles.get(key) == "aux":
            continue
        empty = next((t for t in _tensors(value) if t.numel() == 0), None)
        if empty is not None:
            raise ValueError(
                f"{where}: {label}[{key!r}] ({record.roles[key]}) is empty, shape "
                f"{tuple(empty.shape)}: a forward of no sample. Give at least one sample "
                "(fam.make_inputs(preset, seed, batch=1))."
            )


@functools.cache
def _family_needs(model_class: str) -> dict[str, str]:
    """The latents and timestep kwargs a lab family's inputs give a `model_class` forward."""
    from lab.families import FAMILY_NAMES
    from lab.families import family as get_family

    for name in FAMILY_NAMES:
        fam = get_family(name)
        if fam.model_class == model_class:
            made = fam.make_inputs("tiny", 0)
            return {k: r for k, r in made.roles.items() if r in _NEEDED_ROLES}
    return {}


def inputs_mismatch_hint(model: torch.nn.Module, inputs: Inputs) -> str:
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


# ---- after a failure --------------------------------------------------------------------


def failing_module(err: BaseException, model: Any) -> tuple[str, str] | None:
    """The innermost module of `model` whose `forward` was on the stack when `err` was raised.

    Walks the traceback (it survives the lockstep thread hand-over, which re-raises the same
    exception object) for frames whose `self` is one of the model's modules.

    Returns:
        (module path, class name), the path as in `named_modules()` with "<root>" for the
        model itself; None when the failure happened outside every module.
    """
    names = {id(m): n or ROOT for n, m in model.named_modules()}
    found = None
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names:
            found = (names[id(owner)], type(owner).__name__)
        tb = tb.tb_next
    return found


_DTYPE_MISMATCH = re.compile(r"dtype|scalar type|should be the same", re.IGNORECASE)


def dtype_mismatch_fix(
    err: BaseException, side: Side, module: str, param_dtypes: Mapping[str, Any]
) -> str | None:
    """Say how to fix a dtype mismatch inside `module` on `side`, or None if it is not one.

    The common case: a rule (or keep_fp32_modules) pins a module's parameters to fp32 on a
    side that runs bf16 without autocast, so the module's bf16 input meets fp32 weights.

    Args:
        err: The exception the forward raised.
        side: The side whose forward raised it.
        module: The failing module's path (see `failing_module`).
        param_dtypes: That side's parameter name -> dtype (torch dtype or name).
    """
    if not _DTYPE_MISMATCH.search(str(err)):
        return None
    forward = side.resolved_param_dtype
    prefix = "" if module == ROOT else f"{module}."
    own = {
        name: d if isinstance(d, str) else dtype_name(d)
        for name, d in param_dtypes.items()
        if name.startswith(prefix) and "." not in name[len(prefix) :]
    }
    pinned = {n: d for n, d in own.items() if parse_dtype(d) != parse_dtype(forward)}
    if pinned and not side.autocast:
        rules = [
            f"'{p}: {v}'"
            for p, v in side.param_dtype_rules.items()
            if any(fnmatch.fnmatchcase(n, p) for n in pinned)
        ]
        why = f"rule {rules[-1]}" if rules else "keep_fp32_modules"
        held = "/".join(sorted(set(pinned.values())))
        return (
            f"Fix: {module}'s parameters are {held} on side {side.name!r} ({why}) while that "
            f"side runs {forward} without autocast, so a {forward} input meets {held} weights. "
            f"Turn autocast on for side {side.name!r}, or drop that rule or narrow it so that "
            f"it misses {module!r}."
        )
    return (
        f"Fix: check side {side.name!r}'s dtypes at {module!r}: its input_dtype_policy, "
        "param_dtype, param_dtype_rules and autocast (autocast casts matmul inputs to one dtype)."
    )

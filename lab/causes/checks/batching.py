"""batch_invariance and cfg_batching: one side, the same sample alone and inside a larger batch.

Both checks run one side twice on identical weights and compare what a sample gets back:
forwarded alone (batch 1, or each CFG branch on its own) and inside one larger forward (a batch
of N prompts, or [uncond, cond] stacked). Any difference is the kernels' doing: a matmul or an
attention kernel may split its reduction differently when the batch grows, so a trainer that
recomputes log-probs at another micro-batch size (or CFG layout) than the rollout sees a PPO
ratio off 1 with every weight, dtype and input equal.

Which kwargs carry the batch is read from the family itself: `make_inputs` at batch 1 and at
batch 2 (a kwarg whose leading size doubles is batched; one whose shape stays is shared by every
sample, like MiniMax-H3's distinct timesteps or Flux's position ids). Module outputs are split
the same way: an activation whose leading size is the batch's multiple of the sample's is sliced
at the sample's rows; one of equal shape is compared whole (RoPE tables and other batch-free
tensors); any other is recorded as skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lab.base.dtypes import dtype_name
from lab.causes.checks.result import CheckResult, ulp_words
from lab.families import Family, Inputs
from lab.families import family as get_family
from lab.pairing.capture import ROOT, ModuleHooks, depth_filter, flatten_output
from lab.pairing.guards import check_fp32_master
from lab.pairing.metrics import compare
from lab.pairing.run import forward_side, model_device
from lab.pairing.sides import Side
from lab.pairing.weights import WeightView
from lab.rl.flow_grpo import combine_cfg
from lab.rl.latents import latent_leaves

METRIC_COLUMNS: tuple[str, ...] = (
    "max_ulp", "max_abs_diff", "rel_max", "mean_abs_diff", "bitexact_frac",
)  # fmt: skip
_ROW_COLUMNS: tuple[str, ...] = (
    "module", "module_class", "call", "output", "shape", "dtype", "numel", *METRIC_COLUMNS,
    "batch_axis",
)  # fmt: skip


# ---- which kwargs carry the batch -----------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _probe(family_name: str, preset: str, variant: str | None) -> dict[str, int | None]:
    fam = get_family(family_name)
    one = fam.make_inputs(preset, 0, 1, False, variant=variant)
    two = fam.make_inputs(preset, 0, 2, False, variant=variant)
    axes: dict[str, int | None] = {}
    for key, a in one.kwargs.items():
        b = two.kwargs[key]
        if isinstance(a, torch.Tensor) and a.ndim:
            doubled = b.shape[0] == 2 * a.shape[0] and b.shape[1:] == a.shape[1:]
            axes[key] = a.shape[0] if doubled and a.shape[0] else None
        elif isinstance(a, list | tuple) and len(b) == 2 * len(a) and len(a):
            axes[key] = len(a)
        else:
            axes[key] = None
    return axes


def batch_axes(fam: Family, preset: str, variant: str | None = None) -> dict[str, int | None]:
    """Per kwarg of `fam.make_inputs`: its rows per sample along dim 0 (None: shared by all).

    Read from make_inputs at batch 1 and 2, so it is what the family's pipeline does.

    Raises:
        ValueError: For a family whose forward holds one sample (`max_batch` 1).
    """
    if fam.max_batch == 1:
        raise ValueError(
            f"batch_axes: {fam.title} holds one sample per forward (Family.max_batch 1); it has "
            "no batch axis to probe."
        )
    return dict(_probe(fam.name, preset, variant))


def count_samples(inputs: Inputs, axes: dict[str, int | None], where: str) -> int:
    """How many samples `inputs` holds, by its batched kwargs.

    Raises:
        ValueError: Batched kwargs that disagree, naming them.
    """
    counts = {}
    for key, rows in axes.items():
        if rows is None or key not in inputs.kwargs:
            continue
        value = inputs.kwargs[key]
        size = value.shape[0] if isinstance(value, torch.Tensor) else len(value)
        counts[key] = size / rows
    distinct = set(counts.values())
    if len(distinct) != 1 or not float(next(iter(distinct))).is_integer():
        raise ValueError(
            f"{where}: the batched kwargs disagree on the sample count: "
            f"{ {k: v for k, v in counts.items()} }. Were these inputs made by this family's "
            "make_inputs?"
        )
    return int(next(iter(distinct)))


def take_samples(inputs: Inputs, axes: dict[str, int | None], start: int, stop: int) -> Inputs:
    """Samples [start, stop) of `inputs` (shared kwargs kept), without a negative branch."""
    kwargs = {}
    for key, value in inputs.kwargs.items():
        rows = axes.get(key)
        kwargs[key] = value if rows is None else value[start * rows : stop * rows]
    return replace(inputs, kwargs=kwargs, negative=None)


def stack_samples(parts: Sequence[Inputs], axes: dict[str, int | None], where: str) -> Inputs:
    """One Inputs holding every sample of `parts`, in order (shared kwargs must agree).

    Raises:
        ValueError: A shared kwarg (timestep layout, ids, sizes) differs between the parts: they
            cannot ride in one forward.
    """
    first = parts[0]
    kwargs = {}
    for key, value in first.kwargs.items():
        values = [p.kwargs[key] for p in parts]
        if axes.get(key) is None:
            for other in values[1:]:
                if not _same(value, other):
                    raise ValueError(
                        f"{where}: kwarg {key!r} is shared by every sample of a forward, but the "
                        "parts hold different values: they are not one step of one pipeline "
                        "(same sigma, same geometry). Make them with the same preset and sigma."
                    )
            kwargs[key] = value
        elif isinstance(value, torch.Tensor):
            kwargs[key] = torch.cat(values)
        else:
            kwargs[key] = type(value)(item for v in values for item in v)
    return replace(first, kwargs=kwargs, negative=None)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ---- one side, alone and in a batch ----------------------------------------------------------


@dataclass
class _Paired:
    rows: list[dict[str, Any]]
    skipped: list[str]
    roots_alone: list[list[torch.Tensor]]
    """Per unit: its model output leaves from the forward alone."""
    roots_batched: list[list[torch.Tensor]]
    """Per unit: its slice of the batched forward's model output leaves."""


def _capture(
    model: torch.nn.Module,
    inputs: Inputs,
    side: Side,
    view: WeightView,
    keep: Callable[[str], bool],
) -> dict[tuple[str, int, str], torch.Tensor]:
    store: dict[tuple[str, int, str], torch.Tensor] = {}

    def on_output(label: str, call: int, module: Any, args: Any, kwargs: Any, out: Any) -> None:
        with torch._C.DisableTorchFunction():
            for idx, leaf in flatten_output(out):
                if isinstance(leaf, torch.Tensor):
                    store[(label, call, idx)] = leaf.detach().clone()

    with ModuleHooks(model, on_output, names_filter=keep).attached():
        forward_side(model, inputs, side, view=view)
    return store


def _run_alone_and_batched(
    model: torch.nn.Module,
    side: Side,
    units: Sequence[Inputs],
    batched: Inputs,
    modules_for: set[int],
    names_filter: Callable[[str], bool] | None,
) -> _Paired:
    """Forward each unit alone, then all of them in `batched`, comparing each unit's rows.

    Units in `modules_for` are compared at every (filtered) module; the others at the model
    output only. Comparisons run inside the batched forward's hooks and drop the tensors, so
    memory holds the alone-captures and one batched activation at a time.
    """
    device = model_device(model)
    view = WeightView(model, side)
    classes = {name or ROOT: type(m).__name__ for name, m in model.named_modules()}

    def keeper(unit: int) -> Callable[[str], bool]:
        if unit not in modules_for:
            return lambda name: name == ROOT
        if names_filter is None:
            return lambda name: True
        return lambda name: name == ROOT or names_filter(name)

    alone = [_capture(model, u, side, view, keeper(i)) for i, u in enumerate(units)]
    wanted = set().union(*alone)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    roots_batched: list[dict[str, torch.Tensor]] = [{} for _ in units]

    def on_output(label: str, call: int, module: Any, args: Any, kwargs: Any, out: Any) -> None:
        with torch._C.DisableTorchFunction(), torch.autocast(device.type, enabled=False):
            for idx, leaf in flatten_output(out):
                key = (label, call, idx)
                if key not in wanted or not isinstance(leaf, torch.Tensor):
                    continue
                for unit, single in ((i, a[key]) for i, a in enumerate(alone) if key in a):
                    piece, batch_axis = _slice(leaf, single, unit, len(alone))
                    if piece is None:
                        skipped.append(
                            f"{_label(key)}: shape {tuple(single.shape)} alone, "
                            f"{tuple(leaf.shape)} in the batch (no batch axis at dim 0)"
                        )
                        continue
                    if not single.is_floating_point():
                        equal = bool(torch.equal(single, piece))
                        skipped.append(f"{_label(key)}: {single.dtype} (equal: {equal})")
                        continue
                    if label == ROOT:
                        roots_batched[unit][idx] = piece.detach().clone()
                    m = compare(single, piece.detach())
                    rows.append(
                        {
                            "unit": unit,
                            "module": label,
                            "module_class": classes.get(label, ""),
                            "call": call,
                            "output": idx,
                            "shape": list(single.shape),
                            "dtype": dtype_name(single.dtype),
                            "numel": m.numel,
                            "max_ulp": float(m.max_ulp),
                            "max_abs_diff": float(m.max_abs_diff),
                            "rel_max": float(m.rel_max),
                            "mean_abs_diff": float(m.mean_abs_diff),
                            "bitexact_frac": float(m.bitexact_frac),
                            "batch_axis": batch_axis,
                        }
                    )

    keep_batched = None if names_filter is None else (lambda n: n == ROOT or names_filter(n))
    with ModuleHooks(model, on_output, names_filter=keep_batched).attached():
        forward_side(model, batched, side, view=view)
    roots_alone = [
        [t for (lb, _, _), t in sorted(a.items(), key=lambda kv: kv[0][2]) if lb == ROOT]
        for a in alone
    ]
    roots_b = [[r[k] for k in sorted(r)] for r in roots_batched]
    return _Paired(rows, skipped, roots_alone, roots_b)


def _slice(
    leaf: torch.Tensor, single: torch.Tensor, unit: int, units: int
) -> tuple[torch.Tensor | None, bool]:
    """A unit's part of a batched activation (units are equal-sized), and whether it was cut.

    Cut along dim 0 when the batch holds `units` times the unit's rows there (diffusers keeps
    the batch outermost, attention's (B, heads, ...) included); compared whole when the shape
    did not change (batch-free tensors: RoPE tables, shared embeddings); None otherwise.
    """
    if single.ndim and leaf.ndim == single.ndim and leaf.shape[1:] == single.shape[1:]:
        rows = single.shape[0]
        if units > 1 and rows and leaf.shape[0] == units * rows:
            return leaf[unit * rows : (unit + 1) * rows], True
    if leaf.shape == single.shape:
        return leaf, False
    return None, False


def _label(key: tuple[str, int, str]) -> str:
    label, call, idx = key
    return f"{label}{':' + idx if idx else ''}{'#' + str(call) if call else ''}"


def _origin(inputs: Inputs, where: str) -> tuple[Family, str, str | None]:
    if not isinstance(inputs, Inputs):
        raise ValueError(
            f"{where}: inputs must be an Inputs record from Family.make_inputs, got "
            f"{type(inputs).__name__}."
        )
    if inputs.origin is None:
        raise ValueError(
            f"{where}: these inputs carry no origin (family, preset), so which kwargs hold the "
            "batch cannot be read from the family. Make them with fam.make_inputs(preset, seed)."
        )
    family_name, preset, variant = inputs.origin
    return get_family(family_name), preset, variant


def _names_filter(
    names_filter: Callable[[str], bool] | None, capture_depth: int | None, where: str
) -> Callable[[str], bool] | None:
    if names_filter is not None and capture_depth is not None:
        raise ValueError(f"{where}: pass names_filter or capture_depth, not both.")
    if capture_depth is not None:
        if (
            isinstance(capture_depth, bool)
            or not isinstance(capture_depth, int)
            or capture_depth < 0
        ):
            raise ValueError(
                f"{where}: capture_depth must be an int >= 0 (1 = every block's output), got "
                f"{capture_depth!r}."
            )
        return depth_filter(capture_depth)
    return names_filter


def _base_meta(model: torch.nn.Module, fam: Family, preset: str, side: Side) -> dict[str, Any]:
    return {
        "family": fam.name,
        "preset": preset,
        "device": str(model_device(model)),
        "side": side.to_dict(),
        "init": getattr(model, "lab_init", None),
        "applicable": True,
    }


def _first_divergent(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["max_ulp"] > 0 or r["max_abs_diff"] > 0), None)


def _not_applicable(check: str, columns: list[str], meta: dict[str, Any], why: str) -> CheckResult:
    return CheckResult(check, [], columns, why, True, {**meta, "applicable": False})


# ---- batch_invariance -----------------------------------------------------------------------


def batch_invariance(
    model: torch.nn.Module,
    inputs: Inputs,
    side: Side,
    *,
    batch: int = 4,
    position: int = 0,
    others_seed: int = 1,
    names_filter: Callable[[str], bool] | None = None,
    capture_depth: int | None = None,
) -> CheckResult:
    """The same sample forwarded alone and inside a batch of `batch`, on one side.

    The other batch - 1 samples are the family's own inputs for seeds others_seed,
    others_seed + 1, ... at the same sigma (other noise and prompts, same step), cast to the
    sample's dtypes. Every module output of the sample is compared (its rows of each batched
    activation against its own batch-1 forward), and the model output of every position.

    Args:
        model: The fp32 master (Family.build or Family.load).
        inputs: One sample: fam.make_inputs(preset, seed) with batch 1 and cfg=False.
        side: The side to run (rollout or trainer: the check is about one side's kernels).
        batch: Samples in the larger forward, >= 2.
        position: Where the sample sits in the batch.
        others_seed: First seed of the other samples.
        names_filter: Compare only modules whose path passes (the model output always).
        capture_depth: Or compare modules at most this deep (1 = each block's output).

    Returns:
        A CheckResult: one row per module output of the sample (column `position`), plus the
        model output of every other position; passed = every position's model output is
        bit-identical to its batch-1 forward.

    Raises:
        ValueError: Inputs that hold more than one sample or carry no origin, a bad batch or
            position, a batch above the family's `max_batch`, or a model that is not the
            fp32 master (a bf16 model's forwards would run on rounded weights).
    """
    where = "batch_invariance"
    check_fp32_master(model, where)
    fam, preset, variant = _origin(inputs, where)
    columns = ["position", *_ROW_COLUMNS]
    meta = {**_base_meta(model, fam, preset, side), "batch": batch, "position": position}
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 2:
        raise ValueError(f"{where}: batch must be an int >= 2 (the larger forward), got {batch!r}.")
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < batch:
        raise ValueError(
            f"{where}: position must be an int in [0, batch) = [0, {batch}), got {position!r}."
        )
    if fam.max_batch == 1:
        return _not_applicable(
            where, columns, meta,
            f"{fam.title} packs one sample per forward (Family.max_batch 1): its pipeline never "
            "batches samples, so every forward is batch 1 on both sides and batch size cannot "
            "move the ratio.",
        )  # fmt: skip
    if fam.max_batch is not None and batch > fam.max_batch:
        raise ValueError(
            f"{where}: batch {batch} exceeds {fam.title}'s max_batch {fam.max_batch}; use "
            f"batch <= {fam.max_batch}."
        )
    names_filter = _names_filter(names_filter, capture_depth, where)
    axes = batch_axes(fam, preset, variant)
    if count_samples(inputs, axes, where) != 1:
        raise ValueError(
            f"{where}: inputs hold {count_samples(inputs, axes, where)} samples; pass one "
            "(fam.make_inputs(preset, seed, batch=1, cfg=False))."
        )
    if inputs.sigma is None:
        raise ValueError(f"{where}: inputs.sigma is None; make them with fam.make_inputs.")
    sample = replace(inputs, negative=None)
    device = model_device(model)
    own_config = dict(model.config) if hasattr(model, "lab_checkpoint") else None
    others = []
    for k in range(batch - 1):
        made = fam.make_inputs(
            preset, others_seed + k, 1, False, variant=variant, sigma=inputs.sigma,
            device=device, config=own_config,
        )  # fmt: skip
        others.append(_with_samples_of(sample, made, where))
    units = [*others[:position], sample, *others[position:]]
    batched = stack_samples(units, axes, where)
    paired = _run_alone_and_batched(model, side, units, batched, {position}, names_filter)
    rows = []
    for r in paired.rows:
        if r["unit"] != position and r["module"] != ROOT:
            continue
        rows.append({"position": r.pop("unit"), **r})
    # The checked sample's rows in forward order, then the other positions' model outputs.
    rows.sort(key=lambda r: r["position"] != position)
    roots = [r for r in rows if r["module"] == ROOT]
    passed = bool(roots) and all(r["max_ulp"] == 0 and r["max_abs_diff"] == 0 for r in roots)
    mine = [r for r in rows if r["position"] == position]
    meta.update(
        sigma=inputs.sigma,
        others_seed=others_seed,
        compared=len(rows),
        skipped=len(paired.skipped),
        skipped_examples=paired.skipped[:5],
        divergent_modules=sum(1 for r in mine if r["max_ulp"] > 0 or r["max_abs_diff"] > 0),
    )
    return CheckResult(where, rows, columns, _batch_verdict(side, meta, mine, roots), passed, meta)


def _with_samples_of(sample: Inputs, made: Inputs, where: str) -> Inputs:
    """`sample` with its latents and conditioning replaced by `made`'s (in `sample`'s dtypes)."""
    kwargs = dict(sample.kwargs)
    for key, value in sample.kwargs.items():
        if sample.roles[key] not in ("latents", "cond"):
            continue
        other = made.kwargs[key]
        if isinstance(value, torch.Tensor):
            if other.shape != value.shape:
                raise ValueError(
                    f"{where}: the family's inputs for another seed give {key!r} the shape "
                    f"{tuple(other.shape)}, the sample has {tuple(value.shape)}: were the "
                    "inputs made for another preset or config?"
                )
            kwargs[key] = other.to(value.dtype) if value.is_floating_point() else other
    return replace(sample, kwargs=kwargs)


def _batch_verdict(side: Side, meta: dict[str, Any], mine: list[dict], roots: list[dict]) -> str:
    n, pos = meta["batch"], meta["position"]
    where = f"side {side.name!r} on {meta['device']}"
    own = next((r for r in mine if r["module"] == ROOT), None)
    if all(r["max_ulp"] == 0 and r["max_abs_diff"] == 0 for r in roots):
        return (
            f"Batch invariant here: on {where}, every sample's model output inside a batch of "
            f"{n} is bit-identical to its batch-1 forward ({len(mine)} module outputs of sample "
            f"{pos} compared, {meta['divergent_modules']} differ). Batch size does not move this "
            "side's ratio at this size and device; kernels choose tiles by shape, so re-check "
            "at the real size on the GPU."
        )
    first = _first_divergent(mine)
    off = [r for r in roots if r["max_ulp"] > 0 or r["max_abs_diff"] > 0]
    first_words = (
        f"; it first shows at {first['module']} ({first['module_class']})" if first else ""
    )
    return (
        f"Not batch invariant: on {where}, {len(off)} of {len(roots)} samples get another model "
        f"output inside a batch of {n} than alone (sample {pos}: "
        f"{ulp_words([own['max_ulp']]) if own else 'n/a'}, rel_max "
        f"{own['rel_max'] if own else float('nan'):.3e}){first_words}, "
        f"{meta['divergent_modules']} of {len(mine)} module outputs differ. With identical "
        "weights, dtypes and inputs, the kernels reduce in another order when the batch grows. "
        "So the PPO ratio is exactly 1 only when the trainer recomputes at the rollout's batch "
        "size (batch 1 on both sides is the trivial case): match the micro-batch sizes, or use "
        "batch-invariant kernels."
    )


# ---- cfg_batching ---------------------------------------------------------------------------


def cfg_batching(
    model: torch.nn.Module,
    inputs: Inputs,
    side: Side,
    *,
    cfg_scale: float = 4.5,
    names_filter: Callable[[str], bool] | None = None,
    capture_depth: int | None = None,
) -> CheckResult:
    """Uncond and cond in one forward ([uncond, cond] stacked) versus two separate forwards.

    A family with cfg_layout "batched" hands [negative, positive] in one batch (SD3, LTX-2);
    one with "separate" runs `inputs.negative` as a second forward (Wan, Qwen-Image). Either
    way this runs both layouts on one side and compares each branch's module outputs, and the
    guided velocity (`combine_cfg` at `cfg_scale`) the two layouts give.

    Args:
        model: The fp32 master.
        inputs: fam.make_inputs(preset, seed, cfg=True).
        side: The side to run.
        cfg_scale: Guidance scale of the guided-velocity row (> 1).
        names_filter: Compare only modules whose path passes (the model output always).
        capture_depth: Or compare modules at most this deep.

    Returns:
        A CheckResult: rows per branch ("uncond", "cond", and "guided" for the combined
        velocity); passed = both branches' model outputs bit-identical in both layouts. Not
        applicable (no rows, passed) for guidance-distilled families and one-sample forwards.

    Raises:
        ValueError: Inputs without CFG (no negative branch, or an odd batch), cfg_scale <= 1,
            or a model that is not the fp32 master.
    """
    where = "cfg_batching"
    check_fp32_master(model, where)
    fam, preset, variant = _origin(inputs, where)
    columns = ["branch", *_ROW_COLUMNS]
    meta = {**_base_meta(model, fam, preset, side), "cfg_layout": fam.cfg_layout}
    if not float(cfg_scale) > 1.0:
        raise ValueError(
            f"{where}: cfg_scale must be > 1 (guidance on), got {cfg_scale!r}; e.g. 4.5."
        )
    meta["cfg_scale"] = float(cfg_scale)
    if fam.cfg_layout == "none":
        return _not_applicable(
            where, columns, meta,
            f"{fam.title} is guidance-distilled (cfg_layout 'none'): each step is one forward "
            "with no unconditional branch, so there is no CFG layout to batch or split.",
        )  # fmt: skip
    if fam.max_batch == 1:
        return _not_applicable(
            where, columns, meta,
            f"{fam.title} packs one sample per forward (Family.max_batch 1): its pipeline always "
            "runs uncond and cond as two forwards, on the rollout and the trainer alike, so "
            "there is no batched layout to differ from.",
        )  # fmt: skip
    names_filter = _names_filter(names_filter, capture_depth, where)
    axes = batch_axes(fam, preset, variant)
    if fam.cfg_layout == "batched":
        rows_in = count_samples(inputs, axes, where)
        if rows_in % 2:
            raise ValueError(
                f"{where}: {fam.title} batches CFG as [negative, positive], but the inputs hold "
                f"{rows_in} samples (odd). Make them with fam.make_inputs(preset, seed, cfg=True)."
            )
        half = rows_in // 2
        uncond, cond = (
            take_samples(inputs, axes, 0, half),
            take_samples(inputs, axes, half, rows_in),
        )
    else:
        if inputs.negative is None:
            raise ValueError(
                f"{where}: {fam.title} runs CFG as a separate forward, but inputs.negative is "
                "None. Make them with fam.make_inputs(preset, seed, cfg=True)."
            )
        uncond, cond = replace(inputs.negative, negative=None), replace(inputs, negative=None)
    units = [uncond, cond]
    ragged = _ragged(units, axes)
    if ragged:
        key, a, b = ragged
        return _not_applicable(
            where, columns, meta,
            f"{fam.title}'s branches cannot share one forward as they are: {key!r} is {a} for "
            f"uncond and {b} for cond (prompts of different lengths), which is why its pipeline "
            "runs them as two forwards. Stacking them would need padding and an attention mask, "
            "another computation rather than another layout.",
        )  # fmt: skip
    batched = stack_samples(units, axes, where)
    paired = _run_alone_and_batched(model, side, units, batched, {0, 1}, names_filter)
    names = ("uncond", "cond")
    rows = [{"branch": names[r.pop("unit")], **r} for r in paired.rows]
    rows.sort(key=lambda r: names.index(r["branch"]))
    # The guided velocity each layout gives, as trajectory() combines it (per output tensor).
    n_latents = len(latent_leaves(cond))
    for i in range(min(n_latents, len(paired.roots_alone[1]), len(paired.roots_batched[1]))):
        alone = combine_cfg(fam, paired.roots_alone[1][i], paired.roots_alone[0][i], cfg_scale)
        stacked = combine_cfg(
            fam, paired.roots_batched[1][i], paired.roots_batched[0][i], cfg_scale
        )
        m = compare(alone, stacked)
        rows.append(
            {
                "branch": "guided", "module": ROOT, "module_class": "combine_cfg", "call": 0,
                "output": str(i), "shape": list(alone.shape), "dtype": dtype_name(alone.dtype),
                "numel": m.numel, "max_ulp": float(m.max_ulp),
                "max_abs_diff": float(m.max_abs_diff), "rel_max": float(m.rel_max),
                "mean_abs_diff": float(m.mean_abs_diff),
                "bitexact_frac": float(m.bitexact_frac), "batch_axis": True,
            }
        )  # fmt: skip
    roots = [r for r in rows if r["module"] == ROOT and r["branch"] != "guided"]
    passed = bool(roots) and all(r["max_ulp"] == 0 and r["max_abs_diff"] == 0 for r in roots)
    meta.update(
        sigma=inputs.sigma,
        compared=len(rows),
        skipped=len(paired.skipped),
        skipped_examples=paired.skipped[:5],
    )
    return CheckResult(where, rows, columns, _cfg_verdict(fam, side, meta, rows), passed, meta)


def _ragged(
    units: Sequence[Inputs], axes: dict[str, int | None]
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """The first batched tensor kwarg whose per-sample shape differs between units, if any."""
    for key, rows in axes.items():
        values = [u.kwargs.get(key) for u in units]
        if rows is None or not all(isinstance(v, torch.Tensor) for v in values):
            continue
        shapes = [tuple(v.shape) for v in values]
        if any(s[1:] != shapes[0][1:] for s in shapes[1:]):
            return key, shapes[0], shapes[1]
    return None


def _cfg_verdict(fam: Family, side: Side, meta: dict[str, Any], rows: list[dict]) -> str:
    where = f"side {side.name!r} on {meta['device']}"
    layout = (
        "its pipeline batches [uncond, cond]"
        if fam.cfg_layout == "batched"
        else "its pipeline runs uncond as a second forward"
    )
    roots = {r["branch"]: r for r in rows if r["module"] == ROOT and r["output"] == "0"}
    if all(r["max_ulp"] == 0 and r["max_abs_diff"] == 0 for r in roots.values()):
        return (
            f"CFG layout does not matter here: on {where}, uncond and cond give bit-identical "
            f"model outputs stacked in one forward and as two forwards ({fam.title}: {layout}). "
            "Kernels choose tiles by shape, so re-check at the real size on the GPU."
        )
    branches = [r for r in rows if r["branch"] in ("uncond", "cond")]
    first = _first_divergent(branches)
    guided = roots.get("guided")
    guided_words = (
        f"; the guided velocity at CFG {meta['cfg_scale']:g} differs by max abs "
        f"{guided['max_abs_diff']:.3e} (rel_max {guided['rel_max']:.3e})"
        if guided
        else ""
    )
    return (
        f"CFG layout changes the velocity: on {where}, "
        + ", ".join(
            f"{b} {ulp_words([r['max_ulp']])} (rel_max {r['rel_max']:.3e})"
            for b, r in roots.items()
            if b != "guided"
        )
        + f" between one stacked forward and two forwards{guided_words}"
        + (f"; first at {first['module']} ({first['module_class']})" if first else "")
        + f". {fam.title}: {layout}. A rollout and a trainer that lay CFG out differently get "
        "another velocity from the same weights and inputs, and the guidance scale multiplies "
        "the branch gap: use the pipeline's layout on both sides."
    )

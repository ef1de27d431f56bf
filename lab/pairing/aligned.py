"""pair_aligned(): two implementations of one model, module outputs paired through an Alignment.

`lab.pair` runs one model tree under two sides. Here the two sides are two trees (the sglang
engine's DiT and diffusers' under a lab Side): each runs its own forward, every module output is
captured, and the `Alignment` says which output of tree A is which output of tree B (a renamed
module, or a fused projection split into the modules it fuses). Rows are named in tree B's
paths, in tree B's completion order, each carrying its tree-A name (`LayerDivergence.module_a`),
so a Result of the engine against the trainer reads like the emulated rollout against the
trainer. Every module of either tree that ran and has no counterpart is a `Skipped` with the
reason, and so is an aligned pair whose shapes differ.

Why a row differs is read from what each call received and held (`explain_aligned`): its
main input (the largest floating tensor handed to it) differing in dtype or value, a parameter
held at another dtype, a named implementation difference of the family (declared where the
engine computes the module another way), a submodule that differs first.
"""

from __future__ import annotations

import fnmatch
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.base.dtypes import dtype_name
from lab.pairing.alignment import Alignment
from lab.pairing.capture import ROOT, ModuleHooks, flatten_output
from lab.pairing.metrics import decode_stats, pair_stats
from lab.pairing.result import LayerDivergence, Result, Skipped
from lab.pairing.sides import Side
from lab.pairing.why import Why

OutputView = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
"""(tree-A module name, its output leaf, tree B's leaf) -> the A leaf laid out as B's."""


@dataclass(frozen=True)
class Tree:
    """One side of a cross-implementation pair: a model and how one forward of it runs."""

    name: str
    """The side's name in the Result ("sglang", "trainer", ...)."""
    model: torch.nn.Module
    run: Callable[[], Any]
    """Runs one forward of `model` exactly as this side runs it (weights, inputs, context)."""
    description: Mapping[str, Any] = field(default_factory=dict)
    """What goes into Result.side_a / side_b besides the name."""
    side: Side | None = None
    """The lab Side it runs under, if any (its autocast lists explain op dtypes)."""


@dataclass
class _Call:
    """One captured module call: its output leaves, main input and held parameter dtypes."""

    order: int
    leaves: list[tuple[str, torch.Tensor]]
    main_input: tuple[str, int, str] | None
    """(dtype, shape, checksum) of the largest floating tensor the call received."""
    param_dtypes: dict[str, str]
    """Parameters the module owns directly -> the dtype they were held at during the call."""
    output_digests: list[tuple[str, int, str]]


def _digest(t: torch.Tensor) -> tuple[str, int, str]:
    """(dtype, numel, hash of the bytes in row-major order) of a tensor.

    A view of the same values with another shape (a head split, a flatten) has the same digest.
    The bytes go to the host: cross-implementation pairs run the engine on the CPU.
    """
    data = t.detach().contiguous().reshape(-1)
    if data.numel() and data.stride(-1) != 1:
        # An expanded tensor (stride 0, e.g. a timestep `t.expand(B).clone()` at batch 1) is
        # "contiguous" to torch yet cannot be viewed as bytes: copy it to a real row-major one.
        data = data.clone(memory_format=torch.contiguous_format)
    if data.is_complex():
        data = torch.view_as_real(data).reshape(-1)
    raw = data.cpu().view(torch.uint8).numpy().tobytes()
    return dtype_name(t.dtype), t.numel(), hashlib.blake2b(raw, digest_size=16).hexdigest()


def _main_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    best = None
    for _, leaf in flatten_output((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            if best is None or leaf.numel() > best.numel():
                best = leaf
    return best


def _capture(tree: Tree) -> dict[tuple[str, int], _Call]:
    """Run the tree's forward once with every module's calls captured (outputs cloned)."""
    calls: dict[tuple[str, int], _Call] = {}
    inputs: dict[tuple[str, int], Any] = {}

    def on_input(label: str, call: int, module: Any, args: tuple, kwargs: dict) -> None:
        main = _main_input(args, kwargs)
        inputs[(label, call)] = _digest(main) if main is not None else None

    def on_output(label: str, call: int, module: Any, args: Any, kwargs: Any, out: Any) -> None:
        leaves = [
            (idx, leaf.detach().clone())
            for idx, leaf in flatten_output(out)
            if isinstance(leaf, torch.Tensor)
        ]
        calls[(label, call)] = _Call(
            order=len(calls),
            leaves=leaves,
            main_input=inputs.pop((label, call), None),
            param_dtypes={
                n: dtype_name(p.dtype) for n, p in module.named_parameters(recurse=False)
            },
            output_digests=[_digest(t) for _, t in leaves],
        )

    with torch.no_grad(), ModuleHooks(tree.model, on_output, on_input=on_input).attached():
        tree.run()
    return calls


def calls_from_dump(
    entries: list[dict], tensors: Mapping[str, torch.Tensor]
) -> dict[tuple[str, int], _Call]:
    """A dumped forward as captured calls: each module call's output leaves, in dump order.

    A dump records outputs only: the calls carry no main input and no parameter dtypes, so a
    row's why there says what the outputs show (`explain_aligned`).
    """
    calls: dict[tuple[str, int], _Call] = {}
    for e in sorted(entries, key=lambda e: e["order"]):
        key = (e["module"], e["call"])
        call = calls.get(key)
        if call is None:
            call = calls[key] = _Call(len(calls), [], None, {}, [])
        t = tensors[e["key"]]
        call.leaves.append((e["output"], t))
        call.output_digests.append(_digest(t))
    return calls


def _pair_leaves(
    a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor, torch.Tensor]] | str:
    """Pair two calls' output leaves: by position, else by unique shape; or why they cannot be."""
    if len(a) == len(b) and all(x.shape == y.shape for (_, x), (_, y) in zip(a, b, strict=True)):
        return [(ib, x, y) for (_, x), (ib, y) in zip(a, b, strict=True)]
    shapes_a = [tuple(t.shape) for _, t in a]
    shapes_b = [tuple(t.shape) for _, t in b]
    if len(a) == len(b) and sorted(shapes_a) == sorted(shapes_b) and len(set(shapes_a)) == len(a):
        by_shape = {tuple(t.shape): t for _, t in a}
        return [(ib, by_shape[tuple(y.shape)], y) for ib, y in b]
    return f"output shapes differ: {shapes_a} vs {shapes_b}"


@dataclass
class _Row:
    row: LayerDivergence
    key_b: tuple[str, int]
    call_a: _Call
    call_b: _Call


def pair_aligned(
    tree_a: Tree,
    tree_b: Tree,
    alignment: Alignment,
    *,
    meta: Mapping[str, Any] | None = None,
    differences: Mapping[str, str] | None = None,
    captured_a: Mapping[tuple[str, int], _Call] | None = None,
    view_a: OutputView | None = None,
) -> Result:
    """Run two implementations' forwards and compare every aligned module output.

    Args:
        tree_a: The reference (e.g. the engine's DiT as the engine runs it).
        tree_b: The candidate (e.g. diffusers' model under the trainer Side).
        alignment: Which modules of A compute which modules of B (`derive_alignment`).
        meta: Extra Result.meta fields (family, preset, seed, ...).
        differences: Module path glob (tree B's names) -> how the two implementations compute
            that module differently (the family's named differences); a differing row whose
            inputs and weights agree is explained by the first glob it matches.
        captured_a: Tree A's calls already captured (a dump, `calls_from_dump`): its forward
            is not run.
        view_a: Lays each tree-A output leaf out as its tree-B counterpart is, where the two
            implementations lay the same values out otherwise (MiniMax H3's engine: one
            unbatched packed sequence padded to 64 rows); applied before the leaves are paired.

    Returns:
        A propagated-mode Result: rows in tree B's names and completion order, each with its
        tree-A name in `module_a`; unaligned modules and unpairable outputs are Skipped with
        their reason; `meta["alignment"]` holds the alignment.
    """
    start = time.perf_counter()
    calls_a = dict(captured_a) if captured_a is not None else _capture(tree_a)
    seconds_a = time.perf_counter() - start
    calls_b = _capture(tree_b)
    seconds_b = time.perf_counter() - start - seconds_a
    classes_b = {(n or ROOT): type(m).__name__ for n, m in tree_b.model.named_modules()}
    by_b = alignment.by_b()
    fused_parts: dict[str, tuple[str, int, int]] = {}
    for m in alignment.modules:
        if m.kind == "fused":
            for i, name in enumerate(m.b):
                fused_parts[name] = (m.a, i, len(m.b))
    rows: list[_Row] = []
    skipped: list[Skipped] = []
    fused_cache: dict[tuple[str, int], list[torch.Tensor] | str] = {}
    for key_b in sorted(calls_b, key=lambda k: calls_b[k].order):
        name_b, call = key_b
        call_b = calls_b[key_b]
        aligned = by_b.get(name_b)
        if name_b in fused_parts:
            name_a, part, count = fused_parts[name_b]
            call_a = calls_a.get((name_a, call))
            if call_a is None:
                skipped.append(
                    Skipped(name_b, call, "", f"{tree_a.name}'s {name_a!r} has no call #{call}")
                )
                continue
            pieces = fused_cache.get((name_a, call))
            if pieces is None:
                pieces = fused_cache[(name_a, call)] = _split_fused(
                    calls_a[(name_a, call)],
                    [calls_b.get((b, call)) for b in by_fused(alignment, name_a)],
                )
            if isinstance(pieces, str):
                skipped.append(Skipped(name_b, call, "", f"fused {name_a!r}: {pieces}"))
                continue
            pairs = []
            if call_b.leaves:
                piece, leaf_b = pieces[part], call_b.leaves[0][1]
                piece = view_a(name_a, piece, leaf_b) if view_a else piece
                pairs = [("", piece, leaf_b)]
            label_a = f"{name_a}[{part + 1}/{count}]"
        elif aligned is not None and aligned.kind == "same":
            name_a = aligned.a
            call_a = calls_a.get((name_a, call))
            if call_a is None:
                skipped.append(
                    Skipped(name_b, call, "", f"{tree_a.name}'s {name_a!r} ran no call #{call}")
                )
                continue
            leaves_a = call_a.leaves
            if view_a is not None and len(leaves_a) == len(call_b.leaves):
                leaves_a = [
                    (ia, view_a(name_a, a, b))
                    for (ia, a), (_, b) in zip(leaves_a, call_b.leaves, strict=True)
                ]
            pairs = _pair_leaves(leaves_a, call_b.leaves)
            if isinstance(pairs, str):
                skipped.append(Skipped(name_b, call, "", f"aligned with {name_a!r}, but {pairs}"))
                continue
            label_a = name_a
        else:
            if call == 0:
                why = alignment.unaligned_b.get(name_b, "not aligned")
                skipped.append(Skipped(name_b, call, "", f"only in {tree_b.name}: {why}"))
            continue
        for idx, a, b in pairs:
            if not (a.is_floating_point() and b.is_floating_point()):
                skipped.append(
                    Skipped(name_b, call, idx, f"not comparable: {a.dtype} vs {b.dtype}")
                )
                continue
            if a.shape != b.shape:
                skipped.append(
                    Skipped(
                        name_b,
                        call,
                        idx,
                        f"shape differs: {tuple(a.shape)} in {tree_a.name} "
                        f"vs {tuple(b.shape)} in {tree_b.name}",
                    )
                )
                continue
            stats, hist = pair_stats(a, b.to(a.device))
            row = LayerDivergence(
                order=len(rows),
                module=name_b,
                call=call,
                output=idx,
                module_class=classes_b.get(name_b, "?"),
                dtype_a=dtype_name(a.dtype),
                dtype_b=dtype_name(b.dtype),
                shape=tuple(a.shape),
                metrics=decode_stats(stats.cpu(), hist.cpu(), a.dtype, b.dtype),
                module_a=label_a,
            )
            rows.append(_Row(row, key_b, call_a, call_b))
    for name_a, reason in alignment.unaligned_a.items():
        if (name_a, 0) in calls_a:
            skipped.append(Skipped(name_a, 0, "", f"only in {tree_a.name}: {reason}"))
    whys = explain_aligned(
        rows, tree_a.name, tree_b.name, differences or {}, sides=(tree_a.side, tree_b.side)
    )
    result_meta = {
        **dict(meta or {}),
        "alignment": alignment.to_dict(),
        "timings_s": {"side_a": seconds_a, "side_b": seconds_b},
        "cross_implementation": True,
    }
    result = Result(
        "propagated",
        {"name": tree_a.name, **tree_a.description},
        {"name": tree_b.name, **tree_b.description},
        [r.row for r in rows],
        skipped,
        result_meta,
    )
    result._whys = whys
    return result


def by_fused(alignment: Alignment, name_a: str) -> tuple[str, ...]:
    """The tree-B modules fused into tree A's `name_a`, in concatenation order."""
    return next(m.b for m in alignment.modules if m.a == name_a)


def _split_fused(call_a: _Call, calls_b: list[_Call | None]) -> list[torch.Tensor] | str:
    """A fused output split along its last dim into the pieces its B modules compute."""
    if not call_a.leaves:
        return "it returned no tensor"
    if any(c is None or not c.leaves for c in calls_b):
        return "a module it fuses did not run"
    fused = call_a.leaves[0][1]
    widths = [c.leaves[0][1].shape[-1] for c in calls_b]  # type: ignore[union-attr]
    if sum(widths) != fused.shape[-1]:
        return f"last dim {fused.shape[-1]} is not the sum of its pieces {widths}"
    return list(torch.split(fused, widths, dim=-1))


def explain_aligned(
    rows: list[_Row],
    name_a: str,
    name_b: str,
    differences: Mapping[str, str],
    *,
    sides: tuple[Side | None, Side | None] = (None, None),
) -> list[Why]:
    """The Why of every row of a cross-implementation pair (empty where it does not differ).

    Causes, in order: the call's main input differs in dtype (`input_dtype`) or already in
    value (`inherited`, naming the module whose output it was when one produced it, else the
    last divergent row before it); a parameter the module owns is held at another dtype
    (`param_dtype`); its op runs in another dtype under a side's autocast lists (`autocast`);
    a row inside the call differs first (`submodule`); a declared difference of the two
    implementations (`implementation`); else `unexplained`.
    """
    by_digest: dict[tuple[str, int, str], _Row] = {}
    whys: list[Why] = []
    diverged: list[_Row] = []
    # Rows inside a call completed after the module's previous call: its last row bounds them.
    last_row: dict[tuple[str, int], int] = {}
    for i, r in enumerate(rows):
        name, call = r.key_b
        after = last_row.get((name, call - 1), -1)
        inside = [d for d in diverged if d.row.order > after and d.row.module != name
                  and _under(d.row.module, name)]  # fmt: skip
        whys.append(_why_of(r, by_digest, diverged, inside, (name_a, name_b), differences, sides))
        for d in r.call_b.output_digests:
            by_digest.setdefault(d, r)
        if r.row.diverges:
            diverged.append(r)
        last_row[r.key_b] = i
    return whys


def _why_of(
    r: _Row,
    by_digest: Mapping[tuple[str, int, str], _Row],
    diverged: list[_Row],
    inside_rows: list[_Row],
    names: tuple[str, str],
    differences: Mapping[str, str],
    sides: tuple[Side | None, Side | None],
) -> Why:
    if not r.row.diverges:
        return Why()
    name_a, name_b = names
    codes: list[str] = []
    parts: list[str] = []
    upstream = inside = None
    in_a, in_b = r.call_a.main_input, r.call_b.main_input
    if in_a is None and in_b is not None:
        earlier = [d for d in diverged if not _under(d.row.module, r.row.module)]
        if earlier:
            upstream = earlier[-1].row.label()
            codes.append("inherited")
            parts.append(
                f"{name_a} recorded no inputs (a dump); it ran after {upstream}, which already "
                "differs"
            )
    elif in_a is not None and in_b is not None:
        if in_a[0] != in_b[0]:
            codes.append("input_dtype")
            parts.append(f"its input is {in_a[0]} on {name_a}, {in_b[0]} on {name_b}")
        elif in_a[2] != in_b[2]:
            source = by_digest.get(in_b)
            earlier = [d for d in diverged if not _under(d.row.module, r.row.module)]
            if source is not None and source.row.diverges:
                upstream = source.row.label()
                note = f" (it is {upstream}'s output)"
            elif earlier:
                upstream = earlier[-1].row.label()
                note = f" (computed after {upstream}, the last divergent output before it)"
            else:
                note = " (computed from outputs no aligned module produced)"
            codes.append("inherited")
            parts.append("its input already differs" + note)
    held = [
        f"{p} {d} on {name_a}, {r.call_b.param_dtypes[p]} on {name_b}"
        for p, d in sorted(r.call_a.param_dtypes.items())
        if p in r.call_b.param_dtypes and r.call_b.param_dtypes[p] != d
    ]
    if held:
        codes.append("param_dtype")
        parts.append("held at another dtype: " + ", ".join(held))
    if in_a is not None and in_b is not None and not codes:
        note = _autocast_note(r.row.module_class, (in_a[0], in_b[0]), names, sides)
        if note is not None:
            codes.append("autocast")
            parts.append(note)
    first_inside = inside_rows[0] if inside_rows else None
    if first_inside is not None and "inherited" not in codes and "input_dtype" not in codes:
        inside = first_inside.row.label()
        codes.append("submodule")
        parts.append(f"first differs inside at {inside}")
    if not codes:
        declared = next(
            (why for glob, why in differences.items() if fnmatch.fnmatchcase(r.row.module, glob)),
            None,
        )
        if declared is not None:
            codes.append("implementation")
            parts.append(declared)
        else:
            codes.append("unexplained")
            parts.append(
                f"same input and weights, another output: {name_a} and {name_b} compute "
                "this module differently, and no known difference is declared for it"
            )
    return Why(codes=tuple(codes), parts=tuple(parts), upstream=upstream, inside=inside)


def _autocast_note(
    module_class: str,
    input_dtypes: tuple[str, str],
    names: tuple[str, str],
    sides: tuple[Side | None, Side | None],
) -> str | None:
    """The autocast sentence when a side's op lists make the op's dtype differ, else None."""
    from lab.base.dtypes import DTYPES
    from lab.pairing.why import _MODULE_OPS, _compute_dtype

    op = _MODULE_OPS.get(module_class)
    if op is None or not any(s is not None and s.autocast for s in sides):
        return None
    computed = []
    for side, dtype in zip(sides, input_dtypes, strict=True):
        entry = ((None, DTYPES.get(dtype, torch.float32)),)
        computed.append(
            _compute_dtype(side, op, entry) if side is not None else (dtype, "no autocast")
        )
    (ca, la), (cb, lb) = computed
    if ca == cb:
        return None
    return f"autocast: {op} runs in {cb} on {names[1]} ({lb}), {ca} on {names[0]} ({la})"


def _under(path: str, ancestor: str) -> bool:
    return ancestor == ROOT or path == ancestor or path.startswith(ancestor + ".")

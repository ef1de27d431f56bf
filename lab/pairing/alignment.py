"""Alignment: which module of one implementation's tree computes which module of another's.

Two implementations of one DiT (the sglang engine's class and diffusers') hold the same weights
under other names and layouts: sglang fuses Qwen-Image's `attn.add_{q,k,v}_proj` into one
`attn.to_added_qkv`, renames Wan's `blocks.N.attn1.to_q` to `blocks.N.to_q`, and so on. An
`Alignment` says, for every module of tree A (the engine's), which module(s) of tree B
(diffusers') compute the same output:

- `same`: one B module, the same output (a renamed module, or the same path);
- `fused`: several B modules whose outputs, concatenated along the last dimension in the given
  order, are A's output (a fused projection: A's weight is the dim-0 concat of theirs).

It is derived from the parameters, never typed by hand: `derive_alignment` maps every B
parameter to its A name (the engine's own name mapping), so a module of A corresponds to the
B module that owns exactly the same parameters. Modules without parameters (norms without an
affine, activations) align by path, under aligned parents. Every module of either tree that
has no counterpart is listed with the reason (`Alignment.unaligned_a`, `.unaligned_b`); at run
time an aligned pair whose output shapes differ is skipped with both shapes, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lab.pairing.capture import ROOT

Kind = Literal["same", "fused"]

ParamMapping = Callable[[str], tuple[str, int | None, int | None]]
"""B parameter name -> (A parameter name, merge index or None, pieces merged or None)."""


@dataclass(frozen=True)
class AlignedModule:
    """One module of tree A and the module(s) of tree B that compute its output."""

    a: str
    """Module path in tree A (ROOT for the model)."""
    b: tuple[str, ...]
    """Module path(s) in tree B; several for `fused`, in concatenation order."""
    kind: Kind
    how: str
    """How the correspondence was found: "parameters", "path" or "root"."""


@dataclass(frozen=True)
class Alignment:
    """Module correspondence between two implementations of one model."""

    name_a: str
    """What tree A is (e.g. "sglang 0.5.23 FluxTransformer2DModel")."""
    name_b: str
    modules: tuple[AlignedModule, ...]
    unaligned_a: Mapping[str, str] = field(default_factory=dict)
    """Module of A -> why it has no counterpart in B."""
    unaligned_b: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, tuple[tuple[str, int | None], ...]] = field(default_factory=dict)
    """A parameter -> the B parameter(s) it holds ((name, merge index) each, in order)."""

    def by_a(self) -> dict[str, AlignedModule]:
        """The aligned modules keyed by their path in A."""
        return {m.a: m for m in self.modules}

    def by_b(self) -> dict[str, AlignedModule]:
        """The aligned modules keyed by their (first) path in B."""
        return {m.b[0]: m for m in self.modules}

    def counts(self) -> dict[str, int]:
        """Aligned (same / fused) and unaligned module counts, for summaries."""
        return {
            "same": sum(1 for m in self.modules if m.kind == "same"),
            "fused": sum(1 for m in self.modules if m.kind == "fused"),
            "unaligned_a": len(self.unaligned_a),
            "unaligned_b": len(self.unaligned_b),
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (Result.meta["alignment"])."""
        return {
            "a": self.name_a,
            "b": self.name_b,
            "counts": self.counts(),
            "modules": [
                {"a": m.a, "b": list(m.b), "kind": m.kind, "how": m.how} for m in self.modules
            ],
            "unaligned_a": dict(self.unaligned_a),
            "unaligned_b": dict(self.unaligned_b),
        }

    def table(self) -> Any:
        """One row per module of either tree: a, b, kind, how, reason (a pandas DataFrame)."""
        import pandas as pd

        rows = [
            {"a": m.a, "b": " + ".join(m.b), "kind": m.kind, "how": m.how, "reason": ""}
            for m in self.modules
        ]
        rows += [
            {"a": a, "b": "", "kind": "unaligned", "how": "", "reason": why}
            for a, why in self.unaligned_a.items()
        ]
        rows += [
            {"a": "", "b": b, "kind": "unaligned", "how": "", "reason": why}
            for b, why in self.unaligned_b.items()
        ]
        return pd.DataFrame(rows, columns=["a", "b", "kind", "how", "reason"])


class AlignmentError(ValueError):
    """Two trees whose parameters do not correspond one to one (not the same weights)."""


def _label(name: str) -> str:
    return name or ROOT


def _owner(param: str) -> tuple[str, str]:
    module, _, local = param.rpartition(".")
    return module, local


def derive_alignment(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    b_to_a: ParamMapping,
    *,
    name_a: str | None = None,
    name_b: str | None = None,
    parameterless: Mapping[str, str] | None = None,
) -> Alignment:
    """Align two implementations of one model from how their parameters map.

    Args:
        model_a: Tree A (the engine's model).
        model_b: Tree B (diffusers').
        b_to_a: Maps each B parameter name to (A name, merge index, pieces) as the engine's
            own loader does (`get_param_names_mapping`); merged pieces are concatenated along
            dim 0 of the A parameter in merge-index order; an empty A name is a parameter the
            engine's loader drops (its B module is listed unaligned with that reason).
        name_a: What tree A is, for messages (default: its class name).
        name_b: What tree B is.
        parameterless: Reasons for A modules without parameters that have no B counterpart,
            by path glob (e.g. {"*.attn.attn": "the attention kernel call; diffusers calls
            the function inside its Attention"}); the default reason is generic.

    Returns:
        The Alignment; every module of either tree is aligned or listed with a reason.

    Raises:
        AlignmentError: A B parameter maps to no A parameter, an A parameter receives no B
            parameter, or the shapes disagree (the two models do not hold the same weights).
    """
    import fnmatch

    name_a = name_a or type(model_a).__name__
    name_b = name_b or type(model_b).__name__
    params_a = dict(model_a.named_parameters())
    params_b = dict(model_b.named_parameters())
    pieces: dict[str, list[tuple[int | None, str]]] = {}
    unknown = []
    dropped: set[str] = set()
    for name_p in params_b:
        target, index, _ = b_to_a(name_p)
        if target == "":
            # The engine's mapping sends it nowhere: its loader drops it (Cosmos3's lm_head
            # and text-final norm, which its forward never reads).
            dropped.add(name_p)
            continue
        if target not in params_a:
            unknown.append(f"{name_p!r} -> {target!r}")
            continue
        pieces.setdefault(target, []).append((index, name_p))
    # A buffer of B that A holds as a parameter (SD3's pos_embed table: a diffusers buffer, an
    # engine Parameter) is the same weight.
    for name_p, buffer in model_b.named_buffers():
        target, index, _ = b_to_a(name_p)
        if target in params_a and target not in pieces:
            pieces.setdefault(target, []).append((index, name_p))
            params_b[name_p] = buffer  # type: ignore[assignment]
    missing = [n for n in params_a if n not in pieces]
    if unknown or missing:
        raise AlignmentError(
            f"align {name_a} with {name_b}: the parameters do not correspond. "
            + (
                f"{len(unknown)} parameter(s) of {name_b} map to no parameter of {name_a}: "
                f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}. "
                if unknown
                else ""
            )
            + (
                f"{len(missing)} parameter(s) of {name_a} receive none: "
                f"{', '.join(repr(n) for n in missing[:4])}{' ...' if len(missing) > 4 else ''}. "
                if missing
                else ""
            )
            + "Were both built from the same config (and the same engine version's mapping)?"
        )
    params: dict[str, tuple[tuple[str, int | None], ...]] = {}
    bad_shapes = []
    for target, got in pieces.items():
        got.sort(key=lambda p: -1 if p[0] is None else p[0])
        params[target] = tuple((b, i) for i, b in got)
        rows = sum(params_b[b].shape[0] if params_b[b].dim() else 1 for b, _ in params[target])
        shape_a = tuple(params_a[target].shape)
        first = tuple(params_b[got[0][1]].shape)
        if len(got) == 1 and first != shape_a:
            bad_shapes.append(f"{target!r} {shape_a} <- {got[0][1]!r} {first}")
        elif len(got) > 1 and (not shape_a or rows != shape_a[0]):
            bad_shapes.append(f"{target!r} {shape_a} <- {len(got)} pieces of {rows} rows")
    if bad_shapes:
        raise AlignmentError(
            f"align {name_a} with {name_b}: parameter shapes differ: {'; '.join(bad_shapes[:4])}. "
            "Were both built from the same config?"
        )

    modules_a = dict(model_a.named_modules())
    modules_b = dict(model_b.named_modules())
    # Each module's full parameter set, in B's names (A's translated through the mapping).
    subtree_a = _subtree_params(modules_a, lambda p: [b for b, _ in params[p]])
    mapped_buffers = {b for sources in params.values() for b, _ in sources} - set(
        dict(model_b.named_parameters())
    )
    subtree_b = _subtree_params(modules_b, lambda p: [p], buffers=mapped_buffers)
    by_set_b: dict[frozenset[str], list[str]] = {}
    for name_m, owned in subtree_b.items():
        if owned:
            by_set_b.setdefault(owned, []).append(name_m)

    aligned: dict[str, AlignedModule] = {}
    claimed_b: set[str] = set()
    unaligned_a: dict[str, str] = {}
    for name_m, module in modules_a.items():
        owned = subtree_a[name_m]
        if not name_m:
            aligned[name_m] = AlignedModule(ROOT, (ROOT,), "same", "root")
            claimed_b.add("")
            continue
        if not owned:
            continue  # parameterless: aligned by path below, once the parents are
        own = [p for p, _ in module.named_parameters(recurse=False)]
        candidates = by_set_b.get(owned, [])
        if candidates:
            direct = {c for c in candidates if any(True for _ in modules_b[c].parameters(False))}
            pick = _closest(name_m, candidates, claimed_b, direct if own else set())
            if pick is not None:
                aligned[name_m] = AlignedModule(_label(name_m), (pick,), "same", "parameters")
                claimed_b.add(pick)
                continue
        if own and not any(c for c in module.children() if list(c.parameters())):
            # A leaf holding pieces of several B modules: a fused projection.
            sources = [params[f"{name_m}.{p}" if name_m else p] for p in own]
            owners = [_owner(b)[0] for b, _ in sources[0]]
            same_layout = all(
                [_owner(b)[0] for b, _ in s] == owners and len(s) == len(owners) for s in sources
            )
            if same_layout and len(owners) > 1 and not (set(owners) & claimed_b):
                aligned[name_m] = AlignedModule(
                    _label(name_m), tuple(owners), "fused", "parameters"
                )
                claimed_b.update(owners)
                continue
        unaligned_a[_label(name_m)] = (
            f"no module of {name_b} holds exactly its parameters "
            f"({len(owned)} of them, e.g. {sorted(owned)[0]!r} in {name_b}'s names)"
        )
    # Parameterless modules: the same relative path under aligned parents, parents first.
    for name_m, module in modules_a.items():
        if not name_m or subtree_a[name_m]:
            continue
        parent, _, leaf = name_m.rpartition(".")
        parent_b = aligned.get(parent)
        target = None
        if parent_b is not None and parent_b.kind == "same":
            base = "" if parent_b.b[0] == ROOT else parent_b.b[0]
            guess = f"{base}.{leaf}" if base else leaf
            if guess in modules_b and not subtree_b[guess] and guess not in claimed_b:
                target = guess
        if target is None and name_m in modules_b and not subtree_b[name_m]:
            target = name_m if name_m not in claimed_b else None
        if target is not None and type(modules_b[target]).__name__ != type(module).__name__:
            # The same place but another computation (the engine's fused norm + modulation
            # where diffusers has the plain norm): not the same output.
            unaligned_a[_label(name_m)] = (
                f"{name_b}'s module at that place, {target!r}, is a "
                f"{type(modules_b[target]).__name__}, this a {type(module).__name__}: they "
                "compute different outputs"
            )
            continue
        if target is not None:
            aligned[name_m] = AlignedModule(_label(name_m), (target,), "same", "path")
            claimed_b.add(target)
            continue
        reason = next(
            (
                why
                for glob, why in (parameterless or {}).items()
                if fnmatch.fnmatchcase(name_m, glob)
            ),
            f"no parameters and no module of {name_b} at the matching path "
            f"({type(module).__name__})",
        )
        unaligned_a[_label(name_m)] = reason

    unaligned_b: dict[str, str] = {}
    for name_m, module in modules_b.items():
        if name_m in claimed_b:
            continue
        owned = subtree_b[name_m]
        if owned and owned in {subtree_b[c] for c in claimed_b if c in subtree_b}:
            holder = next(c for c in claimed_b if subtree_b.get(c) == owned)
            reason = (
                f"holds the same parameters as {_label(holder)!r}, which is the one aligned "
                f"(its output is {type(module).__name__}'s, not a module of {name_a})"
            )
        elif owned and owned <= dropped:
            reason = (
                f"the engine's parameter mapping drops its parameters ({', '.join(sorted(owned))}"
                f"): {name_a} does not hold or compute it"
            )
        elif owned:
            reason = f"no module of {name_a} holds exactly its parameters ({len(owned)})"
        else:
            reason = f"no parameters and no module of {name_a} at the matching path"
        unaligned_b[_label(name_m)] = reason
    order = {n: i for i, n in enumerate(modules_a)}
    ordered = sorted(aligned.items(), key=lambda kv: order[kv[0]])
    return Alignment(
        name_a=name_a,
        name_b=name_b,
        modules=tuple(m for _, m in ordered),
        unaligned_a=dict(sorted(unaligned_a.items(), key=lambda kv: order.get(kv[0], -1))),
        unaligned_b=unaligned_b,
        params=params,
    )


def _subtree_params(
    modules: Mapping[str, torch.nn.Module],
    names: Callable[[str], Iterable[str]],
    buffers: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, frozenset[str]]:
    """Each module path -> every parameter (and listed buffer) under it, as `names` spells them."""
    out: dict[str, frozenset[str]] = {}
    for prefix, module in modules.items():
        found: set[str] = set()
        for local, _ in module.named_parameters():
            found.update(names(f"{prefix}.{local}" if prefix else local))
        for local, _ in module.named_buffers():
            full = f"{prefix}.{local}" if prefix else local
            if full in buffers:
                found.add(full)
        out[prefix] = frozenset(found)
    return out


def _closest(name: str, candidates: list[str], claimed: set[str], direct: set[str]) -> str | None:
    """The unclaimed candidate for `name`.

    The same path, else one that holds the parameters itself when `direct` lists those (a
    Linear, not the GELU wrapper around it), else the one that reads most like it.
    """
    import difflib

    free = [c for c in candidates if c not in claimed]
    if not free:
        return None
    if name in free:
        return name
    return max(
        free,
        key=lambda c: (c in direct, difflib.SequenceMatcher(None, name, c).ratio(), -len(c)),
    )

"""weight_sync: a trainer's and an engine's weights by name, count, shape, dtype and value.

The first set is the reference (the trainer that pushes its weights), the second the candidate
(the engine that receives them). Each tensor gets one status, worst first:

    missing   in the reference only (the engine never received it)
    extra     in the candidate only (the engine holds a tensor the trainer does not have)
    shape     both hold it, in other shapes
    differs   values differ even after rounding both to the coarser dtype (a stale or wrong sync)
    dtype     values arrive (rounded or equal), but in another dtype than `expect_dtype` says
    rounded   values differ, but are equal once rounded to `rounded_to` (the cast a sync does:
              an fp32 master sent as bf16, or an fp32 copy that went through bf16 on the way)
    equal     same dtype, bit-identical

Either side may be a state dict, a module (its parameters and persistent buffers), a
safetensors file, or a `lab.dump` directory, whose manifest holds fingerprints of the engine's
parameters (shape, dtype, checksums) rather than values: there the value statuses come from
the checksums, which a dump also records as cast to each coarser dtype, and no ULP is known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.base.dtypes import dtype_name, parse_dtype
from lab.causes.checks.result import CheckResult
from lab.engine.dump import MANIFEST, Dump, load_dump, tensor_fingerprint
from lab.families.master import held_parameters
from lab.pairing.metrics import compare
from lab.pairing.stats_layout import coarser_dtype
from lab.pairing.weights import constructed_buffer_dtypes

STATUSES: tuple[str, ...] = ("missing", "extra", "shape", "differs", "dtype", "rounded", "equal")
"""Worst first; `passed` means every tensor is `rounded` or `equal`."""
_FAILING = frozenset({"missing", "extra", "shape", "dtype", "differs"})
COLUMNS: list[str] = [
    "name", "status", "dtype_a", "dtype_b", "dtype_changed", "shape_a", "shape_b", "numel",
    "rounded_to", "max_ulp", "max_abs_diff", "bitexact_frac", "compared_by",
]  # fmt: skip
_GRIDS: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

Source = Mapping[str, torch.Tensor] | torch.nn.Module | str | Path | Dump


def _resolve(value: Source, params_only: bool, where: str) -> tuple[str, dict[str, Any], bool]:
    """(description, name -> tensor or fingerprint, whether the entries are fingerprints)."""
    if isinstance(value, Dump):
        return _from_dump(value, where)
    if isinstance(value, torch.nn.Module):
        tensors = dict(value.named_parameters())
        if not params_only:
            tensors.update(value.state_dict())
        # A compact master holds exact tensors at bf16; their logical value is the exact upcast.
        for name, logical in held_parameters(value).items():
            if name in tensors:
                tensors[name] = tensors[name].to(logical)
        return f"{type(value).__name__} (module)", tensors, False
    if isinstance(value, str | Path):
        path = Path(value)
        if path.is_dir() and (path / MANIFEST).is_file():
            return _from_dump(load_dump(path), where)
        if path.is_file() and path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return f"{path.name} (safetensors)", dict(load_file(str(path))), False
        raise ValueError(
            f"{where}: {str(path)!r} is neither a lab.dump directory (with {MANIFEST}) nor a "
            ".safetensors file. Pass a state dict, a module, a dump directory or a .safetensors "
            "file."
        )
    if isinstance(value, Mapping):
        bad = [k for k, v in value.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(
                f"{where}: entry {bad[0]!r} is a {type(value[bad[0]]).__name__}, not a tensor; "
                "a state dict maps names to tensors (model.state_dict())."
            )
        return "state dict", dict(value), False
    raise ValueError(
        f"{where}: expected a state dict, a torch module, a lab.dump directory or a .safetensors "
        f"file, got {type(value).__name__}."
    )


def _from_dump(dump: Dump, where: str) -> tuple[str, dict[str, Any], bool]:
    weights = dump.manifest.get("weights")
    if not weights:
        why = dump.manifest.get("weights_unavailable") or "an older dump schema"
        raise ValueError(
            f"{where}: dump {str(dump.directory)!r} holds no weight fingerprints ({why}). "
            "Dump from a process where every parameter is local (not FSDP-sharded) with "
            "lab.dump.attach."
        )
    return f"dump {dump.directory.name}", dict(weights["parameters"]), True


@checked_arguments
def weight_sync(
    state_a: Source,
    state_b: Source,
    *,
    expect_dtype: str | None = None,
    keep_fp32_modules: Sequence[str] = (),
    names: tuple[str, str] = ("trainer", "engine"),
) -> CheckResult:
    """Compare two sets of weights tensor by tensor (see the module docstring for statuses).

    Args:
        state_a: The reference (the trainer's weights): a state dict, a module, a .safetensors
            file or a lab.dump directory.
        state_b: The candidate (the engine's weights), same forms.
        expect_dtype: The dtype the candidate should hold floating tensors in (the engine's
            --sglang-dit-precision, e.g. "bf16"); a tensor in another dtype gets "dtype". A
            buffer that a module source's class builds in its own dtype (SD3's
            `pos_embed.pos_embed`, fp32) is expected at that dtype, as an engine load keeps it.
            None: dtype changes are listed (dtype_changed) but not failed.
        keep_fp32_modules: Name components the engine keeps in fp32 whatever expect_dtype
            says (Family.engine_fp32_modules), e.g. ("norm2", "time_embedder").
        names: What to call the two sides in the verdict.

    Returns:
        A CheckResult, one row per tensor name (the reference's order, then extras);
        passed = every tensor is "rounded" or "equal".

    Raises:
        ValueError: An unsupported source, a state dict holding non-tensors, a dump without
            weight fingerprints, or a bad expect_dtype.
    """
    where = "weight_sync"
    expected = None if expect_dtype is None else parse_dtype(
        expect_dtype, where=f"{where}(expect_dtype)"
    )  # fmt: skip
    if isinstance(keep_fp32_modules, str):
        raise ValueError(
            f"{where}: keep_fp32_modules must be a tuple of names, got the string "
            f"{keep_fp32_modules!r}; use ({keep_fp32_modules!r},)."
        )
    dumps = [_is_dump(s) for s in (state_a, state_b)]
    # A dump fingerprints parameters only: a module paired with one offers its parameters.
    what_a, a, prints_a = _resolve(state_a, any(dumps), f"{where}(state_a)")
    what_b, b, prints_b = _resolve(state_b, any(dumps), f"{where}(state_b)")
    # A buffer the reference module's class builds in its own dtype (SD3's pos_embed table,
    # fp32 at any precision) is expected at that dtype: an engine load keeps it so.
    own: dict[str, torch.dtype] = {}
    if expected is not None:
        for source in (state_a, state_b):
            if isinstance(source, torch.nn.Module):
                own = constructed_buffer_dtypes(source, expected) or {}
                break
    rows = []
    for name in [*a, *(n for n in b if n not in a)]:
        want = own.get(name, expected)
        rows.append(
            _row(name, a.get(name), b.get(name), prints_a, prints_b, want, keep_fp32_modules)
        )
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    changes: dict[str, int] = {}
    for r in rows:
        if r["dtype_changed"]:
            pair = f"{r['dtype_a']}->{r['dtype_b']}"
            changes[pair] = changes.get(pair, 0) + 1
    meta = {
        "side_a": {"name": names[0], "source": what_a, "count": len(a)},
        "side_b": {"name": names[1], "source": what_b, "count": len(b)},
        "numel_a": sum(_numel(v) for v in a.values()),
        "numel_b": sum(_numel(v) for v in b.values()),
        "status_counts": counts,
        "dtype_changes": changes,
        "expect_dtype": None if expected is None else dtype_name(expected),
        "keep_fp32_modules": list(keep_fp32_modules),
        "applicable": True,
    }
    # No tensor on either side compares nothing: never a pass (an empty state dict, a wrong
    # prefix or filter), whatever the rows' statuses say.
    passed = bool(rows) and not any(r["status"] in _FAILING for r in rows)
    return CheckResult(where, rows, list(COLUMNS), _verdict(rows, meta, names), passed, meta)


def _is_dump(value: Any) -> bool:
    if isinstance(value, Dump):
        return True
    return isinstance(value, str | Path) and (Path(value) / MANIFEST).is_file()


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    shape = value.get("shape", []) if isinstance(value, Mapping) else []
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _meta_of(value: Any) -> tuple[list[int], str]:
    if isinstance(value, torch.Tensor):
        return list(value.shape), dtype_name(value.dtype)
    return list(value["shape"]), value["dtype"]


def _row(
    name: str,
    a: Any,
    b: Any,
    prints_a: bool,
    prints_b: bool,
    expected: torch.dtype | None,
    keep_fp32: Sequence[str],
) -> dict[str, Any]:
    nan = float("nan")
    row: dict[str, Any] = dict(
        name=name, rounded_to="", max_ulp=nan, max_abs_diff=nan, bitexact_frac=nan,
        compared_by="",
    )  # fmt: skip
    shape_a, dtype_a = _meta_of(a) if a is not None else (None, "")
    shape_b, dtype_b = _meta_of(b) if b is not None else (None, "")
    row.update(
        dtype_a=dtype_a, dtype_b=dtype_b, shape_a=shape_a, shape_b=shape_b,
        dtype_changed=bool(a is not None and b is not None and dtype_a != dtype_b),
        numel=_numel(a if a is not None else b),
    )  # fmt: skip
    if a is None or b is None:
        row["status"] = "missing" if b is None else "extra"
        return row
    if shape_a != shape_b:
        row["status"] = "shape"
        return row
    if prints_a or prints_b:
        status, rounded_to = _by_fingerprint(a, b, prints_a, prints_b)
        row.update(status=status, rounded_to=rounded_to, compared_by="fingerprint")
    else:
        row.update(_by_value(a, b), compared_by="value")
    kept = any(part in keep_fp32 for part in name.split("."))
    want = torch.float32 if kept else expected
    if (
        want is not None
        and row["status"] != "differs"
        and _is_float_name(dtype_b)
        and dtype_b != dtype_name(want)
    ):
        row["status"] = "dtype"
    return row


def _is_float_name(name: str) -> bool:
    return name in ("fp32", "bf16", "fp16", "fp64")


def _by_value(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    a, b = a.detach().cpu(), b.detach().cpu()
    if not (a.is_floating_point() and b.is_floating_point()):
        equal = a.dtype == b.dtype and bool(torch.equal(a, b))
        return dict(status="equal" if equal else "differs", bitexact_frac=float(equal))
    m = compare(a, b)
    out: dict[str, Any] = dict(
        max_ulp=float(m.max_ulp),
        max_abs_diff=float(m.max_abs_diff),
        bitexact_frac=float(m.bitexact_frac),
    )
    if a.dtype == b.dtype and m.max_abs_diff == 0 and m.bitexact_frac == 1.0:
        return {**out, "status": "equal"}
    if a.dtype != b.dtype and m.max_abs_diff_rounded == 0:
        coarse = coarser_dtype(a.dtype, b.dtype)
        return {**out, "status": "rounded", "rounded_to": dtype_name(coarse)}
    # Same dtype (or not equal after rounding): is the candidate the reference rounded to a
    # coarser grid on the way (an fp32 copy that went through bf16)?
    for grid in _GRIDS:
        if torch.finfo(grid).bits >= torch.finfo(b.dtype).bits:
            continue
        if torch.equal(a.to(grid).to(b.dtype), b):
            return {**out, "status": "rounded", "rounded_to": dtype_name(grid)}
    return {**out, "status": "differs"}


def _by_fingerprint(a: Any, b: Any, prints_a: bool, prints_b: bool) -> tuple[str, str]:
    fa = a if prints_a else tensor_fingerprint(a)
    fb = b if prints_b else tensor_fingerprint(b)
    if fa["dtype"] == fb["dtype"]:
        d = fa["dtype"]
        return ("equal", "") if fa["hashes"].get(d) == fb["hashes"].get(d) else ("differs", "")
    # Compared in the dtype both fingerprints carry (the coarser one's view of the finer).
    common = set(fa["hashes"]) & set(fb["hashes"])
    for d in sorted(common, key=lambda n: torch.finfo(parse_dtype(n, where="dump")).bits):
        if fa["hashes"][d] == fb["hashes"][d]:
            return "rounded", d
    return "differs", ""


def _verdict(rows: list[dict], meta: dict[str, Any], names: tuple[str, str]) -> str:
    a, b = names
    counts = meta["status_counts"]
    head = (
        f"{a} ({meta['side_a']['source']}, {meta['side_a']['count']} tensors, "
        f"{meta['numel_a']} elements) vs {b} ({meta['side_b']['source']}, "
        f"{meta['side_b']['count']} tensors, {meta['numel_b']} elements): "
    )
    parts = [
        ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        or "no tensor on either side, nothing compared: not a pass",
    ]
    if meta["dtype_changes"]:
        parts.append(
            "dtype changes " + ", ".join(f"{k}: {n}" for k, n in meta["dtype_changes"].items())
        )
    for status, words in (
        ("missing", f"never reach the {b}"),
        ("extra", f"exist only on the {b}"),
        ("shape", "change shape"),
        ("differs", "differ beyond rounding (a stale or wrong sync)"),
        ("dtype", f"are not held in {meta['expect_dtype']} (nor kept fp32) by the {b}"),
    ):
        hit = [r["name"] for r in rows if r["status"] == status]
        if hit:
            parts.append(f"{_names(hit)} {words}")
    differs = [r for r in rows if r["status"] == "differs" and r["max_ulp"] == r["max_ulp"]]
    if differs:
        worst = max(differs, key=lambda r: r["max_ulp"])
        parts.append(f"worst {worst['name']!r} at {worst['max_ulp']:g} ULP")
    ok = not any(r["status"] in _FAILING for r in rows)
    tail = (
        " Give it the state dicts (or dumps) to compare."
        if not rows
        else " In sync: every tensor arrives, equal or rounded as a sync casts it."
        if ok
        else f" Out of sync: the {b} does not run the {a}'s weights."
    )
    return head + "; ".join(parts) + "." + tail


def _names(names: list[str], n: int = 3) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")

"""Real-engine dumps: module outputs written from any process, paired like a live side.

Format (one directory): `forward_<n>.safetensors` per root forward, holding every captured output
tensor under the key `<module>#<call>:<output>`, plus `manifest.json`:

    {"schema": "precision-lab/dump/3", "model_class": ..., "module_names": [...],
     "weights": {"covers": ..., "parameters": {name: {"shape", "dtype", "hashes"}}} | null,
     "weights_unavailable": null | why, "weights_taken": "attach" | "forward 0",
     "forwards": [{"forward", "step", "cfg_branch", "file", "inputs": {name: fingerprint},
                   "weights": {...} (only where they differ from the manifest's),
                   "weights_unavailable": why (only where they could not be read)}],
     "entries": [{"order", "module", "call", "output", "step", "cfg_branch", "forward",
                  "dtype", "shape", "file", "key", "complex"}, ...]}

Module names are exact `named_modules()` paths (`<root>` for the model), calls count per root
forward, and `step` / `cfg_branch` are whatever the caller set on the handle. `attach` needs only
torch and safetensors at run time, so it can be installed inside an engine process. Every file is
written atomically (lab.base.atomic): a full disk never tears a manifest or a forward file.

Fingerprints say which weights and inputs a dump came from, so a dump of other weights, other
inputs or another width is refused instead of paired (`allow_mismatch=True` pairs it anyway and
flags it in the Result's meta). `tensor_fingerprint` documents what a fingerprint covers. The
weights are fingerprinted as each root forward starts (as the forward holds them: a lab side's
casts), not only when `attach` is called: weights changed between forwards (or before the
first) are the weights of the forwards that ran with them. The manifest's `weights` are the
first forward's (those at `attach` until a forward runs: a dump of weights alone); a forward
that ran with other weights carries its own.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.base.dtypes import dtype_name
from lab.families.master import held_parameters
from lab.pairing.capture import ROOT, flatten_output
from lab.pairing.metrics import decode_stats, pair_stats
from lab.pairing.result import LayerDivergence, Result, Skipped

SCHEMA = "precision-lab/dump/3"
SCHEMA_ATTACH_WEIGHTS = "precision-lab/dump/2"
SCHEMAS_READ: tuple[str, ...] = ("precision-lab/dump/1", SCHEMA_ATTACH_WEIGHTS, SCHEMA)
"""Schema 1 dumps (no fingerprints) still pair, their weights and inputs unchecked; schema 2
dumps fingerprinted the weights when `attach` was called (checked, and said so)."""
MANIFEST = "manifest.json"
_FORWARD_FILE = re.compile(r"^forward_\d+\.safetensors$")

# Checksum words are 16 bits; 2**22 of them per reduction step keeps every partial sum of
# word * (position mod 65521 + 1) below 2**54, so int64 never overflows and integer addition
# makes the result independent of reduction order (CPU and CUDA agree).
_CHUNK_WORDS = 1 << 22
_POSITION_MODULUS = 65521
_ACC_MODULUS = (1 << 61) - 1
# A float tensor is also fingerprinted as it would be after a cast to each coarser dtype, so a
# bf16 engine's weights can be matched against the fp32 master they were cast from.
_VIEWS: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float64: (torch.float64, torch.float32, torch.bfloat16, torch.float16),
    torch.float32: (torch.float32, torch.bfloat16, torch.float16),
}
FINGERPRINT_COVERS = (
    "every byte of every parameter (named_parameters, buffers excluded) and of every tensor "
    "input of the forward, as a position-weighted checksum of 16-bit words computed on the "
    "tensor's device; fp32/fp64 tensors also as cast to each coarser float dtype. It tells "
    "different weights or inputs apart; it is not a cryptographic hash."
)


class DumpError(ValueError):
    """A dump directory that cannot be read or paired, with what disagrees."""


class DumpWriteError(OSError):
    """A forward's dump file could not be written (the writer's own error, the file named).

    An OSError, like a full disk's: the forward that was being dumped is not at fault, so
    `forward_side` and `pair` pass it on as it is instead of blaming a side or a module.
    """


# ---- fingerprints -------------------------------------------------------------------------------


def tensor_fingerprint(tensor: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and checksums of a tensor, computed where it lives (no host copy).

    Covers every element: the tensor's bytes are read as 16-bit words w_i and summed as
    (sum w_i, sum w_i * (i mod 65521 + 1)) in int64 on the tensor's device, chunk by chunk (the
    temporaries stay near 100 MB whatever the tensor's size); the two sums and the word count are
    hashed with blake2b. Reordered, rounded or re-seeded values give another fingerprint. fp32
    (and fp64) tensors are also fingerprinted after a cast to each coarser float dtype, so two
    fingerprints are compared on the dtypes both have (`fingerprints_differ`).

    Cost, measured on one H200 for 12.1e9 parameters (FLUX.1-dev size) in 320 tensors: 2.2 s in
    fp32 (three dtypes each), 0.5 s in bf16, 200 MiB of temporaries. On CPU it is about 0.76 s
    per 3072 x 12288 fp32 tensor, so a full-size model on CPU takes minutes; tiny presets take
    milliseconds.

    Args:
        tensor: Any dense tensor (not on the meta device).

    Returns:
        {"shape": [...], "dtype": "fp32", "hashes": {"fp32": hex, "bf16": hex, "fp16": hex}}.
    """
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    views = _VIEWS.get(t.dtype, (t.dtype,))
    hashes = {dtype_name(d): _checksum(t if d == t.dtype else t.to(d)) for d in views}
    return {"shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype), "hashes": hashes}


def _checksum(t: torch.Tensor) -> str:
    flat = t.contiguous().reshape(-1)
    if flat.numel() and flat.stride(-1) != 1:
        # A one-element (e.g. expanded timestep) tensor counts as contiguous with any stride,
        # and a dtype view needs stride 1.
        flat = flat.clone(memory_format=torch.contiguous_format)
    words = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)
    acc = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS].to(torch.int64) & 0xFFFF
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        acc[0] += w.sum()
        acc[1] = (acc[1] + (w * (pos % _POSITION_MODULUS + 1)).sum()) % _ACC_MODULUS
    total, weighted = acc.tolist()
    text = f"{words.numel()}:{total}:{weighted}".encode()
    return hashlib.blake2b(text, digest_size=8).hexdigest()


@checked_arguments
def weight_fingerprints(model: torch.nn.Module) -> tuple[dict[str, Any] | None, str | None]:
    """Fingerprint every parameter of `model` (see `tensor_fingerprint`).

    Returns:
        ({"covers": ..., "parameters": {name: fingerprint}}, None), or (None, why) when the
        weights cannot be read here (meta device, or FSDP-sharded DTensors: one rank holds only
        a shard, and gathering would need every rank).
    """
    params = list(model.named_parameters())
    for name, p in params:
        if p.device.type == "meta":
            return None, f"parameter {name!r} is on the meta device (no weights)"
        if type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor":
            return None, f"parameter {name!r} is a sharded DTensor (one rank holds a shard)"
    # A compact master's held tensors are fingerprinted as their fp32 value (exact upcast), so
    # a dump's fp32 weights are compared on every bit, not only on their bf16 rounding.
    held = held_parameters(model)
    return {
        "covers": FINGERPRINT_COVERS,
        "parameters": {
            name: tensor_fingerprint(p.detach().to(held[name]) if name in held else p)
            for name, p in params
        },
    }, None


def input_fingerprints(
    kwargs: Mapping[str, Any], args: Iterable[Any] = (), forward: Any = None
) -> dict[str, Any]:
    """Fingerprint every leaf of a forward's inputs, keyed by argument name (`name.0` inside).

    Positional `args` are named through `forward`'s signature when it binds. Tensors get
    `tensor_fingerprint`; JSON values (ints, shapes, flags) are kept as {"value": v}; anything
    else as {"type": class name}. None leaves are skipped (an engine may drop an all-true mask).
    """
    args = tuple(args)
    named: dict[str, Any] = {}
    if args and forward is not None:
        try:
            named = dict(inspect.signature(forward).bind_partial(*args, **kwargs).arguments)
        except (TypeError, ValueError):
            named = {}
    if not named:
        named = {**{f"args.{i}": a for i, a in enumerate(args)}, **kwargs}
    out: dict[str, Any] = {}
    for name, value in named.items():
        for idx, leaf in flatten_output(value):
            key = f"{name}.{idx}" if idx else name
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type != "meta":
                    out[key] = tensor_fingerprint(leaf)
            elif isinstance(leaf, bool | int | float | str):
                out[key] = {"value": leaf}
            else:
                out[key] = {"type": type(leaf).__name__}
    return out


def fingerprints_differ(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """How two fingerprints (tensor or value) differ, or None when they agree or can't be compared.

    Tensors of other shapes differ; otherwise the hashes are compared on every dtype both
    fingerprints have (an fp32 tensor matches a bf16 one when it rounds to it exactly).
    Fingerprints without a common dtype (fp16 vs bf16) cannot be compared: None.
    """
    if "hashes" in a and "hashes" in b:
        if list(a["shape"]) != list(b["shape"]):
            return f"shape {tuple(a['shape'])} vs {tuple(b['shape'])}"
        common = sorted(set(a["hashes"]) & set(b["hashes"]))
        differ = [d for d in common if a["hashes"][d] != b["hashes"][d]]
        if differ:
            return f"values differ ({a['dtype']} vs {b['dtype']}, compared as {differ[0]})"
        return None
    if "value" in a and "value" in b and a["value"] != b["value"]:
        return f"{a['value']!r} vs {b['value']!r}"
    if ("hashes" in a) != ("hashes" in b) and ("value" in a or "value" in b):
        return "a tensor on one side only"
    return None


def _uncomparable(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return (
        "hashes" in a
        and "hashes" in b
        and list(a["shape"]) == list(b["shape"])
        and not set(a["hashes"]) & set(b["hashes"])
    )


# ---- writing ------------------------------------------------------------------------------------


class DumpHandle:
    """Hooks that write every module output of every root forward to a dump directory.

    Set `step` / `cfg_branch` between forwards (`handle.set(step=3, cfg_branch="uncond")`);
    `detach()` (or leaving the `with` block) removes the hooks and writes the manifest. Only
    forwards that completed are listed: one that raised, or whose file could not be written,
    leaves the manifest of the forwards before it intact.
    """

    @checked_arguments
    def __init__(
        self,
        model: torch.nn.Module,
        directory: str | Path,
        *,
        step: int = 0,
        cfg_branch: str = "cond",
        model_name: str | None = None,
        overwrite: bool = False,
    ) -> None:
        self.model = model
        self.directory = Path(directory)
        _prepare_directory(self.directory, overwrite)
        self.step = step
        self.cfg_branch = cfg_branch
        self.model_name = model_name or type(model).__name__
        self.entries: list[dict[str, Any]] = []
        self.forward_records: list[dict[str, Any]] = []
        self.forwards = 0
        # Until a forward runs, the weights as attached (what `weight_sync` reads of a dump of
        # weights alone); then the first forward's, taken as it starts (`_start`).
        self.weights, self.weights_unavailable = weight_fingerprints(model)
        self.weights_taken = "attach"
        self._pending: list[dict[str, Any]] = []
        self._pending_inputs: dict[str, Any] = {}
        self._pending_weights: tuple[dict[str, Any] | None, str | None] = (None, None)
        self._calls: dict[str, int] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            label = name or ROOT
            self._handles.append(module.register_forward_hook(self._record(label)))
        self._handles.insert(0, model.register_forward_pre_hook(self._start, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._flush))
        self.write_manifest()

    @checked_arguments
    def set(self, *, step: int | None = None, cfg_branch: str | None = None) -> None:
        """Label the next forwards with this denoising step and CFG branch."""
        if step is not None:
            self.step = step
        if cfg_branch is not None:
            self.cfg_branch = cfg_branch

    def _start(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self._calls, self._tensors, self._pending = {}, {}, []
        self._pending_inputs = input_fingerprints(kwargs, args, module.forward)
        self._pending_weights = weight_fingerprints(self.model)

    def _record(self, label: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            call = self._calls.get(label, 0)
            self._calls[label] = call + 1
            for idx, leaf in flatten_output(output):
                if not isinstance(leaf, torch.Tensor):
                    continue
                key = f"{label}#{call}:{idx}"
                tensor = leaf.detach()
                is_complex = tensor.is_complex()
                if is_complex:
                    tensor = torch.view_as_real(tensor)
                self._tensors[key] = tensor.to("cpu", copy=True).contiguous()
                self._pending.append(
                    {
                        "order": len(self._pending),
                        "module": label,
                        "call": call,
                        "output": idx,
                        "step": self.step,
                        "cfg_branch": self.cfg_branch,
                        "forward": self.forwards,
                        "dtype": dtype_name(leaf.dtype),
                        "shape": list(leaf.shape),
                        "file": _forward_file(self.forwards),
                        "key": key,
                        "complex": is_complex,
                    }
                )

        return hook

    def _flush(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        from safetensors.torch import save_file

        from lab.base.atomic import atomic_path

        tensors, pending, self._tensors, self._pending = self._tensors, self._pending, {}, []
        path = self.directory / _forward_file(self.forwards)
        try:
            with atomic_path(path) as tmp:
                save_file(tensors, str(tmp))
        except OSError:
            raise  # a full disk, a read-only folder: the OS's words, naming the file
        except Exception as err:  # safetensors' SafetensorError wraps its I/O errors
            raise DumpWriteError(
                f"attach: forward {self.forwards} of the dump could not be written to "
                f"{str(path)!r}: {type(err).__name__}: {err}. The forwards before it are kept "
                "(manifest.json lists them); free space or fix the folder, then dump again."
            ) from err
        weights, why = self._pending_weights
        record: dict[str, Any] = {
            "forward": self.forwards,
            "step": self.step,
            "cfg_branch": self.cfg_branch,
            "file": _forward_file(self.forwards),
            "inputs": self._pending_inputs,
        }
        if not self.forward_records:
            self.weights, self.weights_unavailable = weights, why
            self.weights_taken = f"forward {self.forwards}"
        elif why is not None:
            record["weights_unavailable"] = why
        elif weights != self.weights:
            record["weights"] = weights  # changed since the first forward: this one's own
        self.entries += pending
        self.forward_records.append(record)
        self.forwards += 1
        self.write_manifest()

    def write_manifest(self) -> Path:
        """Write manifest.json for the forwards completed so far (atomically); returns its path."""
        from lab.base.atomic import atomic_write_text

        doc = {
            "schema": SCHEMA,
            "model_class": type(self.model).__name__,
            "model_name": self.model_name,
            "module_names": [n or ROOT for n, _ in self.model.named_modules()],
            "torch": torch.__version__,
            "weights": self.weights,
            "weights_unavailable": self.weights_unavailable,
            "weights_taken": self.weights_taken,
            "forwards": self.forward_records,
            "entries": self.entries,
        }
        return atomic_write_text(self.directory / MANIFEST, json.dumps(doc, indent=1))

    def detach(self) -> None:
        """Remove every hook and write the manifest."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.write_manifest()

    def __enter__(self) -> DumpHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()


def _forward_file(forward: int) -> str:
    return f"forward_{forward:05d}.safetensors"


def _prepare_directory(directory: Path, overwrite: bool) -> None:
    """Create `directory`; refuse one holding a dump unless `overwrite` (then remove that dump).

    Raises:
        DumpError: The directory holds a manifest or forward files and overwrite is False.
    """
    if directory.exists() and not directory.is_dir():
        raise DumpError(f"attach: {str(directory)!r} is a file; pass a directory for the dump.")
    old = [p for p in directory.glob("*") if p.name == MANIFEST or _FORWARD_FILE.match(p.name)]
    if old and not overwrite:
        raise DumpError(
            f"attach: {str(directory)!r} already holds a dump ({len(old)} file(s): "
            f"{', '.join(sorted(p.name for p in old)[:3])}{' ...' if len(old) > 3 else ''}). "
            "Dump into a new directory, or pass overwrite=True to replace it."
        )
    # The manifest goes first: a half-removed dump is never mistaken for a complete one.
    for p in sorted(old, key=lambda p: p.name != MANIFEST):
        p.unlink()
    directory.mkdir(parents=True, exist_ok=True)


@checked_arguments
def attach(
    module: torch.nn.Module,
    directory: str | Path,
    *,
    step: int = 0,
    cfg_branch: str = "cond",
    model_name: str | None = None,
    overwrite: bool = False,
) -> DumpHandle:
    """Start dumping every module output of `module`'s forwards into `directory`.

    Fingerprints `module`'s parameters and inputs as each root forward starts (see
    `tensor_fingerprint`: one pass over the weights on their device per forward, about 0.5 s
    for 12e9 bf16 parameters on an H200), so the weights recorded are the ones that forward ran
    with, even when they change between `attach` and a forward or between forwards.

    Args:
        module: Any torch module (a diffusers DiT inside an engine process, a lab model).
        directory: Created if missing; one safetensors file per root forward plus manifest.json.
        step: Denoising step label for the next forwards (change with `handle.set`).
        cfg_branch: CFG branch label, e.g. "cond" / "uncond".
        model_name: Free-form name stored in the manifest (default: the class name).
        overwrite: Replace a dump already in `directory` (its manifest and forward files).

    Returns:
        The DumpHandle; use it as a context manager or call `detach()`.

    Raises:
        DumpError: `directory` already holds a dump and overwrite is False.
        DumpWriteError: (during a forward) its file could not be written, naming it.
    """
    return DumpHandle(
        module,
        directory,
        step=step,
        cfg_branch=cfg_branch,
        model_name=model_name,
        overwrite=overwrite,
    )


# ---- reading ------------------------------------------------------------------------------------


@checked_arguments
@dataclass
class Dump:
    """A validated dump directory: manifest entries and a tensor loader."""

    directory: Path
    manifest: dict[str, Any]
    unlisted: dict[str, list[str]] = field(default_factory=dict)
    """File -> tensor keys it holds that no manifest entry names (dropped entries)."""

    @property
    def module_names(self) -> list[str]:
        """Every named_modules() path of the dumped model."""
        return list(self.manifest["module_names"])

    @checked_arguments
    def forward_record(self, forward: int) -> dict[str, Any] | None:
        """The manifest's record of one forward (its input fingerprints); None in schema 1."""
        return next((f for f in self.manifest.get("forwards", []) if f["forward"] == forward), None)

    @checked_arguments
    def weights_of(self, forward: int) -> tuple[dict[str, Any] | None, str | None]:
        """The weight fingerprints `forward` ran with, or (None, why they are unknown)."""
        record = self.forward_record(forward) or {}
        if record.get("weights_unavailable"):
            return None, str(record["weights_unavailable"])
        if record.get("weights") is not None:
            return record["weights"], None
        weights = self.manifest.get("weights")
        return weights, None if weights is not None else self.manifest.get("weights_unavailable")

    @checked_arguments
    def entries(self, step: int | None = None, cfg_branch: str | None = None) -> list[dict]:
        """Entries of the first forward matching `step` / `cfg_branch` (None = any).

        Raises:
            DumpError: No forward matches, listing the (step, cfg_branch) pairs there are.
        """
        chosen = [
            e
            for e in self.manifest["entries"]
            if (step is None or e["step"] == step)
            and (cfg_branch is None or e["cfg_branch"] == cfg_branch)
        ]
        if not chosen:
            have = sorted({(e["step"], e["cfg_branch"]) for e in self.manifest["entries"]})
            raise DumpError(
                f"dump {str(self.directory)!r}: no forward with step={step!r}, "
                f"cfg_branch={cfg_branch!r}. Have (step, cfg_branch): {have}."
            )
        first = chosen[0]["forward"]
        return [e for e in chosen if e["forward"] == first]

    @checked_arguments
    def tensors(self, entries: list[dict]) -> dict[str, torch.Tensor]:
        """Load the tensors of `entries`, keyed by entry key, complex ones restored.

        Raises:
            DumpError: A file that cannot be read (truncated or corrupt), naming it.
        """
        out: dict[str, torch.Tensor] = {}
        files: dict[str, dict[str, torch.Tensor]] = {}
        for e in entries:
            if e["file"] not in files:
                files[e["file"]] = _read_forward_file(self.directory, e["file"])
            t = files[e["file"]][e["key"]]
            out[e["key"]] = torch.view_as_complex(t) if e["complex"] else t
        return out


_ENTRY_KINDS: dict[str, type | tuple[type, ...]] = {
    "order": int, "module": str, "call": int, "output": str, "step": int, "cfg_branch": str,
    "forward": int, "dtype": str, "shape": list, "file": str, "key": str, "complex": bool,
}  # fmt: skip


@checked_arguments
def load_dump(directory: str | Path) -> Dump:
    """Read and check a dump: every manifest entry must exist in its file with its dtype/shape.

    Raises:
        DumpError: Missing, empty, truncated or non-JSON manifest; another schema; entries with
            missing or mistyped fields; a `file` outside the dump directory; a truncated or
            corrupt forward file (named); or entries that disagree with the files (listing
            each: missing file, missing key, dtype or shape differs).
    """
    from safetensors import safe_open

    directory = Path(directory)
    manifest = _read_manifest(directory)
    problems: list[str] = []
    by_file: dict[str, list[dict]] = {}
    for e in manifest["entries"]:
        by_file.setdefault(e["file"], []).append(e)
    unlisted: dict[str, list[str]] = {}
    for file, entries in by_file.items():
        if not (directory / file).is_file():
            problems.append(f"{file}: file missing ({len(entries)} entries point to it)")
            continue
        try:
            with safe_open(str(directory / file), framework="pt") as f:
                keys = set(f.keys())
                for e in entries:
                    if e["key"] not in keys:
                        problems.append(f"{e['key']}: not in {file}")
                        continue
                    t = f.get_tensor(e["key"])
                    shape = list(t.shape[:-1]) if e["complex"] else list(t.shape)
                    dtype = dtype_name(torch.view_as_complex(t).dtype if e["complex"] else t.dtype)
                    if shape != e["shape"] or dtype != e["dtype"]:
                        problems.append(
                            f"{e['key']}: manifest says {e['dtype']} {e['shape']}, "
                            f"{file} holds {dtype} {shape}"
                        )
        except DumpError:
            raise
        except Exception as err:  # safetensors' SafetensorError for a torn header or body
            raise _torn_file(directory, file, err) from None
        listed = {e["key"] for e in entries}
        extra = sorted(keys - listed)
        if extra:
            unlisted[file] = extra
    if problems:
        shown = "; ".join(problems[:8])
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise DumpError(
            f"dump {str(directory)!r}: manifest and files disagree in {len(problems)} "
            f"place(s): {shown}{more}."
        )
    return Dump(directory, manifest, unlisted)


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    where = f"dump {str(directory)!r}"
    if not path.is_file():
        raise DumpError(f"{where} has no {MANIFEST}; was it written by lab.engine.dump.attach?")
    raw = path.read_bytes()
    if not raw.strip():
        raise DumpError(f"{where}: {MANIFEST} is empty ({len(raw)} bytes): it was never written.")
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DumpError(
            f"{where}: {MANIFEST} is not valid JSON ({err}); it is truncated or not a manifest."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("schema") not in SCHEMAS_READ:
        schema = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise DumpError(f"{where}: schema {schema!r} is not one of {SCHEMAS_READ}.")
    problems: list[str] = []
    if not isinstance(manifest.get("module_names"), list):
        problems.append("module_names: missing or not a list")
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        problems.append("entries: missing or not a list")
        entries = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            problems.append(f"entries[{i}]: not an object")
            continue
        for key, kind in _ENTRY_KINDS.items():
            value = e.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                problems.append(f"entries[{i}].{key}: expected {kind.__name__}, got {value!r:.40}")
        if isinstance(e.get("file"), str) and not _inside(directory, e["file"]):
            problems.append(
                f"entries[{i}].file {e['file']!r} points outside the dump directory "
                "(only file names inside it are allowed)"
            )
    problems += _duplicate_problems(manifest, entries)
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise DumpError(
            f"{where}: {MANIFEST} is malformed in {len(problems)} place(s): "
            f"{'; '.join(problems[:6])}{more}."
        )
    return manifest


def _duplicate_problems(manifest: dict[str, Any], entries: list[Any]) -> list[str]:
    """What a manifest lists twice, and entries of a forward no record lists.

    Twice: an entry (its key in its file, or its output in its forward), a forward record, a
    module name. Each would pair as a second row of the same output.
    """
    problems: list[str] = []
    well_typed = [
        (i, e)
        for i, e in enumerate(entries)
        if isinstance(e, dict)
        and all(
            isinstance(e.get(k), t) and not (t is int and isinstance(e.get(k), bool))
            for k, t in _ENTRY_KINDS.items()
        )
    ]
    first_key: dict[tuple[str, str], int] = {}
    first_output: dict[tuple[int, str, int, str], int] = {}
    for i, e in well_typed:
        key, output = (e["file"], e["key"]), (e["forward"], e["module"], e["call"], e["output"])
        if key in first_key:
            problems.append(
                f"entries[{i}]: a second entry for {e['key']!r} in {e['file']} (first: "
                f"entries[{first_key[key]}]); each output is listed once"
            )
        elif output in first_output:
            problems.append(
                f"entries[{i}]: a second entry for forward {e['forward']}'s "
                f"{e['module']}#{e['call']}:{e['output']} (first: entries[{first_output[output]}])"
            )
        first_key.setdefault(key, i)
        first_output.setdefault(output, i)
    names = manifest.get("module_names")
    if isinstance(names, list):
        twice = sorted({n for n in names if names.count(n) > 1}, key=str)
        if twice:
            problems.append(f"module_names: listed twice: {twice[:5]}")
    records = manifest.get("forwards")
    if manifest.get("schema") != SCHEMAS_READ[0] and records is not None:
        if not isinstance(records, list) or not all(
            isinstance(r, dict) and isinstance(r.get("forward"), int) for r in records
        ):
            return [*problems, "forwards: expected a list of forward records with a 'forward'"]
        numbers = [r["forward"] for r in records]
        twice = sorted({n for n in numbers if numbers.count(n) > 1})
        if twice:
            problems.append(f"forwards: forward(s) {twice[:5]} recorded twice")
        files = {r["forward"]: r.get("file") for r in records}
        for i, e in well_typed:
            if e["forward"] not in files:
                problems.append(f"entries[{i}]: forward {e['forward']} has no forward record")
            elif files[e["forward"]] != e["file"]:
                problems.append(
                    f"entries[{i}]: file {e['file']!r}, but forward {e['forward']} was written "
                    f"to {files[e['forward']]!r}"
                )
    return problems


def _inside(directory: Path, file: str) -> bool:
    """A relative name without '..' that resolves inside `directory` (symlinks followed)."""
    rel = Path(file)
    if rel.is_absolute() or rel.drive or ".." in rel.parts or not rel.parts:
        return False
    root = directory.resolve()
    return (root / rel).resolve().is_relative_to(root)


def _read_forward_file(directory: Path, file: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(directory / file))
    except Exception as err:  # safetensors' SafetensorError for a torn header or body
        raise _torn_file(directory, file, err) from None


def _torn_file(directory: Path, file: str, err: BaseException) -> DumpError:
    size = (directory / file).stat().st_size
    return DumpError(
        f"dump {str(directory)!r}: {file} ({size} bytes) cannot be read: {err}. It is truncated "
        "or corrupt (was the writer killed or the disk full?); dump that forward again."
    )


def _check_same_model(names_a: list[str], names_b: list[str], what_a: str, what_b: str) -> None:
    only_a = [n for n in names_a if n not in set(names_b)]
    only_b = [n for n in names_b if n not in set(names_a)]
    if only_a or only_b:
        raise DumpError(
            f"pair: module trees differ. Only in {what_a} ({len(only_a)}): "
            f"{', '.join(repr(n) for n in only_a[:5])}{' ...' if len(only_a) > 5 else ''}. "
            f"Only in {what_b} ({len(only_b)}): "
            f"{', '.join(repr(n) for n in only_b[:5])}{' ...' if len(only_b) > 5 else ''}. "
            "Was the dump written from the same model class and config?"
        )


# ---- provenance ---------------------------------------------------------------------------------


@dataclass
class _Provenance:
    """What the weight and input fingerprints of two sides say, shape problems first."""

    shapes: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    def add(self, what: str, a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> None:
        """Compare two maps name -> fingerprint; `what` is "weights" or "inputs"."""
        if a is None or b is None:
            return
        for name in [n for n in a if n in b]:
            diff = fingerprints_differ(a[name], b[name])
            if diff is None:
                if _uncomparable(a[name], b[name]):
                    pair = f"{a[name]['dtype']} vs {b[name]['dtype']}"
                    self.unchecked.append(f"{what} {name!r}: {pair} share no dtype to compare")
                continue
            (self.shapes if diff.startswith("shape") else self.values).append(
                f"{what} {name!r}: {diff}"
            )
        for name in [n for n in a if n not in b] + [n for n in b if n not in a]:
            if what == "weights":
                self.shapes.append(f"weights {name!r}: a parameter of one side only")
            else:
                self.unchecked.append(f"inputs {name!r}: given on one side only")

    def summary(self, what: str) -> str:
        """The meta verdict for "weights" or "inputs": "match" or "differ (n)"."""
        mine = [p for p in self.shapes + self.values if p.startswith(what)]
        return f"differ ({len(mine)})" if mine else "match"

    def problems(self) -> list[str]:
        """Shape problems, then value problems."""
        return self.shapes + self.values


def _provenance(
    weights_a: Mapping[str, Any] | None,
    weights_b: Mapping[str, Any] | None,
    inputs_a: Mapping[str, Any] | None,
    inputs_b: Mapping[str, Any] | None,
    why_unchecked: list[str],
) -> tuple[_Provenance, dict[str, Any]]:
    prov = _Provenance(unchecked=list(why_unchecked))
    pa = weights_a["parameters"] if weights_a else None
    pb = weights_b["parameters"] if weights_b else None
    prov.add("weights", pa, pb)
    prov.add("inputs", inputs_a, inputs_b)
    have_inputs = inputs_a is not None and inputs_b is not None
    checks = {
        "weights": prov.summary("weights") if pa is not None and pb is not None else "unchecked",
        "inputs": prov.summary("inputs") if have_inputs else "unchecked",
        "unchecked": prov.unchecked,
    }
    return prov, checks


def _refuse_or_flag(
    prov: _Provenance, what_a: str, what_b: str, allow_mismatch: bool, where: str
) -> list[str]:
    """Raise on weights/inputs/shape mismatches, or (allow_mismatch) warn and return them."""
    problems = prov.problems()
    if not problems:
        return []
    more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
    kind = "a model of another width or config" if prov.shapes else "other weights or inputs"
    message = (
        f"{where}: {what_a} and {what_b} come from {kind}: {len(problems)} difference(s), "
        f"shapes first: {'; '.join(problems[:6])}{more}."
    )
    if not allow_mismatch:
        raise DumpError(
            f"{message} Pair a dump with the model and inputs that wrote it, or pass "
            "allow_mismatch=True to compare anyway (flagged in result.meta['dump_mismatch'])."
        )
    warnings.warn(f"{message} Compared anyway (allow_mismatch=True).", stacklevel=3)
    return problems


# ---- pairing ------------------------------------------------------------------------------------


def _parse_key(key: str) -> tuple[str, int, str]:
    """`<module>#<call>:<output>` -> (module, call, output)."""
    module, rest = key.rsplit("#", 1)
    call, output = rest.split(":", 1)
    return module, int(call), output


def _compare(
    entries: list[dict],
    tensors_a: dict[str, torch.Tensor],
    tensors_b: dict[str, torch.Tensor],
    classes: dict[str, str],
    *,
    what_a: str,
    what_b: str,
    unlisted: Mapping[str, str] | None = None,
) -> tuple[list[LayerDivergence], list[Skipped], list[str]]:
    """Pair the reference's entries with the candidate's tensors; every unpaired output skipped.

    Returns:
        (rows, skipped, shape problems). When any paired output differs in shape the models
        differ, and no value is compared: every pair is skipped, shape mismatches first.
    """
    unlisted = dict(unlisted or {})
    shape_skips, other_skips, comparable = [], [], []
    for e in entries:
        a, b = tensors_a.get(e["key"]), tensors_b.get(e["key"])
        if b is None:
            reason = unlisted.pop(e["key"], f"only in {what_a}: not in {what_b}")
            other_skips.append(Skipped(e["module"], e["call"], e["output"], reason))
            continue
        if tuple(a.shape) != tuple(b.shape):
            reason = f"shape differs: {tuple(a.shape)} in {what_a} vs {tuple(b.shape)} in {what_b}"
            shape_skips.append(Skipped(e["module"], e["call"], e["output"], reason))
            continue
        comparable.append((e, a, b))
    listed = {e["key"] for e in entries}
    for key in tensors_b:
        if key not in listed:
            module, call, output = _parse_key(key)
            reason = unlisted.pop(key, f"only in {what_b}: not in {what_a}")
            other_skips.append(Skipped(module, call, output, reason))
    for key, reason in unlisted.items():
        if key not in listed:
            module, call, output = _parse_key(key)
            other_skips.append(Skipped(module, call, output, reason))
    shape_problems = [f"{s.module}#{s.call}:{s.output}: {s.reason}" for s in shape_skips]
    rows = []
    for e, a, b in comparable:
        if shape_skips:
            first = shape_skips[0]
            reason = (
                f"not compared: {len(shape_skips)} output(s) differ in shape (first "
                f"{first.module!r}), so the two models differ and their values cannot be paired"
            )
            other_skips.append(Skipped(e["module"], e["call"], e["output"], reason))
            continue
        if a.is_complex() and b.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        if not (a.is_floating_point() and b.is_floating_point()):
            reason = f"not comparable: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
            other_skips.append(Skipped(e["module"], e["call"], e["output"], reason))
            continue
        b = b.to(a.device)
        stats, hist = pair_stats(a, b)
        rows.append(
            LayerDivergence(
                order=e["order"],
                module=e["module"],
                call=e["call"],
                output=e["output"],
                module_class=classes.get(e["module"], "?"),
                dtype_a=dtype_name(a.dtype),
                dtype_b=dtype_name(b.dtype),
                shape=tuple(a.shape),
                metrics=decode_stats(stats.cpu(), hist.cpu(), a.dtype, b.dtype),
            )
        )
    return sorted(rows, key=lambda r: r.order), shape_skips + other_skips, shape_problems


def _unlisted_reasons(dump: Dump, entries: list[dict], what: str) -> dict[str, str]:
    files = {e["file"] for e in entries}
    return {
        key: f"in {what}'s {file} but not in its manifest (a dropped entry)"
        for file in sorted(files)
        for key in dump.unlisted.get(file, [])
    }


def _live_capture(model: torch.nn.Module, inputs: Any, side: Any) -> dict[str, torch.Tensor]:
    from lab.pairing.capture import ModuleHooks
    from lab.pairing.guards import model_in_use
    from lab.pairing.run import model_device
    from lab.pairing.side_context import check_side_device, side_context, side_inputs
    from lab.pairing.weights import WeightView

    device = model_device(model)
    check_side_device(side, device, model)
    cast = side_inputs(inputs, side, device)
    captured: dict[str, torch.Tensor] = {}

    def on_output(label: str, call: int, module: Any, args: Any, kwargs: Any, out: Any) -> None:
        for idx, leaf in flatten_output(out):
            if isinstance(leaf, torch.Tensor):
                captured[f"{label}#{call}:{idx}"] = leaf.detach().clone()

    was_training = model.training
    model.eval()
    try:
        with (
            model_in_use(model, "pair_dump"),
            torch.no_grad(),
            ModuleHooks(model, on_output).attached(),
            WeightView(model, side).applied(),
            side_context(side, device, model),
        ):
            model(**cast.kwargs)
    finally:
        model.train(was_training)
    return captured


def _schema_note(dump: Dump, what: str, weights_why: str | None) -> list[str]:
    schema = dump.manifest.get("schema")
    if schema not in (SCHEMA, SCHEMA_ATTACH_WEIGHTS):
        return [f"{what} was written before fingerprints ({schema})"]
    notes = [f"{what}'s weights: {weights_why}"] if weights_why else []
    if schema == SCHEMA_ATTACH_WEIGHTS and not weights_why:
        notes.append(
            f"{what} ({schema}) fingerprinted its weights when attach was called, not when the "
            "forward ran: weights changed in between would not show"
        )
    return notes


@checked_arguments
def pair_dump(
    directory: str | Path,
    model: torch.nn.Module,
    inputs: Any,
    side: Any,
    *,
    step: int | None = None,
    cfg_branch: str | None = None,
    dump_name: str = "dump",
    allow_mismatch: bool = False,
) -> Result:
    """Pair a dumped forward (the reference) against a live side's forward (the candidate).

    Before any forward runs, the dump's fingerprints are checked against `model`'s parameters
    and `inputs` (compared in the dump's dtypes: a bf16 engine dump matches the fp32 master it
    was cast from); shape differences are listed first.

    Args:
        directory: A dump written by `attach`.
        model: The fp32 master model the live side runs (same class and config as the dump).
        inputs: The inputs the dumped forward saw, tagged by role (the live side applies its
            own input_dtype_policy).
        side: The live candidate Side.
        step: Which dumped step (None = the first forward).
        cfg_branch: Which dumped CFG branch (None = any).
        dump_name: Name of the reference side in the Result.
        allow_mismatch: Pair even when weights, inputs or output shapes differ; the differences
            go to `result.meta["dump_mismatch"]` and a warning is issued.

    Returns:
        A propagated-mode Result, rows in the dump's completion order; every output of either
        side that could not be paired is a Skipped with its reason; `meta["dump_checks"]` says
        what the fingerprints showed.

    Raises:
        DumpError: A bad dump, no matching forward, a model whose module names differ, or
            (unless allow_mismatch) a dump of other weights, other inputs or another width.
    """
    from lab.pairing.guards import model_in_use

    dump = load_dump(directory)
    _check_same_model(
        dump.module_names, [n or ROOT for n, _ in model.named_modules()], "the dump", "the model"
    )
    # Held before the master is checked: while another thread's side has the weights swapped,
    # its casts would read as a bf16 master; that call is refused as in use instead.
    with model_in_use(model, "pair_dump"):
        return _pair_dump_held(
            dump, directory, model, inputs, side, step, cfg_branch, dump_name, allow_mismatch
        )


def _pair_dump_held(
    dump: Dump,
    directory: str | Path,
    model: torch.nn.Module,
    inputs: Any,
    side: Any,
    step: int | None,
    cfg_branch: str | None,
    dump_name: str,
    allow_mismatch: bool,
) -> Result:
    """`pair_dump` once `model` is held (`model_in_use`) and the dump read."""
    from lab.pairing.guards import check_fp32_master

    check_fp32_master(model, "pair_dump")
    entries = dump.entries(step, cfg_branch)
    record = dump.forward_record(entries[0]["forward"])
    dump_weights, dump_why = dump.weights_of(entries[0]["forward"])
    live_weights, why = weight_fingerprints(model) if dump_weights else (None, "")
    kwargs = inputs.kwargs if hasattr(inputs, "kwargs") else dict(inputs)
    live_inputs = input_fingerprints(kwargs)
    if record and record["inputs"] and hasattr(inputs, "kwargs"):
        live_inputs = _as_switches_derive(live_inputs, record["inputs"], inputs)
    prov, checks = _provenance(
        dump_weights,
        live_weights,
        record["inputs"] if record else None,
        live_inputs,
        _schema_note(dump, "the dump", dump_why) + ([f"the model's weights: {why}"] if why else []),
    )
    what_a, what_b = f"the dump ({dump_name})", f"the live side ({side.name})"
    mismatch = _refuse_or_flag(
        prov, "the dump", "the model and inputs", allow_mismatch, "pair_dump"
    )
    live = _live_capture(model, inputs, side)
    classes = {(n or ROOT): type(m).__name__ for n, m in model.named_modules()}
    rows, skipped, shape_problems = _compare(
        entries,
        dump.tensors(entries),
        live,
        classes,
        what_a=what_a,
        what_b=what_b,
        unlisted=_unlisted_reasons(dump, entries, "the dump"),
    )
    mismatch = _refuse_shapes(shape_problems, mismatch, allow_mismatch, "pair_dump")
    meta = {"dump_a": str(directory), "step": step, "cfg_branch": cfg_branch, "dump_checks": checks}
    if mismatch:
        meta["dump_mismatch"] = mismatch
    return Result(
        "propagated",
        {"name": dump_name, "dump": str(directory)},
        side.to_dict(),
        rows,
        skipped,
        meta,
    )


def _as_switches_derive(
    live: Mapping[str, Any], dumped: Mapping[str, Any], inputs: Any
) -> dict[str, Any]:
    """Check a dumped input against what an input-level op switch derives from `inputs`.

    Only where the raw input differs and the derived form matches: the dumped side ran that
    switch (the scheduler's timestep, a dropped identity mask).
    """
    from lab.precision.engine_ops import switch_derived_inputs

    out = dict(live)
    for derived in switch_derived_inputs(inputs):
        for name, fingerprint in input_fingerprints(derived.kwargs).items():
            if name not in dumped or name not in out:
                continue
            if fingerprints_differ(dumped[name], out[name]) is None:
                continue
            if fingerprints_differ(dumped[name], fingerprint) is None:
                out[name] = fingerprint
    return out


def _refuse_shapes(
    shape_problems: list[str], mismatch: list[str], allow_mismatch: bool, where: str
) -> list[str]:
    """Output shapes that differ (not caught by fingerprints, e.g. a schema 1 dump)."""
    if not shape_problems or any(p.startswith("weights") for p in mismatch):
        return mismatch + [p for p in shape_problems if p not in mismatch]
    prov = _Provenance(shapes=[f"output {p}" for p in shape_problems])
    return mismatch + _refuse_or_flag(prov, "the two sides", "each other", allow_mismatch, where)


@checked_arguments
def pair_dumps(
    directory_a: str | Path,
    directory_b: str | Path,
    *,
    step: int | None = None,
    cfg_branch: str | None = None,
    allow_mismatch: bool = False,
) -> Result:
    """Pair two dumps of the same model (the first is the reference).

    Both dumps' weight and input fingerprints must agree on every dtype both recorded (an fp32
    trainer dump matches a bf16 engine dump whose weights round from it).

    Args:
        directory_a: The reference dump.
        directory_b: The candidate dump.
        step: Which dumped step (None = the first forward).
        cfg_branch: Which CFG branch (None = any).
        allow_mismatch: Pair even when weights, inputs or shapes differ; flagged in
            `result.meta["dump_mismatch"]` with a warning.

    Raises:
        DumpError: A bad dump, no matching forward, module trees that differ, or (unless
            allow_mismatch) dumps of other weights, inputs or widths.
    """
    a, b = load_dump(directory_a), load_dump(directory_b)
    _check_same_model(a.module_names, b.module_names, "dump A", "dump B")
    entries_a, entries_b = a.entries(step, cfg_branch), b.entries(step, cfg_branch)
    record_a = a.forward_record(entries_a[0]["forward"])
    record_b = b.forward_record(entries_b[0]["forward"])
    weights_a, why_a = a.weights_of(entries_a[0]["forward"])
    weights_b, why_b = b.weights_of(entries_b[0]["forward"])
    prov, checks = _provenance(
        weights_a,
        weights_b,
        record_a["inputs"] if record_a else None,
        record_b["inputs"] if record_b else None,
        _schema_note(a, "dump A", why_a) + _schema_note(b, "dump B", why_b),
    )
    mismatch = _refuse_or_flag(prov, "dump A", "dump B", allow_mismatch, "pair_dumps")
    tensors_b = b.tensors(entries_b)
    unlisted = {
        **_unlisted_reasons(a, entries_a, "dump A"),
        **_unlisted_reasons(b, entries_b, "dump B"),
    }
    rows, skipped, shape_problems = _compare(
        entries_a,
        a.tensors(entries_a),
        tensors_b,
        {},
        what_a="dump A",
        what_b="dump B",
        unlisted=unlisted,
    )
    mismatch = _refuse_shapes(shape_problems, mismatch, allow_mismatch, "pair_dumps")
    meta = {"dump_a": str(directory_a), "dump_b": str(directory_b), "step": step}
    meta["dump_checks"] = checks
    if mismatch:
        meta["dump_mismatch"] = mismatch
    return Result(
        "propagated",
        {"name": "dump_a", "dump": str(directory_a)},
        {"name": "dump_b", "dump": str(directory_b)},
        rows,
        skipped,
        meta,
    )

"""Real-engine dumps: module outputs written from any process, paired like a live side.

Format (one directory): `forward_<n>.safetensors` per root forward, holding every captured output
tensor under the key `<module>#<call>:<output>`, plus `manifest.json`:

    {"schema": "precision-lab/dump/1", "model_class": ..., "module_names": [...],
     "entries": [{"order", "module", "call", "output", "step", "cfg_branch", "forward",
                  "dtype", "shape", "file", "key", "complex"}, ...]}

Module names are exact `named_modules()` paths (`<root>` for the model), calls count per root
forward, and `step` / `cfg_branch` are whatever the caller set on the handle. `attach` needs only
torch and safetensors at run time, so it can be installed inside an engine process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lab.capture import ROOT, flatten_output
from lab.metrics import decode_stats, pair_stats
from lab.precision.dtypes import dtype_name
from lab.result import LayerDivergence, Result, Skipped

SCHEMA = "precision-lab/dump/1"
MANIFEST = "manifest.json"


class DumpError(ValueError):
    """A dump directory that cannot be read or paired, with what disagrees."""


class DumpHandle:
    """Hooks that write every module output of every root forward to a dump directory.

    Set `step` / `cfg_branch` between forwards (`handle.set(step=3, cfg_branch="uncond")`);
    `detach()` (or leaving the `with` block) removes the hooks and writes the manifest.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        directory: str | Path,
        *,
        step: int = 0,
        cfg_branch: str = "cond",
        model_name: str | None = None,
    ) -> None:
        self.model = model
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.step = step
        self.cfg_branch = cfg_branch
        self.model_name = model_name or type(model).__name__
        self.entries: list[dict[str, Any]] = []
        self.forwards = 0
        self._calls: dict[str, int] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            label = name or ROOT
            self._handles.append(module.register_forward_hook(self._record(label)))
        self._handles.insert(0, model.register_forward_pre_hook(self._start))
        self._handles.append(model.register_forward_hook(self._flush))

    def set(self, *, step: int | None = None, cfg_branch: str | None = None) -> None:
        """Label the next forwards with this denoising step and CFG branch."""
        if step is not None:
            self.step = step
        if cfg_branch is not None:
            self.cfg_branch = cfg_branch

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self._calls, self._tensors = {}, {}

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
                self.entries.append(
                    {
                        "order": len(self.entries),
                        "module": label,
                        "call": call,
                        "output": idx,
                        "step": self.step,
                        "cfg_branch": self.cfg_branch,
                        "forward": self.forwards,
                        "dtype": _dtype_label(leaf.dtype),
                        "shape": list(leaf.shape),
                        "file": f"forward_{self.forwards:05d}.safetensors",
                        "key": key,
                        "complex": is_complex,
                    }
                )

        return hook

    def _flush(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        from safetensors.torch import save_file

        save_file(self._tensors, str(self.directory / f"forward_{self.forwards:05d}.safetensors"))
        self._tensors = {}
        self.forwards += 1
        self.write_manifest()

    def write_manifest(self) -> Path:
        """Write manifest.json for the forwards so far; returns its path."""
        path = self.directory / MANIFEST
        doc = {
            "schema": SCHEMA,
            "model_class": type(self.model).__name__,
            "model_name": self.model_name,
            "module_names": [n or ROOT for n, _ in self.model.named_modules()],
            "torch": torch.__version__,
            "entries": self.entries,
        }
        path.write_text(json.dumps(doc, indent=1))
        return path

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


def attach(
    module: torch.nn.Module,
    directory: str | Path,
    *,
    step: int = 0,
    cfg_branch: str = "cond",
    model_name: str | None = None,
) -> DumpHandle:
    """Start dumping every module output of `module`'s forwards into `directory`.

    Args:
        module: Any torch module (a diffusers DiT inside an engine process, a lab model).
        directory: Created if missing; one safetensors file per root forward plus manifest.json.
        step: Denoising step label for the next forwards (change with `handle.set`).
        cfg_branch: CFG branch label, e.g. "cond" / "uncond".
        model_name: Free-form name stored in the manifest (default: the class name).

    Returns:
        The DumpHandle; use it as a context manager or call `detach()`.
    """
    return DumpHandle(module, directory, step=step, cfg_branch=cfg_branch, model_name=model_name)


# ---- reading ------------------------------------------------------------------------------------


@dataclass
class Dump:
    """A validated dump directory: manifest entries and a tensor loader."""

    directory: Path
    manifest: dict[str, Any]

    @property
    def module_names(self) -> list[str]:
        """Every named_modules() path of the dumped model."""
        return list(self.manifest["module_names"])

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

    def tensors(self, entries: list[dict]) -> dict[str, torch.Tensor]:
        """Load the tensors of `entries`, keyed by entry key, complex ones restored."""
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        files: dict[str, dict[str, torch.Tensor]] = {}
        for e in entries:
            if e["file"] not in files:
                files[e["file"]] = load_file(str(self.directory / e["file"]))
            t = files[e["file"]][e["key"]]
            out[e["key"]] = torch.view_as_complex(t) if e["complex"] else t
        return out


def load_dump(directory: str | Path) -> Dump:
    """Read and check a dump: every manifest entry must exist in its file with its dtype/shape.

    Raises:
        DumpError: Missing manifest, another schema, or entries that disagree with the files
            (listing each: missing file, missing key, dtype or shape differs).
    """
    from safetensors import safe_open

    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise DumpError(
            f"dump {str(directory)!r} has no {MANIFEST}; was it written by lab.dump.attach?"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("schema") != SCHEMA:
        raise DumpError(
            f"dump {str(directory)!r}: schema {manifest.get('schema')!r} is not {SCHEMA!r}."
        )
    problems: list[str] = []
    by_file: dict[str, list[dict]] = {}
    for e in manifest["entries"]:
        by_file.setdefault(e["file"], []).append(e)
    for file, entries in by_file.items():
        if not (directory / file).is_file():
            problems.append(f"{file}: file missing ({len(entries)} entries point to it)")
            continue
        with safe_open(str(directory / file), framework="pt") as f:
            keys = set(f.keys())
            for e in entries:
                if e["key"] not in keys:
                    problems.append(f"{e['key']}: not in {file}")
                    continue
                t = f.get_tensor(e["key"])
                shape = list(t.shape[:-1]) if e["complex"] else list(t.shape)
                dtype = _dtype_label(torch.view_as_complex(t).dtype if e["complex"] else t.dtype)
                if shape != e["shape"] or dtype != e["dtype"]:
                    problems.append(
                        f"{e['key']}: manifest says {e['dtype']} {e['shape']}, "
                        f"{file} holds {dtype} {shape}"
                    )
    if problems:
        shown = "; ".join(problems[:8])
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise DumpError(
            f"dump {str(directory)!r}: manifest and files disagree in {len(problems)} "
            f"place(s): {shown}{more}."
        )
    return Dump(directory, manifest)


def _dtype_label(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except (KeyError, ValueError):
        return str(dtype).removeprefix("torch.")


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


# ---- pairing ------------------------------------------------------------------------------------


def _compare(
    entries: list[dict],
    tensors_a: dict[str, torch.Tensor],
    tensors_b: dict[str, torch.Tensor],
    classes: dict[str, str],
) -> tuple[list[LayerDivergence], list[Skipped]]:
    rows, skipped = [], []
    for e in entries:
        a, b = tensors_a.get(e["key"]), tensors_b.get(e["key"])
        if a is None or b is None:
            where = "the reference" if a is None else "the candidate"
            skipped.append(Skipped(e["module"], e["call"], e["output"], f"missing in {where}"))
            continue
        if a.is_complex() and b.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        if not (a.is_floating_point() and b.is_floating_point()) or a.shape != b.shape:
            reason = f"not comparable: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
            skipped.append(Skipped(e["module"], e["call"], e["output"], reason))
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
    return sorted(rows, key=lambda r: r.order), skipped


def _live_capture(model: torch.nn.Module, inputs: Any, side: Any) -> dict[str, torch.Tensor]:
    from lab.capture import ModuleHooks
    from lab.run import check_side_device, model_device, side_context, side_inputs
    from lab.weights import WeightView

    device = model_device(model)
    check_side_device(side, device)
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
            torch.no_grad(),
            ModuleHooks(model, on_output).attached(),
            WeightView(model, side).applied(),
            side_context(side, device, model),
        ):
            model(**cast.kwargs)
    finally:
        model.train(was_training)
    return captured


def pair_dump(
    directory: str | Path,
    model: torch.nn.Module,
    inputs: Any,
    side: Any,
    *,
    step: int | None = None,
    cfg_branch: str | None = None,
    dump_name: str = "dump",
) -> Result:
    """Pair a dumped forward (the reference) against a live side's forward (the candidate).

    Args:
        directory: A dump written by `attach`.
        model: The fp32 master model the live side runs (same class and config as the dump).
        inputs: The inputs the dumped forward saw, tagged by role (the live side applies its
            own input_dtype_policy).
        side: The live candidate Side.
        step: Which dumped step (None = the first forward).
        cfg_branch: Which dumped CFG branch (None = any).
        dump_name: Name of the reference side in the Result.

    Returns:
        A propagated-mode Result, rows in the dump's completion order.

    Raises:
        DumpError: A bad dump, no matching forward, or a model whose module names differ.
    """
    dump = load_dump(directory)
    _check_same_model(
        dump.module_names, [n or ROOT for n, _ in model.named_modules()], "the dump", "the model"
    )
    entries = dump.entries(step, cfg_branch)
    live = _live_capture(model, inputs, side)
    classes = {(n or ROOT): type(m).__name__ for n, m in model.named_modules()}
    rows, skipped = _compare(entries, dump.tensors(entries), live, classes)
    return Result(
        "propagated",
        {"name": dump_name, "dump": str(directory)},
        side.to_dict(),
        rows,
        skipped,
        {"dump_a": str(directory), "step": step, "cfg_branch": cfg_branch},
    )


def pair_dumps(
    directory_a: str | Path,
    directory_b: str | Path,
    *,
    step: int | None = None,
    cfg_branch: str | None = None,
) -> Result:
    """Pair two dumps of the same model (the first is the reference).

    Raises:
        DumpError: A bad dump, no matching forward, or module trees that differ.
    """
    a, b = load_dump(directory_a), load_dump(directory_b)
    _check_same_model(a.module_names, b.module_names, "dump A", "dump B")
    entries_a, entries_b = a.entries(step, cfg_branch), b.entries(step, cfg_branch)
    tensors_b = b.tensors(entries_b)
    rows, skipped = _compare(entries_a, a.tensors(entries_a), tensors_b, {})
    return Result(
        "propagated",
        {"name": "dump_a", "dump": str(directory_a)},
        {"name": "dump_b", "dump": str(directory_b)},
        rows,
        skipped,
        {"dump_a": str(directory_a), "dump_b": str(directory_b), "step": step},
    )

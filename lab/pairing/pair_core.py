"""The lockstep pair's per-output path in C++ (`_pair_core.cpp`), built against torch's headers.

A lockstep pair reports every captured module call to `_Lockstep._on_output` (sd3 full: 2434 a
pair), which names the output's tensors, records the call's input dtypes for `lab.why`, parks
the output or pairs it with the other side's and queues the pair's metric batch. In Python that
is ~10-20 us a call of dict lookups, tuple building and tensor attribute reads through the
binding layer; at sd3 full's 0.14 s of host-bound plain forwards it is most of what pairing every
module costs. `_pair_core.Lockstep` does the same on the same Python objects (the step's dicts,
the `Aliases` names, the `FlowRecorder` tables, the `Collector`'s pending list and batches),
reading tensors through `at::Tensor`; `_pair_core.Reporter` is the captured module's instance
forward that calls it. Outputs it does not take (tensor subclasses, nested or mapping outputs,
inference tensors) go to the Python method before any state is touched, so the Result, the
dtype flow and the skips are the same either way (`tests/test_pair_core.py`).

- Built with `$CXX` (default `c++`) into `$LAB_CACHE_DIR` (`cpu_kernel.cache_dir`), named by a
  hash of the source, the flags, torch's and Python's versions; written to a temporary name and
  renamed, so concurrent processes never load half a file. A build takes ~15 s.
- LAB_PAIR_CORE picks the path: "cxx" (the default) or "python". Where "cxx" cannot be built (no
  C++ compiler, no Python headers), the Python path runs, with one warning saying why.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from lab.base.switches import env_choice
from lab.pairing.collect import Aliases, Collector
from lab.pairing.cpu_kernel import cache_dir
from lab.pairing.dtype_flow import FlowRecorder

if TYPE_CHECKING:
    from lab.pairing.lockstep import _Lockstep

SOURCE = Path(__file__).with_name("_pair_core.cpp")
FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-w")
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
""""module": the loaded extension, or "failed": why it could not be built (warned once)."""


def mode() -> str:
    """LAB_PAIR_CORE: "cxx" (default) or "python".

    Raises:
        ValueError: Any other value.
    """
    choices = {
        "cxx": "the per-output path in C++ (built once with the machine's C++ compiler)",
        "python": "the per-output path in Python (`_Lockstep._on_output`)",
    }
    return env_choice("LAB_PAIR_CORE", choices, "cxx")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _command(compiler: str, output: str) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    python_include = sysconfig.get_paths()["include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
        f"-I{python_include}",
        str(SOURCE),
        "-o",
        output,
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch_python",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def build(directory: Path | None = None) -> Path:
    """Compile `_pair_core.cpp` (unless a build of this source, these flags and versions exists).

    Returns:
        The extension's path.

    Raises:
        RuntimeError: No C++ compiler on PATH, no Python headers, or the compiler failed (its
            output quoted).
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(
            "no C++ compiler on PATH (tried $CXX, c++, g++, clang++): install g++, or set "
            "LAB_PAIR_CORE=python"
        )
    python_include = Path(sysconfig.get_paths()["include"])
    if not (python_include / "Python.h").exists():
        raise RuntimeError(
            f"no Python.h in {python_include}: install Python's headers (python3-dev), or set "
            "LAB_PAIR_CORE=python"
        )
    key = " ".join((*_command(compiler, "-"), torch.__version__, sys.version))
    digest = hashlib.sha1(SOURCE.read_bytes() + key.encode()).hexdigest()[:12]
    directory = cache_dir() if directory is None else directory
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = directory / f"pair_core-{digest}-{platform.machine()}{suffix}"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=directory)
    os.close(fd)
    try:
        cmd = _command(compiler, tmp)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[:2000]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ModuleType:
    from lab.pairing import collect, result

    spec = importlib.util.spec_from_file_location("_pair_core", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path}: not loadable as an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.setup(
        torch.Tensor,
        collect._Pending,
        result.Skipped,
        collect._DEFER_NUMEL,
        collect._FLUSH_NUMEL,
        collect._DEVICE_PAIRS,
        collect._DEVICE_BATCH_NUMEL,
    )
    return module


def extension() -> ModuleType | None:
    """The loaded extension, or None when LAB_PAIR_CORE=python or it cannot be built (warned once).

    Raises:
        ValueError: LAB_PAIR_CORE has a value `mode` refuses.
    """
    if mode() == "python":
        return None
    module = _STATE.get("module")
    if module is not None or "failed" in _STATE:
        return module  # type: ignore[return-value]
    with _LOCK:
        if "module" not in _STATE and "failed" not in _STATE:
            try:
                _STATE["module"] = _load(build())
            except (RuntimeError, OSError, ImportError) as err:
                _STATE["failed"] = str(err)
                warnings.warn(
                    f"pair: the C++ pairing path could not be built ({err}); using the Python "
                    "path (slower per captured output, same results).",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return _STATE.get("module")  # type: ignore[return-value]


_STANDS_IN_FOR = {
    (owner, name): getattr(owner, name)
    for owner, names in (
        (Aliases, ("name", "known")),
        (FlowRecorder, ("record", "note_output", "_producer")),
        (Collector, ("compare",)),
    )
    for name in names
}
"""The Python functions `_pair_core.Lockstep` does the work of. A test or bench that replaces
one of them (to count, time or take out what it does) gets the Python path, which calls them."""


def replaced() -> list[str]:
    """The functions of `_STANDS_IN_FOR` something has replaced ("Owner.name" each)."""
    return [
        f"{owner.__name__}.{name}"
        for (owner, name), original in _STANDS_IN_FOR.items()
        if getattr(owner, name) is not original
    ]


def lockstep(step: _Lockstep) -> Any | None:
    """`step._on_output` in C++ for this pair (None: the Python path runs).

    None also where a function it does the work of has been replaced (`replaced`). Call after
    `FlowRecorder.track` (the producers are looked up among the names it tracks).
    """
    ext = extension()
    if ext is None or replaced():
        return None
    flow = step.flow
    tracked = flow._aliases
    state = {
        "collector": step.collector,
        "module_classes": step.collector.module_classes,
        "key_a": "a",
        "key_b": "b",
        "calls_a": step.calls["a"],
        "calls_b": step.calls["b"],
        "held_a": step.held["a"],
        "held_b": step.held["b"],
        "aliases_a": step.aliases["a"],
        "aliases_b": step.aliases["b"],
        "names_a": step.aliases["a"]._names,
        "names_b": step.aliases["b"]._names,
        "reason_a": f"only on side {step.sides['a'].name!r}",
        "reason_b": f"only on side {step.sides['b'].name!r}",
        "parked": step.parked,
        "done": step.done,
        "skip_keys": step.skip_keys,
        "inputs_a": flow.inputs["a"],
        "inputs_b": flow.inputs["b"],
        "produced": flow.produced,
        "bases": flow._bases,
        "flow_names": None if tracked is None else tracked._names,
        "segments": step.segments,
        "budget": step.budget,
    }
    return ext.Lockstep(step, state)

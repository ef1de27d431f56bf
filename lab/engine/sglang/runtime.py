"""The engine's process-wide state on this machine: version gate, 1-process group, server args.

sglang-diffusion's DiT classes expect to live inside its server: a model-parallel group (even
for one process), global server args (read while building attention layers), and a forward
context around each forward. `start_engine()` sets up exactly that, once per process, the way
the engine's own unit tests do (a server-args object holding the engine's dataclass defaults,
with the parallel degrees its `__post_init__` would resolve for one CPU process).

Everything the lab changes in the engine to run it on a CPU is in `cpu_routing.py`, named and
gated on the version below. The lab was written against exactly one engine release: any other
is refused here, before a model is built, rather than paired under semantics nobody checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import socket
import threading
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

SUPPORTED_VERSION = "0.5.23"
"""The sglang release lab.engine.sglang reads and routes (`pip install -e '.[engine]'`)."""

INSTALL_HINT = (
    "Install the engine extra: `bash scripts/install_engine.sh` (pip install -e '.[engine]', "
    f"then sglang=={SUPPORTED_VERSION} with --no-deps: its metadata pins torch 2.14.1, which "
    "would replace the lab's torch 2.11.0)."
)

_LOCK = threading.Lock()
_STARTED: dict[str, Any] = {}


class EngineUnavailable(ImportError):
    """The sglang engine is not installed here, or is another version than the lab reads."""


def engine_version() -> str | None:
    """The installed sglang version, or None when it is not installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_engine(where: str = "lab.engine.sglang") -> str:
    """The installed engine version, when it is the one the lab supports.

    Raises:
        EngineUnavailable: sglang is missing or another version, naming the install command.
    """
    version = engine_version()
    if version is None:
        raise EngineUnavailable(f"{where}: sglang is not installed. {INSTALL_HINT}")
    if version != SUPPORTED_VERSION:
        raise EngineUnavailable(
            f"{where}: sglang {version} is installed; lab.engine.sglang was written and "
            f"checked against sglang {SUPPORTED_VERSION} (its CPU routing and input "
            "conventions read that release's code). Install that one: "
            f"pip install --no-deps sglang=={SUPPORTED_VERSION}."
        )
    return version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_args() -> SimpleNamespace:
    """The engine's ServerArgs defaults, resolved for one CPU process, bf16 DiT."""
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    # What ServerArgs.__post_init__ resolves for one process without parallelism (it would also
    # look the model up by path, which a lab-built model has none of).
    values.update(
        model_path="precision-lab",
        num_gpus=1,
        tp_size=1,
        sp_degree=1,
        ulysses_degree=1,
        ring_degree=1,
        kv_gather_degree=1,
        dp_size=1,
        pipeline_config=SimpleNamespace(dit_precision="bfloat16", vae_precision="bfloat16"),
    )
    return SimpleNamespace(**values)


def start_engine(where: str = "lab.engine.sglang") -> str:
    """Set up the engine's process state once: imports, process group, server args, routing.

    Idempotent and thread-safe. A process that already holds a torch.distributed group (an
    engine worker) keeps it; otherwise a 1-process gloo group on a free local port is made.

    Returns:
        The engine version.

    Raises:
        EngineUnavailable: sglang missing or another version.
    """
    version = require_engine(where)
    with _LOCK:
        if _STARTED:
            return version
        with warnings.catch_warnings():
            # Import-time notes that only concern GPUs (AWQ / GGUF quantization on CUDA).
            warnings.filterwarnings("ignore", message=r"Only CUDA.*support.*")
            from sglang.multimodal_gen.runtime.distributed import parallel_state
            from sglang.multimodal_gen.runtime.server_args import (
                get_global_server_args,
                set_global_server_args,
            )

        with contextlib.suppress(ValueError):
            _STARTED["server_args_were_set"] = get_global_server_args() is not None
        if not _STARTED.get("server_args_were_set"):
            set_global_server_args(_server_args())
        with _process_stdio():
            parallel_state.maybe_init_distributed_environment_and_model_parallel(
                tp_size=1,
                sp_size=1,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
        from lab.engine.sglang.cpu_routing import apply_cpu_routing

        _STARTED["routing"] = apply_cpu_routing(version)
        _STARTED["version"] = version
    return version


@contextlib.contextmanager
def _process_stdio() -> Iterator[None]:
    """The process's own stdout/stderr for the block.

    The engine silences its group setup by redirecting `sys.stdout.fileno()`, which a Jupyter
    kernel's stream does not have.
    """
    import sys

    saved = sys.stdout, sys.stderr
    try:
        sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def cpu_routing_applied() -> tuple[str, ...]:
    """Names of the CPU routings in effect (empty before `start_engine`)."""
    return tuple(_STARTED.get("routing", ()))


@contextlib.contextmanager
def forward_context() -> Iterator[None]:
    """The engine's per-forward context (`set_forward_context`) for one DiT forward."""
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context

    with set_forward_context(current_timestep=0, attn_metadata=None):
        yield

"""Forward hooks on every module: each call's output tensors, keyed by exact module path."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lab.base.arguments import checked_arguments

ROOT = "<root>"
"""Name used for the model itself (its named_modules() path is the empty string)."""


@dataclass(frozen=True)
class CallKey:
    """One output tensor of one call of one module."""

    module: str
    call: int
    output: str
    """Index path inside the module's output: "" for a bare tensor, "0", "1", "sample", ..."""

    @property
    def label(self) -> str:
        """Display name: `module[:output][#call]`."""
        out = f":{self.output}" if self.output else ""
        call = f"#{self.call}" if self.call else ""
        return f"{self.module}{out}{call}"


def flatten_output(output: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (index path, leaf) for every leaf of a module output; None leaves are skipped."""
    if output is None:
        return
    if isinstance(output, torch.Tensor):
        yield prefix, output
    elif isinstance(output, tuple | list):
        for i, v in enumerate(output):
            yield from flatten_output(v, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(output, Mapping):
        for k, v in output.items():
            yield from flatten_output(v, f"{prefix}.{k}" if prefix else str(k))
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            yield from flatten_output(
                getattr(output, f.name), f"{prefix}.{f.name}" if prefix else f.name
            )
    else:
        yield prefix, output


def output_leaves(output: Any) -> Iterable[tuple[str, Any]]:
    """`flatten_output(output)`, without a generator for a bare tensor (most module outputs)."""
    if isinstance(output, torch.Tensor):
        return (("", output),)
    return flatten_output(output)


@checked_arguments
def depth_filter(max_depth: int) -> Callable[[str], bool]:
    """A names_filter keeping the model and modules at most `max_depth` levels below it.

    `blocks` is depth 0 and `blocks.3` depth 1, so depth 1 keeps every block's output: the
    capture a full-size model can afford when every module's activation would not fit.
    """
    return lambda name: name == ROOT or name.count(".") <= max_depth


OnOutput = Callable[[str, int, torch.nn.Module, tuple, dict, Any], None]
OnInput = Callable[[str, int, torch.nn.Module, tuple, dict], None]


_MISSING = object()


@checked_arguments
@contextlib.contextmanager
def instance_forwards(
    modules: Iterable[tuple[torch.nn.Module, str]],
    wrap: Callable[[torch.nn.Module, Callable[..., Any], str], Callable[..., Any]],
) -> Iterator[None]:
    """Each module's current forward replaced by `wrap(module, forward, label)`; restored on exit.

    What a forward hook with kwargs would see (the call's arguments and its output), without
    the hook: a module with any hook runs `Module._call_impl`'s slow path (the hook lists, a
    closure) on every call, ~3-6 us. The forward wrapped is the one the module has now (its
    class's, or an instance forward such as an engine op's), so enter this inside whatever
    installs those. Set through the instance dict: `Module.__setattr__` is ~1 us of type
    checks a module.
    """
    saved: list[tuple[torch.nn.Module, Any]] = []
    try:
        for module, label in modules:
            instance = module.__dict__
            saved.append((module, instance.get("forward", _MISSING)))
            instance["forward"] = wrap(module, module.forward, label)
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous


class OutputReports:
    """`ModuleHooks` for outputs only, reported from instance forwards (`instance_forwards`).

    The same calls, counted the same way (as each returns), with the same arguments and
    output, at a fraction of a hook's cost: the two-pass pair's captured modules. Enter
    `attached()` inside the side's engine-op context, once per forward.
    """

    @checked_arguments
    def __init__(self, modules: Iterable[tuple[torch.nn.Module, str]], on_output: OnOutput):
        """Report `modules` ((module, label) each) to `on_output(label, call, module, ...)`."""
        self.modules = list(modules)
        self.on_output = on_output
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def attached(self) -> Iterator[OutputReports]:
        """Wrap every module's forward for the block; the call counts start from zero."""
        self.calls = calls = {}
        report = self.on_output

        def wrap(module: torch.nn.Module, inner: Callable[..., Any], label: str) -> Any:
            def forward(*args: Any, **kwargs: Any) -> Any:
                output = inner(*args, **kwargs)
                call = calls.get(label, 0)
                calls[label] = call + 1
                report(label, call, module, args, kwargs, output)
                return output

            return forward

        with instance_forwards(self.modules, wrap):
            yield self


class ModuleHooks:
    """Forward hooks on every (filtered) module that report each call with its call index.

    `paused()` turns reporting off, for re-running modules from inside a hook. Without
    `on_input`, only forward hooks are installed (they still see the call's kwargs).
    """

    @checked_arguments
    def __init__(
        self,
        model: torch.nn.Module,
        on_output: OnOutput,
        *,
        on_input: OnInput | None = None,
        names_filter: Callable[[str], bool] | None = None,
        prefix: str = "",
        start_calls: dict[str, int] | None = None,
    ) -> None:
        """Attach nothing yet; `attached()` installs and removes the hooks.

        `prefix` names `model`'s modules as paths under an outer model (for hooks on one
        block); `start_calls` continues another forward's call counts.
        """
        self.model = model
        self.prefix = prefix
        self.start_calls = dict(start_calls or {})
        self.on_output = on_output
        self.on_input = on_input
        self.names_filter = names_filter
        self.calls: dict[str, int] = {}
        self._paused = 0
        self._pending: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Suspend reporting (nested re-runs of modules do not count as calls)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def attached(self) -> Iterator[ModuleHooks]:
        """Install the hooks for the duration of the block; always removes them."""
        handles = []
        self.calls = dict(self.start_calls)
        try:
            for name, module in self.model.named_modules():
                if self.prefix:
                    label = f"{self.prefix}.{name}" if name else self.prefix
                else:
                    label = name or ROOT
                if self.names_filter is not None and not self.names_filter(label):
                    continue
                if self.on_input is None:
                    # Outputs only: one plain hook a module, the call counted as it returns
                    # (the same index as counting at the start, unless a module calls itself).
                    handles.append(
                        module.register_forward_hook(self._post_only(label), with_kwargs=True)
                    )
                    continue
                handles.append(module.register_forward_pre_hook(self._pre(label), with_kwargs=True))
                handles.append(
                    module.register_forward_hook(
                        self._post(label), with_kwargs=True, always_call=False
                    )
                )
            yield self
        finally:
            for h in handles:
                h.remove()

    def _pre(self, label: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self._paused:
                return
            call = self.calls.get(label, 0)
            self.calls[label] = call + 1
            self._pending.setdefault(label, []).append(call)
            if self.on_input is not None:
                self.on_input(label, call, module, args, kwargs)

        return hook

    def _post_only(self, label: str) -> Callable[..., None]:
        calls, on_output = self.calls, self.on_output

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._paused:
                return
            call = calls.get(label, 0)
            calls[label] = call + 1
            on_output(label, call, module, args, kwargs, output)

        return hook

    def _post(self, label: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._paused:
                return
            call = self._pending[label].pop()
            self.on_output(label, call, module, args, kwargs, output)

        return hook

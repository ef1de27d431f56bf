"""Issue 42, cleanup on every exit path: a user callback that raises at any point leaves nothing.

Every callback a caller hands a pair or forward (the `names_filter`, and the model's own code:
a forward hook of theirs stands for any module that raises) is made to raise at its first
call, its second, ... up to its last, in every way a pair can run (lockstep, lockstep streamed,
two passes, local mode) and in a plain forward. After each, the model and the process must be
exactly as before: no hook, no patched forward, every parameter and buffer the same tensor in
fp32, eval/train flags, grad mode, the torch-function mode stack, SDPA flags, the collector on,
the in-use guard given back and no side thread alive. Then the next pair runs and gives the
same Result. (Before: a names_filter raising part-way left lockstep's block hooks installed and
the next lockstep pair on that model never returned.)

wan2_2 tiny: its rollout side patches forwards (the "wan" engine ops), its trainer runs under
autocast emulation, and it has blocks (lockstep's hooks), all on the cheapest tiny model.
"""

from __future__ import annotations

import _thread
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import lab
from lab.base.errors import PairError
from lab.pairing import guards, lockstep

CONFIGS: dict[str, dict[str, Any]] = {
    "lockstep": dict(lockstep=True),
    "lockstep_stream": dict(lockstep=True, stream=True),
    "two_pass": dict(lockstep=False),
    "local": dict(mode="local"),
}


class Raised(Exception):
    """What the test's callbacks raise (told apart from any error of the lab's own)."""


@pytest.fixture
def tiny() -> tuple[torch.nn.Module, lab.Inputs, lab.Side, lab.Side]:
    fam = lab.family("wan2_2")
    rollout, trainer = lab.Side.rollout(fam), lab.Side.trainer(fam)
    assert rollout.engine_ops and trainer.autocast, "no patch or emulation to leave behind"
    return fam.build("tiny", 0), fam.make_inputs("tiny", 0), rollout, trainer


def _state(model: torch.nn.Module) -> dict[str, Any]:
    """Everything a pair or forward touches and must give back, as comparable values."""
    modules = {
        name: (
            tuple(m._forward_hooks),
            tuple(m._forward_pre_hooks),
            tuple(m._forward_hooks_with_kwargs),
            id(m.__dict__.get("forward")),
            m.training,
        )
        for name, m in model.named_modules()
    }
    tensors = {
        name: (id(t), t.data_ptr(), t.dtype, t.requires_grad)
        for name, t in (*model.named_parameters(), *model.named_buffers())
    }
    sdpa = tuple(
        getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
        for k in ("flash", "mem_efficient", "math", "cudnn")
    )
    side_threads = [t.name for t in threading.enumerate() if t.name.startswith("lab-pair")]
    return dict(
        modules=modules,
        tensors=tensors,
        grad=torch.is_grad_enabled(),
        autocast=torch.is_autocast_enabled("cpu"),
        function_modes=len(torch.overrides._get_current_function_mode_stack()),
        sdpa=sdpa,
        gc=gc.isenabled(),
        side_keys=dict(lockstep._KEYS),
        held=dict(guards._HOLDS.owners),
        side_threads=side_threads,
        threads=torch.get_num_threads(),
    )


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()` in a thread; a call that never returns fails the test instead of hanging it."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # handed to the caller below
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not return within {seconds:g} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


class _RaiseAt:
    """A callback that counts its calls and raises `Raised` at call number `at` (1-based)."""

    def __init__(self, at: int | None, value: Any = True) -> None:
        self.at, self.calls, self.value = at, 0, value

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise Raised(f"call {self.calls}")
        return self.value


def _raised_by_us(err: BaseException) -> bool:
    seen = err
    while seen is not None:
        if isinstance(seen, Raised):
            return True
        seen = seen.__cause__
    return False


def _walk(model: torch.nn.Module, run: Callable[[_RaiseAt], Any], before: dict) -> int:
    """Raise from the callback at every call it gets in a normal run; check the state each time.

    Returns how many points were walked.
    """
    counting = _RaiseAt(None)
    run(counting)
    points = counting.calls
    assert points > 10, "the callback was hardly called: the walk would prove nothing"
    for at in range(1, points + 1):
        callback = _RaiseAt(at)
        with pytest.raises((PairError, Raised)) as info:
            _within(120, lambda callback=callback: run(callback))
        assert _raised_by_us(info.value), f"point {at}: another error: {info.value!r}"
        assert _state(model) == before, f"point {at} of {points} left something behind"
    return points


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_raising_names_filter_at_every_point_leaves_nothing(tiny: tuple, config: str) -> None:
    model, inputs, rollout, trainer = tiny
    kwargs = CONFIGS[config]
    expected = _within(120, lambda: lab.pair(model, inputs, rollout, trainer, **kwargs)).table()
    before = _state(model)

    def run(names_filter: _RaiseAt) -> Any:
        return lab.pair(model, inputs, rollout, trainer, names_filter=names_filter, **kwargs)

    _walk(model, run, before)
    # The next pair on the model runs (lockstep's hooks left behind made it wait for good).
    after = _within(120, lambda: lab.pair(model, inputs, rollout, trainer, **kwargs))
    assert after.table().equals(expected)
    assert _state(model) == before


# Local mode runs a forward per module call: every call raising is ~40 pairs, hence slow.
@pytest.mark.parametrize(
    "config",
    [*(c if c != "local" else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS),
     "forward_side"],
)  # fmt: skip
def test_a_raising_module_at_every_call_leaves_nothing(tiny: tuple, config: str) -> None:
    model, inputs, rollout, trainer = tiny
    kwargs = CONFIGS.get(config, {})
    expected = _within(120, lambda: lab.pair(model, inputs, rollout, trainer, **kwargs)).table()
    current: list[_RaiseAt] = [_RaiseAt(None)]

    def user_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        current[0]()

    # The caller's own hooks on every module: part of the model, kept by every pair.
    handles = [m.register_forward_hook(user_hook) for m in model.modules()]
    try:
        before = _state(model)

        def run(callback: _RaiseAt) -> Any:
            current[0] = callback
            try:
                if config == "forward_side":
                    return lab.forward_side(model, inputs, trainer)
                return lab.pair(model, inputs, rollout, trainer, **kwargs)
            finally:
                current[0] = _RaiseAt(None)

        _walk(model, run, before)
        after = _within(120, lambda: lab.pair(model, inputs, rollout, trainer, **kwargs))
        assert after.table().equals(expected)
        assert _state(model) == before
    finally:
        for h in handles:
            h.remove()


# Not local mode: it runs in the main thread as two passes do, through the `finally` blocks the
# raising walk above covers, and with a hook on every module its re-runs make the walk minutes.
@pytest.mark.parametrize("config", ["lockstep", "lockstep_stream", "two_pass", "forward_side"])
def test_ctrl_c_at_every_module_call_leaves_nothing(tiny: tuple, config: str) -> None:
    # A real Ctrl-C: KeyboardInterrupt raised in the main thread (`interrupt_main`) wherever it
    # is then: inside a forward (two passes, forward_side) or waiting for lockstep's side
    # threads, which must unwind before it goes on. (Before: one arriving while lockstep
    # started its side threads left them running a pair nobody waited for.)
    model, inputs, rollout, trainer = tiny
    kwargs = CONFIGS.get(config, {})
    expected = _within(120, lambda: lab.pair(model, inputs, rollout, trainer, **kwargs)).table()
    calls = [0, 0]  # [calls so far, the call that interrupts (0: none)]

    def user_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        calls[0] += 1
        if calls[0] == calls[1]:
            _thread.interrupt_main()

    def run() -> Any:
        if config == "forward_side":
            return lab.forward_side(model, inputs, trainer)
        return lab.pair(model, inputs, rollout, trainer, **kwargs)

    handles = [m.register_forward_hook(user_hook) for m in model.modules()]
    try:
        before = _state(model)
        run()
        points = calls[0]
        assert points > 10
        for at in range(1, points + 1):
            calls[:] = [0, at]
            with pytest.raises(KeyboardInterrupt):
                run()
                time.sleep(5)  # the interrupt is delivered between bytecodes: here at the latest
            assert _state(model) == before, f"Ctrl-C at call {at} of {points} left something"
        calls[:] = [0, 0]
        assert _within(120, run) is not None
        if config != "forward_side":
            assert run().table().equals(expected)
        assert _state(model) == before
    finally:
        for h in handles:
            h.remove()


def test_a_raising_loss_leaves_the_master_and_its_gradients_alone(tiny: tuple) -> None:
    from lab.rl.gradients import master_gradients

    model, inputs, _, trainer = tiny
    before = _state(model)
    grads = {n: p.grad for n, p in model.named_parameters()}

    def loss(output: Any, _: Any) -> torch.Tensor:
        raise Raised("loss")

    with pytest.raises((PairError, Raised)) as info:
        master_gradients(model, inputs, trainer, loss)
    assert _raised_by_us(info.value)
    assert _state(model) == before
    assert {n: p.grad for n, p in model.named_parameters()} == grads

"""Issue 42, shared state: a second Module over the same tensors is held like the model itself.

The in-use guard (lab.pairing.guards.model_in_use) is keyed on the parameters and storages a
side swaps, not on the Module object: a `copy.copy` of a model shares every Parameter.
Sweeps' folders: tests/test_sweep.py; baselines: tests/test_baselines.py.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import lab
from lab.base.errors import ModelInUseError


def _tiny() -> tuple[Any, torch.nn.Module, lab.Inputs]:
    fam = lab.family("wan2_2")
    return fam, fam.build("tiny", 0), fam.make_inputs("tiny", 0)


def _held_in_a_thread(
    model: torch.nn.Module, call: Callable[[], Any]
) -> tuple[threading.Thread, dict[str, Any]]:
    """Start `call` in a thread and park it inside the model's first block (weights swapped)."""
    inside, release = threading.Event(), threading.Event()

    def hold(module: Any, args: Any, output: Any) -> None:
        if not inside.is_set():
            inside.set()
            assert release.wait(timeout=120), "the main thread never released the held call"

    handle = model.blocks[0].register_forward_hook(hold)
    outcome: dict[str, Any] = {"handle": handle, "release": release}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # reported by the caller's assertions
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(timeout=120), "the held call never reached its forward"
    return thread, outcome


def _finish(thread: threading.Thread, outcome: dict[str, Any]) -> Any:
    outcome["release"].set()
    thread.join()
    outcome["handle"].remove()
    assert "error" not in outcome, outcome.get("error")
    return outcome["value"]


def _twins(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Other Modules over the model's tensors: a shallow copy, and one built over its storage."""
    yield "copy.copy", copy.copy(model)
    fam = lab.family("wan2_2")
    over = fam.build("tiny", 0)
    for (_, mine), (_, theirs) in zip(
        model.named_parameters(), over.named_parameters(), strict=True
    ):
        theirs.data = mine.data  # another Parameter object, the same storage
    yield "same storage", over


def test_a_copy_sharing_the_parameters_is_refused_while_the_model_is_paired() -> None:
    fam, model, inputs = _tiny()
    rollout, trainer = lab.Side.rollout(fam), lab.Side.trainer(fam)
    expected = lab.pair(model, inputs, rollout, trainer).table()
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    twins = dict(_twins(model))

    thread, outcome = _held_in_a_thread(model, lambda: lab.pair(model, inputs, rollout, trainer))
    try:
        for how, twin in twins.items():
            # Before: the copy's pair ran on the held pair's bf16 casts and "restored" them.
            with pytest.raises(ModelInUseError, match=r"^pair: this WanTransformer3DModel shares "
                               r"parameter tensors with a WanTransformer3DModel"):  # fmt: skip
                lab.pair(twin, inputs, rollout, trainer)
            with pytest.raises(ModelInUseError, match=r"copy\.deepcopy\(model\)"):
                lab.forward_side(twin, inputs, trainer)
            assert how  # both kinds of twin were tried
    finally:
        result = _finish(thread, outcome)
    assert result.table().equals(expected), "the held pair gave another result"
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, masters[name]), name
    # Released: each twin pairs (its own thread's turn) and gives the model's Result.
    for twin in twins.values():
        assert lab.pair(twin, inputs, rollout, trainer).table().equals(expected)


def test_a_deep_copy_pairs_beside_the_model_and_the_holder_may_nest() -> None:
    fam, model, inputs = _tiny()
    rollout, trainer = lab.Side.rollout(fam), lab.Side.trainer(fam)
    expected = lab.pair(model, inputs, rollout, trainer).table()
    own = copy.deepcopy(model)
    thread, outcome = _held_in_a_thread(model, lambda: lab.pair(model, inputs, rollout, trainer))
    try:
        # Its own tensors: nothing shared, nothing refused.
        assert lab.pair(own, inputs, rollout, trainer).table().equals(expected)
    finally:
        _finish(thread, outcome)

    # One thread may hold the same tensors twice over (a call inside a call): not refused.
    from lab.pairing.guards import model_in_use

    twin = copy.copy(model)
    with model_in_use(model, "outer"), model_in_use(twin, "inner"):
        assert lab.pair(twin, inputs, rollout, trainer).table().equals(expected)
    # And every hold is given back: another thread may hold it now.
    seen: list[BaseException] = []

    def other() -> None:
        try:
            with model_in_use(twin, "other"):
                pass
        except BaseException as err:
            seen.append(err)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == []


# ---- one folder, one run (lab.base.processes.holding_folder) ---------------------------------


def _reaped_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_held_folder_is_refused_to_a_second_holder_and_a_dead_owners_lock_is_taken_over(
    tmp_path: Any,
) -> None:
    import json
    import os

    from lab.base.processes import LOCK_FILE, FolderInUseError, alive, holding_folder

    folder = tmp_path / "runs" / "out"
    with holding_folder(folder, "first"):
        owner = json.loads((folder / LOCK_FILE).read_text())
        assert owner["pid"] == os.getpid()
        # Another open of the lock, in this thread or another, is another holder: refused.
        refused = rf"^second: '.*out' is in use by another run, process {os.getpid()} \(.*\): "
        with pytest.raises(FolderInUseError, match=refused + "two runs writing one folder"):
            with holding_folder(folder, "second"):
                pass
    assert not (folder / LOCK_FILE).exists()
    assert not folder.exists() and not folder.parent.exists(), "left the folders it made"

    # A lock file whose owner died (kill -9: no flock held any more) is stale: taken over.
    folder.mkdir(parents=True)
    dead = _reaped_pid()
    assert not alive(dead)
    (folder / LOCK_FILE).write_text(json.dumps({"pid": dead, "command": "x", "since": "y"}))
    with holding_folder(folder, "after a kill -9"):
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert folder.is_dir(), "a folder it did not make is kept"


def test_without_flock_the_lock_file_pid_decides(tmp_path: Any) -> None:
    import json
    import os

    from lab.base.processes import _open_by_pid

    lock = tmp_path / "lock"
    lock.write_text(json.dumps({"pid": os.getpid()}))
    assert _open_by_pid(lock) is None, "a live owner's lock was taken"
    lock.write_text("")  # being written by its owner right now
    assert _open_by_pid(lock) is None
    os.utime(lock, (0, 0))  # ... or its owner died mid-write long ago
    fd = _open_by_pid(lock)
    assert fd is not None
    os.close(fd)
    lock.write_text(json.dumps({"pid": _reaped_pid()}))
    fd = _open_by_pid(lock)
    assert fd is not None
    os.close(fd)

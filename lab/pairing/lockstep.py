"""Lockstep pairing: the two sides' forwards run in two threads that take turns module by module.

Propagated mode compares side A's output of a module with side B's output of the same module.
Running A to the end and then B needs every output of A kept until B reaches it (all of one
forward's activations); re-running blocks of A next to B bounds that memory but costs a
third forward. Here each side's forward runs in its own thread and the two hand one baton
back and forth: the side that reaches a captured module output first holds it (no copy: its
thread is parked right there, so nothing can edit the tensor) and hands over; the other side
runs up to the same module, the pair is reduced to its metric vector on the device, and that
side runs on to the next output. Memory holds one forward's live activations per side plus
one output; time is the two forwards plus the metrics. Only one thread runs at any moment.

What is thread-local in torch (grad mode, autocast, the autocast emulation's function mode)
is set once per thread; what is global (parameter tensors, engine-op forwards, SDPA kernel
flags) is handed over with the baton: `PairedWeights.activate`, `ops_dispatched` and a
per-turn `sdpa_kernel` context (one context for the whole run when both sides pin the same
kernel).

The two threads live on between pairs (`_Workers`): a thread's first CUDA forward builds
per-thread library state (cuDNN attention graphs, handles), which cost sd3 full ~0.1 s a
thread on an H200 (first forward in a fresh thread 0.17 s, every later one 0.08 s).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from lab.base.processes import signals_deferred
from lab.base.switches import env_choice
from lab.pairing import pair_core
from lab.pairing.capture import ROOT, flatten_output, instance_forwards
from lab.pairing.collect import Aliases
from lab.pairing.result import Skipped
from lab.pairing.side_context import sdpa_context, side_autocast
from lab.pairing.weights import PairedWeights

if TYPE_CHECKING:
    from lab.families import Inputs
    from lab.pairing.state import PairRun


class _Abort(BaseException):
    """Raised in a side's thread to unwind its forward after the other side failed."""


class _Baton:
    """Strict turn-taking between named threads; `stop` wakes everyone to unwind."""

    def __init__(self, first: str) -> None:
        self._cond = threading.Condition()
        self._turn = first
        self._stopped = False

    def wait(self, key: str) -> None:
        with self._cond:
            while self._turn != key and not self._stopped:
                self._cond.wait()
            if self._stopped:
                raise _Abort

    def give(self, key: str) -> None:
        with self._cond:
            self._turn = key
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


_KEYS: dict[int, str] = {}
"""Thread id -> the side key ("a" or "b") that thread is running; absent: no side."""
_get_ident = threading.get_ident


def _current_key() -> str:
    """The side the calling thread runs ("" for any other thread).

    Read at every hook and engine-op call: a dict keyed by the thread id costs a third of a
    `threading.local` attribute read.
    """
    return _KEYS.get(_get_ident(), "")


def _own_inputs(inputs_a: Inputs, inputs_b: Inputs) -> Inputs:
    """Side B's inputs, with a copy of every tensor it shares with side A's.

    Either forward may edit its inputs in place while the other is parked.
    """
    shared = {id(v) for v in inputs_a.kwargs.values() if isinstance(v, torch.Tensor)}
    kwargs = {
        k: v.clone() if isinstance(v, torch.Tensor) and id(v) in shared else v
        for k, v in inputs_b.kwargs.items()
    }
    return replace(inputs_b, kwargs=kwargs)


class _Worker:
    """One long-lived daemon thread running the jobs it is handed, one after another."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                job()  # `_Lockstep.thread` keeps every exception for the caller
            finally:
                done.set()
                # Nothing of a finished pair (model, tensors) stays referenced while idle.
                del job, done

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Queue `job`; the returned event is set once it has returned."""
        done = threading.Event()
        self._jobs.put((job, done))
        return done


def pin_mode() -> str:
    """LAB_PAIR_PIN: "fastest" (default), "core" or "off" (see `_Workers.pin`, `fastest_cpu`).

    Raises:
        ValueError: Any other value.
    """
    choices = {
        "fastest": "the kept side threads run on the fastest of a few cores, probed at the "
        "pair's start",
        "core": "the kept side threads run on the core the pair was started from",
        "off": "wherever the scheduler puts them",
    }
    return env_choice("LAB_PAIR_PIN", choices, "fastest")


PROBE_CPUS = 16
"""The most CPUs `fastest_cpu` probes (the caller's and others picked at random); read at each
call."""
_PROBE_RANDOM = random.Random(0)  # its own: a pair never draws from the caller's `random`


def _probe_s(loops: int = 1500) -> float:
    """Seconds a fixed stretch of interpreter work takes on the calling thread's core now."""
    start = time.perf_counter()
    x = 0
    for i in range(loops):
        x += i
    return time.perf_counter() - start


def fastest_cpu(limit: int | None = None) -> tuple[int | None, dict[int, float]]:
    """The CPU that runs a short stretch of interpreter work fastest now, and the probes.

    Candidates: the caller's CPU (when its CPU set holds it) and others of that set, `limit`
    in all (default `PROBE_CPUS`), the others sampled at random past the limit; each probed
    CPU's time is its best of two probes (seconds). The calling thread moves to each CPU in
    turn and gets its CPU set back after. (None, {}) where affinity or the current CPU cannot
    be read, or no CPU could be probed.

    Why: a short forward's pair is bound by the one core its side threads run on, and on a
    shared host the vCPUs do not all run at one speed. On the H200 host the same loop took
    about 19-25 ms on most of its 16 vCPUs and 32-42 ms on others, a different set on each
    pass (`data/gpu/cores_h200_6a4657c.txt`; one thread per core, a KVM guest: another
    tenant on the same physical core is the likely cause). Probing costs ~40 us a CPU.
    """
    limit = PROBE_CPUS if limit is None else limit
    if limit < 1:
        raise ValueError(f"fastest_cpu: limit={limit}; probe at least one CPU.")
    here = current_cpu()
    if here is None or not hasattr(os, "sched_setaffinity"):
        return None, {}
    mask = os.sched_getaffinity(0)
    first = [here] if here in mask else []
    others = sorted(mask - {here})
    room = limit - len(first)
    if len(others) > room:
        others = sorted(_PROBE_RANDOM.sample(others, room))
    probes: dict[int, float] = {}
    try:
        for cpu in [*first, *others]:
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError:  # offline, or taken from the process since: not a candidate
                continue
            probes[cpu] = min(_probe_s(), _probe_s())
    finally:
        restore_affinity(mask)
    if not probes:
        return None, {}
    return min(probes, key=probes.__getitem__), probes


def restore_affinity(mask: set[int]) -> None:
    """Give the calling thread `mask` back, or every CPU where that fails.

    A CPU taken from the process since the probe makes `mask` fail; the thread is then given
    every CPU it may still use, so it is never left on one probed CPU.
    """
    try:
        os.sched_setaffinity(0, mask)
    except OSError:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))


def pin_for_processes(mode: str) -> str:
    """`mode` as this process may apply it: "core" for "fastest" beside other pairing processes.

    Several processes of one host pairing at once (LOCAL_WORLD_SIZE > 1, as torchrun sets it)
    would all probe the same idle core fastest and share it; each keeps its own core instead.
    """
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return "core" if mode == "fastest" and local > 1 else mode


_SCHED_GETCPU: list[Any] = []


def current_cpu() -> int | None:
    """The CPU the calling thread runs on (glibc's sched_getcpu), or None where unknown."""
    if not _SCHED_GETCPU:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
            fn.restype = ctypes.c_int
            _SCHED_GETCPU.append(fn)
        except (OSError, AttributeError, TypeError):  # no libc of that kind (e.g. Windows)
            _SCHED_GETCPU.append(None)
    fn = _SCHED_GETCPU[0]
    cpu = fn() if fn is not None else -1
    return cpu if cpu >= 0 else None


class _Workers:
    """The two side threads, kept between pairs; one pair at a time uses them.

    A pair started while another holds them (from another thread, or nested) runs on two fresh
    threads instead, as does one in a forked child (whose copies of the threads are dead).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self.pinned: int | None = None
        """The CPU both threads are pinned to (None: not pinned)."""
        self._cpus: frozenset[int] | None = None
        """The CPU set last given to both threads (None: none given, or not known)."""
        self.probes: dict[int, float] = {}
        """`fastest_cpu`'s probe seconds per CPU at the last claim (empty unless "fastest")."""
        self.probe_s = 0.0
        """Seconds the last claim spent probing (inside the pair's `lockstep_s`)."""
        self.mode = "none"
        """How the last claim placed the threads: "fastest", "core", or "none" (not pinned)."""

    def pin(self, cpu: int | None) -> None:
        """Pin both threads to `cpu` (None: give them the caller's CPU set).

        Only one side runs at a time, and each hand-over wakes the other side's thread. Left
        to the scheduler, that thread often wakes on another core, whose caches hold none of
        the forward's Python state: on an H200 host, pinning both to one core took cosmos3
        full's every-module pair from 1.66x to 1.27x the plain forwards, and capturing nothing
        from 1.06x to 0.94x (`bench/pair_pin.py`). The CPU pairs run on fresh threads, never
        pinned: a pinned thread's OpenMP team shares its one core, which is also what a CPU op
        inside a CUDA pair's forward gets (LAB_PAIR_PIN=off where that matters); the team keeps
        that core after the threads are unpinned.
        """
        if not hasattr(os, "sched_setaffinity"):
            return
        cpus = frozenset({cpu} if cpu is not None else os.sched_getaffinity(0))
        if cpus == self._cpus:
            return
        self._cpus, self.pinned = None, None  # unknown until every thread has it
        try:
            for worker in self._workers.values():
                os.sched_setaffinity(worker.thread.native_id, cpus)
        except OSError:  # a CPU set the process may not use: the pair runs unpinned
            with contextlib.suppress(OSError):
                for worker in self._workers.values():
                    os.sched_setaffinity(worker.thread.native_id, os.sched_getaffinity(0))
            return
        self._cpus, self.pinned = cpus, cpu

    @contextlib.contextmanager
    def claimed(self) -> Any:
        """The workers keyed "a" and "b", or None when another pair holds them."""
        if not self._lock.acquire(blocking=False):
            yield None
            return
        try:
            for key in ("a", "b"):
                worker = self._workers.get(key)
                if worker is None or not worker.thread.is_alive():
                    self._workers[key] = _Worker(f"lab-pair-{key}")
                    self._cpus = self.pinned = None  # a new thread: set its CPUs again
            mode = pin_for_processes(pin_mode())
            self.probes, self.probe_s = {}, 0.0
            if mode == "fastest":
                start = time.perf_counter()
                cpu, self.probes = fastest_cpu()
                self.probe_s = time.perf_counter() - start
            else:
                cpu = current_cpu() if mode == "core" else None
            self.pin(cpu)
            self.mode = mode if self.pinned is not None else "none"
            yield self._workers
        finally:
            self._lock.release()


_WORKERS = _Workers()

KEEP_WORKERS_ON: tuple[str, ...] = ("cuda",)
"""Device types whose pairs keep the two side threads between pairs. Not CPU: an idle side thread
keeps its OpenMP team, which on a small machine slows every later CPU forward of the process
(flux tiny's plain forwards took 2x as long after one kept-thread pair on 2 cores). libgomp
spins between parallel regions only while its teams hold no more threads than there are CPUs
(`do_spin`: `gomp_managed_threads > gomp_available_cpus` throttles the spin); past that, idle
team threads sleep and every short op pays a wake-up. While a CPU pair runs, its two side
threads' teams put it past that too (`bench/cpu_threads.py`)."""


def _run_sides(step: _Lockstep) -> None:
    """Run both sides' forwards (`step.thread`) to the end, on the kept workers if free."""
    keep = step.run.device.type in KEEP_WORKERS_ON
    with _WORKERS.claimed() if keep else contextlib.nullcontext() as workers:
        # Ctrl-C waits until both sides are started and known to `waits`: one arriving while
        # a thread started (`Thread.start` waits for it) left that side running unwaited. It
        # is delivered as the block ends, inside the `try` that unwinds both sides.
        waits: list[Callable[[], Any]] = []
        try:
            with signals_deferred():
                if workers is not None:
                    step.pinned_cpu = _WORKERS.pinned
                    step.probes, step.probe_s = dict(_WORKERS.probes), _WORKERS.probe_s
                    step.pin = _WORKERS.mode
                    waits = [workers[k].submit(lambda k=k: step.thread(k)).wait for k in "ab"]
                else:
                    threads = [
                        threading.Thread(
                            target=step.thread, args=(k,), name=f"lab-pair-{k}", daemon=True
                        )
                        for k in ("a", "b")
                    ]
                    for t in threads:
                        t.start()
                    waits = [t.join for t in threads]
            for wait in waits:
                wait()
        except BaseException:  # KeyboardInterrupt: unwind both forwards first
            step.baton.stop()
            for wait in waits:
                wait()
            raise


class _SegmentEdited(Exception):
    """A side edited one of its parked outputs in place before the other side compared it."""


PARK_BUDGET_SHARE = 0.05
"""Default bytes a side may park before it hands over mid-block: this share of the master."""
_PARK_BUDGET_MIN = 64 << 20


def _budget_switch() -> int | None:
    """LAB_PARK_BUDGET as an int (None when unset).

    Raises:
        ValueError: It is set to anything but a non-negative integer.
    """
    value = os.environ.get("LAB_PARK_BUDGET")
    if value is not None and not (value.isascii() and value.isdigit()):
        raise ValueError(
            f"LAB_PARK_BUDGET={value!r}: give a number of bytes, e.g. 2000000000 (0 hands over "
            "after every parked output)."
        )
    return None if value is None else int(value)


def check_switches() -> None:
    """Refuse a bad lockstep switch before any forward.

    LAB_LOCKSTEP_HANDOVER, LAB_PARK_BUDGET, LAB_PAIR_PIN and LAB_PAIR_CORE.

    Raises:
        ValueError: Naming the bad value and the values allowed.
    """
    handover_mode()
    _budget_switch()
    pin_mode()
    pair_core.mode()


def park_budget(model: torch.nn.Module, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of outputs a side parks at most before handing over, even inside a block.

    LAB_PARK_BUDGET (bytes) if set, else PARK_BUDGET_SHARE of the model's parameter bytes
    (at least 64 MiB): flux full 2.4 GB, about one double block's outputs; a Wan2.2 full block
    parks ~10 GB, so it hands over every few modules. `params`: the model's parameters when
    the caller has them already (a `WeightView`'s, without walking the module tree).

    Raises:
        ValueError: LAB_PARK_BUDGET is not a non-negative integer.
    """
    value = _budget_switch()
    if value is not None:
        return value
    params = model.parameters() if params is None else params
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return max(_PARK_BUDGET_MIN, int(PARK_BUDGET_SHARE * nbytes))


_PER_MODULE: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
"""Models whose forward edited a parked output in place: they hand over per module."""


class _Lockstep:
    def __init__(self, run: PairRun, blocks: set[int], stream: bool, segments: bool) -> None:
        self.run = run
        self.flow = run.flow
        self.collector = run.collector
        self.sides = {"a": run.side_a, "b": run.side_b}
        self.inputs = {"a": run.inputs_a, "b": _own_inputs(run.inputs_a, run.inputs_b)}
        self.weights = PairedWeights({"a": run.view_a, "b": run.view_b}, blocks, stream=stream)
        self.baton = _Baton("a")
        self.held: dict[str, dict[tuple[str, int, str], list[Any]]] = {"a": {}, "b": {}}
        self.calls: dict[str, dict[str, int]] = {"a": {}, "b": {}}
        self.done = {"a": False, "b": False}
        self.errors: dict[str, BaseException] = {}
        self.order = 0
        self.aliases = {"a": Aliases(), "b": Aliases()}
        self.sdpa: dict[str, contextlib.ExitStack] = {}
        backends = {side.attention_backend for side in self.sides.values()}
        self.sdpa_per_turn = len(backends) > 1
        """Both sides pin the same kernel: one context around the run, none per turn."""
        self.segments = segments
        """Hand over at block boundaries (see `run_lockstep`), not after every parked output."""
        view_params = (p for _, p in run.view_a.parameters())
        self.budget = park_budget(run.model, view_params) if segments else 0
        self.parked = {"a": 0, "b": 0}
        """Bytes (plus one per leaf) the side parked since it last handed over (0: none)."""
        self.b_leaves = 0
        self.handovers = 0
        self.probes: dict[int, float] = {}
        """`fastest_cpu`'s probe seconds per CPU for this pair (LAB_PAIR_PIN=fastest)."""
        self.probe_s = 0.0
        self.pin = "none"
        """How the side threads were placed: "fastest", "core", or "none" (fresh threads, a
        CPU pair, LAB_PAIR_PIN=off, or a pin that failed)."""
        self.pinned_cpu: int | None = None
        """The CPU the kept side threads ran on (`_Workers.pin`); None: fresh threads, or not
        pinned. A pair's host-bound time depends on that core (benches record it per run)."""
        self.skip_keys: list[tuple[float, int]] = []
        """Sort key of each `collector.skipped` entry: two-pass order, whoever reached it."""

    # ---- one side's thread ---------------------------------------------------------------

    def thread(self, key: str) -> None:
        _KEYS[_get_ident()] = key
        side = self.sides[key]
        other = "b" if key == "a" else "a"
        try:
            self.baton.wait(key)
            device = self.run.device
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                if device.type == "cuda":
                    stack.enter_context(torch.cuda.device(device))
                stack.enter_context(side_autocast(side, device))
                self._resume(key)
                try:
                    out = self.run.model(**self.inputs[key].kwargs)
                    if self.run.outputs is not None:
                        self.run.outputs[key] = out
                    if self.segments:
                        self._check_parked(key)  # the other side compares them after we end
                finally:
                    self._suspend(key)
        except _Abort:
            pass
        except BaseException as err:
            self.errors.setdefault(key, err)
            self.baton.stop()
        finally:
            # The thread lives on: its hooks ignore calls until the next pair.
            _KEYS.pop(_get_ident(), None)
            self.done[key] = True
            self.baton.give(other)

    def _resume(self, key: str) -> None:
        self.weights.activate(key)
        if not self.sdpa_per_turn:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_context(self.sides[key].attention_backend))
        self.sdpa[key] = stack

    def _suspend(self, key: str) -> None:
        stack = self.sdpa.pop(key, None)
        if stack is not None:
            stack.close()

    def _check_parked(self, key: str) -> None:
        """Check that our parked outputs still hold the values they were parked with.

        The other side compares them next; an in-place edit since they were parked means this
        model must hand over per module (`run_lockstep` runs the pair again so).

        Raises:
            _SegmentEdited: A parked output's `_version` moved.
        """
        for entry in self.held[key].values():
            if not entry[2] and entry[4] is not None and entry[1]._version != entry[4]:
                raise _SegmentEdited(entry)

    def _pause(self, key: str) -> None:
        other = "b" if key == "a" else "a"
        if self.segments:
            self._check_parked(key)
            self.parked[key] = 0
        self.handovers += 1  # (read by tests and benches)
        self._suspend(key)
        self.baton.give(other)
        self.baton.wait(key)
        self._resume(key)
        # Outputs of ours the other side did not reach while we were parked: from here on our
        # forward runs again and may edit them in place, so keep copies.
        for entry in self.held[key].values():
            if not entry[2] and isinstance(entry[1], torch.Tensor):
                entry[1], entry[2] = entry[1].detach().clone(), True

    # ---- hooks (run in the side's thread) ---------------------------------------------------

    def _on_output(self, key: str, label: str, args: tuple, kwargs: dict, output: Any) -> None:
        """Pair, park or skip each leaf of one captured output.

        Runs without the autocast emulation's torch-function mode (see `_run_once`). Called
        once a captured module call (sd3 full: 1912 a pair), so what it reads is bound once.
        """
        is_a = key == "a"
        calls = self.calls[key]
        call = calls.get(label, 0)
        calls[label] = call + 1
        flow = self.flow
        flow.record(key, label, call, args, kwargs)
        name_of = self.aliases[key].name
        theirs_held = self.held["b" if is_a else "a"]
        parked = False
        leaves = (("", output),) if isinstance(output, torch.Tensor) else flatten_output(output)
        for idx, leaf in leaves:
            k = (label, call, idx)
            name = name_of(leaf)
            if is_a:
                flow.note_output(name, k, leaf)
            else:
                seq = self.b_leaves  # side B's leaf sequence: the two-pass order of skips
                self.b_leaves = seq + 1
            theirs = theirs_held.pop(k, None)
            if theirs is not None:
                if is_a:
                    order = self.order
                    self.order = order + 1
                    seq = theirs[5]
                    skipped = self.collector.compare(order, k, leaf, theirs[1],
                                                     names=(name, theirs[3]))  # fmt: skip
                else:
                    skipped = self.collector.compare(theirs[0], k, theirs[1], leaf,
                                                     names=(theirs[3], name))  # fmt: skip
                if skipped:
                    self.skip_keys.append((0, seq))
            elif self.done["b" if is_a else "a"]:
                reason = f"only on side {self.sides[key].name!r}"
                self.collector.skipped.append(Skipped(label, call, idx, reason))
                self.skip_keys.append((1, self._next_order()) if is_a else (0, seq))
            else:
                order = self._next_order() if is_a else -1
                tensor = isinstance(leaf, torch.Tensor)
                # [order, leaf, copied yet, alias name, version when parked, B's sequence]
                self.held[key][k] = [
                    order, leaf, False, name, leaf._version if tensor else None,
                    -1 if is_a else seq,
                ]  # fmt: skip
                self.parked[key] += 1 + (leaf.numel() * leaf.element_size() if tensor else 0)
                parked = True
        if parked and (not self.segments or self.parked[key] > self.budget):
            self._pause(key)

    def boundary(self, key: str, lead: bool = False) -> None:
        """Side `key` enters or leaves a block: hand over if it parked outputs (segments).

        `lead`: it left a block the other side has yet to run, whose casts are still kept
        (`PairedWeights.keeps`): hand over too, so the other side runs that block next on
        those casts: a hand-over's wake-up is ~70 us on the H200's host, casting one of sd3
        full's blocks ~0.9 ms (`bench/ab_cast_share.py`).
        """
        if self.parked[key] or (lead and not self.done["b" if key == "a" else "a"]):
            self._pause(key)

    def _next_order(self) -> int:
        self.order += 1
        return self.order - 1

    def leftovers(self) -> None:
        """Report unmatched outputs, then put every skip in two-pass order.

        Two passes report, in side B's leaf order, B's outputs that are not comparable or only
        on side B, then side A's unmatched outputs in A's order. Here the same skips arise in
        whatever order the hand-overs give, each with its key; one stable sort restores it.
        """
        skipped = self.run.collector.skipped
        for key in ("a", "b"):
            name = self.sides[key].name
            for (module, call, idx), entry in self.held[key].items():
                skipped.append(Skipped(module, call, idx, f"only on side {name!r}"))
                self.skip_keys.append((1, entry[0]) if key == "a" else (0, entry[5]))
        order = sorted(range(len(skipped)), key=self.skip_keys.__getitem__)
        skipped[:] = [skipped[i] for i in order]


_ON_OUTPUT = _Lockstep._on_output
"""The Python per-output method (a bench or test that replaces it turns the C++ path off)."""


def _reporting_forwards(
    modules: list[tuple[torch.nn.Module, str]],
    on_output: Callable[[str, str, tuple, dict, Any], None],
) -> contextlib.AbstractContextManager:
    """Each module's forward, wrapped to report its output to `on_output` as a side's call.

    `capture.instance_forwards`, not a forward hook: any hook puts every call of its module
    on `Module._call_impl`'s slow path, and sd3 full calls 1912 captured modules a pair. The
    module's current forward is wrapped (its class's, or an engine op's dispatch, which is
    installed first). A call from a thread running no side (the kept threads between pairs,
    any other thread) is passed through unreported. When `on_output` is the C++ path's
    (`pair_core.lockstep`), the wrapper is its `Reporter`, which does the same in C++.
    """
    core = pair_core.extension() if pair_core.mode() == "cxx" else None
    if core is not None and isinstance(on_output, core.Lockstep):
        reporter = core.Reporter
        return instance_forwards(
            modules, lambda module, inner, label: reporter(inner, label, on_output, _KEYS)
        )
    no_function_mode = torch._C.DisableTorchFunction

    def reporting(module: torch.nn.Module, inner: Callable[..., Any], label: str) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            output = inner(*args, **kwargs)
            key = _KEYS.get(_get_ident(), "")
            if key:
                # Out of sight of the autocast emulation's torch-function mode, as the hooks.
                with no_function_mode():
                    on_output(key, label, args, kwargs, output)
            return output

        return forward

    return instance_forwards(modules, reporting)


def run_lockstep(run: PairRun, block_ids: set[int], *, stream: bool) -> None:
    """Pair every captured module of `run` with the two forwards in lockstep (propagated).

    A side parks its captured outputs and runs on; it hands over when it enters or leaves a
    block (or has parked `park_budget` bytes, or its forward ends), and the other side runs
    the same stretch, comparing as it goes: about a hand-over per block instead of one per
    output (flux full: 1221 hand-overs become ~60). A forward that edits a parked output in
    place before the hand-over (checked by `_version`)
    makes the pair run again handing over per module, and so every later pair of that model.
    LAB_LOCKSTEP_HANDOVER=module always hands over per module. Both give the same Result.

    Args:
        run: The pairing run (model, sides, views, inputs, collector, filter).
        block_ids: Ids of the model's blocks: a switch refills only their tensors and the
            ones outside every block; with `stream`, a block's casts exist only while it runs.
        stream: Cast block tensors block by block instead of once for the run.

    Raises:
        The first exception either side's forward raised (the other side is unwound).
    """
    segments = bool(block_ids) and handover_mode() == "block" and run.model not in _PER_MODULE
    try:
        _run_once(run, block_ids, stream, segments)
    except _SegmentEdited:
        _PER_MODULE[run.model] = True
        run.collector.reset()
        run.flow.reset()
        _run_once(run, block_ids, stream, False)


def handover_mode() -> str:
    """LAB_LOCKSTEP_HANDOVER: "block" (default) or "module" (after every unmatched output).

    Raises:
        ValueError: Any other value.
    """
    choices = {
        "block": "hand over at block boundaries",
        "module": "after every captured output the other side has not reached",
    }
    return env_choice("LAB_LOCKSTEP_HANDOVER", choices, "block")


def _run_once(run: PairRun, block_ids: set[int], stream: bool, segments: bool) -> None:
    from lab.precision.engine_ops import ops_dispatched

    entered = time.perf_counter()
    model = run.model
    step = _Lockstep(run, block_ids, stream, segments)
    run.flow.track(step.aliases["a"], step.inputs["a"].kwargs)
    # The per-output path in C++ (`pair_core`), unless LAB_PAIR_CORE=python or a bench or test
    # has put its own `_on_output` on the class.
    core = pair_core.lockstep(step) if _Lockstep._on_output is _ON_OUTPUT else None
    on_output = core if core is not None else step._on_output
    blocks = step.weights.block_modules
    handles = []

    # The hooks' own work (weight swaps, bookkeeping, metrics) is no part of the side's
    # forward: it runs without the autocast emulation's torch-function mode, which would
    # otherwise see every tensor call of it (~5 us each on a tiny CPU model).
    no_function_mode = torch._C.DisableTorchFunction

    def pre(mod: torch.nn.Module, args: Any) -> None:
        key = _current_key()
        if key:
            with no_function_mode():
                if segments:
                    step.boundary(key)
                step.weights.enter_block(key, mod)

    def make_post(label: str, captured: bool) -> Any:
        """A block's forward hook: leave the block, report its output if captured."""
        weights = step.weights

        def post(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            key = _current_key()
            if not key:
                return
            with no_function_mode():
                weights.exit_block(key, mod)
                if captured:
                    on_output(key, label, args, kwargs, output)
                if segments:
                    # Read after the output: a hand-over in `on_output` (park budget) may have
                    # let the other side run the block and drop the casts already.
                    step.boundary(key, weights.keeps(mod))

        return post

    # A captured module that is no block reports its outputs from an instance forward
    # (`_reporting_forwards`), not a forward hook: any hook puts every call of its module on
    # `Module._call_impl`'s slow path. Blocks keep their hooks (the casts enter and leave there).
    # Installed inside the `try`: a names_filter that raises part-way must not leave the blocks
    # it already hooked (their hooks would wait for this dead run's baton in the next pair).
    try:
        reporting: list[tuple[torch.nn.Module, str]] = []
        for name, module in run.view_a.named_modules:
            label = name or ROOT
            captured = run.names_filter is None or run.names_filter(label)
            block = id(module) in blocks
            if block:
                handles.append(module.register_forward_pre_hook(pre, prepend=True))
                handles.append(
                    module.register_forward_hook(make_post(label, captured), with_kwargs=True)
                )
            elif captured:
                reporting.append((module, label))
        per_side = {k: (s.engine_ops, s.op_switches) for k, s in step.sides.items()}
        start = time.perf_counter()
        # The lockstep's own set-up: its state, the C++ core, the blocks' hooks.
        run.timings["install_s"] = run.timings.get("install_s", 0.0) + start - entered
        with contextlib.ExitStack() as stack:
            stack.enter_context(step.weights.applied())
            modules = (m for _, m in run.view_a.named_modules)
            stack.enter_context(ops_dispatched(model, per_side, _current_key, modules))
            # After the engine-op forwards: each wraps whatever forward the module has now.
            stack.enter_context(_reporting_forwards(reporting, on_output))
            if not step.sdpa_per_turn:
                stack.enter_context(sdpa_context(run.side_a.attention_backend))
            _run_sides(step)
    finally:
        for h in handles:
            h.remove()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    # Added up over a run that ran again (an output edited in place): every try's time.
    run.timings["lockstep_s"] = run.timings.get("lockstep_s", 0.0) + time.perf_counter() - start
    handled, handed = core.counts() if core is not None else (0, None)
    run.core.update(path="cxx" if core is not None else "python", cxx_outputs=handled,
                    python_outputs=handed, handovers=step.handovers,
                    park_budget=step.budget, pinned_cpu=step.pinned_cpu,
                    pin=step.pin)  # fmt: skip
    if step.probes:
        # How much faster the chosen core ran the probe than the median probed one.
        fast, median = min(step.probes.values()), statistics.median(step.probes.values())
        # The chosen core's probe and the median probed one's, in microseconds: a run's speed
        # next to another run's (or another call's) on the same loop.
        run.core.update(probed_cpus=len(step.probes), probe_speedup=median / fast,
                        probe_s=step.probe_s, probe_fastest_us=fast * 1e6,
                        probe_median_us=median * 1e6)  # fmt: skip
    if step.errors:
        key, err = next(iter(step.errors.items()))  # the side that failed first
        run.phase["side"] = step.sides[key].name
        raise err
    step.leftovers()

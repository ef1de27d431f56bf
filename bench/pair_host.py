"""Where a paired forward's host time goes, function by function (issue 16).

    python bench/pair_host.py OUT_DIR [--families sd3,qwen_image] [--device cuda] [--repeat 5]
        [--ablate] [--gpu-profile]

A short forward is host-bound (sd3 full on an H200: the GPU is busy half of its plain forward),
so what a pair adds is host time, and cProfile, which taxes every call, distorts exactly that.
Here each function of the pairing path is wrapped once (two clock reads a call) and its
inclusive host time added up over one pair; the wall times of the cases come from unwrapped
runs. For each family, in one process:
- wall time, median of --repeat interleaved rounds after one untimed run of each: `plain` (both
  sides' `lab.forward_side` with streamed views), and `lab.pair(stream=True)` capturing
  `nothing`, the `blocks` and `every` module;
- per case, one wrapped pair: calls and milliseconds a function (`functions`) and the pair's
  phases (`phases_ms`: set-up before the strategy, the lockstep run, the Result after it).
Inclusive times nest (`compare` holds `_reduce_on_device`, which holds `_flush_device`), and a
side's `_pause` holds its wait for the other side (`wait`), which is the other side's forward.
With --ablate, three more every-module cases (wall time only; their numbers are not a Result
to read): `every_noreduce` (the metric reduction replaced by constants), `every_noflow` (no
dtype-flow record) and `every_hooksonly` (the pairing hook returns at once: no parking, no
hand-overs), so each part's share is the difference to `every`.

With --gpu-profile (CUDA), one more run of `plain`, `nothing`, `every` (and `every_noreduce`
with --ablate) under `torch.profiler`, CUDA activity only: the GPU's busy time (union of kernel
intervals), the metric kernels' share and the span from the first kernel to the last
(`{case}_gpu_*`). A case whose wall time exceeds its GPU busy time waits for the host. (This
was bench/pair_breakdown.py.)

On CUDA the family's `full` preset is used. On CPU it is a deep tiny model: the tiny preset's
widths with the full preset's layer counts (every `*layers*` key), so the module tree and the
pair count are full size's while the forward stays cheap (sd3: 1217 pairs, as at full).
Writes OUT_DIR/pair_host.json after every family.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import lab
from lab.pairing import _fused_stats, collect, dtype_flow, lockstep, weights
from lab.pairing import run as run_module
from lab.pairing.state import sync
from lab.pairing.weights import WeightView

WRAPPED: tuple[tuple[Any, str], ...] = (
    (lockstep._Lockstep, "_on_output"),
    (lockstep._Lockstep, "_pause"),
    (lockstep._Lockstep, "_check_parked"),
    (lockstep._Lockstep, "leftovers"),
    (lockstep._Baton, "wait"),
    (dtype_flow.FlowRecorder, "record"),
    (dtype_flow.FlowRecorder, "note_output"),
    (collect.Aliases, "name"),
    (collect.Collector, "compare"),
    (collect.Collector, "_reduce_on_device"),
    (collect.Collector, "_flush_device"),
    (collect.Collector, "flush"),
    (collect.Collector, "rows"),
    (_fused_stats.RunReducer, "reduce_many"),
    (weights.PairedWeights, "enter_block"),
    (weights.PairedWeights, "exit_block"),
    (weights.PairedWeights, "activate"),
    (lockstep, "_run_sides"),
)
"""(owner, attribute) of each function whose inclusive host time is added up."""

METRIC_KERNELS = ("multi_pair", "pair_stats", "finish")
"""Name parts of the metric kernels (the fused kernels and their finishing launches)."""


def gpu_time(prof: Any) -> dict[str, float]:
    """Busy seconds (union of kernel intervals), metric-kernel seconds, first-to-last span."""
    intervals, metric = [], 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            start, end = event.time_range.start, event.time_range.end
            intervals.append((start, end))
            if any(k in event.name for k in METRIC_KERNELS):
                metric += end - start
    intervals.sort()
    busy, open_start, open_end = 0.0, None, None
    for start, end in intervals:
        if open_end is None or start > open_end:
            if open_end is not None:
                busy += open_end - open_start
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_end is not None:
        busy += open_end - open_start
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    return {"busy_s": busy / 1e6, "metric_s": metric / 1e6, "span_s": span / 1e6,
            "kernels": len(intervals)}  # fmt: skip


def round_orders(keys: list[str], rounds: int) -> list[list[str]]:
    """The order of `keys` in each of `rounds` interleaved rounds: a balanced Latin square.

    Williams' design: its first row is 0, 1, n-1, 2, n-2, ...; row i adds i to each (mod n);
    for an odd n the rows reversed follow. Over each cycle of its rows (n, or 2n for an odd n)
    every case runs first equally often and right after each other case equally often, so
    what one case leaves behind (a large Result to free, the allocator's cache, a core's
    state) lands on each of the others alike. A rotation (row i starting at case i, the rest
    in their cyclic order) keeps each case after the same one in every round but one in n.
    """
    n = len(keys)
    first = [0]
    for step in range(1, n):
        first.append((step + 1) // 2 if step % 2 else n - step // 2)
    rows = [[(j + i) % n for j in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[keys[j] for j in rows[r % len(rows)]] for r in range(rounds)] if n else []


def timed_rounds(
    cases: dict[str, Callable[[], Any]],
    rounds: int,
    device: str,
    run: Callable[[str, int, Callable[[], Any]], Any] | None = None,
) -> dict[str, list[float]]:
    """Each case's seconds over `rounds` interleaved rounds (orders from `round_orders`), the
    device synced before and after each run. `run(key, round, fn)` runs one case where a bench
    does more than call it (e.g. reads its peak in the last round); default `fn()`."""
    times: dict[str, list[float]] = {key: [] for key in cases}
    for round_, order in enumerate(round_orders(list(cases), rounds)):
        for key in order:
            sync(device)
            start = time.perf_counter()
            if run is None:
                cases[key]()
            else:
                run(key, round_, cases[key])
            sync(device)
            times[key].append(time.perf_counter() - start)
    return times


def core_jiffies() -> list[tuple[int, int]] | None:
    """Each CPU's (busy, steal) clock ticks since boot from /proc/stat, by CPU number (None
    where /proc/stat is not there). Busy is every state but idle and iowait, whatever ran."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    per_cpu: dict[int, tuple[int, int]] = {}
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        ticks = [int(f) for f in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        steal = ticks[7] if len(ticks) > 7 else 0
        # guest time is already counted in user; steal is time the hypervisor ran others
        per_cpu[int(name[3:])] = (sum(ticks[:8]) - idle - steal, steal)
    return [per_cpu.get(i, (0, 0)) for i in range(max(per_cpu) + 1)] if per_cpu else None


def _thread_cpu_s(thread: threading.Thread) -> float | None:
    """CPU seconds `thread` has run (None: gone, or no per-thread clock here)."""
    if not thread.is_alive():  # an ended thread's id may name another thread by now
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
    except (AttributeError, OSError, TypeError):
        return None


class RunClock:
    """Where one run's time went on the host: its wall time, the CPU time of the calling
    thread and of the kept side threads (`lockstep._WORKERS`), and, for the core the run
    used, how busy that core was (any process) and how much the hypervisor stole from it.

    A pair's forwards run on its side threads, pinned to one core: when that core is busy
    with something else, or stolen, the pair waits, and its wall time grows while its own CPU
    time does not. `record(cpu)` says which of those a run met.

        with RunClock() as clock:
            fn()
        clock.record(cpu)

    (or `start()` and `stop()` around the run; `stop` always runs on leaving the block, so the
    collector's callback never outlives the run, even when it raises).
    """

    TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)

    def __init__(self) -> None:
        self._start: tuple[float, float, float | None, Any, int | None, float] | None = None
        self._stop: tuple[float, float, float | None, Any, int | None, float] | None = None
        self._gc: list[tuple[int, float]] = []
        """(generation, seconds) of each collection the garbage collector ran in the run."""
        self._gc_began: float | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self._gc.append((info["generation"], time.perf_counter() - self._gc_began))
            self._gc_began = None

    @staticmethod
    def _side_cpu_s() -> float | None:
        threads = [w.thread for w in lockstep._WORKERS._workers.values()]
        cpu = [_thread_cpu_s(t) for t in threads]
        return sum(c for c in cpu if c is not None) if threads and None not in cpu else None

    def _sample(self) -> tuple[float, float, float | None, Any, int | None, float]:
        # time.time(): the epoch, to set a run against `bench/host_watch.py`'s samples.
        return (time.perf_counter(), time.thread_time(), self._side_cpu_s(), core_jiffies(),
                lockstep.current_cpu(), time.time())  # fmt: skip

    def start(self) -> None:
        """Read every clock before the run, and time the garbage collector's runs in it."""
        self._gc = []
        gc.callbacks.append(self._on_gc)
        self._start = self._sample()

    def stop(self) -> None:
        """Read every clock after the run."""
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        self._stop = self._sample()

    def __enter__(self) -> RunClock:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def record(self, cpu: int | None = None) -> dict[str, Any]:
        """The run's figures; `cpu`: the core to read (default: the calling thread's at the
        start, which is where a plain forward ran unless it moved: `cpu_end` says)."""
        if self._start is None or self._stop is None:
            raise RuntimeError("RunClock.record: call start() and stop() around the run first.")
        (w0, t0, s0, j0, c0, e0), (w1, t1, s1, j1, c1, e1) = self._start, self._stop
        row: dict[str, Any] = {"wall_s": w1 - w0, "thread_cpu_s": t1 - t0, "t0": e0, "t1": e1,
                               "side_cpu_s": None if s0 is None or s1 is None else s1 - s0,
                               "cpu_start": c0, "cpu_end": c1}  # fmt: skip
        # The collector's runs in the run, whichever thread triggered them: full ones (the
        # oldest generation) walk every tracked object of the process.
        row["gc_s"] = sum(seconds for _, seconds in self._gc)
        row["gc_full"] = sum(1 for generation, _ in self._gc if generation == 2)
        row["gc_full_s"] = sum(seconds for generation, seconds in self._gc if generation == 2)
        core = c0 if cpu is None else cpu
        row["cpu"] = core
        if j0 is not None and j1 is not None and core is not None and core < min(len(j0), len(j1)):
            busy = [(b1 - b0) * self.TICK_S for (b0, _), (b1, _) in zip(j0, j1, strict=False)]
            steal = [(s1_ - s0_) * self.TICK_S for (_, s0_), (_, s1_) in zip(j0, j1, strict=False)]
            row["core_busy_s"], row["core_steal_s"] = busy[core], steal[core]
            row["host_steal_s"] = sum(steal)
            # Every CPU's busy seconds (any process): what else ran beside the run, e.g. on
            # the core's hyperthread sibling.
            row["cores_busy_s"] = [round(b, 2) for b in busy]
        return row


def vs_plain(times: dict[str, list[float]]) -> dict[str, float]:
    """For each case of `times` (which holds `plain`): its median and minimum seconds, their
    ratios to plain's, and the median over rounds of each round's own ratio."""
    plain = times["plain"]
    row: dict[str, float] = {}
    for key, values in times.items():
        row[f"{key}_s"] = statistics.median(values)
        row[f"{key}_min_s"] = min(values)
        row[f"{key}_vs_plain"] = row[f"{key}_s"] / statistics.median(plain)
        row[f"{key}_vs_plain_min"] = row[f"{key}_min_s"] / min(plain)
        row[f"{key}_vs_plain_rounds"] = statistics.median(
            c / p for c, p in zip(values, plain, strict=True)
        )
    return row


def bootstrap_interval(
    statistic: Callable[[list[int]], float],
    rounds: int,
    level: float = 0.95,
    draws: int = 2000,
    seed: int = 0,
) -> list[float] | None:
    """The central `level` of `statistic(picked rounds)` over `draws` draws of `rounds` round
    indices with replacement (a round's cases stay together, as they ran). Seeded: the same
    times give the same interval. None under 5 rounds, where the draws repeat a handful of
    values."""
    if rounds < 5:
        return None
    rng = random.Random(seed)
    drawn = sorted(statistic([rng.randrange(rounds) for _ in range(rounds)]) for _ in range(draws))
    tail = (1 - level) / 2
    return [drawn[int(tail * (draws - 1))], drawn[math.ceil((1 - tail) * (draws - 1))]]


def against(times: dict[str, list[float]], case: str, base: str) -> dict[str, Any]:
    """`case` against `base`, both timed in the same rounds: the medians' ratio with its 95 %
    bootstrap interval, and the rounds in which `case` was the faster."""
    a, b = times[case], times[base]
    median = statistics.median

    def ratio(picked: list[int]) -> float:
        return median(a[i] for i in picked) / median(b[i] for i in picked)

    return {
        f"{case}_vs_{base}": ratio(list(range(len(a)))),
        f"{case}_vs_{base}_ci": bootstrap_interval(ratio, len(a)),
        f"{case}_faster_than_{base}_rounds": sum(x < y for x, y in zip(a, b, strict=True)),
    }


def deep_tiny(fam: Any, variant: str | None = None) -> Any:
    """`fam` with its tiny preset given the full preset's layer counts (every `*layers*` key;
    `variant`: the variant's full layer counts, e.g. sd3 large's 38 blocks)."""
    full = fam.config("full", variant)
    tiny = {**fam.presets["tiny"], **{k: v for k, v in full.items() if "layers" in k}}
    return dataclasses.replace(fam, presets={**fam.presets, "tiny": tiny})


@contextlib.contextmanager
def timed_functions(counts: Counter, millis: Counter) -> Iterator[None]:
    """Wrap every WRAPPED function to add its calls and inclusive host ms; unwrap on exit."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in WRAPPED]
    clock = time.perf_counter_ns
    lock = threading.Lock()  # the side threads hand over mid-call: no lost updates

    def wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = (clock() - start) / 1e6
                with lock:
                    millis[name] += elapsed
                    counts[name] += 1

        return timed

    try:
        for owner, name, fn in saved:
            setattr(owner, name, wrap(fn, name))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextlib.contextmanager
def phase_marks(marks: dict[str, float]) -> Iterator[None]:
    """Record when `pair` hands over to its strategy and gets control back."""
    strategy = run_module._run_strategy

    def marked(*args: Any, **kwargs: Any) -> Any:
        marks["strategy_start"] = time.perf_counter()
        try:
            return strategy(*args, **kwargs)
        finally:
            marks["strategy_end"] = time.perf_counter()

    run_module._run_strategy = marked
    try:
        yield
    finally:
        run_module._run_strategy = strategy


def breakdown(fn: Callable[[], Any], device: str) -> dict[str, Any]:
    """One wrapped run of `fn`: its wall ms, its phases and its functions' calls and ms."""
    counts: Counter = Counter()
    millis: Counter = Counter()
    marks: dict[str, float] = {}
    with timed_functions(counts, millis), phase_marks(marks):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        end = time.perf_counter()
    phases = {}
    if marks:
        phases = {
            "setup": (marks["strategy_start"] - start) * 1e3,
            "strategy": (marks["strategy_end"] - marks["strategy_start"]) * 1e3,
            "result": (end - marks["strategy_end"]) * 1e3,
        }
    return {
        "wall_ms": (end - start) * 1e3,
        "phases_ms": {k: round(v, 3) for k, v in phases.items()},
        "functions": {k: {"calls": counts[k], "ms": round(millis[k], 3)} for k in counts},
    }


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` set to `value` for the block."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def ablations(run: Callable[[], Any], device: str) -> dict[str, Callable[[], Any]]:
    """The every-module pair `run` with one part of its host work taken out (see --ablate)."""
    from lab.pairing.metrics import STAT_FIELDS, ULP_BIN_EDGES

    stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=device)
    hist = torch.zeros(len(ULP_BIN_EDGES), dtype=torch.float64, device=device)

    def constant(self: Any, pending: Any, *args: Any) -> None:
        pending.stats, pending.hist = stats, hist

    def constant_pair(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return stats, hist

    def constant_segments(pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.expand(len(pairs), -1), hist.expand(len(pairs), -1)

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    def under(*swaps: tuple[Any, str, Any]) -> Callable[[], Any]:
        def ablated() -> Any:
            with contextlib.ExitStack() as stack:
                for swap in swaps:
                    stack.enter_context(replaced(*swap))
                return run()

        return ablated

    flow = dtype_flow.FlowRecorder
    return {
        # CUDA pairs go through `_reduce_on_device`; CPU pairs are batched (`segment_stats`)
        # or, from 1M elements on, reduced on arrival (`pair_stats`).
        "every_noreduce": under(
            (collect.Collector, "_reduce_on_device", constant),
            (collect, "pair_stats", constant_pair),
            (collect, "segment_stats", constant_segments),
        ),
        "every_noflow": under((flow, "record", nothing), (flow, "note_output", nothing)),
        "every_hooksonly": under((lockstep._Lockstep, "_on_output", nothing)),
    }


def side_runs(
    fam: Any, model: torch.nn.Module, inputs: Any, device: str
) -> tuple[Callable[[], None], Callable[[Callable[[str], bool] | None], Callable[[], Any]]]:
    """The cases' two ways to run the default sides: both plain, and paired.

    Returns `plain` (each side's `lab.forward_side` with a streamed view, the full-size
    baseline) and `paired(names_filter)`, a streamed `lab.pair` capturing what the filter
    passes (None: every module).
    """
    a, b = lab.Side.rollout(fam, device=device), lab.Side.trainer(fam, device=device)
    views = {s.name: WeightView(model, s, stream_classes=fam.block_classes) for s in (a, b)}

    def plain() -> None:
        for side in (a, b):
            lab.forward_side(model, inputs, side, view=views[side.name])

    def paired(names_filter: Callable[[str], bool] | None) -> Callable[[], Any]:
        return lambda: lab.pair(
            model, inputs, a, b, stream=True, names_filter=names_filter, check_outputs=False
        )

    return plain, paired


def rows_per_family(
    out: str, families: str, device: str, measure: Callable[[str], dict[str, Any]]
) -> None:
    """`measure(name)` for each comma-separated family: a rounded JSON line printed (without the
    per-run `*_times_s`) and OUT.json (`{"meta", "rows"}`) written after each, the CUDA cache
    emptied between families; a family that fails gets a row naming its error, and the next
    one runs. On CPU the
    pairs keep their side threads, as on CUDA (the interleaved benches' --device cpu)."""
    if device == "cpu":
        lockstep.KEEP_WORKERS_ON = (*lockstep.KEEP_WORKERS_ON, "cpu")
    rows = []
    for name in families.split(","):
        try:
            row = measure(name)
        except Exception as err:  # keep the other families' figures
            row = {"family": name, "error": f"{type(err).__name__}: {err}"}
        shown = {k: v for k, v in row.items() if not k.endswith("_times_s")}
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in shown.items()}),
              flush=True)  # fmt: skip
        rows.append(row)
        meta = {"torch": torch.__version__}
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if device == "cuda":
            torch.cuda.empty_cache()


def family_case(name: str, device: str) -> tuple[Any, str, torch.nn.Module, Any]:
    """(family, preset label, model, inputs): the `full` preset on CUDA, else a deep tiny one.
    `name` may name a variant, "sd3:large" (on CPU: the tiny width at the variant's depth)."""
    name, _, variant_name = name.partition(":")
    variant = variant_name or None
    fam = lab.family(name)
    fam.config("full", variant)  # an unknown variant raises here, naming the known ones
    expert = fam.expert_for_sigma(0.75)
    if device == "cuda":
        model = fam.build("full", 0, device="cuda", expert=expert, variant=variant)
        return fam, "full", model, fam.make_inputs("full", 0, device="cuda", variant=variant)
    fam = deep_tiny(fam, variant)
    # The variant's depth is in the tiny preset now; its other overrides are full-size widths.
    model = fam.build("tiny", 0, expert=expert)
    return fam, "tiny (full layer counts)", model, fam.make_inputs("tiny", 0)


def measure(
    name: str, device: str, repeat: int, ablate: bool = False, gpu_profile: bool = False
) -> dict[str, Any]:
    """The wall times and host breakdowns of one family (see the module docstring)."""
    fam, preset, model, inputs = family_case(name, device)
    plain, paired = side_runs(fam, model, inputs, device)
    block_names = {
        n
        for n, m in model.named_modules()
        if type(m).__name__ in fam.block_classes and n.count(".") <= 1
    }

    cases = {
        "plain": plain,
        "nothing": paired(lambda n: False),
        "blocks": paired(block_names.__contains__),
        "every": paired(None),
    }
    if ablate:
        cases.update(ablations(cases["every"], device))
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeat):
        for key, fn in cases.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[key].append(time.perf_counter() - start)
    pairs = len(cases["every"]().rows)
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "pairs": pairs,
                           "repeat": repeat}  # fmt: skip
    plain_s = statistics.median(times["plain"])
    for key, values in times.items():
        row[f"{key}_s"] = statistics.median(values)
        row[f"{key}_vs_plain"] = row[f"{key}_s"] / plain_s
    for key in times:
        if key.startswith("every"):
            row[f"{key}_us_per_pair_over_nothing"] = (
                (row[f"{key}_s"] - row["nothing_s"]) / pairs * 1e6
            )
    for key in ("nothing", "blocks", "every"):
        row[f"host_{key}"] = breakdown(cases[key], device)
    if gpu_profile:
        for key in ("plain", "nothing", "every", "every_noreduce"):
            if key not in cases:
                continue
            sync(device)
            activity = [torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activity) as prof:
                cases[key]()
                sync(device)
            for field, value in gpu_time(prof).items():
                row[f"{key}_gpu_{field}"] = value
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3,cosmos3,qwen_image,flux")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ablate", action="store_true", help="add the ablated every-module cases")
    parser.add_argument(
        "--gpu-profile", action="store_true", help="add each case's GPU busy time (CUDA only)"
    )
    args = parser.parse_args()
    if args.gpu_profile and args.device != "cuda":
        parser.error(f"--gpu-profile reads CUDA kernel times; --device is {args.device!r}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.families.split(","):
        rows.append(measure(name, args.device, args.repeat, args.ablate, args.gpu_profile))
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("host_")}))
        (out / "pair_host.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

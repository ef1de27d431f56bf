"""Interleaved rounds for the benches: orders, per-run clocks, ratios and their intervals.

The host-bound pairs move by 10-30 % from one device call to the next with the same code, so a
bench times its cases side by side in one process, in interleaved rounds whose orders form a
balanced Latin square (`round_orders`), and reports each case against the plain forwards by the
medians, the minima and each round's own ratio, with a bootstrap interval over the rounds
(`bootstrap_interval`). `RunClock` records where one run's time went on the host. Used by
bench/full_size.py and bench/ab_switch.py.

On CUDA a bench's family case is the `full` preset. On CPU it is a deep tiny model
(`deep_tiny`): the tiny preset's widths with the full preset's layer counts (every `*layers*`
key), so the module tree and the pair count are full size's while the forward stays cheap.
"""

from __future__ import annotations

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lab
from lab.pairing import lockstep
from lab.pairing.state import sync
from lab.pairing.weights import WeightView


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
        # time.time(): the epoch, to set a run against samples taken outside the process.
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

"""The pairing path's own host time, without the forwards around it (issue 16).

    python bench/pair_replay.py OUT.json [--families sd3] [--device cuda] [--rounds 7]

A short full-size forward is host-bound (sd3 on the H200: the plain forwards' host thread is
busy for their whole wall time), so what a pair adds is host work, and timing it inside a
pair mixes it with the forwards it interleaves with: on the H200 host the same pair moves by
10-20 % from call to call. Here one every-module `lab.pair(stream=True)` runs with its
`_Lockstep._on_output` calls recorded (side, module, arguments, output: every output of both
sides stays referenced), then those calls are made again, in the order they came, on a fresh
`_Lockstep` of the same run with its hand-overs taken out: parking, matching, the dtype-flow
record, alias names, `Collector.compare` and, on CUDA, the metric batches (tables, launches,
`record_stream`) run as in the pair, and nothing else does. Per family, the minimum over
--rounds of:
- `full`: the replay as it is, through the Python per-output path (`*_loop_ms`: the calls and
  the last batch; `*_rows_ms`: the Result's rows after a sync, `Collector.rows`);
- `cxx`: the same through the C++ per-output path (`pair_core`; `cxx_matches`: its rows equal
  the pair's);
- `noflow`, `noaliases`, `nocompare`: with the dtype-flow record, the alias names or
  `Collector.compare` taken out; on CUDA also `noreduce` (`RunReducer.reduce_many` queues
  nothing) and `norecordstream`;
- `timed` (CUDA): the replay with the functions of the metric path wrapped: calls and
  milliseconds in its fastest round (`timed_ms`; the wrappers' own cost is in them).
`replay_matches` checks the replay against the pair: the same rows, metric for metric.

The recorded outputs must fit next to the model: on one H200, sd3 and cosmos3 full do, flux,
qwen_image, ltx2 and wan2_2 do not (their row holds the error). On CPU the family is a deep
tiny model (`pair_host.deep_tiny`: sd3 has full's 1217 pairs); --tiny takes the tiny preset.
Writes OUT.json after each family.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pair_host
import torch

from lab.pairing import _fused_stats, collect, dtype_flow, lockstep, pair_core
from lab.pairing.metrics import STAT_FIELDS
from lab.pairing.state import sync

Swap = tuple[Any, str, Any]


@contextlib.contextmanager
def swapped(swaps: list[Swap]) -> Iterator[None]:
    """Each `owner.name` set to its value for the block (`pair_host.replaced`, several)."""
    with contextlib.ExitStack() as stack:
        for swap in swaps:
            stack.enter_context(pair_host.replaced(*swap))
        yield


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def record(run_pair: Callable[[], Any]) -> tuple[Any, list[tuple], Any]:
    """Run the pair with its `_on_output` calls recorded: (Result, calls, the pair's run)."""
    calls: list[tuple] = []
    runs: list[Any] = []
    on_output = lockstep._Lockstep._on_output

    def recorded(self: Any, *args: Any) -> None:
        calls.append(args)
        if not runs:
            runs.append(self.run)
        on_output(self, *args)

    with swapped([(lockstep._Lockstep, "_on_output", recorded)]):
        result = run_pair()
    if not runs:
        raise RuntimeError("pair_replay: the pair made no _on_output call (nothing captured?)")
    return result, calls, runs[0]


def replay(
    run: Any, calls: list[tuple], device: str, core: bool = False
) -> tuple[float, float, list]:
    """The calls made again on a fresh `_Lockstep` of `run`: (loop s, rows s, rows).

    `core`: through the C++ per-output path (`pair_core.lockstep`) instead of the Python one.
    """
    run.collector.reset()
    run.flow.reset()
    step = lockstep._Lockstep(run, set(), False, True)
    run.flow.track(step.aliases["a"], step.inputs["a"].kwargs)
    step._pause = _nothing  # no other side to hand over to: it has run already
    step.budget = 1 << 62
    on_output = pair_core.lockstep(step) if core else step._on_output
    if on_output is None:
        raise RuntimeError("pair_replay: the C++ pairing path is off (LAB_PAIR_CORE=python)")
    sync(device)
    start = time.perf_counter()
    for args in calls:
        on_output(*args)
    run.collector._flush_device()
    loop = time.perf_counter() - start
    sync(device)
    start = time.perf_counter()
    rows = run.collector.rows()
    return loop, time.perf_counter() - start, rows


def variants(device: str, timings: dict[str, list]) -> dict[str, list[Swap]]:
    """The replay's cases: what each takes out (see the module docstring)."""
    flow = dtype_flow.FlowRecorder
    out: dict[str, list[Swap]] = {
        "full": [],
        "cxx": [],  # `full` through the C++ per-output path (`measure` passes core=True)
        "noflow": [(flow, "record", _nothing), (flow, "note_output", _nothing)],
        "noaliases": [(collect.Aliases, "name", _nothing)],
        "nocompare": [(collect.Collector, "compare", _nothing)],
    }
    if device != "cuda":
        return out
    zeros: list[tuple[torch.Tensor, torch.Tensor]] = []

    def queue_nothing(self: Any, pairs: list, on_side: bool = True) -> list[tuple[int, int]]:
        if not self._outputs:  # one row of zeros every pair points at
            if not zeros:
                zeros.append(
                    (torch.zeros(1, len(STAT_FIELDS), dtype=torch.float64, device=device),
                     torch.zeros(1, _fused_stats._BINS, dtype=torch.float64, device=device))
                )  # fmt: skip
            self._outputs.append(zeros[0])
        return [(0, 0)] * len(pairs)

    def timed(owner: Any, name: str) -> Swap:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = timings.setdefault(label, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        return owner, name, wrapper

    out["noreduce"] = [(_fused_stats.RunReducer, "reduce_many", queue_nothing)]
    out["norecordstream"] = [(torch.Tensor, "record_stream", _nothing)]
    out["timed"] = [
        timed(collect.Collector, "compare"),
        timed(collect.Collector, "_reduce_on_device"),
        timed(collect.Collector, "_flush_device"),
        timed(_fused_stats.RunReducer, "reduce_many"),
        timed(_fused_stats.RunReducer, "_plan"),
        timed(_fused_stats, "_read_in_place"),
        timed(_fused_stats, "_launch"),
        timed(torch.Tensor, "record_stream"),
        timed(torch, "empty"),
        timed(torch.Tensor, "to"),
    ]
    extension = pair_core.extension()
    if extension is not None:  # the C++ path copies through its own `read_in_place`
        out["timed"].append(timed(extension, "read_in_place"))
    return out


def measure(name: str, device: str, rounds: int, tiny: bool = False) -> dict[str, Any]:
    """One family's row (see the module docstring)."""
    if tiny:
        import lab

        fam = lab.family(name)
        model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
        preset = "tiny"
    else:
        fam, preset, model, inputs = pair_host.family_case(name, device)
    plain, paired = pair_host.side_runs(fam, model, inputs, device)
    result, calls, run = record(paired(None))
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "rounds": rounds,
                           "pairs": len(result.rows), "calls": len(calls)}  # fmt: skip
    times = []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        plain()
        sync(device)
        times.append(time.perf_counter() - start)
    row["plain_s"] = min(times)
    timings: dict[str, list] = {}
    fastest: dict[str, list] = {}
    for case, swaps in variants(device, timings).items():
        loops, rows_s = [], []
        for _ in range(rounds):
            timings.clear()
            with swapped(swaps):
                loop, rows_time, rows = replay(run, calls, device, core=case == "cxx")
            if case == "cxx" and "cxx_matches" not in row:
                row["cxx_matches"] = [r.metrics for r in rows] == [r.metrics for r in result.rows]
            if case == "timed" and (not loops or loop < min(loops)):
                fastest = {label: list(entry) for label, entry in timings.items()}
            loops.append(loop)
            rows_s.append(rows_time)
            if case == "full" and "replay_matches" not in row:
                row["replay_matches"] = [r.metrics for r in rows] == [
                    r.metrics for r in result.rows
                ]
        row[f"{case}_loop_ms"] = min(loops) * 1e3
        row[f"{case}_us_per_pair"] = min(loops) / len(result.rows) * 1e6
        row[f"{case}_rows_ms"] = min(rows_s) * 1e3
    row["timed_ms"] = {  # in the fastest round of `timed`
        label: {"calls": count, "ms": round(seconds * 1e3, 3)}
        for label, (count, seconds) in fastest.items()
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--families", default="sd3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="the tiny preset (CPU)")
    args = parser.parse_args()
    rows = []
    for name in args.families.split(","):
        try:
            row = measure(name, args.device, args.rounds, args.tiny)
        except torch.OutOfMemoryError as err:  # the recorded outputs did not fit
            row = {"family": name, "device": args.device, "error": str(err).splitlines()[0]}
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)  # fmt: skip
        rows.append(row)
        Path(args.out).write_text(json.dumps({"meta": {"torch": torch.__version__}, "rows": rows},
                                             indent=1))  # fmt: skip
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

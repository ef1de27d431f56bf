"""Every family at full size on one GPU: paired forwards against two plain forwards.

    python bench/full_size.py OUT_DIR [--families flux,sd3,sd3:large,...] [--dump sd3] [--repeat 7]
        [--round-seconds 15] [--fixed-order] [--no-plain-fastest] [--sharded on|off]
    python bench/full_size.py --table OUT_DIR/full_size.json   # the table of a written run

For each family's `full` preset (seeded weights, the lab's own inputs), measured side by side in
one process, warm (one untimed run of each case first, so one-off kernel compilation and
autotuning are never timed):
- `plain`: each side's `lab.forward_side` over the resident fp32 master with a streamed view,
  the limit pairing is measured against; peak memory of each;
- `every_module`: `lab.pair` with every module output compared (streamed, lockstep);
- `blocks_only`: the same, comparing only the outputs of the family's blocks;
- the first (cold) `every_module` run separately, as `every_module_cold_s`;
- the four timed cases (plain a, plain b, every module, blocks only) run in rounds, one of each
  case a round, `--repeat` rounds or as many as fill `--round-seconds` (`runs_for`; one where
  the forwards take seconds): a burst of host noise
  (the short forwards' plain time moves by 70 % between runs on the H200's host) lands on every
  case alike instead of on one case's runs. The rounds' orders form a balanced Latin square
  (`rounds.round_orders`): over each 4 rounds every case runs right after each other case
  once (`--fixed-order`: plain a, plain b, every module, blocks only in every round). Each
  case keeps `{case}_times_s`; `{case}_vs_plain` is the medians' ratio, `{case}_vs_plain_min`
  the minima's, and `{case}_vs_plain_rounds` the
  median over rounds of the round's own ratio, `{case}_vs_plain_ci` the first's 95 % bootstrap
  interval over the rounds (`ratio_interval`);
- for the families in `--dump` (default sd3): the block outputs dumped to disk per side and
  compared afterwards (`bench/full_pair.py`'s `dump_then_compare`), against `blocks_only`.
A family may name a variant, `sd3:large`.
Then the sharded MiniMax H3 case (`--sharded on`, the default; it runs when the machine has
two GPUs): its trained master, which one GPU refuses, paired with `lab.fsdp.pair_sharded`.
Writes OUT_DIR/full_size.json after every family (a run cut short keeps its figures), with the
ratios (`every_module_vs_plain`, `blocks_only_vs_plain`, `peak_vs_plain`), the pair counts and
`meta["timings_s"]` of the paired runs, and each run's host clocks (`{case}_clocks`, with the
probe of the core it ran on, `probe_us`). An out-of-memory or other failure is recorded in the
row (`error`) and the next family runs. At the end (and with `--table`) it prints the ratios'
table and a second one of where the host's time went (`host_work`: each case's CPU seconds a
run, the every-module pair's CPU less the blocks-only pair's, a pair's share of it, and the
cores' probes).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from full_pair import dump_then_compare  # bench/ is this script's folder
from rounds import RunClock, bootstrap_interval, round_orders

import lab
from lab.pairing.lockstep import fastest_cpu, restore_affinity
from lab.pairing.weights import WeightView


def _timed(fn: Any, repeat: int, cuda: bool | None = None) -> tuple[float, float, Any]:
    """Median seconds over `repeat` runs, the peak GiB over them (0 off CUDA), the last value.

    `cuda`: whether `fn` runs on CUDA (synced, its peak read); None: wherever CUDA is there.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    times, peak, value = [], 0.0, None
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        value = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
    return statistics.median(times), peak, value


def in_rounds(
    cases: dict[str, Callable[[], Any]], repeat: int, rotate: bool = True, cuda: bool | None = None
) -> tuple[dict[str, list[float]], dict[str, float], dict[str, Any]]:
    """`repeat` rounds of every case in turn: each case's seconds, its peak GiB, its last value.

    `rotate`: the rounds' orders from `rounds.round_orders` (each case after each other
    case equally often, so what one leaves behind, such as a large Result to free or the
    allocator's cache, lands on each of the others alike). False: the cases' order in every
    round.
    """
    times: dict[str, list[float]] = {key: [] for key in cases}
    peaks = dict.fromkeys(cases, 0.0)
    last: dict[str, Any] = {}
    keys = list(cases)
    orders = round_orders(keys, repeat) if rotate else [keys] * repeat
    for order in orders:
        for key in order:
            fn = cases[key]
            last.pop(key, None)  # a case's earlier value is not held through its next run
            seconds, peak, last[key] = _timed(fn, 1, cuda)
            times[key].append(seconds)
            peaks[key] = max(peaks[key], peak)
    return times, peaks, last


def ratios(times: dict[str, list[float]], case: str) -> dict[str, Any]:
    """`case` against the two plain forwards: medians, minima, the median round's ratio, and
    the medians' ratio's 95 % interval over the rounds (`ratio_interval`; None under 5 rounds)."""
    plain = [a + b for a, b in zip(times["plain_a"], times["plain_b"], strict=True)]
    median = statistics.median
    return {
        f"{case}_vs_plain": median(times[case])
        / (median(times["plain_a"]) + median(times["plain_b"])),
        f"{case}_vs_plain_min": min(times[case]) / (min(times["plain_a"]) + min(times["plain_b"])),
        f"{case}_vs_plain_rounds": median(t / p for t, p in zip(times[case], plain, strict=True)),
        f"{case}_vs_plain_ci": ratio_interval(times, case),
    }


def ratio_interval(
    times: dict[str, list[float]], case: str, level: float = 0.95, draws: int = 2000, seed: int = 0
) -> list[float] | None:
    """A bootstrap interval of `case`'s medians' ratio to the plain forwards': the rounds drawn
    again with replacement `draws` times (`rounds.bootstrap_interval`: a round's cases
    together, as they ran), the ratio of the drawn rounds' medians each time, and the central
    `level` of those ratios. How far one call's median can be trusted when a shared host's
    cores move the short forwards by tens of percent from run to run. Seeded: the same times
    give the same interval. None under 5 rounds."""
    runs, a, b = times[case], times["plain_a"], times["plain_b"]
    median = statistics.median

    def ratio(picked: list[int]) -> float:
        plain = median(a[i] for i in picked) + median(b[i] for i in picked)
        return median(runs[i] for i in picked) / plain

    return bootstrap_interval(ratio, len(runs), level, draws, seed)


# MiniMax H3 full (33.1 B) fits one H200 only with a compact master: weights as a bf16
# checkpoint upcast to fp32 before any optimizer step (`init="bf16_shipped"`, every tensor exact at
# bf16, held there). With the default `trained` init one-GPU pairing refuses before building a
# side (tests/test_compact_master.py, gpu, prints the message).
INIT = {"minimax_h3": "bf16_shipped"}
FAMILIES_AFTER = ("cosmos3", "qwen_image", "ltx2", "wan2_2", "minimax_h3")
"""The default order after flux and sd3 (both variants): the forwards of seconds come last."""


ROUND_PER_PLAIN = 3.2
"""One round's seconds over one plain forward pair's: plain a + b, every module (~1.2x), blocks
only (~1.0x); `runs_for` sizes the rounds with it."""


def runs_for(
    warm_s: list[float], repeat: int, round_seconds: float = 0.0, most: int = 41, cycle: int = 4
) -> int:
    """Runs a case: 1 where the warm plain forwards take seconds (steady there); otherwise
    `repeat`, or more where `round_seconds` of rounds hold more: a short forward's rounds are
    cheap and its host's noise large, so its medians need many (sd3 full: ~0.5 s a round, 15 s
    of them is 32). Rounded up to whole cycles of the Latin square (`cycle` rounds, one per
    case), at most `most`. `warm_s` are the warm-up forwards of the two sides; the fastest
    stands for both (the first of a process may have paid CUDA's set-up)."""
    if min(warm_s) > 2.0:
        return 1
    if round_seconds <= 0:
        return repeat
    rounds = math.ceil(round_seconds / (ROUND_PER_PLAIN * 2 * min(warm_s)))
    if rounds <= repeat:
        return repeat
    return max(repeat, min(most, cycle * math.ceil(rounds / cycle)))


def measure(
    name: str,
    repeat: int,
    dump: bool = False,
    rotate: bool = True,
    preset: str = "full",
    device: str = "cuda",
    plain_fastest: bool = False,
    round_seconds: float = 0.0,
) -> dict[str, Any]:
    """One family (`name` or `name:variant`) at `preset` on `device` (the bench: full, CUDA;
    the tests: tiny, CPU); `dump`: add the dump-then-compare case; `rotate`: the rounds' order
    (`in_rounds`); `plain_fastest`: run each plain forward on the core `fastest_cpu` picks,
    as a pair's side threads are by default (LAB_PAIR_PIN=fastest); `round_seconds`: more than
    `repeat` rounds where that many seconds of them hold more (`runs_for`)."""
    name, _, variant = name.partition(":")
    variant = variant or None
    fam = lab.family(name)
    row: dict[str, Any] = {"family": name, "variant": variant, "preset": preset,
                           "init": INIT.get(name, "trained"),
                           "plain_pin": "fastest" if plain_fastest else "none"}  # fmt: skip
    start = time.perf_counter()
    model = fam.build(
        preset, 0, variant=variant, device=device, expert=fam.expert_for_sigma(0.75),
        init=row["init"],
    )  # fmt: skip
    row["build_s"] = time.perf_counter() - start
    row["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    cuda = torch.device(device).type == "cuda"
    row["resident_gib"] = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    inputs = fam.make_inputs(preset, 0, variant=variant, device=device)
    a, b = lab.Side.rollout(fam, device=device), lab.Side.trainer(fam, device=device)
    blocks = fam.block_classes
    views = {s.name: WeightView(model, s, stream_classes=blocks) for s in (a, b)}
    block_names = {
        n for n, m in model.named_modules() if type(m).__name__ in blocks and n.count(".") <= 1
    }

    def plain(side: lab.Side) -> tuple[int | None, float | None]:
        """One plain forward; the core it was pinned to and that core's probe in us (None, None:
        not pinned)."""
        # The output is dropped: the rounds' other cases must not hold it in their peaks.
        if not plain_fastest:
            lab.forward_side(model, inputs, side, view=views[side.name])
            return None, None
        # As a pair's side threads (LAB_PAIR_PIN=fastest): on the core that probes fastest
        # now, probe included, so the ratio is the pairing's cost, not the cores' lottery.
        cpu, probes = fastest_cpu()
        probe_us = probes[cpu] * 1e6 if cpu is not None else None
        mask = os.sched_getaffinity(0) if cpu is not None else None
        if cpu is not None:
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError:  # taken from the process since the probe: run where it is
                cpu = mask = probe_us = None
        try:
            lab.forward_side(model, inputs, side, view=views[side.name])
        finally:
            if mask is not None:
                restore_affinity(mask)  # as fastest_cpu gives a caller its CPU set back
        return cpu, probe_us

    def paired(names_filter: Any = None) -> Any:
        return lab.pair(model, inputs, a, b, stream=True, names_filter=names_filter)

    warm = []
    for side in (a, b):
        warm_s, _, _ = _timed(lambda s=side: plain(s), 1, cuda)  # warm-up
        if warm_s > 2.0:
            # The process's first forward pays one-time CUDA set-up (sd3 first: 4 s): again.
            warm_s, _, _ = _timed(lambda s=side: plain(s), 1, cuda)
        warm.append(warm_s)
    # A forward of seconds times steadily: one run of each case is enough there.
    repeat = runs_for(warm, repeat, round_seconds)
    row["repeat"] = repeat
    cold_s, _, _ = _timed(paired, 1, cuda)
    row["every_module_cold_s"] = cold_s
    paired(block_names.__contains__)  # warm-up
    case_pins: dict[str, list[int | None]] = {"every_module": [], "blocks_only": []}
    clocks: dict[str, list[dict[str, Any]]] = {}

    def clocked(case: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        # Each run's host clocks (`RunClock`): for a pair, on the core its side threads were
        # pinned to; for a plain forward, on the calling thread's core.
        def run() -> Any:
            with RunClock() as clock:
                value = fn()
            if case in case_pins:
                core = value.meta.get("pair_core", {})
                cpu, probe_us = core.get("pinned_cpu"), core.get("probe_fastest_us")
                case_pins[case].append(cpu)
            else:
                cpu, probe_us = value  # a plain forward's pinned core and its probe
            record = clock.record(cpu)
            # The core's probe (the same loop on every run): how fast the core ran this run.
            record["probe_us"] = probe_us
            if case in case_pins:
                record["timings_s"] = value.meta.get("timings_s")  # the pair's own phases
            clocks.setdefault(case, []).append(record)
            return value

        return run

    cases = {
        "plain_a": clocked("plain_a", lambda: plain(a)),
        "plain_b": clocked("plain_b", lambda: plain(b)),
        "every_module": clocked("every_module", paired),
        "blocks_only": clocked("blocks_only", lambda: paired(block_names.__contains__)),
    }
    times, peaks, results = in_rounds(cases, repeat, rotate=rotate, cuda=cuda)
    row["order"] = "rotated" if rotate else "fixed"
    for key in ("plain_a", "plain_b"):
        row[f"{key}_s"] = statistics.median(times[key])
        row[f"{key}_peak_gib"] = peaks[key]
    plain_peak = max(peaks["plain_a"], peaks["plain_b"])
    for case in ("every_module", "blocks_only"):
        result = results[case]
        row[f"{case}_s"] = statistics.median(times[case])
        row.update(ratios(times, case))
        row[f"{case}_peak_gib"] = peaks[case]
        row[f"{case}_peak_vs_plain"] = peaks[case] / plain_peak if plain_peak else None  # 0: CPU
        row[f"{case}_pairs"] = len(result.rows)
        row[f"{case}_timings_s"] = result.meta.get("timings_s")
        row[f"{case}_lockstep"] = result.meta.get("lockstep")
        if case == "every_module":
            row["model_output_rel_max"] = result.output_metrics()["model_output_rel_max"]
            row["master"] = result.meta.get("master")
        del result
    for key, seconds in times.items():
        row[f"{key}_times_s"] = seconds
    for case, cpus in case_pins.items():
        # The CPU each timed run's side threads were pinned to, round by round (None: not
        # pinned): a pair's host-bound time depends on its core.
        row[f"{case}_pinned_cpus"] = cpus
    for case, runs in clocks.items():
        # Round by round: wall (less the final sync), the calling and side threads' CPU
        # seconds, and that core's busy and stolen seconds (any process), `RunClock.record`.
        row[f"{case}_clocks"] = runs
    del results
    if dump:
        # Block outputs only: every module's outputs of a full forward are tens of GB a side.
        root = Path(tempfile.mkdtemp(prefix="lab-dump-"))
        try:
            row["dump_blocks_s"] = dump_then_compare(
                model, inputs, a, b, device, block_names.__contains__, root
            )
            row["dump_vs_blocks_only"] = row["dump_blocks_s"] / row["blocks_only_s"]
        except Exception as err:  # keep the family's measured cases
            row["dump_error"] = repr(err)[:300]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return row


def measure_sharded(
    nproc: int = 2, family: str = "minimax_h3", preset: str = "full", device: str = "cuda"
) -> dict[str, Any]:
    """MiniMax H3 full with its trained (off-grid) master, paired sharded across `nproc` GPUs.

    One GPU refuses it before building a side (`check_master_fits`: the fp32 master and the
    casts leave no room for two forwards); `lab.fsdp.pair_sharded` runs each side as an FSDP2
    job (one fully_shard per block) on `nproc` ranks and pairs the block outputs. Recorded: the
    wall time, each side's build/shard/forward seconds and per-rank peaks (the jobs' meta), the
    pairing time, the block pairs and the model output's rel_max. With fewer GPUs the row says
    so and why; where a rank fails, the row says where and keeps what was paired before it.
    (`family`, `preset`, `device`: another case through the same path, as the tests run it.)
    """
    row: dict[str, Any] = {"family": family, "preset": preset, "init": "trained",
                           "case": f"sharded_{nproc}gpu"}  # fmt: skip
    found = torch.cuda.device_count() if device == "cuda" else nproc
    if found < nproc:
        row["skipped"] = (
            f"needs {nproc} GPUs, found {found}: MiniMax H3 full with an fp32 master off the "
            "bf16 grid (trained init) does not fit one H200 next to two forwards, and one-GPU "
            "pairing refuses it before building a side (tests/test_compact_master.py)."
        )
        return row
    from lab.fsdp import ShardedPairError, pair_sharded

    start = time.perf_counter()
    try:
        result = pair_sharded(family, preset, nproc=nproc, device=device, capture_depth=1)
    except ShardedPairError as err:
        # What failed where, and what the ranks had done by then (the error's first line).
        row["error"] = str(err).splitlines()[0]
        row["failed"] = {"side": err.side, "module": err.module, "rank": err.rank,
                         "error_type": err.error_type}  # fmt: skip
        row["pairs_before_failure"] = None if err.result is None else len(err.result.rows)
        row["captured"] = [None if c is None else {"outputs": len(c.leaves), **{
            k: c.meta.get(k) for k in ("partial", "build_s", "shard_s", "forward_s")}}
            for c in err.captures]  # fmt: skip
        row["wall_s"] = time.perf_counter() - start
        return row
    row["wall_s"] = time.perf_counter() - start
    for key in ("fsdp2_a", "fsdp2_b"):
        job = result.meta.get(key, {})
        row[key] = {
            k: job.get(k)
            for k in ("build_s", "shard_s", "forward_s", "peak_memory_gib_per_rank", "world_size")
        }
    row["timings_s"] = result.meta.get("timings_s")
    row["pairs"] = len(result.rows)
    row["model_output_rel_max"] = result.output_metrics()["model_output_rel_max"]
    return row


def _name(row: dict[str, Any]) -> str:
    """A row's family as the tables name it: "sd3 large" for `sd3:large`."""
    return row["family"] + (f" {row['variant']}" if row.get("variant") else "")


def _cell(row: dict[str, Any], case: str) -> str:
    """`case`'s ratios in a table cell: median [interval] / min / rounds."""
    ci = row.get(f"{case}_vs_plain_ci")
    interval = f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
    return (
        f"{row[f'{case}_vs_plain']:.2f}x{interval} / {row[f'{case}_vs_plain_min']:.2f}x / "
        f"{row[f'{case}_vs_plain_rounds']:.2f}x"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The families' ratios as a Markdown table (docs/performance.md's): for each case the medians'
    ratio with its 95 % interval over the rounds, the minima's ratio and the median round's;
    the peaks against the larger plain peak; rounds run. A row that failed or skipped says so."""
    lines = [
        "| family | plain a + b | rounds | every module | blocks only | peak every / blocks |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        name = _name(row)
        if "pairs" in row and "wall_s" in row:  # the sharded case: no plain forwards to divide by
            lines.append(f"| {name} ({row['case']}) | {sharded_cell(row)} | | | | |")
            continue
        if "every_module_vs_plain" not in row:
            why = row.get("error") or row.get("skipped") or "no figures"
            if row.get("pairs_before_failure") is not None:
                why += f" ({row['pairs_before_failure']} block pairs kept)"
            lines.append(f"| {name} ({row.get('case', row.get('preset'))}) | {why} | | | | |")
            continue
        lines.append(
            f"| {name} | {row['plain_a_s']:.3f} + {row['plain_b_s']:.3f} s | {row['repeat']} | "
            f"{_cell(row, 'every_module')} | {_cell(row, 'blocks_only')} | "
            f"{row['every_module_peak_vs_plain']:.3f} / {row['blocks_only_peak_vs_plain']:.3f}x |"
        )
    return "\n".join(lines)


def host_work(row: dict[str, Any]) -> dict[str, Any] | None:
    """What a family's runs cost the host, from each run's clocks (`{case}_clocks`): per case
    the median CPU seconds of a run (the calling thread's and the side threads'), the median
    probe of the core it ran on (us, the same loop every run; None where not recorded), and the
    every-module pair's CPU less the blocks-only pair's: the host work of the modules inside the
    blocks, in all and per extra pair. None where the row has no clocks (a failed or skipped
    row, or a run recorded without clocks) or fewer than 5 rounds.

    Where a case waits on the GPU inside a CUDA call (a full launch queue; a pair's own final
    sync, which spins; a plain forward's clock stops before its sync), its CPU seconds include
    that wait: this reads as host work only for a host-bound case (sd3, cosmos3; a forward of
    seconds, timed once, is left out).
    """
    cases = ("plain_a", "plain_b", "every_module", "blocks_only")
    if not all(len(row.get(f"{case}_clocks") or ()) >= 5 for case in cases):
        return None
    out: dict[str, Any] = {}
    for case in cases:
        runs = row[f"{case}_clocks"]
        out[f"{case}_cpu_s"] = statistics.median(r["thread_cpu_s"] + r["side_cpu_s"] for r in runs)
        probes = [r["probe_us"] for r in runs if r.get("probe_us") is not None]
        out[f"{case}_probe_us"] = statistics.median(probes) if probes else None
    extra = row["every_module_pairs"] - row["blocks_only_pairs"]
    modules_s = out["every_module_cpu_s"] - out["blocks_only_cpu_s"]
    out["modules_cpu_s"] = modules_s
    out["modules_cpu_us_per_pair"] = modules_s / extra * 1e6 if extra > 0 else None
    return out


def sharded_cell(row: dict[str, Any]) -> str:
    """A sharded row in words: wall time, block pairs, each side's build and forward seconds
    and per-rank peaks, the model output's rel_max."""
    sides = []
    for key in ("fsdp2_a", "fsdp2_b"):
        job = row[key]
        peaks = "/".join(f"{p:.1f}" for p in job.get("peak_memory_gib_per_rank") or [] if p)
        sides.append(
            f"{key[-1]}: build {job['build_s']:.1f} s, forward {job['forward_s']:.2f} s, "
            f"peak GiB {peaks or '-'}"
        )
    return (
        f"paired in {row['wall_s']:.1f} s on {row['fsdp2_a']['world_size']} ranks, "
        f"{row['pairs']} block pairs ({'; '.join(sides)}), model output rel_max "
        f"{row['model_output_rel_max']:.3g}"
    )


def host_table(rows: list[dict[str, Any]]) -> str:
    """Where the host's time went, family by family (`host_work`), as a Markdown table; rows
    without clocks are left out."""
    lines = [
        "| family | CPU s a run: plain a + b / every module / blocks only | every module less "
        "blocks only (a pair) | core probe, us: plain / every module |",
        "|---|---|---|---|",
    ]
    for row in rows:
        work = host_work(row) if "every_module_vs_plain" in row else None
        if work is None:
            continue
        name = _name(row)
        per_pair = work["modules_cpu_us_per_pair"]
        probes = [work["plain_a_probe_us"], work["every_module_probe_us"]]
        probe = " / ".join("-" if p is None else f"{p:.0f}" for p in probes)
        lines.append(
            f"| {name} | {work['plain_a_cpu_s']:.3f} + {work['plain_b_cpu_s']:.3f} / "
            f"{work['every_module_cpu_s']:.3f} / {work['blocks_only_cpu_s']:.3f} | "
            f"{work['modules_cpu_s'] * 1e3:.0f} ms"
            + ("" if per_pair is None else f" ({per_pair:.0f} us)")
            + f" | {probe} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument(
        "--table", metavar="FULL_SIZE_JSON",
        help="print the Markdown table of a written full_size.json and stop (no GPU needed)",
    )  # fmt: skip
    parser.add_argument(
        "--families", default=",".join(["flux", "sd3", "sd3:large", *FAMILIES_AFTER]),
        help="families in order (name or name:variant); short forwards first; '' for none (the "
        "sharded case alone)",
    )  # fmt: skip
    parser.add_argument("--dump", default="sd3", help="families that also dump-then-compare")
    parser.add_argument("--repeat", type=int, default=7, help="rounds at least")
    parser.add_argument(
        "--round-seconds", type=float, default=15.0,
        help="short forwards get more rounds, as many as fill about this many seconds (at most "
        "41; 0: --repeat rounds everywhere)",
    )  # fmt: skip
    parser.add_argument(
        "--fixed-order", action="store_true",
        help="every round in the same order (plain a, plain b, every module, blocks only)",
    )  # fmt: skip
    parser.add_argument(
        "--plain-fastest", action=argparse.BooleanOptionalAction, default=True,
        help="run each plain forward on the core that probes fastest now (lockstep.fastest_cpu), "
        "as a pair's side threads are by default, so both sides of the ratio draw alike from a "
        "shared host's cores (--no-plain-fastest: where the scheduler puts them)",
    )  # fmt: skip
    parser.add_argument(
        "--sharded", choices=("on", "off"), default="on",
        help="MiniMax H3 full (trained master) paired sharded on 2 GPUs when two exist (the row "
        "says why not otherwise); off: leave it out",
    )  # fmt: skip
    args = parser.parse_args()
    if args.table:
        written = json.loads(Path(args.table).read_text())["rows"]
        print(table(written) + "\n\n" + host_table(written))
        return
    if args.out_dir is None:
        parser.error("OUT_DIR is needed to measure (or --table FULL_SIZE_JSON to print one)")
    if not torch.cuda.is_available():
        raise SystemExit("bench/full_size.py measures on CUDA; this machine has no GPU.")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
        "repeat": args.repeat,
        "round_seconds": args.round_seconds,
        "order": "fixed" if args.fixed_order else "rotated",
    }
    rows: list[dict[str, Any]] = []
    for name in [n for n in args.families.split(",") if n]:  # "": the sharded case alone
        try:
            row = measure(
                name, args.repeat, dump=name in args.dump.split(","),
                rotate=not args.fixed_order, plain_fastest=args.plain_fastest,
                round_seconds=args.round_seconds,
            )  # fmt: skip
        except Exception as err:  # keep the other families' figures
            row = {"family": name, "preset": "full", "error": repr(err)[:400]}
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "full_size.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        gc.collect()
        torch.cuda.empty_cache()
    if args.sharded == "off":
        row = {"family": "minimax_h3", "case": "sharded_2gpu", "skipped": "--sharded off"}
    else:
        try:
            row = measure_sharded(2)  # says why it skips with fewer than two GPUs
        except Exception as err:
            row = {"family": "minimax_h3", "case": "sharded_2gpu", "error": repr(err)[:400]}
            traceback.print_exc()
    rows.append(row)
    print(json.dumps(row), flush=True)
    (out / "full_size.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows) + "\n\n" + host_table(rows), flush=True)


if __name__ == "__main__":
    main()

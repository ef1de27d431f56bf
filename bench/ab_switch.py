"""One lab switch, each of its values against the others,, in one process.

    python bench/ab_switch.py OUT.json --switch LAB_METRICS_STREAM=1,0
        [--families sd3,sd3:large,cosmos3] [--device cuda] [--rounds 9] [--blocks]

The host-bound pairs move by 10-30 % from one device call to the next with the same code, so a
switch is measured against its alternatives only side by side: for each family, in one process,
`plain` (both sides' `lab.forward_side`, streamed views) and the streamed every-module `lab.pair`
under each value of the switch (`pair_<value>`; with --blocks also the block outputs only,
`blocks_<value>`), one untimed run of each first, then --rounds rounds, each running every case
once, the rounds' orders a balanced Latin square (`rounds.round_orders`: each case right after
each other case equally often). For each case: the median and minimum seconds, their ratios to
`plain`'s, the median of each round's own ratio to that round's plain forwards (`*_vs_plain_rounds`)
and, on CUDA, the peak memory of its last run against the larger of the two plain forwards'
(`*_peak_vs_plain`). The first value against each other one: the medians' ratio
(`pair_<first>_vs_pair_<other>`), its 95 % bootstrap interval over the rounds (`..._ci`) and the
rounds the first was faster in (`..._faster_than_..._rounds`); every case's seconds round by
round in `round_seconds`. `rows_equal`: every value's Result has the same rows, metric for
metric, as the first value's (a switch that changes how a pair runs must not change what it
finds). On CUDA the
family's `full` preset, on CPU a deep tiny model (`rounds.deep_tiny`; the pairs keep their side
threads as on CUDA). Writes OUT.json after each family.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from rounds import against, family_case, rows_per_family, side_runs, timed_rounds, vs_plain

import lab
from lab.base.switches import env_set
from lab.pairing.weights import WeightView


def _found(result: lab.Result) -> tuple[list[str], list[Any]]:
    """Every row (order, label, dtypes, shape, metrics) and skip, by repr: a NaN metric equals
    itself this way (floats compared with == would not)."""
    rows = [repr((r.order, r.label(), r.dtype_a, r.dtype_b, r.shape, r.metrics))
            for r in result.rows]  # fmt: skip
    return rows, list(result.skipped)


def parse_switch(text: str) -> tuple[str, list[str]]:
    """ "NAME=v1,v2" -> ("NAME", ["v1", "v2"]).

    Raises:
        ValueError: No "=", a name that is no LAB_ switch, or fewer than two values.
    """
    name, sep, values = text.partition("=")
    choices = [v for v in values.split(",") if v]
    if not sep or not name.startswith("LAB_") or len(choices) < 2:
        raise ValueError(
            f"--switch {text!r}: give a LAB_ variable and two or more values, e.g. "
            "LAB_METRICS_STREAM=1,0."
        )
    return name, choices


def peak(device: str, fn: Callable[[], Any]) -> tuple[Any, int]:
    """`fn()` and, on CUDA, the peak bytes allocated while it ran (0 on CPU)."""
    if device != "cuda":
        return fn(), 0
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    return out, torch.cuda.max_memory_allocated()


def cases(
    fam: Any, model: torch.nn.Module, inputs: Any, device: str, switch: str, values: list[str],
    blocks: bool,
) -> dict[str, Callable[[], Any]]:  # fmt: skip
    """plain, one each side alone (for the peak), and the pairs under each value."""
    plain, paired = side_runs(fam, model, inputs, device)
    out: dict[str, Callable[[], Any]] = {"plain": plain}
    filters: dict[str, Callable[[str], bool] | None] = {"pair": None}
    if blocks:
        block_names = {
            n
            for n, m in model.named_modules()
            if type(m).__name__ in fam.block_classes and n.count(".") <= 1
        }
        filters["blocks"] = block_names.__contains__
    for what, names_filter in filters.items():
        run = paired(names_filter)
        for value in values:

            def case(run: Callable[[], Any] = run, value: str = value) -> Any:
                with env_set(switch, value):
                    return run()

            out[f"{what}_{value}"] = case
    return out


def measure(
    name: str, device: str, switch: str, values: list[str], rounds: int, blocks: bool = False
) -> dict[str, Any]:
    """One family's row (see the module docstring)."""
    fam, preset, model, inputs = family_case(name, device)
    runs = cases(fam, model, inputs, device, switch, values, blocks)
    results: dict[str, Any] = {}
    peaks: dict[str, int] = {}
    for key, fn in runs.items():
        results[key], peaks[key] = peak(device, fn)

    def run(key: str, round_: int, fn: Callable[[], Any]) -> None:
        if key != "plain" and round_ == rounds - 1:
            results[key], peaks[key] = peak(device, fn)
        else:
            fn()

    times = timed_rounds(runs, rounds, device, run)
    row: dict[str, Any] = {"family": name, "preset": preset, "device": device, "rounds": rounds,
                           "switch": switch, "values": values}  # fmt: skip
    row.update(vs_plain(times))
    # The first value against each other one, round by round (`rounds.against`: the
    # medians' ratio, its 95 % interval, the rounds the first was faster in), and the times.
    for what in ("pair", "blocks"):
        for value in values[1:]:
            if f"{what}_{value}" in times:
                row.update(against(times, f"{what}_{values[0]}", f"{what}_{value}"))
    row["round_seconds"] = times
    if device == "cuda":
        side_peaks = []
        for side in (lab.Side.rollout(fam, device=device), lab.Side.trainer(fam, device=device)):
            view = WeightView(model, side, stream_classes=fam.block_classes)
            forward = lambda s=side, v=view: lab.forward_side(model, inputs, s, view=v)  # noqa: E731
            side_peaks.append(peak(device, forward)[1])
        for key in runs:
            if key != "plain":
                row[f"{key}_peak_vs_plain"] = peaks[key] / max(side_peaks)
    first = {what: results[f"{what}_{values[0]}"] for what in ("pair", "blocks") if
             f"{what}_{values[0]}" in results}  # fmt: skip
    for key, result in results.items():
        if key != "plain" and "metric_batches" in result.meta:  # CUDA: each stream's batches
            row[f"{key}_metric_batches"] = result.meta["metric_batches"]
        if key != "plain" and "pair_core" in result.meta:  # lockstep: which per-output path
            row[f"{key}_pair_core"] = result.meta["pair_core"]
    row["pairs"] = len(first["pair"].rows)
    row["rows_equal"] = all(
        _found(results[f"{what}_{value}"]) == _found(res)
        for what, res in first.items()
        for value in values[1:]
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--switch", required=True, help="LAB_NAME=value1,value2[,...]")
    parser.add_argument("--families", default="sd3,cosmos3")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--blocks", action="store_true", help="add the block outputs only")
    args = parser.parse_args()
    switch, values = parse_switch(args.switch)
    rows_per_family(
        args.out,
        args.families,
        args.device,
        lambda name: measure(name, args.device, switch, values, args.rounds, args.blocks),
    )


if __name__ == "__main__":
    main()

"""What @checked_arguments costs a call: each case checked and unchecked, side by side.

Run: `python bench/arguments.py [OUT.json] [--repeat 7] [--number 2000]`.
Each case is one public call timed through the decorator and through its undecorated body
(`fn.__wrapped__`, the same arguments), interleaved, each the minimum over --repeat rounds of
--number calls (this machine's noise only ever adds time):
- family: `lab.family("flux")`, a dictionary lookup behind one checked str (and its parser);
- config: `Family.config("tiny")`, two checked str;
- expert: `Family.expert_for_sigma(0.5)`, one checked float;
- mean_velocity: `flow_grpo.mean_velocity_factor(...)`, three floats and a Literal (per step);
- side: `Side.rollout(fam)`, a Family or a family name (builds a Side);
- pair: `lab.pair(...)` of the flux tiny model (a whole paired forward; --number / 500 calls).
Prints one JSON row per case (us per call checked and unchecked, the difference) and writes
them all to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lab
from lab.rl import flow_grpo


def _per_call_us(call: Callable[[], Any], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        call()
    return (time.perf_counter() - start) / number * 1e6


def cases() -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """Case -> (checked call, unchecked call, calls per round as a share of --number)."""
    fam = lab.family("flux")
    family, config, expert = lab.family, type(fam).config, type(fam).expert_for_sigma
    mean_velocity = flow_grpo.mean_velocity_factor
    rollout = lab.Side.rollout
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    side = rollout(fam)
    return {
        "family": (lambda: family("flux"), lambda: family.__wrapped__("flux"), 1),
        "config": (lambda: fam.config("tiny"), lambda: config.__wrapped__(fam, "tiny"), 1),
        "expert": (lambda: expert(fam, 0.5), lambda: expert.__wrapped__(fam, 0.5), 1),
        "mean_velocity": (
            lambda: mean_velocity(0.5, 0.4, 0.7, "sde"),
            lambda: mean_velocity.__wrapped__(0.5, 0.4, 0.7, "sde"),
            1,
        ),
        "side": (lambda: rollout(fam), lambda: rollout.__wrapped__(lab.Side, fam), 10),
        "pair": (
            lambda: lab.pair(model, inputs, side, side),
            lambda: lab.pair.__wrapped__(model, inputs, side, side),
            500,
        ),
    }


def measure(repeat: int = 7, number: int = 2000) -> list[dict[str, Any]]:
    """One row per case: checked_us, unchecked_us and added_us per call (minima over rounds)."""
    rows = []
    for name, (checked, unchecked, share) in cases().items():
        n = max(1, number // share)
        checked(), unchecked()  # the plan is built on the first checked call
        best = {"checked": float("inf"), "unchecked": float("inf")}
        for _ in range(repeat):
            best["checked"] = min(best["checked"], _per_call_us(checked, n))
            best["unchecked"] = min(best["unchecked"], _per_call_us(unchecked, n))
        rows.append(
            {
                "case": name,
                "calls": n,
                "checked_us": round(best["checked"], 3),
                "unchecked_us": round(best["unchecked"], 3),
                "added_us": round(best["checked"] - best["unchecked"], 3),
            }
        )
    return rows


def main() -> None:
    """Print and save the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="runs/bench_arguments.json")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    rows = measure(args.repeat, args.number)
    for row in rows:
        print(json.dumps(row))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

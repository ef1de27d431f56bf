"""Search: a smallest set of fp32 rules or op switches that brings two sides within a target.

The candidate changes (one fp32 parameter rule per module, or one op switch / patch group) are
applied to the candidate side. The search first checks that all of them together meet the
target, then bisects: a half that meets it alone is searched alone; when neither half does, each
half is minimised with the other kept on (QuickXplain-style), which needs O(k log n) forwards for
k needed changes out of n. Every forward it runs is kept as a `Trial`, in the order run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from lab.base.arguments import checked_arguments
from lab.families import Inputs
from lab.pairing.result import Result
from lab.pairing.run import pair
from lab.pairing.sides import Side


@checked_arguments
@dataclass(frozen=True)
class Change:
    """One change to the candidate side: an fp32 rule, an op switch value, or a patch group."""

    kind: str
    """"rule" (glob -> fp32), "switch" (name=value) or "group" (appended to engine_ops)."""
    target: str
    value: Any = "fp32"

    def label(self) -> str:
        """Short display form, e.g. `*.norm2.*=fp32`."""
        return f"{self.target}={self.value}"


@checked_arguments
@dataclass(frozen=True)
class Trial:
    """One paired forward the search ran: the changes on, the metric, whether it met the target."""

    changes: tuple[str, ...]
    metric: float
    meets: bool


@checked_arguments
@dataclass
class SearchResult:
    """The smallest change set found, every trial, and the before/after metric."""

    metric: str
    target: float
    baseline: float
    found: list[Change] | None
    """None when even every candidate together misses the target."""
    final: float | None
    trials: list[Trial] = field(default_factory=list)

    def table(self) -> Any:
        """Every trial in the order run (a pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame([{"changes": ", ".join(t.changes), "metric": t.metric,
                              "meets": t.meets} for t in self.trials])  # fmt: skip


@checked_arguments
def module_rules(model: torch.nn.Module, depth: int = 1) -> list[Change]:
    """One fp32 rule per parameter-owning module at `depth` (`blocks.0` is depth 1).

    Rules are globs `<module>.*`, so each pins every parameter under that module.
    """
    seen: list[str] = []
    for name, _ in model.named_parameters():
        prefix = ".".join(name.split(".")[: depth + 1])
        if prefix != name and prefix not in seen:
            seen.append(prefix)
    return [Change("rule", f"{p}.*") for p in seen]


def _side_with(side: Side, changes: Sequence[Change]) -> Side:
    rules = dict(side.param_dtype_rules)
    switches = dict(side.op_switches)
    groups = list(side.engine_ops)
    for c in changes:
        if c.kind == "rule":
            rules[c.target] = c.value
        elif c.kind == "switch":
            switches[c.target] = c.value
        elif c.kind == "group":
            groups.append(c.target)
        else:
            raise ValueError(
                f"search: unknown change kind {c.kind!r}. Known: 'rule', 'switch', 'group'."
            )
    return side.replace(param_dtype_rules=rules, op_switches=switches, engine_ops=tuple(groups))


METRICS: dict[str, Callable[[Result], float]] = {
    "model_output_rel_max": lambda r: r.output_metrics()["model_output_rel_max"],
    "model_output_max_abs_diff": lambda r: r.output_metrics()["model_output_max_abs_diff"],
    "max_ulp": lambda r: float(r.summary()["max_ulp"]),
}


@checked_arguments
def find_smallest_changes(
    model: torch.nn.Module,
    inputs: Inputs,
    reference: Side,
    candidate: Side,
    candidates: Sequence[Change],
    *,
    target: float = 0.0,
    metric: str | Callable[[Result], float] = "model_output_rel_max",
) -> SearchResult:
    """Find a smallest subset of `candidates` that brings `metric` to at most `target`.

    Args:
        model: The fp32 master model.
        inputs: Inputs for the paired forward.
        reference: The side held fixed (rollout by convention).
        candidate: The side the changes are applied to.
        candidates: Changes to choose from (e.g. `module_rules(model)` or switch changes).
        target: The metric must be <= target.
        metric: A name in `METRICS` or a function of the Result (e.g. a ratio_abs_minus_1).

    Returns:
        A SearchResult; `found` is None if every candidate together misses the target.

    Raises:
        ValueError: An unknown metric name or change kind, or no candidates.
    """
    if not candidates:
        raise ValueError("find_smallest_changes: no candidate changes given.")
    if isinstance(metric, str):
        if metric not in METRICS:
            raise ValueError(
                f"find_smallest_changes: unknown metric {metric!r}. Known: {', '.join(METRICS)}."
            )
        metric_name, measure = metric, METRICS[metric]
    else:
        metric_name, measure = getattr(metric, "__name__", "metric"), metric
    trials: list[Trial] = []
    cache: dict[tuple[Change, ...], float] = {}

    def evaluate(changes: Sequence[Change]) -> float:
        # Each set of changes is paired once (minimal_subset asks again for sets it has seen).
        key = tuple(sorted(changes, key=Change.label))
        if key not in cache:
            side = _side_with(candidate, changes)
            value = measure(pair(model, inputs, reference, side, check_outputs=False))
            trials.append(Trial(tuple(c.label() for c in changes), value, value <= target))
            cache[key] = value
        return cache[key]

    def meets(changes: Sequence[Change]) -> bool:
        return evaluate(changes) <= target

    baseline = evaluate([])
    everything = list(candidates)
    if not meets(everything):
        return SearchResult(metric_name, target, baseline, None, None, trials)
    found = [] if baseline <= target else minimal_subset(everything, meets)
    final = evaluate(found)
    return SearchResult(metric_name, target, baseline, found, final, trials)


T = TypeVar("T")


@checked_arguments
def minimal_subset(pool: Sequence[T], meets: Callable[[list[T]], bool]) -> list[T]:
    """A minimal part of `pool` for which `meets` holds, given that the whole pool meets it.

    QuickXplain: a half that meets it alone is searched alone; when neither half does, each half
    is minimised with the other kept on. O(k log n) calls of `meets` for k needed items out of n;
    the caller caches `meets` (it is called again on sets it has seen).
    """

    def shrink(kept: list[T], part: list[T]) -> list[T]:
        # Smallest part of `part` that, with `kept` on, meets the target (kept + part does).
        if len(part) <= 1:
            return [] if part and meets(kept) else part
        half = len(part) // 2
        left, right = part[:half], part[half:]
        if meets(kept + left):
            return shrink(kept, left)
        if meets(kept + right):
            return shrink(kept, right)
        need_left = shrink(kept + right, left)
        need_right = shrink(kept + need_left, right)
        return need_left + need_right

    return [] if meets([]) else shrink([], list(pool))

"""attribute_settings(): which of the settings that differ between two sides causes the drift.

Two sides differ in a handful of settings (autocast, an input role's dtype, an fp32 keep, a
patch group, a rule). Each is a *knob*: one differing Side field, or one key / element of a
dict or tuple field (each param_dtype_rules glob, each input_dtype_policy role, each fp32 keep,
each op switch and patch group). Fields that mean nothing apart are one knob, said so in its
`grouped`: forward_dtype with rollout_precision (the spec ties them), autocast with its dtype
and op policy when autocast itself differs.

A coalition S of knobs is side A with the knobs in S set to side B's values; its value v(S) is
the divergence of that side's model output against side A's (v(empty) = 0, v(all) = the full
A-vs-B divergence). Each knob's Shapley value is its average marginal effect over every order
of adding the knobs, so the values sum to the full divergence exactly (efficiency). Up to
`max_exact` knobs every coalition is evaluated once (2^n forwards, cached); above, orders are
sampled and each share comes with its standard error (each sampled order still sums exactly).
Each knob's effect alone (A plus that knob) and removed alone (B minus that knob) are in the
table too: where they differ from its share, the knob interacts with others.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.base.arguments import checked_arguments
from lab.families import Inputs
from lab.pairing.capture import flatten_output
from lab.pairing.sides import Side

OUTPUT_METRICS: tuple[str, ...] = ("rel_l2", "rel_max", "mean_abs_diff", "max_abs_diff")
"""Model-output metrics computed from the two outputs directly (float64)."""
STEP_METRICS: tuple[str, ...] = ("log_ratio", "transition_kl")
"""With `step=`: the mean |log_prob_new - log_prob_old| or transition KL over its samples."""

_IGNORED = ("name",)
_SET_FIELDS = ("keep_fp32_modules", "engine_ops", "fsdp_wrap_classes")
_MAP_FIELDS = ("param_dtype_rules", "input_dtype_policy", "op_switches")
_AUTOCAST = ("autocast", "autocast_dtype", "autocast_policy")
_DTYPE_PAIR = ("forward_dtype", "rollout_precision")


@dataclass(frozen=True)
class Knob:
    """One atomic difference between two sides."""

    name: str
    """e.g. "autocast", "param_dtype_rules['*.norm2.*']", "input_dtype_policy['latents']"."""
    field: str
    """The Side field it lives in (the first one, for a grouped knob)."""
    key: Any = None
    """The dict key or tuple element, for a knob inside a dict or tuple field."""
    value_a: Any = None
    value_b: Any = None
    grouped: tuple[str, ...] = ()
    """Fields set together with `field` (they mean nothing apart), and why, in `why_grouped`."""
    why_grouped: str = ""
    parts: tuple[Knob, ...] = ()
    """For knobs that only run together (`merge_knobs`): the knobs this one sets at once."""

    def atoms(self) -> tuple[Knob, ...]:
        """The single knobs this one sets (itself, or its parts)."""
        return tuple(a for p in self.parts for a in p.atoms()) if self.parts else (self,)

    def label(self) -> str:
        """The knob and its two values, e.g. "autocast: off -> on (cuda op lists)"."""
        return f"{self.name}: {_show_knob(self, self.value_a)} -> {_show_knob(self, self.value_b)}"


_MISSING = "(unset)"


def _show(value: Any) -> str:
    if isinstance(value, tuple | list):
        return "(" + ", ".join(map(str, value)) + ")"
    return str(value)


def _show_knob(knob: Knob, value: Any) -> str:
    """A knob's value as a user reads it: autocast as on/off with its dtype and op lists."""
    if knob.field == "autocast" and isinstance(value, tuple) and len(value) == len(_AUTOCAST):
        on, dtype, policy = value
        if not on:
            return "off"
        extra = [f"dtype {dtype}" if dtype else "", f"{policy} op lists" if policy else ""]
        details = ", ".join(e for e in extra if e)
        return f"on ({details})" if details else "on"
    if knob.field == "op_switches" and value == _MISSING:
        from lab.precision.engine_registry import SWITCHES

        switch = SWITCHES.get(str(knob.key))
        if switch is not None:
            return f"{switch.values[0]} (stock)"
    return _show(value)


def knobs_between(side_a: Side, side_b: Side) -> list[Knob]:
    """Split everything that differs between two sides into knobs (in Side field order).

    Raises:
        ValueError: Sides on different devices (not a setting: they cannot be paired).
    """
    a, b = side_a.to_dict(), side_b.to_dict()
    if a.get("device") != b.get("device"):
        raise ValueError(
            f"attribute_settings: the sides run on different devices ({a.get('device')!r} vs "
            f"{b.get('device')!r}); pair them on one device."
        )
    knobs: list[Knob] = []
    done: set[str] = set()
    for name in (f.name for f in dataclasses.fields(Side)):
        if name in _IGNORED or name in done or a.get(name) == b.get(name):
            continue
        if name in _MAP_FIELDS:
            va, vb = dict(a[name] or {}), dict(b[name] or {})
            for key in list(vb) + [k for k in va if k not in vb]:
                if va.get(key, _MISSING) != vb.get(key, _MISSING):
                    knobs.append(Knob(f"{name}[{key!r}]", name, key, va.get(key, _MISSING),
                                      vb.get(key, _MISSING)))  # fmt: skip
        elif name in _SET_FIELDS:
            va, vb = tuple(a[name] or ()), tuple(b[name] or ())
            for item in [x for x in vb if x not in va] + [x for x in va if x not in vb]:
                knobs.append(Knob(f"{name}[{item!r}]", name, item, item in va, item in vb))
            if [x for x in va if x in vb] != [x for x in vb if x in va]:
                knobs.append(Knob(f"{name} order", name, "order", va, vb))
        elif name in _AUTOCAST and a["autocast"] != b["autocast"]:
            knobs.append(
                Knob(
                    "autocast",
                    "autocast",
                    None,
                    tuple(a[f] for f in _AUTOCAST),
                    tuple(b[f] for f in _AUTOCAST),
                    grouped=_AUTOCAST[1:],
                    why_grouped="autocast_dtype and autocast_policy mean nothing without autocast",
                )
            )
            done.update(_AUTOCAST)
        elif name in _DTYPE_PAIR:
            knobs.append(
                Knob(
                    "forward_dtype",
                    "forward_dtype",
                    None,
                    tuple(a[f] for f in _DTYPE_PAIR),
                    tuple(b[f] for f in _DTYPE_PAIR),
                    grouped=_DTYPE_PAIR[1:],
                    why_grouped="the spec requires forward_dtype to equal rollout_precision",
                )
            )
            done.update(_DTYPE_PAIR)
        else:
            knobs.append(Knob(name, name, None, a[name], b[name]))
    return knobs


def side_with(side_a: Side, side_b: Side, knobs: Iterable[Knob], name: str | None = None) -> Side:
    """Side A with `knobs` set to side B's values (named `name`, default side B's)."""
    a, b = side_a.to_dict(), side_b.to_dict()
    out = dict(a)
    chosen = [atom for k in knobs for atom in k.atoms()]
    for k in chosen:
        if k.field in _MAP_FIELDS:
            continue
        if k.field in _SET_FIELDS:
            continue
        for f in (k.field, *k.grouped):
            out[f] = b[f]
    for f in _MAP_FIELDS:
        keys = [k.key for k in chosen if k.field == f]
        if keys:
            merged = dict(a[f] or {})
            for key in keys:
                if key in (b[f] or {}):
                    merged[key] = b[f][key]
                else:
                    merged.pop(key, None)
            # Side B's order for the keys it has (rules: later globs win).
            order = list(b[f] or {})
            out[f] = dict(sorted(merged.items(), key=lambda kv: _rank(order, kv[0])))
    for f in _SET_FIELDS:
        mine = [k for k in chosen if k.field == f]
        if mine:
            items = list(a[f] or ())
            for k in mine:
                if k.key == "order":
                    continue
                if k.value_b and k.key not in items:
                    items.append(k.key)
                elif not k.value_b and k.key in items:
                    items.remove(k.key)
            if any(k.key == "order" for k in mine):
                order = list(b[f] or ())
                items.sort(key=lambda x: _rank(order, x))
            out[f] = tuple(items)
    out["name"] = name or b["name"]
    return Side.from_dict(out)


def _rank(order: list[Any], item: Any) -> tuple[int, int]:
    return (1, order.index(item)) if item in order else (0, 0)


# ---- the value of a coalition ----------------------------------------------------------------


def forward_signature(model: torch.nn.Module, side: Side) -> tuple[Any, ...]:
    """Everything a side's forward of `model` depends on; equal signatures, equal outputs.

    The dtype of every parameter and buffer (after keeps, rules and buffer casts), the master
    dtype they are cast through, the forward/autocast settings, the input policy, kernels and
    engine ops. Not: the side's name, its reduce dtype, its FSDP wrap classes (they decide how
    rules are lowered, not the dtypes), rollout_precision.
    """
    from lab.pairing.weights import plan_weights

    plan = plan_weights(model, side)
    return (
        tuple(sorted((n, str(d)) for n, d in plan.param_dtypes.items())),
        tuple(sorted((n, str(d)) for n, d in plan.buffer_dtypes.items())),
        str(plan.master_dtype),
        side.forward_dtype,
        side.autocast,
        side.resolved_autocast_dtype if side.autocast else None,
        side.resolved_autocast_policy if side.autocast else None,
        tuple(sorted(side.input_dtype_policy.items())),
        side.attention_backend,
        tuple(side.engine_ops),
        tuple(sorted((k, repr(v)) for k, v in side.op_switches.items())),
        side.device,
    )


def _leaves64(output: Any) -> torch.Tensor:
    leaves = [
        t.detach().reshape(-1).to(torch.float64)
        for _, t in flatten_output(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return torch.cat(leaves)


class _Value:
    """v(S) for coalitions of knobs: side A's forward once, each coalition's once (cached)."""

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: Inputs,
        side_a: Side,
        side_b: Side,
        knobs: list[Knob],
        metric: str,
        step: Any,
    ) -> None:
        self.model, self.inputs, self.a, self.b, self.knobs = model, inputs, side_a, side_b, knobs
        self.metric, self.step = metric, step
        self.cache: dict[frozenset[int], Any] = {}
        self.results: dict[frozenset[int], Any] = {}
        self.by_signature: dict[Any, Any] = {}
        """What a side computes -> its value (or failure): sides that differ only in settings
        this model's forward never reads (a wrap class, a keep naming a module without
        parameters) run one forward."""
        self._reference = self._outputs(side_a)

    def _outputs(self, side: Side) -> tuple[Any, Any]:
        from lab.pairing.run import forward_side

        out = forward_side(self.model, self.inputs, side)
        neg = None
        if self.step is not None and self.inputs.negative is not None:
            neg = forward_side(self.model, self.inputs.negative, side)
        return out, neg

    @classmethod
    def again(cls, value: _Value, knobs: list[Knob]) -> _Value:
        """The same model, inputs, sides and reference output, over other knobs."""
        new = cls.__new__(cls)
        new.__dict__.update(value.__dict__)
        new.knobs, new.cache, new.results = knobs, {}, {}
        return new

    def side(self, members: frozenset[int]) -> Side:
        return side_with(self.a, self.b, [self.knobs[i] for i in sorted(members)])

    def __call__(self, members: frozenset[int]) -> float:
        found = self.cache.get(members)
        if found is None:
            side = self.side(members)
            key = forward_signature(self.model, side)
            found = self.by_signature.get(key)
            if found is None:
                try:
                    found = self._measure(side)
                except Exception as err:
                    found = err
                self.by_signature[key] = found
            self.cache[members] = found
        if isinstance(found, Exception):
            raise found
        return found

    @property
    def forwards(self) -> int:
        """Distinct forwards run: coalitions whose sides run the same forward share one."""
        return len(self.by_signature)

    def _measure(self, side: Side) -> float:
        metric = self.metric
        if metric in OUTPUT_METRICS or metric in STEP_METRICS:
            out, neg = self._outputs(side)
            ref, ref_neg = self._reference
            if metric in STEP_METRICS:
                return _step_metric(self.step, metric, ref, ref_neg, out, neg)
            a, b = _leaves64(ref), _leaves64(out)
            d = b - a
            if metric == "rel_l2":
                norm = float(a.norm())
                return float(d.norm()) / norm if norm > 0 else float(d.norm())
            if metric == "rel_max":
                return float(d.abs().max()) / (float(a.abs().max()) + 1e-30)
            if metric == "mean_abs_diff":
                return float(d.abs().mean())
            return float(d.abs().max())
        from lab.pairing.run import pair

        result = pair(self.model, self.inputs, self.a, side, check_outputs=False)
        values = {**result.summary(), **result.output_metrics()}
        return float(values[metric])


def _step_metric(step: Any, metric: str, ref: Any, ref_neg: Any, out: Any, neg: Any) -> float:
    from lab.rl.flow_grpo import log_ratio_terms

    v_old, v_new = step.velocity(ref, ref_neg), step.velocity(out, neg)
    terms = log_ratio_terms(
        v_old, v_new, step.x_t.to(v_old.device), step.x_prev.to(v_old.device), step.sigma,
        step.sigma_prev, step.std_dev_t, step.sde_type,
    )  # fmt: skip
    values = terms.predicted.abs() if metric == "log_ratio" else terms.transition_kl
    return float(values.mean())


def merge(first: Knob, second: Knob, why: str) -> Knob:
    """One knob setting both (for settings that do not run apart)."""
    return Knob(
        f"{first.name} + {second.name}",
        first.field,
        None,
        (first.value_a, second.value_a),
        (first.value_b, second.value_b),
        grouped=(second.field,) if second.field != first.field else (),
        why_grouped=why,
        parts=(first, second),
    )


def _runs(value: _Value, members: frozenset[int]) -> str | None:
    """None when the coalition's side runs; else the failure, in one line."""
    from lab.base.errors import PairError

    try:
        value(members)
    except PairError as err:
        return str(err).split(". Fix:")[0][:300]
    return None


def runnable_knobs(value: _Value) -> _Value:
    """Merge knobs until each one runs alone on side A and can be taken off side B alone.

    A setting that only runs beside another (Wan's fp32 text passed through, which only a
    forward under autocast can take) is merged with the first knob that makes it run, and the
    merged knob says why. Re-evaluates on the merged knobs (the cache is keyed by index).

    Raises:
        ValueError: A knob that runs with no single partner (naming it and the failure).
    """
    while True:
        n = len(value.knobs)
        every = frozenset(range(n))
        failing = None
        for i in range(n):
            for members, how in ((frozenset({i}), "alone"), (every - {i}, "removed")):
                err = _runs(value, members)
                if err is not None:
                    failing = (i, members, how, err)
                    break
            if failing:
                break
        if failing is None:
            return value
        i, members, how, err = failing
        import itertools

        partners = None
        others = [j for j in range(n) if j != i]
        for size in (1, 2):
            for combo in itertools.combinations(others, size):
                trial = members | set(combo) if how == "alone" else members - set(combo)
                if _runs(value, frozenset(trial)) is None:
                    partners = combo
                    break
            if partners is not None:
                break
        knob = value.knobs[i]
        if partners is None:
            raise ValueError(
                f"attribute_settings: knob {knob.name!r} does not run {how} ({err}) and no one "
                "or two other knobs make it run; the sides' settings cannot be separated."
            )
        merged = knob
        for j in partners:
            merged = merge(
                merged,
                value.knobs[j],
                f"{knob.name} {'alone' if how == 'alone' else 'taken off side B alone'} does "
                f"not run ({err})",
            )
        chosen = (i, *partners)
        knobs = [k for j, k in enumerate(value.knobs) if j not in chosen]
        knobs.insert(min(chosen), merged)
        value = _Value.again(value, knobs)


def check_metric(metric: Any, step: Any, where: str) -> str:
    """Validate a metric name against what `step` allows.

    Raises:
        ValueError: An unknown metric, or a step metric without a step.
    """
    if step is not None and not hasattr(step, "velocity"):
        raise ValueError(
            f"{where}: step must be a lab.StepScore (StepScore.from_trajectory(traj, i)), got "
            f"{type(step).__name__}."
        )
    from lab.pairing.metrics import PairMetrics

    result_metrics = {f"model_output_{m}" for m in ("mean_abs_diff", "max_abs_diff", "rel_max")}
    result_metrics |= {"max_ulp", "bitexact_pairs"} | {
        f.name for f in dataclasses.fields(PairMetrics)
    }
    known = (*OUTPUT_METRICS, *STEP_METRICS, *sorted(result_metrics))
    if not isinstance(metric, str) or metric not in known:
        from lab.base.errors import nearest_words

        raise ValueError(
            f"{where}: unknown metric {metric!r}.{nearest_words([str(metric)], known)} Known: "
            f"{', '.join(known[:6])}, or a Result metric ({', '.join(sorted(result_metrics)[:4])}"
            ", ...)."
        )
    if metric in STEP_METRICS and step is None:
        raise ValueError(
            f"{where}: metric {metric!r} scores a trajectory step; pass step="
            "StepScore.from_trajectory(traj, i), or use 'rel_l2' / 'rel_max'."
        )
    return metric


# ---- Shapley values ----------------------------------------------------------------------------


@checked_arguments
@dataclass
class SettingAttribution:
    """Each knob's Shapley share of the divergence between two sides."""

    knobs: list[Knob]
    metric: str
    total: float
    """v(all knobs): the divergence of side B against side A."""
    shares: list[float]
    """Shapley value of each knob (same order as `knobs`); they sum to `total`."""
    stderr: list[float]
    """Standard error of each share (0 for exact values)."""
    alone: list[float]
    """v({k}) - v({}): side A with only that knob of side B."""
    removed: list[float]
    """v(all) - v(all without k): side B with only that knob set back to side A's."""
    exact: bool
    forwards: int
    """Distinct coalitions evaluated (each one forward of the candidate side)."""
    side_a: dict[str, Any] = field(default_factory=dict)
    side_b: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def table(self) -> Any:
        """One row per knob, largest share first (a pandas DataFrame).

        Columns: knob, field, value_a, value_b, share, share_pct, stderr, alone, removed,
        grouped, forwards.
        """
        import pandas as pd

        rows = []
        for i, k in enumerate(self.knobs):
            rows.append(
                {
                    "knob": k.name,
                    "field": k.field,
                    "value_a": _show_knob(k, k.value_a),
                    "value_b": _show_knob(k, k.value_b),
                    "share": self.shares[i],
                    "share_pct": 100 * self.shares[i] / self.total if self.total else 0.0,
                    "stderr": self.stderr[i],
                    "alone": self.alone[i],
                    "removed": self.removed[i],
                    "grouped": ", ".join(k.grouped) + (f" ({k.why_grouped})" if k.grouped else ""),
                    "forwards": self.forwards,
                }
            )
        table = pd.DataFrame(rows)
        return table.sort_values("share", ascending=False, kind="stable").reset_index(drop=True)

    def top(self) -> Knob | None:
        """The knob with the largest share (None when nothing differs)."""
        if not self.knobs:
            return None
        return self.knobs[max(range(len(self.knobs)), key=lambda i: self.shares[i])]

    def describe(self) -> str:
        """The attribution in plain words."""
        a, b = self.side_a.get("name", "A"), self.side_b.get("name", "B")
        if not self.knobs:
            return f"{b} and {a} have the same settings: nothing to attribute."
        head = f"{self.metric} of {b} against {a}: {self.total:.3g}"
        if self.total == 0:
            moving = [
                f"{k.name} alone {al:.3g}"
                for k, al in zip(self.knobs, self.alone, strict=True)
                if al != 0
            ]
            if moving:
                return (
                    f"{head}: the sides agree bit for bit, but not knob by knob: "
                    f"{'; '.join(moving)}; together they cancel."
                )
            return (
                f"{head}: the {len(self.knobs)} differing knob(s) change nothing here "
                f"({', '.join(k.name for k in self.knobs)})."
            )
        parts, quiet = [], []
        for _, row in self.table().iterrows():
            pct = row["share_pct"]
            if abs(pct) < 0.5:
                quiet.append(row["knob"])
                continue
            se = f" +- {100 * row['stderr'] / self.total:.0f}" if row["stderr"] else ""
            note = ""
            if abs(row["alone"] - row["share"]) > 0.25 * abs(self.total):
                note = f" (alone {row['alone']:.3g}: it interacts with the others)"
            parts.append(f"{row['knob']} explains {pct:.0f}{se} %{note}")
        words = "; ".join(parts)
        if quiet:
            words += (
                f"; the other {len(quiet)} knob(s) change nothing"
                if len(quiet) > 1
                else f"; {quiet[0]} changes nothing"
            )
        how = (
            "exact Shapley values"
            if self.exact
            else f"Shapley values sampled ({len(self.knobs)} knobs)"
        )
        return f"{head} ({how}, {self.forwards} forwards): {words}."

    @checked_arguments
    def plot(self, backend: str = "plotly") -> Any:
        """A bar chart of the shares (`lab.plots.plot_setting_shares`)."""
        # The figure lives with the others in views/; imported on call, as a convenience.
        from lab.views.plots.settings import plot_setting_shares

        return plot_setting_shares(self, backend=backend)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {
            "schema": "precision-lab/setting-attribution/1",
            "metric": self.metric,
            "total": self.total,
            "exact": self.exact,
            "forwards": self.forwards,
            "side_a": self.side_a,
            "side_b": self.side_b,
            "meta": self.meta,
            "knobs": [
                {
                    **dataclasses.asdict(k),
                    "value_a": _jsonable(k.value_a),
                    "value_b": _jsonable(k.value_b),
                    "key": _jsonable(k.key),
                    "share": s,
                    "stderr": e,
                    "alone": al,
                    "removed": rm,
                }
                for k, s, e, al, rm in zip(
                    self.knobs, self.shares, self.stderr, self.alone, self.removed, strict=True
                )
            ],
        }

    @checked_arguments
    def to_json(self, path: str | Path) -> Path:
        """Write `to_dict()` atomically."""
        from lab.base.atomic import atomic_write_text

        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


def shapley(
    n: int, value: Callable[[frozenset[int]], float], *, max_exact: int, samples: int, seed: int
) -> tuple[list[float], list[float], bool]:
    """Shapley values of n players for `value` (cached by the caller).

    Returns:
        (values, standard errors, exact).
    """
    if n == 0:
        return [], [], True
    if n <= max_exact:
        weights = [
            math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) for s in range(n)
        ]
        values = []
        for i in range(n):
            terms = []
            others = [j for j in range(n) if j != i]
            for mask in range(1 << (n - 1)):
                members = frozenset(others[j] for j in range(n - 1) if mask >> j & 1)
                terms.append(weights[len(members)] * (value(members | {i}) - value(members)))
            values.append(math.fsum(terms))
        return values, [0.0] * n, True
    rng = random.Random(seed)
    marginals: list[list[float]] = [[] for _ in range(n)]
    for _ in range(samples):
        order = list(range(n))
        rng.shuffle(order)
        members: frozenset[int] = frozenset()
        before = value(members)
        for i in order:
            after_members = members | {i}
            after = value(after_members)
            marginals[i].append(after - before)
            members, before = after_members, after
    values = [math.fsum(m) / len(m) for m in marginals]
    errors = []
    for m, mean in zip(marginals, values, strict=True):
        var = math.fsum((x - mean) ** 2 for x in m) / max(len(m) - 1, 1)
        errors.append(math.sqrt(var / len(m)))
    return values, errors, False


@checked_arguments
def attribute_settings(
    model: torch.nn.Module,
    inputs: Inputs,
    side_a: Side,
    side_b: Side,
    *,
    metric: str | None = None,
    step: Any = None,
    max_exact: int = 12,
    samples: int = 64,
    seed: int = 0,
) -> SettingAttribution:
    """Split the divergence of side B against side A across the settings that differ.

    Args:
        model: The fp32 master model.
        inputs: The step's inputs (with `negative` for a CFG step scored by `step`).
        side_a: The reference side (rollout by convention).
        side_b: The candidate side.
        metric: "rel_l2" (||b - a|| / ||a|| of the model output, the default without a step),
            "rel_max", "mean_abs_diff", "max_abs_diff", with `step` "log_ratio" (the default
            with one) or "transition_kl", or any Result metric (a full `lab.pair` per
            coalition: slower).
        step: A `lab.StepScore`: score each coalition by that trajectory step's log-prob drift.
        max_exact: Up to this many knobs, exact Shapley values (2^n forwards); above, `samples`
            sampled orders with standard errors.
        samples: Sampled orders above `max_exact`.
        seed: The sampling seed.

    Returns:
        A SettingAttribution.

    Raises:
        ValueError: An unknown metric, a step metric without a step, sides on two devices.
    """
    where = "attribute_settings"
    for name, side in (("side_a", side_a), ("side_b", side_b)):
        if not isinstance(side, Side):
            raise ValueError(
                f"{where}: {name} must be a lab.Side, got {type(side).__name__} {side!r:.60}."
            )
    metric = check_metric(metric or ("log_ratio" if step is not None else "rel_l2"), step, where)
    value = runnable_knobs(
        _Value(model, inputs, side_a, side_b, knobs_between(side_a, side_b), metric, step)
    )
    knobs = value.knobs
    everything = frozenset(range(len(knobs)))
    empty = value(frozenset())
    shares, errors, exact = shapley(
        len(knobs), value, max_exact=max_exact, samples=samples, seed=seed
    )
    total = value(everything)
    alone = [value(frozenset({i})) - empty for i in range(len(knobs))]
    removed = [total - value(everything - {i}) for i in range(len(knobs))]
    origin = inputs.origin if isinstance(inputs, Inputs) else None
    meta = {"family": origin[0], "preset": origin[1]} if origin else {}
    meta["sigma"] = inputs.sigma
    if step is not None:
        meta["step"] = step.to_dict()
    return SettingAttribution(
        knobs=knobs,
        metric=metric,
        total=total - empty,
        shares=shares,
        stderr=errors,
        alone=alone,
        removed=removed,
        exact=exact,
        forwards=value.forwards,
        side_a=side_a.to_dict(),
        side_b=side_b.to_dict(),
        meta=meta,
    )

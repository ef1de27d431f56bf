"""attribute(): which modules cause the final divergence, by grafting one side into the other.

    attr = attribute(model, inputs, rollout, trainer)      # blocks and top-level modules
    attr.table()                                           # share, own_share, input_share, ...
    attr.smallest_set(0.9)                                 # fewest grafts removing 90 %, verified
    attribute_scenario("wan_sgld_anti_parity").attribution # what a known bug adds, per unit

Units partition the forward: `level="block"` takes the root's children with ModuleLists expanded
(so pos_embed, rope, the time embedders, norm_out and proj_out are units like every block); an
int level takes the modules that many hops below the root (containers do not count a hop) plus
shallower leaves. Side A's forward keeps every unit call's inputs and output; side B's own
forward gives the baseline divergence R0 and the dtype B hands each unit and gets back there.

Grafting is cumulative in forward order: C(k) is what remains of the final model-output
divergence when units 0..k of side B all return side A's outputs (cast to the dtype B's own
forward produced there), and unit k's share is (C(k-1) - C(k)) / R0: what B's unit k adds on A's
exact upstream values. It splits into an input share (C(k-1) - I(k), I(k) grafting unit k's
inputs instead of its output: the root's own code between units, or a model input) and an own
share (I(k) - C(k)). The shares telescope to 1 - residual, the residual being what the root does
after the last unit (or the rounding of a final cast between the sides' output dtypes).

Incremental: grafted units are stubs that return the cast captured output (their prefix costs no
evaluation), and a forward is only re-run when it changes: while C(k-1) runs, every later unit's
inputs and output are compared bitwise with A's (cast); if unit k received and produced exactly
A's values there, C(k) = I(k) = C(k-1) without a forward, and I(k) runs only when unit k's inputs
differed. `Attribution.meta` counts the unit evaluations this took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lab.base.arguments import checked_arguments
from lab.base.atomic import atomic_write_text
from lab.base.dtypes import dtype_name
from lab.base.errors import AttributionError
from lab.families import Inputs
from lab.pairing.capture import ROOT, flatten_output
from lab.pairing.guards import check_fp32_master, check_inputs, model_in_use
from lab.pairing.run import (
    _cast_tree,
    _clone_tree,
    _dtype_tree,
    _nonfinite_inputs,
    model_device,
)
from lab.pairing.side_context import check_side_device, side_context, side_inputs
from lab.pairing.sides import Side
from lab.pairing.weights import WeightView
from lab.rl.step_score import StepScore

if TYPE_CHECKING:
    import pandas as pd

    from lab.engine.scenarios import ScenarioRun
    from lab.rl.trajectory import Trajectory

Metric = Literal["rel_l2", "rel_max", "log_ratio"]
METRICS: tuple[str, ...] = ("rel_l2", "rel_max", "log_ratio")
INPUT = "input"
"""What a unit's input share stands for: the code between units (root glue) or a model input."""
IDENTICAL_VERDICT = "nothing to attribute: the sides are bit-identical at the model output"
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


# ---- units ---------------------------------------------------------------------------------


def attribution_units(
    model: torch.nn.Module,
    level: Literal["block"] | int = "block",
    names: str | Sequence[str] | None = None,
) -> list[tuple[str, torch.nn.Module]]:
    """The modules `attribute` grafts, in `named_modules()` order, as (path, module).

    Args:
        model: The model.
        level: "block" (= 1): the root's children, ModuleList/ModuleDict expanded. An int d:
            modules d hops below the root plus shallower leaves (containers are no hop), so
            the units never nest and together cover every module's work.
        names: fnmatch globs on the unit paths ('*' crosses dots); only matching units are
            grafted, the others' work counts as input share of the next grafted unit.

    Raises:
        ValueError: An unknown level, or globs that match no unit (with the nearest names).
    """
    depth = _check_level(level)
    units = list(_frontier(model, "", 0, depth))
    if names is None:
        return units
    globs = [names] if isinstance(names, str) else list(names)
    if not globs or not all(isinstance(g, str) for g in globs):
        raise ValueError(
            f"attribute: names must be a glob or a list of globs on unit paths, got {names!r}."
        )
    kept = [(n, m) for n, m in units if any(fnmatch.fnmatchcase(n, g) for g in globs)]
    if not kept:
        all_names = [n for n, _ in units]
        near = difflib.get_close_matches(globs[0].strip("*"), all_names, n=3, cutoff=0.3)
        raise ValueError(
            f"attribute: names {globs!r} matched no unit at level {level!r} of "
            f"{type(model).__name__}."
            + (f" Nearest names: {', '.join(repr(n) for n in near)}." if near else "")
            + f" Units: {', '.join(all_names[:12])}{', ...' if len(all_names) > 12 else ''}. "
            "Globs are fnmatch patterns on the full dotted path; '*' also crosses dots."
        )
    return kept


def _check_level(level: Any) -> int:
    if level == "block":
        return 1
    if isinstance(level, int) and not isinstance(level, bool) and level >= 1:
        return level
    raise ValueError(
        f"attribute: unknown level {level!r}. Use 'block' (the root's children, ModuleLists "
        "expanded) or a depth >= 1 (1 is 'block', 2 the modules inside each block, ...)."
    )


def _frontier(
    module: torch.nn.Module, prefix: str, depth: int, max_depth: int
) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _CONTAINERS):
            # Never called itself: its children are the modules the parent calls.
            yield from _frontier(child, path, depth, max_depth)
        elif depth + 1 >= max_depth or next(child.children(), None) is None:
            yield path, child
        else:
            yield from _frontier(child, path, depth + 1, max_depth)


# ---- divergence of the final output ----------------------------------------------------------


def _output_leaves(output: Any) -> list[tuple[str, torch.Tensor]]:
    return [
        (idx, leaf)
        for idx, leaf in flatten_output(output)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]


def _flat64(leaves: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in leaves])


@dataclass(frozen=True)
class Divergence:
    """The final model output of a (grafted) side-B forward against side A's, in float64."""

    rel_l2: float
    """||b - a|| / ||a|| over every floating output leaf."""
    rel_max: float
    """max |b - a| / max |a|."""
    log_ratio: float = math.nan
    """With a `StepScore`: mean over samples of |log_prob_new - log_prob_old| on that step, the
    rollout's x_prev scored under both guided velocities (exact, float64); NaN without one."""

    def get(self, metric: str) -> float:
        """The value of `metric` ("rel_l2", "rel_max" or "log_ratio")."""
        return float(getattr(self, metric))


# ---- bitwise comparison of call values --------------------------------------------------------

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: Any, b: Any) -> bool:
    """Both trees hold the same tensors bit for bit (-0.0 and NaN payloads included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        if a.is_floating_point() and a.element_size() in _INT_VIEW:
            view = _INT_VIEW[a.element_size()]
            return bool(torch.equal(a.detach().view(view), b.detach().view(view)))
        return bool(torch.equal(a, b))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # an object without a plain equality: count it as changed
        return False


# ---- the grafting engine -------------------------------------------------------------------


@dataclass
class _Forward:
    """One side-B forward's output divergence and which units saw A's exact values.

    Per watched unit: whether every call received (`same_inputs`) and produced
    (`same_outputs`) exactly side A's cast values.
    """

    divergence: Divergence
    same_inputs: dict[str, bool] = field(default_factory=dict)
    same_outputs: dict[str, bool] = field(default_factory=dict)


class _Grafter:
    """Side A captured once; side B re-run with any set of units grafted (stubs) or inputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: Inputs,
        source: Side,
        target: Side,
        units: list[tuple[str, torch.nn.Module]],
        step: StepScore | None = None,
        rollout_is_source: bool = True,
    ) -> None:
        self.model = model
        self.step = step
        self.rollout_is_source = rollout_is_source
        self.device = model_device(model)
        self.source, self.target = source, target
        self.units = dict(units)
        self.block_ids = {
            id(m)
            for name, parent in model.named_modules()
            if isinstance(parent, _CONTAINERS) and "." not in name
            for m in parent.children()
        }
        self.views = {
            "a": WeightView.shared(model, source),
            "b": WeightView.shared(model, target),
        }
        self.inputs = {
            "a": side_inputs(inputs, source, self.device),
            "b": side_inputs(inputs, target, self.device),
        }
        self.unit_evaluations = 0
        self.block_evaluations = 0
        self.forwards = 0
        # Side A: every unit call's inputs and output, and the completion order of the calls.
        self.a_in: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.a_out: dict[tuple[str, int], Any] = {}
        self.a_calls: dict[str, int] = {}
        self.order: list[str] = []
        out_a = self._forward("a", capture=True)
        self.leaves_a = _output_leaves(out_a)
        self.flat_a = _flat64(self.leaves_a) if self.leaves_a else None
        self.negative = self._negative_outputs(inputs)
        self.velocity_a: torch.Tensor | None = None
        if step is not None:
            self.velocity_a = step.velocity(out_a, self.negative["a"])
        # Side B's own forward: the dtypes it hands each unit call and gets back.
        self.b_in_dtypes: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.b_out_dtypes: dict[tuple[str, int], Any] = {}
        self.b_calls: dict[str, int] = {}
        # Also watched: which units already receive and produce A's exact values in B's forward.
        self._check_comparable(out_b := self._forward("b", capture=True, watch=True))
        self.first = _Forward(
            self._divergence(out_b), self._watched["inputs"], self._watched["outputs"]
        )
        self.baseline = self.first.divergence
        for side, leaves in ((source, self.leaves_a), (target, self.leaves_b)):
            bad = sum(int((~torch.isfinite(t)).sum()) for _, t in leaves if t.is_floating_point())
            if bad:
                raise ValueError(
                    f"attribute: side {side.name!r} produced {bad} NaN/Inf value(s) in its model "
                    "output from finite inputs, so shares of the divergence mean nothing. Check "
                    "that side's dtypes (fp16 overflows above 65504); lab.pair(...) names the "
                    "first module whose output is non-finite."
                )
        self.unit_calls_per_forward = sum(self.a_calls.values())
        self.ungraftable = {
            name: f"called {self.a_calls.get(name, 0)} time(s) by {source.name!r} and "
            f"{self.b_calls.get(name, 0)} by {target.name!r}"
            for name in self.units
            if self.a_calls.get(name, 0) != self.b_calls.get(name, 0)
        }
        self.not_called = [
            n for n in self.units if not self.a_calls.get(n) and n not in self.b_calls
        ]
        self.order = [n for n in self.order if n not in self.ungraftable]

    # -- forwards

    def _forward(
        self,
        side_key: str,
        *,
        capture: bool = False,
        stubs: frozenset[str] = frozenset(),
        input_graft: str | None = None,
        watch: bool = False,
    ) -> Any:
        """One forward of side A or B with hooks on every unit; returns the model output."""
        calls: dict[str, int] = {}
        current: dict[str, int] = {}
        handles: list[Any] = []
        watched = self._watched = {"inputs": {}, "outputs": {}}
        is_a = side_key == "a"

        def pre(label: str, module: torch.nn.Module) -> Any:
            def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
                call = current[label] = calls.get(label, 0)
                calls[label] = call + 1
                stubbed = label in stubs
                if not stubbed:
                    self.unit_evaluations += 1
                if id(mod) in self.block_ids and not stubbed:
                    self.block_evaluations += 1
                with torch._C.DisableTorchFunction():
                    if capture and is_a:
                        self.a_in[(label, call)] = (_clone_tree(args), _clone_tree(kwargs))
                    elif capture:
                        self.b_in_dtypes[(label, call)] = (_dtype_tree(args), _dtype_tree(kwargs))
                    if label == input_graft:
                        return self._a_inputs_cast(label, call)
                    if watch and not stubbed:
                        same = (label, call) in self.a_in and _same_bits(
                            (args, kwargs), self._a_inputs_cast(label, call)
                        )
                        watched["inputs"][label] = watched["inputs"].get(label, True) and same
                return None

            return hook

        def post(label: str) -> Any:
            def hook(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                call = current[label]
                with torch._C.DisableTorchFunction():
                    if capture and is_a:
                        self.a_out[(label, call)] = _clone_tree(output)
                        if label not in self.order:
                            self.order.append(label)
                    elif capture:
                        self.b_out_dtypes[(label, call)] = _dtype_tree(output)
                    if watch and label not in stubs:
                        same = (label, call) in self.a_out and _same_bits(
                            output, self._a_output_cast(label, call)
                        )
                        watched["outputs"][label] = watched["outputs"].get(label, True) and same

            return hook

        def stub(label: str) -> Any:
            def forward(*args: Any, **kwargs: Any) -> Any:
                with torch._C.DisableTorchFunction():
                    return self._a_output_cast(label, current[label])

            return forward

        side = self.source if is_a else self.target
        missing = object()
        saved: list[tuple[torch.nn.Module, Any]] = []
        self.forwards += 1
        try:
            for label, module in self.units.items():
                handles.append(
                    module.register_forward_pre_hook(pre(label, module), with_kwargs=True)
                )
                handles.append(module.register_forward_hook(post(label), with_kwargs=True))
            with (
                torch.no_grad(),
                self.views[side_key].applied(),
                side_context(side, self.device, self.model),
            ):
                # Inside the side's context: its engine ops own `module.forward` too, and get
                # theirs back when we restore ours first.
                try:
                    for label in stubs:
                        module = self.units[label]
                        saved.append((module, module.__dict__.get("forward", missing)))
                        module.forward = stub(label)
                    output = self.model(**self.inputs[side_key].kwargs)
                finally:
                    for module, previous in reversed(saved):
                        if previous is missing:
                            module.__dict__.pop("forward", None)
                        else:
                            module.forward = previous
        finally:
            for h in handles:
                h.remove()
        if capture:
            if is_a:
                self.a_calls = dict(calls)
            else:
                self.b_calls = dict(calls)
        return output

    def _a_inputs_cast(self, label: str, call: int) -> tuple[Any, Any]:
        args, kwargs = self.a_in[(label, call)]
        want = self.b_in_dtypes.get((label, call), (None, None))
        return _cast_tree(args, want[0]), _cast_tree(kwargs, want[1])

    def _a_output_cast(self, label: str, call: int) -> Any:
        return _cast_tree(self.a_out[(label, call)], self.b_out_dtypes.get((label, call)))

    def run(self, stubs: frozenset[str] = frozenset(), input_graft: str | None = None) -> _Forward:
        """Side B with `stubs` returning A's outputs (and `input_graft` fed A's inputs)."""
        out = self._forward("b", stubs=stubs, input_graft=input_graft, watch=input_graft is None)
        watched = self._watched
        return _Forward(self._divergence(out), watched["inputs"], watched["outputs"])

    # -- comparison

    def _check_comparable(self, out_b: Any) -> None:
        leaves_b = self.leaves_b = _output_leaves(out_b)
        shapes_a = [(i, tuple(t.shape)) for i, t in self.leaves_a]
        shapes_b = [(i, tuple(t.shape)) for i, t in leaves_b]
        if not shapes_a or shapes_a != shapes_b:
            raise ValueError(
                f"attribute: the model outputs of Side({self.source.name!r}) and "
                f"Side({self.target.name!r}) cannot be compared: {shapes_a} vs {shapes_b} "
                "(output index, shape). Both sides must run the same model on the same inputs; "
                "check the sides' input_dtype_policy and op_switches that change inputs."
            )

    def _divergence(self, out_b: Any) -> Divergence:
        a = self.flat_a
        d = _flat64(_output_leaves(out_b)) - a
        norm_a, max_a = float(a.norm()), float(a.abs().max())
        if norm_a == 0.0:
            raise ValueError(
                f"attribute: Side({self.source.name!r})'s model output is all zero, so no "
                "relative divergence exists (zero-initialised output layers?). Use seeded random "
                "weights (Family.build) or real weights."
            )
        log_ratio = math.nan
        if self.step is not None:
            v_b = self.step.velocity(out_b, self.negative["b"])
            v_old, v_new = (
                (self.velocity_a, v_b) if self.rollout_is_source else (v_b, self.velocity_a)
            )
            log_ratio = float(self.step.log_ratio(v_old, v_new).abs().mean())
        return Divergence(
            rel_l2=float(d.norm()) / norm_a, rel_max=float(d.abs().max()) / max_a,
            log_ratio=log_ratio,
        )  # fmt: skip

    def _negative_outputs(self, inputs: Inputs) -> dict[str, Any]:
        """Each side's own negative-branch output where the step's CFG layout is "separate".

        Run once and held: no graft reaches the negative forward, so its drift stays in the
        residual. None for both sides otherwise (the batched layout carries both branches).
        """
        from lab.families import family as get_family

        step = self.step
        out: dict[str, Any] = {"a": None, "b": None}
        if step is None or not step.cfg_scale > 1.0 or inputs.negative is None:
            return out
        if get_family(step.family_name).cfg_layout != "separate":
            return out
        for key, side in (("a", self.source), ("b", self.target)):
            cast = side_inputs(inputs.negative, side, self.device)
            with (
                torch.no_grad(),
                self.views[key].applied(),
                side_context(side, self.device, self.model),
            ):
                out[key] = self.model(**cast.kwargs)
        return out


# ---- the result ----------------------------------------------------------------------------

_COLUMNS: tuple[str, ...] = (
    "position", "module", "module_class", "calls", "share", "own_share", "input_share",
    "rel_l2_after_graft", "rel_max_after_graft", "rel_l2_after_input_graft",
    "rel_max_after_input_graft", "evaluated",
)  # fmt: skip
_STEP_COLUMNS: tuple[str, ...] = ("log_ratio_after_graft", "log_ratio_after_input_graft")


@dataclass(frozen=True)
class GraftSet:
    """The fewest units whose grafts together remove `fraction` of R0, as measured."""

    modules: tuple[str, ...]
    """Unit paths, in the attribution's forward order."""
    fraction: float
    """The fraction asked for."""
    removed_fraction: float
    """1 - R / R0, R measured by one side-B forward grafting exactly `modules`."""
    reached: bool
    """removed_fraction >= fraction (False: even every unit did not remove that much)."""
    forwards: int
    """Side-B forwards this search ran (each grafting one candidate set)."""

    def __str__(self) -> str:
        """One sentence: the set, what it removed against what was asked, and its cost."""
        names = ", ".join(self.modules) or "no unit"
        verdict = "reached" if self.reached else "not reached, even with every unit"
        return (
            f"grafting {len(self.modules)} unit(s) ({names}) removes "
            f"{self.removed_fraction:.1%} of the divergence (asked {self.fraction:.0%}: "
            f"{verdict}; {self.forwards} side-B forward(s) measured it)"
        )


class Attribution:
    """Per-unit shares of the final model-output divergence, from cumulative grafts.

    Rows are units in forward order (the order of their first call on the grafted-from side).
    `share` = own_share + input_share; shares sum to 1 - residual. A fresh Attribution keeps the
    model and side A's captures so `smallest_set` can verify its sets with real forwards; one
    read back with `from_json` answers only the fractions computed before it was saved.
    """

    @checked_arguments
    def __init__(
        self,
        rows: list[dict[str, Any]],
        meta: dict[str, Any],
        *,
        sets: dict[str, GraftSet] | None = None,
        grafter: _Grafter | None = None,
    ) -> None:
        """Wrap computed rows and meta (`attribute` builds it; `from_json` reads it back)."""
        self.rows = rows
        self.meta = meta
        self._sets = dict(sets or {})
        self._grafter = grafter

    # -- numbers

    @property
    def metric(self) -> str:
        """The metric the shares are fractions of ("rel_l2" or "rel_max")."""
        return self.meta["metric"]

    @property
    def r0(self) -> Divergence:
        """Side B's own divergence from side A at the model output."""
        return Divergence(**self.meta["r0"])

    @property
    def residual(self) -> float:
        """Fraction of R0 that remains with every unit grafted (0 when R0 is 0)."""
        return float(self.meta["residual"])

    @property
    def identical(self) -> bool:
        """The two sides' model outputs are bit-identical (R0 == 0): nothing to attribute."""
        return self.r0.get(self.metric) == 0.0

    def table(self) -> pd.DataFrame:
        """One row per unit, in forward order (a DataFrame).

        Columns: position, module, module_class, calls, share, own_share, input_share,
        rel_l2/rel_max after grafting units 0..k (and after grafting unit k's inputs instead),
        with a step (`attribute_step`) the mean |log ratio| after those grafts
        (log_ratio_after_graft, log_ratio_after_input_graft), and `evaluated`: the forwards
        C(k) needed ("none" when unit k received and produced A's exact values, "graft", or
        "input+graft").
        """
        import pandas as pd

        columns = list(_COLUMNS)
        if self.meta.get("step"):
            columns[-1:-1] = _STEP_COLUMNS
        return pd.DataFrame(self.rows, columns=columns)

    def ranked(self) -> pd.DataFrame:
        """`table()` sorted by share, largest first (ties in forward order)."""
        return self.table().sort_values(
            ["share", "position"], ascending=[False, True], kind="stable"
        )

    def by_class(self) -> pd.DataFrame:
        """Shares summed per module class: units, share, own_share, input_share (largest first)."""
        df = self.table()
        grouped = df.groupby("module_class", sort=False).agg(
            units=("module", "count"),
            share=("share", "sum"),
            own_share=("own_share", "sum"),
            input_share=("input_share", "sum"),
        )
        return grouped.reset_index().sort_values("share", ascending=False, kind="stable")

    def top(self) -> dict[str, Any] | None:
        """The row with the largest share (None when there is no unit or nothing to attribute)."""
        if self.identical or not self.rows:
            return None
        return max(self.rows, key=lambda r: (r["share"], -r["position"]))

    @property
    def verdict(self) -> str:
        """One sentence: which unit takes the largest share, what it adds and inherits."""
        if self.identical:
            return IDENTICAL_VERDICT + "."
        top = self.top()
        if top is None:
            return "no unit was grafted."
        sides = f"{self.meta['grafted_from']} grafted into {self.meta['grafted_into']}"
        what = f"final {self.metric} divergence"
        if self.metric == "log_ratio":
            what = f"step-{self.meta['step']['step']} log-prob drift mean |log ratio|"
        failed = self.meta.get("failed")
        return (
            f"{top['module']} ({top['module_class']}) takes {top['share']:.1%} of the "
            f"{what} {self.r0.get(self.metric):.3g} (own {top['own_share']:.1%}, "
            f"input {top['input_share']:.1%}); residual after every graft "
            f"{self.residual:.1%} ({sides})."
            if failed is None
            else f"{top['module']} ({top['module_class']}) takes {top['share']:.1%} of the "
            f"{what} {self.r0.get(self.metric):.3g} among the {len(self.rows)} unit(s) grafted "
            f"before unit {failed['position']} ({failed['unit']}) failed ({failed['error']}); "
            f"residual after them {self.residual:.1%} ({sides})."
        )

    def summary(self) -> dict[str, Any]:
        """R0, the top unit and its share, the residual, the verdict and the cost."""
        top = self.top()
        keys = ("level", "metric", "grafted_from", "grafted_into", "reverse", "units")
        cost = ("unit_evaluations", "block_evaluations", "forwards", "forwards_equivalent")
        return {
            **{k: self.meta.get(k) for k in keys},
            "r0_rel_l2": self.r0.rel_l2,
            "r0_rel_max": self.r0.rel_max,
            "top_module": top["module"] if top else None,
            "top_share": top["share"] if top else 0.0,
            "input_share_total": sum(r["input_share"] for r in self.rows),
            "residual": self.residual,
            "verdict": self.verdict,
            **{k: self.meta.get(k) for k in cost},
        }

    # -- the smallest set

    @checked_arguments
    def smallest_set(self, fraction: float = 0.9) -> GraftSet:
        """The fewest units whose grafts together remove `fraction` of R0, verified.

        Cumulative shares depend on the order, so candidates are added greedily by share and
        each candidate set is measured by one real side-B forward grafting exactly that set.
        Once a set reaches the target, members are dropped (smallest share first) while the
        set without them still reaches it, so no member of the answer is superfluous.

        Args:
            fraction: In (0, 1]: the part of R0 (in this attribution's metric) to remove.

        Returns:
            A GraftSet with the modules and the removed fraction as measured.

        Raises:
            ValueError: A fraction outside (0, 1], or an Attribution read from JSON asked for
                a fraction it did not compute before it was saved.
        """
        if not isinstance(fraction, int | float) or not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"smallest_set: fraction must be in (0, 1] (0.9 = remove 90 % of R0), "
                f"got {fraction!r}."
            )
        key = repr(float(fraction))
        if key in self._sets:
            return self._sets[key]
        if self.identical:
            found = GraftSet((), float(fraction), 0.0, True, 0)
            self._sets[key] = found
            return found
        grafter = self._grafter
        if grafter is None:
            done = ", ".join(self._sets) or "none"
            raise ValueError(
                f"smallest_set: this Attribution was read from JSON and holds no model; it "
                f"answers only the fractions computed before it was saved ({done}). Run "
                "lab.attribute(model, inputs, side_a, side_b, ...) again for a new fraction."
            )
        metric, r0 = self.metric, self.r0.get(self.metric)
        target = (1.0 - fraction) * r0
        position = {r["module"]: r["position"] for r in self.rows}
        ranked = [r["module"] for r in self.ranked().to_dict("records")]
        measured: dict[frozenset[str], float] = {}

        def remaining(units: frozenset[str]) -> float:
            if units not in measured:
                with _held(grafter.model, "smallest_set"):
                    measured[units] = grafter.run(stubs=units).divergence.get(metric)
            return measured[units]

        chosen: frozenset[str] = frozenset()
        for name in ranked:
            chosen = chosen | {name}
            if remaining(chosen) <= target:
                break
        if remaining(chosen) <= target:
            for name in sorted(chosen, key=lambda n: (self._share(n), -position[n])):
                smaller = chosen - {name}
                if smaller and remaining(smaller) <= target:
                    chosen = smaller
        left = remaining(chosen)
        found = GraftSet(
            modules=tuple(sorted(chosen, key=position.__getitem__)),
            fraction=float(fraction),
            removed_fraction=1.0 - left / r0,
            reached=left <= target,
            forwards=len(measured),
        )
        self._sets[key] = found
        self.meta["unit_evaluations"] = grafter.unit_evaluations
        self.meta["block_evaluations"] = grafter.block_evaluations
        return found

    @checked_arguments
    def removed_by(self, modules: Sequence[str]) -> float:
        """The fraction of R0 that grafting exactly `modules` removes, by one side-B forward.

        Raises:
            ValueError: A name that is not a unit of this attribution, or an Attribution read
                from JSON (it holds no model).
        """
        known = [r["module"] for r in self.rows]
        bad = [m for m in modules if m not in known]
        if bad:
            near = difflib.get_close_matches(bad[0], known, n=3)
            raise ValueError(
                f"removed_by: {bad[0]!r} is not a unit of this attribution."
                + (f" Nearest: {', '.join(repr(n) for n in near)}." if near else "")
                + f" Units: {', '.join(known)}."
            )
        if self.identical:
            return 0.0
        if self._grafter is None:
            raise ValueError(
                "removed_by: this Attribution was read from JSON and holds no model. Run "
                "lab.attribute(model, inputs, side_a, side_b, ...) again to graft new sets."
            )
        with _held(self._grafter.model, "removed_by"):
            left = self._grafter.run(stubs=frozenset(modules)).divergence.get(self.metric)
        return 1.0 - left / self.r0.get(self.metric)

    def _share(self, module: str) -> float:
        return next(r["share"] for r in self.rows if r["module"] == module)

    # -- files

    def to_dict(self) -> dict[str, Any]:
        """Rows, meta and the smallest sets computed so far (JSON-ready)."""
        return {
            "rows": self.rows,
            "meta": self.meta,
            "smallest_sets": {k: dataclasses.asdict(s) for k, s in self._sets.items()},
        }

    @checked_arguments
    def to_json(self, path: str | Path) -> Path:
        """Write `to_dict()` atomically to `path` (parent folders created)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    @checked_arguments
    def from_json(cls, path: str | Path) -> Attribution:
        """Read an Attribution written by `to_json` (without the model: see `smallest_set`)."""
        doc = json.loads(Path(path).read_text())
        sets = {
            k: GraftSet(**{**s, "modules": tuple(s["modules"])})
            for k, s in doc.get("smallest_sets", {}).items()
        }
        return cls(doc["rows"], doc["meta"], sets=sets)

    def __repr__(self) -> str:
        """Attribution(level, metric, sides, units, verdict)."""
        return (
            f"Attribution(level={self.meta.get('level')!r}, metric={self.metric!r}, "
            f"{self.meta.get('grafted_from')!r} -> {self.meta.get('grafted_into')!r}, "
            f"{len(self.rows)} units: {self.verdict})"
        )


# ---- attribute -----------------------------------------------------------------------------


@checked_arguments
def attribute(
    model: torch.nn.Module,
    inputs: Inputs,
    side_a: Side,
    side_b: Side,
    *,
    level: Literal["block"] | int = "block",
    names: str | Sequence[str] | None = None,
    reverse: bool = False,
    metric: Metric | None = None,
    step: StepScore | None = None,
) -> Attribution:
    """Each unit's share of the final model-output divergence between two sides, by grafting.

    Side B runs with side A's outputs grafted in, unit after unit in forward order (each cast
    to the dtype B's own forward produces there), and what remains of the divergence is
    measured after each graft (see the module docstring for C(k), I(k) and the shares).

    Direction matters for dtype-only differences: a graft is cast to the receiving side's
    dtype, so grafting a wider side's values into a narrower side re-rounds them exactly as
    the narrower side does, and the unit that rounds shows no share. Graft from the narrower
    side into the wider one (`reverse=True` when side B is the narrower) to see it.

    Args:
        model: An fp32 master model (Family.build or Family.load).
        inputs: The pipeline's tensors (each side applies its own policy).
        side_a: The reference side (its outputs are grafted), rollout by convention.
        side_b: The candidate side (its forward receives the grafts).
        level: "block" (the root's children, ModuleLists expanded) or a depth >= 1.
        names: fnmatch globs selecting which units to graft (the rest count as input share).
        reverse: Graft side B's outputs into side A's forward instead.
        metric: "rel_l2" (||d|| / ||a||, smooth: the default without a step), "rel_max"
            (max |d| / max |a|, which jumps by whole ULPs of the output's largest element) or
            "log_ratio" (needs `step`; its default there): the mean |log_prob_new -
            log_prob_old| the divergence causes on that SDE step.
        step: A `StepScore` (`StepScore.from_trajectory(traj, i)`, or use `attribute_step`):
            every graft is also scored as the log-ratio of that step, side A taken as the
            rollout (side B with reverse=True), `inputs` being that step's inputs. Adds the
            `log_ratio_after_graft` columns; for a "separate" CFG layout the negative branch
            is each side's own forward, held, so its drift stays in the residual.

    Returns:
        An Attribution; `meta` records the sides, the level, R0 and the cost (unit and block
        evaluations, forwards, forwards_equivalent).

    Raises:
        ValueError: An unknown level or metric, names matching no unit, a side that is not a
            Side or cannot run on the model's device, outputs of different shapes.
        AttributionError: A graft failed after earlier units were grafted (out of memory, a
            forward error): `err.attribution` holds those units' rows, the residual after
            them and `meta["failed"]` (the unit and the error). A failure before any unit
            was grafted raises the error itself.
    """
    _check_level(level)
    if metric is None:
        metric = "log_ratio" if step is not None else "rel_l2"
    if metric not in METRICS:
        raise ValueError(
            f"attribute: unknown metric {metric!r}. Use 'rel_l2' (||b - a|| / ||a||, the "
            "default), 'rel_max' (max |b - a| / max |a|) or, with a step, 'log_ratio'."
        )
    if metric == "log_ratio" and step is None:
        raise ValueError(
            "attribute: metric 'log_ratio' needs step=StepScore(...) (the SDE step whose "
            "log-prob drift to attribute); use lab.attribute_step(traj, i) with a trajectory, "
            "or metric='rel_l2'."
        )
    if step is not None and not isinstance(step, StepScore):
        raise ValueError(
            f"attribute: step must be a lab.rl.step_score.StepScore (StepScore.from_trajectory("
            f"traj, i)), got {type(step).__name__}."
        )
    for label, side in (("side_a", side_a), ("side_b", side_b)):
        if not isinstance(side, Side):
            raise ValueError(
                f"attribute: {label} must be a lab.Side (e.g. lab.Side.rollout(fam)), got "
                f"{type(side).__name__}."
            )
    units = attribution_units(model, level, names)
    device = model_device(model)
    for side in (side_a, side_b):
        check_side_device(side, device, model)
    check_fp32_master(model, "attribute")
    check_inputs(model, inputs, "attribute")
    if held := _nonfinite_inputs(inputs):
        raise ValueError(f"attribute: shares of a NaN/Inf divergence mean nothing.{held}")
    source, target = (side_b, side_a) if reverse else (side_a, side_b)
    with _held(model, "attribute"):
        grafter = _Grafter(
            model, inputs, source, target, units, step=step, rollout_is_source=not reverse
        )
        failed: _WalkFailed | None = None
        try:
            rows, residual = _walk(grafter, metric)
        except _WalkFailed as walk:
            rows, residual, failed = walk.rows, walk.residual, walk
    classes = {n: type(m).__name__ for n, m in units}
    for row in rows:
        row["module_class"] = classes[row["module"]]
    per_forward = max(grafter.unit_calls_per_forward, 1)
    meta = {
        "level": level,
        "names": names if names is None or isinstance(names, str) else list(names),
        "metric": metric,
        "reverse": reverse,
        "side_a": side_a.to_dict(),
        "side_b": side_b.to_dict(),
        "grafted_from": source.name,
        "grafted_into": target.name,
        "model_class": type(model).__name__,
        "units": len(rows),
        "r0": {
            k: v
            for k, v in dataclasses.asdict(grafter.baseline).items()
            if step is not None or k != "log_ratio"
        },
        "residual": residual,
        "ungraftable": dict(grafter.ungraftable),
        "not_called": list(grafter.not_called),
        "output_dtypes": {
            "grafted_from": sorted({dtype_name(t.dtype) for _, t in grafter.leaves_a}),
            "grafted_into": sorted({dtype_name(t.dtype) for _, t in grafter.leaves_b}),
        },
        "unit_calls_per_forward": grafter.unit_calls_per_forward,
        "unit_evaluations": grafter.unit_evaluations,
        "block_evaluations": grafter.block_evaluations,
        "forwards": grafter.forwards,
        "forwards_equivalent": grafter.unit_evaluations / per_forward,
        "device": str(device),
        "step": step.to_dict() if step is not None else None,
    }
    if inputs.origin is not None:
        meta["family"], meta["preset"], meta["variant"] = inputs.origin
    if failed is not None:
        cause = failed.__cause__
        if not rows:
            raise cause  # no unit grafted yet: the error as it is
        error = f"{type(cause).__name__}: {cause}"
        meta["failed"] = {"position": failed.position, "unit": failed.unit, "error": error}
        done = Attribution(rows, meta, grafter=grafter)
        raise AttributionError(
            f"attribute: the graft of unit {failed.position} of {len(units)} "
            f"({failed.unit!r}) failed: {error}. The {len(rows)} unit(s) grafted before it are "
            "in err.attribution (their shares, and the residual after them; its "
            "meta['failed'] says where).",
            done,
        ) from cause
    return Attribution(rows, meta, grafter=grafter)


@checked_arguments
def attribute_step(
    traj: Trajectory,
    step: int,
    *,
    level: Literal["block"] | int = "block",
    names: str | Sequence[str] | None = None,
    reverse: bool = False,
    metric: Metric = "log_ratio",
    model: torch.nn.Module | None = None,
) -> Attribution:
    """Each unit's share of the log-prob drift at one step of a trajectory, by grafting.

    Rebuilds the step's model (the trajectory's family, preset, seed, init and the step's
    expert) and inputs (the first prompt's first forward: its x_t at that sigma, with CFG as the
    trajectory ran it), then runs `attribute` between the trajectory's rollout (side A) and
    trainer (side B) with `StepScore.from_trajectory(traj, step)`: shares are fractions of the
    mean |log_prob_new - log_prob_old| of those samples, and R0 is exactly what the trajectory
    measured there (`meta["step"]`).

    Args:
        traj: A `lab.trajectory(...)` result with its tensors (keep_tensors=True).
        step: An in-window step index.
        level: As in `attribute`.
        names: As in `attribute`.
        reverse: As in `attribute` (the trainer's outputs grafted into the rollout).
        metric: "log_ratio" (default), "rel_l2" or "rel_max" (the log-ratio columns are
            filled either way).
        model: The step's model if already built (must be the same weights); None builds it.

    Raises:
        ValueError: A trajectory without tensors, a step outside the schedule or the SDE
            window, or anything `attribute` refuses.
    """
    from lab.families import family as get_family
    from lab.rl.latents import unflatten_samples

    score = StepScore.from_trajectory(traj, step)
    meta = traj.meta
    fam = get_family(meta["family"])
    record = traj.steps[step]
    device = meta["device"]
    if model is None:
        init = {} if meta.get("init") is None else {"init": meta["init"]}
        model = fam.build(
            meta["preset"], meta["seed"], variant=meta.get("variant"), expert=record.expert,
            device=device, **init,
        )  # fmt: skip
    inputs = fam.make_inputs(
        meta["preset"], meta["seed"], score.batch, score.cfg_scale > 1.0,
        variant=meta.get("variant"), sigma=record.sigma,
        latents=unflatten_samples(score.x_t, score.shapes), device=device,
    )  # fmt: skip
    side_a, side_b = Side.from_dict(meta["side_a"]), Side.from_dict(meta["side_b"])
    attr = attribute(
        model, inputs, side_a, side_b, level=level, names=names, reverse=reverse, metric=metric,
        step=score,
    )  # fmt: skip
    attr.meta["trajectory"] = {k: meta.get(k) for k in ("family", "preset", "seed", "steps")}
    return attr


@contextlib.contextmanager
def _held(model: torch.nn.Module, where: str) -> Iterator[None]:
    """`model_in_use`, in eval mode (only the modules that were training go back)."""
    with model_in_use(model, where):
        training = [m for m in model.modules() if m.training]
        for m in training:
            m.training = False
        try:
            yield
        finally:
            for m in training:
                m.training = True


def _walk(grafter: _Grafter, metric: str) -> tuple[list[dict[str, Any]], float]:
    """Cumulative grafts in forward order; returns the rows and the residual fraction."""
    r0 = grafter.baseline
    r0_value = r0.get(metric)
    with_step = grafter.step is not None
    rows: list[dict[str, Any]] = []
    order = grafter.order

    def row(k: int, name: str, before: Divergence, inp: Divergence, after: Divergence, how: str):
        share = own = in_share = 0.0
        if r0_value > 0:
            share = (before.get(metric) - after.get(metric)) / r0_value
            in_share = (before.get(metric) - inp.get(metric)) / r0_value
            own = (inp.get(metric) - after.get(metric)) / r0_value
        out = {
            "position": k,
            "module": name,
            "module_class": "",
            "calls": grafter.a_calls.get(name, 0),
            "share": share,
            "own_share": own,
            "input_share": in_share,
            "rel_l2_after_graft": after.rel_l2,
            "rel_max_after_graft": after.rel_max,
            "rel_l2_after_input_graft": inp.rel_l2,
            "rel_max_after_input_graft": inp.rel_max,
            "evaluated": how,
        }
        if with_step:
            out["log_ratio_after_graft"] = after.log_ratio
            out["log_ratio_after_input_graft"] = inp.log_ratio
        return out

    if r0_value == 0.0:
        # Bit-identical outputs: no graft can remove anything, and no share is 0/0.
        return [row(k, n, r0, r0, r0, "none") for k, n in enumerate(order)], 0.0
    last = grafter.first
    before = r0
    for k, name in enumerate(order):
        same_in = last.same_inputs.get(name, False)
        same_out = last.same_outputs.get(name, False)
        if same_in and same_out:
            rows.append(row(k, name, before, before, before, "none"))
            continue
        try:
            if same_in:
                inp, how = before, "graft"
            else:
                graft = grafter.run(frozenset(order[:k]), input_graft=name)
                inp, how = graft.divergence, "input+graft"
            last = grafter.run(frozenset(order[: k + 1]))
        except Exception as err:
            # The units grafted so far keep their rows; what is left is their residual.
            raise _WalkFailed(rows, before.get(metric) / r0_value, k, name) from err
        after = last.divergence
        rows.append(row(k, name, before, inp, after, how))
        before = after
    residual = before.get(metric) / r0_value
    return rows, residual


class _WalkFailed(Exception):
    """A graft of `_walk` raised: the rows of the units before it, and their residual."""

    def __init__(self, rows: list[dict[str, Any]], residual: float, k: int, name: str) -> None:
        super().__init__(f"the graft of unit {k} ({name!r}) failed")
        self.rows, self.residual, self.position, self.unit = rows, residual, k, name


# ---- known scenarios -----------------------------------------------------------------------


@dataclass(frozen=True)
class ScenarioAttribution:
    """What a known bug adds, per unit: its fixed side with the buggy variant grafted."""

    scenario: str
    family_name: str
    attribution: Attribution
    expected_culprit: str
    culprit_units: tuple[str, ...]
    """The unit(s) holding the expected culprit; () when it is root code (an input share)."""
    culprit_share: float
    """Summed share of `culprit_units`, or for root code every input share plus the residual."""
    top_module: str | None
    top_share: float
    culprit_class_share: float
    """Summed share of every unit of the culprit unit's class (e.g. all blocks, all ropes)."""
    direction: str
    """"fixed->bug" or "bug->fixed": which side's values are grafted into which."""
    sites: tuple[str, ...] = ()
    """The scenario's `sites`: every place its bug acts (globs, "<root>" for root code)."""
    site_units: tuple[str, ...] = ()
    """Units at, inside or holding a site."""
    site_share: float = 0.0
    """What the sites take together: the site units' shares, plus, where the code feeding a
    unit is a site's (root code when "<root>" is a site), that unit's input share, plus the
    residual when the root is a site."""
    outside_top_module: str | None = None
    outside_top_share: float = 0.0
    """The largest share of a unit outside every site (its own part only when the code
    feeding it is a site's)."""

    @property
    def sites_take_largest_share(self) -> bool:
        """The bug's sites together take more than any unit outside them (and something)."""
        return self.site_share > 0.0 and self.site_share >= self.outside_top_share

    @property
    def culprit_is_largest(self) -> bool:
        """No single unit (and, for root code, no unit) takes more than the culprit."""
        # Root code is compared with what each unit adds itself: a unit's share includes the
        # root code feeding it (its input share), which is the culprit's own part.
        column = "share" if self.culprit_units else "own_share"
        others = [r[column] for r in self.attribution.rows if r["module"] not in self.culprit_units]
        return not others or self.culprit_share >= max(others)

    @property
    def first_contributor(self) -> tuple[str, str] | None:
        """The first (unit, "input" or "own") in forward order whose share is not 0."""
        for r in self.attribution.rows:
            if r["input_share"] != 0.0:
                return r["module"], INPUT
            if r["own_share"] != 0.0:
                return r["module"], "own"
        return None

    @property
    def culprit_comes_first(self) -> bool:
        """The first nonzero share in forward order belongs to the culprit.

        That is the culprit's unit (its own code or a boundary input it consumes) or, for root
        code, an input share.
        """
        first = self.first_contributor
        if first is None:
            return False
        module, part = first
        return module in self.culprit_units or (not self.culprit_units and part == INPUT)

    @property
    def culprit_class_is_largest(self) -> bool:
        """No other module class takes more than the culprit unit's class (`by_class`)."""
        if not self.culprit_units:
            return self.culprit_is_largest
        rows = {r["module"]: r for r in self.attribution.rows}
        classes = {rows[u]["module_class"] for u in self.culprit_units}
        others = self.attribution.by_class()
        others = others[~others["module_class"].isin(classes)]
        return others.empty or self.culprit_class_share >= float(others["share"].max())

    def row(self) -> dict[str, Any]:
        """One line for a table of scenarios."""
        return {
            "scenario": self.scenario,
            "level": self.attribution.meta["level"],
            "family": self.family_name,
            "direction": self.direction,
            "expected_culprit": self.expected_culprit,
            "culprit_unit": ", ".join(self.culprit_units) or f"<{INPUT} shares>",
            "culprit_share": self.culprit_share,
            "culprit_class_share": self.culprit_class_share,
            "top_module": self.top_module,
            "top_share": self.top_share,
            "culprit_is_largest": self.culprit_is_largest,
            "culprit_class_is_largest": self.culprit_class_is_largest,
            "culprit_comes_first": self.culprit_comes_first,
            "site_share": self.site_share,
            "outside_top_module": self.outside_top_module,
            "outside_top_share": self.outside_top_share,
            "sites_take_largest_share": self.sites_take_largest_share,
            "r0_rel_l2": self.attribution.r0.rel_l2,
            "unit_evaluations": self.attribution.meta["unit_evaluations"],
            "forwards_equivalent": self.attribution.meta["forwards_equivalent"],
        }


def culprit_units(attr: Attribution, culprit: str) -> tuple[str, ...]:
    """The unit(s) of `attr` that hold module path `culprit`.

    The unit itself or its ancestor; every unit inside it when the culprit is coarser than
    the level; () for "<root>" or a path in no unit (root code, seen as input shares).
    """
    if culprit == ROOT:
        return ()
    names = [r["module"] for r in attr.rows]
    for name in names:
        if culprit == name or culprit.startswith(name + "."):
            return (name,)
    return tuple(n for n in names if n.startswith(culprit + "."))


def attribute_scenario(
    name_or_run: str | ScenarioRun,
    *,
    level: Literal["block"] | int = "block",
    preset: str = "tiny",
    device: str = "cpu",
    seed: int = 0,
    reverse: bool | None = None,
    metric: Metric = "rel_l2",
) -> ScenarioAttribution:
    """Attribute what a known bug adds: the fixed variant against the buggy one.

    A scenario's bug pair differs from its fixed pair in one side (the other is shared), so
    side A is that side's fixed variant and side B its buggy variant: the divergence between
    them is the bug alone, not the other rollout-vs-trainer differences. By default the graft
    goes from the narrower side into the wider one (see `attribute`): the buggy side's values
    into the fixed forward when, over every unit call, the bug holds more values in a narrower
    dtype than the fix, and the other way otherwise.

    Args:
        name_or_run: A scenario name (`lab.scenarios.names("cpu")`) or a ScenarioRun (its
            preset and seed are read from the run's meta).
        level: As in `attribute`.
        preset: Family preset when a name is given.
        device: "cpu" or "cuda".
        seed: Weight seed (inputs use seed 0, like `lab.scenarios.run`).
        reverse: None: choose by dtype as above; True: graft the buggy side into the fixed
            one; False: the fixed side into the buggy one.
        metric: As in `attribute`.

    Raises:
        ValueError: An unknown scenario, a GPU scenario on CPU, or a scenario whose bug and
            fixed pairs differ in both sides.
    """
    from lab.engine import scenarios
    from lab.families import family as get_family

    if isinstance(name_or_run, str):
        scenario = scenarios.get(name_or_run)
    else:
        scenario = name_or_run.scenario
        preset = name_or_run.bug.meta.get("preset", preset)
        seed = name_or_run.bug.meta.get("seed", seed)
    if scenario.needs_gpu and torch.device(device).type != "cuda":
        raise ValueError(
            f"attribute_scenario: {scenario.name!r} needs a CUDA device: {scenario.why_gpu}"
        )
    fam = get_family(scenario.family_name)
    model = fam.build(preset, seed, device=device, expert=fam.expert_for_sigma(0.75))
    inputs = (
        scenario.inputs(fam, preset, device)
        if scenario.inputs is not None
        else fam.make_inputs(preset, 0, device=device)
    )
    bug_a, bug_b, fixed_a, fixed_b = scenario.sides(fam, device)
    if bug_a != fixed_a and bug_b != fixed_b:
        raise ValueError(
            f"attribute_scenario: {scenario.name!r} changes both sides between its bug and its "
            "fix, so no single side carries the bug; attribute the pairs with lab.attribute."
        )
    fixed, bug = (fixed_a, bug_a) if bug_a != fixed_a else (fixed_b, bug_b)
    if reverse is None:
        reverse = _bug_is_narrower(model, inputs, fixed, bug)
    attr = attribute(model, inputs, fixed, bug, level=level, reverse=reverse, metric=metric)
    attr.meta["scenario"] = scenario.name
    units = culprit_units(attr, scenario.expected_culprit)
    rows = {r["module"]: r for r in attr.rows}
    if units:
        share = sum(rows[u]["share"] for u in units)
        classes = {rows[u]["module_class"] for u in units}
        class_share = sum(r["share"] for r in attr.rows if r["module_class"] in classes)
    else:
        share = sum(r["input_share"] for r in attr.rows) + attr.residual
        class_share = share
    top = attr.top()
    sites = site_shares(model, attr, scenario.sites)
    return ScenarioAttribution(
        scenario=scenario.name,
        family_name=scenario.family_name,
        attribution=attr,
        expected_culprit=scenario.expected_culprit,
        culprit_units=units,
        culprit_share=share,
        top_module=top["module"] if top else None,
        top_share=top["share"] if top else 0.0,
        culprit_class_share=class_share,
        direction="bug->fixed" if reverse else "fixed->bug",
        sites=tuple(scenario.sites),
        **sites,
    )


def site_shares(model: torch.nn.Module, attr: Attribution, sites: Sequence[str]) -> dict[str, Any]:
    """How the shares of `attr` split between a bug's sites and everything else.

    A unit belongs to the sites when it is a site module, lies inside one, or holds one (at a
    coarser level than the sites, the whole unit). The code feeding a unit (its input share)
    belongs to the module whose forward calls it (containers skipped; the root for top-level
    units): a site's code when that module is at or inside a site, or is the root and
    "<root>" is a site. The residual is root code.

    Returns:
        site_units, site_share, outside_top_module, outside_top_share (ScenarioAttribution's
        fields).
    """
    root_site = ROOT in sites
    globs = [g for g in sites if g != ROOT]
    matched = {
        name
        for name, _ in model.named_modules()
        if name and any(fnmatch.fnmatch(name, g) for g in globs)
    }

    def at_or_inside(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in matched for i in range(1, len(parts) + 1))

    def holds(path: str) -> bool:
        return any(m.startswith(path + ".") for m in matched)

    def caller(path: str) -> str:
        parts = path.split(".")[:-1]
        while parts and isinstance(model.get_submodule(".".join(parts)), _CONTAINERS):
            parts.pop()
        return ".".join(parts)

    site_units: list[str] = []
    share = attr.residual if root_site else 0.0
    outside: list[tuple[float, str]] = []
    for r in attr.rows:
        name = r["module"]
        if at_or_inside(name) or holds(name):
            site_units.append(name)
            share += r["share"]
            continue
        owner = caller(name)
        if (owner == "" and root_site) or (owner and at_or_inside(owner)):
            share += r["input_share"]
            outside.append((r["own_share"], name))
        else:
            outside.append((r["share"], name))
    top_share, top_module = max(outside, default=(0.0, None))
    return {
        "site_units": tuple(site_units),
        "site_share": share,
        "outside_top_module": top_module,
        "outside_top_share": top_share,
    }


def _bug_is_narrower(model: torch.nn.Module, inputs: Inputs, fixed: Side, bug: Side) -> bool:
    """Over every unit call's floating inputs and outputs, the bug holds more narrower dtypes."""
    narrower = wider = 0
    with _held(model, "attribute_scenario"):
        grafter = _Grafter(model, inputs, fixed, bug, attribution_units(model, "block"))
    for key, (args, kwargs) in grafter.a_in.items():
        pairs = [
            (_dtype_tree(args), grafter.b_in_dtypes.get(key, (None, None))[0]),
            (_dtype_tree(kwargs), grafter.b_in_dtypes.get(key, (None, None))[1]),
            (_dtype_tree(grafter.a_out[key]), grafter.b_out_dtypes.get(key)),
        ]
        for fixed_tree, bug_tree in pairs:
            for a, b in _dtype_pairs(fixed_tree, bug_tree):
                if a.is_floating_point and b.is_floating_point and a != b:
                    if b.itemsize < a.itemsize:
                        narrower += 1
                    elif b.itemsize > a.itemsize:
                        wider += 1
    return narrower > wider


def _dtype_pairs(a: Any, b: Any) -> Iterator[tuple[torch.dtype, torch.dtype]]:
    if isinstance(a, torch.dtype) and isinstance(b, torch.dtype):
        yield a, b
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            yield from _dtype_pairs(x, y)
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() & b.keys():
            yield from _dtype_pairs(a[k], b[k])


def scenario_attribution_table(results: Sequence[ScenarioAttribution]) -> pd.DataFrame:
    """One row per scenario: culprit unit and share, the top unit and share, the cost."""
    import pandas as pd

    return pd.DataFrame([r.row() for r in results])

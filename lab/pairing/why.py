"""explain(): why each divergent row differs, from the two sides and the recorded dtype flow.

A row's cause is looked for at its own module call first (local causes), then inside it (a
submodule that differs first) and upstream (its inputs already differ):

- `input_dtype`: the tensors handed to the call differ in dtype (at the model itself: the
  sides' input_dtype_policy);
- `param_dtype`: a parameter the module owns is held at another dtype, and which setting made
  it so: the side's forward/param dtype, the engine's fp32 keep list, a param_dtype_rules glob
  (or the master dtype it was rounded through);
- `buffer_dtype`: a buffer it owns differs (the engine casts persistent buffers, FSDP2 does not);
- `autocast`: its op runs in another dtype on the two sides, and which autocast op list put it
  there (CUDA's lower-precision / fp32 / promote lists, or torch's CPU lists);
- `engine_op` / `op_switch`: an engine patch group or op switch replaces its forward on one
  side (input switches act on the model inputs, reported at the model);
- `attention_kernel`: the sides pin different SDPA kernels and the module computes attention;
- `submodule`: a module inside the call differs first (named);
- `inherited`: propagated mode only, its inputs already differ (named: the first divergent
  module upstream of them); in local mode every module runs on side A's exact inputs, so a
  local-mode row never inherits;
- `unexplained`: it differs and none of the above was recorded.

Upstream is traced through the tensors themselves: each input of side A's call is matched to
the captured output (or model input) it was, when it was one; an input computed in between
(a residual sum inside a block) is charged to what ran before it inside the enclosing call and
to that call's own inputs. Rows that do not differ get an empty `Why`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lab.base.dtypes import dtype_name
from lab.pairing.capture import ROOT
from lab.pairing.dtype_flow import MODEL_INPUT, DtypeFlow, InputEntry

if TYPE_CHECKING:
    from lab.pairing.result import LayerDivergence
    from lab.pairing.sides import Side
    from lab.pairing.weights import WeightPlan

CAUSES: dict[str, str] = {
    "input_dtype": "the tensors handed to the module differ in dtype",
    "param_dtype": "a parameter it owns is held at another dtype (and the setting that did it)",
    "buffer_dtype": "a buffer it owns is held at another dtype (engine buffer casts)",
    "autocast": "its op runs in another dtype under an autocast op list",
    "engine_op": "an engine patch group replaces its forward on one side",
    "op_switch": "an engine op switch replaces its forward (or the model inputs) on one side",
    "attention_kernel": "the sides pin different attention kernels at this attention module",
    "implementation": "the two implementations compute it differently (a named difference)",
    "submodule": "a module inside it differs first",
    "inherited": "its inputs already differ (propagated mode): the first divergent module upstream",
    "unexplained": "no recorded difference at this module",
}
"""Cause codes, in the order a `Why` lists them, with what each means."""


@dataclass(frozen=True)
class Why:
    """The cause(s) of one row's divergence: codes for programs, parts for people.

    An empty Why (no codes) means the row does not differ.
    """

    codes: tuple[str, ...] = ()
    """Cause codes (keys of `CAUSES`), one per part."""
    parts: tuple[str, ...] = ()
    """One short sentence fragment per cause, e.g. "buffer pos_embed.pos_embed: ..."."""
    upstream: str | None = None
    """Label of the first divergent module upstream of the inputs (code `inherited`)."""
    inside: str | None = None
    """Label of the first divergent submodule (code `submodule`)."""

    @property
    def text(self) -> str:
        """The parts joined by "; " ("" for a row that does not differ)."""
        return "; ".join(self.parts)

    @classmethod
    def from_text(cls, text: str, codes: Sequence[str]) -> Why:
        """Rebuild a Why from its text and codes (a saved row's `why` and `why_codes`)."""
        parts = tuple(text.split("; ")) if text else ()
        if len(parts) != len(codes):
            parts = (text,) if text else ()
        return cls(codes=tuple(codes), parts=parts)


# Module classes whose forward is one op on an autocast list: the op it runs.
_MODULE_OPS: dict[str, str] = {
    "Linear": "linear",
    "Conv1d": "conv1d",
    "Conv2d": "conv2d",
    "Conv3d": "conv3d",
    "ConvTranspose1d": "conv_transpose1d",
    "ConvTranspose2d": "conv_transpose2d",
    "ConvTranspose3d": "conv_transpose3d",
    "PReLU": "prelu",
    "LayerNorm": "layer_norm",
    "GroupNorm": "group_norm",
    "Softmax": "softmax",
    "LogSoftmax": "log_softmax",
    "Softplus": "softplus",
    "MultiheadAttention": "multi_head_attention_forward",
}

# torch 2.11's CPU autocast casts these module ops to the lower dtype (AutocastCPU kernels in
# aten/src/ATen/autocast_mode.cpp); layer_norm, group_norm, softmax and the rest of the table
# above have no CPU autocast kernel and run in their input dtype (see lab.precision.autocast).
_CPU_LOWER_PRECISION_OPS = frozenset(
    {
        "linear",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "prelu",
        "multi_head_attention_forward",
    }
)

_LIST_NAMES = {
    "lower_precision_fp": "CUDA lower-precision list",
    "fp32": "CUDA fp32 list",
    "fp32_set_opt_dtype": "CUDA fp32 list, dtype=float32",
    "fp32_append_dtype": "CUDA fp32 list",
    "promote": "CUDA promote list",
}


def explain(
    rows: Sequence[LayerDivergence], side_a: Side, side_b: Side, flow: DtypeFlow
) -> list[Why]:
    """The Why of every row (in `rows`' order); rows that do not differ get an empty Why.

    Args:
        rows: A Result's rows, in forward completion order.
        side_a: The reference side.
        side_b: The candidate side.
        flow: What the pair recorded (`Result.flow`).

    Returns:
        One Why per row.
    """
    return _Explainer(rows, side_a, side_b, flow).whys()


class _Explainer:
    def __init__(
        self, rows: Sequence[LayerDivergence], side_a: Side, side_b: Side, flow: DtypeFlow
    ) -> None:
        self.given = list(rows)
        self.rows = sorted(rows, key=lambda r: r.order)
        self.a, self.b, self.flow = side_a, side_b, flow
        self.names = _side_names(side_a, side_b)
        self.by_key = {(r.module, r.call, r.output): r for r in self.rows}
        self.by_order = {r.order: r for r in self.rows}
        self.div_orders = [r.order for r in self.rows if r.diverges]
        # Calls in completion order, each with the orders of its rows.
        self.calls: dict[tuple[str, int], list[int]] = {}
        for r in self.rows:
            self.calls.setdefault((r.module, r.call), []).append(r.order)
        self.start: dict[tuple[str, int], int] = {}
        self.parent: dict[tuple[str, int], tuple[str, int]] = {}
        self._nest()
        self._first_up: dict[tuple[str, int], Origin | None] = {}
        self._origin: dict[int, Origin] = {}
        self._causes: dict[tuple[str, int], list[tuple[str, str]]] = {}

    # ---- the call tree, from completion order -------------------------------------------

    def _nest(self) -> None:
        """Each call's window (its first descendant row's order) and enclosing captured call.

        Children finish before their parents, so the calls finished inside a call's window
        are the ones on top of the stack whose paths lie under its path.
        """
        stack: list[tuple[tuple[str, int], int]] = []
        for key in sorted(self.calls, key=lambda k: self.calls[k][0]):
            start = self.calls[key][0]
            while stack and _under(stack[-1][0][0], key[0]):
                child, child_start = stack.pop()
                self.parent[child] = key
                start = min(start, child_start)
            self.start[key] = start
            stack.append((key, start))

    def _first_divergent(self, lo: int, hi: int) -> int | None:
        """Order of the first divergent row with lo <= order < hi."""
        i = bisect.bisect_left(self.div_orders, lo)
        if i < len(self.div_orders) and self.div_orders[i] < hi:
            return self.div_orders[i]
        return None

    def inside(self, key: tuple[str, int]) -> int | None:
        return self._first_divergent(self.start[key], self.calls[key][0])

    def first_up(self, key: tuple[str, int]) -> Origin | None:
        """The first divergence upstream of the call's inputs (propagated mode), or None."""
        if key not in self._first_up:
            found = [
                o
                for entry in self.flow.inputs_a.get(key, ())
                if entry[1].is_floating_point
                for o in self.entry_origins(key, entry)
            ]
            self._first_up[key] = min(found, default=None)
        return self._first_up[key]

    def entry_origins(self, key: tuple[str, int], entry: InputEntry) -> list[Origin]:
        """Where one input tensor of a call may have picked up a difference."""
        _, _, producer, ident = entry
        if producer is not None:
            if producer[0] == MODEL_INPUT:
                return []  # same values on both sides; a dtype difference is `input_dtype`
            row = self.by_key.get(producer)
            if row is not None:
                return [self.origin(row.order)] if row.diverges else []
        parent = self.parent.get(key)
        if parent is not None:
            for outer in self.flow.inputs_a.get(parent, ()):
                if outer[3] == ident:  # handed on unchanged from the enclosing call's inputs
                    return self.entry_origins(parent, outer)
        # Computed inside the enclosing call: from what ran before it there, from that call's
        # own inputs, or by that call's own ops (its attention kernel, engine forward, tables).
        found: list[Origin] = []
        first = self._first_divergent(
            self.start[parent] if parent is not None else -1, self.start[key]
        )
        if first is not None:
            found.append(self.origin(first))
        if parent is not None:
            up = self.first_up(parent)
            if up is not None:
                found.append(up)
            inline = [t for c, t in self.causes(parent) if c in _INLINE_CAUSES]
            if inline:
                # Its own ops ran at some point before this call started.
                label = f"{parent[0]}, its own ops: {inline[0].partition(':')[0]}"
                found.append((self.start[key] - 0.5, label))
        return found

    def origin(self, order: int) -> Origin:
        """Where a divergent row's difference first appears (itself when nothing earlier)."""
        if order in self._origin:
            return self._origin[order]
        row = self.by_order[order]
        key = (row.module, row.call)
        found: list[Origin] = [(order, row.label())]
        inner = self.inside(key)
        if inner is not None:
            found.append(self.origin(inner))
        if self.flow.mode == "propagated":
            up = self.first_up(key)
            if up is not None:
                found.append(up)
        self._origin[order] = result = min(found)
        return result

    def causes(self, key: tuple[str, int]) -> list[tuple[str, str]]:
        """The call's local causes (memoized)."""
        if key not in self._causes:
            order = self.calls[key][0]
            self._causes[key] = list(self.local_causes(key, self.by_order[order].module_class))
        return self._causes[key]

    # ---- per call ---------------------------------------------------------------------------

    def whys(self) -> list[Why]:
        # Traced in completion order, so each lookup upstream finds its answer memoized
        # (recursion stays as deep as the module tree, not as long as the forward).
        for r in self.rows:
            if r.diverges:
                self.origin(r.order)
        by_call: dict[tuple[str, int], Why] = {}
        out = []
        for r in self.given:
            if not r.diverges:
                out.append(Why())
                continue
            key = (r.module, r.call)
            if key not in by_call:
                by_call[key] = self.why_of_call(key)
            out.append(by_call[key])
        return out

    def why_of_call(self, key: tuple[str, int]) -> Why:
        causes = list(self.causes(key))
        inner = self.inside(key)
        inside_label = self.by_order[inner].label() if inner is not None else None
        if inside_label is not None:
            causes.append(("submodule", f"first differs inside at {inside_label}"))
        upstream_label = None
        if self.flow.mode == "propagated":
            up = self.first_up(key)
            if up is not None:
                upstream_label = up[1]
                causes.append(("inherited", f"inherited from upstream ({upstream_label})"))
        if not causes:
            causes.append(
                (
                    "unexplained",
                    "no recorded cause: same input, parameter and buffer dtypes, forward and "
                    "kernel settings at this module",
                )
            )
        return Why(
            codes=tuple(c for c, _ in causes),
            parts=tuple(t.replace("; ", ", ") for _, t in causes),
            upstream=upstream_label,
            inside=inside_label,
        )

    def local_causes(self, key: tuple[str, int], module_class: str) -> Iterable[tuple[str, str]]:
        module = key[0]
        a_in = self.flow.inputs_a.get(key)
        b_in = self.flow.inputs_b.get(key)
        if a_in is not None and b_in is not None:
            text = self.input_difference(module, a_in, b_in)
            if text:
                yield "input_dtype", text
        if module == ROOT:
            yield from self.input_switches()
        tensors = self.flow.modules.get(module)
        if tensors is not None:
            yield from self.param_differences(tensors.params)
            yield from self.buffer_differences(tensors.buffers)
        if a_in is not None and b_in is not None:
            text = self.autocast_difference(module_class, a_in, b_in)
            if text:
                yield "autocast", text
        yield from self.engine_op_difference(module_class)
        if tensors is not None and tensors.attention:
            ka, kb = self.a.attention_backend, self.b.attention_backend
            if ka != kb:
                na, nb = self.names
                yield "attention_kernel", f"attention kernel: {na} {ka!r} vs {nb} {kb!r}"

    # ---- the causes -------------------------------------------------------------------------

    def input_difference(
        self, module: str, a_in: tuple[InputEntry, ...], b_in: tuple[InputEntry, ...]
    ) -> str | None:
        na, nb = self.names
        dtypes_a = {entry[0]: entry[1] for entry in a_in}
        dtypes_b = {entry[0]: entry[1] for entry in b_in}
        groups: dict[tuple[str, str], list[str]] = {}
        only: list[str] = []
        for arg in [*dtypes_a, *(k for k in dtypes_b if k not in dtypes_a)]:
            da, db = dtypes_a.get(arg), dtypes_b.get(arg)
            if da == db:
                continue
            if da is None or db is None:
                only.append(f"{_arg_name(arg)} only on {na if db is None else nb}")
                continue
            label = _arg_name(arg)
            if module == ROOT:
                label += self.policy_note(arg)
            groups.setdefault((dtype_name(da), dtype_name(db)), []).append(label)
        if not groups and not only:
            return None
        pieces = [f"{na} {a} vs {nb} {b} ({', '.join(args)})" for (a, b), args in groups.items()]
        return "inputs: " + ", ".join(pieces + only)

    def policy_note(self, arg: Any) -> str:
        role = self.flow.input_roles.get(arg) if isinstance(arg, str) else None
        policy_a, policy_b = dict(self.a.input_dtype_policy), dict(self.b.input_dtype_policy)
        if role not in policy_a or (policy_a[role] is None and policy_b.get(role) is None):
            return ""  # not a policy role ("aux"), or passed through on both sides
        return f": input_dtype_policy[{role!r}] {policy_a[role]!r} vs {policy_b.get(role)!r}"

    def input_switches(self) -> Iterable[tuple[str, str]]:
        from lab.precision.engine_ops import SWITCHES, check_engine_ops

        check_engine_ops((), {})  # loads the registry
        na, nb = self.names
        sa, sb = dict(self.a.op_switches), dict(self.b.op_switches)
        for name in [*sa, *(k for k in sb if k not in sa)]:
            switch = SWITCHES.get(name)
            if switch is None or switch.transform_inputs is None:
                continue
            va, vb = sa.get(name, switch.values[0]), sb.get(name, switch.values[0])
            if va != vb:
                yield "op_switch", f"op switch {name}: {na} {va!r} vs {nb} {vb!r} (model inputs)"

    def param_differences(self, params: tuple[tuple[str, str], ...]) -> Iterable[tuple[str, str]]:
        groups: dict[tuple[str, str], list[str]] = {}
        for name, master in params:
            ha = _held(self.flow.plan_a, name, master, param=True)
            hb = _held(self.flow.plan_b, name, master, param=True)
            if ha[0] != hb[0]:
                groups.setdefault((_describe(ha), _describe(hb)), []).append(name)
        na, nb = self.names
        for (a, b), names in groups.items():
            yield "param_dtype", f"params: {na} {a} vs {nb} {b} on {_names(names)}"

    def buffer_differences(
        self, buffers: tuple[tuple[str, str, bool], ...]
    ) -> Iterable[tuple[str, str]]:
        na, nb = self.names
        for name, own, _persistent in buffers:
            ha = _held(self.flow.plan_a, name, own, param=False)
            hb = _held(self.flow.plan_b, name, own, param=False)
            if ha[0] != hb[0]:
                yield "buffer_dtype", f"buffer {name}: {na} {_describe(ha)} vs {nb} {_describe(hb)}"

    def autocast_difference(
        self, module_class: str, a_in: tuple[InputEntry, ...], b_in: tuple[InputEntry, ...]
    ) -> str | None:
        op = _MODULE_OPS.get(module_class)
        if op is None:
            return None
        ca = _compute_dtype(self.a, op, a_in)
        cb = _compute_dtype(self.b, op, b_in)
        if ca is None or cb is None or ca[0] == cb[0]:
            return None
        if not (self.a.autocast or self.b.autocast):
            return None  # both run in their input dtypes: `input_dtype` says why
        na, nb = self.names
        first, second = ((nb, cb), (na, ca)) if self.b.autocast else ((na, ca), (nb, cb))
        return (
            f"autocast: {op} runs in {first[1][0]} on {first[0]} ({first[1][1]}), "
            f"{second[1][0]} on {second[0]} ({second[1][1]})"
        )

    def engine_op_difference(self, module_class: str) -> Iterable[tuple[str, str]]:
        from lab.precision.engine_ops import forward_source

        sa = forward_source(module_class, self.a.engine_ops, dict(self.a.op_switches))
        sb = forward_source(module_class, self.b.engine_ops, dict(self.b.op_switches))
        if sa == sb:
            return
        na, nb = self.names
        code = "op_switch" if "switch" in {s[0] for s in (sa, sb) if s is not None} else "engine_op"
        label = "op switch" if code == "op_switch" else "engine op"
        yield (
            code,
            f"{label}: {module_class} runs {_forward_name(sa)} on {na}, "
            f"{_forward_name(sb)} on {nb}",
        )


Origin = tuple[float, str]
"""(position in completion order, label) of where a difference first appears."""

# Causes at an enclosing call that also change what its own code computes between its
# submodules (the attention output, a patched block's modulation, a block-owned table).
_INLINE_CAUSES = frozenset(
    {"attention_kernel", "engine_op", "op_switch", "param_dtype", "buffer_dtype"}
)


def _under(path: str, ancestor: str) -> bool:
    """`path` names a module strictly inside `ancestor`."""
    if ancestor == ROOT:
        return path != ROOT
    return path.startswith(ancestor + ".")


def _side_names(a: Side, b: Side) -> tuple[str, str]:
    if a.name != b.name:
        return a.name, b.name
    return f"{a.name} (A)", f"{b.name} (B)"


def _arg_name(arg: Any) -> str:
    if isinstance(arg, tuple):
        return f"{_arg_name(arg[0])}[{arg[1]}]"
    if isinstance(arg, int):
        return f"arg {arg}"
    return str(arg)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:2])
    return shown + (f" (+{len(names) - 2} more)" if len(names) > 2 else "")


def _held(
    plan: WeightPlan, name: str, own: str, *, param: bool
) -> tuple[tuple[str, str | None], str]:
    """((dtype, master it was rounded through), what decided it) for one tensor of one side.

    As `WeightView.cast`: the master value goes through the plan's master dtype to the
    tensor's dtype; the master dtype matters only when it is neither of the two.
    """
    if param:
        dtype = plan.param_dtypes.get(name)
        source = plan.param_sources.get(name, ("forward_dtype", None))
    else:
        dtype = plan.buffer_dtypes.get(name)
        source = plan.buffer_sources.get(name, ("cast_buffers", None))
    if dtype is None:  # a buffer this side does not cast: held as is
        return (own, None), "buffers not cast"
    target, master = dtype_name(dtype), dtype_name(plan.master_dtype)
    via = master if master not in (own, target) else None
    return (target, via), _source_text(source)


def _source_text(source: tuple[str, str | None]) -> str:
    kind, detail = source
    if kind == "param_dtype_rules":
        return f"rule {detail!r}"
    if kind == "keep_fp32_modules":
        return f"engine fp32 keep {detail!r}"
    if kind == "cast_buffers":
        return "engine casts buffers"
    if kind == "constructed":
        return f"the class builds it {detail}; an engine load keeps that"
    return kind  # "forward_dtype" / "param_dtype"


def _describe(held: tuple[tuple[str, str | None], str]) -> str:
    (dtype, via), source = held
    through = f" through a {via} master" if via else ""
    return f"{dtype}{through} ({source})"


def _compute_dtype(side: Side, op: str, inputs: tuple[InputEntry, ...]) -> tuple[str, str] | None:
    """(dtype `op` computes in on `side`, which rule says so), from its recorded input dtypes."""
    floating = [entry[1] for entry in inputs if entry[1].is_floating_point]
    if not floating:
        return None
    own = dtype_name(floating[0])
    low = side.resolved_autocast_dtype
    if not side.autocast or low == "fp32":
        return own, "no autocast"
    if side.resolved_autocast_policy == "cpu":
        if op in _CPU_LOWER_PRECISION_OPS:
            return low, "CPU autocast lower-precision list"
        return own, "on no CPU autocast list"
    from lab.precision.autocast import cuda_op_list

    listed = cuda_op_list(op)
    if listed == "lower_precision_fp":
        return low, _LIST_NAMES[listed]
    if listed in ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype"):
        return "fp32", _LIST_NAMES[listed]
    if listed == "promote":
        widest = "fp32" if torch.float32 in floating else low
        return widest, _LIST_NAMES[listed]
    return own, "on no CUDA autocast list"


def _forward_name(source: tuple[str, str, Any] | None) -> str:
    if source is None:
        return "its class's own forward"
    kind, name, value = source
    if kind == "group":
        return f"the {name!r} engine forward"
    return f"the {name}={value!r} switch forward"

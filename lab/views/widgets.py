"""ipywidgets control panel: edits two Sides, calls pair, shows the plots in place.

    panel = control_panel("flux", "tiny")      # one call in a notebook shows it
    panel.set("trainer.input_dtype_policy.latents", "fp32")
    panel.run()                                 # what the Run button does
    panel.select("transformer_blocks.0.attn")   # what clicking that point does
    panel.prescribe(); panel.apply_prescription(1)   # the Prescribe and Apply buttons
    panel.last_result, panel.selected, panel.message, panel.stale_keys()

Everything the widgets do goes through `ControlPanel` methods, so tests drive the panel
without a browser. Each side has a control for every setting a row's "why" can name: dtypes,
each input role's policy, autocast, the rules, the engine fp32 keeps (`keep_fp32_modules`),
the buffer casts (`cast_buffers`), the attention kernel, and the engine patch groups and op
switches that apply to this family (the others are hidden). The model is built once per
(family, preset, device, seed, expert) and kept, so a toggle and a re-run on the tiny preset
only re-runs `pair`; an edit after a run marks the results stale (named settings, dimmed
results) until the next run, or runs at once with "run on every change". A bad setting (a rule
with an unknown dtype, a glob matching nothing, a keep naming no module) never raises out of
the panel: it becomes `panel.message`, shown in red with the nearest names, and the last good
result stays on screen. A forward that fails part-way is shown with its side, module and fix,
and the pairs compared before it. The divergence plot is plotly (hover: module, class, block,
dtypes and the module's own parameters, metrics, why); a click on a point, the module picker
below it and `select` show that output's row, its why, its ULP histogram and the dtype of
every parameter and buffer on both sides with what set it. Prescribe lists the cheapest
verified changes to one side (`lab.prescribe`) with their costs; Apply sets that side's
controls to a prescription and runs the pair. Clicks reach Python through `anywidget`;
without it the plot still hovers and zooms and the picker selects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import html
import io
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ipywidgets as W

from lab.base.arguments import checked_arguments
from lab.base.devices import DeviceName
from lab.base.dtypes import DTYPES, dtype_name
from lab.base.errors import PairError
from lab.families import FAMILY_NAMES, PRESETS, FamilyName
from lab.families import family as get_family
from lab.pairing.capture import ROOT
from lab.pairing.result import Result
from lab.pairing.run import MODES, pair
from lab.pairing.sides import ATTENTION_BACKENDS, AUTOCAST_POLICIES, PrecisionWarning, Side
from lab.pairing.weights import WeightPlan, plan_weights
from lab.precision.engine_ops import PATCH_GROUPS, SWITCHES, _load_definitions
from lab.precision.input_policy import POLICY_KEYS
from lab.precision.param_rules import RuleMatch, block_wraps, compile_param_dtype_maps
from lab.precision.param_rules import explain_rules as _explain_rules
from lab.views.plots.divergence import COLOR_BY, bitexact_words, divergence_spec

SIDE_NAMES: tuple[str, ...] = ("rollout", "trainer")
"""The reference side first, the candidate second, as in every table of the lab."""
POLICY_CHOICES: tuple[str, ...] = ("default", *DTYPES, "passthrough")
"""What the input_dtype_policy selectors offer; "passthrough" is the policy value None."""
SAME_AS_FORWARD = "forward"
"""Choice meaning None for param_dtype / autocast_dtype: use the side's forward_dtype."""
METRICS: tuple[str, ...] = ("rel_max", "max_abs_diff", "mean_abs_diff", "max_ulp", "cosine_dist")
_VIEW_KEYS: frozenset[str] = frozenset(
    {"metric", "color_by", "auto_run", "prescribe.movable", "prescribe.target"}
)
"""Controls that change how results are shown (or what Prescribe searches), not a pair's
settings: editing them never makes the results on screen stale."""
_STYLE = """<style>
.lab-results.lab-stale { opacity: 0.45; }
.lab-stale-note { background: #fff3cd; border: 1px solid #e0c060; padding: 3px 8px; }
.lab-verdict { font-weight: 600; margin: 2px 0 4px; }
.lab-verdict.lab-agree { color: #197319; }
</style>"""
_SUMMARY_KEYS: tuple[str, ...] = (
    "model_output_rel_max",
    "model_output_max_abs_diff",
    "model_output_mean_abs_diff",
    "max_ulp",
    "pairs",
    "bitexact_pairs",
    "skipped",
    "first_divergent_module",
)
_DRIFT_KEYS: tuple[str, ...] = (
    "ratio_abs_minus_1",
    "ratio_max_abs_minus_1",
    "log_prob_mean_abs_diff",
    "clip_frac",
)
_RUN_STAGES = 4  # validate + model, pair, ratio drift, plots


# ---- rules text ---------------------------------------------------------------------------


@checked_arguments
def parse_rules_text(text: str, *, where: str = "param_dtype_rules") -> dict[str, str]:
    """Turn the panel's rules text (one `glob: dtype` per line) into ordered rules.

    Blank lines and lines starting with `#` are skipped. The dtype is not checked here
    (`parse_dtype` does that when the rules compile), so the message names the rule.

    Args:
        text: e.g. two lines, "*norm*: fp32" and "proj_out.*: bf16".
        where: What the text configures, for the error message.

    Returns:
        glob -> dtype name, in line order (later rules win when they compile).

    Raises:
        ValueError: A line without `glob: dtype`, or a glob given twice (naming both lines).
    """
    rules: dict[str, str] = {}
    seen_on: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, colon, value = line.rpartition(":")
        pattern, value = pattern.strip(), value.strip()
        if not colon or not pattern or not value:
            raise ValueError(
                f"{where}, line {number}: {line!r} is not 'glob: dtype'. Write one rule per "
                "line, e.g. '*norm*: fp32'."
            )
        if pattern in rules:
            raise ValueError(
                f"{where}, line {number}: glob {pattern!r} is already on line {seen_on[pattern]}. "
                "Later rules win, so keep one of the two lines."
            )
        rules[pattern] = value
        seen_on[pattern] = number
    return rules


@checked_arguments
def format_rules_text(rules: Mapping[str, str]) -> str:
    """Inverse of `parse_rules_text`: one `glob: dtype` per line."""
    return "\n".join(f"{pattern}: {value}" for pattern, value in rules.items())


@checked_arguments
def parse_keep_text(text: str) -> tuple[str, ...]:
    """The panel's keep_fp32_modules text (names separated by commas or spaces) as a tuple.

    Example: "norm1, norm2 rope" -> ("norm1", "norm2", "rope"); a name given twice is kept once.
    """
    return tuple(dict.fromkeys(n for n in re.split(r"[,\s]+", text) if n))


@checked_arguments
def nearest_rule_names(pattern: str, names: Sequence[str], n: int = 3) -> list[str]:
    """Globs close to `pattern` that do match some of `names` (for a rule that matches none).

    Each literal piece of the glob that is in no name ("nrom2" of "*nrom2*") is replaced by
    the closest dotted component of the names ("norm2"), so a misspelt glob with wildcards
    gets a fix too, not only a full name.

    Returns:
        Up to `n` globs, each matching at least one name; [] when none is close.
    """
    import difflib
    import fnmatch

    pieces = [p for p in re.split(r"[*?]+|\[[^\]]*\]", pattern) if p]
    parts = sorted({part for name in names for part in name.split(".")})
    found: list[str] = []
    for piece in pieces:
        if any(piece in name for name in names):
            continue
        words = [w for w in piece.split(".") if w]
        for word in words:
            if word in parts:
                continue
            for close in difflib.get_close_matches(word, parts, n=n, cutoff=0.6):
                glob = pattern.replace(word, close)
                if glob not in found and any(fnmatch.fnmatchcase(m, glob) for m in names):
                    found.append(glob)
    return found[:n]


@checked_arguments
def rule_matches_table(matches: Sequence[RuleMatch]) -> Any:
    """What each rule matched, one row per rule (a pandas DataFrame).

    Columns: pattern, dtype, parameters (names matched, aliases included), elements, effective
    (parameters this rule still decides after later rules), examples (first names).
    """
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "pattern": m.pattern,
                "dtype": m.dtype_name,
                "parameters": len(m.names),
                "elements": m.numel,
                "effective": m.effective,
                "examples": ", ".join(m.names[:3]) + (" ..." if len(m.names) > 3 else ""),
            }
            for m in matches
        ],
        columns=["pattern", "dtype", "parameters", "elements", "effective", "examples"],
    )


# ---- one module's detail ------------------------------------------------------------------

_DETAIL_COLUMNS: tuple[str, ...] = (
    "label",
    "module_class",
    "shape",
    "dtype_a",
    "dtype_b",
    "rel_max",
    "max_abs_diff",
    "mean_abs_diff",
    "max_ulp",
    "bitexact_frac",
    "cosine_dist",
    "rounding_only",
)


@dataclass(frozen=True)
class ModuleDetail:
    """What clicking a point of the divergence plot shows (`ControlPanel.select` returns it)."""

    label: str
    """The selected entry: one paired output `module[:output][#call]`, or a module path."""
    side_names: tuple[str, str]
    """(reference, candidate), the order of every dtype column below."""
    rows: Any
    """The `Result.table()` rows of the entry (a DataFrame, label column first)."""
    why: tuple[str, ...]
    """Why each row differs, from the Result's `why` column ("" where it has none)."""
    param_dtypes: Any
    """The module's parameters and floating buffers (recursive), one row each: tensor, kind,
    then per side its dtype and what set it (the rule `glob: dtype`, "keep_fp32_modules
    'norm2'", "param_dtype", "cast_buffers", "built fp32 (an engine load keeps it)" or
    "not cast")."""
    ulp_figure: Any
    """`lab.views.plots.plot_ulp_histogram` of the entry, as a plotly go.Figure."""

    def html(self) -> str:
        """The detail as the panel shows it above the ULP histogram."""
        a, b = self.side_names
        # One column per paired output, one line per field: the fields read top to bottom.
        rows = (
            self.rows.drop(columns=["why"], errors="ignore")
            .rename(columns={"dtype_a": f"dtype {a} (ref)", "dtype_b": f"dtype {b} (cand)"})
            .set_index("label")
            .T.map(_cell)
        )
        whys = [w for w in dict.fromkeys(self.why) if w]
        why = (
            "".join(f"<div class='lab-why'><b>why:</b> {html.escape(w)}</div>" for w in whys)
            if whys
            else "<div class='lab-why'><i>no why recorded for this row</i></div>"
        )
        params = _param_dtypes_html(self.param_dtypes, self.side_names)
        return (
            f"<b>selected: {html.escape(self.label)}</b>{why}"
            + rows.to_html(classes="lab-rows")
            + f"<b>parameter and buffer dtypes</b> ({html.escape(a)} reference, "
            f"{html.escape(b)} candidate)" + params
        )

    def _repr_html_(self) -> str:
        return self.html()


_PARAM_ROWS = 12
"""Parameter rows shown before the rest are summed up (a block or the root owns hundreds)."""


def _param_dtypes_html(table: Any, side_names: tuple[str, str]) -> str:
    """The parameter table, the tensors a rule, a keep or a cast touched (or that differ) first.

    Past `_PARAM_ROWS` rows, the tensors both sides hold at their plain param_dtype are summed
    up in one line by dtype, so a block or the whole model stays readable.
    """
    if not len(table):
        return "<i>no parameters or floating buffers</i>"
    a, b = side_names
    plain = (
        (table[f"{a} set by"] == "param_dtype")
        & (table[f"{b} set by"] == "param_dtype")
        & (table[f"{a} dtype"] == table[f"{b} dtype"])
    )
    shown = table[~plain]
    rest = table[plain]
    if len(table) <= _PARAM_ROWS:
        shown, rest = table, rest.iloc[:0]
    elif len(shown) < _PARAM_ROWS:
        shown = table[~plain | (plain.cumsum() <= _PARAM_ROWS - len(shown))]
        rest = table[plain & (plain.cumsum() > _PARAM_ROWS - int((~plain).sum()))]
    out = shown.to_html(index=False, classes="lab-param-dtypes")
    if len(rest):
        counts = rest[f"{a} dtype"].value_counts()
        by_dtype = ", ".join(f"{d} x{n}" for d, n in counts.items())
        out += (
            f"<div>and {len(rest)} more at param_dtype on both sides ({html.escape(by_dtype)})"
            "; all rows are in <code>panel.selected.param_dtypes</code>.</div>"
        )
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4e}"
    return str(int(value)) if isinstance(value, float) else str(value)


def _dtype_sources(
    plan: WeightPlan, buffers: Sequence[tuple[str, str]]
) -> dict[str, tuple[str, str, str]]:
    """Every parameter's and floating buffer's dtype on one side, and what set it.

    Args:
        plan: The side's weight plan (`result.flow.plan_a` / `plan_b`: the pair's own).
        buffers: (full name, dtype name as built) of every floating buffer of the model.

    Returns:
        name -> (kind "parameter" or "buffer", dtype name, what set it: the rule
        `glob: dtype`, "keep_fp32_modules 'norm2'", "param_dtype", "cast_buffers",
        "built fp32 (an engine load keeps it)" or "not cast").
    """
    out = {}
    for name, dtype in plan.param_dtypes.items():
        d = dtype_name(dtype)
        kind, detail = plan.param_sources.get(name, ("param_dtype", None))
        if kind == "param_dtype_rules":
            source = f"{detail}: {d}"
        elif kind == "keep_fp32_modules":
            source = f"keep_fp32_modules {detail!r}"
        else:
            source = "param_dtype"
        out[name] = ("parameter", d, source)
    for name, own in buffers:
        kind, detail = plan.buffer_sources.get(name, ("", None))
        if kind == "constructed":
            d = dtype_name(plan.buffer_dtypes[name]) if name in plan.buffer_dtypes else own
            out[name] = ("buffer", d, f"built {detail} (an engine load keeps it)")
        elif name in plan.buffer_dtypes:
            d = dtype_name(plan.buffer_dtypes[name])
            why = "cast_buffers" if kind == "cast_buffers" else f"keep_fp32_modules {detail!r}"
            out[name] = ("buffer", d, why)
        else:
            out[name] = ("buffer", own, "not cast")
    return out


def _module_param_table(
    module: str, sources: tuple[dict[str, tuple[str, str, str]], ...], side_names: tuple[str, str]
) -> Any:
    import pandas as pd

    prefix = "" if module == ROOT else f"{module}."
    names = [n for n in sources[0] if n.startswith(prefix)]
    a, b = side_names
    columns = ["tensor", "kind", f"{a} dtype", f"{a} set by", f"{b} dtype", f"{b} set by"]
    return pd.DataFrame(
        [
            (n[len(prefix) :], sources[0][n][0], *sources[0][n][1:], *sources[1][n][1:])
            for n in names
        ],
        columns=columns,
    )


# ---- the panel ----------------------------------------------------------------------------


def _style() -> dict[str, str]:
    return {"description_width": "initial"}


DEVICES: tuple[str, ...] = ("cpu", "cuda")
"""The panel's device choices."""


def _dropdown(options: Sequence[Any], value: Any, description: str, css: str) -> W.Dropdown:
    labelled = [(str(o), o) for o in options]
    w = W.Dropdown(
        options=labelled,
        value=value,
        description=description,
        style=_style(),
        layout=W.Layout(width="auto"),
    )
    w.add_class(css)
    return w


class ControlPanel:
    """The control panel: widgets for both sides and the run, plus the methods they call.

    Keys name every control: "family", "preset", "device", "seed", "sigma", "mode",
    "cfg_scale", "steps", "noise_level", "ratio_drift", "metric", "color_by", "auto_run",
    "prescribe.movable", "prescribe.target", and per side ("rollout.", "trainer.")
    "master_dtype", "forward_dtype", "rollout_precision", "param_dtype",
    "input_dtype_policy.latents|cond|timestep", "autocast", "autocast_dtype",
    "autocast_policy", "param_dtype_rules" (text), "keep_fp32_modules" (text, names
    separated by commas), "cast_buffers", "attention_backend", "engine_ops",
    "op_switches.<switch>". `keys()` lists them.
    """

    @checked_arguments
    def __init__(
        self,
        family: FamilyName = "flux",
        preset: str = "tiny",
        device: DeviceName = "cpu",
        *,
        seed: int = 0,
    ) -> None:
        _load_definitions()
        self.last_result: Result | None = None
        """The last good Result (kept on screen when a later run fails)."""
        self.last_trajectory: Any = None
        """The last ratio-drift Trajectory (when "ratio_drift" was on), else None."""
        self.last_run_s: float | None = None
        """Seconds the last good run took, from the click to the result on screen."""
        self.runs = 0
        """Runs started (the status line numbers them, so each click shows its outcome)."""
        self.message: str = ""
        """The inline message: "" when all is well, else what is wrong and how to fix it."""
        self.rule_matches: dict[str, list[RuleMatch]] = {}
        """Per side: what each rule matched at the last live compile."""
        self.exported: Path | None = None
        self.selected: ModuleDetail | None = None
        """The module shown below the plot (a click or `select`), else None."""
        self.prescriptions: Any = None
        """The last `lab.Prescriptions` Prescribe found, else None."""
        self.timings: dict[str, float] = {}
        """Seconds each stage of the last good run took (sides, pair, drift, show, ...)."""
        self._spec: dict[str, Any] | None = None
        self._figure: Any = None
        self._table: Any = None
        self._status_text = ""
        self._ran_settings: dict[str, Any] | None = None
        self._ran_run = 0
        self._prescribed_for: tuple[Side, Side, str] | None = None
        self._param_dtypes: tuple[dict[str, tuple[str, str, str]], ...] | None = None
        self._inapplicable: dict[str, str] = {}
        self._selecting = False
        self._running = False
        self._models: dict[tuple, Any] = {}
        self._inputs: dict[tuple, Any] = {}
        self._loading = False
        self.controls: dict[str, W.ValueWidget] = {}
        """The settings, by key (see the class docstring)."""
        self._outputs: dict[str, W.DOMWidget] = {}
        self._build_widgets(family, preset, device, seed)
        self._load_family_defaults()
        self._refresh_applicable()
        self.widget = self._layout()

    # ---- public methods -----------------------------------------------------------------

    @property
    def figure(self) -> Any:
        """The divergence plot on screen as a plotly go.Figure, None before the first run.

        The panel sends the figure to the browser as plain JSON (`divergence_spec`); the
        go.Figure is built from it on first use here.
        """
        if self._figure is None and self._spec is not None:
            import plotly.graph_objects as go

            self._figure = go.Figure(self._spec)
        return self._figure

    def keys(self) -> list[str]:
        """Every control key `set` and `get` accept."""
        return list(self.controls)

    @checked_arguments
    def get(self, key: str) -> Any:
        """The current value of one control (see `keys()`).

        Raises:
            ValueError: For an unknown key, listing the known ones.
        """
        return self._control(key).value

    @checked_arguments
    def set(self, key: str, value: Any) -> bool:
        """Change one control as a click would (observers fire: rules compile live).

        A value the control does not offer (an unknown policy value, dtype or backend, an
        engine op that does not apply to this family) is not raised: it becomes `message`
        and the control keeps its value, as in the panel.

        Returns:
            True if the value was taken.

        Raises:
            ValueError: For an unknown key (a programming error, not a setting).
        """
        control = self._control(key)
        if isinstance(value, list):
            value = tuple(value)
        if key in self._inapplicable and value != control.value:
            self._show_message(f"{key}: {self._inapplicable[key]}")
            return False
        options = getattr(control, "options", None)
        if options is not None and not isinstance(control, W.SelectMultiple):
            allowed = [v for _, v in options] if options and isinstance(options[0], tuple) else []
            allowed = allowed or list(options)
            if not any(value == a and type(value) is type(a) for a in allowed):
                self._show_message(
                    f"{key}: unknown value {value!r}. Allowed: "
                    f"{', '.join(repr(a) for a in allowed)}."
                )
                return False
        if isinstance(control, W.SelectMultiple):
            unknown = [v for v in value if v not in control.options]
            if unknown:
                why = "; ".join(self._inapplicable.get(f"{key}.{v}", "") for v in unknown).strip(
                    "; "
                )
                self._show_message(
                    f"{key}: unknown {unknown}. Allowed: "
                    f"{', '.join(map(repr, control.options)) or 'none for this family'}."
                    + (f" {why}" if why else "")
                )
                return False
        control.value = value
        return True

    @checked_arguments
    def apply(self, settings: Mapping[str, Any]) -> None:
        """`set` each key -> value in order; stops at the first value not taken.

        Returns nothing, so a notebook cell ending in `panel.apply(...)` prints nothing; a
        value not taken is in `message` (and in red on the panel), which `run_and_export`
        refuses to run with.

        Raises:
            ValueError: For an unknown key.
        """
        for key, value in dict(settings).items():
            if not self.set(key, value):
                return

    @checked_arguments
    def run_and_export(self, out_dir: str | Path) -> Path:
        """Headless use (papermill): `run`, then `export` to `out_dir`.

        Unlike the Run button this raises, so a headless notebook fails at this cell.

        Raises:
            RuntimeError: The settings were wrong or the pair failed; the text is `message`.
        """
        if self.message or self.run() is None:
            raise RuntimeError(f"control panel: {self.message}")
        report = self.export(out_dir)
        assert report is not None  # run() just set last_result
        return report

    def sides(self) -> tuple[Side, Side]:
        """The rollout (reference) and trainer (candidate) Sides the controls describe.

        Raises:
            ValueError: A setting no Side accepts, or rules that do not compile on the model.
        """
        return self._side("rollout"), self._side("trainer")

    def stale_keys(self) -> list[str]:
        """The settings changed since the result on screen ran ([] when it is current).

        View controls (the plot metric, the colouring, auto-run, what Prescribe searches)
        never make a result stale.
        """
        if self._ran_settings is None:
            return []
        now = self._settings()
        return [k for k, v in now.items() if v != self._ran_settings.get(k)]

    def verdict(self) -> str:
        """The last result in one sentence: they agree bit for bit, or where they part.

        "" before the first run.
        """
        result = self.last_result
        if result is None:
            return ""
        words = bitexact_words(result)
        if words is not None:
            return words
        first = result.first_divergence()
        rel = result.summary().get("model_output_rel_max")
        why = result.why(first) if first is not None else None
        return (
            f"The sides differ: model output rel_max {_fmt(rel)}; first divergence at "
            f"{first.label() if first is not None else '?'}" + (f" ({why})." if why else ".")
        )

    @checked_arguments
    def compile_rules(self, side_name: str) -> list[RuleMatch] | None:
        """Compile one side's rules text on the built model and show what each rule matched.

        A rule that matches nothing is shown with the globs close to it that do match.

        Returns:
            The matches, or None when the rules are wrong (then `message` says why).
        """
        table = self._outputs[f"{side_name}.rules_table"]
        try:
            matches = self._explain(side_name)
        except ValueError as err:
            text = str(err) + self._rule_hint(side_name, str(err))
            table.value = _error_html(text)
            self._show_message(text)
            return None
        self.rule_matches[side_name] = matches
        if matches:
            table.value = (
                "<div style='overflow-x:auto'>"
                + rule_matches_table(matches).to_html(index=False, classes="lab-rules")
                + "</div>"
            )
        else:
            table.value = "<i>no rules: every parameter at param_dtype</i>"
        self._show_message("")
        return matches

    @checked_arguments
    def check_keep(self, side_name: str) -> bool:
        """Check one side's keep_fp32_modules against the built model's module names.

        Returns:
            True when every name is a module-name component; else False, and `message`
            names the ones that are not and the nearest that are.
        """
        error = self._keep_error(side_name)
        self._show_message(error or "")
        return error is None

    def run(self) -> Result | None:
        """What the Run button does: build Sides, pair them on the cached model, show results.

        Returns:
            The new Result, or None when something was wrong (see `message` and the status
            line; the last good result stays in `last_result` and on screen).
        """
        if self._running:  # an auto-run edit made inside a run (a family's defaults loading)
            return None
        self._running = True
        try:
            return self._run()
        finally:
            self._running = False

    def _run(self) -> Result | None:
        bar = self._outputs["progress"]
        bar.value, bar.max, bar.bar_style = 0, _RUN_STAGES, "info"
        self.runs += 1
        start = time.perf_counter()
        timings: dict[str, float] = {}
        settings = self._settings()
        # Warnings are recorded, not printed: the PrecisionWarnings become notes on the panel
        # (each says what to change); the rest (library internals) are nothing a panel user
        # can act on.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrecisionWarning)
            try:
                side_a, side_b = self.sides()
                for side_name in SIDE_NAMES:
                    error = self._keep_error(side_name)
                    if error:
                        raise ValueError(error)
                model, inputs = self._model_and_inputs()
                timings["sides_s"] = time.perf_counter() - start
                bar.value = 1
                with self._threads():
                    result = pair(
                        model, inputs, side_a, side_b, self.get("mode"), meta=self._meta()
                    )
                timings["pair_s"] = time.perf_counter() - start - sum(timings.values())
                bar.value = 2
                with self._threads():
                    traj = self._trajectory(side_a, side_b) if self.get("ratio_drift") else None
                timings["drift_s"] = time.perf_counter() - start - sum(timings.values())
                bar.value = 3
            except Exception as err:  # the panel shows every failure inline, never a traceback
                self._show_failure(err, time.perf_counter() - start)
                return None
        self.last_result, self.last_trajectory = result, traj
        self._param_dtypes = self._table = None
        self._ran_settings, self._ran_run = settings, self.runs
        notes = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
        self._show_message("", notes=notes)
        self._show_result(result, traj, timings)
        bar.value, bar.bar_style = _RUN_STAGES, "success"
        self.last_run_s = time.perf_counter() - start
        timings["total_s"] = self.last_run_s
        self.timings = timings
        self._set_status(
            f"run {self.runs}: ran in {self.last_run_s:.2f} s at {_dt.datetime.now():%H:%M:%S}"
        )
        self._show_stale()
        return result

    @checked_arguments
    def select(self, module: str) -> ModuleDetail:
        """What clicking a point of the divergence plot does: show that module's detail.

        The detail (`selected`, and on the panel below the plot): its rows of the table with
        the `why`, the ULP histogram of its outputs, and the dtype of each of its parameters
        on both sides with the rule that set it.

        Args:
            module: A point's label `module[:output][#call]` (one paired output, what a click
                selects) or a module path (all its outputs and calls together).

        Returns:
            The detail shown.

        Raises:
            ValueError: Before the first successful run, or for a name that is no paired
                output of the last result (naming the nearest ones).
        """
        from lab.views import plots

        result = self.last_result
        if result is None:
            raise ValueError("select: nothing to select yet; press Run (or call run()) first.")
        table = self._labelled()
        chosen = table[(table["label"] == module) | (table["module"] == module)]
        if not len(chosen):
            import difflib

            near = difflib.get_close_matches(module, list(table["label"]), 3, 0.4)
            raise ValueError(
                f"select: {module!r} is no paired output of the last result. Nearest: "
                f"{', '.join(map(repr, near)) or 'none'}. Give a point's label "
                "(module[:output][#call]) or a module path."
            )
        names = (str(result.side_a.get("name")), str(result.side_b.get("name")))
        detail = ModuleDetail(
            label=module,
            side_names=names,
            rows=chosen[[c for c in (*_DETAIL_COLUMNS, "why") if c in chosen.columns]],
            why=tuple(str(w) for w in chosen["why"]) if "why" in chosen else ("",) * len(chosen),
            param_dtypes=_module_param_table(
                chosen["module"].iloc[0], self._param_sources(), names
            ),
            ulp_figure=plots.plot_ulp_histogram(result, [module], backend="plotly"),
        )
        self.selected = detail
        self._outputs["detail"].value = detail.html()
        # The picker follows at once, before the (slower) histogram figure is sent.
        picker = self._outputs["module"]
        if module in picker.options:
            self._selecting = True
            try:
                picker.value = module
            finally:
                self._selecting = False
        _show_plotly(self._outputs["detail_plot"], detail.ulp_figure)
        return detail

    def prescribe(self) -> Any:
        """What the Prescribe button does: the cheapest verified changes to one side.

        Searches changes to the side "prescribe.movable" names ("trainer" by default) that
        bring the pair within "prescribe.target" ("bitexact", or JSON such as
        {"metric": "rel_max", "max": 1e-3}), with `lab.prescribe`: each prescription is
        verified by a paired forward and costed (parameter bytes, forward time). The table
        shows them cheapest first; Apply (`apply_prescription`) takes one.

        Returns:
            The `lab.Prescriptions`, or None when something was wrong (see `message`).
        """
        from lab.causes.prescribe import parse_target
        from lab.causes.prescribe import prescribe as find_prescriptions

        start = time.perf_counter()
        movable = "b" if self.get("prescribe.movable") == "trainer" else "a"
        out = self._outputs["prescriptions"]
        try:
            target = parse_target(self.get("prescribe.target"))
            # Warnings are library internals of the searched forwards (as in `run`).
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                side_a, side_b = self.sides()
                model, inputs = self._model_and_inputs()
                with self._threads():
                    found = find_prescriptions(
                        model, inputs, side_a, side_b, movable=movable, target=target, repeats=3
                    )
        except Exception as err:  # shown inline, as a run's failure is
            self._show_message(f"Prescribe: {type(err).__name__}: {err}")
            return None
        self.prescriptions = found
        self._prescribed_for = (side_a, side_b, movable)
        out.value = _prescriptions_html(found, self.get("prescribe.movable"))
        picker = self._outputs["prescription"]
        picker.options = [
            (f"{i}. {'; '.join(p.labels())}", i) for i, p in enumerate(found.prescriptions, 1)
        ]
        picker.value = 1 if found.prescriptions else None
        self._show_message("")
        seconds = time.perf_counter() - start
        self._set_status(
            f"prescribed in {seconds:.1f} s: {len(found)} prescription(s) for side "
            f"{self.get('prescribe.movable')!r}"
        )
        return found

    @checked_arguments
    def apply_prescription(self, rank: int | None = None) -> Result | None:
        """What the Apply button does: set the moved side to a prescription's side and run.

        Args:
            rank: 1 for the cheapest prescription; None takes the one the picker shows.

        Returns:
            The Result of the run (the sides as prescribed), or None when there is nothing to
            apply, the sides changed since Prescribe, or the run failed (see `message`).
        """
        found = self.prescriptions
        if found is None or not len(found):
            self._show_message(
                "Apply: no prescription to apply; press Prescribe first."
                if found is None
                else f"Apply: Prescribe found none. {found.describe()}"
            )
            return None
        rank = rank if rank is not None else self._outputs["prescription"].value or 1
        if not 1 <= rank <= len(found):
            self._show_message(f"Apply: rank {rank!r} is not 1..{len(found)}.")
            return None
        side_a, side_b, movable = self._prescribed_for or (None, None, "b")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrecisionWarning)
            try:
                now_a, now_b = self.sides()
            except ValueError as err:
                self._show_message(f"Apply: {err}")
                return None
        # Each prescription is a whole side: another one can replace an applied one, as long
        # as the side that stays put is the one Prescribe held fixed.
        if movable == "b":
            fixed_then, fixed_now, moving_then, moving_now = side_a, now_a, side_b, now_b
        else:
            fixed_then, fixed_now, moving_then, moving_now = side_b, now_b, side_a, now_a
        allowed = [moving_then, *(p.side for p in found.prescriptions)]
        if fixed_now != fixed_then or moving_now not in allowed:
            self._show_message(
                "Apply: the sides changed since Prescribe, so its prescriptions are for other "
                "settings; press Prescribe again."
            )
            return None
        chosen = found.prescriptions[rank - 1]
        side_name = "trainer" if movable == "b" else "rollout"
        self._loading = True
        try:
            self._load_side(side_name, chosen.side)
        finally:
            self._loading = False
        self._refresh_applicable()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrecisionWarning)
            loaded = self._side(side_name)
        if loaded != chosen.side:
            missing = [
                f.name
                for f in dataclasses.fields(Side)
                if getattr(loaded, f.name) != getattr(chosen.side, f.name)
            ]
            self._show_message(
                f"Apply: the panel has no control for {', '.join(missing)}, which prescription "
                f"{rank} changes; not run."
            )
            return None
        self._outputs["prescriptions"].value += (
            f"<div class='lab-applied'>applied prescription {rank} to side {side_name!r}: "
            f"{html.escape('; '.join(chosen.labels()))}</div>"
        )
        return self.run()

    @checked_arguments
    def export(self, out_dir: str | Path | None = None) -> Path | None:
        """What the Export button does: results.json + report.html (+ PNGs) of the last result.

        Args:
            out_dir: Folder to write; None: a fresh one, runs/control_panel/<family>-<preset>-
                <time>/ under the working directory or $LAB_HOME (`lab.runs.run_folder`).

        Returns:
            The report path, or None when there is nothing to export yet.
        """
        if self.last_result is None:
            self._show_message("Export: nothing to export yet; press Run first.")
            return None
        from lab.views.home import run_folder
        from lab.views.report import write_html

        # Two exports in one second get two folders: neither writes over the other.
        labels = {"family": self.get("family"), "preset": self.get("preset")}
        folder = Path(out_dir) if out_dir is not None else run_folder("control_panel", **labels)
        self.last_result.to_json(folder / "results.json")
        if self.last_trajectory is not None:
            self.last_trajectory.to_json(folder / "ratio_drift.json")
        self.exported = write_html(
            self.last_result,
            folder / "report.html",
            metric=self.get("metric"),
            trajectories=self.last_trajectory if self.last_trajectory is not None else (),
        )
        size_mb = self.exported.stat().st_size / 1e6
        self._set_status(f"exported {self.exported} ({size_mb:.1f} MB)")
        return self.exported

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    # ---- building and reading the sides -------------------------------------------------

    def _control(self, key: str) -> W.ValueWidget:
        if key not in self.controls:
            import difflib

            near = difflib.get_close_matches(key, self.controls, 3, 0.5)
            hint = f" Did you mean {', '.join(map(repr, near))}?" if near else ""
            raise ValueError(
                f"ControlPanel: unknown control {key!r}.{hint} Known: {', '.join(self.controls)}."
            )
        return self.controls[key]

    def _settings(self) -> dict[str, Any]:
        """Every control that makes a pair what it is, key -> value (not the view's)."""
        return {k: w.value for k, w in self.controls.items() if k not in _VIEW_KEYS}

    def _side(self, side_name: str) -> Side:
        fam = get_family(self.get("family"))
        maker = Side.rollout if side_name == "rollout" else Side.trainer
        g = lambda key: self.get(f"{side_name}.{key}")  # noqa: E731
        policy = {
            key: None if (v := g(f"input_dtype_policy.{key}")) == "passthrough" else v
            for key in POLICY_KEYS
        }
        switches = {
            name: g(f"op_switches.{name}")
            for name, switch in SWITCHES.items()
            if g(f"op_switches.{name}") != switch.values[0]
        }
        return maker(
            fam,
            device=self.get("device"),
            master_dtype=g("master_dtype"),
            forward_dtype=g("forward_dtype"),
            rollout_precision=g("rollout_precision"),
            param_dtype=None if g("param_dtype") == SAME_AS_FORWARD else g("param_dtype"),
            input_dtype_policy=policy,
            autocast=g("autocast"),
            autocast_dtype=None if g("autocast_dtype") == SAME_AS_FORWARD else g("autocast_dtype"),
            autocast_policy=g("autocast_policy"),
            param_dtype_rules=parse_rules_text(
                g("param_dtype_rules"), where=f"{side_name}.param_dtype_rules"
            ),
            keep_fp32_modules=parse_keep_text(g("keep_fp32_modules")),
            cast_buffers=g("cast_buffers"),
            attention_backend=g("attention_backend"),
            engine_ops=tuple(g("engine_ops")),
            op_switches=switches,
        )

    def _load_side(self, side_name: str, side: Side) -> None:
        """Set one side's controls to `side` (observers are the caller's to hold off)."""
        c, s = self.controls, side_name
        for attr in ("master_dtype", "forward_dtype", "rollout_precision"):
            c[f"{s}.{attr}"].value = getattr(side, attr)
        c[f"{s}.param_dtype"].value = side.param_dtype or SAME_AS_FORWARD
        for key in POLICY_KEYS:
            value = side.input_dtype_policy.get(key)
            c[f"{s}.input_dtype_policy.{key}"].value = "passthrough" if value is None else value
        c[f"{s}.autocast"].value = side.autocast
        c[f"{s}.autocast_dtype"].value = side.autocast_dtype or SAME_AS_FORWARD
        c[f"{s}.autocast_policy"].value = side.autocast_policy or "cuda"
        c[f"{s}.param_dtype_rules"].value = format_rules_text(side.param_dtype_rules)
        c[f"{s}.keep_fp32_modules"].value = ", ".join(side.keep_fp32_modules)
        c[f"{s}.cast_buffers"].value = side.cast_buffers
        c[f"{s}.attention_backend"].value = side.attention_backend
        ops = c[f"{s}.engine_ops"]
        # The options follow the family; a side's own groups are always among them.
        ops.options = list(dict.fromkeys([*ops.options, *side.engine_ops]))
        ops.value = tuple(g for g in ops.options if g in side.engine_ops)
        for name, switch in SWITCHES.items():
            c[f"{s}.op_switches.{name}"].value = side.op_switches.get(name, switch.values[0])
        self._outputs[f"{s}.rules_table"].value = ""

    def _explain(self, side_name: str) -> list[RuleMatch]:
        rules = parse_rules_text(
            self.get(f"{side_name}.param_dtype_rules"), where=f"{side_name}.param_dtype_rules"
        )
        if not rules:
            return []
        model = self._model()
        matches = _explain_rules(model, rules)
        side = self._side(side_name)
        if side.fsdp_wrap_classes:
            # FSDP2's per-wrap maps refuse some rule sets explain_rules accepts: check them too.
            compile_param_dtype_maps(
                model, block_wraps(model, side.fsdp_wrap_classes), rules, side.forward_dtype
            )
        return matches

    def _rule_hint(self, side_name: str, error: str) -> str:
        """The globs close to each rule that matches no parameter (a line to add), else ""."""
        import fnmatch

        try:
            rules = parse_rules_text(self.get(f"{side_name}.param_dtype_rules"))
        except ValueError:
            return ""
        if "did not match" not in error:
            return ""
        names = [n for n, _ in self._model().named_parameters()]
        hints = []
        for pattern in rules:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                near = nearest_rule_names(pattern, names)
                if near:
                    hints.append(f"{pattern!r}: did you mean {', '.join(map(repr, near))}?")
        return ("\n" + " ".join(hints)) if hints else ""

    def _keep_error(self, side_name: str) -> str | None:
        """What is wrong with one side's keep_fp32_modules on the built model, or None."""
        import difflib

        names = parse_keep_text(self.get(f"{side_name}.keep_fp32_modules"))
        if not names:
            return None
        parts = self._module_parts()
        missing = [n for n in names if n not in parts]
        if not missing:
            return None
        near = {m: difflib.get_close_matches(m, sorted(parts), n=3, cutoff=0.5) for m in missing}
        hints = "; ".join(
            f"{m!r}: nearest {', '.join(map(repr, n))}" if n else f"{m!r}: none close"
            for m, n in near.items()
        )
        return (
            f"{side_name}.keep_fp32_modules: {missing} name no module of "
            f"{type(self._model()).__name__} ({hints}). Entries are module-name components "
            "such as 'norm2', separated by commas."
        )

    def _module_parts(self) -> frozenset[str]:
        model = self._model()
        return frozenset(part for n, _ in model.named_modules() for part in n.split(".") if n)

    def _model_key(self) -> tuple:
        fam = get_family(self.get("family"))
        return (
            self.get("family"),
            self.get("preset"),
            self.get("device"),
            self.get("seed"),
            fam.expert_for_sigma(self.get("sigma")),
        )

    def _model(self) -> Any:
        key = self._model_key()
        if key not in self._models:
            name, preset, device, seed, expert = key
            # One model at a time: a full preset must not pile up in memory.
            self._models.clear()
            self._inputs.clear()
            self._models[key] = get_family(name).build(preset, seed, device=device, expert=expert)
        return self._models[key]

    def _model_and_inputs(self) -> tuple[Any, Any]:
        fam = get_family(self.get("family"))
        cfg_scale = float(self.get("cfg_scale"))
        if cfg_scale < 1.0:
            raise ValueError(f"cfg_scale must be >= 1 (1 = no guidance), got {cfg_scale!r}.")
        if cfg_scale > 1.0 and fam.cfg_layout == "none":
            raise ValueError(
                f"cfg_scale={cfg_scale!r}, but {fam.title} is guidance-distilled (cfg_layout "
                "'none'): there is no negative branch. Use cfg_scale=1.0."
            )
        model = self._model()
        key = (*self._model_key(), self.get("sigma"), cfg_scale > 1.0)
        if key not in self._inputs:
            self._inputs[key] = fam.make_inputs(
                self.get("preset"),
                self.get("seed"),
                1,
                cfg_scale > 1.0,
                sigma=float(self.get("sigma")),
                device=self.get("device"),
            )
        return model, self._inputs[key]

    def _refresh_applicable(self) -> None:
        """Offer the engine patch groups and op switches that apply to this family only.

        A patch group applies when it is one of the family's own engine groups or patches its
        model or block class (the "wan" group's RMSNorm alone does not make it Flux's); a
        module switch when the model has a class it patches; an input switch when it changes
        this family's inputs. A control a side has set away from stock stays shown.
        """
        fam = get_family(self.get("family"))
        classes, input_switches, refusals = self._op_probe()
        own = {fam.model_class, *fam.block_classes}
        groups = [
            g
            for g, group in PATCH_GROUPS.items()
            if g in fam.engine_ops or own & set(group.forwards)
        ]
        self._inapplicable = {}
        for s in SIDE_NAMES:
            ops = self.controls[f"{s}.engine_ops"]
            held = tuple(ops.value)
            options = [g for g in PATCH_GROUPS if g in groups or g in held]
            was, self._loading = self._loading, True
            try:
                ops.options = options
                ops.value = tuple(g for g in options if g in held)
            finally:
                self._loading = was
            ops.layout.display = None if options else "none"
            for g in PATCH_GROUPS:
                if g not in options:
                    patched = ", ".join(sorted(PATCH_GROUPS[g].forwards))
                    self._inapplicable[f"{s}.engine_ops.{g}"] = (
                        f"patch group {g!r} patches {patched}: not a class of {fam.title}'s "
                        f"model ({fam.model_class}) or its blocks, nor one of its engine groups."
                    )
            for name, switch in SWITCHES.items():
                key = f"{s}.op_switches.{name}"
                control = self.controls[key]
                if switch.transform_inputs is not None:
                    applies = name in input_switches
                    reason = refusals.get(name) or (
                        f"op switch {name!r} changes none of {fam.title}'s inputs."
                    )
                else:
                    patched = {c for forwards in switch.forwards.values() for c in forwards}
                    applies = bool(classes & patched)
                    reason = (
                        f"op switch {name!r} patches {', '.join(sorted(patched))}, which "
                        f"{fam.model_class} has none of."
                    )
                shown = applies or control.value != switch.values[0]
                control.layout.display = None if shown else "none"
                if not applies:
                    self._inapplicable[key] = reason
            self._outputs[f"{s}.no_ops"].value = (
                ""
                if options
                else f"<i>no engine patch group applies to {html.escape(fam.model_class)}</i>"
            )

    def _op_probe(self) -> tuple[frozenset[str], frozenset[str], dict[str, str]]:
        """This family's module class names, input switches that change, and those that refuse.

        The refusals map a switch's name to its message.

        From the panel's model on the tiny preset (built once, and the run reuses it); on a
        larger preset from the family's tiny build, which has the same classes and inputs,
        so picking a family never builds a full-size model.
        """
        fam = get_family(self.get("family"))
        if self.get("preset") == "tiny" or self._model_key() in self._models:
            try:
                model, inputs = self._model_and_inputs()
            except ValueError:  # a cfg_scale the family refuses: the run will say so
                return _tiny_probe(fam.name)
            return _probe(model, inputs)
        return _tiny_probe(fam.name)

    def _param_sources(self) -> tuple[dict[str, tuple[str, str, str]], ...]:
        """Both sides' parameter and buffer dtypes with what set them, for the last result."""
        if self._param_dtypes is None:
            result = self.last_result
            assert result is not None  # select() checked
            flow = result.flow
            if flow is not None:
                buffers = [
                    (name, dtype)
                    for tensors in flow.modules.values()
                    for name, dtype, _ in tensors.buffers
                ]
                plans = (flow.plan_a, flow.plan_b)
            else:  # a Result without its dtype flow: plan the sides again on the model
                model = self._model()
                buffers = [
                    (n, dtype_name(b.dtype))
                    for n, b in model.named_buffers()
                    if b is not None and b.is_floating_point()
                ]
                plans = tuple(
                    plan_weights(model, Side.from_dict(d)) for d in (result.side_a, result.side_b)
                )
            self._param_dtypes = tuple(_dtype_sources(plan, buffers) for plan in plans)
        return self._param_dtypes

    def _labelled(self) -> Any:
        """The last result's table with a `label` column, computed once a run."""
        if self._table is None:
            assert self.last_result is not None
            table = self.last_result.table()
            table.insert(0, "label", [r.label() for r in self.last_result.rows])
            self._table = table
        return self._table

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """One intra-op thread for the forwards of the tiny preset on the CPU, then back.

        A tiny model's matmuls are a few thousand elements: splitting one over threads only
        adds their hand-over, which on a busy machine (other kernels on the cores) made a
        flux pair 20x slower (2.1 s instead of 0.1 s). The per-element sums do not depend on
        the thread count (tests/test_widgets.py checks the panel's rows against `lab.pair`'s
        bit for bit). Larger presets keep every thread.
        """
        import torch

        if self.get("preset") != "tiny" or self.get("device") != "cpu":
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _meta(self) -> dict[str, Any]:
        return dict(
            family=self.get("family"),
            preset=self.get("preset"),
            seed=self.get("seed"),
            sigma=float(self.get("sigma")),
            cfg=float(self.get("cfg_scale")) > 1.0,
            cfg_scale=float(self.get("cfg_scale")),
            source="lab.views.widgets.ControlPanel",
        )

    def _trajectory(self, side_a: Side, side_b: Side) -> Any:
        from lab.rl.trajectory import trajectory

        return trajectory(
            self.get("family"),
            self.get("preset"),
            steps=int(self.get("steps")),
            noise_level=float(self.get("noise_level")),
            cfg_scale=float(self.get("cfg_scale")),
            samples=1,
            seed=self.get("seed"),
            device=self.get("device"),
            rollout=side_a,
            trainer=side_b,
            keep_tensors=False,
            progress=False,
        )

    # ---- widgets --------------------------------------------------------------------------

    def _add(self, key: str, widget: W.ValueWidget, on_change: Callable | None = None) -> None:
        self.controls[key] = widget
        if on_change is not None:
            widget.observe(lambda change: None if self._loading else on_change(), names="value")
        # After the control's own observer (a family loads its sides, rules compile).
        widget.observe(lambda change: None if self._loading else self._on_edit(key), "value")

    def _build_widgets(self, family: str, preset: str, device: str, seed: int) -> None:
        get_family(family)  # an unknown family raises here, with the known names
        # The dropdowns would refuse these with a bare TraitError ("value not found").
        for what, value, choices in (("preset", preset, PRESETS), ("device", device, DEVICES)):
            if value not in choices:
                raise ValueError(
                    f"control_panel: unknown {what} {value!r}. Choices: "
                    f"{', '.join(repr(c) for c in choices)}."
                )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"control_panel: seed must be an int, got {seed!r}.")
        self._add(
            "family", _dropdown(FAMILY_NAMES, family, "family", "lab-family"), self._on_family
        )
        self._add("preset", _dropdown(PRESETS, preset, "preset", "lab-preset"), self._on_model)
        self._add("device", _dropdown(DEVICES, device, "device", "lab-device"), self._on_model)
        self._add(
            "seed",
            W.IntText(
                value=seed, description="seed", style=_style(), layout=W.Layout(width="120px")
            ),
            self._on_model,
        )
        self._add("mode", _dropdown(MODES, "propagated", "mode", "lab-mode"))
        self._add(
            "sigma",
            W.BoundedFloatText(
                value=0.75,
                min=0.0,
                max=1.0,
                step=0.05,
                description="sigma",
                style=_style(),
                layout=W.Layout(width="140px"),
            ),
        )
        self._add(
            "cfg_scale",
            W.BoundedFloatText(
                value=1.0,
                min=1.0,
                max=30.0,
                step=0.5,
                description="CFG scale",
                style=_style(),
                layout=W.Layout(width="150px"),
            ),
        )
        self._add(
            "steps",
            W.BoundedIntText(
                value=4,
                min=2,
                max=1000,
                description="steps",
                style=_style(),
                layout=W.Layout(width="130px"),
            ),
        )
        self._add(
            "noise_level",
            W.BoundedFloatText(
                value=0.7,
                min=0.01,
                max=5.0,
                step=0.1,
                description="noise level (eta)",
                style=_style(),
                layout=W.Layout(width="190px"),
            ),
        )
        self._add(
            "ratio_drift",
            W.Checkbox(
                value=False, description="ratio drift over steps", style=_style(), indent=False
            ),
        )
        self._add(
            "metric", _dropdown(METRICS, "rel_max", "plot metric", "lab-metric"), self._replot
        )
        self._add(
            "color_by", _dropdown(COLOR_BY, "kind", "colour by", "lab-color_by"), self._replot
        )
        auto = W.Checkbox(value=False, description="run on every change", indent=False)
        auto.add_class("lab-auto_run")
        self._add("auto_run", auto)
        dtypes = tuple(DTYPES)
        for s in SIDE_NAMES:
            for attr in ("master_dtype", "forward_dtype", "rollout_precision"):
                self._add(f"{s}.{attr}", _dropdown(dtypes, "fp32", attr, f"lab-{s}-{attr}"))
            self._add(
                f"{s}.param_dtype",
                _dropdown(
                    (SAME_AS_FORWARD, *dtypes),
                    SAME_AS_FORWARD,
                    "param_dtype",
                    f"lab-{s}-param_dtype",
                ),
            )
            for key in POLICY_KEYS:
                self._add(
                    f"{s}.input_dtype_policy.{key}",
                    _dropdown(POLICY_CHOICES, "passthrough", key, f"lab-{s}-{key}"),
                )
            self._add(
                f"{s}.autocast", W.Checkbox(value=False, description="autocast", indent=False)
            )
            self.controls[f"{s}.autocast"].add_class(f"lab-{s}-autocast")
            self._add(
                f"{s}.autocast_dtype",
                _dropdown(
                    (SAME_AS_FORWARD, *dtypes), SAME_AS_FORWARD, "dtype", f"lab-{s}-autocast_dtype"
                ),
            )
            self._add(
                f"{s}.autocast_policy",
                _dropdown(AUTOCAST_POLICIES, "cuda", "op lists", f"lab-{s}-autocast_policy"),
            )
            rules = W.Textarea(
                value="",
                placeholder="*norm*: fp32",
                continuous_update=False,
                layout=W.Layout(width="98%", height="70px"),
            )
            rules.add_class(f"lab-{s}-rules")
            self._add(f"{s}.param_dtype_rules", rules, lambda s=s: self.compile_rules(s))
            keep = W.Text(
                value="",
                placeholder="none (e.g. norm1, norm2)",
                description="keep_fp32_modules",
                continuous_update=False,
                style=_style(),
                layout=W.Layout(width="98%"),
            )
            keep.add_class(f"lab-{s}-keep_fp32_modules")
            self._add(f"{s}.keep_fp32_modules", keep, lambda s=s: self.check_keep(s))
            cast = W.Checkbox(value=False, description="cast_buffers", indent=False)
            cast.add_class(f"lab-{s}-cast_buffers")
            cast.tooltip = "Cast persistent floating buffers like parameters (an engine load)"
            self._add(f"{s}.cast_buffers", cast)
            self._add(
                f"{s}.attention_backend",
                _dropdown(ATTENTION_BACKENDS, "default", "attention", f"lab-{s}-attention_backend"),
            )
            ops = W.SelectMultiple(
                options=list(PATCH_GROUPS),
                value=(),
                description="engine ops",
                style=_style(),
                layout=W.Layout(width="auto", height="60px"),
            )
            ops.add_class(f"lab-{s}-engine_ops")
            self._add(f"{s}.engine_ops", ops)
            for name, switch in SWITCHES.items():
                self._add(
                    f"{s}.op_switches.{name}",
                    _dropdown(switch.values, switch.values[0], name, f"lab-{s}-{name}"),
                )
                self.controls[f"{s}.op_switches.{name}"].tooltip = switch.description
            self._outputs[f"{s}.rules_table"] = W.HTML()
            self._outputs[f"{s}.rules_table"].add_class(f"lab-{s}-rules-table")
            self._outputs[f"{s}.no_ops"] = W.HTML()
        self._add(
            "prescribe.movable",
            _dropdown(("trainer", "rollout"), "trainer", "move side", "lab-prescribe-movable"),
        )
        target = W.Text(
            value="bitexact",
            description="target",
            continuous_update=False,
            style=_style(),
            layout=W.Layout(width="320px"),
        )
        target.add_class("lab-prescribe-target")
        self._add("prescribe.target", target)
        run = W.Button(description="Run", button_style="primary", icon="play")
        run.add_class("lab-run")
        run.on_click(lambda _: self.run())
        export = W.Button(description="Export report", icon="download")
        export.add_class("lab-export")
        export.on_click(lambda _: self.export())
        prescribe = W.Button(
            description="Prescribe", icon="medkit", layout=W.Layout(min_width="120px")
        )
        prescribe.add_class("lab-prescribe")
        prescribe.on_click(lambda _: self.prescribe())
        apply = W.Button(description="Apply", icon="check")
        apply.add_class("lab-apply")
        apply.on_click(lambda _: self.apply_prescription())
        self.buttons = (run, export)
        self.prescribe_buttons = (prescribe, apply)
        o = self._outputs
        o["progress"] = W.IntProgress(
            value=0, min=0, max=_RUN_STAGES, layout=W.Layout(width="200px")
        )
        o["status"] = W.HTML()
        o["message"] = W.HTML()
        o["stale"] = W.HTML()
        o["summary"] = W.HTML("<i>press Run</i>")
        o["plot"] = W.VBox(layout=W.Layout(width="100%"))
        # One plot widget for the panel's life, updated in place (plotly.js reaches the
        # browser once); without anywidget an Output shows the figure: hover, no clicks.
        self.plot_widget = _plot_widget(self._on_click, "lab-divergence")
        o["plot"].children = (self.plot_widget,)
        o["module"] = W.Dropdown(
            options=[], description="module", style=_style(), layout=W.Layout(width="60%")
        )
        o["module"].observe(self._on_pick, names="value")
        o["detail"] = W.HTML("<i>click a point of the plot (or pick a module) for its detail</i>")
        o["detail_plot"] = W.Output(layout=W.Layout(width="100%"))
        o["drift_plot"] = W.Image(format="png", layout=W.Layout(max_width="100%", display="none"))
        o["top_modules"] = W.HTML()
        o["prescription"] = W.Dropdown(
            options=[], description="prescription", style=_style(), layout=W.Layout(width="50%")
        )
        o["prescriptions"] = W.HTML()
        for name in (
            "message",
            "stale",
            "summary",
            "plot",
            "module",
            "detail",
            "detail_plot",
            "drift_plot",
            "top_modules",
            "status",
            "prescription",
            "prescriptions",
        ):
            o[name].add_class(f"lab-{name.replace('_', '-')}")

    def _side_box(self, s: str) -> W.VBox:
        c = self.controls
        title = "rollout (reference)" if s == "rollout" else "trainer (candidate)"
        switches = [c[f"{s}.op_switches.{n}"] for n in SWITCHES]
        return W.VBox(
            [
                W.HTML(f"<b>{title}</b>"),
                W.HBox([c[f"{s}.master_dtype"], c[f"{s}.forward_dtype"]]),
                W.HBox([c[f"{s}.rollout_precision"], c[f"{s}.param_dtype"]]),
                W.HTML("input_dtype_policy (per input role)"),
                W.HBox([c[f"{s}.input_dtype_policy.{k}"] for k in POLICY_KEYS]),
                W.HBox([c[f"{s}.autocast"], c[f"{s}.autocast_dtype"], c[f"{s}.autocast_policy"]]),
                W.HTML("param_dtype_rules (one <code>glob: dtype</code> per line, later wins)"),
                c[f"{s}.param_dtype_rules"],
                self._outputs[f"{s}.rules_table"],
                c[f"{s}.keep_fp32_modules"],
                c[f"{s}.cast_buffers"],
                c[f"{s}.attention_backend"],
                c[f"{s}.engine_ops"],
                self._outputs[f"{s}.no_ops"],
                W.VBox(switches),
            ],
            layout=W.Layout(width="50%", border="1px solid #ddd", padding="4px"),
        )

    def _layout(self) -> W.VBox:
        c, o = self.controls, self._outputs
        self.results = W.VBox(
            [
                o["summary"],
                o["plot"],
                o["module"],
                o["detail"],
                o["detail_plot"],
                o["drift_plot"],
                o["top_modules"],
            ]
        )
        self.results.add_class("lab-results")
        panel = W.VBox(
            [
                W.HTML(_STYLE + "<h3>Precision Lab control panel</h3>"),
                W.HBox([c["family"], c["preset"], c["device"], c["seed"], c["mode"], c["sigma"]]),
                W.HBox(
                    [
                        c["cfg_scale"],
                        c["ratio_drift"],
                        c["steps"],
                        c["noise_level"],
                        c["metric"],
                        c["color_by"],
                    ]
                ),
                W.HBox([self._side_box(s) for s in SIDE_NAMES]),
                W.HBox([*self.buttons, c["auto_run"], o["progress"], o["status"]]),
                o["message"],
                o["stale"],
                W.HBox(
                    [
                        *self.prescribe_buttons,
                        c["prescribe.movable"],
                        c["prescribe.target"],
                        o["prescription"],
                    ]
                ),
                o["prescriptions"],
                self.results,
            ]
        )
        panel.add_class("lab-panel")
        return panel

    # ---- observers ----------------------------------------------------------------------

    def _load_family_defaults(self) -> None:
        """Set both sides' controls to the family's rollout / trainer presets."""
        fam = get_family(self.get("family"))
        self._loading = True
        try:
            for s, side in zip(SIDE_NAMES, _default_sides(fam), strict=True):
                self._load_side(s, side)
        finally:
            self._loading = False
        if get_family(self.get("family")).cfg_layout == "none":
            self._loading = True
            try:
                self.controls["cfg_scale"].value = 1.0
            finally:
                self._loading = False

    def _on_family(self) -> None:
        self._load_family_defaults()
        self._on_model()

    def _on_model(self) -> None:
        self._refresh_applicable()
        for s in SIDE_NAMES:
            if self.get(f"{s}.param_dtype_rules").strip():
                self.compile_rules(s)

    def _on_edit(self, key: str) -> None:
        """Any control changed: the results on screen are stale (or run again at once)."""
        if key in _VIEW_KEYS and key != "auto_run":
            return
        if self.get("auto_run") and not self._running and (key != "auto_run" or self.stale_keys()):
            self.run()
        else:
            self._show_stale()

    def _replot(self) -> None:
        if self.last_result is not None:
            self._show_result(self.last_result, self.last_trajectory)

    # ---- output -------------------------------------------------------------------------

    def _show_stale(self) -> None:
        """Mark the results stale (note, dimmed, status line) when settings changed since."""
        keys = self.stale_keys() if self.last_result is not None else []
        note = self._outputs["stale"]
        if keys:
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            note.value = (
                f"<div class='lab-stale-note'><b>Stale:</b> the results below are run "
                f"{self._ran_run}'s; changed since: {html.escape(shown)}. Press Run.</div>"
            )
            self.results.add_class("lab-stale")
            self._set_status(self._status_text, stale=True)
        else:
            note.value = ""
            self.results.remove_class("lab-stale")
            self._set_status(self._status_text)

    def _show_message(self, text: str, *, notes: Sequence[str] = ()) -> None:
        self.message = text
        parts = []
        if text:
            kept = (
                f"\nStill showing the last good result ({self.last_result.summary()['family']})."
                if self.last_result is not None
                else ""
            )
            parts.append(_error_html(text + kept))
        parts += [f"<div style='color:#8a6d00'>note: {html.escape(n)}</div>" for n in notes]
        self._outputs["message"].value = "".join(parts)

    def _set_status(self, text: str, *, failed: bool = False, stale: bool = False) -> None:
        self._status_text = text
        colour = "#b00020" if failed else "inherit"
        shown = text + (" (stale: settings changed since; press Run)" if stale and text else "")
        self._outputs[
            "status"
        ].value = (
            f"<span class='lab-status-text' style='color:{colour}'>{html.escape(shown)}</span>"
        )

    def _show_failure(self, err: Exception, seconds: float) -> None:
        """Message, partial pairs and status line for a run that raised `err`."""
        self._outputs["progress"].bar_style = "danger"
        stamp = f"{_dt.datetime.now():%H:%M:%S}"
        if isinstance(err, PairError) and err.side is not None and err.__cause__ is not None:
            cause = err.__cause__
            where = f" in module {err.module!r} ({err.module_class})" if err.module else ""
            text = f"Run failed on side {err.side!r}{where}: {type(cause).__name__}: {cause}"
            if err.fix:
                text += f"\n{err.fix}"
            status = f"run {self.runs}: failed at {stamp} on side {err.side!r}" + (
                f" in {err.module}" if err.module else ""
            )
        else:
            # Python users are pointed at err.result; the panel shows what it holds below.
            text = _ERR_RESULT_HINT.sub("", f"{type(err).__name__}: {err}")
            status = f"run {self.runs}: failed at {stamp}: {type(err).__name__}"
        self._show_message(text)
        partial = err.result if isinstance(err, PairError) else None
        if partial is not None:
            self._outputs["message"].value += _partial_html(partial, err)
        self._set_status(f"{status} (after {seconds:.2f} s); see the message below", failed=True)

    def _on_pick(self, change: dict[str, Any]) -> None:
        if not self._selecting and change["new"]:
            self._select_inline(change["new"])

    def _on_click(self, curve: int, point: int) -> None:
        """A click on point `point` of trace `curve` of the divergence plot (from the browser)."""
        if self._spec is not None and self.last_result is not None:
            trace = self._spec["data"][curve]
            self._select_inline(_point_label(trace, point, self.last_result))

    def _select_inline(self, label: str) -> None:
        try:
            self.select(label)
        except Exception as err:  # a callback's exception would only reach the browser console
            self._show_message(f"select: {type(err).__name__}: {err}")

    def _show_result(
        self, result: Result, traj: Any, timings: dict[str, float] | None = None
    ) -> None:
        """Summary, plot, module detail and top table of `result`, updated in place.

        The table is computed once and the plot is sent as plain JSON (no go.Figure): on the
        tiny preset these took longer than the pair itself.
        """
        timings = timings if timings is not None else {}
        start = time.perf_counter()
        metric = self.get("metric")
        table = self._labelled()
        self._outputs["summary"].value = _summary_html(result, traj, self.verdict())
        self._spec = divergence_spec(result, metric, color_by=self.get("color_by"), table=table)
        self._figure = None
        _show_plotly(self.plot_widget, self._spec)
        timings["plot_s"] = time.perf_counter() - start
        drift = self._outputs["drift_plot"]
        if traj is not None:
            from lab.views import plots

            drift.value = _png(plots.plot_ratio_drift(traj, backend="matplotlib"))
            drift.layout.display = None
        else:
            drift.layout.display = "none"
        labels = list(table["label"])
        keep = self.selected.label if self.selected is not None else None
        first = result.first_divergence()
        self._selecting = True
        try:
            self._outputs["module"].options = labels
            self._outputs["module"].value = None
        finally:
            self._selecting = False
        mark = time.perf_counter()
        if keep is not None and (keep in labels or any(r.module == keep for r in result.rows)):
            self.select(keep)
        elif first is not None:
            self.select(first.label())
        timings["detail_s"] = time.perf_counter() - mark
        if len(table):
            cols = ["module", "module_class", "dtype_a", "dtype_b", metric, "max_ulp"]
            cols += ["why"] if "why" in table.columns else []
            top = table.sort_values(metric, ascending=False).head(10)[cols]
            self._outputs["top_modules"].value = (
                f"<b>most divergent module outputs by {html.escape(metric)}</b>"
                + top.to_html(index=False, float_format=lambda v: f"{v:.3e}")
            )
        timings["show_s"] = time.perf_counter() - start


_ERR_RESULT_HINT = re.compile(
    r"\s*(The pairs compared so far are in err\.result\.|The Result is in err\.result; pass "
    r"check_outputs=False to get it returned\.)"
)


def _partial_html(result: Result, err: Exception) -> str:
    """What `err.result` holds, for a panel that cannot hand the user the object."""
    n = len(result.rows)
    if not n:
        return "<div class='lab-partial'>No pair was compared before the failure.</div>"
    first = result.first_divergence()
    last = result.table().tail(8)
    last.insert(0, "label", [r.label() for r in result.rows[-len(last) :]])
    cols = ["label", "module_class", "dtype_a", "dtype_b", "rel_max", "max_ulp"]
    a, b = result.side_a.get("name"), result.side_b.get("name")
    shown = last[cols].rename(columns={"dtype_a": f"dtype {a}", "dtype_b": f"dtype {b}"})
    what = "before the failure" if err.__cause__ is not None else "in this run"
    return (
        f"<div class='lab-partial'><b>{n} pair(s) compared {what}</b>; first divergence: "
        f"{html.escape(first.label()) if first is not None else 'none (bit-exact so far)'}. "
        f"The last {len(last)}:"
        + shown.to_html(index=False, float_format=lambda v: f"{v:.3e}")
        + "</div>"
    )


def _point_label(trace: Any, index: int, result: Result | None) -> str:
    """The label of point `index` of a divergence-plot trace (a go trace or its JSON dict).

    plot_divergence_by_layer puts each output at x = its position in `result.rows`; a
    customdata label, where a trace carries one, is used first.
    """
    get = trace.get if isinstance(trace, Mapping) else lambda k: getattr(trace, k, None)
    custom = get("customdata")
    if custom is not None and len(custom) > index:
        value = custom[index]
        return str(value[0] if isinstance(value, list | tuple) else value)
    if result is None:
        raise ValueError("the plot shows no result")
    return result.rows[int(get("x")[index])].label()


# A plotly figure that reports clicks to Python. plotly's own FigureWidget ships plotly.js as
# its anywidget module (~5 MB), and anywidget gives a module 2 s to load: on a busy machine
# the model then never initialises and the plot stays empty. This module is a few lines;
# plotly.js travels once as a trait and is loaded when the view renders, with no deadline.
_PLOT_ESM = """
function loadPlotly(model) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!window.__labPlotly) {
    window.__labPlotly = new Promise((resolve, reject) => {
      const url = URL.createObjectURL(
        new Blob([model.get("_plotly_js")], { type: "text/javascript" }));
      const script = document.createElement("script");
      script.src = url;
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => reject(new Error("plotly.js did not load"));
      document.head.appendChild(script);
    });
  }
  return window.__labPlotly;
}

async function render({ model, el }) {
  const Plotly = await loadPlotly(model);
  const div = document.createElement("div");
  el.style.width = "100%";
  div.style.width = "100%";
  el.appendChild(div);
  const draw = () => {
    const spec = model.get("spec") || {};
    Plotly.react(div, spec.data || [], spec.layout || {},
                 { displaylogo: false, responsive: true });
  };
  draw();
  model.on("change:spec", draw);
  div.on("plotly_click", (event) => {
    const p = event.points && event.points[0];
    if (p) model.send({ event: "click", curve: p.curveNumber, point: p.pointIndex });
  });
  // The view is drawn before JupyterLab attaches it: follow the width it gets.
  const resize = new ResizeObserver(() => Plotly.Plots.resize(div));
  resize.observe(el);
  return () => { resize.disconnect(); model.off("change:spec", draw); Plotly.purge(div); };
}

export default { render };
"""


@functools.cache
def _plot_widget_class() -> type | None:
    try:
        import anywidget
    except ImportError:
        return None
    import traitlets
    from plotly.offline import get_plotlyjs

    class PlotlyPlot(anywidget.AnyWidget):
        """A plotly figure in the browser (hover, zoom) whose point clicks reach Python."""

        _esm = traitlets.Unicode(_PLOT_ESM).tag(sync=True)
        _plotly_js = traitlets.Unicode().tag(sync=True)
        spec = traitlets.Dict().tag(sync=True)
        """The figure as plotly JSON (data, layout)."""

        def __init__(self, on_click: Callable[[int, int], None], css: str) -> None:
            super().__init__(_plotly_js=get_plotlyjs(), _dom_classes=(css,))
            self._on_click = on_click
            self.on_msg(self._handle)

        def _handle(self, _widget: Any, content: Any, _buffers: Any) -> None:
            if isinstance(content, dict) and content.get("event") == "click":
                self._on_click(int(content["curve"]), int(content["point"]))

    return PlotlyPlot


def _plot_widget(on_click: Callable[[int, int], None], css: str) -> W.DOMWidget:
    """The divergence plot's widget: clickable with anywidget, an Output without it."""
    cls = _plot_widget_class()
    return cls(on_click, css) if cls is not None else W.Output(_dom_classes=(css,))


def _plotly_spec(fig: Any) -> dict[str, Any]:
    """A figure as plotly JSON: a dict (`divergence_spec`) as it is, a go.Figure converted."""
    if isinstance(fig, Mapping):
        return dict(fig)
    import json

    import plotly.io as pio

    return json.loads(pio.to_json(fig, validate=False, remove_uids=True))


def _show_plotly(target: W.DOMWidget, fig: Any) -> None:
    """Show `fig` (a go.Figure or its JSON) in a plot widget or, without one, an Output.

    The Output shows it through JupyterLab's plotly renderer.
    """
    if not isinstance(target, W.Output):
        target.spec = _plotly_spec(fig)
        return
    from IPython import get_ipython

    if get_ipython() is None:  # headless: the figure object is what tests read
        return
    target.clear_output(wait=True)
    from IPython.display import display

    with target:
        display({"application/vnd.plotly.v1+json": _plotly_spec(fig)}, raw=True)


@functools.cache
def _tiny_probe(family_name: str) -> tuple[frozenset[str], frozenset[str], dict[str, str]]:
    """`_probe` of a family's tiny build (its classes and inputs are every preset's)."""
    fam = get_family(family_name)
    return _probe(fam.build("tiny", 0), fam.make_inputs("tiny", 0))


def _probe(model: Any, inputs: Any) -> tuple[frozenset[str], frozenset[str], dict[str, str]]:
    """Module class names of `model`, input switches that change `inputs`, those refusing them.

    The refusals map a switch's name to its message (a timestep switch on a model whose
    timestep it cannot adapt).

    An input switch is tried with the latents in bf16 (a rollout's dtype): LTX's positions
    switch casts the coordinates to the latents' dtype, which changes nothing on fp32 ones.
    """
    import torch

    classes = frozenset(type(m).__name__ for m in model.modules())
    latents = {
        k: v.to(torch.bfloat16)
        for k in inputs.keys_with_role("latents")
        if isinstance(v := inputs.kwargs[k], torch.Tensor) and v.is_floating_point()
    }
    probe = inputs.replace_kwargs(**latents) if latents else inputs
    changes = set()
    refusals: dict[str, str] = {}
    for name, switch in SWITCHES.items():
        if switch.transform_inputs is None:
            continue
        for value in switch.values[1:]:
            try:
                out = switch.transform_inputs(probe, value)
            except ValueError as err:
                refusals[name] = str(err)
                continue
            if any(out.kwargs.get(k) is not v for k, v in probe.kwargs.items()):
                changes.add(name)
    return classes, frozenset(changes), refusals


def _default_sides(fam: Any) -> tuple[Side, Side]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        return Side.rollout(fam), Side.trainer(fam)


def _error_html(text: str) -> str:
    return (
        "<div class='lab-error' style='color:#b00020;white-space:pre-wrap'>"
        f"{html.escape(text)}</div>"
    )


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4e}"
    return html.escape(str(value))


def _summary_html(result: Result, traj: Any, verdict: str) -> str:
    """The summary table, under the result in one sentence (`ControlPanel.verdict`)."""
    summary = result.summary()
    roots = result.root_rows()
    rows = [
        ("reference (A)", f"{result.side_a.get('name')}"),
        ("candidate (B)", f"{result.side_b.get('name')}"),
        ("model output dtype A / B", f"{roots[0].dtype_a} / {roots[0].dtype_b}" if roots else "-"),
    ]
    exact = all(not r.diverges for r in result.rows)
    for k in _SUMMARY_KEYS:
        value = summary.get(k)
        if k == "first_divergent_module" and value is None:
            value = "none: the sides agree bit for bit" if exact else "none"
        rows.append((k, _fmt(value)))
    if traj is not None:
        overall = traj.overall()
        rows += [(k, _fmt(overall.get(k))) for k in _DRIFT_KEYS]
    rows += [
        (f"input policy {side.get('name')}", html.escape(_policy_words(side["input_dtype_policy"])))
        for side in (result.side_a, result.side_b)
    ]
    body = "".join(
        f"<tr><th>{html.escape(k)}</th><td data-key='{html.escape(k)}'>{v}</td></tr>"
        for k, v in rows
    )
    agree = " lab-agree" if bitexact_words(result) is not None else ""
    return (
        f"<div class='lab-verdict{agree}'>{html.escape(verdict)}</div>"
        f"<table class='lab-summary-table'>{body}</table>"
    )


def _policy_words(policy: Mapping[str, Any]) -> str:
    """The policy as the dropdowns say it: "latents: passthrough, ..., timestep: fp32"."""
    return ", ".join(
        f"{key}: {'passthrough' if policy.get(key) is None else policy[key]}"
        for key in (*POLICY_KEYS, *(k for k in policy if k not in POLICY_KEYS))
    )


def _prescriptions_html(found: Any, side_name: str) -> str:
    """The Prescribe table: each prescription's changes, whether it meets, and its costs."""
    text = f"<pre class='lab-prescribe-words'>{html.escape(found.describe())}</pre>"
    if not len(found):
        return text
    table = found.table()
    table["extra_bytes"] = [f"{b:+,}" for b in table["extra_bytes"]]
    table["time_ratio"] = [f"x{r:.2f}" for r in table["time_ratio"]]
    table["value"] = [f"{v:.3g}" for v in table["value"]]
    table = table.rename(
        columns={
            "extra_bytes": f"extra parameter bytes on {side_name}",
            "time_ratio": "forward time",
            "value": "verified value",
        }
    )
    return text + table.to_html(index=False, classes="lab-prescriptions-table", escape=True)


@checked_arguments
def control_panel(
    family: FamilyName = "flux", preset: str = "tiny", device: DeviceName = "cpu", *, seed: int = 0
) -> ControlPanel:
    """Build the control panel; the returned object displays itself as the panel in Jupyter.

    Raises:
        ValueError: An unknown family, preset or device, or a seed that is not an int (the
            panel's own settings never raise; see `message`).
    """
    return ControlPanel(family, preset, device, seed=seed)


__all__ = [
    "POLICY_CHOICES",
    "SIDE_NAMES",
    "ControlPanel",
    "control_panel",
    "format_rules_text",
    "nearest_rule_names",
    "parse_keep_text",
    "parse_rules_text",
    "rule_matches_table",
]

"""Result / LayerDivergence / Skipped: what a paired forward found, with to_json / from_json."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lab.base.dtypes import DTYPES
from lab.pairing.capture import ROOT
from lab.pairing.metrics import ULP_BIN_LABELS, PairMetrics

SCHEMA = "precision-lab/result/1"


@dataclass(frozen=True)
class LayerDivergence:
    """One paired output tensor: a module call's output on both sides and their metrics."""

    order: int
    """Position in forward completion order (children finish before their parents)."""
    module: str
    call: int
    output: str
    module_class: str
    dtype_a: str
    dtype_b: str
    shape: tuple[int, ...]
    metrics: PairMetrics
    module_a: str | None = None
    """Side A's name for this output when the sides are two implementations (the engine's
    module path, `path[i/n]` for piece i of a fused output); None when both run one tree."""

    @property
    def diverges(self) -> bool:
        """Any element differs (a NaN on one side only counts as a difference)."""
        m = self.metrics
        return m.max_abs_diff > 0 or m.nonfinite_a != m.nonfinite_b or m.bitexact_frac < 1.0

    def ulp_at_scale(self) -> float:
        """The largest difference in ULPs of the reference's largest magnitude.

        In the coarser dtype of the two sides. `max_ulp` counts the representable values
        between paired elements, which runs to thousands (bf16) or billions (fp32) for elements
        near or across zero even when the difference is one rounding step of the tensor's own
        scale; this is that difference at the scale: 1.0 is one ULP of the largest value. 0 for
        no difference; inf when the reference is all zero and the candidate is not.
        """
        m = self.metrics
        if m.max_abs_diff == 0:
            return 0.0
        if not (math.isfinite(m.max_abs_a) and m.max_abs_a > 0):
            return math.inf
        # One ULP at 1.0 in the coarser dtype (a name the lab does not know counts as fp32).
        eps = max(
            torch.finfo(DTYPES.get(d, torch.float32)).eps for d in (self.dtype_a, self.dtype_b)
        )
        return m.max_abs_diff / (eps * 2.0 ** math.floor(math.log2(m.max_abs_a)))

    def label(self) -> str:
        """Display name: `module[:output][#call]`."""
        out = f":{self.output}" if self.output else ""
        call = f"#{self.call}" if self.call else ""
        return f"{self.module}{out}{call}"

    def row(self) -> dict[str, Any]:
        """Flat dict for the table."""
        m = dataclasses.asdict(self.metrics)
        hist = m.pop("ulp_hist")
        return {
            "order": self.order,
            "module": self.module,
            "call": self.call,
            "output": self.output,
            "module_class": self.module_class,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape": "x".join(str(s) for s in self.shape),
            **m,
            "ulp_hist": list(hist),
            **({"module_a": self.module_a} if self.module_a is not None else {}),
        }


def _near_zero_ulps(row: LayerDivergence) -> bool:
    """A max ULP count that elements near zero inflate: large, and far above the one at scale."""
    return row.metrics.max_ulp > 64 and row.ulp_at_scale() * 16 < row.metrics.max_ulp


@dataclass(frozen=True)
class Skipped:
    """A pair that could not be compared, and why (shown in summaries, never dropped)."""

    module: str
    call: int
    output: str
    reason: str


@dataclass
class Result:
    """Everything one paired forward found; the first side is the reference."""

    mode: str
    side_a: dict[str, Any]
    side_b: dict[str, Any]
    rows: list[LayerDivergence]
    skipped: list[Skipped] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    """Family, preset, seed, device, autocast policies, versions, timings (seconds)."""
    flow: Any = field(default=None, repr=False, compare=False)
    """The pair's recorded dtype flow (a `lab.pairing.dtype_flow.DtypeFlow`) that `whys()` explains
    the rows from; None for a Result read from JSON (its rows carry their why) or a dump."""
    partial: str | None = None
    """None for a pair that finished; else what stopped it (the `PairError`'s message): the rows
    are only what was compared before that. Every `PairError` that carries a Result sets it, it
    is written to the file, and every view (describe, summary, table, report, compare) shows it."""
    _whys: list[Any] | None = field(default=None, init=False, repr=False, compare=False)

    # ---- views --------------------------------------------------------------------------

    def table(self) -> Any:
        """One row per paired output tensor, in forward completion order (a pandas DataFrame).

        Columns: order, module, call, output, module_class, dtype_a, dtype_b, shape,
        mean_abs_diff, max_abs_diff, rel_max, max_ulp, bitexact_frac, cosine_dist,
        rounding_only, max_abs_diff_rounded, nonfinite_a, nonfinite_b, degenerate, ...,
        why (the cause of the row's divergence as text, "" where it does not differ, None
        where unknown) and why_codes (its cause codes, `lab.pairing.why.CAUSES`).
        """
        import pandas as pd

        table = pd.DataFrame(self._why_rows())
        # A partial Result's table is not the whole forward: the frame says so wherever it goes.
        table.attrs["partial"] = self.partial
        return table

    def whys(self) -> list[Any]:
        """The `lab.why.Why` of each row, in row order (an empty Why where it does not differ).

        Computed once, from `flow`, on first use; a Result read from JSON has the saved ones.
        None for every row of a Result with neither (a file written before `why`, a dump).
        """
        if self._whys is None or len(self._whys) != len(self.rows):
            if self.flow is None:
                self._whys = [None] * len(self.rows)
            else:
                from lab.pairing.sides import Side
                from lab.pairing.why import explain

                side_a, side_b = Side.from_dict(self.side_a), Side.from_dict(self.side_b)
                self._whys = explain(self.rows, side_a, side_b, self.flow)
        return self._whys

    def why(self, row: LayerDivergence | str | None) -> str | None:
        """The why text of one of this Result's rows (None for no row or an unknown why).

        `row`: a row (of this Result, or one with the same label from another, e.g. the same
        run read back from JSON), a label (`module[:output][#call]`) or a module path (its
        first output that differs, else its first output).

        Raises:
            ValueError: A label or module this Result has no row for, naming the nearest.
        """
        if row is None:
            return None
        whys = self.whys()
        if isinstance(row, LayerDivergence):
            index = next((i for i, r in enumerate(self.rows) if r is row), None)
            if index is None:
                row = row.label()
        if isinstance(row, str):
            index = self._row_index(row)
        elif not isinstance(row, LayerDivergence):
            raise ValueError(
                f"Result.why: expected a row, a label or a module path, got "
                f"{type(row).__name__} {row!r:.80}."
            )
        found = whys[index]
        return found.text if found is not None else None

    def _row_index(self, name: str) -> int:
        """The row of label `name`, else module `name`'s first differing output (or first)."""
        from lab.base.errors import nearest_words

        for i, r in enumerate(self.rows):
            if r.label() == name:
                return i
        outputs = [i for i, r in enumerate(self.rows) if r.module == name]
        if outputs:
            return next((i for i in outputs if self.rows[i].diverges), outputs[0])
        labels = [r.label() for r in self.rows]
        raise ValueError(
            f"Result.why: {name!r} is no row of this Result ({len(labels)} rows)."
            f"{nearest_words([name], labels)} Use a module path from "
            "result.table()['module'] or a row's label (`row.label()`: module[:output][#call])."
        )

    def _why_rows(self) -> list[dict[str, Any]]:
        return [
            {
                **r.row(),
                "why": w.text if w is not None else None,
                "why_codes": list(w.codes) if w is not None else None,
            }
            for r, w in zip(self.rows, self.whys(), strict=True)
        ]

    def first_divergence(self) -> LayerDivergence | None:
        """The first module output (in completion order) that differs; None at parity."""
        return next((r for r in self.rows if r.diverges), None)

    @property
    def first_divergent_module(self) -> str | None:
        """Module path of `first_divergence()`, or None."""
        row = self.first_divergence()
        return row.module if row is not None else None

    def root_rows(self) -> list[LayerDivergence]:
        """Rows of the model's own outputs (first call), the main output first."""
        return [r for r in self.rows if r.module == ROOT and r.call == 0]

    def output_metrics(self) -> dict[str, Any]:
        """The seed's output-level metrics from the model's main output, plus every output.

        Returns:
            model_output_mean_abs_diff, model_output_max_abs_diff, model_output_rel_max (main
            output), and "outputs": {output index: {metric: value}} for each root output.
        """
        roots = self.root_rows()
        out: dict[str, Any] = {"outputs": {}}
        for r in roots:
            out["outputs"][r.output or "0"] = {
                "mean_abs_diff": r.metrics.mean_abs_diff,
                "max_abs_diff": r.metrics.max_abs_diff,
                "rel_max": r.metrics.rel_max,
                "max_ulp": r.metrics.max_ulp,
                "bitexact_frac": r.metrics.bitexact_frac,
                "dtype_a": r.dtype_a,
                "dtype_b": r.dtype_b,
            }
        if roots:
            main = roots[0].metrics
            out["model_output_mean_abs_diff"] = main.mean_abs_diff
            out["model_output_max_abs_diff"] = main.max_abs_diff
            out["model_output_rel_max"] = main.rel_max
        return out

    def summary(self) -> dict[str, Any]:
        """Headline numbers: counts, bit-exact rows, first divergence, output metrics."""
        first = self.first_divergence()
        n_exact = sum(1 for r in self.rows if not r.diverges)
        return {
            "family": self.meta.get("family"),
            "preset": self.meta.get("preset"),
            "mode": self.mode,
            "side_a": self.side_a.get("name"),
            "side_b": self.side_b.get("name"),
            "partial": self.partial,
            "pairs": len(self.rows),
            "bitexact_pairs": n_exact,
            "skipped": len(self.skipped),
            "degenerate_pairs": sum(1 for r in self.rows if r.metrics.degenerate),
            "max_ulp": max((r.metrics.max_ulp for r in self.rows), default=0.0),
            "first_divergent_module": first.label() if first is not None else None,
            # The first output whose difference survives rounding both sides to the coarser
            # dtype: at parity up to rounding (e.g. an fp32 autocast boundary), it is None.
            "first_non_rounding_divergence": next(
                (r.label() for r in self.rows if r.diverges and not r.metrics.rounding_only), None
            ),
            "first_divergence_why": self.why(first),
            "first_non_rounding_divergence_why": self.why(
                next((r for r in self.rows if r.diverges and not r.metrics.rounding_only), None)
            ),
            **{k: v for k, v in self.output_metrics().items() if k != "outputs"},
        }

    def describe(self) -> str:
        """A few human lines for a notebook or a log."""
        s = self.summary()
        first = self.first_divergence()
        none = "none (bit-exact)" if self.partial is None else "none among the outputs compared"
        lines = [
            f"{s['family'] or 'model'} [{s['preset'] or '?'}], {self.mode}: "
            f"{self.side_a.get('name')} (reference) vs {self.side_b.get('name')} (candidate)",
            f"  paired outputs: {s['pairs']}, bit-exact: {s['bitexact_pairs']}, "
            f"skipped: {s['skipped']}, degenerate: {s['degenerate_pairs']}, "
            f"max ULP: {s['max_ulp']:g}",
            f"  first divergent module: {s['first_divergent_module'] or none}"
            + (
                " (rounding only; first beyond rounding: "
                f"{s['first_non_rounding_divergence'] or 'none'})"
                if first is not None and first.metrics.rounding_only
                else ""
            ),
        ]
        ran = [
            f"{side.get('name')} under FSDP2 on {job['world_size']} {job['backend']} rank(s)"
            for side, key in (
                (self.side_a, "fsdp2_a"),
                (self.side_b, "fsdp2_b"),
                (self.side_b, "fsdp2"),
            )
            if isinstance(job := self.meta.get(key), dict) and "world_size" in job
        ]
        if ran:
            lines.insert(1, "  " + "; ".join(ran))
        if self.partial is not None:
            lines.insert(1, f"  {partial_words(self.partial)}")
        if s["first_divergence_why"]:
            lines.append(f"  why: {s['first_divergence_why']}")
        beyond = s["first_non_rounding_divergence"]
        if (
            beyond
            and beyond != s["first_divergent_module"]
            and s["first_non_rounding_divergence_why"]
        ):
            lines.append(f"  why ({beyond}): {s['first_non_rounding_divergence_why']}")
        top = max(self.rows, key=lambda r: r.metrics.max_ulp, default=None)
        if top is not None and _near_zero_ulps(top):
            lines.append(
                f"  max ULP is at {top.label()}, among elements near zero (where ULPs are tiny): "
                f"its largest difference is {top.ulp_at_scale():.3g} ULP of its largest value "
                f"(rel_max {top.metrics.rel_max:.1e})"
            )
        root = next(iter(self.root_rows()), None)
        if root is not None and (root.metrics.nonfinite_a or root.metrics.nonfinite_b):
            # The differences below leave NaN/Inf out: without this line they read as parity.
            lines.append(
                f"  model output NaN/Inf: {root.metrics.nonfinite_a} on "
                f"{self.side_a.get('name')}, {root.metrics.nonfinite_b} on "
                f"{self.side_b.get('name')} of {root.metrics.numel} (left out of the differences)"
            )
        if "model_output_rel_max" in s:
            lines.append(
                "  model_output_mean_abs_diff={:.3e} max_abs_diff={:.3e} rel_max={:.3e}".format(
                    s["model_output_mean_abs_diff"],
                    s["model_output_max_abs_diff"],
                    s["model_output_rel_max"],
                )
            )
        for sk in self.skipped[:5]:
            lines.append(f"  skipped {sk.module}#{sk.call}:{sk.output}: {sk.reason}")
        return "\n".join(lines)

    # ---- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (schema in docs/files.md, "Result JSON")."""
        return {
            "schema": SCHEMA,
            "mode": self.mode,
            "side_a": self.side_a,
            "side_b": self.side_b,
            "meta": self.meta,
            "summary": _clean(self.summary()),
            "ulp_bins": list(ULP_BIN_LABELS),
            "rows": [_clean(r) for r in self._why_rows()],
            "skipped": [dataclasses.asdict(s) for s in self.skipped],
            **({"partial": self.partial} if self.partial is not None else {}),
        }

    def to_json(self, path: str | Path) -> Path:
        """Write `to_dict()` to `path` atomically (parents created). Returns the path.

        The document is serialized before the file is touched, and written to a temporary that
        replaces `path` only once complete (lab.base.atomic): a full disk or an unserializable meta
        value leaves an earlier file whole and never a 0-byte one. A symlink is written through
        (its target gets the document, the link stays).

        Raises:
            ValueError: `path` cannot be written at all (a folder, a read-only place, a name too
                long), naming it, before anything is serialized.
        """
        from lab.base.atomic import atomic_write_text, check_file_path

        check_file_path(path, "Result.to_json")
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))
        return Path(path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "Result.from_dict") -> Result:
        """Rebuild a Result from `to_dict()` output (rows with or without extra keys).

        Args:
            data: The document.
            where: What to name in errors (from_json passes the file).

        Raises:
            ValueError: On a document of another schema, or one whose fields are missing or of
                the wrong type (each listed with its place, e.g. `rows[3].max_ulp`).
        """
        _check_document(data, where)
        metric_fields = {f.name for f in dataclasses.fields(PairMetrics)}
        rows = []
        for r in data["rows"]:
            m = {k: r[k] for k in metric_fields if k != "ulp_hist"}
            m["ulp_hist"] = tuple(r["ulp_hist"])
            rows.append(
                LayerDivergence(
                    order=r["order"],
                    module=r["module"],
                    call=r["call"],
                    output=r["output"],
                    module_class=r["module_class"],
                    dtype_a=r["dtype_a"],
                    dtype_b=r["dtype_b"],
                    shape=tuple(int(s) for s in r["shape"].split("x")) if r["shape"] else (),
                    metrics=PairMetrics(**m),
                    module_a=r.get("module_a"),
                )
            )
        result = cls(
            mode=data["mode"],
            side_a=data["side_a"],
            side_b=data["side_b"],
            rows=rows,
            skipped=[Skipped(**s) for s in data.get("skipped", [])],
            meta=data.get("meta", {}),
            partial=data.get("partial"),
        )
        result._whys = _saved_whys(data["rows"], where)
        return result

    @classmethod
    def from_json(cls, path: str | Path) -> Result:
        """Read a file written by `to_json`.

        Raises:
            FileNotFoundError: No such file.
            ValueError: An empty, truncated or non-JSON file, or a document that is not a
                Result (another schema, missing fields, fields of the wrong type); the message
                names the file and what is wrong.
        """
        path = Path(path)
        where = f"Result.from_json({str(path)!r})"
        if not path.exists():
            raise FileNotFoundError(f"{where}: no such file. Write one with Result.to_json(path).")
        if path.is_dir():
            raise ValueError(f"{where}: is a directory; pass the result.json inside it.")
        raw = path.read_bytes()
        if not raw.strip():
            raise ValueError(
                f"{where}: the file is empty ({len(raw)} bytes); it was not written completely "
                "(re-run, or restore it from the run that wrote it)."
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{where}: not a UTF-8 text file (byte {err.start}); is it a result.json?"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            ends_early = _ends_early(text, err)
            cut = "; the document ends early: the file is truncated" if ends_early else ""
            raise ValueError(
                f"{where}: not valid JSON ({err.msg} line {err.lineno}, column {err.colno})"
                f"{cut}. Only files written by Result.to_json can be read."
            ) from None
        return cls.from_dict(data, where=where)


def _ends_early(text: str, err: json.JSONDecodeError) -> bool:
    """Whether `text` reads as a torn write: a JSON document cut off, not a malformed one.

    A cut can stop anywhere in a token (``1.``, ``tru``, ``"ab``), so where the decoder fails
    says little. What a cut always leaves is an object or array still open (or a string that
    never closes); a complete but malformed document closes everything it opens.
    """
    if err.pos >= len(text.rstrip()):
        return True  # the decoder ran out of text: no need to scan it
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
    return in_string or depth > 0


def _check_document(data: Any, where: str) -> None:
    """Raise one ValueError listing every missing or mistyped field of a Result document."""
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: expected a JSON object (a Result document), got {type(data).__name__}."
        )
    if data.get("schema") != SCHEMA and "per_step" in data:
        raise ValueError(
            f"{where}: this is a ratio-drift trajectory (it has per_step), not a paired "
            "forward's Result; read it with lab.Trajectory.from_json."
        )
    if data.get("schema") != SCHEMA:
        raise ValueError(
            f"{where}: schema {data.get('schema')!r} is not {SCHEMA!r}; "
            "was this file written by Result.to_json?"
        )
    problems: list[str] = []

    def need(obj: dict[str, Any], key: str, kind: str, place: str, optional: bool = False) -> None:
        if key not in obj:
            if not optional:
                problems.append(f"{place}{key}: missing")
            return
        if not _is_kind(obj[key], kind):
            problems.append(f"{place}{key}: expected {kind}, got {obj[key]!r:.60}")

    for key, kind in (("mode", "str"), ("side_a", "object"), ("side_b", "object")):
        need(data, key, kind, "")
    need(data, "rows", "list", "")
    need(data, "meta", "object", "", optional=True)
    need(data, "skipped", "list", "", optional=True)
    row_kinds = {**_ROW_KINDS, **{k: _metric_kind(t) for k, t in _metric_types().items()}}
    for i, r in enumerate(data.get("rows") if isinstance(data.get("rows"), list) else []):
        if not isinstance(r, dict):
            problems.append(f"rows[{i}]: expected an object, got {r!r:.60}")
            continue
        for key, kind in row_kinds.items():
            need(r, key, kind, f"rows[{i}].")
    if (
        "partial" in data
        and data["partial"] is not None
        and not (isinstance(data["partial"], str) and data["partial"].strip())
    ):
        problems.append(
            f"partial: expected null or the failure's message, got {data['partial']!r:.60}"
        )
    bins = data.get("ulp_bins", list(ULP_BIN_LABELS))
    if not isinstance(bins, list) or not all(isinstance(b, str) for b in bins):
        problems.append(f"ulp_bins: expected a list of bin labels, got {bins!r:.60}")
        bins = list(ULP_BIN_LABELS)
    seen: dict[tuple[Any, ...], int] = {}
    for i, r in enumerate(data.get("rows") if isinstance(data.get("rows"), list) else []):
        if not isinstance(r, dict) or any(not _is_kind(r.get(k), t) for k, t in row_kinds.items()):
            continue  # its missing or mistyped fields are listed above
        problems += [f"rows[{i}].{p}" for p in _row_value_problems(r, len(bins))]
        key = (r["module"], r["call"], r["output"])
        if key in seen:
            problems.append(
                f"rows[{i}]: a second row for {_label(*key)!r} (first at rows[{seen[key]}]); "
                "a pair writes each module output once"
            )
        seen.setdefault(key, i)
    for i, sk in enumerate(data.get("skipped") if isinstance(data.get("skipped"), list) else []):
        if not isinstance(sk, dict):
            problems.append(f"skipped[{i}]: expected an object, got {sk!r:.60}")
            continue
        for key, kind in (("module", "str"), ("call", "int"), ("output", "str"), ("reason", "str")):
            need(sk, key, kind, f"skipped[{i}].")
        extra = sorted(set(sk) - {"module", "call", "output", "reason"})
        if extra:
            problems.append(f"skipped[{i}]: unknown keys {extra}")
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise ValueError(
            f"{where}: not a valid Result document, {len(problems)} problem(s): "
            f"{'; '.join(problems[:6])}{more}."
        )


# What each metric can be, by its formula (lab.pairing.metrics.decode_stats): (lowest, highest,
# NaN possible). Differences, maxima and ULP counts are >= 0 and may overflow to inf, never NaN
# (non-finite elements are left out of them and counted apart); cosine_dist is NaN only when
# both norms overflow; the means are plain means of the finite elements.
_METRIC_RANGES: dict[str, tuple[float, float, bool]] = {
    "numel": (0, math.inf, False), "mean_abs_diff": (0, math.inf, False),
    "max_abs_diff": (0, math.inf, False), "rel_max": (0, math.inf, False),
    "max_ulp": (0, math.inf, False), "bitexact_frac": (0, 1, False),
    "cosine_dist": (0, math.inf, True), "max_abs_diff_rounded": (0, math.inf, False),
    "nonfinite_a": (0, math.inf, False), "nonfinite_b": (0, math.inf, False),
    "mean_a": (-math.inf, math.inf, True), "mean_b": (-math.inf, math.inf, True),
    "max_abs_a": (0, math.inf, False), "max_abs_b": (0, math.inf, False),
}  # fmt: skip


def _row_value_problems(row: dict[str, Any], bins: int) -> list[str]:
    """Values no pair can produce in one well-typed row: out of range, NaN, counts too large."""
    out = [
        f"{key}: {row[key]!r} is outside [{low:g}, {high:g}]"
        if not (isinstance(row[key], float) and math.isnan(row[key]))
        else f"{key}: NaN, which this metric never is"
        for key, (low, high, nan_ok) in _METRIC_RANGES.items()
        if not (
            (isinstance(row[key], float) and math.isnan(row[key]) and nan_ok)
            or low <= row[key] <= high
        )
    ]
    for key in ("order", "call"):
        if row[key] < 0:
            out.append(f"{key}: {row[key]!r} is negative")
    for key in ("nonfinite_a", "nonfinite_b"):
        if row[key] > row["numel"] >= 0:
            out.append(f"{key}: {row[key]} of only {row['numel']} elements")
    hist = row["ulp_hist"]
    if len(hist) != bins or any(v < 0 for v in hist):
        out.append(
            f"ulp_hist: expected {bins} counts >= 0 (one per ulp_bins label), got {hist!r:.60}"
        )
    return out


def _label(module: str, call: int, output: str) -> str:
    """`LayerDivergence.label` of a row's key."""
    return f"{module}{f':{output}' if output else ''}{f'#{call}' if call else ''}"


def partial_words(partial: str) -> str:
    """One line that says a Result is partial, for every view (describe, report, compare)."""
    first = partial.strip().splitlines()[0] if partial.strip() else "the pair failed"
    return (
        f"PARTIAL: the pair failed part-way ({first:.300}); the rows are only the outputs "
        "compared before that, not the whole forward"
    )


_ROW_KINDS: dict[str, str] = {
    "order": "int", "module": "str", "call": "int", "output": "str", "module_class": "str",
    "dtype_a": "str", "dtype_b": "str", "shape": "shape",
}  # fmt: skip


def _metric_types() -> dict[str, Any]:
    import typing

    return typing.get_type_hints(PairMetrics)


def _metric_kind(annotation: Any) -> str:
    if annotation is bool:
        return "bool"
    if annotation is int:
        return "int"
    if annotation is float:
        return "number"
    return "int list"  # ulp_hist: tuple[int, ...]


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "int list":
        return isinstance(value, list) and all(_is_kind(v, "int") for v in value)
    if kind == "shape":
        return isinstance(value, str) and (
            value == "" or all(part.isdigit() for part in value.split("x"))
        )
    raise AssertionError(f"unknown kind {kind!r}")


def _saved_whys(rows: list[dict[str, Any]], where: str) -> list[Any]:
    """The rows' saved `why` / `why_codes` as Why records (None where a row has no why).

    Raises:
        ValueError: A why that is not a string, or codes that are not a list of strings.
    """
    from lab.pairing.why import Why

    out: list[Any] = []
    for i, r in enumerate(rows):
        text, codes = r.get("why"), r.get("why_codes")
        if text is None:
            out.append(None)
            continue
        if not isinstance(text, str):
            raise ValueError(f"{where}: rows[{i}].why: expected a string, got {text!r:.60}.")
        if codes is None:
            codes = []
        if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
            raise ValueError(
                f"{where}: rows[{i}].why_codes: expected a list of strings, got {codes!r:.60}."
            )
        out.append(Why.from_text(text, codes))
    return out


def _clean(value: Any) -> Any:
    """JSON-ready copy: tuples become lists (NaN/Inf floats are written as NaN/Infinity)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def results_table(results: Sequence[Result]) -> Any:
    """One summary row per Result (for sweeps and overlays), as a pandas DataFrame."""
    import pandas as pd

    return pd.DataFrame([r.summary() for r in results])

"""Numerics contracts: a pair's parity written down once, checked in CI ever after.

`write(path, ...)` runs a pair and records, per module group (the model's top-level modules and
every block), a tier: `bitwise` where the group was bit-exact when written, else a tolerance
from the measured value times a margin (`rel<=x` on rel_max, or `ulp<=k` on max_ulp), with the
measured numbers beside it. An optional drift clause runs a Flow-GRPO trajectory and bounds its
clip fraction (or asks that no ratio be clipped: "under the noise floor"). `check(path)`
re-runs exactly that (the model rebuilt from its family, preset and seed, or loaded from its
checkpoint; its weight fingerprint compared), optionally with one side overridden for a
what-if, or side A read from a dump, and says which clauses hold.

The file is JSON, schema `precision-lab/contract/1`; a newer schema or a malformed field is
a `ContractError` (exit 2 on the command line), a failing clause exit 1 with the table.

    contract = lab.contract.write("parity.json", "flux", "tiny")
    lab.contract.check("parity.json").assert_holds()      # in a user's own pytest
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lab.base.arguments import checked_arguments
from lab.families import FamilyName
from lab.pairing.capture import ROOT
from lab.pairing.result import LayerDivergence, Result
from lab.pairing.sides import Side

SCHEMA = "precision-lab/contract/1"
SCHEMA_PREFIX = "precision-lab/contract/"
TierKind = Literal["bitwise", "rel", "ulp"]


class ContractError(ValueError):
    """A contract file that cannot be checked: malformed, another schema, another model."""


@checked_arguments
@dataclass(frozen=True)
class Clause:
    """One module group's tier: the rows it covers, the bound, what was measured."""

    group: str
    """Module path of the group (ROOT for the model's own outputs); it covers the path and
    every module under it."""
    tier: str
    """"bitwise", "rel<=X" (max rel_max over the group's rows) or "ulp<=K" (max max_ulp)."""
    measured: Mapping[str, float]
    """When written: rows, bitexact_rows, rel_max, max_ulp."""

    def bound(self) -> tuple[TierKind, float]:
        """(kind, limit) of the tier."""
        if self.tier == "bitwise":
            return "bitwise", 0.0
        kind, _, value = self.tier.partition("<=")
        return kind, float(value)  # type: ignore[return-value]


@checked_arguments
@dataclass
class ClauseCheck:
    """One clause re-measured."""

    clause: str
    tier: str
    holds: bool
    written: Mapping[str, Any]
    now: Mapping[str, Any]
    note: str = ""


@checked_arguments
@dataclass
class ContractCheck:
    """What `check` found: every clause, and whether all hold."""

    path: str
    checks: list[ClauseCheck]
    result: Result | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        """Every clause holds."""
        return all(c.holds for c in self.checks)

    def failed(self) -> list[ClauseCheck]:
        """The clauses that do not hold."""
        return [c for c in self.checks if not c.holds]

    def table(self) -> Any:
        """One row per clause: clause, tier, holds, written, now, note (a pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "clause": c.clause,
                    "tier": c.tier,
                    "holds": c.holds,
                    "written": _brief(c.written),
                    "now": _brief(c.now),
                    "note": c.note,
                }
                for c in self.checks
            ]
        )

    def describe(self) -> str:
        """Whether it holds, or the failing clauses, one per line."""
        head = f"contract {self.path}"
        extra = "".join(f"\n  note: {n}" for n in self.notes)
        if self.holds:
            return f"{head}: holds ({len(self.checks)} clauses).{extra}"
        lines = [f"{head}: {len(self.failed())} of {len(self.checks)} clause(s) fail:{extra}"]
        for c in self.failed():
            lines.append(
                f"  {c.clause} [{c.tier}]: written {_brief(c.written)}, now {_brief(c.now)}"
                + (f" ({c.note})" if c.note else "")
            )
        return "\n".join(lines)

    def assert_holds(self) -> None:
        """Raise AssertionError with the failing clauses unless every clause holds."""
        if not self.holds:
            raise AssertionError(self.describe())


def _brief(values: Mapping[str, Any]) -> str:
    parts = []
    for k, v in values.items():
        parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    return ", ".join(parts)


# ---- module groups ------------------------------------------------------------------------------


def _group_of(module: str, groups: Sequence[str]) -> str | None:
    """The deepest group that `module` is or lies under."""
    best = None
    for g in groups:
        if g == ROOT:
            if module == ROOT:
                return ROOT
            continue
        if (module == g or module.startswith(g + ".")) and (best is None or len(g) > len(best)):
            best = g
    return best


@checked_arguments
def module_groups(result: Result, blocks: Sequence[str] = ()) -> list[str]:
    """ROOT, every top-level module, and every block (instances of `blocks` classes).

    Blocks are found from the rows: a row whose class is a block class names one.
    """
    groups: list[str] = []
    for r in result.rows:
        top = ROOT if r.module == ROOT else r.module.split(".")[0]
        if top not in groups:
            groups.append(top)
        if r.module_class in blocks and r.module not in groups:
            groups.append(r.module)
    return groups


def _measure(rows: Sequence[LayerDivergence]) -> dict[str, Any]:
    return {
        "rows": len(rows),
        "bitexact_rows": sum(1 for r in rows if not r.diverges),
        "rel_max": max((r.metrics.rel_max for r in rows), default=0.0),
        "max_ulp": max((r.metrics.max_ulp for r in rows), default=0.0),
    }


def _tier(measured: Mapping[str, Any], tier: str, margin: float) -> str:
    if measured["bitexact_rows"] == measured["rows"]:
        return "bitwise"
    if tier == "ulp":
        return f"ulp<={math.ceil(measured['max_ulp'] * margin)}"
    return f"rel<={measured['rel_max'] * margin:.3e}"


# ---- writing ---------------------------------------------------------------------------------


def _weights_digest(model: Any) -> str:
    from lab.engine.dump import weight_fingerprints

    prints, _ = weight_fingerprints(model)
    return hashlib.blake2b(
        json.dumps(prints, sort_keys=True, default=str).encode(), digest_size=8
    ).hexdigest()


@checked_arguments
def write(
    path: str | Path,
    family_name: FamilyName,
    preset: str = "tiny",
    *,
    seed: int = 0,
    sigma: float = 0.75,
    cfg: bool = False,
    rollout: Side | Mapping[str, Any] | None = None,
    trainer: Side | Mapping[str, Any] | None = None,
    tier: Literal["rel", "ulp"] = "rel",
    margin: float = 2.0,
    drift: Mapping[str, Any] | None = None,
    checkpoint: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Run the pair and write its contract.

    Args:
        path: The contract file (JSON).
        family_name: One of `lab.families()`.
        preset: The model preset.
        seed: Weight and input seed.
        sigma: The step's sigma.
        cfg: The family's CFG layout.
        rollout: Side A: a Side, overrides for `Side.rollout(fam)`, or None.
        trainer: Side B: a Side, overrides for `Side.trainer(fam)`, or None.
        tier: The tolerance kind for groups that are not bit-exact: "rel" (rel_max) or "ulp".
        margin: Tolerance = the measured value times this (>= 1).
        drift: Optional drift clause: {"steps": 10, "cfg_scale": 1.0, "samples": 2,
            "clip_range": 1e-4, "max_clip_frac": 0.0} ("max_clip_frac": 0 asks for no ratio
            clipped: under the noise floor).
        checkpoint: A local diffusers checkpoint directory instead of seeded weights.
        overwrite: Replace an existing contract file.

    Returns:
        The contract document (also written to `path`).

    Raises:
        ValueError: Bad arguments, or `path` exists and overwrite is False.
    """
    import lab
    from lab.base.atomic import atomic_write_text, check_file_path

    path = check_file_path(path, "contract write")
    if path.exists() and not overwrite:
        raise ValueError(
            f"contract write: {str(path)!r} exists; pass overwrite=True (--overwrite) to "
            "replace it, or choose another path."
        )
    if tier not in ("rel", "ulp"):
        raise ValueError(f"contract write: tier must be 'rel' or 'ulp', got {tier!r}.")
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not margin >= 1:
        raise ValueError(f"contract write: margin must be a number >= 1, got {margin!r}.")
    fam = lab.family(family_name)
    side_a = Side.from_overrides(rollout, fam, "rollout", "cpu", where="contract write")
    side_b = Side.from_overrides(trainer, fam, "trainer", "cpu", where="contract write")
    model = (
        fam.load(checkpoint)
        if checkpoint
        else fam.build(preset, seed, expert=fam.expert_for_sigma(sigma))
    )
    # A checkpoint's own config sets the input widths, as pair_family builds them.
    own_config = dict(model.config) if checkpoint else None
    inputs = fam.make_inputs(preset, seed, 1, cfg, sigma=sigma, config=own_config)
    result = lab.pair(model, inputs, side_a, side_b, check_outputs=False)
    groups = module_groups(result, fam.block_classes)
    clauses = []
    for g in groups:
        rows = [r for r in result.rows if _group_of(r.module, groups) == g]
        if rows:
            m = _measure(rows)
            clauses.append({"group": g, "tier": _tier(m, tier, float(margin)), "measured": m})
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "model": {
            "family": family_name,
            "preset": preset,
            "seed": seed,
            "checkpoint": checkpoint,
            "init": getattr(model, "lab_init", None),
            "weights_fingerprint": _weights_digest(model),
        },
        "inputs": {"seed": seed, "sigma": sigma, "cfg": cfg, "batch": 1},
        "sides": {"a": side_a.to_dict(), "b": side_b.to_dict()},
        "mode": "propagated",
        "margin": float(margin),
        "clauses": clauses,
        "output": {
            k: v for k, v in result.output_metrics().items() if k.startswith("model_output_")
        },
        "drift": None,
        "versions": result.meta.get("versions"),
    }
    if drift is not None:
        document["drift"] = _run_drift(family_name, preset, seed, side_a, side_b, drift)
    atomic_write_text(path, json.dumps(document, indent=1, default=_json_default))
    return document


def _json_default(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


_DRIFT_KEYS = {
    "steps": 10,
    "cfg_scale": 1.0,
    "samples": 2,
    "clip_range": 1e-4,
    "max_clip_frac": 0.0,
}


def _run_drift(
    family_name: str, preset: str, seed: int, a: Side, b: Side, drift: Mapping[str, Any]
) -> dict[str, Any]:
    import lab

    unknown = sorted(set(drift) - set(_DRIFT_KEYS) - {"measured"})
    if unknown:
        raise ValueError(
            f"contract: unknown drift key(s) {unknown}. Known: {', '.join(_DRIFT_KEYS)}."
        )
    spec = {**_DRIFT_KEYS, **{k: v for k, v in drift.items() if k != "measured"}}
    traj = lab.trajectory(
        family_name, preset, steps=int(spec["steps"]), cfg_scale=float(spec["cfg_scale"]),
        samples=int(spec["samples"]), seed=seed, rollout=a, trainer=b,
        clip_range=float(spec["clip_range"]), keep_tensors=False, progress=False,
    )  # fmt: skip
    overall = traj.overall()
    floor = traj.noise_floor(float(spec["clip_range"]))
    spec["measured"] = {
        "clip_frac": float(overall["clip_frac"]),
        "transition_kl": float(overall.get("transition_kl", math.nan)),
        "below_steps": floor.below_steps,
    }
    return spec


# ---- reading and checking ------------------------------------------------------------------------


@checked_arguments
def read(path: str | Path) -> dict[str, Any]:
    """Read and validate a contract file.

    Raises:
        ContractError: A missing, unreadable or malformed file, or a newer or other schema,
            naming the field and the fix.
    """
    path = Path(path)
    where = f"contract {str(path)!r}"
    if not path.is_file():
        raise ContractError(
            f"{where}: no such file. Write one with `precision-lab contract write`."
        )
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ContractError(f"{where}: not valid JSON ({err}).") from None
    if not isinstance(doc, dict):
        raise ContractError(f"{where}: expected a JSON object, got {type(doc).__name__}.")
    schema = doc.get("schema")
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_PREFIX):
        raise ContractError(
            f"{where}: field 'schema' is {schema!r}, not a lab contract ({SCHEMA})."
        )
    if schema != SCHEMA:
        raise ContractError(
            f"{where}: schema {schema!r} is newer than this lab reads ({SCHEMA}); upgrade the "
            "lab, or rewrite the contract with this version."
        )

    def need(obj: Any, key: str, kind: type | tuple[type, ...], place: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise ContractError(f"{where}: field {place}{key!r} is missing.")
        value = obj[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ContractError(
                f"{where}: field {place}{key!r} must be {getattr(kind, '__name__', kind)}, got "
                f"{type(value).__name__} {value!r:.60}."
            )
        return value

    model = need(doc, "model", dict, "")
    need(model, "family", str, "model.")
    need(model, "preset", str, "model.")
    need(model, "seed", int, "model.")
    need(model, "weights_fingerprint", str, "model.")
    inputs = need(doc, "inputs", dict, "")
    need(inputs, "sigma", (int, float), "inputs.")
    need(inputs, "cfg", bool, "inputs.")
    sides = need(doc, "sides", dict, "")
    for key in ("a", "b"):
        try:
            Side.from_dict(need(sides, key, dict, "sides."))
        except (ValueError, TypeError) as err:
            raise ContractError(
                f"{where}: field sides.{key!r} is not a valid Side: {err}"
            ) from None
    clauses = need(doc, "clauses", list, "")
    if not clauses:
        raise ContractError(
            f"{where}: field 'clauses' is empty: a contract with no clause holds vacuously."
        )
    seen = set()
    for i, c in enumerate(clauses):
        group = need(c, "group", str, f"clauses[{i}].")
        tier = need(c, "tier", str, f"clauses[{i}].")
        if group in seen:
            raise ContractError(f"{where}: clauses[{i}] repeats group {group!r}.")
        seen.add(group)
        ok = tier == "bitwise"
        if not ok and "<=" in tier:
            kind, _, value = tier.partition("<=")
            try:
                ok = kind in ("rel", "ulp") and float(value) >= 0 and math.isfinite(float(value))
            except ValueError:
                ok = False
        if not ok:
            raise ContractError(
                f"{where}: clauses[{i}].tier is {tier!r}; use 'bitwise', 'rel<=X' or 'ulp<=K'."
            )
    drift = doc.get("drift")
    if drift is not None:
        if not isinstance(drift, dict):
            raise ContractError(f"{where}: field 'drift' must be an object or null.")
        for key in ("steps", "clip_range", "max_clip_frac"):
            need(drift, key, (int, float), "drift.")
    return doc


@checked_arguments
def check(
    path: str | Path,
    *,
    rollout_overrides: Mapping[str, Any] | None = None,
    trainer_overrides: Mapping[str, Any] | None = None,
    dump: str | Path | None = None,
) -> ContractCheck:
    """Re-run a contract and check every clause.

    Args:
        path: The contract file.
        rollout_overrides: Side field overrides for side A (a what-if).
        trainer_overrides: Side field overrides for side B.
        dump: A dump directory (`lab.dump.attach`) of side A's forward on the contract's model
            and inputs, read as side A instead of running it.

    Returns:
        A ContractCheck (`holds`, `table()`, `describe()`, `assert_holds()`).

    Raises:
        ContractError: A malformed file, a newer schema, or a model whose weights are not the
            contract's.
    """
    import lab

    doc = read(path)
    m, x = doc["model"], doc["inputs"]
    fam = lab.family(m["family"])
    if m.get("checkpoint"):
        model = fam.load(m["checkpoint"])
    else:
        init = {} if m.get("init") is None else {"init": m["init"]}
        model = fam.build(m["preset"], m["seed"], expert=fam.expert_for_sigma(x["sigma"]), **init)
    digest = _weights_digest(model)
    if digest != m["weights_fingerprint"]:
        raise ContractError(
            f"contract {str(path)!r}: the model built from family {m['family']!r}, preset "
            f"{m['preset']!r}, seed {m['seed']} has weights fingerprint {digest}, the contract "
            f"{m['weights_fingerprint']} (field model.weights_fingerprint): the weights are not "
            "the ones it was written for. Rewrite the contract for these weights."
        )
    side_a = Side.from_dict(doc["sides"]["a"])
    side_b = Side.from_dict(doc["sides"]["b"])
    if rollout_overrides:
        side_a = side_a.replace(**dict(rollout_overrides))
    if trainer_overrides:
        side_b = side_b.replace(**dict(trainer_overrides))
    own_config = dict(model.config) if m.get("checkpoint") else None
    inputs = fam.make_inputs(m["preset"], x.get("seed", m["seed"]), x.get("batch", 1), x["cfg"],
                             sigma=x["sigma"], config=own_config)  # fmt: skip
    if dump is not None:
        from lab.engine.dump import pair_dump

        result = pair_dump(dump, model, inputs, side_b, dump_name=side_a.name)
    else:
        result = lab.pair(model, inputs, side_a, side_b, check_outputs=False)
    groups = [c["group"] for c in doc["clauses"]]
    checks = []
    for c in doc["clauses"]:
        clause = Clause(c["group"], c["tier"], c.get("measured", {}))
        rows = [r for r in result.rows if _group_of(r.module, groups) == clause.group]
        now = _measure(rows)
        kind, limit = clause.bound()
        note = ""
        if not rows:
            holds, note = False, "no row of this group was captured"
        elif kind == "bitwise":
            holds = now["bitexact_rows"] == now["rows"]
        elif kind == "rel":
            holds = now["rel_max"] <= limit
        else:
            holds = now["max_ulp"] <= limit
        keys = ("rows", "rel_max", "max_ulp")
        written = {k: v for k, v in clause.measured.items() if k in keys}
        current = {k: now[k] for k in keys}
        checks.append(ClauseCheck(clause.group, clause.tier, holds, written, current, note))
    notes = []
    written_cpu = (doc.get("versions") or {}).get("cpu")
    now_cpu = result.meta.get("versions", {}).get("cpu")
    if written_cpu and now_cpu and written_cpu != now_cpu:
        notes.append(
            f"written on {written_cpu} CPU kernels, checked on {now_cpu}: kernels of another "
            "set round differently, so bitwise clauses may not carry over"
        )
    if doc.get("drift"):
        spec = doc["drift"]
        asked = {k: v for k, v in spec.items() if k != "measured"}
        measured = _run_drift(m["family"], m["preset"], m["seed"], side_a, side_b, asked)
        measured = measured["measured"]
        limit = float(spec["max_clip_frac"])
        holds = measured["clip_frac"] <= limit
        tier = "no ratio clipped" if limit == 0 else f"clip_frac<={limit:g}"
        checks.append(
            ClauseCheck(
                "drift",
                tier,
                holds,
                {"clip_frac": (spec.get("measured") or {}).get("clip_frac")},
                {"clip_frac": measured["clip_frac"], "steps_clipped": len(measured["below_steps"])},
                f"clip range {spec['clip_range']:g}, {spec['steps']} steps",
            )
        )
    return ContractCheck(str(path), checks, result, notes)


__all__ = [
    "SCHEMA",
    "Clause",
    "ClauseCheck",
    "ContractCheck",
    "ContractError",
    "check",
    "module_groups",
    "read",
    "write",
]

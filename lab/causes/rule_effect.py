"""What a set of param_dtype_rules does: the trainer paired against the rollout without and with.

    effect = rule_effect("wan2_2", "tiny")          # the family's fp32_rule_suggestions
    effect.runs                                     # {"without rules": Result, "with rules": ...}
    print(effect.describe())                        # lowered / raised / unchanged, and why

Whether a rule *can* lower the divergence is read from the data, not assumed:

- the parameter dtypes both sides hold (`lab.weights.plan_weights`): where the rollout holds a
  parameter in fp32 (an engine fp32 keep) and the trainer gathers it in bf16, the trainer's
  divergence comes partly from parameters and a rule pinning it to fp32 closes that gap;
  where both sides hold every parameter in the same dtype, it does not come from parameters
  and the sides' other differences (autocast, buffers, input policy, engine ops) are listed;
- the values the rules pin: when every one is exactly representable in the trainer's gather
  dtype (seeded norm gains of exactly 1.0, a checkpoint shipped in bf16), holding it in fp32
  changes no value the forward reads, so "no effect" is a property of those weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lab.base.arguments import checked_arguments
from lab.base.devices import DeviceName
from lab.base.dtypes import dtype_name, parse_dtype
from lab.families.master import held_parameters
from lab.pairing.result import Result
from lab.pairing.sides import Side
from lab.precision.param_rules import RuleMatch, explain_rules

if TYPE_CHECKING:
    import pandas as pd

    from lab.families import FamilyName

Verdict = Literal["lowered", "raised", "unchanged"]
RUN_NAMES: tuple[str, str] = ("without rules", "with rules")
# Side fields that say nothing about numerics (names, how FSDP2 would wrap, where it runs) or
# that the parameter-dtype comparison already covers.
_NOT_NUMERICS: frozenset[str] = frozenset(
    {"name", "fsdp_wrap_classes", "device", "param_dtype_rules", "keep_fp32_modules"}
)


@checked_arguments
@dataclass(frozen=True, eq=False)
class RuleEffect:
    """The trainer side without and with `rules`, against the same rollout, plus the evidence."""

    family: str
    preset: str
    rules: dict[str, str]
    without: Result
    with_rules: Result
    matches: list[RuleMatch]
    """What each rule matched on the model (explain_rules)."""
    params: pd.DataFrame
    """One row per parameter: name, numel, rollout, trainer_without, trainer_with (dtype names),
    pinned (the rules changed its trainer dtype), on_grid (its master values are exactly
    representable in the trainer's gather dtype)."""
    sides_differ: dict[str, tuple[Any, Any]]
    """Numerics fields of the rollout and the trainer (without rules) that differ."""
    buffers_differ: list[str]
    """Buffers the two sides hold in different dtypes (rules match parameters only)."""

    @property
    def runs(self) -> dict[str, Result]:
        """{"without rules": Result, "with rules": Result}, for plots and reports."""
        return dict(zip(RUN_NAMES, (self.without, self.with_rules), strict=True))

    @property
    def rel_max(self) -> tuple[float, float]:
        """model_output_rel_max without and with the rules."""
        return tuple(
            float(r.output_metrics().get("model_output_rel_max", math.nan))
            for r in (self.without, self.with_rules)
        )  # type: ignore[return-value]

    @property
    def verdict(self) -> Verdict:
        """Whether the rules lowered, raised or left model_output_rel_max unchanged."""
        before, after = self.rel_max
        if after < before:
            return "lowered"
        return "raised" if after > before else "unchanged"

    @checked_arguments
    def dtype_gaps(self, which: Literal["without", "with"] = "without") -> pd.DataFrame:
        """Parameters the trainer holds in another dtype than the rollout (rows of `params`)."""
        column = "trainer_without" if which == "without" else "trainer_with"
        return self.params[self.params["rollout"] != self.params[column]].reset_index(drop=True)

    def table(self) -> pd.DataFrame:
        """One row per run: headline numbers and the parameter-dtype gap to the rollout."""
        import pandas as pd

        rows = []
        for (name, result), which in zip(self.runs.items(), ("without", "with"), strict=True):
            s = result.summary()
            gaps = self.dtype_gaps(which)
            column = "trainer_without" if which == "without" else "trainer_with"
            rows.append(
                {
                    "run": name,
                    "model_output_rel_max": s.get("model_output_rel_max"),
                    "model_output_max_abs_diff": s.get("model_output_max_abs_diff"),
                    "bitexact_pairs": s["bitexact_pairs"],
                    "pairs": s["pairs"],
                    "first_divergent_module": s["first_divergent_module"],
                    "trainer_fp32_params": int((self.params[column] == "fp32").sum()),
                    "params_dtype_differs_from_rollout": len(gaps),
                }
            )
        return pd.DataFrame(rows).set_index("run")

    @checked_arguments
    def causes(self, which: Literal["without", "with"] = "without") -> dict[str, int]:
        """Rows whose divergence has each cause of their own (`lab.pairing.why` codes), most first.

        "inherited" and "submodule" rows are left out: they only pass on a cause upstream or
        inside. Empty for Results without a recorded dtype flow.
        """
        result = self.without if which == "without" else self.with_rules
        counts: dict[str, int] = {}
        for why in result.whys() if hasattr(result, "whys") else []:
            for code in getattr(why, "codes", ()):
                if code not in ("inherited", "submodule"):
                    counts[code] = counts.get(code, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def moved_rows(self) -> int:
        """Module outputs whose max_abs_diff differs between the two runs."""
        before = {(r.module, r.call, r.output): r.metrics.max_abs_diff for r in self.without.rows}
        return sum(
            1
            for r in self.with_rules.rows
            if before.get((r.module, r.call, r.output)) != r.metrics.max_abs_diff
        )

    def rule_gaps(self) -> pd.DataFrame:
        """Per rule: parameters it decides, dtype gaps to the rollout it closes and opens."""
        import pandas as pd

        params = self.params.set_index("name")
        rows = []
        for match in self.matches:
            names = [n for n in match.names if n in params.index]
            sub = params.loc[names]
            closes = (sub["rollout"] != sub["trainer_without"]) & (
                sub["rollout"] == sub["trainer_with"]
            )
            opens = (sub["rollout"] == sub["trainer_without"]) & (
                sub["rollout"] != sub["trainer_with"]
            )
            rows.append(
                {
                    "rule": match.pattern,
                    "dtype": match.dtype_name,
                    "params": len(names),
                    "closes_gap": int(closes.sum()),
                    "opens_gap": int(opens.sum()),
                }
            )
        return pd.DataFrame(rows, columns=["rule", "dtype", "params", "closes_gap", "opens_gap"])

    def describe(self) -> str:
        """What the rules did to model_output_rel_max, and what the data says about why."""
        before, after = self.rel_max
        gaps_without, gaps_with = self.dtype_gaps("without"), self.dtype_gaps("with")
        pinned = self.params[self.params["pinned"]]
        lines = [
            f"{self.family} [{self.preset}]: {len(self.rules)} rule(s) pin {len(pinned)} trainer "
            f"parameter(s) ({int(pinned['numel'].sum())} elements) to a new dtype.",
            _effect_line(self.verdict, before, after)
            + f" {self.moved_rows()} of {len(self.with_rules.rows)} module outputs moved.",
        ]
        if len(gaps_without):
            lines.append(
                f"Without the rules the trainer holds {len(gaps_without)} parameter(s) in "
                "another dtype than the rollout (e.g. "
                f"{_examples(gaps_without, 'trainer_without')}): part of the trainer's "
                f"divergence comes from parameters. With the rules {len(gaps_with)} differ."
            )
        else:
            lines.append(
                f"Without the rules the rollout and the trainer hold all {len(self.params)} "
                "parameters in the same dtype, so the trainer's divergence does not come from "
                "parameters: the sides differ in "
                + (_side_words(self.sides_differ) or "no numerics setting")
                + (
                    f", and in the dtype of buffer(s) {', '.join(self.buffers_differ[:4])} "
                    "(rules match parameters, never buffers)"
                    if self.buffers_differ
                    else ""
                )
                + "."
            )
        causes = self.causes("without")
        if causes:
            lines.append(
                "Causes of the rows that diverge on their own without the rules (why column): "
                + ", ".join(f"{code} {n}" for code, n in causes.items())
                + "."
            )
        per_rule = self.rule_gaps()
        closing = per_rule[per_rule["closes_gap"] > 0]
        opening = per_rule[per_rule["opens_gap"] > 0]
        if len(closing):
            lines.append(
                "Rules that give the trainer the rollout's dtype: "
                + ", ".join(f"{r.rule!r} ({r.closes_gap})" for r in closing.itertuples())
                + "."
            )
        if len(opening):
            lines.append(
                "Rules that pin parameters the rollout holds in "
                f"{gaps_with['rollout'].iloc[0] if len(gaps_with) else 'another dtype'}, so they "
                "change what the trainer computes rather than matching the rollout: "
                + ", ".join(f"{r.rule!r} ({r.opens_gap})" for r in opening.itertuples())
                + "."
            )
        if len(pinned) and self.verdict == "unchanged":
            on_grid = int(pinned.loc[pinned["on_grid"], "numel"].sum())
            total = int(pinned["numel"].sum())
            gather = self.without.side_b.get("param_dtype") or self.without.side_b.get(
                "forward_dtype"
            )
            if on_grid == total:
                lines.append(
                    f"Every value the rules pin ({total} elements) is exactly representable in "
                    f"{gather}: holding it in fp32 changes no value the forward reads. No "
                    "effect here is a property of these weights, not evidence that the rules "
                    "do not matter; weights off that grid (a checkpoint after optimizer "
                    "steps) can differ."
                )
            else:
                lines.append(
                    f"{total - on_grid} of the {total} pinned elements change value in fp32, "
                    "yet the output's largest difference did not move: the ops reading them "
                    "cast them back to the compute dtype (autocast), or the change stays below "
                    "the output's rounding."
                )
        first = self.with_rules.first_divergence()
        why = self.with_rules.why(first) if hasattr(self.with_rules, "why") else None
        if first is not None and why:
            lines.append(f"First divergence with the rules: {first.label()}: {why}")
        return "\n".join(lines)

    @checked_arguments
    def save(self, out_dir: str | Path) -> Path:
        """Write results.json (with rules), without_rules.json and rule_effect.json to out_dir.

        Returns:
            The folder.
        """
        from lab.base.atomic import atomic_write_text

        out = Path(out_dir)
        self.with_rules.to_json(out / "results.json")
        self.without.to_json(out / "without_rules.json")
        atomic_write_text(out / "rule_effect.json", json.dumps(self.to_dict(), indent=1))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The verdict and evidence as plain JSON values (the Results are saved separately)."""
        before, after = self.rel_max
        return {
            "family": self.family,
            "preset": self.preset,
            "rules": dict(self.rules),
            "verdict": self.verdict,
            "model_output_rel_max_without": before,
            "model_output_rel_max_with": after,
            "params_dtype_differs_without": self.dtype_gaps("without")["name"].tolist(),
            "params_dtype_differs_with": self.dtype_gaps("with")["name"].tolist(),
            "pinned_params": self.params.loc[self.params["pinned"], "name"].tolist(),
            "pinned_on_grid": bool(self.params.loc[self.params["pinned"], "on_grid"].all()),
            "sides_differ": {k: list(v) for k, v in self.sides_differ.items()},
            "buffers_differ": list(self.buffers_differ),
            "rule_gaps": self.rule_gaps().to_dict(orient="records"),
            "moved_rows": self.moved_rows(),
            "causes_without": self.causes("without"),
            "causes_with": self.causes("with"),
            "describe": self.describe(),
        }


@checked_arguments
def rule_effect(
    family_name: FamilyName,
    preset: str = "tiny",
    rules: Mapping[str, str] | None = None,
    *,
    seed: int = 0,
    device: DeviceName = "cpu",
    mode: str = "propagated",
    sigma: float = 0.75,
    variant: str | None = None,
) -> RuleEffect:
    """Pair the rollout against the trainer without and with `rules` on the same model.

    The trainer is `Side.trainer(family)` with its param_dtype_rules replaced: {} for the
    first run, `rules` for the second. The rollout is `Side.rollout(family)` both times.

    Args:
        family_name: One of `lab.families()`.
        preset: "tiny", "reduced" or "full".
        rules: Ordered glob -> dtype for the trainer; None = the family's
            `fp32_rule_suggestions`.
        seed: Weight and input seed.
        device: "cpu" or "cuda".
        mode: "propagated" or "local".
        sigma: The step's flow-matching sigma.
        variant: A family variant.

    Raises:
        ValueError: An unknown family or preset, a family without suggestions when `rules` is
            None, or a rule that matches nothing (with the nearest parameter names).
    """
    from lab.families import family as get_family
    from lab.pairing.run import pair
    from lab.pairing.weights import plan_weights

    fam = get_family(family_name)
    if rules is None:
        rules = dict(fam.fp32_rule_suggestions)
        if not rules:
            raise ValueError(
                f"rule_effect: family {family_name!r} suggests no fp32 rules "
                "(Family.fp32_rule_suggestions is empty). Pass rules={'glob': 'fp32'}."
            )
    rules = dict(rules)
    expert = fam.expert_for_sigma(sigma)
    model = fam.build(preset, seed, variant=variant, device=device, expert=expert)
    matches = explain_rules(model, rules)
    inputs = fam.make_inputs(preset, seed, 1, False, variant=variant, sigma=sigma, device=device)
    rollout = Side.rollout(fam, device=device)
    trainers = [Side.trainer(fam, device=device, param_dtype_rules=r) for r in ({}, rules)]
    plans = [plan_weights(model, side) for side in (rollout, *trainers)]
    results = [
        pair(
            model,
            inputs,
            rollout,
            trainer,
            mode,
            meta=dict(
                family=family_name,
                preset=preset,
                seed=seed,
                sigma=sigma,
                batch=1,
                cfg=False,
                variant=variant,
                expert=expert,
                init=getattr(model, "lab_init", None),
                rule_effect_run=name,
            ),
            stream=preset == "full",
        )
        for name, trainer in zip(RUN_NAMES, trainers, strict=True)
    ]
    return RuleEffect(
        family=family_name,
        preset=preset,
        rules=rules,
        without=results[0],
        with_rules=results[1],
        matches=matches,
        params=_param_table(model, *plans, gather=trainers[0].resolved_param_dtype),
        sides_differ=_sides_differ(rollout, trainers[0]),
        buffers_differ=sorted(
            n
            for n in set(plans[0].buffer_dtypes) | set(plans[1].buffer_dtypes)
            if _buffer_dtype(model, plans[0], n) != _buffer_dtype(model, plans[1], n)
        ),
    )


def _param_table(model: torch.nn.Module, rollout: Any, without: Any, with_: Any, *,
                 gather: str) -> pd.DataFrame:  # fmt: skip
    import pandas as pd

    gather_dtype = parse_dtype(gather, where="rule_effect")
    params = dict(model.named_parameters())
    held = held_parameters(model)  # compact masters: the on-grid check reads the fp32 value
    rows = []
    for name, d_without in without.param_dtypes.items():
        p = params.get(name)
        d_with = with_.param_dtypes[name]
        on_grid = True
        if p is not None and d_with != d_without and p.is_floating_point():
            master = p.detach().to(held[name]) if name in held else p.detach()
            on_grid = bool(torch.equal(master.to(gather_dtype).to(master.dtype), master))
        rows.append(
            {
                "name": name,
                "numel": int(p.numel()) if p is not None else 0,
                "rollout": dtype_name(rollout.param_dtypes[name]),
                "trainer_without": dtype_name(d_without),
                "trainer_with": dtype_name(d_with),
                "pinned": d_with != d_without,
                "on_grid": on_grid,
            }
        )
    return pd.DataFrame(rows)


def _buffer_dtype(model: torch.nn.Module, plan: Any, name: str) -> str:
    """The dtype a side holds a buffer in: its cast, else the buffer's own dtype."""
    if name in plan.buffer_dtypes:
        return dtype_name(plan.buffer_dtypes[name])
    buffers = dict(model.named_buffers())
    return dtype_name(buffers[name].dtype) if name in buffers else "?"


def _sides_differ(a: Side, b: Side) -> dict[str, tuple[Any, Any]]:
    da, db = a.to_dict(), b.to_dict()
    return {
        f.name: (da[f.name], db[f.name])
        for f in dataclasses.fields(Side)
        if f.name not in _NOT_NUMERICS and da[f.name] != db[f.name]
    }


def _side_words(differ: Mapping[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} ({a!r} vs {b!r})" for k, (a, b) in differ.items())


def _examples(gaps: pd.DataFrame, column: str, n: int = 2) -> str:
    return ", ".join(
        f"{row['name']}: rollout {row['rollout']}, trainer {row[column]}"
        for _, row in gaps.head(n).iterrows()
    )


def _effect_line(verdict: Verdict, before: float, after: float) -> str:
    if verdict == "unchanged":
        return f"The rules left model_output_rel_max unchanged at {before:.3e}."
    ratio = after / before if before else math.inf
    return (
        f"The rules {verdict} model_output_rel_max from {before:.3e} to {after:.3e} (x{ratio:.3g})."
    )

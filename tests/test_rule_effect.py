"""rule_effect: the fp32 suggestions without and with, on one build, recorded like pair_family."""

from __future__ import annotations

from lab.causes.rule_effect import rule_effect


def test_wan_suggestions_close_the_norm2_gap_and_runs_record_their_init() -> None:
    effect = rule_effect("wan2_2")
    without = effect.without.output_metrics()["model_output_rel_max"]
    with_rules = effect.with_rules.output_metrics()["model_output_rel_max"]

    # The engine keeps norm2 in fp32: that rule gives the trainer the rollout's dtype; the
    # other suggestions pin parameters the engine holds in bf16 (they open gaps instead).
    gaps = effect.rule_gaps().set_index("rule")
    assert gaps.loc["*.norm2.*", ["closes_gap", "opens_gap"]].tolist() == [4, 0]
    for rule in ("condition_embedder.*", "patch_embedding.*", "proj_out.*"):
        assert gaps.loc[rule, "closes_gap"] == 0 and gaps.loc[rule, "opens_gap"] > 0, rule
    # The trainer's autocast casts every pinned parameter back to bf16 where it is read: the
    # output does not move, and the verdict says why (the rest is the engine's own ops).
    assert without > 1e-3 and with_rules == without and effect.verdict == "unchanged"
    assert "cast them back to the compute dtype (autocast)" in effect.describe()
    # Both runs say which seeded weights they paired, as pair_family's Results do.
    assert effect.without.meta["init"] == effect.with_rules.meta["init"] == "trained"

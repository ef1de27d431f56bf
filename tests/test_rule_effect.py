"""rule_effect: the fp32 suggestions without and with, on one build, recorded like pair_family."""

from __future__ import annotations

from lab.causes.rule_effect import rule_effect


def test_wan_suggestions_close_the_parameter_gap_and_runs_record_their_init() -> None:
    effect = rule_effect("wan2_2")
    without = effect.without.output_metrics()["model_output_rel_max"]
    with_rules = effect.with_rules.output_metrics()["model_output_rel_max"]

    assert without > 1e-3, "without the rules the trainer's bf16 norm2 must diverge"
    assert with_rules == 0.0
    # Both runs say which seeded weights they paired, as pair_family's Results do.
    assert effect.without.meta["init"] == effect.with_rules.meta["init"] == "trained"

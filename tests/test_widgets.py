"""The control panel, driven through its methods as the widgets would (no browser)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lab.widgets import ControlPanel, control_panel, format_rules_text, parse_rules_text


@pytest.fixture(scope="module")
def panel() -> ControlPanel:
    # sd3 tiny: its trainer keeps the timestep as the rollout hands it (passthrough), and a
    # bf16 timestep visibly moves the output, so a policy toggle has a real effect to assert.
    p = control_panel("sd3", "tiny", "cpu")
    assert p.run() is not None, p.message
    return p


def _root_rel_max(panel: ControlPanel) -> float:
    return panel.last_result.summary()["model_output_rel_max"]


def test_policy_selector_changes_the_trainer_side_and_the_numbers(panel: ControlPanel) -> None:
    before = panel.last_result
    assert panel.get("trainer.input_dtype_policy.timestep") == "passthrough"
    assert panel.set("trainer.input_dtype_policy.timestep", "bf16")
    after = panel.run()
    try:
        assert after is not None, panel.message
        assert panel.message == ""
        assert after is panel.last_result and after is not before
        assert after.side_b["input_dtype_policy"]["timestep"] == "bf16"
        assert before.side_b["input_dtype_policy"]["timestep"] is None
        assert after.side_a == before.side_a, "the rollout side must not change"
        assert _root_rel_max(panel) > 0
        assert _root_rel_max(panel) != before.summary()["model_output_rel_max"]
        assert "model_output_rel_max" in panel._outputs["summary"].value
        assert panel._outputs["plot"].value[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        panel.set("trainer.input_dtype_policy.timestep", "passthrough")


def test_rerun_reuses_the_built_model(panel: ControlPanel) -> None:
    model = panel._model()
    panel.set("trainer.autocast", False)
    try:
        assert panel.run() is not None, panel.message
        assert panel._model() is model
        assert panel.last_result.side_b["autocast"] is False
    finally:
        panel.set("trainer.autocast", True)


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        ("*norm*: fp64", r"Unsupported dtype 'fp64'"),
        ("*no_such_module*: fp32", r"'\*no_such_module\*' did not match any parameter"),
        ("*norm* fp32", r"is not 'glob: dtype'"),
    ],
)
def test_bad_rule_shows_inline_message_and_keeps_last_result(
    panel: ControlPanel, rules: str, expected: str
) -> None:
    good = panel.last_result
    shown = panel._outputs["plot"].value
    panel.set("trainer.param_dtype_rules", rules)  # compiles live, like leaving the text box
    try:
        assert re.search(expected, panel.message), panel.message
        assert "lab-error" in panel._outputs["trainer.rules_table"].value
        assert panel.run() is None
        assert re.search(expected, panel.message), panel.message
        assert "Still showing the last good result" in panel._outputs["message"].value
        assert panel.last_result is good
        assert panel._outputs["plot"].value == shown
    finally:
        panel.set("trainer.param_dtype_rules", "")
    assert panel.message == ""


def test_unknown_policy_value_is_a_message_not_an_exception(panel: ControlPanel) -> None:
    good = panel.last_result
    assert not panel.set("trainer.input_dtype_policy.latents", "fp64")
    assert "unknown value 'fp64'" in panel.message and "'passthrough'" in panel.message
    assert panel.get("trainer.input_dtype_policy.latents") == "passthrough"
    assert panel.last_result is good


def test_rules_table_counts_what_each_rule_matched(panel: ControlPanel) -> None:
    panel.set("trainer.param_dtype_rules", "*norm*: fp32\n# comment\n*norm1.linear.*: bf16")
    try:
        norm, linear = panel.rule_matches["trainer"]
        assert norm.names and linear.names, "tiny sd3 has no norm parameter: vacuous"
        assert set(linear.names) <= set(norm.names)
        assert norm.effective == len(norm.names) - len(linear.names)
        assert linear.effective == len(linear.names)
        html = panel._outputs["trainer.rules_table"].value
        assert "effective" in html and str(norm.numel) in html
        assert panel.run() is not None, panel.message
        assert dict(panel.last_result.side_b["param_dtype_rules"]) == {
            "*norm*": "fp32",
            "*norm1.linear.*": "bf16",
        }
    finally:
        panel.set("trainer.param_dtype_rules", "")


def test_unknown_key_raises_with_the_known_ones(panel: ControlPanel) -> None:
    with pytest.raises(ValueError, match=r"unknown control 'trainer.latents'.*Known: family"):
        panel.set("trainer.latents", "fp32")


def test_export_writes_report_and_results(panel: ControlPanel, tmp_path: Path) -> None:
    report = panel.export(tmp_path / "export")
    assert report is not None and report.name == "report.html"
    assert "<table" in report.read_text()
    data = json.loads((tmp_path / "export" / "results.json").read_text())
    assert data["summary"]["family"] == "sd3"


def test_rules_text_round_trip_and_duplicates() -> None:
    rules = {"*norm*": "fp32", "proj_out.*": "bf16"}
    assert parse_rules_text(format_rules_text(rules)) == rules
    assert list(parse_rules_text("b: fp32\na: bf16")) == ["b", "a"], "order is meaning"
    with pytest.raises(ValueError, match=r"line 2: glob 'a' is already on line 1"):
        parse_rules_text("a: fp32\na: bf16")


def test_family_change_loads_that_familys_sides() -> None:
    p = control_panel("flux")
    p.set("family", "wan2_2")
    assert p.get("trainer.param_dtype_rules") == "*.norm2.*: fp32"
    assert p.get("trainer.input_dtype_policy.timestep") == "fp32"
    assert p.message == "", p.message
    assert p.rule_matches["trainer"][0].names

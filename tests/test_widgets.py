"""The control panel, driven through its methods as the widgets would (no browser)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

import lab
from lab.base.errors import PairError
from lab.precision.engine_ops import SWITCHES
from lab.views.widgets import (
    ControlPanel,
    control_panel,
    format_rules_text,
    nearest_rule_names,
    parse_rules_text,
)


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
        assert panel._outputs["plot"].children == (panel.plot_widget,)
        assert panel.plot_widget.spec["data"], "the figure reached the browser's widget"
        hovers = [t for trace in panel.figure.data for t in trace.text]
        assert len(hovers) == len(after.rows)
        assert any("<b>transformer_blocks.0.norm1.linear</b>" in h for h in hovers)
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
    shown = [tuple(trace.text) for trace in panel.figure.data]
    panel.set("trainer.param_dtype_rules", rules)  # compiles live, like leaving the text box
    try:
        assert re.search(expected, panel.message), panel.message
        assert "lab-error" in panel._outputs["trainer.rules_table"].value
        assert panel.run() is None
        assert re.search(expected, panel.message), panel.message
        assert "Still showing the last good result" in panel._outputs["message"].value
        assert panel.last_result is good
        assert [tuple(trace.text) for trace in panel.figure.data] == shown
        assert "failed at" in panel._outputs["status"].value
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


def test_export_writes_report_and_results(
    panel: ControlPanel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = panel.export(tmp_path / "export")
    assert report is not None and report.name == "report.html"
    assert "<table" in report.read_text()
    data = json.loads((tmp_path / "export" / "results.json").read_text())
    assert data["summary"]["family"] == "sd3"
    # Export with no folder, twice in a row: two fresh folders, neither written over.
    monkeypatch.setenv("LAB_HOME", str(tmp_path / "home"))
    folders = [panel.export().parent for _ in range(2)]
    assert folders[0] != folders[1], "the second export wrote over the first"
    for folder in folders:
        assert folder.parent == tmp_path / "home" / "runs" / "control_panel"
        assert folder.name.startswith("sd3-tiny-") and (folder / "results.json").is_file()


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


# ---- clicking a module ------------------------------------------------------------------


def _click(panel: ControlPanel, trace_index: int, point_index: int) -> None:
    """Deliver the message the browser's plot sends on a click (plotly_click -> model.send)."""
    message = {"event": "click", "curve": trace_index, "point": point_index}
    panel.plot_widget._handle_custom_msg(message, [])


def test_run_selects_the_first_divergence_and_shows_its_buffer_dtypes(panel: ControlPanel) -> None:
    result = panel.run()
    first = result.first_divergence()
    # The first block's norm (its autocast rounding point, or its modulation linear under the
    # settings earlier tests left on this module's panel); never the positional table.
    assert first is not None and first.module.startswith("transformer_blocks.0.norm1")
    assert panel.selected.label == first.label()
    assert first.module in panel._outputs["detail"].value
    # SD3's positional table: built fp32 by its class, which an engine load keeps (the real
    # engine does); FSDP2 leaves buffers alone. Both sides hold it fp32, and say why.
    detail = panel.select("pos_embed")
    tensors = detail.param_dtypes.set_index("tensor")
    assert tensors.loc["pos_embed", "kind"] == "buffer"
    assert tuple(tensors.loc["pos_embed", ["rollout dtype", "rollout set by"]]) == (
        "fp32",
        "built fp32 (an engine load keeps it)",
    )
    assert tuple(tensors.loc["pos_embed", ["trainer dtype", "trainer set by"]]) == (
        "fp32",
        "not cast",
    )
    assert tensors.loc["proj.weight", "trainer dtype"] == "fp16"


def test_click_on_a_point_shows_that_outputs_row_histogram_and_parameters(
    panel: ControlPanel,
) -> None:
    panel.set("trainer.param_dtype_rules", "*norm1.linear.*: fp32")
    try:
        result = panel.run()
        assert result is not None, panel.message
        target = "transformer_blocks.0.norm1.linear"
        row = next(r for r in result.rows if r.module == target)
        k, trace = next(
            (k, t) for k, t in enumerate(panel.figure.data) if result.rows.index(row) in t.x
        )
        _click(panel, k, list(trace.x).index(result.rows.index(row)))

        detail = panel.selected
        assert detail is not None and detail.label == row.label() == target
        assert panel._outputs["module"].value == target, "the picker follows the click"
        shown = detail.rows.iloc[0]
        assert (shown["dtype_a"], shown["dtype_b"]) == (row.dtype_a, row.dtype_b)
        assert shown["rel_max"] == row.metrics.rel_max
        assert shown["max_abs_diff"] == row.metrics.max_abs_diff
        assert list(detail.ulp_figure.data[0].y) == list(row.metrics.ulp_hist)
        params = detail.param_dtypes.set_index("tensor")
        assert list(params.index) == ["weight", "bias"]
        assert set(params["rollout dtype"]) == {"fp16"}
        assert set(params["rollout set by"]) == {"param_dtype"}
        assert set(params["trainer dtype"]) == {"fp32"}
        assert set(params["trainer set by"]) == {"*norm1.linear.*: fp32"}
        html = panel._outputs["detail"].value
        assert target in html and "*norm1.linear.*: fp32" in html
    finally:
        panel.set("trainer.param_dtype_rules", "")


def test_select_a_module_path_sums_its_outputs_and_keeps_it_across_runs(
    panel: ControlPanel,
) -> None:
    result = panel.last_result
    rows = [r for r in result.rows if r.module == "transformer_blocks.0"]
    assert len(rows) > 1, "a block has two outputs (hidden and context) on sd3 tiny"
    detail = panel.select("transformer_blocks.0")
    assert list(detail.rows["label"]) == [r.label() for r in rows]
    summed = [
        sum(r.metrics.ulp_hist[i] for r in rows) for i in range(len(rows[0].metrics.ulp_hist))
    ]
    assert list(detail.ulp_figure.data[0].y) == summed
    assert (
        len(detail.param_dtypes) > 10
        and detail.param_dtypes["tensor"].str.startswith("norm1").any()
    )
    assert panel.run() is not None, panel.message
    assert panel.selected.label == "transformer_blocks.0", "a re-run keeps the selection"


def test_module_picker_selects_like_a_click(panel: ControlPanel) -> None:
    label = panel.last_result.rows[3].label()
    panel._outputs["module"].value = label
    assert panel.selected.label == label


def test_select_unknown_module_names_the_nearest() -> None:
    p = control_panel("flux")
    with pytest.raises(ValueError, match="nothing to select yet; press Run"):
        p.select("proj_out")
    assert p.run() is not None, p.message
    with pytest.raises(ValueError, match=r"'proj_ot' is no paired output.*Nearest: 'proj_out'"):
        p.select("proj_ot")


# ---- a run that fails -------------------------------------------------------------------

_FAILING = {"trainer.autocast": False, "trainer.param_dtype_rules": "*proj_out*: fp32"}


def test_failing_run_names_side_module_and_fix_and_shows_the_partial_pairs() -> None:
    p = control_panel("flux")
    assert p.run() is not None, p.message
    good = p.last_result
    assert "ran in" in p._outputs["status"].value
    assert p.apply(_FAILING) is None and p.message == ""
    assert p.run() is None

    message = p.message
    assert message.startswith(
        "Run failed on side 'trainer' in module 'single_transformer_blocks.0.proj_out' (Linear)"
    ), message
    assert "mat1 and mat2 must have the same dtype" in message
    assert "Fix:" in message and "rule '*proj_out*: fp32'" in message
    assert "Turn autocast on for side 'trainer'" in message
    assert "err.result" not in p._outputs["message"].value
    partial = re.search(r"(\d+) pair\(s\) compared before the failure", p._outputs["message"].value)
    assert partial and int(partial.group(1)) > 0
    assert "single_transformer_blocks.0.attn" in p._outputs["message"].value, "the last pairs"
    status = p._outputs["status"].value
    assert "ran in" not in status
    assert "failed at" in status and "single_transformer_blocks.0.proj_out" in status
    assert p._outputs["progress"].bar_style == "danger"
    assert p.last_result is good

    # The fix the message gives works, and the status line says so.
    p.set("trainer.autocast", True)
    assert p.run() is not None, p.message
    assert "ran in" in p._outputs["status"].value and p.message == ""


@pytest.mark.parametrize("lockstep", [False, True])
def test_pair_error_carries_side_module_and_fix(lockstep: bool) -> None:
    fam = lab.family("flux")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    trainer = lab.Side.trainer(fam).replace(
        autocast=False, param_dtype_rules={"*proj_out*": "fp32"}
    )
    with pytest.raises(PairError) as err:
        lab.pair(model, inputs, lab.Side.rollout(fam), trainer, lockstep=lockstep)
    e = err.value
    assert (e.side, e.module, e.module_class) == (
        "trainer",
        "single_transformer_blocks.0.proj_out",
        "Linear",
    )
    assert e.fix is not None and "'*proj_out*: fp32'" in e.fix
    assert e.result is not None and len(e.result.rows) > 0
    assert "in module 'single_transformer_blocks.0.proj_out' (Linear)" in str(e)


def test_apply_prints_nothing_and_stops_at_the_first_value_not_taken() -> None:
    p = control_panel("flux")
    assert p.apply({"trainer.autocast": False}) is None
    assert p.get("trainer.autocast") is False
    p.apply({"trainer.input_dtype_policy.latents": "fp64", "trainer.autocast": True})
    assert "unknown value 'fp64'" in p.message
    assert p.get("trainer.autocast") is False, "apply stops at the first value not taken"
    with pytest.raises(RuntimeError, match="unknown value 'fp64'"):
        p.run_and_export("unused")


def test_root_detail_lists_the_ruled_parameters_first_and_sums_up_the_rest() -> None:
    p = control_panel("flux")
    p.set("trainer.param_dtype_rules", "*proj_out*: fp32")
    assert p.run() is not None, p.message
    detail = p.select("<root>")
    table = detail.param_dtypes
    ruled = table[table["trainer set by"] == "*proj_out*: fp32"]
    assert len(ruled) == 6 and set(ruled["trainer dtype"]) == {"fp32"}
    assert set(ruled["rollout dtype"]) == {"bf16"}
    html = detail.html()
    shown = re.findall(r"<td>([\w.]+\.(?:weight|bias))</td>", html)
    assert set(ruled["tensor"]) <= set(shown), "the ruled tensors come first"
    more = re.search(r"and (\d+) more at param_dtype on both sides \(bf16 x(\d+)\)", html)
    assert more and int(more.group(1)) == int(more.group(2)) == len(table) - len(shown)


def test_without_anywidget_the_plot_is_an_output_and_select_still_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ipywidgets as W

    from lab.views import widgets

    monkeypatch.setattr(widgets, "_plot_widget_class", lambda: None)
    p = control_panel("flux")
    assert isinstance(p.plot_widget, W.Output) and "lab-divergence" in p.plot_widget._dom_classes
    assert p.run() is not None, p.message
    assert p.selected.label == p.last_result.first_divergence().label()
    assert p.select("proj_out").rows["label"].tolist() == ["proj_out"]


# ---- every setting a why can name, for this family ------------------------------------------


def _norm2_why(result: lab.Result) -> str:
    return result.why("blocks.0.norm2") or ""


def test_keep_fp32_modules_toggles_the_setting_the_why_blames() -> None:
    # wan2_2 tiny, the trainer without its fp32 norm2 rule: the rollout's engine keep holds
    # norm2 in fp32 and the trainer gathers it in bf16, which the why of that row names.
    p = control_panel("wan2_2")
    assert p.get("rollout.keep_fp32_modules") == "norm1, norm2, norm3, rope"
    p.set("trainer.param_dtype_rules", "")
    assert p.run() is not None, p.message
    assert "engine fp32 keep 'norm2'" in _norm2_why(p.last_result)
    p.set("rollout.keep_fp32_modules", "norm1, norm3, rope")
    assert p.message == "", p.message
    assert p.run() is not None, p.message
    assert p.last_result.side_a["keep_fp32_modules"] == ["norm1", "norm3", "rope"]
    assert "norm2" not in _norm2_why(p.last_result)
    detail = p.select("blocks.0.norm2").param_dtypes.set_index("tensor")
    assert set(detail["rollout set by"]) == {"param_dtype"}, detail


def test_cast_buffers_is_a_control_of_both_sides() -> None:
    p = control_panel("sd3")
    assert p.get("rollout.cast_buffers") is True and p.get("trainer.cast_buffers") is False
    assert p.apply({"rollout.cast_buffers": False}) is None and p.message == ""
    assert p.sides()[0].cast_buffers is False
    assert p.run() is not None, p.message
    assert p.last_result.side_a["cast_buffers"] is False


def test_a_keep_naming_no_module_lists_the_nearest() -> None:
    p = control_panel("wan2_2")
    p.set("rollout.keep_fp32_modules", "nrom2")
    assert "rollout.keep_fp32_modules: ['nrom2'] name no module" in p.message, p.message
    assert "'nrom2': nearest 'norm2'" in p.message
    assert p.run() is None and "nearest 'norm2'" in p.message


def test_a_misspelt_glob_lists_the_globs_close_to_it_that_match() -> None:
    p = control_panel("wan2_2")
    p.set("trainer.param_dtype_rules", "*nrom2*: fp32")
    assert "'*nrom2*' did not match any parameter" in p.message
    assert "'*nrom2*': did you mean '*norm2*'?" in p.message, p.message
    assert "did you mean '*norm2*'" in html.unescape(p._outputs["trainer.rules_table"].value)


def test_nearest_rule_names_fixes_the_misspelt_piece_only() -> None:
    names = ["blocks.0.norm2.weight", "blocks.0.norm2.bias", "blocks.0.ffn.net.0.proj.weight"]
    assert nearest_rule_names("*nrom2*", names) == ["*norm2*"]
    assert nearest_rule_names("blocks.*.ffn.net.0.porj.*", names) == ["blocks.*.ffn.net.0.proj.*"]
    assert nearest_rule_names("*zzzz*", names) == []


@pytest.mark.parametrize(
    ("family_name", "groups", "switches"),
    [
        ("flux", ["flux_native"], ["timestep_from"]),
        (
            "wan2_2",
            ["sgld", "wan"],
            ["timestep_from", "wan_patchify", "rope_table_dtype", "wan_norm_path"],
        ),
        (
            "qwen_image",
            ["sgld", "qwen_image", "qwen_image_native"],
            ["timestep_from", "rope_cache_device"],
        ),
        ("ltx2", [], ["positions_dtype", "timestep_from", "ltx_rope"]),
        # The timestep switch refuses a model whose timestep it cannot adapt: not offered.
        ("minimax_h3", [], []),
        ("cosmos3", ["cosmos3_native"], []),
    ],
)
def test_only_the_engine_ops_that_apply_to_the_family_are_offered(
    family_name: str, groups: list[str], switches: list[str]
) -> None:
    p = control_panel(family_name)
    for s in ("rollout", "trainer"):
        assert list(p.controls[f"{s}.engine_ops"].options) == groups
        shown = [n for n in SWITCHES if p.controls[f"{s}.op_switches.{n}"].layout.display != "none"]
        assert shown == switches, (s, shown)
    if not groups:
        assert "no engine patch group applies" in p._outputs["trainer.no_ops"].value
    hidden = next(n for n in SWITCHES if n not in switches)
    assert not p.set(f"trainer.op_switches.{hidden}", SWITCHES[hidden].values[1])
    assert f"op switch {hidden!r}" in p.message, p.message


def test_engine_ops_follow_the_family_when_it_changes() -> None:
    p = control_panel("flux")
    p.set("family", "wan2_2")
    assert p.get("rollout.engine_ops") == ("wan",)
    assert list(p.controls["trainer.engine_ops"].options) == ["sgld", "wan"]
    assert not p.set("trainer.engine_ops", ("qwen_image",))
    assert "patch group 'qwen_image' patches" in p.message, p.message


# ---- stale results, and runs on every change -----------------------------------------------


def test_an_edit_marks_the_results_stale_until_the_next_run() -> None:
    p = control_panel("flux")
    assert p.run() is not None, p.message
    assert p.stale_keys() == [] and "lab-stale" not in p.results._dom_classes
    p.set("trainer.autocast", False)
    assert p.stale_keys() == ["trainer.autocast"]
    assert "Stale:" in p._outputs["stale"].value and "trainer.autocast" in p._outputs["stale"].value
    assert "lab-stale" in p.results._dom_classes
    assert "stale" in p._outputs["status"].value and "run 1: ran in" in p._outputs["status"].value
    p.set("metric", "max_ulp")  # how the result is shown: not a setting of the pair
    assert p.stale_keys() == ["trainer.autocast"]
    p.set("trainer.autocast", True)
    assert p.stale_keys() == [] and p._outputs["stale"].value == ""
    p.set("trainer.autocast", False)
    assert p.run() is not None, p.message
    assert p.stale_keys() == [] and "stale" not in p._outputs["status"].value
    assert "lab-stale" not in p.results._dom_classes


def test_run_on_every_change_reruns_at_once() -> None:
    p = control_panel("flux")
    assert p.run() is not None, p.message
    p.set("auto_run", True)
    runs = p.runs
    p.set("trainer.autocast", False)
    assert p.runs == runs + 1 and p.last_result.side_b["autocast"] is False
    assert p.stale_keys() == []


# ---- a pair with nothing to debug says so ---------------------------------------------------


def test_a_bit_exact_pair_says_so_in_words() -> None:
    p = control_panel("flux")
    # The trainer matched to the engine: no autocast, the scheduler's fp32 timestep.
    p.set("trainer.autocast", False)
    assert p.set("trainer.op_switches.timestep_from", "scheduler"), p.message
    assert p.run() is not None, p.message
    words = f"These sides agree bit for bit: all {len(p.last_result.rows)} paired outputs"
    assert p.verdict().startswith(words)
    summary = p._outputs["summary"].value
    assert words in summary and "lab-agree" in summary
    assert "<td data-key='first_divergent_module'>none: the sides agree bit for bit" in summary
    assert "latents: passthrough, cond: passthrough, timestep: passthrough" in summary
    assert "{" not in summary.split("input policy")[1], "the policy reads as the dropdowns do"
    annotations = [a["text"] for a in p._spec["layout"]["annotations"]]
    assert any(a.startswith(words) for a in annotations)
    p.set("trainer.autocast", True)
    assert p.run() is not None
    assert p.verdict().startswith("The sides differ: model output rel_max ")


def test_hover_in_the_panel_counts_the_modules_own_parameters() -> None:
    p = control_panel("flux")
    assert p.run() is not None, p.message
    hovers = [t for trace in p._spec["data"] for t in trace["text"]]
    to_q = next(h for h in hovers if "<b>transformer_blocks.0.attn.to_q</b>" in h)
    assert "params: bf16 x2 (ref) / bf16 x2 (cand)" in to_q and "whole model" not in to_q
    assert "block: transformer_blocks.0" in to_q


def test_the_panel_pairs_bit_for_bit_as_lab_pair_does() -> None:
    # The panel runs the tiny preset's forwards on one CPU thread: the rows must not change.
    p = control_panel("sd3")
    assert p.run() is not None, p.message
    direct = lab.pair_family("sd3")

    def rows(r: lab.Result) -> list[tuple]:
        return [
            (x.label(), x.metrics.max_abs_diff, x.metrics.mean_abs_diff, x.metrics.max_ulp)
            for x in r.rows
        ]

    assert rows(p.last_result) == rows(direct)
    assert set(p.timings) >= {"pair_s", "show_s", "total_s"}


# ---- Prescribe and Apply ---------------------------------------------------------------------


def test_prescribe_then_apply_makes_the_pair_bit_exact() -> None:
    p = control_panel("flux")
    assert p.apply_prescription() is None and "press Prescribe first" in p.message
    assert p.run() is not None and p.last_result.first_divergence() is not None
    found = p.prescribe()
    assert found is not None, p.message
    best = found.best()
    assert best is found.prescriptions[0] and best.meets
    assert best.side.autocast is False, best.labels()
    table = p._outputs["prescriptions"].value
    assert "autocast" in table and "extra parameter bytes on trainer" in table
    assert "forward time" in table
    assert p._outputs["prescription"].value == 1
    result = p.apply_prescription()
    assert result is not None, p.message
    assert p.get("trainer.autocast") is False and p.sides()[1] == best.side
    assert result.first_divergence() is None
    assert p.verdict().startswith("These sides agree bit for bit")
    assert "applied prescription 1 to side 'trainer'" in p._outputs["prescriptions"].value


def test_apply_refuses_prescriptions_for_sides_that_changed() -> None:
    p = control_panel("flux")
    assert p.prescribe() is not None, p.message
    p.set("rollout.forward_dtype", "fp16")
    assert p.apply_prescription() is None
    assert "the sides changed since Prescribe" in p.message


def test_colour_by_block_replots_without_making_the_result_stale() -> None:
    p = control_panel("flux")
    assert p.run() is not None, p.message
    assert "linear" in [t["name"] for t in p._spec["data"]]
    p.set("color_by", "block")
    names = [t["name"] for t in p._spec["data"]]
    assert "transformer_blocks.0" in names and "linear" not in names
    assert p.stale_keys() == [] and p.runs == 1
    assert "transformer_blocks.1" in p._spec["layout"]["xaxis"]["ticktext"]

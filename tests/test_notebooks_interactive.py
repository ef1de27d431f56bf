"""The interactive lab's notebooks (00, 03, 04, 05) run headless under papermill on tiny."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pandas as pd

from lab.views.notebooks import execute_notebook

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
TOY = REPO / "tests" / "data" / "sweep_toy.ipynb"


def _execute(name: str, tmp_path: Path, **parameters) -> nbformat.NotebookNode:
    import papermill as pm

    out = tmp_path / name
    # Static figures where the notebook draws any (00 and 05 declare no `interactive`).
    if "interactive" in pm.inspect_notebook(str(NOTEBOOKS / name)):
        parameters = {"interactive": False, **parameters}
    execute_notebook(str(NOTEBOOKS / name), str(out), parameters=parameters, cwd=str(tmp_path))
    return nbformat.read(out, as_version=4)


def _text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )


def test_index_lists_every_notebook(tmp_path: Path) -> None:
    nb = _execute("00_index.ipynb", tmp_path)
    index = nb.cells[0].source
    for stem in (
        "01_quickstart",
        "02_ratio_drift",
        "03_control_panel",
        "04_param_overrides",
        "05_sweep",
        "06_scenarios",
        "07_fsdp2",
    ):
        assert f"`{stem}`" in index
    assert "'flux'" in _text(nb)


def test_control_panel_headless_runs_one_pair_and_exports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    nb = _execute(
        "03_control_panel.ipynb",
        tmp_path,
        family="sd3",
        settings={"trainer.input_dtype_policy.timestep": "bf16"},
        out_dir=str(out),
    )
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["family"] == "sd3"
    assert data["side_b"]["input_dtype_policy"]["timestep"] == "bf16"
    assert data["side_a"]["input_dtype_policy"]["timestep"] is None
    assert data["summary"]["model_output_rel_max"] > 0
    assert "<table" in (out / "report.html").read_text()
    shown = [o for c in nb.cells for o in c.get("outputs", []) if "data" in o]
    assert any("application/vnd.jupyter.widget-view+json" in o["data"] for o in shown), (
        "the last cell must display the panel"
    )
    apply_cells = [c for c in nb.cells if c.source.strip() == "panel.apply(settings)"]
    assert apply_cells, "03 applies its settings in a cell of its own"
    assert all(not c.outputs for c in apply_cells), "panel.apply must not print True"
    noise = [o["text"] for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stderr"]
    assert not noise, noise


def test_param_overrides_table_and_effect(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rules = {"*norm*": "fp32", "*ffn*": "fp32"}
    nb = _execute(
        "04_param_overrides.ipynb", tmp_path, family="wan2_2", rules=rules, out_dir=str(out)
    )
    text = _text(nb)
    assert "*norm*" in text and "effective" in text, "the rule table is shown"
    with_rules = json.loads((out / "results.json").read_text())
    without = json.loads((out / "without_rules.json").read_text())
    assert with_rules["side_b"]["param_dtype_rules"] == rules
    assert without["side_b"]["param_dtype_rules"] == {}
    # The rules must reach the weights: the trainer holds more fp32 parameters with them.
    fp32_with = with_rules["meta"]["param_dtypes_b"].get("fp32", 0)
    fp32_without = without["meta"]["param_dtypes_b"].get("fp32", 0)
    assert fp32_with > fp32_without, (with_rules["meta"]["param_dtypes_b"], fp32_without)
    assert (out / "overlay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report.html").stat().st_size > 10_000


def test_sweep_notebook_runs_a_grid_and_plots_the_table(tmp_path: Path) -> None:
    # The toy notebook builds no model: this checks the notebook's sweep, table and plot
    # cells; tests/test_sweep.py runs the real quickstart grid.
    out = tmp_path / "sweep"
    nb = _execute(
        "05_sweep.ipynb",
        tmp_path,
        notebook=str(TOY),
        grid={"x": [1, 2]},
        parameters={},
        out_dir=str(out),
    )
    table = pd.read_csv(out / "sweep.csv")
    assert list(table["status"]) == ["ok", "failed"]
    assert "1/2 runs ok" in _text(nb)
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the sweep plot is shown"

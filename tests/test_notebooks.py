"""Every notebook runs headless under papermill on the tiny preset and writes its results."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from lab.families import FAMILY_NAMES

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _execute(notebook: str, tmp_path: Path, **parameters) -> Path:
    import papermill as pm

    out = tmp_path / notebook
    pm.execute_notebook(
        str(NOTEBOOKS / notebook),
        str(out),
        parameters=parameters,
        kernel_name="python3",
        progress_bar=False,
        cwd=str(tmp_path),
    )
    return out


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_thin_parameterized_and_stripped(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs, "committed with outputs"
            assert cell.execution_count is None
            assert "def " not in cell.source and "class " not in cell.source, (
                "notebook logic belongs in lab/"
            )


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_quickstart_runs_for_every_family(family_name: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    _execute(
        "01_quickstart.ipynb", tmp_path, family=family_name, preset="tiny", out_dir=str(out_dir)
    )
    data = json.loads((out_dir / "results.json").read_text())
    assert data["summary"]["family"] == family_name
    assert data["summary"]["pairs"] > 20
    assert data["side_a"]["name"] == "rollout" and data["side_b"]["name"] == "trainer"
    assert data["summary"]["model_output_rel_max"] >= 0
    png = out_dir / "divergence_by_layer.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quickstart_side_overrides_reach_the_sides(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    _execute(
        "01_quickstart.ipynb",
        tmp_path,
        family="sd3",
        out_dir=str(out_dir),
        trainer_overrides={
            "autocast": False,
            "forward_dtype": "fp16",
            "param_dtype": "fp16",
            "rollout_precision": "fp16",
        },
        rollout_overrides={"attention_backend": "math"},
    )
    data = json.loads((out_dir / "results.json").read_text())
    assert data["side_b"]["autocast"] is False
    assert data["side_a"]["attention_backend"] == "math"


def test_quickstart_interactive_shows_the_plotly_figure(tmp_path: Path) -> None:
    out = _execute(
        "01_quickstart.ipynb",
        tmp_path,
        family="flux",
        interactive=True,
        out_dir=str(tmp_path / "out"),
    )
    nb = nbformat.read(out, as_version=4)
    last = nb.cells[-1]
    assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for o in last.outputs), (
        "interactive=True should display the plotly figure"
    )

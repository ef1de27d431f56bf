from __future__ import annotations

import ast
import dataclasses
import html
import re
from pathlib import Path

import pandas as pd
import pytest

import lab
from lab import report
from lab.baselines import compare_to_baseline
from lab.result import Result, Skipped

FP16_TRAINER = {"forward_dtype": "fp16", "rollout_precision": "fp16", "param_dtype": "fp16"}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> Result:
    # Through JSON: the report must need nothing but a saved result.json.
    path = tmp_path_factory.mktemp("run") / "result.json"
    return Result.from_json(lab.pair_family("flux").to_json(path))


@pytest.fixture(scope="module")
def fp16_result() -> Result:
    return lab.pair_family("flux", trainer=FP16_TRAINER)


def _referenced_files(text: str) -> list[str]:
    # Outside <script>: plotly.js itself holds a link to plotly.com in a string.
    markup = re.sub(r"<script.*?</script>", "", text, flags=re.S)
    refs = re.findall(r'(?:src|href)="([^"#][^"]*)"', markup)
    return [r for r in refs if not r.startswith(("data:", "javascript:"))]


def _assert_offline(text: str) -> None:
    assert not re.search(r"<script[^>]*\bsrc=", text), "a <script src=...> needs the network"
    assert '<script src="http' not in text
    assert not re.search(r"<link[^>]*href=[\"']?https?:", text)
    assert not re.search(r"@import\s+url", text)


def test_single_report_is_self_contained_and_complete(result: Result, tmp_path: Path) -> None:
    path = report.write_html(result, tmp_path / "out" / "report.html")
    text = path.read_text()

    _assert_offline(text)
    assert "Plotly.newPlot" in text and "plotly.js v" in text[: text.index("</head>")]
    # Every paired output is a row of the per-module table.
    table = text[text.index('id="modules-0"') :]
    for row in result.rows:
        assert f"<td>{html.escape(row.module)}</td>" in table
    assert table.count("<tr") == len(result.rows) + 1
    # Summary numbers, as the summary table prints them.
    s = result.summary()
    assert f">{s['pairs']}<" in text and f">{s['bitexact_pairs']}<" in text
    assert f"{s['model_output_rel_max']:.4g}" in text
    assert s["first_divergent_module"] in text
    # Both sides' settings, with differences highlighted and the resolved autocast policy.
    a, b = result.side_a, result.side_b
    differ = [k for k in a if a[k] != b[k]]
    same = [k for k in a if a[k] == b[k]]
    assert differ and same, "the two presets should differ in some fields and agree in others"
    for key in differ:
        assert f'<tr class="diff"><td>{key}</td>' in text
    for key in same:
        assert f"<tr><td>{key}</td>" in text
    policy_a, policy_b = result.meta["autocast_policy_a"], result.meta["autocast_policy_b"]
    assert policy_a != policy_b
    assert re.search(
        rf'<tr class="diff"><td>autocast policy \(resolved\)</td><td>{policy_a or "—"}</td>'
        rf"<td>{policy_b or '—'}</td>",
        text,
    )
    assert "None: every captured output was paired" in text
    # The PNGs beside it exist, referenced relatively.
    refs = _referenced_files(text)
    assert any(r.endswith(".png") for r in refs)
    for ref in refs:
        assert not Path(ref).is_absolute() and (path.parent / ref).is_file(), ref
    assert (tmp_path / "out" / "report_files" / "run0_divergence.png").stat().st_size > 1000


def test_several_results_and_a_baseline_in_one_report(
    result: Result, fp16_result: Result, tmp_path: Path
) -> None:
    cmp = compare_to_baseline(fp16_result, result)
    path = report.write_html(
        {"bf16 trainer": result, "fp16 trainer": fp16_result}, tmp_path / "r.html", comparison=cmp
    )
    text = path.read_text()

    _assert_offline(text)
    assert 'id="run-0"' in text and 'id="run-1"' in text and 'id="overview"' in text
    assert "Overlay: rel_max across depth" in text
    assert '<span class="bad">REGRESSED' in text
    assert '<tr class="worse"><td>x_embedder</td>' in text
    for name in ("overlay.png", "baseline_overlay.png", "run1_ulp_histogram.png"):
        assert f"r_files/{name}" in text and (tmp_path / "r_files" / name).is_file()
    for ref in _referenced_files(text):
        assert (tmp_path / ref).is_file(), ref
    assert text.count("plotly.js v") == 1, "plotly.js should be inlined once, not per figure"


class _DuckTrajectory:
    """Anything with per_step(): the report must not need lab.trajectory."""

    def per_step(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "step": [0, 1, 2],
                "in_window": [True, True, False],
                "ratio_p01": [0.999, 0.998, 1.0],
                "ratio_p50": [1.0001, 1.0002, 1.0],
                "ratio_p99": [1.001, 1.002, 1.0],
                "velocity_gap_rms": [1.5e-3, 2.5e-3, 0.0],
            }
        )


def test_skipped_pairs_and_a_duck_typed_trajectory(result: Result, tmp_path: Path) -> None:
    skipped = dataclasses.replace(
        result, skipped=[Skipped("blocks.9", 0, "1", "non-tensor output: tuple of None")]
    )
    path = report.write_html(
        skipped, tmp_path / "r.html", trajectories={"drift": _DuckTrajectory()}, static=False
    )
    text = path.read_text()

    assert "Skipped pairs (1)" in text and "non-tensor output: tuple of None" in text
    assert 'id="trajectory-0"' in text and "Ratio drift per step" in text
    assert "2.5e-03" in text or "0.0025" in text
    assert not (tmp_path / "r_files").exists(), "static=False must not write PNGs"
    _assert_offline(text)


def test_write_html_rejects_what_is_not_a_result(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no Result given"):
        report.write_html([], tmp_path / "r.html")
    with pytest.raises(ValueError, match=r"\['x'\] are not Results"):
        report.write_html({"x": {"rows": []}}, tmp_path / "r.html")


@pytest.mark.parametrize("module", ["plots", "report", "baselines"])
def test_figures_and_reports_never_import_run(module: str) -> None:
    source = Path(lab.__file__).with_name(f"{module}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {"lab.run", "lab.widgets", "lab.trajectory"} & imported

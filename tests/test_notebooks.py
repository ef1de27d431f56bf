"""Every notebook runs headless under papermill on tiny, with its defaults and on every family.

Each executed notebook must show its figures as outputs (a PNG or plotly figure), carry no
stderr or warning output, and write the results its parameters cell promises.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest

import lab
from lab.families import FAMILY_NAMES
from lab.views.notebooks import KERNEL_START_TIMEOUT_S, execute_notebook, papermill_main
from lab.views.parameters import json_parameter
from lab.views.plots import PLOTLY_MIME

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
PNG = b"\x89PNG\r\n\x1a\n"


def _parameters_cell(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    return next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))


def _defaults(path: Path) -> dict[str, Any]:
    """name -> default value of every assignment in the parameters cell."""
    tree = ast.parse(_parameters_cell(path).source)
    return {
        node.target.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.AnnAssign)
    }


def _execute(name: str, cwd: Path, **parameters: Any) -> nbformat.NotebookNode:
    out = cwd / f"executed_{name}"
    execute_notebook(NOTEBOOKS / name, out, parameters, cwd=cwd)
    return nbformat.read(out, as_version=4)


def _written_to(nb: nbformat.NotebookNode) -> Path:
    """The folder the notebook says it writes (`lab.runs.run_folder`'s cell prints it)."""
    found = re.findall(r"^writing to (.+)$", _text(nb), re.M)
    assert len(found) == 1, f"the notebook does not say where it writes: {found}"
    return Path(found[0])


def _outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def _text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in _outputs(nb)
    )


def _check_clean_with_figures(nb: nbformat.NotebookNode, *, figures: bool = True) -> None:
    """No stderr, no warning, no error output; at least one figure shown when `figures`."""
    for o in _outputs(nb):
        assert o.get("name") != "stderr", f"stderr output: {o.get('text', '')[:500]}"
        assert o.get("output_type") != "error", f"{o.get('ename')}: {o.get('evalue')}"
        assert "Warning" not in str(o.get("text", "")), o.get("text")
    shown = [o for o in _outputs(nb) if {"image/png", PLOTLY_MIME} & set(o.get("data", {}))]
    if figures:
        assert shown, "no figure among the outputs (image/png or plotly)"


# ---- the committed notebooks ----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
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


def test_the_index_lists_every_notebook() -> None:
    index = nbformat.read(NOTEBOOKS / "00_index.ipynb", as_version=4).cells[0].source
    for path in PATHS[1:]:
        assert f"`{path.stem}`" in index, path.stem


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_every_parameter_parses_and_is_listed_with_its_help(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from click.testing import CliRunner
    from papermill.cli import papermill as papermill_cli

    names = list(_defaults(path))
    assert names, "the parameters cell assigns nothing"
    with caplog.at_level(logging.WARNING):
        done = CliRunner().invoke(papermill_cli, ["--help-notebook", str(path)])
    assert done.exit_code == 0, done.output
    assert "Unable to parse" not in caplog.text + done.output, caplog.text
    for name in names:
        match = re.search(rf"^  {name}: \w+ \(default .*?\)\s+(\S.*)$", done.output, re.M)
        assert match, f"{name} is not listed by papermill --help-notebook:\n{done.output}"
        assert len(match.group(1)) > 5, f"{name} has no help text"


def test_a_parameter_name_means_one_thing_in_every_notebook() -> None:
    """`interactive` meant "plotly, not matplotlib" in 01/04/08/09 and "run and export a pair"
    in 03: a name a sweep sets across notebooks must mean one thing in all of them."""
    import papermill as pm

    declared: dict[str, dict[tuple[str, str], list[str]]] = {}
    for path in PATHS:
        for name, spec in pm.inspect_notebook(str(path)).items():
            meaning = (spec["inferred_type_name"], spec["help"])
            declared.setdefault(name, {}).setdefault(meaning, []).append(path.stem)
    interactive = declared["interactive"]
    assert len(interactive) == 1, interactive
    assert "plotly" in next(iter(interactive))[1]
    assert "run_and_export" in _defaults(NOTEBOOKS / "03_control_panel.ipynb")


# ---- dict and list parameters as JSON text (papermill -p) -----------------------------------


def test_json_parameter_reads_text_and_refuses_bad_values_naming_them() -> None:
    assert json_parameter("t", '{"autocast": false}', dict) == {"autocast": False}
    assert json_parameter("w", "[0, 4]", list) == [0, 4]
    assert json_parameter("w", (0, 4), list) == [0, 4]
    assert json_parameter("t", {"a": 1}, dict) == {"a": 1}
    assert json_parameter("t", "", dict) == {} and json_parameter("w", None, list) == []
    with pytest.raises(ValueError, match=r"parameter 't': .*write it as '\{\"autocast\": false\}'"):
        json_parameter("t", "{'autocast': False}", dict)
    with pytest.raises(ValueError, match=r"parameter 'w': '\[0, 4' is not valid JSON"):
        json_parameter("w", "[0, 4", list)
    with pytest.raises(ValueError, match="is JSON dict, expected a JSON array"):
        json_parameter("w", '{"a": 1}', list)
    with pytest.raises(ValueError, match="expected a JSON object, got int 3"):
        json_parameter("t", 3, dict)


def test_overrides_given_as_json_text_reach_the_sides(tmp_path: Path) -> None:
    # What `papermill -p trainer_overrides '{"autocast": false}'` injects: a string.
    out = tmp_path / "out"
    _execute(
        "01_quickstart.ipynb",
        tmp_path,
        trainer_overrides='{"autocast": false, "op_switches": {"timestep_from": "scheduler"}}',
        rollout_overrides="{}",
        interactive=False,
        out_dir=str(out),
    )
    data = json.loads((out / "results.json").read_text())
    assert data["side_b"]["autocast"] is False
    # tiny flux: the trainer matched to the engine (no autocast, the scheduler's fp32
    # timestep) matches the engine-like rollout bit for bit.
    assert data["summary"]["model_output_rel_max"] == 0
    import papermill as pm

    with pytest.raises(pm.PapermillExecutionError, match="trainer_overrides") as err:
        _execute("01_quickstart.ipynb", tmp_path, trainer_overrides="{'autocast': False}")
    assert '{"autocast": false}' in str(err.value), "the fix is the JSON spelling"


def test_two_runs_with_default_folders_leave_two_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: 02 with `-p family wan2_2`, then with `-p family ltx2`, both wrote
    runs/ratio_drift/, and the first results.json was replaced without a word."""
    monkeypatch.delenv("LAB_HOME", raising=False)  # the working directory is the lab home
    for family in ("wan2_2", "ltx2"):
        _execute("02_ratio_drift.ipynb", tmp_path, family=family, steps=2, samples=1,
                 interactive=False)  # fmt: skip
    saved = sorted((tmp_path / "runs" / "ratio_drift").glob("*/results.json"))
    assert [p.parent.name.split("-tiny-")[0] for p in saved] == ["ltx2", "wan2_2"], saved
    assert [json.loads(p.read_text())["meta"]["family"] for p in saved] == ["ltx2", "wan2_2"]


def test_a_named_folder_holding_a_run_is_refused_and_overwrite_replaces_it(
    tmp_path: Path,
) -> None:
    import papermill as pm

    out = tmp_path / "mine"
    _execute("01_quickstart.ipynb", tmp_path, out_dir=str(out), interactive=False)
    assert json.loads((out / "results.json").read_text())["summary"]["family"] == "flux"
    # The same folder again: refused before any pair runs, naming what it holds and the fix.
    with pytest.raises(pm.PapermillExecutionError, match="already holds a run's results") as err:
        _execute("01_quickstart.ipynb", tmp_path, out_dir=str(out), family="sd3")
    assert "results.json" in str(err.value) and "-p overwrite true" in str(err.value)
    assert json.loads((out / "results.json").read_text())["summary"]["family"] == "flux"
    _execute(
        "01_quickstart.ipynb", tmp_path, out_dir=str(out), family="sd3", overwrite=True,
        interactive=False,
    )  # fmt: skip
    assert json.loads((out / "results.json").read_text())["summary"]["family"] == "sd3"


@pytest.mark.slow
def test_the_quickstart_script_writes_a_fresh_folder_each_run_and_says_where(
    tmp_path: Path,
) -> None:
    import os

    env = {**os.environ, "LAB_HOME": str(tmp_path)}
    runs = []
    for family in ("flux", "sd3"):
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "quickstart.sh"), "-p", "family", family],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        runs.append(re.search(r"^wrote (\S+)/results\.json", done.stdout, re.M).group(1))
    assert [Path(r).parent for r in runs] == [tmp_path / "runs" / "quickstart"] * 2
    assert Path(runs[0]).name.startswith("flux-tiny-propagated-")
    assert Path(runs[1]).name.startswith("sd3-tiny-propagated-")
    for run in runs:
        assert {"01_quickstart.ipynb", "results.json"} <= {p.name for p in Path(run).iterdir()}
    again = subprocess.run(
        ["bash", str(REPO / "scripts" / "quickstart.sh")],
        capture_output=True, text=True, timeout=600, env={**env, "OUT_DIR": runs[0]},
    )  # fmt: skip
    assert again.returncode != 0 and "already holds a run's results" in again.stderr


@pytest.mark.slow
def test_headless_runs_start_the_kernel_without_the_tcp_warning(tmp_path: Path) -> None:
    def run(module: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", module, str(NOTEBOOKS / "00_index.ipynb"),
             str(tmp_path / f"{module}.ipynb"), "-p", "root", str(tmp_path), "--no-progress-bar"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )  # fmt: skip

    plain = run("papermill")
    assert plain.returncode == 0, plain.stderr
    # Guards the check below: plain papermill does start its kernel over unencrypted TCP.
    assert "without encryption" in plain.stderr
    ours = run("lab.views.notebooks")
    assert ours.returncode == 0, ours.stderr
    assert "without encryption" not in ours.stderr
    assert "WARNING" not in ours.stderr, ours.stderr


# ---- every notebook with its defaults, and on every family ----------------------------------

# Runs the real engine (the `engine` extra): tests/test_engine_sglang.py runs it, marked `engine`.
ENGINE_NOTEBOOKS = {"12_real_engine.ipynb"}
FAMILY_NOTEBOOKS = [
    p.name for p in PATHS if "family" in _defaults(p) and p.name not in ENGINE_NOTEBOOKS
]
CASES = [(name, fam) for name in FAMILY_NOTEBOOKS for fam in FAMILY_NAMES] + [
    (p.name, None) for p in PATHS if p.name not in {*FAMILY_NOTEBOOKS, *ENGINE_NOTEBOOKS}
]
# Run headless by other default tests with their own parameters: 03, 04 and 05 in
# test_notebooks_interactive.py, 06 in test_scenarios.py.
RUN_ELSEWHERE = {"03_control_panel.ipynb", "04_param_overrides.ipynb", "05_sweep.ipynb",
                 "06_scenarios.ipynb"}  # fmt: skip


def _case(name: str, family: str | None) -> Any:
    """Each notebook once with its own defaults in the default run; every other family, and
    the notebooks run elsewhere, under `slow`."""
    own = family in (None, _defaults(NOTEBOOKS / name).get("family"))
    slow = not own or name in RUN_ELSEWHERE
    return pytest.param(
        name, family, id=f"{name.split('_')[0]}-{family or 'defaults'}",
        marks=pytest.mark.slow if slow else (),
    )  # fmt: skip


def _check_01(out: Path, family: str, nb: Any) -> None:
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["family"] == family
    assert data["summary"]["pairs"] > 20
    assert data["side_a"]["name"] == "rollout" and data["side_b"]["name"] == "trainer"
    assert data["summary"]["model_output_rel_max"] >= 0
    assert (out / "divergence_by_layer.png").read_bytes()[:8] == PNG
    # interactive=True by default: the figure is plotly (hover), with a static fallback
    # (a PNG or HTML) beside it for viewers without the plotly renderer.
    shown = [o["data"] for o in _outputs(nb) if PLOTLY_MIME in o.get("data", {})]
    assert shown and all({"image/png", "text/html"} & set(d) for d in shown)


def _check_02(out: Path, family: str, nb: Any) -> None:
    data = json.loads((out / "results.json").read_text())
    defaults = _defaults(NOTEBOOKS / "02_ratio_drift.ipynb")
    assert data["meta"]["family"] == family
    assert data["overall"]["samples"] == defaults["steps"] * defaults["samples"]
    for name in ("ratio_drift.png", "ratio_hist.png", "logprob_vs_velocity_gap.png"):
        assert (out / name).read_bytes()[:8] == PNG, name


def _check_03(out: Path, family: str, nb: Any) -> None:
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["family"] == family
    # The verdict in words: a pair with nothing to debug says so.
    exact = data["summary"]["bitexact_pairs"] == data["summary"]["pairs"]
    verdict = "These sides agree bit for bit" if exact else "The sides differ"
    assert verdict in _text(nb) or "The model outputs agree bit for bit" in _text(nb)
    assert "<table" in (out / "report.html").read_text()
    assert (out / "divergence_by_layer.png").read_bytes()[:8] == PNG


def _check_04(out: Path, family: str, nb: Any) -> None:
    with_rules = json.loads((out / "results.json").read_text())
    without = json.loads((out / "without_rules.json").read_text())
    effect = json.loads((out / "rule_effect.json").read_text())
    suggestions = dict(lab.family(family).fp32_rule_suggestions)
    assert suggestions, f"{family} suggests no fp32 rules"
    assert with_rules["side_b"]["param_dtype_rules"] == suggestions
    assert without["side_b"]["param_dtype_rules"] == {}
    before = without["summary"]["model_output_rel_max"]
    after = with_rules["summary"]["model_output_rel_max"]
    expected = "lowered" if after < before else "raised" if after > before else "unchanged"
    assert effect["verdict"] == expected
    assert effect["pinned_params"], "the suggestions pin no parameter"
    text = _text(nb)
    assert f"The rules {expected}" in text or (expected == "unchanged" and "unchanged" in text)
    if not effect["params_dtype_differs_without"]:
        assert "does not come from parameters" in text
    else:
        assert "comes from parameters" in text
    assert (out / "overlay.png").read_bytes()[:8] == PNG
    assert (out / "report.html").stat().st_size > 10_000


def _check_05(out: Path, family: str | None, nb: Any) -> None:
    table = (out / "sweep.csv").read_text().splitlines()
    assert len(table) == 3 and all(",ok," in row for row in table[1:]), table


def _check_06(out: Path, family: str | None, nb: Any) -> None:
    rows = json.loads((out / "scenarios.json").read_text())
    assert rows and all(r["culprit_matches"] for r in rows), rows
    assert (out / "bug_vs_fixed.png").read_bytes()[:8] == PNG


def _check_07(out: Path, family: str, nb: Any) -> None:
    fsdp = json.loads((out / "results.json").read_text())
    emulated = json.loads((out / "in_process.json").read_text())
    assert fsdp["summary"]["family"] == family
    # Real FSDP2 equals the in-process emulation bitwise (README "The real FSDP2 trainer side").
    keys = ("module", "call", "output", "max_abs_diff", "max_ulp", "dtype_a", "dtype_b")
    assert [[r[k] for k in keys] for r in fsdp["rows"]] == [
        [r[k] for k in keys] for r in emulated["rows"]
    ]
    assert json.loads((out / "gradients.json").read_text())
    assert (out / "emulation_vs_fsdp2.png").read_bytes()[:8] == PNG


def _check_09(out: Path, family: str | None, nb: Any) -> None:
    assert (out / "overlay.png").read_bytes()[:8] == PNG
    # The fresh folder held no runs: the two examples were saved and compared.
    assert "side_b.autocast,True,False" in (out / "settings_diff.csv").read_text()
    assert "OK (0 worse" in _text(nb)
    assert (out / "report.html").stat().st_size > 10_000


def _check_08(out: Path, family: str, nb: Any) -> None:
    from lab.causes.attribute import Attribution
    from lab.causes.checks import CheckResult

    attr = Attribution.from_json(out / "attribution.json")
    table = attr.table()
    assert attr.meta["family"] == family and len(table) >= 3
    if not attr.identical:
        # Shares of every unit plus what no graft removes add up to the whole divergence.
        assert abs(table["share"].sum() + attr.residual - 1.0) < 1e-6
    for name in ("batch_invariance", "cfg_batching", "sigma_parity", "weight_sync"):
        result = CheckResult.from_json(out / f"{name}.json")
        assert result.verdict and (out / f"{name}.png").read_bytes()[:8] == PNG
    sync = CheckResult.from_json(out / "weight_sync.json").table()
    # The engine's load rounds or keeps every tensor of the master: nothing missing or extra.
    assert set(sync["status"]) <= {"rounded", "equal"}
    for png in ("attribution.png", "noise_floor.png"):
        assert (out / png).read_bytes()[:8] == PNG
    assert "noise floor" in _text(nb)


def _check_10(out: Path, family: str, nb: Any) -> None:
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["family"] == family
    # Both sides ran as 2-rank FSDP2 jobs, each rank holding its rows only; block-level rows.
    for key in ("fsdp2_a", "fsdp2_b"):
        assert data["meta"][key]["world_size"] == 2 and data["meta"][key]["backend"] == "gloo"
    assert data["meta"]["capture_depth"] == 1
    assert len(data["rows"]) >= 10 and "<root>" in {r["module"] for r in data["rows"]}
    # The same table as the in-process pair at block level, bit for bit.
    in_process = lab.pair_family(family, "tiny", capture_depth=1).to_dict()
    keys = ("module", "call", "output", "max_abs_diff", "max_ulp", "dtype_a", "dtype_b")
    assert [[r[k] for k in keys] for r in data["rows"]] == [
        [r[k] for k in keys] for r in in_process["rows"]
    ]
    assert (out / "divergence_by_layer.png").read_bytes()[:8] == PNG
    assert "build_s" in _text(nb) and "forward_s" in _text(nb)  # the ranks' table


def _check_11(out: Path, family: str, nb: Any) -> None:
    found = json.loads((out / "prescriptions.json").read_text())
    assert found["schema"] == "precision-lab/prescriptions/1"
    assert found["meta"]["family"] == family
    if not found["meta"]["baseline_meets"]:
        # Every prescription returned was verified by a pair; the best meets the target.
        best = found["prescriptions"][0]
        assert best["meets"] and best["summary"]["family"] == family
    doc = json.loads((out / "contract.json").read_text())
    assert doc["schema"] == "precision-lab/contract/1" and doc["model"]["family"] == family
    from lab.views.contract import check

    assert check(out / "contract.json").holds
    for png in ("knob_shares.png", "before_after.png"):
        assert (out / png).read_bytes()[:8] == PNG
    assert (
        "explains" in _text(nb) or "agree bit for bit" in _text(nb) or "change nothing" in _text(nb)
    )


CHECKS = {
    "01": _check_01, "02": _check_02, "03": _check_03, "04": _check_04, "05": _check_05,
    "06": _check_06, "07": _check_07, "08": _check_08, "09": _check_09, "10": _check_10,
    "11": _check_11,
}  # fmt: skip


@pytest.mark.parametrize(("name", "family"), [_case(n, f) for n, f in CASES])
def test_notebook_runs_with_its_defaults(
    name: str, family: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defaults only: the family is passed only when it is not the notebook's own default."""
    monkeypatch.setenv("LAB_HOME", str(tmp_path))  # the kernel's runs/ and baselines/
    defaults = _defaults(NOTEBOOKS / name)
    params = {} if family in (None, defaults.get("family")) else {"family": family}
    nb = _execute(name, tmp_path, **params)
    _check_clean_with_figures(nb, figures=name != "00_index.ipynb")
    check = CHECKS.get(name.split("_")[0])
    if check is not None:
        # Each run writes a fresh folder of its own under runs/ of the lab home, and says so.
        if name == "05_sweep.ipynb":
            (out,) = (tmp_path / "runs" / "sweep").iterdir()
        else:
            out = _written_to(nb)
        assert defaults["out_dir"] == "" and out.parent.parent == tmp_path / "runs", out
        check(out, family or defaults.get("family"), nb)
    if name == "00_index.ipynb":
        assert "'flux'" in _text(nb), "the index lists the families"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [([], KERNEL_START_TIMEOUT_S), (["--start-timeout", "5"], 5), (["--start_timeout=7"], 7)],
)
def test_papermill_command_line_gives_kernels_the_lab_start_timeout(
    extra: list[str], expected: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import papermill.cli

    seen: dict[str, Any] = {}
    monkeypatch.setattr(papermill.cli, "execute_notebook", lambda *a, **kw: seen.update(kw))
    notebook = NOTEBOOKS / "01_quickstart.ipynb"
    code = papermill_main([str(notebook), str(tmp_path / "out.ipynb"), *extra])
    assert code == 0 and seen["start_timeout"] == expected


def test_papermill_command_line_makes_the_output_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """papermill refuses an output path whose folder is missing; the lab's command line and
    `execute_notebook` make it (`-`, stdout, and URLs are left alone)."""
    import papermill
    import papermill.cli

    seen: list[str] = []
    monkeypatch.setattr(
        papermill.cli, "execute_notebook", lambda **kw: seen.append(kw["output_path"])
    )
    notebook = NOTEBOOKS / "01_quickstart.ipynb"
    out = tmp_path / "runs" / "deep" / "out.ipynb"
    assert papermill_main([str(notebook), str(out), "-p", "family", "flux"]) == 0
    assert seen == [str(out)] and out.parent.is_dir()
    assert papermill_main([str(notebook), "-", "-p", "family", "flux"]) == 0
    assert not (tmp_path / "-").exists() and seen[-1] == "-"
    # papermill fills {name} from the parameters: the filled-in folder is made, not "{family}".
    templated = str(tmp_path / "by" / "{family}" / "out.ipynb")
    assert papermill_main([str(notebook), templated, "-p", "family", "sd3"]) == 0
    assert (tmp_path / "by" / "sd3").is_dir() and not (tmp_path / "by" / "{family}").exists()
    # A command line papermill cannot parse is left to papermill to refuse.
    assert papermill_main(["--no-such-option"]) != 0
    monkeypatch.setattr(papermill, "execute_notebook", lambda nb, out, **kw: seen.append(out))
    nested = tmp_path / "api" / "out.ipynb"
    execute_notebook(notebook, nested, {"family": "flux"})
    assert seen[-1] == str(nested) and nested.parent.is_dir()
    execute_notebook(notebook, tmp_path / "api" / "{family}" / "o.ipynb", {"family": "wan2_2"})
    assert (tmp_path / "api" / "wan2_2").is_dir()


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """papermill's executions recorded (their keyword arguments) instead of run."""
    import papermill
    import papermill.cli

    calls: list[Any] = []
    monkeypatch.setattr(papermill.cli, "execute_notebook", lambda **kw: calls.append(kw))
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **kw: calls.append(kw))
    return calls


def test_a_parameter_the_notebook_does_not_declare_is_refused_before_a_kernel_starts(
    tmp_path: Path, ran: list[Any], capsys: pytest.CaptureFixture
) -> None:
    """papermill only warns and runs the defaults: `-p famliy sd3` was a flux run."""
    notebook = NOTEBOOKS / "01_quickstart.ipynb"
    out = tmp_path / "out.ipynb"
    assert papermill_main([str(notebook), str(out), "-p", "famliy", "sd3"]) == 2
    err = capsys.readouterr().err
    assert "['famliy'] are not parameters of 01_quickstart.ipynb" in err
    assert "Did you mean 'family' for 'famliy'?" in err
    assert papermill_main([str(notebook), str(out), "-r", "sigmaa", "0.5"]) == 2
    assert papermill_main([str(notebook), str(out), "-y", "{seeed: 1}"]) == 2
    params = tmp_path / "params.yaml"
    params.write_text("presett: tiny\n")
    assert papermill_main([str(notebook), str(out), "-f", str(params)]) == 2
    assert "['presett']" in capsys.readouterr().err
    assert ran == [], "nothing ran"
    with pytest.raises(ValueError, match=r"execute_notebook: \['mdoe'\] .*'mode'"):
        execute_notebook(notebook, out, {"mdoe": "local"})
    assert ran == []
    # Declared names run; a notebook without a parameters cell takes any, as papermill lets it.
    assert (
        papermill_main([str(notebook), str(out), "-p", "family", "sd3", "-r", "sigma", "0.5"]) == 0
    )
    bare = tmp_path / "bare.ipynb"
    bare.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    execute_notebook(bare, out, {"anything": 1})
    assert len(ran) == 2


def test_a_value_the_declared_type_does_not_take_is_refused_and_true_false_are_booleans(
    tmp_path: Path, ran: list[Any], capsys: pytest.CaptureFixture
) -> None:
    """`-p interactive false` was the text "false", which `if interactive:` took as True."""
    notebook = NOTEBOOKS / "01_quickstart.ipynb"
    out = tmp_path / "out.ipynb"
    assert papermill_main([str(notebook), str(out), "-p", "interactive", "maybe"]) == 2
    err = capsys.readouterr().err
    assert "'interactive' (declared bool) must be True or False, got 'maybe' (str). Pass" in err
    assert papermill_main([str(notebook), str(out), "-p", "seed", "abc"]) == 2
    err = capsys.readouterr().err
    assert "'seed' (declared int) must be an int, got 'abc' (str). Pass an int." in err
    assert papermill_main([str(notebook), str(out), "-p", "sigma", "1e"]) == 2
    assert ran == [], "nothing ran"
    # Any case of true/false is papermill's True/False; an int is a float's number.
    for text, want in (("false", False), ("TRUE", True), ("False", False)):
        assert papermill_main([str(notebook), str(out), "-p", "interactive", text]) == 0
        assert ran[-1]["parameters"]["interactive"] is want
    assert papermill_main([str(notebook), str(out), "-p", "sigma", "1", "-p", "seed", "3"]) == 0
    assert ran[-1]["parameters"]["sigma"] == 1 and ran[-1]["parameters"]["seed"] == 3
    with pytest.raises(ValueError, match=r"'seed' \(declared int\) must be an int, got 2\.5"):
        execute_notebook(notebook, out, {"seed": 2.5})
    with pytest.raises(
        ValueError, match=r"'interactive' \(declared bool\) must be True or False, got 1"
    ):
        execute_notebook(notebook, out, {"interactive": 1})
    with pytest.raises(ValueError, match=r"'family' \(declared str\) must be a str, got 3 \(int\)"):
        execute_notebook(notebook, out, {"family": 3})
    execute_notebook(notebook, out, {"sigma": 1, "trainer_overrides": '{"autocast": false}'})
    assert ran[-1]["parameters"] == {"sigma": 1, "trainer_overrides": '{"autocast": false}'}


def test_a_stopped_headless_run_leaves_no_kernel_keys_and_exits_143(tmp_path: Path) -> None:
    """Issue 42: the kernel's connection file (its HMAC and CurveZMQ keys) went to the shared
    temporary folder as `tmp*.json` and stayed there when the papermill process was ended."""
    import os
    import signal
    import time

    from lab.base.processes import alive

    temp, run = tmp_path / "tmp", tmp_path / "run"
    temp.mkdir()
    sleepy = REPO / "tests" / "data" / "sweep_sleep.ipynb"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lab.views.notebooks", str(sleepy), str(tmp_path / "out.ipynb"),
         "-p", "x", "1", "-p", "out_dir", str(run), "--no-progress-bar"],
        cwd=tmp_path, env={**os.environ, "TMPDIR": str(temp), "SWEEP_TOY_SLEEP_S": "600"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (run / "pids.json").is_file():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the kernel never started"
            time.sleep(0.2)
        (keys,) = temp.glob(f"lab-kernel-{proc.pid}-*")
        assert (keys / "kernel.json").is_file(), "the keys went elsewhere"
        kernel = json.loads((run / "pids.json").read_text())["kernel"]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr
    assert "papermill: stopped by SIGTERM." in stderr
    assert list(temp.iterdir()) == [], "the kernel's connection file (or its folder) stayed"
    deadline = time.monotonic() + 60
    while alive(kernel) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(kernel), "the kernel outlived its papermill process"

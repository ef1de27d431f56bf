"""`precision-lab` subcommands, run for real on tiny: their files and their exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lab
from lab.views import runs
from lab.views.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "tests" / "data" / "sweep_toy.ipynb"
PNG = b"\x89PNG\r\n\x1a\n"


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("command", "options"),
    [
        (
            "pair",
            [
                "--family",
                "--trainer-overrides",
                "--max-rel-max",
                "--baseline",
                "--out-dir",
                "--sharded",
            ],
        ),
        ("drift", ["--steps", "--cfg-scale", "--sde-window", "--samples", "--max-clip-frac"]),
        ("report", ["RUN", "--out", "--metric"]),
        ("sweep", ["--grid", "--param", "--jobs", "--resume"]),
        ("scenarios", ["--only", "--list", "--device"]),
        ("compare", ["RUN", "--root", "--out-dir"]),
    ],
)
def test_every_subcommand_has_help_with_its_options_and_exit_codes(
    command: str, options: list[str], capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in options:
        assert option in text, f"{command} --help does not mention {option}"
    assert "exit codes: 0 ok; 1" in text and "2 bad arguments" in text


def test_pair_writes_results_and_figure_with_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "pair"
    code, text, _ = _run(
        capsys,
        "pair",
        "--family", "flux",
        "--out-dir", str(out),
        "--trainer-overrides", '{"autocast": false}',
        "--rollout-overrides", '{"attention_backend": "math"}',
        "--report",
    )  # fmt: skip
    assert code == EXIT_OK
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["family"] == "flux" and data["summary"]["pairs"] > 20
    assert data["side_b"]["autocast"] is False
    assert data["side_a"]["attention_backend"] == "math"
    assert (out / "divergence_by_layer.png").read_bytes()[:8] == PNG
    assert (out / "report.html").stat().st_size > 10_000
    assert "flux [tiny], propagated" in text


def test_pair_exits_1_over_a_threshold_and_against_a_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, text, _ = _run(capsys, "pair", "--out-dir", str(tmp_path / "a"), "--max-rel-max", "1e-9")
    assert code == EXIT_FAILED
    assert "FAILED: model_output_rel_max" in text and "> --max-rel-max 1e-09" in text
    rel_max = json.loads((tmp_path / "a" / "results.json").read_text())["summary"][
        "model_output_rel_max"
    ]
    code, _, _ = _run(
        capsys, "pair", "--out-dir", str(tmp_path / "b"), "--max-rel-max", str(rel_max)
    )
    assert code == EXIT_OK, "at the threshold is not over it"
    # A bit-exact baseline: the default pair (trainer with autocast) is worse everywhere it differs.
    exact = tmp_path / "exact" / "results.json"
    lab.pair_family("flux", "tiny", trainer=runs.MATCHED_TRAINER).to_json(exact)
    code, text, _ = _run(capsys, "pair", "--out-dir", str(tmp_path / "c"), "--baseline", str(exact))
    assert code == EXIT_FAILED
    assert "REGRESSED" in text


def test_pair_saves_a_baseline_then_gates_on_it_and_refuses_bad_names_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_HOME", str(tmp_path))  # baselines go to tmp_path/baselines
    # An unknown baseline is a bad argument, found before the pair runs: nothing is written.
    code, _, err = _run(capsys, "pair", "--out-dir", str(tmp_path / "x"), "--baseline", "flux_t")
    assert code == EXIT_USAGE
    assert "no baseline 'flux_t'" in err and "--save-baseline NAME" in err
    assert not (tmp_path / "x").exists()

    # Exact sides: a bit-exact run kept as known-good.
    exact = ["--trainer-overrides", json.dumps(runs.MATCHED_TRAINER)]
    code, text, _ = _run(
        capsys, "pair", "--out-dir", str(tmp_path / "a"), *exact, "--save-baseline", "flux_t"
    )
    assert code == EXIT_OK and "saved baseline 'flux_t'" in text
    kept = lab.Result.from_json(tmp_path / "baselines" / "flux_t.json")
    assert kept.output_metrics()["model_output_rel_max"] == 0.0

    code, _, err = _run(
        capsys, "pair", "--out-dir", str(tmp_path / "y"), *exact, "--save-baseline", "flux_t"
    )
    assert code == EXIT_USAGE and "flux_t.json exists" in err
    assert not (tmp_path / "y").exists(), "a taken name is refused before the pair runs"

    code, text, _ = _run(capsys, "pair", "--out-dir", str(tmp_path / "b"), *exact,
                         "--baseline", "flux_t")  # fmt: skip
    assert code == EXIT_OK and "vs baseline 'flux_t'" in text

    # The default trainer (autocast) is worse than the bit-exact baseline: exit 1, with the
    # threshold's verdict still printed, and the failed run not kept as a baseline.
    code, text, _ = _run(capsys, "pair", "--out-dir", str(tmp_path / "c"), "--baseline", "flux_t",
                         "--max-rel-max", "1e-9", "--save-baseline", "flux_c")  # fmt: skip
    assert code == EXIT_FAILED
    assert "FAILED: model_output_rel_max" in text and "REGRESSED" in text
    assert "not saved as baseline 'flux_c'" in text
    assert not (tmp_path / "baselines" / "flux_c.json").exists()


def test_runs_get_folders_of_their_own_and_a_baseline_lands_where_it_was_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: every `pair` wrote runs/pair/ over the last one, and `--save-baseline NAME`
    run from another folder wrote into the checkout's data/baselines/."""
    from lab.views import runs

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("LAB_HOME", raising=False)
    exact = ["--trainer-overrides", '{"autocast": false}']
    code, first, _ = _run(capsys, "pair", *exact, "--save-baseline", "flux_exact")
    assert code == EXIT_OK
    code, second, _ = _run(capsys, "pair", "--family", "sd3", "--mode", "local")
    assert code == EXIT_OK
    made = sorted(elsewhere.glob("runs/pair/*/results.json"))
    names = [p.parent.name for p in made]
    assert len(made) == 2, names
    assert names[0].startswith("flux-tiny-propagated-") and names[1].startswith("sd3-tiny-local-")
    assert f"wrote {made[0]}" in first and f"wrote {made[1]}" in second, "where is not said"
    assert (elsewhere / "baselines" / "flux_exact.json").is_file()
    assert not (REPO / "data" / "baselines").exists()
    assert not (REPO / "baselines" / "flux_exact.json").exists(), "saved into the checkout"
    # compare lists the runs and baselines of this folder, and nothing of the checkout's.
    listed = {r.name for r in runs.list_runs()}
    assert listed == {f"runs/pair/{names[0]}", f"runs/pair/{names[1]}", "baseline:flux_exact"}
    code, text, _ = _run(capsys, "compare")
    assert code == EXIT_OK and all(name in text for name in listed), text

    # A named --out-dir that holds a run is refused, before any work; --overwrite replaces it.
    code, _, _ = _run(capsys, "pair", "--out-dir", "mine")
    assert code == EXIT_OK
    before = (elsewhere / "mine" / "results.json").read_bytes()
    code, _, err = _run(capsys, "pair", "--out-dir", "mine", *exact)
    assert code == EXIT_USAGE
    assert "out_dir 'mine' already holds a run's results (divergence_by_layer.png, " in err
    assert "--overwrite" in err and (elsewhere / "mine" / "results.json").read_bytes() == before
    code, _, _ = _run(capsys, "pair", "--out-dir", "mine", *exact, "--overwrite")
    assert code == EXIT_OK
    saved = lab.Result.from_json(elsewhere / "mine" / "results.json")
    assert saved.side_b["autocast"] is False, "--overwrite did not replace the run"


def test_pair_that_fails_part_way_exits_1_and_keeps_the_partial_result(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # fp32 proj_out weights on a side without autocast meet bf16 activations: a dtype error.
    overrides = '{"autocast": false, "param_dtype_rules": {"*proj_out*": "fp32"}}'
    code, text, err = _run(
        capsys, "pair", "--out-dir", str(tmp_path), "--trainer-overrides", overrides
    )
    assert code == EXIT_FAILED
    assert "failed" in err and "proj_out" in err
    partial = json.loads((tmp_path / "results.json").read_text())
    assert len(partial["rows"]) > 0, "the pairs compared before the failure are saved"
    assert "saved the" in text


BAD_VALUES = [
    # A Python literal gets its JSON spelling as the fix.
    (["pair", "--trainer-overrides", "{'autocast': 0}"], '--trainer-overrides: .*"autocast": 0'),
    (["pair", "--rollout-overrides", "[1, 2]"], "--rollout-overrides: .*expected a JSON obj"),
    (["pair", "--trainer-overrides", '{"autocast": "no"}'], "autocast"),
    (["pair", "--trainer-overrides", '{"forward_dtype": "bfloat16"}'], "Did you mean 'bf16'"),
    # A misspelt field was a TypeError traceback from Side.__init__.
    (
        ["pair", "--trainer-overrides", '{"autocasts": false}'],
        r"Side.trainer: unknown field\(s\) \['autocasts'\]. Did you mean 'autocast'",
    ),
    (
        ["pair", "--rollout-overrides", '{"atention_backend": "math"}'],
        r"Side.rollout: .*Did you mean 'attention_backend'",
    ),
    (["drift", "--sde-window", "0,4"], "--sde-window: '0,4' is not valid JSON"),
    (["drift", "--steps", "1"], "steps must be an int >= 2"),
    # Checked before any work (each used to fail, or mean nothing, after the forwards).
    (["pair", "--metric", "rel_mx"], r"--metric 'rel_mx' .*Did you mean 'rel_max'"),
    (["pair", "--out-dir", "/proc/no/such"], r"--out-dir '/proc/no/such' cannot be written"),
    (["pair", "--out-dir", "f.txt"], r"--out-dir 'f.txt' is a file, not a folder"),
    (["pair", "--max-rel-max", "-1"], r"--max-rel-max must be a number >= 0, got -1"),
    (["drift", "--clip-range", "-1"], r"--clip-range must be a number > 0"),
    (["drift", "--max-clip-frac", "2"], r"--max-clip-frac must be a share in \[0, 1\]"),
    (["pair", "--sharded", "0"], r"--sharded must be a rank count >= 1"),
    (["sweep", "01_quickstart", "--grid", "family=flux", "--jobs", "0"], r"--jobs must be"),
    (["scenarios", "--only", "no_such_scenario"], "no_such_scenario"),
    (["compare", "runs/x"], "give two or more"),
    (["report", "no/such/run"], "no saved run 'no/such/run'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_VALUES)
def test_bad_values_exit_2_naming_the_value_and_the_fix(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.txt").write_text("a file")
    before = sorted(tmp_path.rglob("*"))
    code, _, err = _run(capsys, *argv)
    assert sorted(tmp_path.rglob("*")) == before, "a refused command writes nothing"
    assert code == EXIT_USAGE
    assert err.startswith("error: ")
    import re

    assert re.search(message, err), err


def test_an_unknown_choice_is_refused_by_the_parser_with_the_choices(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["pair", "--family", "fluxx"])
    assert done.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "invalid choice: 'fluxx'" in err and "'flux'" in err


def test_drift_writes_the_trajectory_and_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "drift"
    argv = ["drift", "--out-dir", str(out), "--steps", "3", "--samples", "2", "--family", "cosmos3"]
    code, text, _ = _run(capsys, *argv)
    assert code == EXIT_OK, "cosmos3 runs two samples as two forwards"
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["family"] == "cosmos3" and data["meta"]["steps"] == 3
    assert data["overall"]["samples"] == 3 * 2
    for name in ("ratio_drift.png", "ratio_hist.png", "logprob_vs_velocity_gap.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert "cosmos3 (tiny): 3 steps" in text
    # The same --out-dir again: refused (it holds that trajectory), before any step runs.
    code, _, err = _run(capsys, *argv)
    assert code == EXIT_USAGE and "already holds a run's results" in err and "--overwrite" in err
    # A clip range far inside the drift clips every ratio: over a 0 threshold, exit 1.
    argv += ["--overwrite", "--clip-range", "1e-15", "--max-clip-frac", "0"]
    code, text, _ = _run(capsys, *argv)
    assert code == EXIT_FAILED and "FAILED: clip_frac" in text
    assert json.loads((out / "results.json").read_text())["overall"]["clip_frac"] == 1.0


def test_a_drift_that_fails_part_way_saves_the_steps_before(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lab.rl import trajectory as module

    real, calls = module._guided_velocity, []

    def guided(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 5:  # step 2's rollout velocity
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_guided_velocity", guided)
    out = tmp_path / "drift"
    code, text, err = _run(capsys, "drift", "--out-dir", str(out), "--steps", "4")
    assert code == EXIT_FAILED and "drift failed: trajectory('flux'): step 2 of 4" in err
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["completed_steps"] == 2 and len(data["per_step"]) == 2
    assert data["meta"]["failed"]["step"] == 2
    for name in ("ratio_drift.png", "ratio_hist.png", "logprob_vs_velocity_gap.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert "saved the 2 step(s) completed before the failure" in text


def test_a_drift_whose_side_cannot_run_names_the_module_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """It was a raw torch traceback from inside diffusers (pair said where and why)."""
    rules = '{"autocast": false, "param_dtype_rules": {"*norm*": "fp32"}}'
    out = tmp_path / "drift"
    code, _, err = _run(
        capsys, "drift", "--family", "sd3", "--steps", "3", "--out-dir", str(out),
        "--trainer-overrides", rules,
    )  # fmt: skip
    assert code == EXIT_FAILED
    assert (
        "drift failed: forward_side: side 'trainer' failed in module "
        "'transformer_blocks.0.norm1.linear' (Linear): RuntimeError: mat1 and mat2" in err
    )
    assert "(rule '*norm*: fp32') while that side runs fp16 without autocast" in err
    assert "Turn autocast on for side 'trainer'" in err and "Traceback" not in err
    assert not out.exists(), "no step completed: nothing to save"
    # From Python: a PairError carrying where it failed.
    from lab.base.errors import PairError

    fam = lab.family("sd3")
    trainer = lab.Side.trainer(fam, autocast=False, param_dtype_rules={"*norm*": "fp32"})
    with pytest.raises(PairError) as caught:
        lab.trajectory("sd3", steps=2, trainer=trainer, progress=False)
    assert caught.value.side == "trainer" and caught.value.result is None
    assert caught.value.module == "transformer_blocks.0.norm1.linear"
    assert caught.value.fix is not None and caught.value.fix.startswith("Fix: ")
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_report_and_compare_read_saved_runs(tmp_path: Path, capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LAB_HOME", raising=False)
    on = lab.pair_family("flux", "tiny", trainer={"autocast": True})
    off = lab.pair_family("flux", "tiny", trainer=runs.MATCHED_TRAINER)
    on.to_json("runs/autocast_on/results.json")
    off.to_json("runs/autocast_off/results.json")

    code, text, _ = _run(capsys, "compare")
    assert code == EXIT_OK
    assert "runs/autocast_on" in text and "runs/autocast_off" in text

    code, text, _ = _run(capsys, "compare", "autocast_on", "autocast_off", "--out-dir", "cmp")
    assert code == EXIT_OK, "the second run is better everywhere"
    assert "side_b.autocast" in text and "OK" in text
    assert (tmp_path / "cmp" / "overlay.png").read_bytes()[:8] == PNG
    diff = (tmp_path / "cmp" / "settings_diff.csv").read_text()
    assert "side_b.autocast,True,False" in diff
    assert (tmp_path / "cmp" / "report.html").stat().st_size > 10_000

    code, text, _ = _run(capsys, "compare", "runs/autocast_off", "runs/autocast_on")
    assert code == EXIT_FAILED
    assert "WORSE than 'runs/autocast_off': runs/autocast_on" in text

    lab.pair_family("wan2_2", "tiny").to_json("runs/wan/results.json")
    code, _, err = _run(capsys, "compare", "runs/autocast_on", "runs/wan")
    assert code == EXIT_USAGE and "different models" in err
    assert "the run and baseline 'runs/autocast_on' are different models" in err

    code, _, _ = _run(capsys, "report", "autocast_on", "runs/autocast_off", "--out", "r.html")
    assert code == EXIT_OK
    html = (tmp_path / "r.html").read_text()
    assert "runs/autocast_on" in html and "runs/autocast_off" in html

    # Nothing writes over an earlier report, comparison or record unless asked to.
    code, _, err = _run(capsys, "report", "autocast_on", "--out", "r.html")
    assert code == EXIT_USAGE and "--out 'r.html' exists" in err and "--overwrite" in err
    assert (tmp_path / "r.html").read_text() == html
    code, _, err = _run(capsys, "compare", "autocast_on", "autocast_off", "--out-dir", "cmp")
    assert code == EXIT_USAGE and "already holds a run's results (overlay.png, " in err
    code, _, _ = _run(capsys, "compare", "autocast_on", "autocast_off", "--out-dir", "cmp",
                      "--overwrite")  # fmt: skip
    assert code == EXIT_OK
    code, _, err = _run(capsys, "bench-mismatch", "--out", "r.html")
    assert code == EXIT_USAGE and "--out 'r.html' exists" in err
    # A report with no --out goes to a fresh folder of its own, and says where.
    code, text, _ = _run(capsys, "report", "autocast_on")
    (made,) = (tmp_path / "runs" / "report").glob("*/report.html")
    assert code == EXIT_OK and f"wrote {made}" in text


def test_scenarios_list_and_one_scenario(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, text, _ = _run(capsys, "scenarios", "--list")
    assert code == EXIT_OK
    assert "sd3_fp16_vs_bf16\n" in text and "qwen_attention_kernel (GPU only)" in text
    out = tmp_path / "scen"
    code, text, _ = _run(capsys, "scenarios", "--only", "sd3_fp16_vs_bf16", "--out-dir", str(out))
    assert code == EXIT_OK
    rows = json.loads((out / "scenarios.json").read_text())
    assert [r["scenario"] for r in rows] == ["sd3_fp16_vs_bf16"]
    assert rows[0]["culprit_matches"] is True
    assert (out / "bug_vs_fixed.png").read_bytes()[:8] == PNG
    assert "sd3_fp16_vs_bf16" in text


def test_sweep_exits_1_when_a_run_failed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The toy notebook fails for x=2 on purpose (tests/data/sweep_toy.ipynb).
    argv = ["sweep", str(TOY), "--grid", "x=1,2", "--out", str(tmp_path), "--no-progress"]
    code, text, _ = _run(capsys, *argv)
    assert code == EXIT_FAILED
    assert "1/2 runs ok" in text
    code, _, err = _run(capsys, "sweep", str(TOY), "--grid", "x")
    assert code == EXIT_USAGE and "expected KEY=V1,V2" in err


def test_python_dash_m_lab_is_the_same_command_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lab", "compare", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert "no saved runs" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "lab", "pair", "--preset", "huge"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == EXIT_USAGE
    assert "invalid choice: 'huge'" in done.stderr


@pytest.mark.slow
def test_pair_sharded_runs_both_sides_under_fsdp2_and_names_what_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sharded"
    argv = ["pair", "--family", "sd3", "--sharded", "2", "--out-dir", str(out),
            "--trainer-overrides", '{"autocast": false}']  # fmt: skip
    code, text, _ = _run(capsys, *argv)
    assert code == EXIT_OK, text
    assert "rollout under FSDP2 on 2 gloo rank(s); trainer under FSDP2 on 2 gloo rank(s)" in text
    assert "build_s" in text and "forward_s" in text  # the ranks' table
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["fsdp2_b"]["world_size"] == 2 and data["side_b"]["autocast"] is False
    assert (out / "divergence_by_layer.png").read_bytes()[:8] == PNG
    # The same rows as the in-process pair at block level, with the same override.
    in_process = lab.pair_family("sd3", "tiny", capture_depth=1, trainer={"autocast": False})
    assert [r["max_ulp"] for r in data["rows"]] == [r.metrics.max_ulp for r in in_process.rows]
    assert data["summary"]["family"] == "sd3"
    code, _, err = _run(capsys, "pair", "--sharded", "2", "--mode", "local")
    assert code == EXIT_USAGE and "--mode local is not available sharded" in err
    code, _, err = _run(capsys, "pair", "--sharded", "0")
    assert code == EXIT_USAGE and "--sharded must be a rank count >= 1" in err
    # A rank that fails as the rollout starts: exit 1, its error printed, nothing to save.
    monkeypatch.setenv("LAB_FSDP2_FAULT", "raise@1")
    code, _, err = _run(capsys, "pair", "--family", "sd3", "--sharded", "2",
                        "--out-dir", str(tmp_path / "failed"))  # fmt: skip
    assert code == EXIT_FAILED and "pair --sharded failed: pair_sharded: side 'rollout'" in err
    assert "run_fsdp2_forwards: rank 1 of 2 failed first, in job 0" in err
    assert not (tmp_path / "failed" / "results.json").exists()
    # One that fails inside the trainer's forward: the pairs compared before it are saved.
    monkeypatch.setenv("LAB_FSDP2_FAULT", "raise@0:trainer:transformer_blocks.1")
    code, out, err = _run(capsys, "pair", "--family", "sd3", "--sharded", "2",
                          "--out-dir", str(tmp_path / "part"))  # fmt: skip
    assert code == EXIT_FAILED and "in module 'transformer_blocks.1'" in err
    saved = json.loads((tmp_path / "part" / "results.json").read_text())
    assert [r["module"] for r in saved["rows"]][-2:] == ["transformer_blocks.0"] * 2
    assert f"saved the {len(saved['rows'])} pair(s) compared before the failure" in out


# ---- issue 42: Ctrl-C and SIGTERM keep what finished and say so in one line; held folders ----


def _interrupt_at_forward(monkeypatch: pytest.MonkeyPatch, forward: int, sig: str) -> None:
    """Every model the run builds raises `sig` (Ctrl-C, or SIGTERM) in the main thread as its
    `forward`-th forward (counted over all of them) ends."""
    import _thread
    import signal

    from lab.families import Family

    build, count = Family.build, [0]

    def interrupting(self: Family, *args: object, **kwargs: object) -> torch.nn.Module:
        model = build(self, *args, **kwargs)

        def hook(module: torch.nn.Module, inputs: object, output: object) -> None:
            count[0] += 1
            if count[0] == forward:
                _thread.interrupt_main(getattr(signal, sig))

        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(Family, "build", interrupting)


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stopped_drift_saves_the_steps_before_and_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
    sig: str, code: int,
) -> None:  # fmt: skip
    # Before: Ctrl-C lost every finished step (only Exception was kept) with a traceback, and
    # SIGTERM killed the process where it stood.
    _interrupt_at_forward(monkeypatch, 5, sig)  # step 2's rollout forward
    out = tmp_path / "drift"
    got, _, err = _run(capsys, "drift", "--out-dir", str(out), "--steps", "4")
    assert got == code, err
    assert err.splitlines() == [
        f"drift: stopped by {sig} in step 2 of 4; the 2 step(s) before it are saved in {out}."
    ]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["completed_steps"] == 2 and len(data["per_step"]) == 2
    assert data["meta"]["interrupted"] == {"step": 2, "signal": sig}
    for name in ("ratio_drift.png", "ratio_hist.png", "logprob_vs_velocity_gap.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert not (out / ".lab-lock").exists()


def test_a_stopped_pair_exits_130_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _interrupt_at_forward(monkeypatch, 1, "SIGINT")  # as the rollout side's forward ends
    out = tmp_path / "pair"
    code, _, err = _run(capsys, "pair", "--out-dir", str(out))
    assert code == 130 and err.splitlines() == ["pair: stopped by SIGINT; nothing was saved."]
    assert not out.exists(), "the stopped pair left its (empty) folder"


def test_an_out_dir_another_run_holds_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Two commands writing one folder read (and overwrite) each other's results.json.
    from lab.base.processes import holding_folder

    out = tmp_path / "held"
    with holding_folder(out, "another run"):
        for command in (["pair"], ["drift", "--steps", "2"]):
            code, _, err = _run(capsys, *command, "--out-dir", str(out))
            assert code == EXIT_USAGE, err
            assert f"--out-dir: {str(out)!r} is in use by another run, process {os.getpid()}" in err
        assert [p.name for p in out.iterdir()] == [".lab-lock"]
    code, _, err = _run(capsys, "drift", "--steps", "2", "--out-dir", str(out))
    assert code == EXIT_OK, err


@pytest.mark.slow
def test_sigterm_on_pair_sharded_ends_every_rank_saves_the_pairs_and_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    # Before: a traceback (Terminated), nothing saved.
    import signal
    import time

    temp, out = tmp_path / "tmp", tmp_path / "sharded"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp),
           "LAB_FSDP2_FAULT": "hang@1:trainer:transformer_blocks.1"}  # fmt: skip
    cli = subprocess.Popen(
        [sys.executable, "-m", "lab", "pair", "--family", "sd3", "--sharded", "2", "--out-dir",
         str(out)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list(temp.glob("lab-fsdp2-*/tmp/hang1")):
            assert cli.poll() is None, cli.communicate()
            assert time.monotonic() < deadline, "the trainer's ranks never reached block 1"
            time.sleep(0.2)
        cli.send_signal(signal.SIGTERM)
        stdout, stderr = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 143, stdout + stderr
    assert stderr.strip().splitlines() == [
        "pair --sharded: stopped by SIGTERM; every rank ended, saved."
    ], stderr
    saved = json.loads((out / "results.json").read_text())
    # The rollout's whole forward against the trainer's up to where rank 0 waited for rank 1
    # (FSDP2 gathers a block ahead, so rank 0 ran block 1 before it waited).
    modules = [r["module"] for r in saved["rows"]]
    assert "transformer_blocks.0" in modules and modules[-1] == "transformer_blocks.1", modules
    assert f"saved the {len(saved['rows'])} pair(s) compared before SIGTERM" in stdout
    assert list(temp.iterdir()) == [], "the launch's folder stayed"

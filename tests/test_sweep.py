"""`python -m lab sweep`: a grid of papermill runs, one table, failures reported not fatal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch

from lab.base.processes import alive
from lab.views.sweep import grid_points, parse_grid, run_sweep

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "tests" / "data" / "sweep_toy.ipynb"


def _sweep_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lab", "sweep", *args, "--no-progress"],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_two_by_two_grid_gives_four_rows(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = _sweep_cli(
        str(REPO / "notebooks" / "01_quickstart.ipynb"),
        "--grid", "family=flux,sd3",
        "--grid", "mode=propagated,local",
        "--param", "preset=tiny",
        "--out", str(out),
        "--jobs", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4/4 runs ok" in proc.stdout
    table = pd.read_csv(out / "sweep.csv")
    assert len(table) == 4
    assert set(zip(table["family"], table["mode"], strict=True)) == {
        ("flux", "propagated"), ("flux", "local"), ("sd3", "propagated"), ("sd3", "local"),
    }  # fmt: skip
    assert (table["status"] == "ok").all()
    assert (table["preset"] == "tiny").all()
    assert (table["pairs"] > 20).all()
    assert (table["model_output_rel_max"] > 0).all(), "tiny rollout vs trainer should differ"
    # local mode re-runs each module on the same inputs: more pairs stay bit-exact.
    for fam in ("flux", "sd3"):
        rows = table[table["family"] == fam].set_index("mode")
        assert rows.loc["local", "bitexact_pairs"] > rows.loc["propagated", "bitexact_pairs"]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for folder in table["run"]:
        assert (out / folder / "results.json").is_file()
        assert (out / folder / "executed.ipynb").is_file()


def test_failed_run_is_reported_and_the_others_finish(tmp_path: Path) -> None:
    # The toy notebook fails its assert cell at x == 2 and builds no model, so this checks the
    # failure path in seconds; the quickstart grid above covers real runs.
    out = tmp_path / "sweep"
    proc = _sweep_cli(
        str(TOY),
        "--grid", "x=1,2",
        "--out", str(out),
        "--jobs", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1/2 runs ok" in proc.stdout
    assert "FAILED 001_x=2: AssertionError: x == 2 is the failing grid point" in proc.stdout
    table = pd.read_csv(out / "sweep.csv").set_index("x")
    assert list(table["status"]) == ["ok", "failed"]
    assert table.loc[1, "x_out"] == 1 and table.loc[1, "model_output_rel_max"] == 0.1
    kept = Path(table.loc[2, "notebook"])
    assert kept.is_file() and "failing grid point" in kept.read_text(), "executed notebook kept"
    assert (out / "sweep.png").is_file(), "the plot is drawn from the runs that finished"


def test_grid_values_parse_as_json_else_strings() -> None:
    grid = parse_grid(
        ["steps=2,4", "cfg=true,false", "family=flux", 'trainer_overrides={"a": 1, "b": [1, 2]},{}']
    )
    assert grid == {
        "steps": [2, 4],
        "cfg": [True, False],
        "family": ["flux"],
        "trainer_overrides": [{"a": 1, "b": [1, 2]}, {}],
    }
    assert len(grid_points(grid)) == 8
    with pytest.raises(ValueError, match="expected KEY=V1,V2"):
        parse_grid(["family"])


def test_unknown_grid_key_is_refused_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['famly'\] are not parameters of 01_quickstart"):
        run_sweep("01_quickstart", {"famly": ["flux"]}, tmp_path)
    assert not list(tmp_path.iterdir())
    # A misspelt fixed parameter with no grid is named, not "the grid is empty".
    with pytest.raises(ValueError, match=r"\['famly'\] are not parameters .*'family'"):
        run_sweep("01_quickstart", {}, tmp_path, parameters={"famly": "flux"})
    with pytest.raises(
        ValueError, match=r"'interactive' \(declared bool\) must be True or False, got 'm"
    ):
        run_sweep("01_quickstart", {"interactive": [True, "maybe"]}, tmp_path)
    with pytest.raises(ValueError, match=r"'seed' \(declared int\) must be an int, got 0\.5"):
        run_sweep("01_quickstart", {"family": ["flux"]}, tmp_path, parameters={"seed": 0.5})
    with pytest.raises(ValueError, match="the grid is empty"):
        run_sweep("01_quickstart", {}, tmp_path, parameters={"family": "flux"})
    assert not list(tmp_path.iterdir())


# ---- processes, interruption, rows as they finish, resume (issue 14 item 8) -----------------

SLEEPY = REPO / "tests" / "data" / "sweep_sleep.ipynb"


def _start_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lab", "sweep", *args, "--no-progress"],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's background job may inherit SIGINT ignored; the test sends it on purpose.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _pids(folder: Path) -> list[int]:
    """The papermill worker and the kernel that ran one grid point (the notebook writes them)."""
    path = folder / "pids.json"
    return list(json.loads(path.read_text()).values()) if path.is_file() else []


def _rows(out: Path) -> pd.DataFrame:
    path = out / "sweep.csv"
    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def _executions(folder: Path) -> int:
    path = folder / "executions.txt"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.slow
def test_kill_9_of_the_sweep_leaves_no_worker_or_kernel_running(tmp_path: Path) -> None:
    out, temp = tmp_path / "sweep", tmp_path / "tmp"
    temp.mkdir()
    cli = _start_cli(
        str(SLEEPY), "--grid", "x=1,2,3", "--jobs", "2", "--out", str(out),
        cwd=tmp_path, env={"SWEEP_TOY_SLEEP_S": "600", "TMPDIR": str(temp)},
    )  # fmt: skip
    try:
        running = [out / "000_x=1", out / "001_x=2"]
        _wait_for(lambda: all(_pids(f) for f in running), "both runs' kernels to start")
        pids = [pid for f in running for pid in _pids(f)]
        assert all(alive(pid) for pid in pids)
        cli.kill()  # SIGKILL: the sweep gets no chance to clean up
        cli.wait()
        _wait_for(lambda: not any(alive(pid) for pid in pids), "the orphans to die", 60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert not _pids(out / "002_x=3"), "a queued run started after the sweep died"
    # kill -9 leaves its lock (stale: its flock died with it) and its kernels' keys folder; the
    # next sweep takes the folder over and removes the dead one's keys.
    assert (out / ".lab-lock").is_file()
    (keys,) = temp.glob(f"lab-sweep-{cli.pid}-*")
    assert sorted(p.name for p in keys.glob("kernel-*.json")) == [
        "kernel-000.json", "kernel-001.json"
    ]  # fmt: skip
    proc = _sweep_cli(str(SLEEPY), "--grid", "x=0", "--out", str(out), cwd=tmp_path,
                      env={"TMPDIR": str(temp)})  # fmt: skip
    assert proc.returncode == 0 and "1/1 runs ok" in proc.stdout, proc.stdout + proc.stderr
    assert list(temp.iterdir()) == [], "the dead sweep's kernel keys (or this one's) stayed"


@pytest.mark.parametrize(
    ("sig", "code"),
    # Ctrl-C takes the same path (KeyboardInterrupt) as SIGTERM (Terminated, a subclass).
    [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],
)
def test_a_stopped_sweep_ends_its_runs_keeps_finished_rows_and_resumes(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    out, temp = tmp_path / "sweep", tmp_path / "tmp"
    temp.mkdir()
    args = (str(SLEEPY), "--grid", "x=0,1,2", "--jobs", "2", "--out", str(out))
    cli = _start_cli(*args, cwd=tmp_path, env={"SWEEP_TOY_SLEEP_S": "600", "TMPDIR": str(temp)})
    try:
        sleeping = [out / "001_x=1", out / "002_x=2"]
        # x=0 does not sleep: its row is on disk while the other two still run.
        _wait_for(lambda: len(_rows(out)) == 1, "the first finished row in sweep.csv")
        _wait_for(lambda: all(_pids(f) for f in sleeping), "the sleeping runs' kernels")
        pids = [pid for f in sleeping for pid in _pids(f)]
        cli.send_signal(sig)
        stdout, stderr = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == code, stdout + stderr
    assert stderr.strip().splitlines() == [
        f"sweep: stopped by {sig.name}; 1 of 3 runs finished (2 ended, 0 never started); their "
        f"rows are in {out / 'sweep.csv'}. Run again with resume=True (--resume) to run only "
        "the rest."
    ], stderr  # one line, no traceback
    assert "1/1 runs ok" in stdout
    # Before: each ended run's kernel connection file (its HMAC and CurveZMQ keys) stayed.
    assert list(temp.iterdir()) == [], "a kernel's connection file (or its folder) stayed"
    table = _rows(out)
    assert list(table["x"]) == [0] and list(table["status"]) == ["ok"]
    _wait_for(lambda: not any(alive(pid) for pid in pids), "the ended runs to be gone", 60)

    # --resume runs only the two points that did not finish (no sleep this time).
    proc = _sweep_cli(*args, "--resume", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3/3 runs ok" in proc.stdout
    assert [_executions(out / n) for n in ("000_x=0", "001_x=1", "002_x=2")] == [1, 2, 2]
    table = _rows(out)
    assert list(table["x"]) == [0, 1, 2] and (table["status"] == "ok").all()
    assert list(table["x_out"]) == [0, 1, 2]


def test_resume_reruns_failed_and_changed_points_only(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = (str(SLEEPY), "--grid", "x=0,1", "--out", str(out), "--jobs", "2")
    first = _start_cli(*args, cwd=tmp_path, env={"SWEEP_TOY_FAIL_X": "1"})
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 1 and "1/2 runs ok" in stdout, stdout + stderr
    assert "x == 1 fails on request" in stdout

    again = _sweep_cli(*args, "--resume", cwd=tmp_path)
    assert again.returncode == 0 and "2/2 runs ok" in again.stdout, again.stdout + again.stderr
    assert [_executions(out / n) for n in ("000_x=0", "001_x=1")] == [1, 2], "x=0 ran again"
    record = json.loads((out / "000_x=0" / "run.json").read_text())
    assert record["status"] == "ok" and record["parameters"] == {"x": 0}

    # Other parameters are other points: nothing is reused.
    changed = _sweep_cli(*args, "--param", "tag=b", "--resume", cwd=tmp_path)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert [_executions(out / n) for n in ("000_x=0", "001_x=1")] == [2, 3]
    record = json.loads((out / "000_x=0" / "run.json").read_text())
    assert record["parameters"] == {"tag": "b", "x": 0}


def test_a_sweep_without_out_gets_a_fresh_folder_and_an_earlier_sweeps_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAB_HOME", str(tmp_path))
    first = run_sweep(TOY, {"x": [1]}, progress=False)
    second = run_sweep(TOY, {"x": [1]}, progress=False)
    assert first.out_dir != second.out_dir, "two sweeps shared one folder"
    for done in (first, second):
        assert done.out_dir.parent == tmp_path / "runs" / "sweep"
        assert done.out_dir.name.startswith("sweep_toy-") and (done.out_dir / "sweep.csv").is_file()
    with pytest.raises(
        ValueError,
        match=r"^sweep: out_dir '.*' already holds a run's results \(sweep\.csv, sweep\.png\).*"
        r"--overwrite.*resume=True \(--resume\)",
    ):
        run_sweep(TOY, {"x": [3]}, first.out_dir, progress=False)
    assert pd.read_csv(first.out_dir / "sweep.csv")["x"].tolist() == [1], "the refusal wrote"
    again = run_sweep(TOY, {"x": [3]}, first.out_dir, progress=False, overwrite=True)
    assert not again.failed and pd.read_csv(again.table_path)["x"].tolist() == [3]
    # A sweep refused once its fresh folder is made leaves no folder behind.
    shared = {"out_dir": str(tmp_path / "one")}
    with pytest.raises(ValueError, match="gives 2 runs one output folder"):
        run_sweep(TOY, {"x": [1, 3]}, parameters=shared, progress=False)
    assert len(list((tmp_path / "runs" / "sweep").iterdir())) == 2


def test_an_unwritable_out_is_refused_before_any_run(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = _sweep_cli(str(TOY), "--grid", "x=1", "--out", str(blocker / "sweep"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--out {str(blocker / 'sweep')!r} cannot be written (Not a directory)" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The command line refuses it first; run_sweep itself says the same from Python.
    with pytest.raises(ValueError, match=r"cannot write the sweep folder"):
        run_sweep(TOY, {"x": [1]}, blocker / "sweep")
    with pytest.raises(ValueError, match=r"jobs must be an int, got 1\.5"):
        run_sweep(TOY, {"x": [1]}, tmp_path / "s", jobs=1.5)


@pytest.mark.slow
def test_run_sweep_works_from_a_script_without_a_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from lab.views.sweep import run_sweep\n"
        f"sweep = run_sweep({str(TOY)!r}, {{'x': [1, 3]}}, {str(tmp_path / 'out')!r}, "
        "progress=False)\n"
        "print(sweep.describe())\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2/2 runs ok" in proc.stdout
    assert proc.stdout.count("sweep of") == 1, "the script ran more than once"


# ---- issue 42/43: every value before the first run, one output per run, one sweep a folder ---


def test_every_grid_value_is_checked_before_the_first_run(tmp_path: Path) -> None:
    # Before: family=flux ran, then the sdd3 run failed in its kernel, suggesting to create
    # lab/families/sdd3.py.
    cases = [
        ({"family": ["flux", "sdd3"]}, {}, r"^sweep: grid value family='sdd3' is not a family\. "
         r"Did you mean 'sd3'\? Known: cosmos3, flux, .* Nothing ran"),
        ({"preset": ["tiny", "huge"]}, {"family": "sd3"},
         r"grid value preset='huge' is not a preset of sd3\. Known: tiny, reduced, full\."),
        ({"mode": ["propagated", "lockstep"]}, {}, r"mode='lockstep' is not a pairing mode"),
        ({"seed": [0]}, {"family": "flx"}, r"^sweep: parameter family='flx' is not a family"),
    ]  # fmt: skip
    for grid, parameters, message in cases:
        with pytest.raises(ValueError, match=message):
            run_sweep("01_quickstart", grid, tmp_path / "s", parameters=parameters)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' cannot run here: .*no CUDA GPU"):
            run_sweep("01_quickstart", {"device": ["cpu", "cuda"]}, tmp_path / "s")
    with pytest.raises(ValueError, match=r"sde_type='ode' is not an SDE type"):
        run_sweep("02_ratio_drift", {"sde_type": ["sde", "ode"]}, tmp_path / "s")
    assert not list(tmp_path.iterdir()), "a refused sweep made its folder"
    # The command line: exit 2, the user's words (no `run_sweep:`), nothing started.
    proc = _sweep_cli("01_quickstart", "--grid", "family=flux,sdd3", "--out", str(tmp_path / "s"),
                      cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: sweep: grid value family='sdd3' is not a family")
    assert "run_sweep" not in proc.stderr and not (tmp_path / "s").exists()


def test_a_parameter_giving_runs_one_output_folder_is_refused(tmp_path: Path) -> None:
    # Before: every run wrote X/results.json over the others', and each row read the last.
    shared = tmp_path / "X"
    with pytest.raises(ValueError, match=r"^sweep: parameter out_dir='.*X' gives 2 runs one "
                       r"output folder .* \(000_x=1, 001_x=2\): each would write"):  # fmt: skip
        run_sweep(TOY, {"x": [1, 2]}, tmp_path / "s", parameters={"out_dir": str(shared)})
    with pytest.raises(ValueError, match=r"^sweep: grid key out_dir='.*X' gives 2 runs"):
        run_sweep(TOY, {"out_dir": [str(shared)] * 2}, tmp_path / "s", parameters={"x": 1})
    assert not list(tmp_path.iterdir())
    # A relative out_dir is taken inside each run's folder: one per run, and read from there.
    sweep = run_sweep(SLEEPY, {"x": [0, 3]}, tmp_path / "s", parameters={"out_dir": "res"},
                      progress=False)  # fmt: skip
    assert not sweep.failed, sweep.describe()
    assert list(sweep.table()["x_out"]) == [0, 3]
    for name in ("000_x=0", "001_x=3"):
        assert (tmp_path / "s" / name / "res" / "results.json").is_file()


@pytest.mark.slow
def test_a_second_sweep_into_a_held_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    # Before: two sweeps of one folder both reported success, each reading the other's rows.
    from lab.base.processes import FolderInUseError, holding_folder

    out = tmp_path / "sweep"
    with holding_folder(out, "test"):
        with pytest.raises(FolderInUseError, match=rf"^sweep: '.*sweep' is in use by another "
                           rf"run, process {os.getpid()} \("):  # fmt: skip
            run_sweep(TOY, {"x": [1]}, out)
        assert list(out.iterdir()) == [out / ".lab-lock"], "the refused sweep wrote"
    # Two sweeps from the command line: the second exits 2 at once, the first finishes.
    args = (str(SLEEPY), "--grid", "x=1", "--out", str(out))
    first = _start_cli(*args, cwd=tmp_path, env={"SWEEP_TOY_SLEEP_S": "20"})
    try:
        _wait_for(lambda: bool(_pids(out / "000_x=1")), "the first sweep's run to start")
        second = _sweep_cli(*args, cwd=tmp_path)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is in use by another run, process {first.pid} (" in second.stderr
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and "1/1 runs ok" in stdout, stdout + stderr
    assert not (out / ".lab-lock").exists(), "the lock outlived its sweep"

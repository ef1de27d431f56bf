"""Where runs and baselines go: fresh folders per run, named folders never written over."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lab.views import home
from lab.views.home import baselines_home, check_folder_free, lab_home, run_folder


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory of its own, with no $LAB_HOME: the lab home is the working one."""
    monkeypatch.delenv("LAB_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> str:
    """Every run starts in the same second (what two runs launched together see)."""
    stamp = "20250102-030405"
    monkeypatch.setattr(home.time, "strftime", lambda fmt: stamp)
    return stamp


def test_a_fresh_folder_is_named_for_the_run_and_made_under_the_working_directory(
    workdir: Path,
) -> None:
    path = run_folder("quickstart", family="flux", preset="tiny", mode="propagated")
    assert path.is_dir() and not any(path.iterdir())
    assert path.parent == workdir / "runs" / "quickstart"
    assert path.name.startswith("flux-tiny-propagated-"), path.name
    assert run_folder("sweep", label="01_quickstart").name.startswith("01_quickstart-")
    # Unsafe characters in a label become dashes: the name stays one folder.
    assert "/" not in run_folder("scenarios", preset="tiny", label="cuda:0/x").name


def test_runs_started_in_one_second_get_distinct_folders(workdir: Path, frozen_clock: str) -> None:
    first = run_folder("pair", family="sd3", preset="tiny", mode="local")
    second = run_folder("pair", family="sd3", preset="tiny", mode="local")
    assert first.name == f"sd3-tiny-local-{frozen_clock}"
    assert second.name == f"sd3-tiny-local-{frozen_clock}-2"
    made: list[Path] = []
    threads = [
        threading.Thread(target=lambda: made.append(run_folder("pair", family="sd3")))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 8 and len(set(made)) == 8, "two runs were given one folder"


def test_lab_home_moves_runs_and_baselines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAB_HOME", str(tmp_path / "lab_home"))
    assert lab_home() == (tmp_path / "lab_home").resolve()
    assert baselines_home() == (tmp_path / "lab_home" / "baselines").resolve()
    made = run_folder("ratio_drift", family="wan2_2", preset="tiny")
    assert made.parent == (tmp_path / "lab_home" / "runs" / "ratio_drift").resolve()
    assert not (tmp_path / "runs").exists(), "written to the working directory"
    monkeypatch.setenv("LAB_HOME", "")
    assert lab_home() == tmp_path.resolve(), "an empty $LAB_HOME is unset"
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setenv("LAB_HOME", str(tmp_path / "a_file"))
    with pytest.raises(ValueError, match=r"\$LAB_HOME='.*a_file' is a file, not a folder"):
        lab_home()


def test_a_named_folder_holding_results_is_refused_unless_asked_to_overwrite(
    workdir: Path,
) -> None:
    named = workdir / "mine"
    # Missing or empty, or holding only what is no result (an executed notebook papermill
    # writes there first, the lock, hidden files): taken, and made.
    assert run_folder("quickstart", named) == named and named.is_dir()
    (named / "01_quickstart.ipynb").write_text("{}")
    (named / ".lab-lock").write_text("{}")
    assert run_folder("quickstart", str(named)) == named
    (named / "results.json").write_text("{}")
    (named / "divergence_by_layer.png").write_bytes(b"png")
    with pytest.raises(
        ValueError,
        match=r"out_dir '.*mine' already holds a run's results \(divergence_by_layer\.png, "
        r"results\.json\): a new run would write over them\. .*-p overwrite true.*--overwrite",
    ):
        run_folder("quickstart", named)
    with pytest.raises(ValueError, match="already holds"):
        check_folder_free(named)
    assert run_folder("quickstart", named, overwrite=True) == named
    assert (named / "results.json").read_text() == "{}", "taking the folder wrote nothing"
    (workdir / "file").write_text("x")
    with pytest.raises(ValueError, match=r"'.*file' is a file, not a folder"):
        run_folder("quickstart", workdir / "file", overwrite=True)
    with pytest.raises(ValueError, match=r"kind '\.\./up' is not a plain folder name"):
        run_folder("../up")

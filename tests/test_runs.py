"""Saved runs: listing results.json files, finding them, settings diff, overlay, verdicts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import lab
from lab.views import runs
from lab.views.baselines import save_baseline


@pytest.fixture(scope="module")
def flux_pair() -> tuple[lab.Result, lab.Result]:
    """Tiny flux: the trainer as is (diverges), then matched to the engine (matches the rollout:
    no autocast, the scheduler's fp32 timestep)."""
    on = lab.pair_family("flux", "tiny", trainer={"autocast": True})
    off = lab.pair_family("flux", "tiny", trainer=runs.MATCHED_TRAINER)
    assert on.output_metrics()["model_output_rel_max"] > 0
    assert off.output_metrics()["model_output_rel_max"] == 0
    return on, off


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, flux_pair) -> dict[str, Path]:
    """A root with an ad-hoc run, a sweep of two runs, a trajectory, noise; a baselines dir."""
    on, off = flux_pair
    root = tmp_path_factory.mktemp("root")
    baselines = tmp_path_factory.mktemp("baselines")
    paths = {
        "adhoc": on.to_json(root / "runs" / "quickstart" / "results.json"),
        "extra": off.to_json(root / "runs" / "param_overrides" / "without_rules.json"),
        "sweep0": on.to_json(root / "runs" / "sweep" / "000_mode=a" / "results.json"),
        "sweep1": off.to_json(root / "runs" / "sweep" / "001_mode=b" / "results.json"),
        "baseline": save_baseline(off, "flux_tiny_off", directory=baselines),
    }
    (root / "runs" / "sweep" / "sweep.csv").write_text("run,status\n")
    (root / "runs" / "other.json").write_text('{"not": "a result"}')
    (root / "runs" / "broken.json").write_text("{")
    hidden = root / ".venv" / "x"
    hidden.mkdir(parents=True)
    on.to_json(hidden / "results.json")
    traj = lab.trajectory("flux", "tiny", steps=2, samples=1, progress=False)
    paths["trajectory"] = traj.to_json(root / "runs" / "ratio_drift" / "results.json")
    # Distinct modification times, oldest first in this order.
    for i, key in enumerate(["baseline", "sweep0", "sweep1", "extra", "trajectory", "adhoc"]):
        os.utime(paths[key], (1_700_000_000 + i, 1_700_000_000 + i))
    return {"root": root, "baselines": baselines, **paths}


def test_list_runs_finds_every_kind_newest_first(tree) -> None:
    saved = runs.list_runs(tree["root"], baselines=tree["baselines"])
    by_name = {r.name: r for r in saved}
    assert [r.name for r in saved] == [
        "runs/quickstart",
        "runs/ratio_drift",
        "runs/param_overrides/without_rules.json",
        "runs/sweep/001_mode=b",
        "runs/sweep/000_mode=a",
        "baseline:flux_tiny_off",
    ], "newest first; .venv, non-results and broken JSON left out"
    assert by_name["runs/quickstart"].kind == "run"
    assert by_name["runs/sweep/000_mode=a"].kind == "sweep"
    assert by_name["baseline:flux_tiny_off"].kind == "baseline"
    assert by_name["runs/ratio_drift"].kind == "trajectory"
    assert by_name["runs/quickstart"].family == "flux"
    assert by_name["runs/quickstart"].mode == "propagated"
    assert by_name["runs/quickstart"].sides == "rollout vs trainer"
    table = runs.runs_table(saved)
    assert list(table["name"]) == [r.name for r in saved]
    assert table.loc[0, "model_output_rel_max"] > 0
    assert table.loc[table["name"] == "runs/sweep/001_mode=b", "model_output_rel_max"].item() == 0
    without = runs.list_runs(tree["root"], baselines=None, include_trajectories=False)
    assert {r.kind for r in without} == {"run", "sweep"}


def test_list_runs_refuses_a_missing_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        runs.list_runs(tmp_path / "nope")


def test_find_run_by_name_path_folder_baseline_or_unique_part(tree) -> None:
    saved = runs.list_runs(tree["root"], baselines=tree["baselines"])
    root = tree["root"]
    assert runs.find_run("runs/quickstart", saved, root=root).path == tree["adhoc"]
    assert runs.find_run("flux_tiny_off", saved, root=root).kind == "baseline"
    assert runs.find_run("001_mode", saved, root=root).path == tree["sweep1"]
    assert runs.find_run(str(tree["adhoc"]), saved, root=root).name == "runs/quickstart"
    assert runs.find_run(str(tree["adhoc"].parent), saved, root=root).name == "runs/quickstart"
    with pytest.raises(ValueError, match=r"matches 2 saved runs.*000_mode=a"):
        runs.find_run("runs/sweep/00", saved, root=root)
    with pytest.raises(
        ValueError, match=r"no saved run 'runs/quickstrat'.*Nearest: 'runs/quickstart'"
    ):
        runs.find_run("runs/quickstrat", saved, root=root)
    with pytest.raises(ValueError, match="is not a lab result"):
        runs.find_run(str(root / "runs" / "other.json"), saved, root=root)


def test_a_trajectory_is_listed_but_not_loaded_as_a_result(tree) -> None:
    run = runs.find_run(str(tree["trajectory"]), root=tree["root"])
    assert run.kind == "trajectory"
    with pytest.raises(ValueError, match="steps, not layers"):
        run.load()


def test_settings_diff_lists_exactly_what_differs(flux_pair) -> None:
    on, off = flux_pair
    diff = runs.settings_diff({"on": on, "off": off})
    assert list(diff.columns) == ["on", "off"]
    assert diff.loc["side_b.autocast"].tolist() == [True, False]
    assert diff.loc["meta.autocast_policy_b"].tolist() == ["cuda", None]
    assert "meta.family" not in diff.index and "side_a.autocast" not in diff.index
    assert not any(k.startswith("meta.timings_s") for k in diff.index), "timings are not settings"
    assert runs.settings_diff({"a": on, "b": on}).empty, "a run against itself differs nowhere"
    # How a pair ran (its threads' core, probes, batches) is no setting: two runs of the same
    # settings on other cores do not differ.
    import copy

    moved = copy.copy(on)
    moved.meta = {**on.meta, "pair_core": {"pinned_cpu": 3, "pin": "fastest", "probe_s": 0.002},
                  "metric_batches": {"side": 0, "current": 29}}  # fmt: skip
    assert runs.settings_diff({"a": on, "b": moved}).empty
    with pytest.raises(ValueError, match="two or more"):
        runs.settings_diff({"on": on})


def test_compare_runs_holds_later_runs_to_the_first(tree) -> None:
    root = tree["root"]
    better = runs.compare_runs(["runs/quickstart", "runs/sweep/001_mode=b"], root=root)
    verdicts = better.verdicts()
    assert verdicts.loc["runs/sweep/001_mode=b", "verdict"] == "ok"
    assert verdicts.loc["runs/sweep/001_mode=b", "improved"] > 0
    assert better.worse == []
    worse = runs.compare_runs(["runs/sweep/001_mode=b", "runs/quickstart"], root=root)
    assert worse.worse == ["runs/quickstart"]
    assert worse.verdicts().loc["runs/quickstart", "worse"] > 0
    text = worse.describe()
    assert "runs/quickstart vs runs/sweep/001_mode=b: WORSE" in text
    assert "side_b.autocast" in text
    summary = worse.summary()
    assert summary.loc["runs/quickstart", "model_output_rel_max"] > 0
    fig = worse.plot_overlay(backend="plotly")
    names = {t.name for t in fig.data}
    assert {"runs/sweep/001_mode=b", "runs/quickstart"} <= names


def test_compare_runs_of_different_models_has_no_verdict(tree, flux_pair) -> None:
    other = lab.pair_family("wan2_2", "tiny")
    cmp = runs.compare_runs({"flux": flux_pair[0], "wan": other})
    assert cmp.verdicts().loc["wan", "verdict"] == "not comparable"
    assert "not comparable per module" in cmp.describe()
    with pytest.raises(ValueError, match="cannot be held against 'flux'"):
        cmp.worse  # noqa: B018
    assert "meta.family" in cmp.settings_diff().index


def test_compare_runs_needs_two_and_known_names(tree) -> None:
    with pytest.raises(ValueError, match="need two or more runs"):
        runs.compare_runs(["runs/quickstart"], root=tree["root"])
    with pytest.raises(ValueError, match="no saved run 'nope'"):
        runs.compare_runs(["runs/quickstart", "nope"], root=tree["root"])
    with pytest.raises(ValueError, match="given twice"):
        runs.compare_runs(["runs/quickstart", "quickstart"], root=tree["root"])


def test_newest_picks_results_oldest_first(tree) -> None:
    saved = runs.list_runs(tree["root"], baselines=tree["baselines"])
    picked = runs.newest(saved, 2)
    assert [r.name for r in picked] == [
        "runs/param_overrides/without_rules.json",
        "runs/quickstart",
    ]
    with pytest.raises(ValueError, match="5 saved Result"):
        runs.newest(saved, 7)


def test_save_examples_only_when_fewer_runs_are_saved(tmp_path: Path, tree) -> None:
    written = runs.save_examples(tmp_path)
    assert [p.parent.name for p in written] == ["trainer", "trainer_matched"]
    results = [lab.Result.from_json(p) for p in written]
    assert results[0].output_metrics()["model_output_rel_max"] > 0
    assert results[1].output_metrics()["model_output_rel_max"] == 0
    assert runs.save_examples(tmp_path) == [], "two runs are saved now"
    assert runs.save_examples(tree["root"]) == []

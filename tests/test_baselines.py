from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lab
from lab.pairing.result import Result
from lab.views.baselines import (
    compare_to_baseline,
    list_baselines,
    load_baseline,
    save_baseline,
)

FP16_TRAINER = {"forward_dtype": "fp16", "rollout_precision": "fp16", "param_dtype": "fp16"}


@pytest.fixture(scope="module")
def result() -> Result:
    return lab.pair_family("flux")


@pytest.fixture(scope="module")
def fp16_result() -> Result:
    # The trainer in fp16 against a bf16 rollout: nearly every output drifts further.
    return lab.pair_family("flux", trainer=FP16_TRAINER)


def test_baselines_live_in_the_working_directory_never_in_the_package(
    result: Result, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: `--save-baseline NAME` from another folder wrote the checkout's data/baselines/."""
    monkeypatch.delenv("LAB_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    path = save_baseline(result, "flux_tiny")
    assert path == tmp_path / "baselines" / "flux_tiny.json" and path.is_file()
    assert list_baselines() == ["flux_tiny"]
    assert len(load_baseline("flux_tiny").rows) == len(result.rows)
    package = Path(lab.__file__).resolve().parent.parent
    assert not (package / "data" / "baselines").exists(), "baselines ship in the package again"
    monkeypatch.setenv("LAB_HOME", str(tmp_path / "home"))
    assert save_baseline(result, "moved") == tmp_path / "home" / "baselines" / "moved.json"
    assert list_baselines() == ["moved"]


def test_save_then_compare_the_same_run_finds_nothing_worse(result: Result, tmp_path: Path) -> None:
    path = save_baseline(result, "flux_tiny", directory=tmp_path)
    assert path == tmp_path / "flux_tiny.json" and path.is_file()
    assert list_baselines(tmp_path) == ["flux_tiny"]
    assert len(load_baseline("flux_tiny", directory=tmp_path).rows) == len(result.rows)

    cmp = compare_to_baseline(result, "flux_tiny", directory=tmp_path)

    assert cmp.baseline_name == "flux_tiny"
    assert cmp.ok
    assert len(cmp.table) == len(result.rows)
    assert (cmp.table["status"] == "unchanged").all()
    assert cmp.worse().empty and cmp.improved().empty
    assert cmp.summary()["unchanged"] == len(result.rows) and not cmp.settings_differ
    assert "0 worse" in cmp.describe() and "OK" in cmp.describe()


def test_a_worse_candidate_lists_the_affected_modules(
    result: Result, fp16_result: Result, tmp_path: Path
) -> None:
    save_baseline(result, "flux_tiny", directory=tmp_path)
    cmp = compare_to_baseline(fp16_result, tmp_path / "flux_tiny.json")
    worse = cmp.worse()

    base = {r.label(): r.metrics.rel_max for r in result.rows}
    cand = {r.label(): r.metrics.rel_max for r in fp16_result.rows}
    assert base["x_embedder"] == 0 < cand["x_embedder"], "x_embedder should start to diverge"
    assert not cmp.ok
    assert "x_embedder" in set(worse["label"])
    assert "<root>:0" in set(worse["label"])
    # Exactly the rule: every listed row moved past factor x baseline, and nothing else did.
    expected = {k for k in base if cand[k] > 2 * base[k]}
    assert set(worse["label"]) == expected
    assert worse["ratio"].iloc[0] == math.inf, "outputs that left bit-exactness come first"
    assert "REGRESSED" in cmp.describe() and f"worse: {worse['label'].iloc[0]}:" in cmp.describe()

    # The same pair the other way round is a fix: those outputs improved, none got worse.
    back = compare_to_baseline(result, fp16_result)
    assert back.ok and set(back.improved()["label"]) == expected


def test_factor_and_atol_loosen_the_verdict(result: Result, fp16_result: Result) -> None:
    strict = compare_to_baseline(fp16_result, result)
    loose = compare_to_baseline(fp16_result, result, factor=1e6, atol=10.0)
    assert len(loose.worse()) < len(strict.worse())
    assert loose.ok
    with pytest.raises(ValueError, match="factor must be a number >= 1"):
        compare_to_baseline(result, result, factor=0.5)
    with pytest.raises(ValueError, match=r"unknown metric 'relmax'\. Did you mean 'rel_max'"):
        compare_to_baseline(result, result, metric="relmax")


def test_missing_and_new_outputs_are_listed(result: Result) -> None:
    blocks_only = lab.pair_family("flux", capture_depth=1)
    cmp = compare_to_baseline(blocks_only, result)
    assert cmp.summary()["missing"] == len(result.rows) - len(blocks_only.rows) > 0
    assert not cmp.ok
    assert set(compare_to_baseline(result, blocks_only).rows("new")["label"]) == set(
        cmp.rows("missing")["label"]
    )


def test_another_model_is_refused_and_settings_are_listed(result: Result) -> None:
    other = lab.pair_family("wan2_2")
    with pytest.raises(
        ValueError, match=r"different models: wan2_2 \[tiny\] \(WanTransformer3DModel\) vs flux"
    ):
        compare_to_baseline(other, result)
    moved = Result(
        result.mode, result.side_a, result.side_b, result.rows, meta={**result.meta, "seed": 7}
    )
    assert compare_to_baseline(moved, result).settings_differ == {"seed": (0, 7)}


def test_a_baseline_from_another_cpu_kernel_set_is_named_as_such(
    result: Result, tmp_path: Path
) -> None:
    # The same run on a lower ATen CPU capability (CI machines differ: AVX512 or AVX2 only):
    # its reductions round differently, and the comparison says why the bits moved.
    here = torch.backends.cpu.get_cpu_capability()
    lower = {"AVX512": "avx2", "AVX2": "default"}.get(here)
    if lower is None:
        pytest.skip(f"no lower ATen capability known below {here!r}")
    path = tmp_path / "lower.json"
    code = f"import lab; lab.pair_family('flux').to_json({str(path)!r})"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": lower}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    if "pack_vnni2 is only supported" in proc.stderr:
        # torch 2.11's bf16 flash attention packs for AMX/AVX512-BF16 units whatever
        # ATEN_CPU_CAPABILITY says, and the packing refuses the AVX2 set: not emulable here.
        pytest.skip(f"bf16 attention cannot run on ATen's {lower} kernels on this CPU")
    assert proc.returncode == 0, proc.stderr
    other = Result.from_json(path)

    assert result.meta["versions"]["cpu"] == here
    assert other.meta["versions"]["cpu"] == lower.upper()
    cmp = compare_to_baseline(result, other)
    assert cmp.settings_differ == {"versions.cpu": (lower.upper(), here)}
    assert "different software or CPU kernels" in cmp.describe()
    # Not a claim on the verdict: the bits moved somewhere, with no setting of ours changed.
    moved = [
        a.module
        for a, b in zip(other.rows, result.rows, strict=True)
        if repr(dataclasses.asdict(a.metrics)) != repr(dataclasses.asdict(b.metrics))
    ]
    assert 0 < len(moved) < len(result.rows), moved


def test_names_and_overwrite_are_checked(result: Result, tmp_path: Path) -> None:
    save_baseline(result, "flux_tiny", directory=tmp_path)
    with pytest.raises(ValueError, match=r"exists\. Pass overwrite=True"):
        save_baseline(result, "flux_tiny", directory=tmp_path)
    save_baseline(result, "flux_tiny", directory=tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="not a plain file stem"):
        save_baseline(result, "../escape", directory=tmp_path)
    with pytest.raises(ValueError, match=r"Did you mean 'flux_tiny'\? Saved: \['flux_tiny'\]"):
        load_baseline("flux_tine", directory=tmp_path)


def test_two_saves_of_one_name_at_once_leave_one_baseline(result: Result, tmp_path: Path) -> None:
    # Issue 42: both passed the "exists?" check before either wrote, and both succeeded (the
    # second silently replaced the first). Now the file is created exclusively.
    import threading

    other = dataclasses.replace(result, meta={**result.meta, "seed": 1})
    start = threading.Barrier(8)
    outcomes: list[Any] = [None] * 8

    def save(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = save_baseline(other if i % 2 else result, "race", directory=tmp_path)
        except ValueError as err:
            outcomes[i] = err

    threads = [threading.Thread(target=save, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saved = [o for o in outcomes if isinstance(o, Path)]
    refused = [o for o in outcomes if isinstance(o, ValueError)]
    assert len(saved) == 1 and len(refused) == 7, outcomes
    assert all("exists. Pass overwrite=True" in str(e) for e in refused)
    winner = outcomes.index(saved[0])
    kept = load_baseline("race", directory=tmp_path)
    assert kept.meta["seed"] == (1 if winner % 2 else result.meta.get("seed"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["race.json"], "a temporary stayed"

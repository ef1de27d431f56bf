"""Dumps: written in another process, they pair like a live side; bad dumps say what differs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lab
from lab.dump import DumpError, attach, load_dump, pair_dump, pair_dumps
from lab.run import forward_side

# The reference side runs the SD3-shaped sgld group on Qwen-Image, which the trainer does not
# match: the pair has real divergences to reproduce (root rel ~4.6e-3), not just zeros.
_WRITER = textwrap.dedent(
    """
    import json, sys
    import lab
    from lab.dump import attach
    from lab.run import forward_side
    from lab.sides import Side

    directory, side_json = sys.argv[1], sys.argv[2]
    fam = lab.family("qwen_image")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    side = Side.from_dict(json.loads(side_json))
    with attach(model, directory, step=3, cfg_branch="cond") as handle:
        forward_side(model, inputs, side)
        handle.set(cfg_branch="uncond")
        forward_side(model, inputs.negative or inputs, side)
    """
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    fam = lab.family("qwen_image")
    model, inputs = fam.build("tiny", 0), fam.make_inputs("tiny", 0)
    rollout = lab.Side.rollout(fam, engine_ops=("sgld",))
    directory = tmp_path_factory.mktemp("dump") / "rollout"
    subprocess.run(
        [sys.executable, "-c", _WRITER, str(directory), json.dumps(rollout.to_dict())],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return dict(fam=fam, model=model, inputs=inputs, rollout=rollout, directory=directory)


def _key_metrics(result: lab.Result) -> list[tuple]:
    return [
        (r.module, r.call, r.output, r.dtype_a, r.dtype_b, r.metrics.max_abs_diff,
         r.metrics.max_ulp, r.metrics.bitexact_frac)
        for r in result.rows
    ]  # fmt: skip


def test_dump_from_another_process_pairs_like_the_live_side(setup: dict) -> None:
    trainer = lab.Side.trainer(setup["fam"])
    from_dump = pair_dump(setup["directory"], setup["model"], setup["inputs"], trainer, step=3,
                          cfg_branch="cond")  # fmt: skip
    live = lab.pair(setup["model"], setup["inputs"], setup["rollout"], trainer)

    assert len(from_dump.rows) == len(live.rows) > 60
    assert _key_metrics(from_dump) == _key_metrics(live)
    assert from_dump.output_metrics()["model_output_rel_max"] > 1e-3
    assert from_dump.first_divergent_module == live.first_divergent_module


def test_manifest_records_step_branch_dtype_and_shape(setup: dict) -> None:
    dump = load_dump(setup["directory"])
    entries = dump.manifest["entries"]
    root = [e for e in entries if e["module"] == "<root>"]

    assert {(e["step"], e["cfg_branch"]) for e in entries} == {(3, "cond"), (3, "uncond")}
    assert [e["forward"] for e in root] == [0, 1]
    assert root[0]["dtype"] == "bf16" and root[0]["shape"] == [1, 64, 16]
    assert any(e["complex"] for e in entries), "the RoPE tables are complex"


def test_two_dumps_pair_bitwise_with_themselves_and_differ_across_branches(setup: dict) -> None:
    same = pair_dumps(setup["directory"], setup["directory"], cfg_branch="uncond")
    assert len(same.rows) > 60 and same.first_divergence() is None

    with pytest.raises(DumpError, match=r"no forward with step=7.*\(3, 'cond'\)"):
        pair_dumps(setup["directory"], setup["directory"], step=7)


def test_live_side_against_its_own_dump_is_bitwise(setup: dict, tmp_path: Path) -> None:
    model, inputs, rollout = setup["model"], setup["inputs"], setup["rollout"]
    with attach(model, tmp_path / "again"):
        forward_side(model, inputs, rollout)
    result = pair_dump(tmp_path / "again", model, inputs, rollout)

    assert len(result.rows) > 60 and result.first_divergence() is None


def test_manifest_and_file_disagreement_is_listed(setup: dict, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(setup["directory"], broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["entries"][0]["shape"] = [9, 9]
    manifest["entries"][1]["key"] = "img_in#7:"
    (broken / "manifest.json").write_text(json.dumps(manifest))

    with pytest.raises(DumpError, match=r"disagree in 2 place\(s\).*holds bf16 \[1, 64, 48\]"):
        load_dump(broken)
    with pytest.raises(DumpError, match=r"img_in#7:: not in forward_00000.safetensors"):
        load_dump(broken)


def test_dump_from_a_different_model_lists_the_differences(setup: dict) -> None:
    fam = setup["fam"]
    config = {**fam.config("tiny"), "num_layers": 1}
    torch.manual_seed(0)
    smaller = fam.model_cls()(**config).eval()

    with pytest.raises(DumpError, match=r"Only in the dump \(\d+\): 'transformer_blocks.1'"):
        pair_dump(setup["directory"], smaller, setup["inputs"], lab.Side.trainer(fam))

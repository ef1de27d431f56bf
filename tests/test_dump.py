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
from lab.engine.dump import DumpError, attach, load_dump, pair_dump, pair_dumps, tensor_fingerprint
from lab.pairing.run import forward_side

# The reference side runs the SD3-shaped sgld group on Qwen-Image, which the trainer does not
# match: the pair has real divergences to reproduce (root rel ~4.6e-3), not just zeros.
_WRITER = textwrap.dedent(
    """
    import json, sys
    import lab
    from lab.engine.dump import attach
    from lab.pairing.run import forward_side
    from lab.pairing.sides import Side

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


# ---- issue 14: overwrite, fingerprints, confined paths, unpaired outputs, torn files ------------


def _copy(setup: dict, tmp_path: Path, name: str = "copy") -> Path:
    import shutil

    return Path(shutil.copytree(setup["directory"], tmp_path / name))


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def _rewrite(directory: Path, manifest: dict) -> None:
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_dumping_into_a_dump_is_refused_unless_overwrite(setup: dict, tmp_path: Path) -> None:
    folder = _copy(setup, tmp_path)
    before = _manifest(folder)
    assert len({e["forward"] for e in before["entries"]}) == 2

    with pytest.raises(DumpError, match=r"already holds a dump .*overwrite=True"):
        attach(setup["model"], folder)
    assert _manifest(folder) == before, "a refused attach must leave the old dump untouched"

    with attach(setup["model"], folder, overwrite=True):
        forward_side(setup["model"], setup["inputs"], setup["rollout"])
    after = _manifest(folder)
    assert {e["forward"] for e in after["entries"]} == {0}
    assert not (folder / "forward_00001.safetensors").exists(), "a stale forward stayed behind"
    assert len(pair_dump(folder, setup["model"], setup["inputs"], setup["rollout"]).rows) > 60


def test_manifest_records_weight_and_input_fingerprints(setup: dict) -> None:
    manifest = load_dump(setup["directory"]).manifest
    params = dict(setup["model"].named_parameters())
    recorded = manifest["weights"]["parameters"]

    assert set(recorded) == set(params)
    name = "transformer_blocks.0.attn.to_q.weight"
    # Taken as the forward starts: the weights it ran with, the rollout side's bf16 casts.
    assert recorded[name] == tensor_fingerprint(params[name].bfloat16())
    assert set(recorded[name]["hashes"]) == {"bf16"}
    assert manifest["weights_taken"] == "forward 0"
    forwards = manifest["forwards"]
    assert all("weights" not in f for f in forwards), "both forwards ran the same weights"
    assert [(f["forward"], f["cfg_branch"]) for f in forwards] == [(0, "cond"), (1, "uncond")]
    # The rollout side hands the model bf16 latents: the fingerprint is of what the model saw.
    hidden = forwards[0]["inputs"]["hidden_states"]
    assert hidden["dtype"] == "bf16" and hidden["shape"] == [1, 64, 16]
    assert hidden == tensor_fingerprint(setup["inputs"].kwargs["hidden_states"].bfloat16())


def test_fingerprint_covers_every_element_and_matches_across_casts() -> None:
    gen = torch.Generator().manual_seed(0)
    # Over 2**22 16-bit words: the checksum runs in more than one chunk.
    t = torch.randn(2_500_000, generator=gen)
    base = tensor_fingerprint(t)
    assert tensor_fingerprint(t.clone()) == base
    assert tensor_fingerprint(t.bfloat16())["hashes"]["bf16"] == base["hashes"]["bf16"]
    assert tensor_fingerprint(t.half())["hashes"]["fp16"] == base["hashes"]["fp16"]
    for changed in (
        torch.cat([t[:-1], t[-1:] + 1]),  # the last element of the last chunk
        torch.cat([t[1:2], t[:1], t[2:]]),  # two elements swapped
        t.reshape(1000, 2500).t().reshape(-1),  # same values, other order
    ):
        assert tensor_fingerprint(changed)["hashes"]["fp32"] != base["hashes"]["fp32"]
    # The chunked int64 sums equal the one-shot sums in Python integers.
    words = [int(w) & 0xFFFF for w in t[:300_000].view(torch.int16).tolist()]
    total = sum(words)
    weighted = sum(w * (i % 65521 + 1) for i, w in enumerate(words)) % ((1 << 61) - 1)
    import hashlib

    expected = hashlib.blake2b(f"{len(words)}:{total}:{weighted}".encode(), digest_size=8)
    assert tensor_fingerprint(t[:300_000])["hashes"]["fp32"] == expected.hexdigest()


def test_dump_of_other_weights_is_refused_or_flagged(setup: dict) -> None:
    fam, inputs = setup["fam"], setup["inputs"]
    other = fam.build("tiny", 1)
    trainer = lab.Side.trainer(fam)

    with pytest.raises(DumpError, match=r"other weights or inputs: \d+ difference.*weights '"):
        pair_dump(setup["directory"], other, inputs, trainer, step=3, cfg_branch="cond")
    with pytest.warns(UserWarning, match="Compared anyway"):
        flagged = pair_dump(setup["directory"], other, inputs, trainer, cfg_branch="cond",
                            allow_mismatch=True)  # fmt: skip
    assert flagged.meta["dump_checks"]["weights"].startswith("differ")
    assert flagged.meta["dump_checks"]["inputs"] == "match"
    differing = [
        n for (n, p), q in zip(other.named_parameters(), setup["model"].parameters(), strict=True)
        if not torch.equal(p, q)
    ]  # fmt: skip
    assert differing, "seed 1 gave the same weights: this test would pass vacuously"
    assert [m.split("'")[1] for m in flagged.meta["dump_mismatch"]] == differing
    assert len(flagged.rows) > 60


def test_dump_of_other_inputs_is_refused(setup: dict) -> None:
    fam = setup["fam"]
    other_inputs = fam.make_inputs("tiny", 1)
    with pytest.raises(DumpError, match=r"inputs 'hidden_states': values differ"):
        pair_dump(setup["directory"], setup["model"], other_inputs, lab.Side.trainer(fam))
    ok = pair_dump(setup["directory"], setup["model"], setup["inputs"], lab.Side.trainer(fam))
    assert ok.meta["dump_checks"] == {"weights": "match", "inputs": "match", "unchecked": []}


def _wider(setup: dict) -> torch.nn.Module:
    fam = setup["fam"]
    torch.manual_seed(0)
    # Same module names and the same inputs fit, every attention width differs.
    return fam.model_cls()(**{**fam.config("tiny"), "num_attention_heads": 4}).eval()


def test_dump_of_another_width_reports_shapes_first_and_no_divergence(setup: dict) -> None:
    wider, inputs, trainer = _wider(setup), setup["inputs"], lab.Side.trainer(setup["fam"])
    with pytest.raises(DumpError, match=r"another width or config.*shapes first: weights '.*shape"):
        pair_dump(setup["directory"], wider, inputs, trainer, cfg_branch="cond")

    with pytest.warns(UserWarning):
        result = pair_dump(setup["directory"], wider, inputs, trainer, cfg_branch="cond",
                           allow_mismatch=True)  # fmt: skip
    assert result.rows == [] and result.first_divergence() is None
    shape_skips = [s for s in result.skipped if s.reason.startswith("shape differs")]
    assert shape_skips and result.skipped[: len(shape_skips)] == shape_skips
    assert "(1, 64, 48) in the dump (dump) vs (1, 64, 64)" in " ".join(
        s.reason for s in shape_skips
    )
    assert all("not compared" in s.reason for s in result.skipped[len(shape_skips) :])


def test_dump_without_fingerprints_still_refuses_other_output_shapes(
    setup: dict, tmp_path: Path
) -> None:
    folder = _copy(setup, tmp_path)
    manifest = _manifest(folder)
    manifest["schema"] = "precision-lab/dump/1"
    for key in ("weights", "weights_unavailable", "forwards"):
        manifest.pop(key)
    _rewrite(folder, manifest)
    trainer = lab.Side.trainer(setup["fam"])

    with pytest.raises(DumpError, match=r"another width.*shapes first: output .*shape differs"):
        pair_dump(folder, _wider(setup), setup["inputs"], trainer, cfg_branch="cond")
    same = pair_dump(folder, setup["model"], setup["inputs"], trainer, cfg_branch="cond")
    assert same.meta["dump_checks"]["weights"] == "unchecked"
    assert "before fingerprints" in same.meta["dump_checks"]["unchecked"][0]


@pytest.mark.parametrize("bad", ["../forward_00000.safetensors", "/etc/passwd", "sub/../../x"])
def test_manifest_file_paths_stay_inside_the_dump(setup: dict, tmp_path: Path, bad: str) -> None:
    folder = _copy(setup, tmp_path / "inner")
    manifest = _manifest(folder)
    manifest["entries"][0]["file"] = bad
    _rewrite(folder, manifest)
    with pytest.raises(DumpError, match=r"entries\[0\]\.file .* points outside the dump"):
        load_dump(folder)


def test_dropped_manifest_entries_and_unpaired_outputs_are_skipped(
    setup: dict, tmp_path: Path
) -> None:
    folder = _copy(setup, tmp_path)
    manifest = _manifest(folder)
    dropped = [e for e in manifest["entries"] if e["forward"] == 0][5:8]
    manifest["entries"] = [e for e in manifest["entries"] if e not in dropped]
    _rewrite(folder, manifest)
    keys = {(e["module"], e["call"], e["output"]) for e in dropped}
    model, inputs, rollout = setup["model"], setup["inputs"], setup["rollout"]

    live = pair_dump(folder, model, inputs, rollout, cfg_branch="cond")
    assert {(s.module, s.call, s.output) for s in live.skipped} == keys
    assert all("not in its manifest (a dropped entry)" in s.reason for s in live.skipped)

    # Either side of a dump pair: the outputs the other one lacks are listed, never dropped.
    for a, b, side in (
        (setup["directory"], folder, "dump B"),
        (folder, setup["directory"], "dump A"),
    ):
        result = pair_dumps(a, b, cfg_branch="cond")
        assert {(s.module, s.call, s.output) for s in result.skipped} == keys
        assert all(f"in {side}'s forward_00000" in s.reason for s in result.skipped)
        assert len(result.rows) + len(result.skipped) == len(live.rows) + len(live.skipped)


def test_truncated_forward_file_and_manifest_name_the_file(setup: dict, tmp_path: Path) -> None:
    folder = _copy(setup, tmp_path)
    forward = folder / "forward_00001.safetensors"
    forward.write_bytes(forward.read_bytes()[:1000])
    with pytest.raises(
        DumpError, match=r"forward_00001\.safetensors \(1000 bytes\) cannot be read"
    ):
        load_dump(folder)

    manifest = folder / "manifest.json"
    manifest.write_text(manifest.read_text()[:500])
    with pytest.raises(DumpError, match=r"manifest\.json is not valid JSON .*truncated"):
        load_dump(folder)
    manifest.write_text("")
    with pytest.raises(DumpError, match=r"manifest\.json is empty"):
        load_dump(folder)


def test_full_disk_during_a_dump_keeps_the_earlier_forwards(
    setup: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    import safetensors.torch

    model, inputs, rollout = setup["model"], setup["inputs"], setup["rollout"]
    folder = tmp_path / "d"
    handle = attach(model, folder)
    forward_side(model, inputs, rollout)
    complete = _manifest(folder)

    real_save = safetensors.torch.save_file

    def save_then_fail(tensors: dict, filename: str, *args, **kwargs) -> None:
        real_save(tensors, filename, *args, **kwargs)
        with open(filename, "r+b") as f:  # a torn file, as a full disk leaves it
            f.truncate(os.path.getsize(filename) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_fail)
    with pytest.raises(OSError, match="No space"):
        forward_side(model, inputs, rollout)
    monkeypatch.undo()
    assert _manifest(folder) == complete
    assert not (folder / "forward_00001.safetensors").exists()

    def write_fails(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write_fails)
    with pytest.raises(OSError, match="No space"):
        handle.write_manifest()
    monkeypatch.undo()
    handle.detach()
    assert sorted(p.name for p in folder.iterdir()) == [
        "forward_00000.safetensors",
        "manifest.json",
    ]
    assert len(pair_dump(folder, model, inputs, rollout).rows) > 60


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_fingerprint_is_the_same_on_cpu_and_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    # 3M elements: several checksum chunks for every dtype.
    t = (torch.randn(3_000_000, generator=gen) * 100).to(dtype)
    on_cpu, on_gpu = tensor_fingerprint(t), tensor_fingerprint(t.cuda())
    assert on_cpu == on_gpu
    assert len(on_cpu["hashes"]) == (3 if dtype == torch.float32 else 1)


def test_fingerprint_of_a_stride_zero_tensor_equals_its_contiguous_copy() -> None:
    from lab.engine.dump import _checksum

    # Wan's timestep arrives as an expanded one-element tensor (stride 0): a dtype view of it
    # used to raise instead of fingerprinting it.
    value = torch.tensor([750.0])
    expanded = torch.tensor(750.0).expand(1)
    assert expanded.stride() == (0,)
    assert _checksum(expanded) == _checksum(value)
    assert _checksum(expanded) != _checksum(torch.tensor([751.0]))

"""Issue 14, data side: atomic writes, checkpoint loading, clear errors on broken files."""

from __future__ import annotations

import errno
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import lab
from lab.base.atomic import atomic_path, atomic_write_bytes, atomic_write_text
from lab.base.errors import CheckpointError
from lab.pairing.result import Result
from lab.views.baselines import load_baseline, save_baseline


def _enospc_after(monkeypatch: pytest.MonkeyPatch, real_bytes: int) -> None:
    """Make writes put `real_bytes` on disk, then fail as a full disk does.

    Patches both ways a file gets written: os.write (lab.base.atomic) and io.open in a write mode
    (Path.write_text, open(...).write), so the same fault reaches any writer.
    """
    real_write, real_open = os.write, io.open
    left = {"n": real_bytes}

    def write(fd: int, data: bytes) -> int:
        if left["n"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(data[: left["n"]]))
        left["n"] -= n
        return n

    class FullDiskFile:
        def __init__(self, file: Any) -> None:
            self._file = file

        def write(self, data: Any) -> int:
            room = max(left["n"], 0)
            left["n"] -= len(data)
            self._file.write(data[:room])
            self._file.flush()
            if left["n"] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(data)

        def __enter__(self) -> FullDiskFile:
            return self

        def __exit__(self, *exc: Any) -> None:
            self._file.close()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        return FullDiskFile(handle) if any(c in mode for c in "wax+") else handle

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(io, "open", open_)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# ---- lab.base.atomic -----------------------------------------------------------------------------


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "a.json"
    assert atomic_write_text(target, "old") == target
    atomic_write_text(target, "new ü")
    assert target.read_text(encoding="utf-8") == "new ü"
    assert _leftovers(target.parent) == []
    assert (target.stat().st_mode & 0o777) == (0o666 & ~_umask())


def test_full_disk_mid_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "a.bin"
    atomic_write_bytes(target, b"old contents")
    _enospc_after(monkeypatch, 3)
    with pytest.raises(OSError) as err:
        atomic_write_bytes(target, b"x" * 5000)
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert target.read_bytes() == b"old contents"
    assert _leftovers(tmp_path) == []


def test_fsync_failure_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "a.txt"
    atomic_write_text(target, "old")

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_atomic_path_keeps_suffix_and_cleans_up_on_error(tmp_path: Path) -> None:
    target = tmp_path / "fig.png"
    target.write_bytes(b"old png")
    with pytest.raises(RuntimeError, match="writer broke"):
        with atomic_path(target) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp != target
            tmp.write_bytes(b"half")
            raise RuntimeError("writer broke")
    assert target.read_bytes() == b"old png"
    assert _leftovers(tmp_path) == []
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new png")
    assert target.read_bytes() == b"new png"
    assert _leftovers(tmp_path) == []


def test_atomic_path_refuses_a_writer_that_removed_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "t.csv"
    target.write_text("old")
    with pytest.raises(FileNotFoundError, match="left no file"):
        with atomic_path(target) as tmp:
            tmp.unlink()
    assert target.read_text() == "old"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- item 1: fam.load reads exactly what from_pretrained reads -------------------------------


def _equal_states(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def flux_model() -> torch.nn.Module:
    return lab.family("flux").build("tiny", seed=5)


@pytest.fixture
def crowded_dir(flux_model: torch.nn.Module, tmp_path: Path) -> Path:
    """An fp32 sharded save, an fp16 variant save and a stray EMA file in one folder."""
    folder = tmp_path / "ckpt"
    flux_model.save_pretrained(folder, max_shard_size="40KB")
    half = lab.family("flux").build("tiny", seed=5).to(torch.float16)
    half.save_pretrained(folder, variant="fp16", max_shard_size="40KB")
    ema = {k: torch.zeros_like(v) for k, v in flux_model.state_dict().items() if "proj_out" in k}
    save_file(ema, str(folder / "zzz_ema.safetensors"))
    return folder


def test_load_reads_the_index_and_ignores_variants_and_strays(
    flux_model: torch.nn.Module, crowded_dir: Path
) -> None:
    index = json.loads((crowded_dir / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "the save is not sharded: this test would not exercise the index"

    loaded = lab.family("flux").load(crowded_dir)

    assert _equal_states(flux_model, loaded), "fp16 or EMA weights leaked into the fp32 master"
    info = loaded.lab_checkpoint
    assert (
        info["files"] == shards
        and info["index"] == "diffusion_pytorch_model.safetensors.index.json"
    )
    assert info["variant"] is None and info["class_name"] == "FluxTransformer2DModel"
    assert info["dtypes"] == {"fp32": len(flux_model.state_dict())}


def test_load_variant_reads_only_the_variant(
    flux_model: torch.nn.Module, crowded_dir: Path
) -> None:
    loaded = lab.family("flux").load(crowded_dir, variant="fp16")

    info = loaded.lab_checkpoint
    assert info["index"] == "diffusion_pytorch_model.safetensors.index.fp16.json"
    assert all(f.startswith("diffusion_pytorch_model.fp16-") for f in info["files"])
    assert info["dtypes"] == {"fp16": len(flux_model.state_dict())}
    half = {k: v.half().float() for k, v in flux_model.state_dict().items()}
    assert all(torch.equal(half[k], v) for k, v in loaded.state_dict().items())
    assert next(loaded.parameters()).dtype == torch.float32, "the master is fp32 regardless"


def test_load_single_file_variant_and_legacy_index(
    flux_model: torch.nn.Module, tmp_path: Path
) -> None:
    fam = lab.family("flux")
    flux_model.to(torch.bfloat16).save_pretrained(tmp_path / "one", variant="bf16")
    flux_model.float()
    assert fam.load(tmp_path / "one", variant="bf16").lab_checkpoint["files"] == [
        "diffusion_pytorch_model.bf16.safetensors"
    ]
    with pytest.raises(FileNotFoundError, match=r"Variants there: \['bf16'\]; pass variant="):
        fam.load(tmp_path / "one")

    # diffusers still reads the pre-0.27 sharded variant index name.
    flux_model.save_pretrained(tmp_path / "legacy", variant="fp32", max_shard_size="40KB")
    old = tmp_path / "legacy" / "diffusion_pytorch_model.safetensors.index.fp32.json"
    old.rename(tmp_path / "legacy" / "diffusion_pytorch_model.safetensors.fp32.index.json")
    loaded = fam.load(tmp_path / "legacy", variant="fp32")
    assert loaded.lab_checkpoint["index"] == "diffusion_pytorch_model.safetensors.fp32.index.json"
    assert _equal_states(flux_model, loaded)


def test_load_pipeline_folder_uses_its_transformer_subfolder(
    flux_model: torch.nn.Module, tmp_path: Path
) -> None:
    flux_model.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    fam = lab.family("flux")
    loaded = fam.load(tmp_path / "pipe")
    assert loaded.lab_checkpoint["directory"] == str(tmp_path / "pipe" / "transformer")
    assert _equal_states(flux_model, loaded)
    with pytest.raises(FileNotFoundError, match="transformer_2"):
        fam.load(tmp_path / "pipe", subfolder="transformer_2")


def test_load_another_family_checkpoint_names_both(tmp_path: Path) -> None:
    lab.family("wan2_2").build("tiny").save_pretrained(tmp_path / "wan")
    with pytest.raises(CheckpointError) as err:
        lab.family("qwen_image").load(tmp_path / "wan")
    msg = str(err.value)
    assert "WanTransformer3DModel" in msg and "QwenImageTransformer2DModel" in msg
    assert "lab.family('wan2_2').load" in msg


def test_truncated_checkpoint_shard_names_the_file(
    flux_model: torch.nn.Module, tmp_path: Path
) -> None:
    flux_model.save_pretrained(tmp_path / "c")
    weights = tmp_path / "c" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors.*truncated"):
        lab.family("flux").load(tmp_path / "c")


def test_index_naming_a_file_outside_the_folder_is_refused(
    flux_model: torch.nn.Module, tmp_path: Path
) -> None:
    flux_model.save_pretrained(tmp_path / "c", max_shard_size="40KB")
    index_path = tmp_path / "c" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"outside its folder: \['\.\./outside"):
        lab.family("flux").load(tmp_path / "c")


def test_pair_family_checkpoint_builds_inputs_from_its_config(tmp_path: Path) -> None:
    fam = lab.family("flux")
    # Another width than the tiny preset: text and pooled widths differ.
    cfg = {**fam.config("tiny"), "joint_attention_dim": 24, "pooled_projection_dim": 20}
    torch.manual_seed(0)
    fam.model_cls()(**cfg).save_pretrained(tmp_path / "wide")

    result = lab.pair_family("flux", checkpoint=str(tmp_path / "wide"))

    assert result.rows, "no module was captured"
    ctx = next(r for r in result.rows if r.module == "context_embedder")
    assert ctx.shape[-1] == fam.config("tiny")["num_attention_heads"] * 16
    assert result.meta["checkpoint"] == str(tmp_path / "wide")
    provenance = result.meta["checkpoint_files"]
    assert provenance["files"] == ["diffusion_pytorch_model.safetensors"]
    n_tensors = len(lab.family("flux").load(tmp_path / "wide").state_dict())
    assert provenance["dtypes"] == {"fp32": n_tensors}


# ---- item 7 + raw errors: results and baselines -----------------------------------------------


@pytest.fixture(scope="module")
def result() -> Result:
    return lab.pair_family("flux")


def test_to_json_on_a_full_disk_keeps_the_old_file(
    result: Result, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = result.to_json(tmp_path / "result.json")
    before = path.read_bytes()
    assert len(before) > 4096, "the document should be larger than the partial write below"
    _enospc_after(monkeypatch, 4096)
    with pytest.raises(OSError):
        result.to_json(path)
    with pytest.raises(OSError):
        result.to_json(tmp_path / "fresh.json")
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert not (tmp_path / "fresh.json").exists(), "a failed first write left a file behind"
    assert _leftovers(tmp_path) == []
    assert len(Result.from_json(path).rows) == len(result.rows)


def test_to_json_with_an_unserializable_meta_writes_nothing(result: Result, tmp_path: Path) -> None:
    bad = Result(result.mode, result.side_a, result.side_b, result.rows, [], {"x": object()})
    with pytest.raises(TypeError):
        bad.to_json(tmp_path / "r.json")
    assert list(tmp_path.iterdir()) == []


def test_save_baseline_overwrite_on_a_full_disk_keeps_the_old_baseline(
    result: Result, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_baseline(result, "flux_tiny", directory=tmp_path)
    before = path.read_bytes()
    _enospc_after(monkeypatch, 100)
    with pytest.raises(OSError):
        save_baseline(result, "flux_tiny", directory=tmp_path, overwrite=True)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []
    assert len(load_baseline("flux_tiny", directory=tmp_path).rows) == len(result.rows)


def test_from_json_on_empty_truncated_and_foreign_files_names_the_file(
    result: Result, tmp_path: Path
) -> None:
    full = result.to_json(tmp_path / "full.json").read_bytes()
    cases = {
        "empty.json": (b"", r"the file is empty \(0 bytes\)"),
        "blank.json": (b"\n  \n", r"the file is empty"),
        "cut.json": (full[: len(full) // 2], r"not valid JSON \(.*line \d+.*truncated"),
        "picture.json": (b"\x89PNG\r\n\x1a\n\x00\x00\xff", r"not a UTF-8 text file"),
        "list.json": (b"[1, 2]", r"expected a JSON object .*got list"),
        "other.json": (b'{"schema": "precision-lab/dump/1"}', r"schema 'precision-lab/dump/1'"),
    }
    for name, (data, pattern) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=pattern) as err:
            Result.from_json(tmp_path / name)
        assert str(tmp_path / name) in str(err.value), name
    # A torn write can stop anywhere (mid-number, mid-keyword, mid-string, after a comma): every
    # cut is named as one, and a complete but malformed document is not.
    for fraction in (0.1, 0.23, 0.37, 0.5, 0.61, 0.77, 0.9, 0.999):
        cut = tmp_path / f"cut_{fraction}.json"
        cut.write_bytes(full[: int(len(full) * fraction)])
        with pytest.raises(ValueError, match=r"the file is truncated"):
            Result.from_json(cut)
    body = full.rstrip()
    ends = [len(body) - n for n in range(1, 40)]
    # Cuts the decoder reports before the end: after a number's point or exponent sign, inside
    # a keyword (CI met "Expecting ',' delimiter" on a cut after "0.").
    for token in (rb"\d\.", rb"\de-", rb"tru", rb"fals", rb"nul"):
        ends += [m.end() for m in re.finditer(token, body)][:3]
    assert len(ends) > 45
    for end in ends:
        cut.write_bytes(body[:end])
        with pytest.raises(ValueError, match=r"the file is truncated"):
            Result.from_json(cut)
    malformed = tmp_path / "malformed.json"
    malformed.write_bytes(full.replace(b",", b";", 1))
    with pytest.raises(ValueError, match=r"not valid JSON") as err:
        Result.from_json(malformed)
    assert "truncated" not in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"missing\.json.*no such file"):
        Result.from_json(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="is a directory"):
        Result.from_json(tmp_path)


def test_from_json_checks_field_types(result: Result, tmp_path: Path) -> None:
    doc = result.to_dict()
    doc["rows"][0]["max_ulp"] = "abc"
    doc["rows"][1]["shape"] = "4 by 8"
    doc["rows"][2]["degenerate"] = 1
    del doc["rows"][3]["module"]
    doc["skipped"] = [{"module": "x", "call": "0", "output": "", "reason": "r"}]
    doc["side_a"] = "rollout"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        Result.from_json(tmp_path / "bad.json")
    msg = str(err.value)
    assert "bad.json" in msg and "6 problem(s)" in msg
    for place in (
        "side_a: expected object",
        "rows[0].max_ulp: expected number, got 'abc'",
        "rows[1].shape: expected shape",
        "rows[2].degenerate: expected bool, got 1",
        "rows[3].module: missing",
        "skipped[0].call: expected int, got '0'",
    ):
        assert place in msg, place


def test_from_json_accepts_rows_with_and_without_extra_keys(result: Result, tmp_path: Path) -> None:
    doc = result.to_dict()
    doc["rows"][0]["why"] = "bf16 weights on the candidate side"
    doc["rows"][0]["why_codes"] = []
    doc["rows"][1].pop("why", None)
    doc["rows"][1].pop("why_codes", None)
    (tmp_path / "r.json").write_text(json.dumps(doc))
    back = Result.from_json(tmp_path / "r.json")
    assert [r.row()["max_ulp"] for r in back.rows] == [r.row()["max_ulp"] for r in result.rows]


def test_a_temporary_left_by_a_killed_writer_is_not_a_baseline(
    result: Result, tmp_path: Path
) -> None:
    from lab.views.baselines import list_baselines

    save_baseline(result, "flux_tiny", directory=tmp_path)
    (tmp_path / ".flux_tiny.0a1b2c3d.tmp.json").write_text('{"sche')  # kill -9 mid-write
    assert list_baselines(tmp_path) == ["flux_tiny"]

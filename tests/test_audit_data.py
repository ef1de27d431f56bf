"""Issue 14, data side: atomic writes, checkpoint loading, clear errors on broken files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lab.atomic import atomic_path, atomic_write_bytes, atomic_write_text


def _enospc_after(monkeypatch: pytest.MonkeyPatch, real_bytes: int) -> None:
    """Make os.write put `real_bytes` on disk, then fail as a full disk does."""
    real_write = os.write
    left = {"n": real_bytes}

    def write(fd: int, data: bytes) -> int:
        if left["n"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(data[: left["n"]]))
        left["n"] -= n
        return n

    monkeypatch.setattr(os, "write", write)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# ---- lab.atomic -------------------------------------------------------------------------------


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

import json  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import lab  # noqa: E402
from lab.errors import CheckpointError  # noqa: E402


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
    assert info["files"] == shards and info["index"] == "diffusion_pytorch_model.safetensors.index.json"
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

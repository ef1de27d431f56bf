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

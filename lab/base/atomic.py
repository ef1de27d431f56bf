"""Atomic file writes: a reader sees the old file or the complete new one, never a torn one.

Every file the lab writes (result.json, baselines, dump manifests and tensors, reports, sweep
tables, figures) goes through one mechanism: write a temporary file in the target's directory,
flush and fsync it, `os.replace` it onto the target, then fsync the directory so the rename itself
survives a crash. On any exception (a full disk, a writer that raises, Ctrl-C) the temporary is
removed and the old file is left exactly as it was.

    atomic_write_text(path, json.dumps(doc))
    atomic_write_bytes(path, payload)
    with atomic_path("table.csv") as tmp:       # for writers that take a file name
        frame.to_csv(tmp, index=False)

The temporary is `.<name>.<random>.tmp<suffix>` beside the target: same filesystem (so the rename
is atomic), hidden, and with the target's suffix so writers that pick a format by suffix
(matplotlib's savefig, pandas' compression="infer") still do; `<name>` is shortened so the
temporary's name fits wherever the target's does. It is created with mode 0o666 minus the umask,
as `open(path, "w")` would.

A target that is a symlink is written through: its target file gets the new contents and the
link stays (replacing the link itself would leave the file it points at stale). A failure names
the path the caller gave, never the temporary. `check_file_path` refuses, before any work, a
path that cannot be written at all (a folder, a read-only or missing place, a name too long).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

_CHUNK = 1 << 20
"""Bytes per os.write call (a short write is retried from where it stopped)."""


def atomic_write_bytes(path: str | Path, data: bytes | bytearray | memoryview) -> Path:
    """Write `data` to `path` atomically (parent folders created).

    Args:
        path: The file to write or replace.
        data: The complete new contents.

    Returns:
        The path written.

    Raises:
        OSError: The write, fsync or rename failed (e.g. ENOSPC); `path` is unchanged and no
            temporary is left behind.
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_BINARY", 0))
        try:
            view = memoryview(data).cast("B")
            while view:
                written = os.write(fd, view[:_CHUNK])
                view = view[written:]
        finally:
            os.close(fd)
    return path


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically in `encoding` (parent folders created).

    Raises:
        OSError: As `atomic_write_bytes`; `path` is unchanged.
    """
    return atomic_write_bytes(path, text.encode(encoding))


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is fsynced and renamed onto `path`.

    For writers that take a file name (safetensors' save_file, matplotlib's savefig, pandas'
    to_csv). The temporary exists (empty) when yielded; the writer replaces its contents.

    Args:
        path: The file to write or replace (parent folders created).

    Yields:
        The temporary path, in the same directory and with the same suffix as `path`.

    Raises:
        FileNotFoundError: The writer removed the temporary instead of writing it.
        OSError: The fsync or rename failed; `path` is unchanged and the temporary removed.
    """
    given = Path(path)
    path = written_path(given)
    if path.is_dir():
        raise IsADirectoryError(
            errno.EISDIR, "Is a folder, not a file: name a file inside it", str(given)
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _create_temporary(path)
    except OSError as err:
        raise _named(err, given) from None
    try:
        yield tmp
        if not tmp.is_file():
            raise FileNotFoundError(
                f"atomic_path: the writer left no file to write to {str(given)!r}; it is unchanged."
            )
        try:
            _fsync_file(tmp)
            os.replace(tmp, path)
        except OSError as err:
            raise _named(err, given) from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_directory(path.parent)


def written_path(path: str | Path) -> Path:
    """The file a write to `path` changes: `path`, or the file its symlink(s) point at."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _named(err: OSError, given: Path) -> OSError:
    """The same kind of OSError, naming the path the caller gave instead of the temporary."""
    return type(err)(err.errno, err.strerror or str(err), str(given))


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) `folder`'s file system takes; 255 where it cannot say."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def _temporary_name(path: Path, token: str, limit: int) -> str:
    """`.<stem>.<token>.tmp<suffix>`, the stem cut so the name fits `limit` bytes."""
    fixed = f". .{token}.tmp{path.suffix}".encode()
    room = limit - len(fixed) + 1  # the space stands for the stem
    if room < 0:
        return f".{token}.tmp"  # a suffix longer than any name: the format is the writer's
    stem = path.stem.encode()[:room].decode("utf-8", "ignore")
    return f".{stem}.{token}.tmp{path.suffix}"


def _create_temporary(path: Path) -> Path:
    # O_EXCL on a fresh random name: two writers of one target never share a temporary.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    limit = _name_max(path.parent)
    for _ in range(100):
        tmp = path.with_name(_temporary_name(path, secrets.token_hex(4), limit))
        try:
            os.close(os.open(tmp, flags, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"atomic_path: could not create a temporary beside {str(path)!r}.")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; skipped where directories cannot be opened (Windows)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some filesystems (certain FUSE and network mounts) cannot fsync a directory; the
        # rename has happened and is as durable as that filesystem allows.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def folder_write_problem(folder: str | Path, *, keep: bool) -> str | None:
    """Why nothing can be written in `folder`, or None: tried for real, not read off modes.

    Makes the folder and a temporary file in it (permissions alone do not say it: root, /proc).
    keep=False removes the folders it made, so a refused command leaves nothing behind.
    """
    path = Path(folder).resolve()
    if path.exists() and not path.is_dir():
        return "a file, not a folder"
    made = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        return err.strerror or type(err).__name__
    finally:
        if not keep:
            for p in made:
                with contextlib.suppress(OSError):
                    p.rmdir()
    return None


def file_write_problem(path: str | Path) -> str | None:
    """Why `path` cannot be written as a file, or None: tried for real, leaving nothing behind.

    A folder, a name longer than its file system takes, or a folder that cannot be made or
    written (read-only, no permission); a symlink is judged by the file it points at.
    """
    path = written_path(path)
    if path.is_dir():
        return "it is a folder, not a file"
    name_max = _name_max(next((p for p in path.parents if p.is_dir()), Path(".")))
    if len(path.name.encode()) > name_max:
        return (
            f"its name is {len(path.name.encode())} bytes, longer than the {name_max} its file "
            "system takes"
        )
    problem = folder_write_problem(path.parent, keep=False)
    return f"its folder cannot be written ({problem})" if problem else None


def check_file_path(path: str | Path, where: str) -> Path:
    """Refuse, before any work, a file path no write can succeed at; returns it as a Path.

    Raises:
        ValueError: Naming `where`, the path as given, what is wrong and what to do.
    """
    problem = file_write_problem(path)
    if problem:
        raise ValueError(
            f"{where}: cannot write {str(path)!r}: {problem}. Choose a file path in a folder "
            "you can write."
        )
    return Path(path)

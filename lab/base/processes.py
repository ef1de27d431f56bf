"""Processes and what they hold: children that end with the caller, signals, folder locks.

Sweeps (one papermill worker per grid point) and FSDP2 launches (one process per rank) start
children that must never outlive the lab process that started them:

- `start_child` starts a process that the kernel kills when its parent dies, even by `kill -9`
  (Linux `PR_SET_PDEATHSIG`, set in the child before it runs anything), optionally as the
  leader of its own process group so everything it starts can be ended together;
- `sigterm_raises` turns SIGTERM into a `Terminated` exception (a KeyboardInterrupt) while a
  launch runs, so the same `finally` that handles Ctrl-C ends the children and removes the
  temporaries instead of the interpreter dying on the spot;
- `end_child` ends a child (and its group): SIGTERM, a grace period, then SIGKILL.

What a run holds is given back on every way out, and never shared with another run:

- `Interrupted` is the KeyboardInterrupt of a run that keeps what finished (exit 130/143);
  `signals_deferred` keeps Ctrl-C out of a few statements that must not be split;
- `holding_folder` holds an output folder for one run (a flock'd lock file naming the owner's
  pid; a dead owner's lock is stale and taken over);
- `owned_temp_dir` is a temporary folder removed on every way out, and, when its process died
  without removing it, by the next process that makes one of the same kind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived inside `sigterm_raises()`; handled wherever Ctrl-C is."""


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved here, in the parent: the child between fork and exec only calls it (no imports, no
# Python-level locks), which is what makes a preexec_fn safe enough with threads around.
_PRCTL = _load_prctl()


def _die_with(parent_pid: int) -> Callable[[], None] | None:
    if _PRCTL is None:
        return None
    prctl = _PRCTL

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the line above
            os._exit(1)

    return preexec


def start_child(
    cmd: Sequence[str], *, new_group: bool = False, **popen_kwargs: Any
) -> subprocess.Popen:
    """Start `cmd` so that it is killed (SIGKILL) when this process dies, however it dies.

    The signal is tied to the calling thread: call this from the thread that also waits for
    the child (on Linux the kernel sends it when the thread that forked the child exits). On
    other systems the child is started plainly.

    Args:
        cmd: The command line.
        new_group: Start the child as the leader of a new session and process group, so
            `end_child(proc, group=True)` also ends everything the child started in it.
        **popen_kwargs: Passed to subprocess.Popen (env, cwd, stdout, stderr, pass_fds...).

    Returns:
        The Popen.
    """
    return subprocess.Popen(
        list(cmd),
        start_new_session=new_group,
        preexec_fn=_die_with(os.getpid()),
        **popen_kwargs,
    )


def end_child(proc: subprocess.Popen, *, group: bool = False, grace_s: float = 5.0) -> int:
    """End `proc` (and with `group`, its whole process group): SIGTERM, wait, then SIGKILL.

    Safe to call on a child that already exited. Returns its exit status (negative: the
    signal that ended it).
    """

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    if proc.poll() is None:
        send(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()
    if group:
        # Members that ignored SIGTERM, or outlived a leader that had already exited.
        send(signal.SIGKILL)
    return proc.returncode


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (once; later ones wait).

    Outside the main thread, or where SIGTERM is ignored, nothing changes (Python delivers
    signals to the main thread only). The previous handler is restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return
    raised = [False]

    def handler(signum: int, frame: Any) -> None:
        # A second SIGTERM must not interrupt the cleanup the first one started.
        if not raised[0]:
            raised[0] = True
            raise Terminated(f"SIGTERM (signal {signum})")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def alive(pid: int) -> bool:
    """Whether `pid` names a running process (a zombie, already dead but not reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name in parentheses, which may itself hold spaces.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ---- interruptions --------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run part-way; what had finished is kept on the exception.

    A KeyboardInterrupt, so whatever does not know it unwinds as from Ctrl-C. The subclasses
    say what they keep (`SweepInterrupted.sweep`, `TrajectoryInterrupted.trajectory`,
    `Fsdp2Interrupted.captures` and `.result`).
    """

    def __init__(self, message: str, signal_name: str) -> None:
        """The message and "SIGINT" or "SIGTERM"."""
        super().__init__(message)
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        """The shell's code for that signal: 130 for SIGINT, 143 for SIGTERM."""
        return exit_code(self)


def signal_name(err: BaseException) -> str:
    """The signal that stopped a run: "SIGTERM" for a `Terminated`, else "SIGINT"."""
    if isinstance(err, Interrupted):
        return err.signal_name
    return "SIGTERM" if isinstance(err, Terminated) else "SIGINT"


def exit_code(err: BaseException) -> int:
    """128 + the signal number, as a shell reports a process the signal ended: 130 or 143."""
    return 128 + int(signal.SIGTERM if signal_name(err) == "SIGTERM" else signal.SIGINT)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C (and a SIGTERM that raises) until the block ends, then deliver it.

    For a few statements that must not be split: starting threads and noting how to wait for
    them. A KeyboardInterrupt between a thread's start and that note left the thread running
    a side of a pair nobody waited for. Only in the main thread (no other thread gets them),
    and only signals whose handler is Python's (SIG_DFL and SIG_IGN are left alone).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, Any]] = []
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            previous[sig] = handler
            signal.signal(sig, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signum, frame = caught[0]
            previous[signum](signum, frame)


# ---- folders held by one process ------------------------------------------------------------

LOCK_FILE = ".lab-lock"
"""The lock file inside a held folder: the owner's pid and command as JSON, flock'd while held."""

try:
    import fcntl
except ImportError:  # Windows: the lock file's pid is checked instead
    fcntl = None  # type: ignore[assignment]


class FolderInUseError(ValueError):
    """Another live run holds the folder (`holding_folder`); the message names its process."""


def _try_flock(fd: int) -> bool:
    """An exclusive flock on `fd` without waiting: False when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _owner_text(path: Path) -> str:
    try:
        owner = json.loads(path.read_text())
        return f"process {owner['pid']} ({owner['command']}, since {owner['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _owner_record() -> bytes:
    return json.dumps(
        {
            "pid": os.getpid(),
            "command": " ".join(sys.argv)[:200] or sys.executable,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    ).encode()


def _open_locked(path: Path) -> int | None:
    """`path` opened and exclusively flock'd, or None when a live process holds it.

    A lock is held as long as its holder's open file is, so a holder that died (even by
    kill -9) holds nothing: its lock file is stale and taken over here. The holder removes the
    file when it is done; a file removed between our open and our lock is opened again.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            locked = _try_flock(fd)
        except OSError:  # a filesystem without flock (some network mounts): by pid instead
            empty = os.fstat(fd).st_size == 0
            os.close(fd)
            if empty:  # made just now by the open above
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return _open_by_pid(path)
        if not locked:
            os.close(fd)
            return None
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
            return fd
        os.close(fd)


def _open_by_pid(path: Path) -> int | None:
    """Without flock: the lock file created exclusively, or taken over from a dead pid.

    None when a live process holds it. A recycled pid keeps a dead owner's lock (refused,
    naming that pid): the safe side, where flock cannot tell.
    """
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            try:
                pid = int(json.loads(path.read_text())["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                pid = None
            try:
                age_s = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue
            # Unreadable and fresh: its owner is writing it; unreadable for a minute: its
            # owner died mid-write.
            if (pid is None and age_s < 60) or (pid is not None and alive(pid)):
                return None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # stale: its owner died without removing it


@contextlib.contextmanager
def holding_folder(folder: str | Path, where: str) -> Iterator[Path]:
    """Hold `folder` for one run: another run (any process or thread) asking for it is refused.

    The lock is `folder/.lab-lock`, flock'd while held and holding the owner's pid and command
    (read for the refusal). A lock whose owner died, even by kill -9, is stale and taken over:
    the kernel drops a dead process's flock. Removed when the block ends, with the folders
    it made if they are still empty.

    Raises:
        FolderInUseError: A live run holds `folder`, naming its process and the fix.
    """
    folder = Path(folder)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = _open_locked(path) if fcntl is not None else _open_by_pid(path)
    if fd is None:
        raise FolderInUseError(
            f"{where}: {str(folder)!r} is in use by another run, {_owner_text(path)}: two runs "
            "writing one folder read each other's files. Wait for that run to end, or choose "
            "another folder."
        )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _owner_record(), 0)
        yield folder
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)
        # A run that wrote nothing (refused, or stopped before) leaves no folder it made.
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()


# ---- temporary folders that never outlive their process ---------------------------------------

_LIVE_TEMP: dict[Path, int] = {}
"""This process's temporary folders (`owned_temp_dir`) -> their held lock's descriptor."""
_LIVE_TEMP_LOCK = threading.Lock()


def _remove_live_temp_dirs() -> None:
    """At interpreter exit: remove the temporary folders of calls still running.

    A call running in a daemon thread when the main thread ends never reaches its `finally`.
    """
    with _LIVE_TEMP_LOCK:
        for path in list(_LIVE_TEMP):
            shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_live_temp_dirs)


def remove_stale_temp_dirs(prefix: str, parent: str | Path | None = None) -> list[Path]:
    """Remove `prefix*` folders under `parent` (the temporary folder) whose process is gone.

    An `owned_temp_dir` folder is held (its lock flock'd) for as long as its process lives; one
    nobody holds was left by a process that died without cleaning up (kill -9, a SIGTERM with
    no handler, a crash). Folders of live processes are left alone.

    Returns:
        The folders removed.
    """
    parent = Path(tempfile.gettempdir() if parent is None else parent)
    removed = []
    for path in sorted(parent.glob(f"{prefix}*")):
        lock = path / LOCK_FILE
        if not path.is_dir() or not lock.is_file():
            continue  # not one of ours (or mid-removal)
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            if fcntl is not None:
                stale = _try_flock(fd)
            else:
                stale = not alive(int(json.loads(lock.read_text())["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            stale = False
        try:
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def owned_temp_dir(prefix: str) -> Iterator[Path]:
    """A private (0700) temporary folder `<tmp>/<prefix><pid>-<random>`, removed on every way out.

    Removed when the block ends (return, exception, Ctrl-C, SIGTERM under `sigterm_raises`),
    or at interpreter exit for a call left running in a daemon thread. A process that dies
    without either (kill -9, or a SIGTERM it does not handle, e.g. its caller runs in a worker
    thread) leaves it; the next `owned_temp_dir` of that prefix in any process removes it
    (`remove_stale_temp_dirs`). The folder's lock is held before its name is visible: made
    under a hidden name, locked, then renamed, so no cleaner ever sees it unheld.
    """
    parent = Path(tempfile.gettempdir())
    remove_stale_temp_dirs(prefix, parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{prefix}{os.getpid()}-", dir=parent))
    fd = os.open(staging / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    path = parent / staging.name[1:]
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, _owner_record(), 0)
        os.rename(staging, path)
        with _LIVE_TEMP_LOCK:
            _LIVE_TEMP[path] = fd
        yield path
    finally:
        with _LIVE_TEMP_LOCK:
            _LIVE_TEMP.pop(path, None)
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.close(fd)

"""Child processes that end with the caller: parent-death signal, SIGTERM as an exception, kill.

Sweeps (one papermill worker per grid point) and FSDP2 launches (one process per rank) start
children that must never outlive the lab process that started them:

- `start_child` starts a process that the kernel kills when its parent dies, even by `kill -9`
  (Linux `PR_SET_PDEATHSIG`, set in the child before it runs anything), optionally as the
  leader of its own process group so everything it starts can be ended together;
- `sigterm_raises` turns SIGTERM into a `Terminated` exception (a KeyboardInterrupt) while a
  launch runs, so the same `finally` that handles Ctrl-C ends the children and removes the
  temporaries instead of the interpreter dying on the spot;
- `end_child` ends a child (and its group): SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
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

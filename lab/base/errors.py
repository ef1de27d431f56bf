"""Errors that carry what was computed before they happened (partial results survive)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lab.causes.attribute import Attribution
    from lab.pairing.result import Result
    from lab.rl.trajectory import Trajectory


class PairError(RuntimeError):
    """A paired forward failed part-way; `result` holds every pair compared before that."""

    def __init__(
        self,
        message: str,
        result: Result | None = None,
        *,
        side: str | None = None,
        module: str | None = None,
        module_class: str | None = None,
        fix: str | None = None,
    ) -> None:
        """Keep the partial result, and where the failure happened, next to the message."""
        super().__init__(message)
        self.result = result
        if result is not None and result.partial is None:
            # What a failed pair leaves is partial wherever it goes (saved, shown, compared).
            result.partial = message or type(self).__name__
        self.side = side
        """Name of the side whose forward failed (None when no forward failed)."""
        self.module = module
        """`named_modules()` path of the innermost module that was running, or None."""
        self.module_class = module_class
        self.fix = fix
        """What would most likely make the pair run, or None when nothing specific is known."""


class NonFiniteOutputError(PairError, ValueError):
    """A side's model output holds NaN or Inf."""


class DegenerateOutputError(PairError, ValueError):
    """Both sides' model outputs are all zero or constant: agreement there proves nothing."""


class TrajectoryError(PairError):
    """A trajectory step failed; `trajectory` holds every step completed before it.

    A `PairError`: `result` is the failed step's pair (what it compared) where the step failed
    in its captured pair, else None; `step` is the step that failed, `__cause__` the error.
    """

    def __init__(
        self, message: str, trajectory: Trajectory, *, step: int, cause: BaseException
    ) -> None:
        """The message, the steps completed, the failing step and what it raised."""
        inner = cause if isinstance(cause, PairError) else PairError("")  # all None
        super().__init__(
            message,
            inner.result,
            side=inner.side,
            module=inner.module,
            module_class=inner.module_class,
            fix=inner.fix,
        )
        self.trajectory = trajectory
        self.step = step


class AttributionError(PairError):
    """A graft of `lab.attribute` failed; `attribution` holds the units grafted before it.

    Its rows are those units' shares, its residual what remains after them, and its
    `meta["failed"]` the unit (position and path) and the error; `__cause__` is the error.
    """

    def __init__(self, message: str, attribution: Attribution) -> None:
        """The message and the partial Attribution."""
        super().__init__(message)
        self.attribution = attribution


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked (the message names the file)."""


class ModelInUseError(RuntimeError):
    """A second thread asked to pair or run a model another thread is pairing or running."""


def nearest_words(unknown: list[str], known: list[str]) -> str:
    """' Did you mean 'a' for 'b'?' for each unknown name with a close known one ('' if none)."""
    import difflib

    near = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
    return "".join(f" Did you mean {m[0]!r} for {u!r}?" for u, m in near.items() if m)


def check_flags(where: str, optional: tuple[str, ...] = (), **flags: object) -> None:
    """Refuse a switch that is not True or False (None too where named in `optional`).

    `cfg="no"` was truthy and ran CFG, recorded as meta['cfg'] = 'no'.

    Raises:
        ValueError: Naming the argument, the value and what it takes.
    """
    for name, value in flags.items():
        if isinstance(value, bool) or (value is None and name in optional):
            continue
        takes = "True, False or None" if name in optional else "True or False"
        raise ValueError(
            f"{where}: {name} must be {takes}, got {value!r} ({type(value).__name__})."
        )

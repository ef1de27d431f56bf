"""Errors that carry what was computed before they happened (partial results survive)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lab.result import Result


class PairError(RuntimeError):
    """A paired forward failed part-way; `result` holds every pair compared before that."""

    def __init__(self, message: str, result: Result | None = None) -> None:
        """Keep the partial result next to the message."""
        super().__init__(message)
        self.result = result


class NonFiniteOutputError(PairError, ValueError):
    """A side's model output holds NaN or Inf."""


class DegenerateOutputError(PairError, ValueError):
    """Both sides' model outputs are all zero or constant: agreement there proves nothing."""

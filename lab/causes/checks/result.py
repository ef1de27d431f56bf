"""CheckResult: what every pipeline parity check returns (a table, a verdict, pass/fail, meta)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lab.base.arguments import checked_arguments
from lab.base.atomic import atomic_write_text

if TYPE_CHECKING:
    import pandas as pd

CheckName = Literal["batch_invariance", "cfg_batching", "sigma_parity", "weight_sync"]
CHECK_NAMES: tuple[str, ...] = ("batch_invariance", "cfg_batching", "sigma_parity", "weight_sync")
SCHEMA = "precision-lab/check/1"


@checked_arguments
@dataclass
class CheckResult:
    """One pipeline parity check: its rows, a one-paragraph verdict and whether it passed.

    `rows` are plain JSON values (NaN allowed; written as null), one dict per table row, in
    the order the check produced them; `columns` fixes the table's column order even when
    there are no rows. `meta` says what ran (family, preset, side(s), device, settings).
    """

    check: str
    rows: list[dict[str, Any]]
    columns: list[str]
    verdict: str
    passed: bool
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.check not in CHECK_NAMES:
            raise ValueError(
                f"CheckResult.check: unknown check {self.check!r}. Known: {', '.join(CHECK_NAMES)}."
            )
        unknown = sorted({k for r in self.rows for k in r} - set(self.columns))
        if unknown:
            raise ValueError(
                f"CheckResult({self.check}): row keys {unknown} are not in columns {self.columns}."
            )

    @property
    def applicable(self) -> bool:
        """False when the check cannot apply to this family (the verdict says why)."""
        return bool(self.meta.get("applicable", True))

    def table(self) -> pd.DataFrame:
        """The rows as a pandas DataFrame with `columns` in order (empty but typed if no rows)."""
        import pandas as pd

        return pd.DataFrame(
            [{c: r.get(c) for c in self.columns} for r in self.rows], columns=self.columns
        )

    def describe(self) -> str:
        """A headline line (check, family, PASS/FAIL/n.a.) and the verdict."""
        status = "n/a" if not self.applicable else ("PASS" if self.passed else "FAIL")
        where = " ".join(
            str(self.meta[k]) for k in ("family", "preset", "device") if self.meta.get(k)
        )
        return f"{self.check}{f' [{where}]' if where else ''} {status}: {self.verdict}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN and infinities become null)."""
        return _clean(
            {
                "schema": SCHEMA,
                "check": self.check,
                "passed": bool(self.passed),
                "verdict": self.verdict,
                "columns": list(self.columns),
                # Which columns hold floats, so a NaN written as null reads back as NaN.
                "float_columns": sorted(
                    {k for r in self.rows for k, v in r.items() if isinstance(v, float)}
                ),
                "rows": self.rows,
                "meta": self.meta,
            }
        )

    @checked_arguments
    def to_json(self, path: str | Path) -> Path:
        """Write `to_dict()` to `path` atomically (parent folders created)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    @checked_arguments
    def from_dict(cls, data: Mapping[str, Any]) -> CheckResult:
        """Rebuild a CheckResult from `to_dict()` output (null floats come back as NaN).

        Raises:
            ValueError: Another schema, or a dict that is not a check result.
        """
        if data.get("schema") != SCHEMA:
            raise ValueError(
                f"CheckResult.from_dict: schema {data.get('schema')!r}, expected {SCHEMA!r}; "
                "was this written by CheckResult.to_json?"
            )
        columns = list(data["columns"])
        floats = set(data.get("float_columns") or ())
        rows = [
            {k: math.nan if v is None and k in floats else v for k, v in r.items()}
            for r in data["rows"]
        ]
        return cls(
            check=data["check"],
            rows=rows,
            columns=columns,
            verdict=data["verdict"],
            passed=bool(data["passed"]),
            meta=dict(data.get("meta") or {}),
        )

    @classmethod
    @checked_arguments
    def from_json(cls, path: str | Path) -> CheckResult:
        """Read what `to_json` wrote.

        Raises:
            ValueError: The file is not a check result (see `from_dict`).
        """
        return cls.from_dict(json.loads(Path(path).read_text()))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def ulp_words(values: Sequence[float]) -> str:
    """'0 ULP' or 'max 3 ULP' for a column of ULP counts (NaN entries ignored)."""
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    top = max(finite, default=0.0)
    return "0 ULP" if top == 0 else f"max {top:g} ULP"

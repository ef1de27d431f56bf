"""Where the user's files go: runs and baselines under the working directory or $LAB_HOME.

    lab_home()                                  # $LAB_HOME if set, else the working directory
    run_folder("quickstart", "", family="flux", preset="tiny", mode="propagated")
        # -> <home>/runs/quickstart/flux-tiny-propagated-20250101-120000 (made, empty)
    run_folder("quickstart", "runs/mine")       # refused when runs/mine holds results already

Nothing is written inside the installed package or a checkout of it: a run with no folder
given gets a fresh one (family, preset, mode and the time, then `-2`, `-3` ... when two runs
start in one second), and a folder given by name is refused while it holds another run's
results, unless the caller asks to overwrite them.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from lab.base.arguments import checked_arguments

HOME_ENV = "LAB_HOME"
"""The environment variable naming the folder runs/ and baselines/ go under."""
RESULT_SUFFIXES: tuple[str, ...] = (".json", ".png", ".html", ".csv")
"""What a run writes into its folder (results, figures, reports, tables): a folder holding
any such file holds a run's results. Executed notebooks, logs and hidden files do not count."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]+")


@checked_arguments
def lab_home() -> Path:
    """The folder the user's runs/ and baselines/ live under: $LAB_HOME, else the working one.

    Raises:
        ValueError: $LAB_HOME names something that is not a folder.
    """
    value = os.environ.get(HOME_ENV, "").strip()
    if not value:
        return Path.cwd()
    home = Path(value).expanduser()
    if home.exists() and not home.is_dir():
        raise ValueError(
            f"${HOME_ENV}={value!r} is a file, not a folder. Point it at the folder your runs/ "
            f"and baselines/ should go under, or unset it to use the working directory."
        )
    return home.resolve()


@checked_arguments
def runs_home() -> Path:
    """`<lab_home()>/runs`: where runs without a folder of their own go, one folder per kind."""
    return lab_home() / "runs"


@checked_arguments
def baselines_home() -> Path:
    """`<lab_home()>/baselines`: where named baselines are saved and looked up."""
    return lab_home() / "baselines"


@checked_arguments
def result_files(folder: str | Path) -> list[str]:
    """Names of the results a folder already holds (`RESULT_SUFFIXES`, not hidden), sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.suffix in RESULT_SUFFIXES and not p.name.startswith(".") and p.is_file()
    )


@checked_arguments
def run_folder(
    kind: str,
    out_dir: str | Path = "",
    *,
    family: str | None = None,
    preset: str | None = None,
    mode: str | None = None,
    label: str | None = None,
    overwrite: bool = False,
    home: str | Path | None = None,
) -> Path:
    """The folder a run writes into, made: a fresh one, or the one given if it holds no results.

    Args:
        kind: What ran, a plain folder name ("quickstart", "pair", "ratio_drift", "sweep").
        out_dir: The folder asked for; "" for a fresh one under `runs_home()/kind`.
        family: The family, first word of a fresh folder's name.
        preset: The preset, next.
        mode: The pairing mode, next (None where the run has none).
        label: One more word before the time (a sweep's notebook).
        overwrite: Take a folder given by name even when it holds results (a new run writes
            over them). A fresh folder never holds any.
        home: The folder whose runs/ a fresh folder goes under; None: `lab_home()`.

    Returns:
        The folder, made: `<home>/runs/<kind>/<family>-<preset>[-<mode>][-<label>]-<time>`
        (a `-2`, `-3`, ... suffix when another run took that name in the same second: each
        fresh folder is created exclusively), or `out_dir` as given.

    Raises:
        ValueError: `kind` is not a plain name; `out_dir` is a file, cannot be made, or holds
            results (naming them) and overwrite is False.
    """
    if not _NAME.match(kind):
        raise ValueError(
            f"run_folder: kind {kind!r} is not a plain folder name: use letters, digits, '_', "
            "'-' and '.', e.g. 'quickstart'."
        )
    if str(out_dir).strip():
        return _given_folder(Path(out_dir), overwrite)
    parent = (runs_home() if home is None else Path(home) / "runs") / kind
    words = [_UNSAFE.sub("-", str(w)).strip("-") for w in (family, preset, mode, label) if w]
    stem = "-".join([*filter(None, words), time.strftime("%Y%m%d-%H%M%S")])
    _make(parent, parents=True)
    for n in range(1, 10_000):
        path = parent / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as err:
            raise _unmakeable(path, err) from None
        return path
    raise ValueError(f"run_folder: 10000 runs named {stem!r} under {parent}; clear some out.")


@checked_arguments
def check_folder_free(out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Refuse, making nothing, a folder a run may not write into; returns it as a Path.

    Raises:
        ValueError: `out_dir` is a file, or holds results (naming them) and overwrite is False.
    """
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"out_dir {str(path)!r} is a file, not a folder; choose a folder.")
    held = result_files(path)
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(
            f"out_dir {str(path)!r} already holds a run's results ({shown}): a new run would "
            "write over them. Leave out_dir empty for a fresh folder of its own, choose another "
            "folder, or ask to replace them: overwrite=True (notebooks: -p overwrite true; "
            "precision-lab: --overwrite)."
        )
    return path


def _given_folder(path: Path, overwrite: bool) -> Path:
    check_folder_free(path, overwrite=overwrite)
    _make(path, parents=True)
    return path


def _make(path: Path, *, parents: bool) -> None:
    try:
        path.mkdir(parents=parents, exist_ok=True)
    except OSError as err:
        raise _unmakeable(path, err) from None


def _unmakeable(path: Path, err: OSError) -> ValueError:
    return ValueError(
        f"cannot make the run folder {str(path)!r} ({err.strerror or err}). Choose a folder you "
        f"can write (out_dir), or set ${HOME_ENV} to one."
    )

"""The package layout (issue 13): rooms by role, imports only downward, no two-file circles."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lab

ROOT = Path(lab.__file__).resolve().parent

# Each room may import itself and the rooms before it (base is the ground floor).
FLOORS: tuple[str, ...] = (
    "base",
    "families",
    "precision",
    "pairing",
    "rl",
    "engine",
    "causes",
    "views",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _owner(dotted: str) -> str | None:
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imports(path: Path, *, runtime_only: bool) -> set[str]:
    """Modules of `lab` that `path` imports (function-level imports included)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            test = getattr(node, "test", None)
            if isinstance(node, ast.If) and getattr(test, "id", None) == "TYPE_CHECKING":
                skipped.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lab"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("lab")]
        else:
            continue
        for name in names:
            owner = _owner(name)
            if owner is not None:
                found.add(owner)
    return found - {_module_name(path) if path.is_relative_to(ROOT) else ""}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else None


def test_every_module_lives_in_a_room() -> None:
    loose = [m for m in MODULES if m.count(".") == 1 and m not in {"lab.__main__"}]
    loose = [m for m in loose if m.split(".")[1] not in FLOORS]
    assert loose == [], f"modules outside every room: {loose}"
    assert {m.split(".")[1] for m in MODULES if m.count(".") >= 1} <= {*FLOORS, "__main__"}


UPWARD_ON_PURPOSE: dict[tuple[str, str], str] = {
    ("lab.causes.settings", "lab.views.plots.settings"): (
        "SettingAttribution.plot(): the chart the setting attribution is asked for on the "
        "object itself; the figure code stays in views and is imported on call"
    ),
}
"""Upward imports kept on purpose, each with why (STYLE: break a rule and say why)."""


def test_rooms_import_only_downward() -> None:
    upward = []
    for module, path in MODULES.items():
        room = _room(module)
        if room is None:
            continue
        for target in _imports(path, runtime_only=True):
            if (module, target) in UPWARD_ON_PURPOSE:
                continue
            other = _room(target)
            if other is None and room != "views":
                # Only the top floor (the CLI) may use the public API through `lab` itself.
                upward.append(f"{module} -> {target} (the package root)")
            elif other is None:
                continue
            elif FLOORS.index(other) > FLOORS.index(room):
                upward.append(f"{module} ({room}) -> {target} ({other})")
    assert upward == [], "\n".join(upward)


def test_no_two_files_import_each_other() -> None:
    """At run time (function-level imports included; `if TYPE_CHECKING:` ones are annotations)."""
    graph = {m: _imports(p, runtime_only=True) for m, p in MODULES.items()}
    circles = sorted(
        f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a < b and a in graph[b]
    )
    assert circles == [], circles


def test_the_floors_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker is not blind: a base module importing pairing is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lab.pairing.run import pair\n")
    assert _imports(bad, runtime_only=True) == {"lab.pairing.run"}
    hidden = tmp_path / "hidden.py"
    hidden.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lab.rl.trajectory import x\n"
    )
    assert _imports(hidden, runtime_only=True) == set()
    assert _imports(hidden, runtime_only=False) == {"lab.rl.trajectory"}


@pytest.mark.parametrize("short", sorted(lab.PUBLIC_MODULES))
def test_public_short_names_are_the_modules_in_their_rooms(short: str) -> None:
    import importlib

    real = importlib.import_module(lab.PUBLIC_MODULES[short])
    assert getattr(lab, short) is real
    assert importlib.import_module(f"lab.{short}") is real
    assert real.__spec__.name == lab.PUBLIC_MODULES[short]


def test_public_modules_load_from_import_lab_alone() -> None:
    """A fresh interpreter: `import lab` then attribute access, `import lab.x`, `from lab.x`."""
    code = (
        "import lab\n"
        "assert callable(lab.scenarios.run) and callable(lab.plots.show)\n"
        "assert callable(lab.dump.pair_dump) and callable(lab.report.write_html)\n"
        "import lab.widgets, lab.views.widgets\n"
        "assert lab.widgets is lab.views.widgets\n"
        "from lab.runs import compare_runs\n"
        "from lab.fsdp import ParamDtypeMixedPrecisionPolicy, apply_fsdp2\n"
        "assert callable(lab.trajectory) and lab.Trajectory.__module__ == 'lab.rl.trajectory'\n"
        "try:\n"
        "    lab.nonexistent\n"
        "except AttributeError as err:\n"
        "    assert 'nonexistent' in str(err)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_side_parses_dtype_names_once() -> None:
    """Consumers read torch dtypes off the Side; nothing parses a Side's dtype name again."""
    offenders = []
    for module, path in MODULES.items():
        source = path.read_text()
        for field in ("master_dtype", "forward_dtype", "reduce_dtype", "resolved_param_dtype"):
            if f"parse_dtype(side.{field}" in source or f"parse_dtype(self.side.{field}" in source:
                offenders.append(f"{module}: parse_dtype(side.{field})")
    assert offenders == [], offenders


def test_every_room_is_a_regular_package() -> None:
    """A folder without __init__.py is a namespace package, which a non-editable wheel drops."""
    folders = {p.parent for p in ROOT.rglob("*.py")} - {ROOT}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert missing == [], missing


def test_every_gpu_test_file_runs_in_a_device_stage() -> None:
    # A gpu test runs only where scripts/gpu_run.sh sends it (the CI machine has no GPU): a file
    # of gpu tests that no stage names never runs; a stage naming a missing file runs nothing.
    tests = ROOT.parent / "tests"
    script = (ROOT.parent / "scripts" / "gpu_run.sh").read_text()
    marked = re.compile(r"^(@pytest\.mark\.gpu\b|pytestmark = .*pytest\.mark\.gpu\b)", re.M)
    gpu_files = {p.name for p in tests.glob("test_*.py") if marked.search(p.read_text())}
    named = set(re.findall(r"tests/(test_\w+\.py)", script))
    assert gpu_files, "no gpu test file found: the marker's spelling changed?"
    assert not gpu_files - named, f"gpu tests no stage of gpu_run.sh runs: {gpu_files - named}"
    missing = {name for name in named if not (tests / name).exists()}
    assert not missing, f"gpu_run.sh names test files that do not exist: {missing}"

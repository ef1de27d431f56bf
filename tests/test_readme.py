"""The README's code runs as written (docs cite only code that exists)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert (tmp_path / "runs/flux/results.json").is_file()
    assert namespace["result"].mode == "local"


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_readme_names_exist() -> None:
    text = README.read_text()
    names = set(re.findall(r"\blab(?:\.[A-Za-z_]\w*)+", text))
    assert len(names) > 15
    for dotted in sorted(names):
        try:
            _resolve(dotted)
        except (AttributeError, ModuleNotFoundError) as err:
            raise AssertionError(f"README names {dotted}, which does not exist") from err
    for script in re.findall(r"(?:bash|python) ((?:scripts|bench)/[\w/]+\.(?:sh|py))", text):
        assert (README.parent / script).is_file(), script


def test_readme_command_lines_parse() -> None:
    """Every `precision-lab ...` line in the README's bash blocks parses with the real parser."""
    import shlex

    from lab.views.cli import _COMMANDS, _parser

    bash = "\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S))
    joined = re.sub(r"\\\n\s*", " ", bash)
    lines = [ln.split("#")[0].strip() for ln in joined.splitlines()]
    commands = [ln for ln in lines if ln.startswith("precision-lab ")]
    assert commands, "the README shows no precision-lab command (issue 12 item 7)"
    documented = set()
    for line in commands:
        argv = shlex.split(line)[1:]
        try:
            args = _parser().parse_args(argv)
        except SystemExit as err:
            raise AssertionError(f"README command does not parse: {line}") from err
        documented.add(args.command)
    assert documented == set(_COMMANDS), f"undocumented: {sorted(set(_COMMANDS) - documented)}"

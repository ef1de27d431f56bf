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

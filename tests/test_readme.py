"""The README's code runs as written (docs cite only code that exists)."""

from __future__ import annotations

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


def test_readme_names_exist() -> None:
    import lab
    import lab.precision

    text = README.read_text()
    for name in set(re.findall(r"`lab\.(\w+)", text)) | set(re.findall(r"lab\.(\w+)\(", text)):
        assert hasattr(lab, name) or name in {"precision"}, f"README names lab.{name}"
    for name in re.findall(r"lab\.precision\.(\w+)", text):
        if name != "autocast":
            assert hasattr(lab.precision, name), f"README names lab.precision.{name}"
    for script in re.findall(r"bash (scripts/[\w/]+\.sh)", text):
        assert (README.parent / script).is_file(), script

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

# Two CPU cores on CI: more threads only add contention for tiny models.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def load_bench(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Import `bench/<name>.py` (a script folder, not a package) as a module.

    With `bench/` on sys.path for the test, as a script run from it has: a bench may import
    its siblings (bench/full_size.py imports bench/full_pair.py).
    """
    folder = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(folder))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load

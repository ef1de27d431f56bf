from __future__ import annotations

import importlib.util
import os
import random
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


@pytest.fixture
def noisy_rounds() -> Callable[..., dict[str, list[float]]]:
    """Times of cases run in rounds on a shared host: `rounds` rounds, each slowed by its own
    factor in [1, 2) for every case alike, and each case's run by up to `jitter` more.

        noisy_rounds({"old": 0.30, "new": 0.27}, rounds=21, seed=3, jitter=0.03)
    """

    def make(
        bases: dict[str, float], rounds: int, seed: int, jitter: float
    ) -> dict[str, list[float]]:
        rng = random.Random(seed)
        slow = [1 + rng.random() for _ in range(rounds)]
        return {
            case: [base * f * (1 + jitter * rng.random()) for f in slow]
            for case, base in bases.items()
        }

    return make

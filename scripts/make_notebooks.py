"""Write the committed notebooks from their cell sources (thin: each cell calls one lab function).

Run `python scripts/make_notebooks.py` after editing a notebook's cells here; the committed
.ipynb files carry no outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

NOTEBOOKS: dict[str, list[tuple[str, str, list[str]]]] = {
    "01_quickstart.ipynb": [
        (
            "markdown",
            "",
            [
                "# Quickstart: one paired forward, rollout vs trainer\n",
                "\n",
                "Builds a family DiT with seeded weights, runs the same inputs under the engine-like\n",
                "rollout side and the FSDP2-like trainer side, and shows where they first diverge.\n",
                "Run headless: `papermill notebooks/01_quickstart.ipynb out.ipynb -p family wan2_2`.",
            ],
        ),
        ("code", "", ["import lab\n", "from lab import plots"]),
        (
            "code",
            "parameters",
            [
                'family: str = "sd3"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced (real width, 2 blocks), full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                'mode: str = "propagated"  # propagated (accumulation) or local (per-op error)\n',
                "sigma: float = 0.75  # flow-matching sigma of the step\n",
                'out_dir: str = "runs/quickstart"  # where results.json and the PNG go\n',
                'rollout_overrides: dict = {}  # Side field overrides, e.g. {"attention_backend": "math"}\n',
                'trainer_overrides: dict = {}  # e.g. {"autocast": False, "param_dtype_rules": {"*norm*": "fp32"}}',
            ],
        ),
        (
            "code",
            "",
            [
                "result = lab.pair_family(family, preset, seed=seed, device=device, mode=mode, sigma=sigma,\n",
                "                         rollout=rollout_overrides, trainer=trainer_overrides)\n",
                "print(result.describe())",
            ],
        ),
        (
            "code",
            "",
            [
                'fig = plots.plot_divergence_by_layer(result, "rel_max")\n',
                'plots.save_figure(fig, f"{out_dir}/divergence_by_layer.png")',
            ],
        ),
        ("code", "", ['result.to_json(f"{out_dir}/results.json")\n', "result.table().head(25)"]),
    ],
}


def _cell(kind: str, tag: str, source: list[str]) -> dict:
    cell = {"cell_type": kind, "metadata": {"tags": [tag]} if tag else {}, "source": source}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def main() -> None:
    """Write every notebook under notebooks/."""
    root = Path(__file__).resolve().parent.parent / "notebooks"
    for name, cells in NOTEBOOKS.items():
        nb = {
            "cells": [_cell(*c) for c in cells],
            "metadata": {
                "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                "language_info": {"name": "python"},
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        for i, c in enumerate(nb["cells"]):
            c["id"] = f"{Path(name).stem.split('_')[0]}-{i}"
        (root / name).write_text(json.dumps(nb, indent=1) + "\n")


if __name__ == "__main__":
    main()

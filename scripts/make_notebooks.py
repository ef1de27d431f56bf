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
    "02_ratio_drift.ipynb": [
        (
            "markdown",
            "",
            [
                "# Ratio drift: how far the rollout/trainer gap moves the PPO ratio off 1.0\n",
                "\n",
                "Samples a Flow-GRPO rollout (SDE noise inside the window), recomputes every step's\n",
                "velocity and log-prob as the trainer, and plots the ratio drift per step, its\n",
                "distribution, and |d log_prob| against the velocity gap (predicted beside measured).\n",
                "Run headless: `papermill notebooks/02_ratio_drift.ipynb out.ipynb -p family sd3`.",
            ],
        ),
        (
            "code",
            "",
            ["from lab import drift_plots, plots\n", "from lab import trajectory"],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "sd3"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced (real width, 2 blocks), full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "steps: int = 10  # denoising steps\n",
                "sde_window: list = []  # [start, end) steps with SDE noise; [] = every step\n",
                "noise_level: float = 0.7  # eta of the Flow-GRPO SDE\n",
                'sde_type: str = "sde"  # sde (Flow-SDE) or cps\n',
                "cfg_scale: float = 1.0  # guidance scale; > 1 runs CFG (not for flux, minimax_h3)\n",
                "samples: int = 2  # samples per forward (cosmos3 takes 1)\n",
                "prompts: int = 1  # prompts (seeds seed, seed+1, ...)\n",
                "seed: int = 0  # weight and first prompt seed\n",
                "clip_range: float = 1e-4  # PPO clip range for clip_frac\n",
                'out_dir: str = "runs/ratio_drift"  # where results.json and the PNGs go\n',
                'rollout_overrides: dict = {}  # Side field overrides, e.g. {"attention_backend": "math"}\n',
                'trainer_overrides: dict = {}  # e.g. {"autocast": False, "forward_dtype": "fp32"}',
            ],
        ),
        (
            "code",
            "",
            [
                "traj = trajectory(family, preset, steps=steps, sde_window=sde_window or None,\n",
                "                  noise_level=noise_level, sde_type=sde_type, cfg_scale=cfg_scale,\n",
                "                  samples=samples, prompts=prompts, seed=seed, device=device,\n",
                "                  clip_range=clip_range, rollout=rollout_overrides, trainer=trainer_overrides)\n",
                "print(traj.describe())",
            ],
        ),
        (
            "code",
            "",
            ['plots.save_figure(drift_plots.plot_ratio_drift(traj), f"{out_dir}/ratio_drift.png")'],
        ),
        (
            "code",
            "",
            [
                'plots.save_figure(drift_plots.plot_ratio_histogram(traj), f"{out_dir}/ratio_hist.png")'
            ],
        ),
        (
            "code",
            "",
            [
                "plots.save_figure(drift_plots.plot_logprob_vs_velocity_gap(traj),\n",
                '                  f"{out_dir}/logprob_vs_velocity_gap.png")',
            ],
        ),
        ("code", "", ['traj.to_json(f"{out_dir}/results.json")\n', "traj.per_step()"]),
    ],
    "06_scenarios.ipynb": [
        (
            "markdown",
            "",
            [
                "# Scenarios: the known rollout/trainer mismatches, found by the lab itself\n",
                "\n",
                "Runs every known-mismatch scenario available on the device (GPU-only ones need CUDA):\n",
                "the buggy pair of sides, the fixed pair, and the culprit the lab finds in local mode.\n",
                "Run headless: `papermill notebooks/06_scenarios.ipynb out.ipynb -p device cuda`.",
            ],
        ),
        ("code", "", ["from lab import plots, scenario_plots, scenarios"]),
        (
            "code",
            "parameters",
            [
                'device: str = "cpu"  # cpu or cuda (cuda adds the GPU-only scenarios)\n',
                'preset: str = "tiny"  # tiny (CPU), reduced (real width, 2 blocks)\n',
                "only: list = []  # scenario names to run; [] = every one available on the device\n",
                'out_dir: str = "runs/scenarios"  # where scenarios.json, the Results and the PNG go\n',
                "interactive: bool = False  # plotly figure instead of the PNG",
            ],
        ),
        ("code", "", ["runs = scenarios.run_all(preset, device, only or None)"]),
        ("code", "", ["scenarios.scenarios_table(runs)"]),
        ("code", "", ["fig = scenario_plots.plot_bug_vs_fixed(runs, interactive=interactive)"]),
        (
            "code",
            "",
            ['fig if interactive else plots.save_figure(fig, f"{out_dir}/bug_vs_fixed.png")'],
        ),
        ("code", "", ["scenarios.save_runs(runs, out_dir)"]),
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

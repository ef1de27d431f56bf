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
                'trainer_overrides: dict = {}  # e.g. {"autocast": False, "param_dtype_rules": {"*norm*": "fp32"}}\n',
                "interactive: bool = False  # True: also show the plotly figure (hover for module, dtypes)",
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
        (
            "code",
            "",
            [
                'plots.plot_divergence_by_layer(result, "rel_max", backend="plotly") if interactive else None'
            ],
        ),
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
            ["from lab import drift_plots, plots, trajectory, widgets"],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "sd3"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced (real width, 2 blocks), full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "steps: int = 10  # denoising steps\n",
                "sde_window: list = []  # first and last+1 step with SDE noise; empty = every step\n",
                "noise_level: float = 0.7  # eta of the Flow-GRPO SDE\n",
                'sde_type: str = "sde"  # sde (Flow-SDE) or cps\n',
                "cfg_scale: float = 1.0  # guidance scale; > 1 runs CFG (not for flux, minimax_h3)\n",
                "samples: int = 2  # samples per forward (cosmos3 takes 1)\n",
                "prompts: int = 1  # prompts (seeds seed, seed+1, ...)\n",
                "seed: int = 0  # weight and first prompt seed\n",
                "clip_range: float = 1e-4  # PPO clip range for clip_frac\n",
                'out_dir: str = "runs/ratio_drift"  # where results.json and the PNGs go\n',
                'rollout_overrides: dict = {}  # Side field overrides, e.g. {"attention_backend": "math"}\n',
                'trainer_overrides: dict = {}  # e.g. {"autocast": False, "forward_dtype": "fp32"}\n',
                "interactive: bool = False  # True: also open the control panel to explore this family",
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
        (
            "code",
            "",
            [
                "widgets.control_panel(family=family, preset=preset, device=device) if interactive else None"
            ],
        ),
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
    "00_index.ipynb": [
        (
            "markdown",
            "",
            [
                "# Precision Lab: which notebook is for what\n",
                "\n",
                "Every notebook pairs a rollout (reference) forward with a trainer (candidate) forward of a\n",
                "diffusers DiT and shows where and how far they drift apart. All of them run headless under\n",
                "papermill on the `tiny` preset (`-p interactive False`), writing to `runs/<notebook>/`.\n",
                "\n",
                "| notebook | what it is for |\n",
                "|---|---|\n",
                "| `01_quickstart` | one paired forward: per-module divergence, first divergent module, results.json |\n",
                "| `02_ratio_drift` | a Flow-GRPO rollout recomputed by the trainer: PPO ratio drift per step |\n",
                "| `03_control_panel` | the widget panel: toggle input_dtype_policy, autocast, rules; Run; Export a report |\n",
                "| `04_param_overrides` | param_dtype_rules: what each rule matches and its effect on divergence |\n",
                "| `05_sweep` | a notebook over a parameter grid (papermill, parallel), one table and a plot |\n",
                "| `06_scenarios` | named precision scenarios run side by side |\n",
                "| `07_fsdp2` | the trainer side under real FSDP2 with per-parameter mixed precision |\n",
                "\n",
                "From a shell: `python -m lab sweep notebooks/01_quickstart.ipynb --grid family=flux,sd3 --out runs/sweep`.",
            ],
        ),
        ("code", "", ["import lab"]),
        (
            "code",
            "parameters",
            [
                "interactive: bool = False  # nothing here is interactive; kept like every notebook\n",
                'out_dir: str = "runs/index"  # unused: this notebook writes nothing',
            ],
        ),
        ("code", "", ["lab.families()"]),
    ],
    "03_control_panel.ipynb": [
        (
            "markdown",
            "",
            [
                "# Control panel: toggle one setting, re-run, look\n",
                "\n",
                "Both sides' dtype flags, input_dtype_policy per boundary input, autocast, per-parameter\n",
                "rules (`glob: dtype`, one per line, compiled live against the built model), attention\n",
                "backend and engine ops; Run pairs the two sides on the cached model (about a second on\n",
                "tiny) and updates the plots in place; Export writes `report.html` + `results.json`.\n",
                "Headless (`interactive=False`, the papermill default) it applies `settings`, runs one\n",
                "pair and exports to `out_dir` before showing the panel.",
            ],
        ),
        ("code", "", ["from lab.widgets import control_panel"]),
        (
            "code",
            "parameters",
            [
                'family: str = "sd3"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced, full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                'settings: dict = {}  # panel control -> value, e.g. {"trainer.input_dtype_policy.timestep": "bf16"}\n',
                "interactive: bool = False  # False: run one pair and export before showing the panel\n",
                'out_dir: str = "runs/control_panel"  # where the headless run writes results.json + report.html',
            ],
        ),
        ("code", "", ["panel = control_panel(family, preset, device, seed=seed)"]),
        ("code", "", ["panel.apply(settings)"]),
        ("code", "", ["panel.run_and_export(out_dir) if not interactive else None"]),
        ("code", "", ["panel"]),
    ],
    "04_param_overrides.ipynb": [
        (
            "markdown",
            "",
            [
                "# Per-parameter dtype rules: what they match and what they change\n",
                "\n",
                "`param_dtype_rules` are ordered globs on full parameter names (later rules win) that pin\n",
                "parameters to a dtype on the trainer side, as the FSDP2 plan's `param_dtype_patterns` do.\n",
                "The table shows what each rule matched (parameters, elements, how many it still decides);\n",
                "the overlay pairs the trainer against the rollout without and with the rules. Under\n",
                "autocast most ops re-cast their weights, so a rule can change little: that is a finding too.",
            ],
        ),
        (
            "code",
            "",
            [
                "import lab\n",
                "from lab import plots\n",
                "from lab.precision.param_rules import explain_rules\n",
                "from lab.report import write_html\n",
                "from lab.result import results_table\n",
                "from lab.widgets import rule_matches_table",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "wan2_2"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced, full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                'rules: dict = {"*norm*": "fp32", "*ffn*": "fp32"}  # ordered glob -> dtype for the trainer\n',
                'metric: str = "rel_max"  # the overlay metric (a Result.table() column)\n',
                "interactive: bool = False  # True: also show the plotly overlay (hover for modules)\n",
                'out_dir: str = "runs/param_overrides"  # where results.json, the PNG and report.html go',
            ],
        ),
        ("code", "", ["model = lab.family(family).build(preset, seed, device=device)"]),
        ("code", "", ["rule_matches_table(explain_rules(model, rules))"]),
        (
            "code",
            "",
            [
                "runs = {\n",
                '    "without rules": lab.pair_family(\n',
                '        family, preset, seed=seed, device=device, trainer={"param_dtype_rules": {}}\n',
                "    ),\n",
                '    "with rules": lab.pair_family(\n',
                '        family, preset, seed=seed, device=device, trainer={"param_dtype_rules": rules}\n',
                "    ),\n",
                "}",
            ],
        ),
        ("code", "", ["results_table(list(runs.values())).assign(run=list(runs))"]),
        (
            "code",
            "",
            [
                'plots.save_figure(plots.plot_overlay(runs, metric), f"{out_dir}/overlay.png")',
            ],
        ),
        (
            "code",
            "",
            ['plots.plot_overlay(runs, metric, backend="plotly") if interactive else None'],
        ),
        (
            "code",
            "",
            [
                'runs["with rules"].to_json(f"{out_dir}/results.json")\n',
                'runs["without rules"].to_json(f"{out_dir}/without_rules.json")\n',
                'write_html(runs, f"{out_dir}/report.html", metric=metric)',
            ],
        ),
    ],
    "05_sweep.ipynb": [
        (
            "markdown",
            "",
            [
                "# Sweep: one notebook over a parameter grid\n",
                "\n",
                "Runs `notebook` once per grid point with papermill, `jobs` at a time, collects every run's\n",
                "results.json summary into `out_dir/sweep.csv` and plots one metric per run. A failed run\n",
                "keeps its executed notebook and is listed; the others finish. The same from a shell:\n",
                "`python -m lab sweep 01_quickstart --grid mode=propagated,local -p family=flux --out runs/sweep`.",
            ],
        ),
        ("code", "", ["from IPython.display import Image\n", "\n", "from lab import sweep"]),
        (
            "code",
            "parameters",
            [
                'notebook: str = "01_quickstart"  # a path or a name under notebooks/\n',
                'grid: dict = {"mode": ["propagated", "local"]}  # parameter -> values; every combination runs\n',
                'parameters: dict = {"family": "flux", "preset": "tiny"}  # given to every run\n',
                "jobs: int = 2  # runs in parallel\n",
                'metric: str = ""  # column to plot; "" = the first headline metric present\n',
                "interactive: bool = False  # kept like every notebook; each run gets interactive=False\n",
                'out_dir: str = "runs/sweep"  # sweep folder: one sub-folder per run, sweep.csv, sweep.png',
            ],
        ),
        (
            "code",
            "",
            [
                "result = sweep.run_sweep(\n",
                "    notebook, grid, out_dir, parameters=parameters, jobs=jobs, metric=metric or None\n",
                ")\n",
                "print(result.describe())",
            ],
        ),
        ("code", "", ["result.table()"]),
        ("code", "", ["Image(filename=str(result.plot_path)) if result.plot_path else None"]),
    ],
    "07_fsdp2.ipynb": [
        (
            "markdown",
            "",
            [
                "# The trainer side under real FSDP2, beside its in-process emulation; gradients\n",
                "\n",
                "Pairs the rollout side against the trainer side twice: emulated in this process\n",
                "(WeightView casts) and run under real FSDP2 in `nproc` torchrun ranks (gloo on CPU,\n",
                "NCCL on GPU). Equal tables mean the emulation is exact. Then the gradient of one\n",
                "Flow-GRPO step's log-prob on both sides, per parameter, and FSDP2's reduce dtype\n",
                "(fp32 vs bf16) against an unsharded fp32 reference. At 1 rank a bf16 reduce only\n",
                "rounds the fp32-computed gradients; `-p nproc 2` adds the rounding of the rank sum.",
            ],
        ),
        (
            "code",
            "",
            [
                "import lab\n",
                "from lab import fsdp, gradients, plots\n",
                "from lab.result import results_table",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "wan2_2"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced, full\n',
                "nproc: int = 1  # FSDP2 ranks (gloo on CPU, one GPU each on cuda)\n",
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                'metric: str = "rel_max"  # metric of the plots\n',
                "interactive: bool = False  # True: also show the plotly overlay\n",
                'out_dir: str = "runs/fsdp2"  # where the JSON files and PNGs go',
            ],
        ),
        (
            "code",
            "",
            [
                "runs = {\n",
                '    "in-process emulation": lab.pair_family(family, preset, seed=seed, device=device),\n',
                '    "real FSDP2": fsdp.pair_fsdp2(family, preset, seed=seed, nproc=nproc, device=device),\n',
                "}",
            ],
        ),
        ("code", "", ["results_table(list(runs.values())).assign(run=list(runs))"]),
        (
            "code",
            "",
            [
                'plots.save_figure(plots.plot_overlay(runs, metric), f"{out_dir}/emulation_vs_fsdp2.png")'
            ],
        ),
        (
            "code",
            "",
            ['plots.plot_overlay(runs, metric, backend="plotly") if interactive else None'],
        ),
        (
            "code",
            "",
            [
                "grads = gradients.gradient_pair(family, preset, seed=seed, device=device)\n",
                "print(grads.describe())",
            ],
        ),
        ("code", "", ["grads.table()"]),
        (
            "code",
            "",
            [
                "plots.save_figure(gradients.plot_gradient_divergence(grads, metric),\n",
                '                  f"{out_dir}/gradient_divergence.png")',
            ],
        ),
        (
            "code",
            "",
            [
                "reduce = fsdp.compare_reduce_dtypes(family, preset, nproc=nproc, device=device, seed=seed)"
            ],
        ),
        ("code", "", ["gradients.gradient_summaries(reduce)"]),
        (
            "code",
            "",
            [
                "plots.save_figure(gradients.plot_gradient_divergence(reduce, metric),\n",
                '                  f"{out_dir}/reduce_dtypes.png")',
            ],
        ),
        (
            "code",
            "",
            [
                'runs["real FSDP2"].to_json(f"{out_dir}/results.json")\n',
                'runs["in-process emulation"].to_json(f"{out_dir}/in_process.json")\n',
                'gradients.save_gradient_results({"rollout vs trainer": grads, **reduce},\n',
                '                                f"{out_dir}/gradients.json")',
            ],
        ),
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

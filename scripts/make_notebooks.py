"""Write the committed notebooks from their cell sources (thin: each cell calls one lab function).

Run `python scripts/make_notebooks.py` after editing a notebook's cells here; the committed
.ipynb files carry no outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

# Parameters cells: one `name: type = default  # help` per line. papermill's parser drops any
# line holding a second "=", so the help text never contains one (tests/test_notebooks.py).
BACKEND = '"plotly" if interactive else "matplotlib"'
INTERACTIVE = (
    "interactive: bool = True  # True: plotly figures (hover, zoom); False: static matplotlib\n"
)
OVERWRITE = "overwrite: bool = False  # True: write into an out_dir that holds another run's results (replacing them)"
FRESH = "empty for a fresh folder of its own under runs/"


def out_dir_line(kind: str, what: str) -> str:
    """The `out_dir` parameter: empty by default, so each run writes a fresh folder."""
    return f'out_dir: str = ""  # where {what} go; {FRESH}{kind}/\n'


def folder_cell(kind: str, labels: str, call: str = "run_folder") -> tuple[str, str, list[str]]:
    """The cell that makes the run's folder (`lab.runs.run_folder`) and says where it is."""
    return (
        "code",
        "",
        [
            f"out_dir = {call}(\n",
            f'    "{kind}", out_dir, {labels}overwrite=overwrite\n',
            ")\n",
            'print(f"writing to {out_dir}")',
        ],
    )


NOTEBOOKS: dict[str, list[tuple[str, str, list[str]]]] = {
    "00_index.ipynb": [
        (
            "markdown",
            "",
            [
                "# Precision Lab: which notebook is for what\n",
                "\n",
                "Every notebook pairs a rollout (reference) forward with a trainer (candidate) forward of a\n",
                "diffusers DiT and shows where and how far they drift apart. Run all cells with the defaults\n",
                "and each one shows its figures inline (plotly: hover for the module, its dtypes and metrics).\n",
                "Headless: `python -m lab.views.notebooks notebooks/01_quickstart.ipynb out.ipynb -p family sd3`\n",
                "(papermill's command line; dict and list parameters take JSON text). Each run writes a\n",
                "fresh folder under `runs/` of the working directory (or `$LAB_HOME`), named for its family,\n",
                "preset and time, and prints it; `-p out_dir DIR` names one instead.\n",
                "\n",
                "| notebook | what it is for |\n",
                "|---|---|\n",
                "| `01_quickstart` | one paired forward: per-module divergence, first divergent module, results.json |\n",
                "| `02_ratio_drift` | a Flow-GRPO rollout recomputed by the trainer: PPO ratio drift per step |\n",
                "| `03_control_panel` | the widget panel: toggle input_dtype_policy, autocast, rules; Run; Export a report |\n",
                "| `04_param_overrides` | the family's suggested fp32 rules: what they match, and whether they lower the divergence |\n",
                "| `05_sweep` | a notebook over a parameter grid (papermill, parallel), one table and a plot |\n",
                "| `06_scenarios` | the known rollout/trainer mismatches, each found by the lab itself |\n",
                "| `07_fsdp2` | the trainer side under real FSDP2 with per-parameter mixed precision; gradients |\n",
                "| `08_causes` | which modules cause the divergence (grafting), what it does to the update (KL, noise floor), pipeline checks |\n",
                "| `09_saved_runs` | saved results (runs, sweeps, baselines): overlay any two or more, settings diff |\n",
                "| `10_sharded` | both sides under FSDP2 across ranks: models one GPU cannot hold (MiniMax H3 full on 2 GPUs) |\n",
                "| `11_prescribe` | which setting causes the drift (Shapley shares), the cheapest verified fix, a contract that keeps it |\n",
                "| `12_real_engine` | the real engine's own DiT (sglang) against the trainer, and the emulated rollout checked against it (the `engine` extra) |\n",
                "\n",
                "The same from a shell: `precision-lab pair | drift | report | sweep | scenarios | compare`\n",
                "(`precision-lab --help`).",
            ],
        ),
        ("code", "", ["import lab\n", "from lab import runs"]),
        (
            "code",
            "parameters",
            [
                'root: str = ""  # folder searched for saved runs; empty for runs/ and baselines/ of the working folder (or LAB_HOME)'
            ],
        ),
        ("code", "", ["lab.families()"]),
        ("code", "", ["runs.runs_table(runs.list_runs(root or None))"]),
    ],
    "01_quickstart.ipynb": [
        (
            "markdown",
            "",
            [
                "# Quickstart: one paired forward, rollout vs trainer\n",
                "\n",
                "Builds a family DiT with seeded weights, runs the same inputs under the engine-like\n",
                "rollout side and the FSDP2-like trainer side, and shows where they first diverge.\n",
                "Headless: `python -m lab.views.notebooks notebooks/01_quickstart.ipynb out.ipynb -p family wan2_2`\n",
                "(or `precision-lab pair --family wan2_2`).",
            ],
        ),
        (
            "code",
            "",
            [
                "import lab\n",
                "from lab import plots\n",
                "from lab.parameters import json_parameter\n",
                "from lab.runs import run_folder",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "flux"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU, milliseconds), reduced (real width, 2 blocks), full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                'mode: str = "propagated"  # propagated (error accumulates) or local (per-op error)\n',
                "sigma: float = 0.75  # flow-matching sigma of the step\n",
                'rollout_overrides: dict = {}  # Side field overrides (JSON), e.g. {"attention_backend": "math"}\n',
                'trainer_overrides: dict = {}  # e.g. {"autocast": false, "param_dtype_rules": {"*norm*": "fp32"}}\n',
                INTERACTIVE,
                out_dir_line("quickstart", "results.json and divergence_by_layer.png"),
                OVERWRITE,
            ],
        ),
        (
            "code",
            "",
            [
                'rollout_overrides = json_parameter("rollout_overrides", rollout_overrides, dict)\n',
                'trainer_overrides = json_parameter("trainer_overrides", trainer_overrides, dict)\n',
                f"backend = {BACKEND}",
            ],
        ),
        folder_cell("quickstart", "family=family, preset=preset, mode=mode, "),
        (
            "code",
            "",
            [
                "result = lab.pair_family(\n",
                "    family,\n",
                "    preset,\n",
                "    seed=seed,\n",
                "    device=device,\n",
                "    mode=mode,\n",
                "    sigma=sigma,\n",
                "    rollout=rollout_overrides,\n",
                "    trainer=trainer_overrides,\n",
                ")\n",
                "print(result.describe())",
            ],
        ),
        (
            "code",
            "",
            [
                "plots.show(\n",
                '    plots.plot_divergence_by_layer(result, "rel_max", backend=backend),\n',
                '    save_as=f"{out_dir}/divergence_by_layer.png",\n',
                ")",
            ],
        ),
        ("code", "", ["print(f\"wrote {result.to_json(f'{out_dir}/results.json')}\")"]),
        ("code", "", ["result.table().head(25)"]),
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
                "Headless: `python -m lab.views.notebooks notebooks/02_ratio_drift.ipynb out.ipynb -p family sd3`\n",
                "(or `precision-lab drift --family sd3`).",
            ],
        ),
        (
            "code",
            "",
            [
                "from lab import plots, trajectory, widgets\n",
                "from lab.parameters import json_parameter\n",
                "from lab.runs import run_folder",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "flux"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced (real width, 2 blocks), full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "steps: int = 10  # denoising steps\n",
                "sde_window: list = []  # [start, end) steps with SDE noise (JSON), e.g. [0, 4]; [] for every step\n",
                "noise_level: float = 0.7  # eta of the Flow-GRPO SDE\n",
                'sde_type: str = "sde"  # sde (Flow-SDE) or cps\n',
                "cfg_scale: float = 1.0  # guidance scale; above 1 runs CFG (not for flux, minimax_h3)\n",
                "samples: int = 2  # samples per prompt (cosmos3 runs one forward per sample)\n",
                "prompts: int = 1  # prompts (seeds seed, seed+1, ...)\n",
                "seed: int = 0  # weight and first prompt seed\n",
                "clip_range: float = 1e-4  # PPO clip range for clip_frac\n",
                'rollout_overrides: dict = {}  # Side field overrides (JSON), e.g. {"attention_backend": "math"}\n',
                'trainer_overrides: dict = {}  # e.g. {"autocast": false, "forward_dtype": "fp32"}\n',
                "panel: bool = False  # True: also open the control panel on this family\n",
                INTERACTIVE,
                out_dir_line("ratio_drift", "results.json and the PNGs"),
                OVERWRITE,
            ],
        ),
        (
            "code",
            "",
            [
                'sde_window = json_parameter("sde_window", sde_window, list)\n',
                'rollout_overrides = json_parameter("rollout_overrides", rollout_overrides, dict)\n',
                'trainer_overrides = json_parameter("trainer_overrides", trainer_overrides, dict)\n',
                f"backend = {BACKEND}",
            ],
        ),
        folder_cell("ratio_drift", "family=family, preset=preset, "),
        (
            "code",
            "",
            [
                "traj = trajectory(\n",
                "    family,\n",
                "    preset,\n",
                "    steps=steps,\n",
                "    sde_window=sde_window or None,\n",
                "    noise_level=noise_level,\n",
                "    sde_type=sde_type,\n",
                "    cfg_scale=cfg_scale,\n",
                "    samples=samples,\n",
                "    prompts=prompts,\n",
                "    seed=seed,\n",
                "    device=device,\n",
                "    clip_range=clip_range,\n",
                "    rollout=rollout_overrides,\n",
                "    trainer=trainer_overrides,\n",
                ")\n",
                "print(traj.describe())",
            ],
        ),
        (
            "code",
            "",
            [
                "plots.show(\n",
                '    plots.plot_ratio_drift(traj, backend=backend), save_as=f"{out_dir}/ratio_drift.png"\n',
                ")",
            ],
        ),
        (
            "code",
            "",
            [
                "plots.show(\n",
                '    plots.plot_ratio_histogram(traj, backend=backend), save_as=f"{out_dir}/ratio_hist.png"\n',
                ")",
            ],
        ),
        (
            "code",
            "",
            [
                "plots.show(\n",
                "    plots.plot_logprob_vs_velocity_gap(traj, backend=backend),\n",
                '    save_as=f"{out_dir}/logprob_vs_velocity_gap.png",\n',
                ")",
            ],
        ),
        ("code", "", ["print(f\"wrote {traj.to_json(f'{out_dir}/results.json')}\")"]),
        ("code", "", ["traj.per_step()"]),
        (
            "code",
            "",
            [
                "widgets.control_panel(family=family, preset=preset, device=device) if panel else None"
            ],
        ),
    ],
    "03_control_panel.ipynb": [
        (
            "markdown",
            "",
            [
                "# Control panel: toggle one setting, re-run, look\n",
                "\n",
                'Each side has a control for every setting a row\'s "why" can name: its dtype flags, the\n',
                "input_dtype_policy of each input role, autocast, per-parameter rules (`glob: dtype`, one per\n",
                "line, compiled live against the built model), the engine fp32 keeps (`keep_fp32_modules`),\n",
                "the buffer casts (`cast_buffers`), the attention kernel, and the engine patch groups and op\n",
                "switches that apply to this family. Run pairs the two sides on the cached model (well under\n",
                'a second on tiny) and updates the plot in place (click a module for its row, its "why" and\n',
                'its dtypes); an edit after a run marks the results stale until the next Run (or tick "run on\n',
                'every change"). Prescribe lists the cheapest verified changes to one side with their costs;\n',
                "Apply sets that side to one and runs. Export writes `report.html` + `results.json`. With the\n",
                "defaults (`run_and_export=True`) the notebook first applies `settings`, runs one pair, exports\n",
                "it to `out_dir` and shows its figure and verdict, then shows the panel.",
            ],
        ),
        (
            "code",
            "",
            [
                "from lab import plots\n",
                "from lab.parameters import json_parameter\n",
                "from lab.runs import run_folder\n",
                "from lab.widgets import control_panel",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "flux"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced, full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                'settings: dict = {}  # panel control -> value (JSON), e.g. {"trainer.autocast": false}\n',
                "run_and_export: bool = True  # True: run one pair with settings and export it before the panel; False: panel only\n",
                INTERACTIVE,
                out_dir_line("control_panel", "the headless run's results.json and report.html"),
                OVERWRITE,
            ],
        ),
        ("code", "", ['settings = json_parameter("settings", settings, dict)']),
        ("code", "", [f"backend = {BACKEND}"]),
        ("code", "", ["panel = control_panel(family, preset, device, seed=seed)"]),
        ("code", "", ["panel.apply(settings)"]),
        (
            "code",
            "",
            [
                "if run_and_export:\n",
                "    out_dir = run_folder(\n",
                '        "control_panel", out_dir, family=family, preset=preset, overwrite=overwrite\n',
                "    )\n",
                '    print(f"writing to {out_dir}")\n',
                "    panel.run_and_export(out_dir)\n",
                "    print(panel.verdict())\n",
                "    plots.show(\n",
                '        plots.plot_divergence_by_layer(panel.last_result, "rel_max", backend=backend),\n',
                '        save_as=f"{out_dir}/divergence_by_layer.png",\n',
                "    )",
            ],
        ),
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
                "By default this runs the family's own `fp32_rule_suggestions` (norms, modulation,\n",
                "embeddings, output head). The table shows what each rule matched; the overlay pairs the\n",
                "trainer against the rollout without and with the rules. The verdict below is computed from\n",
                "the two runs and the parameter dtypes of both sides: whether the rules lowered\n",
                "`model_output_rel_max`, whether the trainer's divergence comes from parameters at all, which\n",
                "rules give the trainer the rollout's dtype and which change its compute instead, and, when\n",
                'nothing moved, whether the pinned values already sat exactly on the bf16 grid (then "no\n',
                'effect" describes the weights, not the rules).',
            ],
        ),
        (
            "code",
            "",
            [
                "from lab import plots\n",
                "from lab.parameters import json_parameter\n",
                "from lab.report import write_html\n",
                "from lab.rule_effect import rule_effect\n",
                "from lab.runs import run_folder\n",
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
                "rules: dict = {}  # ordered glob -> dtype for the trainer (JSON); {} for the family's fp32_rule_suggestions\n",
                'metric: str = "rel_max"  # the overlay metric (a Result.table() column)\n',
                INTERACTIVE,
                out_dir_line(
                    "param_overrides", "results.json, without_rules.json, the PNG and report.html"
                ),
                OVERWRITE,
            ],
        ),
        (
            "code",
            "",
            ['rules = json_parameter("rules", rules, dict)\n', f"backend = {BACKEND}"],
        ),
        folder_cell("param_overrides", "family=family, preset=preset, "),
        (
            "code",
            "",
            ["effect = rule_effect(family, preset, rules or None, seed=seed, device=device)"],
        ),
        ("code", "", ["rule_matches_table(effect.matches)"]),
        ("code", "", ["effect.table()"]),
        (
            "code",
            "",
            [
                "plots.show(\n",
                '    plots.plot_overlay(effect.runs, metric, backend=backend), save_as=f"{out_dir}/overlay.png"\n',
                ")",
            ],
        ),
        ("code", "", ["print(effect.describe())"]),
        ("code", "", ["effect.rule_gaps()"]),
        (
            "code",
            "",
            [
                'print(f"wrote {effect.save(out_dir)}/results.json, without_rules.json, rule_effect.json")\n',
                'write_html(effect.runs, f"{out_dir}/report.html", metric=metric);',
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
                "`precision-lab sweep 01_quickstart --grid mode=propagated,local -p family=flux`.\n",
                "Compare any of its runs afterwards in `09_saved_runs` or with `precision-lab compare`.",
            ],
        ),
        (
            "code",
            "",
            ["from lab import plots, sweep\n", "from lab.parameters import json_parameter"],
        ),
        (
            "code",
            "parameters",
            [
                'notebook: str = "01_quickstart"  # a path or a name under notebooks/\n',
                'grid: dict = {"mode": ["propagated", "local"]}  # parameter -> values (JSON); every combination runs\n',
                'parameters: dict = {"family": "flux", "preset": "tiny"}  # given to every run (JSON)\n',
                "jobs: int = 2  # runs in parallel\n",
                'metric: str = ""  # column to plot; empty for the first headline metric present\n',
                'out_dir: str = ""  # sweep folder (a sub-folder per run, sweep.csv, sweep.png); empty for a fresh one under runs/sweep/\n',
                "overwrite: bool = False  # True: run into an out_dir that holds an earlier sweep (replacing its runs)",
            ],
        ),
        (
            "code",
            "",
            [
                'grid = json_parameter("grid", grid, dict)\n',
                'parameters = json_parameter("parameters", parameters, dict)',
            ],
        ),
        (
            "code",
            "",
            [
                "result = sweep.run_sweep(\n",
                "    notebook, grid, out_dir, parameters=parameters, jobs=jobs, metric=metric or None,\n",
                "    overwrite=overwrite,\n",
                ")\n",
                "print(result.describe())",
            ],
        ),
        ("code", "", ["result.table()"]),
        ("code", "", ["plots.show(sweep.plot_sweep(result.table(), metric or None))"]),
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
                "Headless: `python -m lab.views.notebooks notebooks/06_scenarios.ipynb out.ipynb -p device cuda`\n",
                "(or `precision-lab scenarios --device cuda`).",
            ],
        ),
        (
            "code",
            "",
            [
                "from lab import plots, scenarios\n",
                "from lab.parameters import json_parameter\n",
                "from lab.runs import run_folder",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'device: str = "cpu"  # cpu or cuda (cuda adds the GPU-only scenarios)\n',
                'preset: str = "tiny"  # tiny (CPU), reduced (real width, 2 blocks)\n',
                'only: list = []  # scenario names to run (JSON), e.g. ["sd3_fp16_vs_bf16"]; [] for all on the device\n',
                INTERACTIVE,
                out_dir_line("scenarios", "scenarios.json, the Results and the PNG"),
                OVERWRITE,
            ],
        ),
        ("code", "", ['only = json_parameter("only", only, list)\n', f"backend = {BACKEND}"]),
        folder_cell("scenarios", "preset=preset, label=device, "),
        ("code", "", ["runs = scenarios.run_all(preset, device, only or None)"]),
        ("code", "", ["scenarios.scenarios_table(runs)"]),
        (
            "code",
            "",
            [
                "plots.show(\n",
                '    plots.plot_bug_vs_fixed(runs, backend=backend), save_as=f"{out_dir}/bug_vs_fixed.png"\n',
                ")",
            ],
        ),
        ("code", "", ['print(f"wrote {scenarios.save_runs(runs, out_dir)}")']),
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
                "from lab.result import results_table\n",
                "from lab.runs import run_folder",
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
                INTERACTIVE,
                out_dir_line("fsdp2", "the JSON files and PNGs"),
                OVERWRITE,
            ],
        ),
        ("code", "", [f"backend = {BACKEND}"]),
        folder_cell("fsdp2", "family=family, preset=preset, "),
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
                "plots.show(\n",
                '    plots.plot_overlay(runs, metric, backend=backend), save_as=f"{out_dir}/emulation_vs_fsdp2.png"\n',
                ")",
            ],
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
                "plots.show(\n",
                '    plots.plot_gradient_divergence(grads, metric), save_as=f"{out_dir}/gradient_divergence.png"\n',
                ")",
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
                "plots.show(\n",
                '    plots.plot_gradient_divergence(reduce, metric), save_as=f"{out_dir}/reduce_dtypes.png"\n',
                ")",
            ],
        ),
        (
            "code",
            "",
            [
                'runs["real FSDP2"].to_json(f"{out_dir}/results.json")\n',
                'runs["in-process emulation"].to_json(f"{out_dir}/in_process.json")\n',
                "gradients.save_gradient_results(\n",
                '    {"rollout vs trainer": grads, **reduce}, f"{out_dir}/gradients.json"\n',
                ")\n",
                'print(f"wrote {out_dir}: results.json, in_process.json, gradients.json")',
            ],
        ),
    ],
    "08_causes.ipynb": [
        (
            "markdown",
            "",
            [
                "# Causes and consequences: which modules cause it, what it does to the update, is it the DiT at all\n",
                "\n",
                "1. **Attribution by grafting** (`lab.attribute`): side B runs with side A's outputs grafted in,\n",
                "   unit after unit in forward order; each unit's share of the final divergence, split into\n",
                "   what it adds itself and what reaches it from the root's own code.\n",
                "2. **Policy-level metrics** (`lab.trajectory`): per step the KL between the two sides' SDE\n",
                "   transitions, chi-square, the numeric noise floor against the PPO clip range, and which\n",
                "   modules cause the log-prob drift of the worst step (`lab.attribute_step`).\n",
                "3. **Pipeline parity checks** (`lab.checks`): batch invariance, CFG batching, sigma/timestep\n",
                "   parity and weight sync, each with a verdict.\n",
                "\n",
                "Headless: `python -m lab.views.notebooks notebooks/08_causes.ipynb out.ipynb -p family flux`",
            ],
        ),
        (
            "code",
            "",
            [
                "import lab\n",
                "from lab import checks, plots\n",
                "from lab.pairing.weights import WeightView\n",
                "from lab.runs import run_folder",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "sd3"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced, full\n',
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                'level: str = "block"  # attribution units: "block" or a depth such as 2\n',
                "fraction: float = 0.9  # smallest_set: the share of the divergence its grafts remove\n",
                "steps: int = 10  # trajectory steps\n",
                "cfg_scale: float = 4.5  # guidance of the trajectory and the CFG check (1.0 where the family has no CFG)\n",
                "samples: int = 4  # trajectory samples per prompt\n",
                "clip_range: float = 1e-4  # the PPO clip range the noise floor is read against\n",
                "batch: int = 4  # batch of the batch-invariance check\n",
                INTERACTIVE,
                out_dir_line("causes", "the JSON files and PNGs"),
                OVERWRITE,
            ],
        ),
        folder_cell("causes", "family=family, preset=preset, "),
        (
            "code",
            "",
            [
                f"backend = {BACKEND}\n",
                "level = int(level) if str(level).isdigit() else level\n",
                "fam = lab.family(family)\n",
                "# Guidance-distilled families (flux, minimax_h3) run one forward a step: no CFG to scale.\n",
                'has_cfg = fam.cfg_layout != "none"\n',
                "model = fam.build(preset, seed, device=device, expert=fam.expert_for_sigma(0.75))\n",
                "inputs = fam.make_inputs(preset, seed, device=device)\n",
                "rollout = lab.Side.rollout(fam, device=device)\n",
                "trainer = lab.Side.trainer(fam, device=device)",
            ],
        ),
        ("markdown", "", ["## 1. Which modules cause the final divergence"]),
        (
            "code",
            "",
            [
                "attr = lab.attribute(model, inputs, rollout, trainer, level=level)\n",
                "print(attr.verdict)\n",
                'attr.to_json(f"{out_dir}/attribution.json")\n',
                "attr.ranked().head(12)",
            ],
        ),
        (
            "code",
            "",
            [
                'plots.show(plots.plot_attribution(attr, backend=backend), save_as=f"{out_dir}/attribution.png")',
            ],
        ),
        (
            "code",
            "",
            [
                "smallest = attr.smallest_set(fraction)\n",
                "print(smallest)\n",
                "attr.by_class().head(8)",
            ],
        ),
        ("markdown", "", ["## 2. What it does to the policy update"]),
        (
            "code",
            "",
            [
                "traj = lab.trajectory(\n",
                "    family, preset, steps=steps, cfg_scale=cfg_scale if has_cfg else 1.0,\n",
                "    samples=samples, seed=seed,\n",
                "    device=device, clip_range=clip_range,\n",
                ")\n",
                'traj.per_step()[["step", "sigma", "transition_kl", "chi_square", "log_prob_mean_abs_diff", "clip_frac"]]',
            ],
        ),
        (
            "code",
            "",
            [
                "floor = traj.noise_floor(clip_range)\n",
                "print(floor.verdict)\n",
                'plots.show(plots.plot_noise_floor(floor, backend=backend), save_as=f"{out_dir}/noise_floor.png")',
            ],
        ),
        (
            "markdown",
            "",
            [
                "Which modules cause the log-prob drift at the step where it is largest: the same grafting,\n",
                "each graft scored as that step's exact log ratio of the rollout's own sample (`lab.attribute_step`).",
            ],
        ),
        (
            "code",
            "",
            [
                "per_step = traj.per_step()\n",
                'worst = int(per_step.loc[per_step["log_prob_mean_abs_diff"].idxmax(), "step"])\n',
                "step_attr = lab.attribute_step(traj, worst, level=level)\n",
                "print(step_attr.verdict)\n",
                'step_attr.to_json(f"{out_dir}/attribution_step.json")\n',
                'plots.show(plots.plot_attribution(step_attr, backend=backend), save_as=f"{out_dir}/attribution_step.png")',
            ],
        ),
        ("markdown", "", ["## 3. Is it the DiT at all? Pipeline parity checks"]),
        (
            "code",
            "",
            [
                "engine_view = WeightView(model, rollout)\n",
                "with engine_view.applied():\n",
                "    engine_weights = {k: v.clone() for k, v in model.state_dict().items()}\n",
                "results = {\n",
                '    "batch_invariance": checks.batch_invariance(model, inputs, trainer, batch=batch),\n',
                '    "cfg_batching": checks.cfg_batching(\n',
                "        model, fam.make_inputs(preset, seed, device=device, cfg=has_cfg), trainer,\n",
                "        cfg_scale=cfg_scale,\n",
                "    ),\n",
                '    "sigma_parity": checks.sigma_parity(fam, rollout, trainer, steps=steps, preset=preset),\n',
                '    "weight_sync": checks.weight_sync(\n',
                "        model, engine_weights, expect_dtype=fam.rollout_dtype,\n",
                "        keep_fp32_modules=fam.engine_fp32_modules,\n",
                "    ),\n",
                "}\n",
                "for name, result in results.items():\n",
                '    result.to_json(f"{out_dir}/{name}.json")\n',
                '    print(f"{name}: {result.verdict}")',
            ],
        ),
        (
            "code",
            "",
            [
                "for name, result in results.items():\n",
                '    plots.show(plots.plot_check(result, backend=backend), save_as=f"{out_dir}/{name}.png")',
            ],
        ),
    ],
    "09_saved_runs.ipynb": [
        (
            "markdown",
            "",
            [
                "# Saved runs: list them, overlay any two or more, diff their settings\n",
                "\n",
                "Every results.json the lab wrote (notebooks, `precision-lab pair` and sweeps under `runs/`,\n",
                "baselines under `baselines/`, both in the working folder or `$LAB_HOME`), newest first, like TensorBoard's or W&B's run\n",
                "list. `compare` picks runs by name, path or a unique part of a name (`[]`: the two newest);\n",
                "the first is the reference the others are held to. The overlay shows the metric across\n",
                "depth for each run, the settings diff every side field and meta value that differs, and\n",
                "the verdict which module outputs got worse or better than in the first run. With\n",
                "`examples=True` and fewer than two saved runs, two tiny flux runs (the trainer as it is,\n",
                "then matched to the engine) are saved first so there is something to compare.\n",
                "The same from a shell: `precision-lab compare RUN RUN [...]`.",
            ],
        ),
        (
            "code",
            "",
            [
                "from lab import plots, runs\n",
                "from lab.parameters import json_parameter\n",
                "from lab.report import write_html",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'root: str = ""  # folder searched for saved results; empty for runs/ and baselines/ of the working folder (or LAB_HOME)\n',
                "compare: list = []  # runs to compare (JSON: names, paths or parts of names); [] for the two newest\n",
                'metric: str = "rel_max"  # the per-module metric of the overlay and the verdicts\n',
                "examples: bool = True  # with fewer than two saved runs, first save two tiny flux runs to compare\n",
                INTERACTIVE,
                out_dir_line("saved_runs", "overlay.png, settings_diff.csv and report.html"),
                OVERWRITE,
            ],
        ),
        (
            "code",
            "",
            [
                'compare = json_parameter("compare", compare, list)\n',
                "root = root or None\n",
                f"backend = {BACKEND}",
            ],
        ),
        ("code", "", ["examples_written = runs.save_examples(root) if examples else []"]),
        ("code", "", ["saved = runs.list_runs(root)\n", "runs.runs_table(saved)"]),
        (
            "code",
            "",
            [
                "cmp = runs.compare_runs(compare or runs.newest(saved, 2), root=root, metric=metric)\n",
                "print(cmp.describe())",
            ],
        ),
        ("code", "", ["cmp.summary()"]),
        ("code", "", ["cmp.settings_diff()"]),
        folder_cell("saved_runs", "", call="runs.run_folder"),
        (
            "code",
            "",
            [
                'plots.show(cmp.plot_overlay(metric, backend=backend), save_as=f"{out_dir}/overlay.png")',
            ],
        ),
        ("code", "", ["cmp.verdicts()"]),
        (
            "code",
            "",
            [
                'cmp.settings_diff().to_csv(f"{out_dir}/settings_diff.csv")\n',
                'write_html(cmp.runs, f"{out_dir}/report.html", metric=metric);',
            ],
        ),
    ],
    "10_sharded.ipynb": [
        (
            "markdown",
            "",
            [
                "# Both sides sharded: models one GPU cannot hold\n",
                "\n",
                "Pairs the rollout and trainer sides with **both** run under real FSDP2 across `nproc` ranks\n",
                "(gloo on CPU, one GPU each on cuda). Each rank builds only its rows of the seeded fp32 master,\n",
                "so a model no single GPU holds pairs across several: MiniMax H3 full (33 B parameters, 123.4 GiB\n",
                "of fp32 master) takes `-p preset full -p device cuda -p nproc 2` on two H200s, 62.7 GiB a rank.\n",
                "The rollout side runs as the engine loads it (keep-fp32 modules as rules, buffers cast), each\n",
                "block gathered at its dtype. Block outputs and the model output by default (`capture_depth=1`).\n",
                "A rank that fails (out of memory, a dtype error) raises `lab.fsdp.ShardedPairError`, naming the\n",
                "side, the module and the rank: its `result` holds the pairs compared before the failure and its\n",
                "`captures` what each side's rank 0 had captured.\n",
                "Headless: `python -m lab.views.notebooks notebooks/10_sharded.ipynb out.ipynb -p family qwen_image`.",
            ],
        ),
        (
            "code",
            "",
            ["import lab\n", "from lab import fsdp, plots\n", "from lab.runs import run_folder"],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "minimax_h3"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced, full (MiniMax H3 full: nproc 2 on cuda)\n',
                "nproc: int = 2  # FSDP2 ranks (gloo on CPU, one GPU each on cuda)\n",
                'device: str = "cpu"  # cpu or cuda\n',
                "seed: int = 0  # weight and input seed\n",
                "capture_depth: int = 1  # 1: block outputs and the model output; 2+: deeper modules too\n",
                'metric: str = "rel_max"  # metric of the plot\n',
                INTERACTIVE,
                out_dir_line("sharded", "results.json and divergence_by_layer.png"),
                OVERWRITE,
            ],
        ),
        ("code", "", [f"backend = {BACKEND}"]),
        folder_cell("sharded", "family=family, preset=preset, "),
        (
            "code",
            "",
            [
                "result = fsdp.pair_sharded(\n",
                "    family, preset, nproc=nproc, device=device, seed=seed, capture_depth=capture_depth\n",
                ")\n",
                "print(result.describe())",
            ],
        ),
        ("code", "", ["fsdp.sharded_ranks_table(result)"]),
        (
            "code",
            "",
            [
                "plots.show(\n",
                "    plots.plot_divergence_by_layer(result, metric, backend=backend),\n",
                '    save_as=f"{out_dir}/divergence_by_layer.png",\n',
                ")",
            ],
        ),
        ("code", "", ["print(f\"wrote {result.to_json(f'{out_dir}/results.json')}\")"]),
        ("code", "", ["result.table().head(25)"]),
    ],
    "11_prescribe.ipynb": [
        (
            "markdown",
            "",
            [
                "# From diagnosis to prescription: which setting causes the drift, and the fix\n",
                "\n",
                "Splits the difference between the rollout and the trainer side into knobs (each\n",
                "differing setting, rule, input role, keep, op switch) and gives each its exact\n",
                "Shapley share of the divergence; then searches the cheapest changes to the trainer\n",
                "(copy a knob from the rollout, fp32 rules, op switches) that meet the target, each\n",
                "verified by a paired forward with its measured cost; shows the divergence before and\n",
                "after the best one, and writes a numerics contract that keeps it (`precision-lab\n",
                "contract check contract.json` in CI). Headless:\n",
                "`python -m lab.views.notebooks notebooks/11_prescribe.ipynb out.ipynb -p family sd3`.",
            ],
        ),
        (
            "code",
            "",
            [
                "import lab\n",
                "from lab import plots\n",
                "from lab.causes.prescribe import parse_target\n",
                "from lab.runs import run_folder",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "sd3"  # one of lab.families()\n',
                'preset: str = "tiny"  # tiny (CPU), reduced, full\n',
                "seed: int = 0  # weight and input seed\n",
                "sigma: float = 0.75  # flow-matching sigma of the step\n",
                'target: str = "bitexact"  # bitexact, or a threshold as JSON: {"metric": "rel_max", "max": 1e-3}\n',
                'movable: str = "b"  # the side that may change: b (the trainer) or a (the rollout)\n',
                INTERACTIVE,
                out_dir_line("prescribe", "the figures, tables and contract.json"),
                OVERWRITE,
            ],
        ),
        ("code", "", ["target = parse_target(target)\n", f"backend = {BACKEND}"]),
        folder_cell("prescribe", "family=family, preset=preset, "),
        ("code", "", ["fam = lab.family(family)"]),
        ("code", "", ["model = fam.build(preset, seed, expert=fam.expert_for_sigma(sigma))"]),
        ("code", "", ["inputs = fam.make_inputs(preset, seed, sigma=sigma)"]),
        ("code", "", ["rollout, trainer = lab.Side.rollout(fam), lab.Side.trainer(fam)"]),
        (
            "code",
            "",
            [
                "shares = lab.attribute_settings(model, inputs, rollout, trainer)\n",
                "print(shares.describe())",
            ],
        ),
        (
            "code",
            "",
            ['plots.show(shares.plot(backend=backend), save_as=f"{out_dir}/knob_shares.png")'],
        ),
        ("code", "", ["shares.table()"]),
        (
            "code",
            "",
            [
                "found = lab.prescribe(model, inputs, rollout, trainer, target=target, movable=movable)\n",
                "print(found.describe())",
            ],
        ),
        ("code", "", ["found.table()"]),
        ("code", "", ['found.to_json(f"{out_dir}/prescriptions.json")']),
        ("code", "", ["before = lab.pair(model, inputs, rollout, trainer, check_outputs=False)"]),
        ("code", "", ["after = found.best().result if found.best() else before"]),
        (
            "code",
            "",
            [
                "plots.show(\n",
                '    plots.plot_overlay({"before": before, "after the best prescription": after},\n',
                '                       "rel_max", backend=backend),\n',
                '    save_as=f"{out_dir}/before_after.png",\n',
                ")",
            ],
        ),
        (
            "code",
            "",
            [
                "lab.contract.write(\n",
                '    f"{out_dir}/contract.json", family, preset, seed=seed, sigma=sigma,\n',
                "    rollout=lab.Side.from_dict(after.side_a), trainer=lab.Side.from_dict(after.side_b),\n",
                "    overwrite=True,\n",
                ')["clauses"][:5]',
            ],
        ),
    ],
    "12_real_engine.ipynb": [
        (
            "markdown",
            "",
            [
                "# The real engine: sglang-diffusion's own DiT against the trainer\n",
                "\n",
                "Builds the family's model, then the engine's own DiT class from the same weights (the\n",
                "engine's loader and parameter mapping), and pairs them module by module through the\n",
                "alignment of the two trees: renamed modules, fused projections split into the modules\n",
                "they fuse, every unaligned module listed with its reason. The emulation check runs the\n",
                "lab's emulated rollout side against the same engine, beside both against the trainer.\n",
                "Needs the `engine` extra (`bash scripts/install_engine.sh`); CPU. Headless:\n",
                "`python -m lab.views.notebooks notebooks/12_real_engine.ipynb out.ipynb -p family wan2_2`\n",
                "(or `precision-lab pair --engine sglang --family wan2_2`).",
            ],
        ),
        (
            "code",
            "",
            [
                "import lab\n",
                "from lab import plots\n",
                "from lab.engine import sglang as engine\n",
                "from lab.runs import run_folder",
            ],
        ),
        (
            "code",
            "parameters",
            [
                'family: str = "qwen_image"  # one of engine.ENGINE_FAMILIES\n',
                'preset: str = "tiny"  # tiny (CPU, seconds); the engine runs on the CPU here\n',
                "seed: int = 0  # weight and input seed\n",
                "sigma: float = 0.75  # flow-matching sigma of the step\n",
                INTERACTIVE,
                out_dir_line("real_engine", "the results, the table and the figure"),
                OVERWRITE,
            ],
        ),
        ("code", "", [f"backend = {BACKEND}"]),
        folder_cell("real_engine", "family=family, preset=preset, "),
        ("code", "", ["engine.supported()"]),
        (
            "code",
            "",
            [
                "check = engine.check_emulation(family, preset, seed=seed, sigma=sigma)\n",
                "print(check.describe())",
            ],
        ),
        ("code", "", ["check.engine.alignment.table()"]),
        ("code", "", ["result = check.engine_vs_trainer\n", "print(result.describe())"]),
        (
            "code",
            "",
            [
                "plots.show(\n",
                '    plots.plot_divergence_by_layer(result, "rel_max", backend=backend),\n',
                '    save_as=f"{out_dir}/divergence_by_layer.png",\n',
                ")",
            ],
        ),
        (
            "code",
            "",
            [
                'result.table()[["module", "module_a", "dtype_a", "dtype_b", "rel_max", "why"]].head(30)',
            ],
        ),
        ("code", "", ["check.table()"]),
        ("code", "", ["check.save(out_dir)"]),
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

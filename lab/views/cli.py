"""Command line: `precision-lab pair | drift | report | sweep | scenarios | compare`.

`python -m lab` is the same. Every subcommand takes the notebooks' parameter names
(`--family`, `--preset`, `--device`, `--seed`, `--out-dir`, `--rollout-overrides JSON`, ...).
Without `--out-dir` a run writes into a fresh folder of its own,
`runs/<command>/<family>-<preset>[-<mode>]-<time>` under the working directory (or $LAB_HOME),
and says where; an `--out-dir` that holds another run's results is refused unless
`--overwrite` is given (`lab.views.home.run_folder`). Every command exits with

    0  the run finished (and met any threshold given)
    1  the run found a failure: a pair that failed part-way (its partial result is saved), a
       threshold exceeded, a comparison worse than its reference, a sweep run or a scenario
       that failed
    2  bad arguments: the message names the bad value and what would be right; or the output
       folder is held by another run (its pid is named)
  130  stopped by Ctrl-C, 143 by SIGTERM: one line says so; what had finished is saved (a
       drift's completed steps, a sweep's finished rows, a sharded pair's compared pairs)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lab.base.arguments import option_type

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_EXIT_CODES = (
    "exit codes: 0 ok; 1 the run found a failure (see the subcommand); 2 bad arguments "
    "(the message names the bad value and the fix); 130 Ctrl-C, 143 SIGTERM (what finished "
    "is saved)"
)
PRESETS: tuple[str, ...] = ("tiny", "reduced", "full")
MODES: tuple[str, ...] = ("propagated", "local")


class UsageError(ValueError):
    """A command-line value the lab refused (exit code 2)."""


# ---- the parser ---------------------------------------------------------------------------


def _command(commands: Any, name: str, help_text: str, description: str) -> Any:
    return commands.add_parser(
        name,
        help=help_text,
        description=description,
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _out_dir_options(parser: argparse.ArgumentParser, kind: str, fresh: str) -> None:
    """--out-dir (default: a fresh folder) and --overwrite, as every run-writing command has."""
    parser.add_argument(
        "--out-dir",
        default="",
        help=f"where the files go (default: a fresh folder runs/{kind}/{fresh}-<time> under the "
        "working directory, or $LAB_HOME)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out-dir that holds another run's results (they are replaced); "
        "without it such a folder is refused",
    )


def _model_options(parser: argparse.ArgumentParser, kind: str, fresh: str) -> None:
    """The options pair and drift share, named as in notebooks 01 and 02."""
    from lab.families import FAMILY_NAMES

    parser.add_argument(
        "--family", default="flux", choices=FAMILY_NAMES, help="the DiT family (default flux)"
    )
    parser.add_argument(
        "--preset", default="tiny", choices=PRESETS, help="model size (default tiny: CPU, ms)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--seed", type=option_type(int), default=0, help="weight and input seed (default 0)"
    )
    parser.add_argument(
        "--rollout-overrides",
        default="{}",
        metavar="JSON",
        help='Side field overrides of the rollout, e.g. \'{"attention_backend": "math"}\'',
    )
    parser.add_argument(
        "--trainer-overrides",
        default="{}",
        metavar="JSON",
        help="Side field overrides of the trainer, e.g. '{\"autocast\": false}'",
    )
    _out_dir_options(parser, kind, fresh)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precision-lab",
        description="Paired rollout-vs-trainer forwards of diffusers DiTs, from a shell.",
        epilog=_EXIT_CODES,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pair = _command(
        commands,
        "pair",
        "one paired forward: results.json and the divergence figure (notebook 01)",
        "Pair the rollout side against the trainer side on one forward of a family's model; "
        "write OUT_DIR/results.json and OUT_DIR/divergence_by_layer.png (with --report, also "
        "OUT_DIR/report.html). Exit 1 when the pair fails part-way (the pairs compared so far "
        "are saved), when model_output_rel_max exceeds --max-rel-max, or when a module output "
        "got worse than in --baseline.",
    )
    _model_options(pair, "pair", "<family>-<preset>-<mode>")
    pair.add_argument("--mode", default="propagated", choices=MODES, help="default propagated")
    pair.add_argument(
        "--sigma", type=option_type(float), default=0.75, help="flow-matching sigma (0.75)"
    )
    pair.add_argument("--metric", default="rel_max", help="metric of the figure (rel_max)")
    pair.add_argument(
        "--max-rel-max",
        type=option_type(float),
        default=None,
        metavar="X",
        help="exit 1 when model_output_rel_max > X",
    )
    pair.add_argument(
        "--baseline",
        default=None,
        metavar="NAME_OR_PATH",
        help="exit 1 when a module output is worse than in this baseline (a name saved with "
        "--save-baseline, or a results.json)",
    )
    pair.add_argument(
        "--save-baseline",
        default=None,
        metavar="NAME",
        help="keep this run as known-good, baselines/NAME.json under the working directory (or "
        "$LAB_HOME), for later --baseline NAME (not when it fails --max-rel-max or --baseline; "
        "an existing NAME is refused)",
    )
    pair.add_argument("--report", action="store_true", help="also write OUT_DIR/report.html")
    pair.add_argument(
        "--engine",
        default=None,
        choices=("sglang",),
        help="run the rollout side in the real engine's own DiT class (sglang-diffusion, the "
        "`engine` extra: bash scripts/install_engine.sh) and pair it module by module against "
        "the trainer through the alignment of the two trees (notebook 12); CPU, propagated",
    )
    pair.add_argument(
        "--sharded",
        type=option_type(int),
        default=None,
        metavar="NPROC",
        help="run both sides under FSDP2 across NPROC ranks (gloo on cpu, one GPU each on "
        "cuda), each rank holding only its rows of the master: for a model one GPU cannot hold, "
        "e.g. --family minimax_h3 --preset full --device cuda --sharded 2 (notebook 10). Block "
        "outputs and the model output; propagated mode only",
    )

    drift = _command(
        commands,
        "drift",
        "PPO ratio drift over a Flow-GRPO rollout (notebook 02)",
        "Sample a Flow-GRPO rollout on the rollout side and recompute each step's log-prob on "
        "the trainer side; write OUT_DIR/results.json (the trajectory) and the figures "
        "ratio_drift.png, ratio_hist.png, logprob_vs_velocity_gap.png. Exit 1 when the share "
        "of ratios outside the clip range exceeds --max-clip-frac.",
    )
    _model_options(drift, "ratio_drift", "<family>-<preset>")
    drift.add_argument("--steps", type=option_type(int), default=10, help="denoising steps (10)")
    drift.add_argument(
        "--cfg-scale", type=option_type(float), default=1.0, help="guidance scale (1.0: none)"
    )
    drift.add_argument(
        "--noise-level", type=option_type(float), default=0.7, help="eta of the SDE (0.7)"
    )
    drift.add_argument("--sde-type", default="sde", choices=("sde", "cps"), help="default sde")
    drift.add_argument(
        "--sde-window",
        default="[]",
        metavar="JSON",
        help="[start, end) steps with SDE noise, e.g. '[0, 4]'; [] every step",
    )
    drift.add_argument("--samples", type=option_type(int), default=2, help="samples per prompt (2)")
    drift.add_argument("--prompts", type=option_type(int), default=1, help="prompts (1)")
    drift.add_argument(
        "--clip-range", type=option_type(float), default=1e-4, help="PPO clip range (1e-4)"
    )
    drift.add_argument(
        "--max-clip-frac",
        type=option_type(float),
        default=None,
        metavar="F",
        help="exit 1 when the share of |ratio - 1| > clip range exceeds F",
    )

    report = _command(
        commands,
        "report",
        "one self-contained HTML report from saved runs",
        "Write one HTML file (figures embedded, no network) from one or more saved runs: "
        "results.json paths, their folders, or names `precision-lab compare` lists. "
        "Ratio-drift trajectories get their own sections.",
    )
    report.add_argument("runs", nargs="+", metavar="RUN", help="saved runs to include")
    report.add_argument(
        "--out",
        default="",
        help="the HTML file (default: report.html in a fresh folder runs/report/<time>)",
    )
    report.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    report.add_argument("--title", default=None, help="page title")
    report.add_argument("--metric", default="rel_max", help="metric of the plots (rel_max)")
    report.add_argument(
        "--root",
        default=None,
        help="where run names are looked up (default: runs/ and baselines/ of the working "
        "directory, or $LAB_HOME)",
    )

    sweep = _command(
        commands,
        "sweep",
        "run a notebook with papermill over a parameter grid (notebook 05)",
        "Run NOTEBOOK once per grid point (papermill, parallel processes); write "
        "OUT/sweep.csv (one row per run) and OUT/sweep.png. Exit 1 if any run failed.",
    )
    sweep.add_argument("notebook", help="a notebook path or a name under notebooks/")
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a parameter and its values (JSON where it parses, else strings); repeatable",
    )
    sweep.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter every run gets (JSON where it parses); repeatable",
    )
    sweep.add_argument(
        "--out",
        default="",
        help="sweep folder (default: a fresh folder runs/sweep/<notebook>-<time> under the "
        "working directory, or $LAB_HOME)",
    )
    sweep.add_argument(
        "--overwrite",
        action="store_true",
        help="run into an --out that holds an earlier sweep (its points run again and are "
        "replaced); without it (or --resume) such a folder is refused",
    )
    sweep.add_argument(
        "--jobs", type=option_type(int), default=2, help="runs in parallel (default 2)"
    )
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    sweep.add_argument(
        "--resume",
        action="store_true",
        help="skip points that already finished ok in OUT with the same notebook and parameters "
        "(failed, interrupted and changed points run again)",
    )

    scen = _command(
        commands,
        "scenarios",
        "the known rollout/trainer mismatches, each found by the lab (notebook 06)",
        "Run each known-mismatch scenario (its buggy and its fixed pair of sides) and find "
        "its culprit in local mode; write OUT_DIR/scenarios.json, each run's Results and "
        "OUT_DIR/bug_vs_fixed.png. Exit 1 when a scenario's culprit is not the expected one.",
    )
    scen.add_argument("--device", default="cpu", help="cpu or cuda (cuda adds GPU-only ones)")
    scen.add_argument("--preset", default="tiny", choices=PRESETS, help="default tiny")
    scen.add_argument("--only", nargs="+", default=None, metavar="NAME", help="scenario names")
    scen.add_argument("--list", action="store_true", help="list the scenario names and exit")
    _out_dir_options(scen, "scenarios", "<preset>-<device>")

    compare = _command(
        commands,
        "compare",
        "compare saved runs: settings diff, per-layer overlay, verdict (notebook 09)",
        "Without RUN: list the saved runs (runs/ and baselines/ of the working directory, or of "
        "$LAB_HOME; --root another folder). With "
        "two or more: print what differs in their settings and how each later run compares to "
        "the first, module output by module output; with --out-dir also write overlay.png, "
        "settings_diff.csv and report.html. A RUN is a listed name, a path to a results.json "
        "or its folder, 'baseline:NAME', or a unique part of a name. Exit 1 when a later run "
        "has a module output worse than the first.",
    )
    compare.add_argument("runs", nargs="*", metavar="RUN", help="two or more saved runs")
    compare.add_argument(
        "--root",
        default=None,
        help="where runs are listed and looked up (default: runs/ and baselines/ of the working "
        "directory, or $LAB_HOME)",
    )
    compare.add_argument("--metric", default="rel_max", help="per-module metric (rel_max)")
    compare.add_argument("--out-dir", default=None, help="write the overlay, diff and report")
    compare.add_argument(
        "--overwrite", action="store_true", help="replace the files of an --out-dir that has some"
    )

    contract = _command(
        commands,
        "contract",
        "write a numerics contract of a pair, or check one (exit 1 when a clause fails)",
        "write FILE: run the family's pair and record each module group's tier (bitwise where "
        "bit-exact, else rel<=X or ulp<=K from the measured value times --margin), optionally a "
        "drift clause. check FILE: re-run it and say which clauses hold; --rollout-overrides / "
        "--trainer-overrides JSON for a what-if on one side, --dump DIR to read side A from a "
        "dump. Exit 0 when every clause holds, 1 when one fails (with the table), 2 for a "
        "malformed or newer-schema file.",
    )
    contract.add_argument("action", choices=("write", "check"), help="write or check")
    contract.add_argument("file", help="the contract (JSON)")
    contract.add_argument("--family", default="flux", help="write: the DiT family (flux)")
    contract.add_argument("--preset", default="tiny", choices=PRESETS, help="write: (tiny)")
    contract.add_argument("--seed", type=option_type(int), default=0, help="write: seed (0)")
    contract.add_argument(
        "--sigma", type=option_type(float), default=0.75, help="write: sigma (0.75)"
    )
    contract.add_argument("--tier", default="rel", choices=("rel", "ulp"), help="write: (rel)")
    contract.add_argument(
        "--margin", type=option_type(float), default=2.0, help="write: tolerance factor (2)"
    )
    contract.add_argument(
        "--drift-steps", type=option_type(int), default=None, metavar="N",
        help="write: add a drift clause over an N-step trajectory (no ratio clipped)",
    )  # fmt: skip
    contract.add_argument(
        "--clip-range", type=option_type(float), default=1e-4, help="drift: (1e-4)"
    )
    contract.add_argument("--overwrite", action="store_true", help="write: replace FILE")
    contract.add_argument("--rollout-overrides", default="{}", metavar="JSON",
                          help="check: Side field overrides of side A")  # fmt: skip
    contract.add_argument("--trainer-overrides", default="{}", metavar="JSON",
                          help="check: Side field overrides of side B")  # fmt: skip
    contract.add_argument("--dump", default=None, metavar="DIR", help="check: side A from a dump")

    mismatch = _command(
        commands,
        "bench-mismatch",
        "every family's default rollout vs trainer in one table: where, why, fix, cost, drift",
        "Per family: the model output's rel_max, the first divergence and its why, the knob "
        "with the largest Shapley share, the cheapest bit-exact prescription and its cost, the "
        "transition KL and mean |log ratio| over a short trajectory at CFG 1 and at the "
        "family's CFG, and the noise-floor verdict at --clip-range. Prints the table; --out "
        "writes the record (JSON).",
    )
    from lab.families import FAMILY_NAMES

    mismatch.add_argument("--families", nargs="+", default=list(FAMILY_NAMES), metavar="FAMILY",
                          choices=FAMILY_NAMES, help="default: every family")  # fmt: skip
    mismatch.add_argument("--preset", default="tiny", choices=PRESETS, help="default tiny")
    mismatch.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    mismatch.add_argument("--steps", type=option_type(int), default=6, help="trajectory steps (6)")
    mismatch.add_argument("--clip-range", type=option_type(float), default=1e-4, help="(1e-4)")
    mismatch.add_argument("--out", default=None, help="write the record here (JSON)")
    mismatch.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


# ---- subcommands --------------------------------------------------------------------------


def _json_option(name: str, value: str, kind: type) -> Any:
    from lab.views.parameters import json_parameter

    try:
        return json_parameter(name, value, kind)
    except ValueError as err:
        flag = f"--{name.replace('_', '-')}"
        text = str(err).replace(f"parameter {name!r}", flag).replace(f"-p {name} ", f"{flag} ")
        raise UsageError(text) from None


@contextlib.contextmanager
def _output_folder(
    args: argparse.Namespace, kind: str, where: str, **labels: str | None
) -> Iterator[Path]:
    """The run's folder (`run_folder`: --out-dir, else a fresh one), held for the run.

    A fresh folder the run wrote nothing into (refused, failed or stopped first) is removed.

    Raises:
        ValueError: --out-dir holds another run's results and --overwrite is not given.
        lab.base.processes.FolderInUseError: Another live run holds the folder.
    """
    from lab.base.processes import holding_folder
    from lab.views.home import run_folder, runs_home

    fresh = not args.out_dir
    target = runs_home() / kind if fresh else Path(args.out_dir).absolute()
    made = [p for p in (target, *target.parents) if not p.exists()]  # deepest first
    out = run_folder(kind, args.out_dir or "", overwrite=args.overwrite, **labels)
    try:
        with holding_folder(out, where):
            yield out
    finally:
        for folder in [out, *made] if fresh else made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: a run that wrote nothing leaves nothing


def _save_partial(err: Any, out_dir: Path, why: str = "the failure") -> None:
    """A failed pair's err.result (the pairs compared before the failure) to results.json."""
    partial = getattr(err, "result", None)
    if partial is not None:
        path = partial.to_json(out_dir / "results.json")
        print(f"saved the {len(partial.rows)} pair(s) compared before {why} to {path}")


def _pair(args: argparse.Namespace) -> int:
    from lab.views.baselines import free_baseline_path, load_baseline

    rollout = _json_option("rollout_overrides", args.rollout_overrides, dict)
    trainer = _json_option("trainer_overrides", args.trainer_overrides, dict)
    # Before any work: an unknown baseline, or a name to save under that is taken, is a bad
    # argument, not something to learn after the forwards.
    # `is not None`: --baseline "" or --save-baseline "" is a bad name, not "no baseline".
    baseline = load_baseline(args.baseline) if args.baseline is not None else None
    if args.save_baseline is not None:
        free_baseline_path(args.save_baseline)
    labels = {"family": args.family, "preset": args.preset, "mode": args.mode}
    with _output_folder(args, "pair", "pair --out-dir", **labels) as out:
        return _pair_into(args, out, rollout, trainer, baseline)


def _pair_into(
    args: argparse.Namespace,
    out: Path,
    rollout: dict[str, Any],
    trainer: dict[str, Any],
    baseline: Any,
) -> int:
    """`pair` once its arguments are checked and `out` is held."""
    import lab
    from lab.base.errors import PairError
    from lab.views import plots
    from lab.views.baselines import compare_to_baseline, save_baseline

    if args.engine is not None:
        result = _pair_engine(args, rollout, trainer)
    elif args.sharded is not None:
        result = _pair_sharded(args, out, rollout, trainer)
        if isinstance(result, int):
            return result
    else:
        try:
            result = lab.pair_family(
                args.family,
                args.preset,
                seed=args.seed,
                device=args.device,
                mode=args.mode,
                sigma=args.sigma,
                rollout=rollout,
                trainer=trainer,
            )
        except PairError as err:
            print(f"pair failed: {err}", file=sys.stderr)
            _save_partial(err, out)
            return EXIT_FAILED
    print(result.describe())
    figure = plots.save_figure(
        plots.plot_divergence_by_layer(result, args.metric), out / "divergence_by_layer.png"
    )
    print(f"wrote {result.to_json(out / 'results.json')} and {figure}")
    if args.report:
        from lab.views.report import write_html

        write_html(result, out / "report.html", metric=args.metric)
    code = EXIT_OK
    rel_max = result.output_metrics().get("model_output_rel_max")
    if args.max_rel_max is not None and rel_max is not None and rel_max > args.max_rel_max:
        print(f"FAILED: model_output_rel_max {rel_max:.3e} > --max-rel-max {args.max_rel_max:g}")
        code = EXIT_FAILED
    if baseline is not None:
        cmp = compare_to_baseline(result, baseline, metric=args.metric, baseline_name=args.baseline)
        print(cmp.describe())
        code = code if cmp.ok else EXIT_FAILED
    if args.save_baseline is not None:
        if code == EXIT_OK:
            path = save_baseline(result, args.save_baseline)
            print(f"saved baseline {args.save_baseline!r}: {path}")
        else:
            print(f"not saved as baseline {args.save_baseline!r}: the run failed its gate above")
    return code


def _pair_engine(args: argparse.Namespace, rollout: dict[str, Any], trainer: dict[str, Any]) -> Any:
    """`pair --engine sglang`: the engine's own DiT against the trainer (lab.engine.sglang)."""
    from lab.engine.sglang import EngineUnavailable, engine_family, pair_engine

    if rollout:
        raise UsageError(
            "--rollout-overrides with --engine: the rollout side is the engine's own DiT, run "
            "the engine's way; its settings are the engine's. Drop --rollout-overrides (or "
            "drop --engine to pair the emulated rollout with those overrides)."
        )
    if args.device != "cpu" or args.mode != "propagated" or args.sharded is not None:
        raise UsageError(
            f"--engine {args.engine} runs on the CPU in propagated mode, unsharded (got "
            f"--device {args.device} --mode {args.mode}"
            + (f" --sharded {args.sharded}" if args.sharded is not None else "")
            + "): the engine's GPU kernels (sglang-kernel) are not part of the extra."
        )
    try:
        engine_family(args.family)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        return pair_engine(
            args.family, args.preset, seed=args.seed, sigma=args.sigma, side=trainer or None
        )
    except EngineUnavailable as err:
        raise UsageError(str(err)) from None


def _pair_sharded(
    args: argparse.Namespace, out: Path, rollout: dict[str, Any], trainer: dict[str, Any]
) -> Any:
    """`pair --sharded NPROC`: both sides under FSDP2 (`lab.fsdp.pair_sharded`).

    The Result; or the exit code when a rank failed (its error printed) or the launch was
    stopped (one line), the pairs compared before either saved to results.json.
    """
    import lab
    from lab.engine.fsdp import (
        Fsdp2Interrupted,
        ShardedPairError,
        pair_sharded,
        sharded_ranks_table,
    )

    if args.mode != "propagated":
        raise ValueError(
            f"pair --sharded: --mode {args.mode} is not available sharded (each side runs in "
            "its own ranks); use --mode propagated."
        )
    fam = lab.family(args.family)
    device = args.device.split(":")[0]
    try:
        result = pair_sharded(
            args.family,
            args.preset,
            nproc=args.sharded,
            device=device,
            seed=args.seed,
            sigma=args.sigma,
            rollout=lab.Side.rollout(fam, device=device, **rollout),
            trainer=lab.Side.trainer(fam, device=device, **trainer),
        )
    except ShardedPairError as err:
        print(f"pair --sharded failed: {err}", file=sys.stderr)
        _save_partial(err, out)
        return EXIT_FAILED
    except Fsdp2Interrupted as stopped:
        # Every rank is ended; what both sides had captured before is paired and kept.
        _save_partial(stopped, out, f"{stopped.signal_name}")
        kept = "saved" if stopped.result is not None else "nothing both sides reached to save"
        print(f"pair --sharded: stopped by {stopped.signal_name}; every rank ended, {kept}.",
              file=sys.stderr)  # fmt: skip
        return stopped.exit_code
    print(sharded_ranks_table(result).to_string(index=False))
    return result


def _drift(args: argparse.Namespace) -> int:
    rollout = _json_option("rollout_overrides", args.rollout_overrides, dict)
    trainer = _json_option("trainer_overrides", args.trainer_overrides, dict)
    window = _json_option("sde_window", args.sde_window, list)
    labels = {"family": args.family, "preset": args.preset}
    with _output_folder(args, "ratio_drift", "drift --out-dir", **labels) as out:
        return _drift_into(args, out, rollout, trainer, window)


def _drift_into(
    args: argparse.Namespace,
    out: Path,
    rollout: dict[str, Any],
    trainer: dict[str, Any],
    window: list[Any],
) -> int:
    """`drift` once its arguments are checked and `out` is held."""
    from lab.base.errors import PairError
    from lab.rl.trajectory import TrajectoryInterrupted, trajectory

    try:
        traj = trajectory(
            args.family,
            args.preset,
            steps=args.steps,
            sde_window=window or None,
            noise_level=args.noise_level,
            sde_type=args.sde_type,
            cfg_scale=args.cfg_scale,
            samples=args.samples,
            prompts=args.prompts,
            seed=args.seed,
            device=args.device,
            clip_range=args.clip_range,
            rollout=rollout,
            trainer=trainer,
            progress=False,
        )
    except PairError as err:
        print(f"drift failed: {err}", file=sys.stderr)
        done = getattr(err, "trajectory", None)  # a TrajectoryError: the steps completed
        if done is not None:
            _write_drift(done, out)
            print(f"saved the {done.meta['completed_steps']} step(s) completed before the failure")
        return EXIT_FAILED
    except TrajectoryInterrupted as stopped:
        done = stopped.trajectory
        _write_drift(done, out)
        print(
            f"drift: stopped by {stopped.signal_name} in step {done.meta['interrupted']['step']} "
            f"of {args.steps}; the {done.meta['completed_steps']} step(s) before it are saved "
            f"in {out}.",
            file=sys.stderr,
        )
        return stopped.exit_code
    print(traj.describe())
    _write_drift(traj, out)
    clip_frac = traj.overall()["clip_frac"]
    if args.max_clip_frac is not None and clip_frac > args.max_clip_frac:
        print(f"FAILED: clip_frac {clip_frac:.3g} > --max-clip-frac {args.max_clip_frac:g}")
        return EXIT_FAILED
    return EXIT_OK


def _write_drift(traj: Any, out: Path) -> None:
    """A trajectory's results.json and its three figures under `out` (the paths printed)."""
    from lab.views import plots

    written = [traj.to_json(out / "results.json")]
    for name, plot in (
        ("ratio_drift.png", plots.plot_ratio_drift),
        ("ratio_hist.png", plots.plot_ratio_histogram),
        ("logprob_vs_velocity_gap.png", plots.plot_logprob_vs_velocity_gap),
    ):
        written.append(plots.save_figure(plot(traj, backend="matplotlib"), out / name))
    print("wrote " + ", ".join(str(p) for p in written))


def _report(args: argparse.Namespace) -> int:
    from lab.rl.trajectory import Trajectory
    from lab.views import runs
    from lab.views.report import write_html

    if args.out and Path(args.out).exists() and not args.overwrite:
        raise UsageError(
            f"--out {args.out!r} exists: another report. Give --overwrite to replace it, "
            "another --out, or none for a fresh folder."
        )

    saved = runs.list_runs(args.root)
    named = [runs.find_run(ref, saved, root=args.root) for ref in args.runs]
    results = {r.name: r.load() for r in named if r.kind != "trajectory"}
    trajectories = {r.name: Trajectory.from_json(r.path) for r in named if r.kind == "trajectory"}
    if not results:
        raise UsageError(
            f"report: {', '.join(args.runs)} are ratio-drift trajectories only; a report needs "
            "at least one Result (a results.json from pair or a notebook)."
        )
    out = Path(args.out) if args.out else runs.run_folder("report") / "report.html"
    write_html(results, out, title=args.title, metric=args.metric, trajectories=trajectories)
    print(f"wrote {out}")
    return EXIT_OK


def _sweep(args: argparse.Namespace) -> int:
    from lab.views.sweep import SweepInterrupted, parse_grid, parse_value, run_sweep

    grid = parse_grid(args.grid)
    params = {}
    for spec in args.param:
        key, eq, value = spec.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--param {spec!r}: expected KEY=VALUE.")
        params[key.strip()] = parse_value(value)
    if args.resume:
        if not args.out:
            raise UsageError(
                "--resume without --out: name the sweep folder to resume (--out FOLDER); a "
                "sweep without --out starts in a fresh folder, with nothing to resume."
            )
        _check_resumable(Path(args.out))
    try:
        result = run_sweep(
            args.notebook,
            grid,
            args.out,
            parameters=params,
            jobs=args.jobs,
            progress=not args.no_progress,
            resume=args.resume,
            overwrite=args.overwrite,
        )
    except SweepInterrupted as stopped:
        print(stopped.sweep.describe())
        print(stopped, file=sys.stderr)
        return stopped.exit_code
    print(result.describe())
    return EXIT_FAILED if result.failed else EXIT_OK


def _check_resumable(out: Path) -> None:
    """--resume reads the results.json of each point recorded ok: refuse a damaged one, named."""
    import json

    from lab.pairing.result import Result
    from lab.views.sweep import RUN_RECORD

    for record in sorted(out.glob(f"*/{RUN_RECORD}")):
        path = record.parent / "results.json"
        try:
            recorded = json.loads(record.read_text(encoding="utf-8"))
            # Where the run wrote it: its own out_dir (recorded), else its folder.
            where = recorded.get("results_dir")
            path = Path(where if isinstance(where, str) else record.parent) / "results.json"
            if recorded.get("status") != "ok":
                continue  # a failed point runs again; its results.json is not read
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, AttributeError) as err:
            if not path.is_file() or isinstance(err, AttributeError):
                continue  # no results (or a damaged record): the point runs again
            why = f"{str(path)!r} cannot be read: {err}"
            if isinstance(err, ValueError):
                try:
                    Result.from_json(path)  # says empty, truncated or not JSON, naming the file
                except ValueError as named:
                    why = str(named)
            raise UsageError(
                f"--resume: {why} Delete its folder {str(path.parent)!r} (that point runs "
                "again), or run without --resume."
            ) from None


def _scenarios(args: argparse.Namespace) -> int:
    from lab.engine import scenarios

    if args.list:
        for name in scenarios.names():
            s = scenarios.get(name)
            gpu = " (GPU only)" if s.needs_gpu else ""
            print(f"{name}{gpu}")
        return EXIT_OK
    labels = {"preset": args.preset, "label": args.device}
    with _output_folder(args, "scenarios", "scenarios --out-dir", **labels) as out:
        return _scenarios_into(args, out)


def _scenarios_into(args: argparse.Namespace, out: Path) -> int:
    """`scenarios` once `out` is held."""
    from lab.engine import scenarios
    from lab.views import plots

    runs = scenarios.run_all(args.preset, args.device, args.only)
    table = scenarios.scenarios_table(runs)
    print(table.to_string(index=False))
    summary = scenarios.save_runs(runs, str(out))
    figure = plots.save_figure(
        plots.plot_bug_vs_fixed(runs, backend="matplotlib"), out / "bug_vs_fixed.png"
    )
    print(f"wrote {summary} and {figure}")
    missed = [r.name for r in runs if not r.culprit_matches]
    if missed:
        print(f"FAILED: the lab did not find the expected culprit of {', '.join(missed)}")
        return EXIT_FAILED
    return EXIT_OK


def _compare(args: argparse.Namespace) -> int:
    from lab.base.atomic import atomic_write_text
    from lab.views import runs

    if not args.runs:
        saved = runs.list_runs(args.root)
        if not saved:
            where = args.root or str(runs.lab_home() / "runs")
            print(f"no saved runs under {where!r} or in {str(runs.baselines_home())!r}")
            return EXIT_OK
        table = runs.runs_table(saved)
        columns = ["name", "kind", "family", "preset", "mode", "modified", "model_output_rel_max"]
        print(table[columns].to_string(index=False))
        return EXIT_OK
    if len(args.runs) < 2:
        raise UsageError(
            f"compare: got one run ({args.runs[0]!r}); give two or more, or none to list them."
        )
    if args.out_dir:
        from lab.views.home import check_folder_free

        check_folder_free(args.out_dir, overwrite=args.overwrite)  # before any work
    cmp = runs.compare_runs(args.runs, root=args.root, metric=args.metric)
    print(cmp.describe())
    diff = cmp.settings_diff()
    if len(diff):
        print("\nsettings that differ:")
        print(diff.to_string())
    worse = cmp.worse  # raises for runs of different models
    if args.out_dir:
        from lab.views import plots
        from lab.views.report import write_html

        out = runs.run_folder("compare", args.out_dir, overwrite=args.overwrite)
        figure = plots.save_figure(
            cmp.plot_overlay(args.metric, backend="matplotlib"), out / "overlay.png"
        )
        atomic_write_text(out / "settings_diff.csv", diff.to_csv())
        print(f"wrote {figure} and {out / 'settings_diff.csv'}")
        write_html(cmp.runs, out / "report.html", metric=args.metric)
    if worse:
        print(f"WORSE than {next(iter(cmp.runs))!r}: {', '.join(worse)}")
        return EXIT_FAILED
    return EXIT_OK


def _contract(args: argparse.Namespace) -> int:
    from lab.views import contract

    if args.action == "write":
        drift = None
        if args.drift_steps is not None:
            drift = {"steps": args.drift_steps, "clip_range": args.clip_range}
        doc = contract.write(
            args.file, args.family, args.preset, seed=args.seed, sigma=args.sigma,
            tier=args.tier, margin=args.margin, drift=drift, overwrite=args.overwrite,
        )  # fmt: skip
        tiers = [c["tier"] for c in doc["clauses"]]
        bitwise = sum(t == "bitwise" for t in tiers)
        print(
            f"wrote {args.file}: {len(tiers)} clauses ({bitwise} bitwise)"
            + (", a drift clause" if doc["drift"] else "")
        )
        return EXIT_OK
    rollout = _json_option("rollout_overrides", args.rollout_overrides, dict)
    trainer = _json_option("trainer_overrides", args.trainer_overrides, dict)
    found = contract.check(
        args.file, rollout_overrides=rollout, trainer_overrides=trainer, dump=args.dump
    )
    print(found.describe())
    if not found.holds:
        print(found.table().to_string(index=False))
        return EXIT_FAILED
    return EXIT_OK


def _bench_mismatch(args: argparse.Namespace) -> int:
    from lab.base.devices import resolve_device
    from lab.causes import mismatch

    resolve_device(args.device)
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise UsageError(
            f"--out {args.out!r} exists: an earlier record. Give --overwrite to replace it, or "
            "another --out."
        )
    rows = mismatch.mismatch_table(
        args.families, args.preset, device=args.device, steps=args.steps,
        clip_range=args.clip_range,
    )  # fmt: skip
    print(mismatch.markdown(rows))
    if args.out:
        print(f"wrote {mismatch.write(rows, args.out)}")
    return EXIT_OK


_COMMANDS = {
    "bench-mismatch": _bench_mismatch,
    "contract": _contract,
    "pair": _pair,
    "drift": _drift,
    "report": _report,
    "sweep": _sweep,
    "scenarios": _scenarios,
    "compare": _compare,
}


def _metrics() -> list[str]:
    """The per-module metrics a figure or comparison can use: PairMetrics' numeric fields."""
    from lab.pairing.metrics import PairMetrics

    return [f.name for f in dataclasses.fields(PairMetrics) if f.type in ("float", "int")]


def _writable(flag: str, folder: str) -> None:
    """Refuse an output folder that cannot be made or written, before any work (makes nothing)."""
    from lab.base.atomic import folder_write_problem

    if Path(folder).is_file():
        raise UsageError(f"{flag} {folder!r} is a file, not a folder; choose a folder.")
    problem = folder_write_problem(folder, keep=False)
    if problem:
        raise UsageError(
            f"{flag} {folder!r} cannot be written ({problem}); choose a folder you can write."
        )


def _check_arguments(args: argparse.Namespace) -> None:
    """Values argparse's types let through that would fail, or mean nothing, after the work."""
    metric = getattr(args, "metric", None)
    if metric is not None and metric not in (known := _metrics()):
        close = difflib.get_close_matches(metric, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"--metric {metric!r} is not a per-module metric.{hint} Known: {known}.")
    for flag, attr in (("--out-dir", "out_dir"), ("--out", "out")):
        value = getattr(args, attr, None)
        if not value:
            continue
        if attr == "out" and args.command in ("report", "bench-mismatch"):  # a file
            from lab.base.atomic import check_file_path

            try:
                check_file_path(value, flag)
            except ValueError as err:
                raise UsageError(str(err)) from None
        else:
            _writable(flag, value)
    ranges = (
        ("--max-rel-max", "max_rel_max", lambda v: v >= 0, "a number >= 0"),
        ("--max-clip-frac", "max_clip_frac", lambda v: 0 <= v <= 1, "a share in [0, 1]"),
        ("--clip-range", "clip_range", lambda v: v > 0, "a number > 0 (Flow-GRPO's is 1e-4)"),
        ("--sharded", "sharded", lambda v: v >= 1, "a rank count >= 1 (2 for two GPUs)"),
        ("--jobs", "jobs", lambda v: v >= 1, "a run count >= 1"),
    )
    for flag, attr, ok, words in ranges:
        value = getattr(args, attr, None)
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise UsageError(f"{flag} must be {words}, got {value!r}.")


def _stopped(command: str, stopped: KeyboardInterrupt) -> int:
    """One line, no traceback, for a Ctrl-C or SIGTERM nothing saved anything of; 130 or 143.

    The commands that keep what finished (drift, sweep, pair --sharded) say so themselves.
    """
    from lab.base.processes import exit_code, signal_name

    print(f"{command}: stopped by {signal_name(stopped)}; nothing was saved.", file=sys.stderr)
    return exit_code(stopped)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 a failure found, 2 bad arguments)."""
    args = _parser().parse_args(argv)
    from lab.base.errors import PairError
    from lab.base.processes import sigterm_raises

    try:
        _check_arguments(args)
        # SIGTERM unwinds as Ctrl-C does (`Terminated`): the same `finally` blocks end the
        # children and remove the temporaries, and what finished is saved.
        with sigterm_raises():
            return _COMMANDS[args.command](args)
    except KeyboardInterrupt as stopped:
        return _stopped(args.command, stopped)
    except PairError as err:  # NaN/Inf or all-zero outputs too: a finding, not an argument
        print(f"failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, FileNotFoundError) as err:
        # The lab's own refusals (unknown family, bad dtype, a rule matching nothing, an unknown
        # saved run, ...) name the bad value and the fix: they are bad arguments.
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

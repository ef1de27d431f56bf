"""Command line: `python -m lab sweep NOTEBOOK --grid key=v1,v2 ... --out DIR --jobs N`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser(
        "sweep",
        help="run a notebook with papermill over a parameter grid",
        description="Run NOTEBOOK once per grid point (papermill, parallel processes); write "
        "OUT/sweep.csv (one row per run) and OUT/sweep.png. Exits 1 if any run failed.",
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
    sweep.add_argument("--out", default="runs/sweep", help="sweep folder (default runs/sweep)")
    sweep.add_argument("--jobs", type=int, default=2, help="runs in parallel (default 2)")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _sweep(args: argparse.Namespace) -> int:
    from lab.sweep import parse_grid, parse_value, run_sweep

    try:
        grid = parse_grid(args.grid)
        params = {}
        for spec in args.param:
            key, eq, value = spec.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"--param {spec!r}: expected KEY=VALUE.")
            params[key.strip()] = parse_value(value)
        result = run_sweep(
            args.notebook,
            grid,
            args.out,
            parameters=params,
            jobs=args.jobs,
            progress=not args.no_progress,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.describe())
    return 1 if result.failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (non-zero if any sweep run failed)."""
    args = _parser().parse_args(argv)
    if args.command == "sweep":
        return _sweep(args)
    return 2  # argparse already refused anything else


if __name__ == "__main__":
    sys.exit(main())

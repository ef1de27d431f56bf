"""`python -m lab ...`: the `precision-lab` command line (lab/views/cli.py)."""

from lab.views.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

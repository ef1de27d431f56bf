#!/usr/bin/env bash
# The test command (README, CI): lint, then pytest (gpu/slow/browser/engine deselected by
# default: a few minutes on two cores). The slow CPU set, as .ci/run runs it:
#   bash scripts/test.sh -m "slow and not gpu and not browser and not engine"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check lab tests scripts bench
.venv/bin/ruff format --check lab tests scripts bench
.venv/bin/python -m pytest "$@"

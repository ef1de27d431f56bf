#!/usr/bin/env bash
# The test command (README, CI): lint, then pytest (gpu/slow/browser deselected by default).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check lab tests scripts bench
.venv/bin/ruff format --check lab tests scripts bench
.venv/bin/python -m pytest "$@"

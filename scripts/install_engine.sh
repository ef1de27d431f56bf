#!/usr/bin/env bash
# The `engine` extra: sglang-diffusion's DiTs next to the lab's own pins (torch 2.11.0, diffusers
# 0.42.1). Installs the extra's packages, then sglang==0.5.23 with --no-deps (its metadata pins
# torch 2.14.1 and CUDA kernels the CPU path does not use), then checks torch did not move.
# Idempotent: a second run with nothing changed installs nothing. Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
SGLANG=0.5.23
stamp=.venv/.engine-$(sha1sum pyproject.toml | cut -c1-12)-$SGLANG
if [ ! -f "$stamp" ]; then
  pins=$(mktemp)
  trap 'rm -f "$pins"' EXIT
  printf 'torch==2.11.0\ndiffusers==0.42.1\n' > "$pins"
  .venv/bin/python -m pip install -q -c "$pins" -e '.[dev,engine]'
  .venv/bin/python -m pip install -q --no-deps "sglang==$SGLANG"
  rm -f .venv/.engine-*
  touch "$stamp"
fi
.venv/bin/python - <<'PY'
import importlib.metadata as md
want = {"torch": "2.11.0", "diffusers": "0.42.1", "sglang": "0.5.23"}
got = {k: md.version(k) for k in want}
bad = {k: v for k, v in got.items() if not v.startswith(want[k])}
if bad:
    raise SystemExit(f"install_engine.sh: versions moved: {bad}; expected {want}")
print("engine extra:", ", ".join(f"{k} {v}" for k, v in got.items()))
PY

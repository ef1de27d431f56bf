#!/usr/bin/env bash
# The main job: the quickstart notebook through papermill on the tiny preset.
# Writes runs/quickstart/{01_quickstart.ipynb,results.json,divergence_by_layer.png}.
# Extra arguments go to papermill (run through lab.views.notebooks: the kernel transport is
# encrypted, so no TCP warning), e.g.: bash scripts/quickstart.sh -p family wan2_2
# OUT_DIR=runs/wan_local bash scripts/quickstart.sh ... writes there instead (keep runs apart).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
out=${OUT_DIR:-runs/quickstart}
mkdir -p "$out"
.venv/bin/python -m lab.views.notebooks notebooks/01_quickstart.ipynb "$out/01_quickstart.ipynb" \
  -p preset tiny -p out_dir "$out" "$@"
.venv/bin/python - "$out/results.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
first = s["first_divergent_module"] or "none (bit-exact)"
print(f"{s['family']} [{s['preset']}], {s['mode']}: {s['pairs']} paired outputs, first "
      f"divergence {first}, model_output_rel_max={s.get('model_output_rel_max'):.3e}")
PY
echo "wrote $out/results.json, $out/divergence_by_layer.png and the executed $out/01_quickstart.ipynb"

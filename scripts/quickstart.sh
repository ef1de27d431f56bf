#!/usr/bin/env bash
# The main job: the quickstart notebook through papermill on the tiny preset.
# Writes results.json, divergence_by_layer.png and the executed 01_quickstart.ipynb into a fresh
# folder, runs/quickstart/<family>-<preset>-<mode>-<time>/ (under $LAB_HOME when it is set), and
# prints it: a second run never writes over the first.
# Extra arguments go to papermill (run through lab.views.notebooks: the kernel transport is
# encrypted, so no TCP warning), e.g.: bash scripts/quickstart.sh -p family wan2_2
# OUT_DIR=runs/wan_local bash scripts/quickstart.sh ... writes there instead; a folder that
# already holds results is refused unless `-p overwrite true` is given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# The folder: OUT_DIR, else -p out_dir (refused while it holds results, unless -p overwrite
# true), else a fresh one named for the -p family/preset/mode.
out=$(.venv/bin/python - "$@" <<'PY'
import ast, os, sys
import papermill as pm
from lab.views.home import check_folder_free, run_folder
args, given = sys.argv[1:], {}
for i, flag in enumerate(args[:-2]):
    if flag in ("-p", "--parameters"):
        given[args[i + 1]] = args[i + 2]
info = pm.inspect_notebook("notebooks/01_quickstart.ipynb")
def value(name, default=None):
    return given.get(name, default or ast.literal_eval(info[name]["default"]))
out = os.environ.get("OUT_DIR") or given.get("out_dir")
try:  # before papermill writes the executed notebook there
    if out:
        check_folder_free(out, overwrite=str(given.get("overwrite")).lower() == "true")
except ValueError as err:
    sys.exit(f"error: {err}")
if not out:
    labels = {"family": value("family"), "preset": value("preset", "tiny"), "mode": value("mode")}
    made = run_folder("quickstart", **labels)
    out = os.path.relpath(made) if made.is_relative_to(os.getcwd()) else str(made)
print(out)
PY
)
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

#!/usr/bin/env bash
# The docs site: install the `docs` extra into .venv (once per pyproject.toml change), check that
# the generated tables, figures and reference pages are current (scripts/make_docs.py --check),
# then build the site with warnings as errors (mkdocs build --strict) into site/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
stamp=.venv/.docs-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  pins=$(mktemp)
  trap 'rm -f "$pins"' EXIT
  printf 'torch==2.11.0\ndiffusers==0.42.1\n' > "$pins"
  .venv/bin/python -m pip install -q -c "$pins" -e '.[dev,docs]'
  rm -f .venv/.docs-*
  touch "$stamp"
fi
.venv/bin/python scripts/make_docs.py --check
.venv/bin/mkdocs build --strict --quiet --site-dir site "$@"
echo "docs: site/ built (mkdocs --strict)"

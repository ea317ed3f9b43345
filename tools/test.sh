#!/usr/bin/env bash
# The test job: the notebooks are the source of truth, then every notebook runs as a test, then pytest.
# Run from the repository root with the project's environment on PATH (README.md, second command).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== export the notebooks and compare with the committed library"
nbdev-export
if [ -n "$(git status --porcelain -- jetrl)" ]; then
  echo "FAIL: jetrl/ differs from what nbs/ exports; run nbdev-export and commit:"; git status --short -- jetrl; exit 1
fi

echo "== notebooks carry no outputs, README.md is generated from nbs/index.ipynb"
nbdev-clean
if [ -n "$(git status --porcelain -- nbs)" ]; then
  echo "FAIL: nbdev-clean changed notebooks (outputs or metadata committed); run nbdev-clean and commit:"
  git status --short -- nbs; exit 1
fi
python tools/make_readme.py --check
python tools/results_rows.py --check      # every results row is of a commit the project cites

echo "== notebooks as tests (cells flagged cuda or slow are skipped)"
nbdev-test --n-workers 2

echo "== pytest"
python -m pytest -q

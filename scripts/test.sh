#!/usr/bin/env bash
# The test command: set up (or reuse) the venv, lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
VENV="${CKPT_VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest -q "$@"

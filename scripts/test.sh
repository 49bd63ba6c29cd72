#!/usr/bin/env bash
# The test command: set up (or reuse) the venv, lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
bash scripts/services.sh  # PostgreSQL for the metadata tests, installed only where missing
VENV="${CKPT_VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest -q "$@"

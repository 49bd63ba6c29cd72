#!/usr/bin/env bash
# The main job: train a small model, commit checkpoints, branch, check out, print log and stats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
VENV="${CKPT_VENV:-.venv}"
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" examples/demo.py "$@"

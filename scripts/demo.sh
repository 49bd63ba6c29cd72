#!/usr/bin/env bash
# The main job: train a small model, commit checkpoints, branch, check out, print log and stats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
VENV="$(CDPATH='' cd -P -- "${CKPT_VENV:-.venv}" >/dev/null && pwd)"  # absolute: a CKPT_VENV of /path made $PWD//path
PATH="$VENV/bin:$PATH" "$VENV/bin/python" examples/demo.py "$@"

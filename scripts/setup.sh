#!/usr/bin/env bash
# Create or reuse the project venv and install what is missing. A usable torch is never reinstalled.
# Usage: source-free; call as `bash scripts/setup.sh [EXTRAS]` (EXTRAS default: dev).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CKPT_VENV:-.venv}"
EXTRAS="${1:-dev}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
stamp="$VENV/.ckptstore-installed"
want="$(cat pyproject.toml setup.py ckptstore/codecs/_*.[ch] ckptstore/formats/_*.c | sha256sum | cut -c1-16)-$EXTRAS"  # sources of the build
# Installed by this script from these sources (torch was importable then): done, without importing
# torch again to prove it (that import alone took 12 s of the demo's set-up on a busy machine).
# The C extensions are checked too: they are built into the checkout, which may be a new clone.
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$VPY" -c \
    "import importlib.util, ckptstore, ckptstore.codecs._huffman, ckptstore.codecs._lossy, ckptstore.codecs._planes
import ckptstore.formats._pickscan, ckptstore.formats._sigbus
assert importlib.util.find_spec('torch')" >/dev/null 2>&1; then
  exit 0
fi
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  # The pinned CPU build installs from local disk on our machines; elsewhere it comes from PyPI.
  "$VPY" -m pip install -q "${CKPT_TORCH_SPEC:-torch==2.13.0}" || "$VPY" -m pip install -q torch
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VPY" -c "import ckptstore, ckptstore.codecs._huffman" >/dev/null 2>&1; then
  "$VPY" -m pip install -q -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored: it is neither" || true
  "$VPY" -c "import ckptstore" # fail loudly if the install did not work
  echo "$want" > "$stamp"
fi

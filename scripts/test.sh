#!/usr/bin/env bash
# The test command: set up (or reuse) the venv, lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
bash scripts/services.sh  # PostgreSQL for the metadata tests, installed only where missing
# The hundreds of processes the tests start load the package's bytecode instead of compiling it each time:
# where PYTHONDONTWRITEBYTECODE is set (as on our machines) a fresh clone would never get any (0.1 s a process).
VENV="${CKPT_VENV:-.venv}"
"$VENV/bin/python" -m compileall -q -j 0 ckptstore migrations bench tests >/dev/null
"$VENV/bin/ruff" check .
# One worker per core (CKPT_TEST_WORKERS to change it, 0 for one process): many tests wait on servers and
# child processes, so two workers on two cores took the suite from 648 s to 435 s. Work stealing: a worker whose
# tests are done takes the other's last ones (the run ends when both are done).
"$VENV/bin/python" -m pytest -q -n "${CKPT_TEST_WORKERS:-auto}" --dist worksteal "$@"

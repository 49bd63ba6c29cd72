#!/usr/bin/env bash
# Fetch, into .whl/, the wheels bench/gpu_check.sh needs on a GPU machine that has python3 3.12 with
# torch, numpy, click and pytest but no package index (the lent H200s): ckptstore's other dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for spec in zstandard==0.25.0 blake3==1.0.11 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 \
            constriction==0.5.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$spec" || python3 -m pip download -q --no-deps -d .whl "$spec"
done
ls .whl

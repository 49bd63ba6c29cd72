#!/usr/bin/env bash
# The GPU checks, in under 5 minutes on one H200: the CUDA tests (GPU checkout bit-identical to the
# CPU one), then checkout throughput straight to the GPU next to torch.load + .cuda() and
# safetensors (bench/checkout_speed.py, on the from-scratch run, trained here first if not cached).
# Results go to $OUT (or bench/gpu-results/): device.txt, gpu_tests.txt, checkout_speed.md.
#
# Needs python3 with a CUDA build of torch plus ckptstore's dependencies. On a machine that cannot
# reach a package index, fetch wheels first where it can: `bash scripts/gpu_wheels.sh` fills .whl/,
# which this script installs from when present.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ckpt-site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/ckpt-site"
fi
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "native byte-plane loops not built: numpy fallback"
python3 - <<'PY' | tee "$out/device.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(torch.cuda.get_device_name(), "torch", torch.__version__)
PY
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_replay_torch.py 2>&1 | tee "$out/gpu_tests.txt"
timeout 160 python3 -m bench.checkout_speed scratch-fp32 --repeats 5 --fresh 2 --out "$out/checkout_speed.md"

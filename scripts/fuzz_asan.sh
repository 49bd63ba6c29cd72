#!/usr/bin/env bash
# The decoder fuzzers against the C extensions built with AddressSanitizer and UBSan.
#
# Builds _planes, _lossy, _huffman and formats/_pickscan with -fsanitize=address,undefined into a
# scratch copy of the package (the work tree's own build is untouched), checks that the built modules link the
# sanitizers, then runs the fuzzers with libasan preloaded (Python itself is not instrumented;
# its allocations are left to ASan's interposed malloc, and leak checking is off since the
# interpreter does not free everything at exit). Any out-of-bounds access or undefined behaviour
# aborts the run with the report.
#
#   scripts/fuzz_asan.sh                                 # default (bounded) fuzz run
#   CKPT_FUZZ_EXAMPLES=100000 scripts/fuzz_asan.sh -k bytegroup   # long, one decoder
# PYTHON picks the interpreter (default: python); further arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-asan.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT

cp -r "$ROOT/ckptstore" "$ROOT/tests" "$ROOT/setup.py" "$ROOT/pyproject.toml" "$SCRATCH/"
find "$SCRATCH/ckptstore" -name '*.so' -delete
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
(cd "$SCRATCH" && CFLAGS="$SAN" LDFLAGS="$SAN" "$PY" setup.py -q build_ext --inplace >/dev/null)
for name in codecs/_planes codecs/_lossy codecs/_huffman formats/_pickscan; do
    so=$(ls "$SCRATCH"/ckptstore/"$name".*.so 2>/dev/null || true)
    if [ -z "$so" ] || ! ldd "$so" | grep -q libasan; then
        echo "fuzz_asan: $name was not built with AddressSanitizer" >&2
        exit 1
    fi
done

LIBS="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
cd "$SCRATCH"
# The fuzzers must exercise the instrumented modules, not a fallback.
env LD_PRELOAD="$LIBS" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 PYTHONPATH="$SCRATCH" "$PY" -c '
from ckptstore.codecs import entropy, huffman, planes
assert huffman.native and entropy.native and planes.native, "a native module failed to load"
print("native modules:", huffman.native.__file__, entropy.native.__file__, planes.native.__file__, sep="\n  ")'
exec env LD_PRELOAD="$LIBS" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:handle_segv=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    CKPT_FUZZ_HANG_S="${CKPT_FUZZ_HANG_S:-30}" PYTHONPATH="$SCRATCH" \
    "$PY" -m pytest -q -p no:cacheprovider tests/fuzz/test_decoders.py tests/codecs tests/formats/test_pickscan.py "$@"

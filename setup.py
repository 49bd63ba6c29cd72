"""Build hook for the native modules; everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and the codecs use their numpy
fallback (slower checkout; `python -c "import ckptstore.codecs.planes as p; print(p.native)"`).
"""

from setuptools import Extension, setup

HEADERS = [f"ckptstore/codecs/{name}.h" for name in ("_interleave", "_simd", "_zstd")]

setup(ext_modules=[Extension(f"ckptstore.codecs.{name}", [f"ckptstore/codecs/{name}.c"], depends=HEADERS,
                             extra_compile_args=["-O3"], optional=True) for name in ("_planes", "_lossy", "_huffman")]
           + [Extension(f"ckptstore.formats.{name}", [f"ckptstore/formats/{name}.c"], extra_compile_args=["-O3"],
                        optional=True) for name in ("_pickscan", "_sigbus")])

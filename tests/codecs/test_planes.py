"""The native byte-plane loops against the numpy ones, bit for bit, and their argument checks."""

import numpy as np
import pytest

from ckptstore.codecs import planes


def test_native_loops_are_built():
    # The README install compiles them; without them checkout falls back to numpy, about 3x slower.
    assert planes.native is not None, "ckptstore.codecs._planes was not built (no C compiler at install?)"


@pytest.mark.parametrize("width", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rows", [0, 1, 7, 100_003])
def test_group_and_interleave_match_numpy_and_invert_each_other(width, rows):
    data = np.random.default_rng(width * rows).integers(0, 256, width * rows, dtype=np.uint8)
    grouped = planes.group(data, width)
    reference = planes.group(data, width, use_native=False)
    assert grouped.shape == (width, rows) and grouped.tobytes() == reference.tobytes()
    assert grouped.tobytes() == data.reshape(-1, width).T.tobytes()
    out, out_numpy = np.empty_like(data), np.empty_like(data)
    planes.interleave(list(grouped), out)
    planes.interleave(list(grouped), out_numpy, use_native=False)
    assert out.tobytes() == data.tobytes() == out_numpy.tobytes()


def test_native_loops_read_payload_views_in_place():
    data = np.arange(4000, dtype=np.uint32).view(np.uint8)
    grouped = planes.group(data, 4).tobytes()
    views = [memoryview(grouped)[j * 4000 : (j + 1) * 4000] for j in range(4)]  # read-only, like a mapped payload
    out = np.empty(4000 * 4, dtype=np.uint8)
    planes.interleave(views, out)
    assert out.tobytes() == data.tobytes()


@pytest.mark.skipif(planes.native is None, reason="argument checks of the native loops")
def test_native_loops_refuse_mismatched_sizes():
    a, b = np.zeros(10, np.uint8), np.zeros(11, np.uint8)
    with pytest.raises(ValueError, match="differ in length"):
        planes.native.interleave([a, b], np.empty(21, np.uint8))
    with pytest.raises(ValueError, match="output size"):
        planes.native.interleave([a, a], np.empty(21, np.uint8))
    with pytest.raises(ValueError, match="between 1 and 255"):
        planes.native.interleave([], np.empty(0, np.uint8))
    with pytest.raises(BufferError):
        planes.native.interleave([a, a], bytes(20))  # read-only output
    with pytest.raises(ValueError, match="width must divide"):
        planes.native.deinterleave(bytes(10), 4, np.empty(10, np.uint8))

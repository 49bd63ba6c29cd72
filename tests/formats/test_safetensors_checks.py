"""safetensors headers that lie about their data are refused with the reason, never read wrongly."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ckptstore import formats
from ckptstore.errors import CheckpointFormatError, UnsupportedStateError
from ckptstore.formats import safetensors_file
from ckptstore.state import RawTensor


def write_raw(path, header: dict | bytes, data: bytes) -> None:
    """A safetensors file with exactly this header and data, whatever they claim."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def entry(begin, end, shape, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header, data, reason", [
    ({"a": entry(8, 0, [2])}, bytes(8), "reversed data_offsets"),
    ({"a": entry(0, 8, [2]), "b": entry(4, 12, [2])}, bytes(12), "'a' and 'b' overlap"),
    ({"a": entry(0, 16, [2])}, bytes(16), r"needs 8 bytes, its data_offsets give 16"),
    ({"a": entry(0, 8, [3])}, bytes(8), r"needs 12 bytes"),
    ({"a": entry(0, 8, [123456789])}, bytes(8), r"needs 493827156 bytes"),  # not 4.93827e\+08
    ({"a": entry(0, 4, [])}, bytes(4), None),  # a scalar: fine
    ({"a": entry(0, 800, [200])}, bytes(8), "ends at byte 800 of the data, which has 8: truncated"),
    ({"a": entry(0, 8, [-2])}, bytes(8), "malformed header entry"),
    ({"a": entry(0, 8, [2.0])}, bytes(8), "malformed header entry"),
    ({"a": entry(0.0, 8, [2])}, bytes(8), "malformed header entry"),
    ({"a": entry(False, 8, [2])}, bytes(8), "malformed header entry"),
    ({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "malformed header entry"),
    ({"a": [1, 2]}, bytes(8), "malformed header entry"),
    ({"a": entry(0, 2**62, [2**30, 2**30])}, bytes(8), "truncated"),
    ({"a": entry(0, 2**70, [2**60, 2**10])}, bytes(8), "malformed header entry"),  # past 64 bits
    ({"a": entry(0, 0, [0, 2**70])}, b"", "malformed header entry"),  # no 64-bit reader could load it
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], '
     b'"data_offsets": [0, 8]}}', bytes(8), "more than once"),
    (b'{"a": ' + b"[" * 100000, b"", "not valid JSON"),
    (b"[1, 2]", b"", "is not a checkpoint"),
    ({"a": entry(0, 2, [3], "F4")}, bytes(2), "needs 1.5 bytes"),
    ({"a": entry(0, 4, [4], "F4")}, bytes(4), "needs 2 bytes"),
    ({"a": entry(0, 3, [2, 3], "F4")}, bytes(3), None),  # six values in three bytes: valid, kept as bytes
])
def test_lying_headers_are_refused_with_their_reason(tmp_path, header, data, reason):
    write_raw(tmp_path / "m.safetensors", header, data)
    if reason is None:
        assert formats.read_checkpoint(tmp_path / "m.safetensors").tensors
        return
    with pytest.raises(CheckpointFormatError, match=reason):
        formats.read_checkpoint(tmp_path / "m.safetensors")


def test_a_header_length_past_the_limit_is_refused_without_reading(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointFormatError, match="more than the 100 MiB"):
        safetensors_file.read(tmp_path / "m.safetensors", "")


def test_gaps_and_unknown_dtypes_still_round_trip_byte_for_byte(tmp_path):
    header = {"__metadata__": {"k": "v"}, "a": entry(4, 12, [2]), "q": entry(12, 15, [3, 2], "I4")}
    write_raw(tmp_path / "m.safetensors", header, b"gap!" + bytes(range(8)) + b"xyz" + b"tail")
    checkpoint = formats.read_checkpoint(tmp_path / "m.safetensors")
    by_path = {p: t for p, t in checkpoint.tensors.items()}
    formats.write_file(checkpoint.files[0], tmp_path / "back.safetensors", None, lambda p: by_path[p])
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
    save_file({"w": torch.randn(3, 4), "b": torch.zeros(0)}, tmp_path / "real.safetensors")
    assert formats.read_checkpoint(tmp_path / "real.safetensors").tensors["w"].shape == (3, 4)


def test_a_header_that_is_not_an_object_is_refused_by_the_reader(tmp_path):
    write_raw(tmp_path / "m.safetensors", b"[1, 2]", b"")
    with pytest.raises(CheckpointFormatError, match="not a JSON object"):
        safetensors_file.read(tmp_path / "m.safetensors", "")


def test_tensors_named_like_the_header_or_a_gap_keep_the_file_byte_for_byte(tmp_path):
    header = {"%header": entry(4, 12, [2]), "%gap0": entry(12, 20, [2]), "%25header": entry(20, 28, [2])}
    write_raw(tmp_path / "m.safetensors", header, b"gap!" + bytes(range(24)))
    checkpoint = formats.read_checkpoint(tmp_path / "m.safetensors")
    assert len(checkpoint.tensors) == 5  # the header, the gap and three tensors, none taking another's place
    formats.write_file(checkpoint.files[0], tmp_path / "back.safetensors", None, lambda p: checkpoint.tensors[p])
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()


def test_an_export_refuses_a_tensor_named_like_the_formats_metadata(tmp_path):
    with pytest.raises(UnsupportedStateError, match="__metadata__"):
        safetensors_file.write_tensors(tmp_path / "out.safetensors",
                                       {"__metadata__": RawTensor("torch.float32", (1,), np.zeros(4, np.uint8))})
    assert not (tmp_path / "out.safetensors").exists()
    # a lone surrogate json writes as \\ud800, which the safetensors library refuses for the whole file (auditor)
    with pytest.raises(UnsupportedStateError, match=r"w\\ud800: the name is no valid text"):
        safetensors_file.write_tensors(tmp_path / "out.safetensors",
                                       {"w\ud800": RawTensor("torch.float32", (1,), np.zeros(4, np.uint8))})
    assert not (tmp_path / "out.safetensors").exists()


def test_float4_tensors_load_as_safetensors_loads_them_and_export_back(tmp_path):
    """safetensors counts F4's 4-bit values, torch packs two per element: they came back as raw bytes, and
    export left them out (auditor)."""
    from safetensors.torch import load_file

    from ckptstore import Repository
    from ckptstore.repo import export

    packed = torch.tensor([[0x12, 0x34], [0x56, 0x78]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    save_file({"w": packed, "b": torch.ones(3)}, tmp_path / "m.safetensors")
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(tmp_path / "m.safetensors")
        state = repo.checkout(cid)
        assert state["w"].dtype == torch.float4_e2m1fn_x2 and state["w"].shape == (2, 2)
        assert torch.equal(state["w"].view(torch.uint8), packed.view(torch.uint8))
        export(repo, cid, "safetensors", tmp_path / "out.safetensors")
    back = load_file(tmp_path / "out.safetensors")
    assert back["w"].shape == (2, 2) and torch.equal(back["w"].view(torch.uint8), packed.view(torch.uint8))
    write_raw(tmp_path / "odd.safetensors", {"a": entry(0, 3, [2, 3], "F4")}, b"\x12\x34\x56")  # no torch shape
    assert formats.read_checkpoint(tmp_path / "odd.safetensors").tensors["a"].dtype == "bytes"
    with Repository.open(tmp_path) as repo:
        cid = repo.commit(tmp_path / "odd.safetensors")
        repo.checkout_to(cid, tmp_path / "odd-back.safetensors")
    assert (tmp_path / "odd-back.safetensors").read_bytes() == (tmp_path / "odd.safetensors").read_bytes()


SAFETENSORS_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                      torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
                      torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                      torch.float8_e8m0fnu, torch.complex64, torch.float4_e2m1fn_x2]


def test_every_dtype_safetensors_writes_loads_and_exports_with_its_dtype_and_bits(tmp_path):
    """A wrong row of the dtype table (I16 read as uint16, F8_E4M3 and F8_E5M2 swapped) gave other values with no
    error: every torch dtype safetensors writes, through commit, load and export (mutation audit)."""
    from safetensors.torch import load_file

    import ckptstore
    from ckptstore import Repository
    from ckptstore.repo import export

    written = set()
    for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
        try:
            save_file({"t": torch.zeros(16, dtype=torch.uint8).view(dtype)}, tmp_path / "probe.safetensors")
        except (KeyError, RuntimeError, ValueError, TypeError):
            continue
        written.add(dtype)
    assert written == set(SAFETENSORS_DTYPES)  # this list is every one safetensors writes
    generator = torch.Generator().manual_seed(0)
    state = {}
    for dtype in SAFETENSORS_DTYPES:
        raw = torch.randint(0, 256, (3, 4 * dtype.itemsize), dtype=torch.uint8, generator=generator)
        state[str(dtype)] = (raw & 1 if dtype == torch.bool else raw).view(dtype)
    save_file(state, tmp_path / "m.safetensors")
    bits = lambda t: t.contiguous().view(torch.uint8)
    with Repository.init(tmp_path / "repo") as repo:
        cid = repo.commit(tmp_path / "m.safetensors")
        loaded = ckptstore.load(cid, repo=repo)
        export(repo, cid, "safetensors", tmp_path / "out.safetensors")
    for back in (loaded, load_file(tmp_path / "out.safetensors")):
        assert sorted(back) == sorted(state)
        for name, tensor in state.items():
            assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
            assert torch.equal(bits(back[name]), bits(tensor)), name


def test_a_header_padded_with_leading_whitespace_is_read_as_the_safetensors_library_reads_it(tmp_path):
    """It was "not a checkpoint" here while safetensors.torch.load_file reads it (stop 61's Left list)."""
    from safetensors.torch import load_file

    from ckptstore.repo.watch import file_incomplete

    header = b' \n\t{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    write_raw(tmp_path / "m.safetensors", header, np.array([1.5, -2.0], np.float32).tobytes())
    assert load_file(tmp_path / "m.safetensors")["a"].tolist() == [1.5, -2.0]
    checkpoint = formats.read_checkpoint(tmp_path / "m.safetensors")
    assert np.asarray(checkpoint.tensors["a"].data).tobytes() == np.array([1.5, -2.0], np.float32).tobytes()
    formats.write_file(checkpoint.files[0], tmp_path / "back.safetensors", None, lambda p: checkpoint.tensors[p])
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
    assert file_incomplete(tmp_path / "m.safetensors") == ""
    write_raw(tmp_path / "half.safetensors", header, b"")  # its header written, not yet its data
    assert file_incomplete(tmp_path / "half.safetensors") == "its tensor data is not all written yet"
    write_raw(tmp_path / "text.safetensors", b"   [1, 2]", b"")
    assert not safetensors_file.looks_like_safetensors(tmp_path / "text.safetensors")


def test_a_tensor_kept_as_bytes_is_written_under_its_committed_dtype_only_when_its_size_fits(tmp_path):
    """The header's F6_E2M3 [1000] beside 5 stored bytes was written as a file safetensors refuses (reviewer 422)."""
    from ckptstore.state import raw_from_bytes

    raw = raw_from_bytes(np.frombuffer(b"\x01\x02\x03", dtype=np.uint8))
    safetensors_file.write_tensors(tmp_path / "ok.safetensors", {"w": raw}, None, {"w": ("F6_E2M3", [4])})
    data = (tmp_path / "ok.safetensors").read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    assert json.loads(data[8:8 + size])["w"] == {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}
    for code, shape in (("F6_E2M3", [1000]), ("F32", [1000]), ("F8_E4M3", [1000]), ("F6_E2M3", [4.0]),
                        ("F6_E2M3", ["a"]), ("F9_NEW", [4]), ("F6_E2M3", 4)):  # reviewers 422, 425
        with pytest.raises(CheckpointFormatError, match="do not describe its 3 stored bytes"):
            safetensors_file.write_tensors(tmp_path / "bad.safetensors", {"w": raw}, None, {"w": (code, shape)})
        assert not (tmp_path / "bad.safetensors").exists()

"""torch.save zips whose end records are damaged the ways the long fuzz run found: a clear error, never zipfile's."""

import io
import struct

import pytest
import torch

from ckptstore import formats
from ckptstore.errors import CkptError
from ckptstore.state import materialize


def _saved() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 7}, buffer)
    return buffer.getvalue()


def _multi_disk(data: bytes) -> bytes:
    """The zip64 end locator claims three disks (zipfile.is_zipfile itself raised BadZipFile)."""
    at = data.rindex(b"PK\x06\x07")
    return data[: at + 16] + struct.pack("<I", 3) + data[at + 20 :]


def _future_version(data: bytes) -> bytes:
    """A central directory entry needs zip version 25.5 to extract (ZipFile raised NotImplementedError)."""
    at = data.rindex(b"PK\x01\x02")
    return data[: at + 6] + struct.pack("<H", 0xFF) + data[at + 8 :]


@pytest.mark.parametrize("damage", [_multi_disk, _future_version])
@pytest.mark.parametrize("trust", [False, True])
def test_a_damaged_zip_end_is_a_ckptstore_error_or_reads_exactly(tmp_path, damage, trust):
    path = tmp_path / "c.pt"
    path.write_bytes(damage(_saved()))
    try:
        checkpoint = formats.read_checkpoint(path, trust_pickle=trust)
    except CkptError as exc:
        assert str(path) in str(exc) or "c.pt" in str(exc)
        return
    state = formats.to_state(checkpoint.kind, checkpoint.files, lambda p: materialize(checkpoint.tensors[p]))
    assert state["step"] == 7
    assert torch.equal(state["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_a_record_flagged_as_a_directory_is_refused_on_the_torch_load_path(tmp_path):
    """torch.load reads such a record as uninitialised memory, silently: the torch.load path refuses it."""
    from ckptstore.formats import torchfile

    data = bytearray(_saved())
    entry = data.index(b"PK\x01\x02", data.index(b"PK\x01\x02") + 4)  # a record after data.pkl's
    data[entry + 38 : entry + 42] = struct.pack("<I", 0x10)
    path = tmp_path / "c.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(CkptError, match="as a directory"):
        torchfile.load(path)
    checkpoint = formats.read_checkpoint(path)  # the torch-free reader reads the record's own bytes
    state = formats.to_state(checkpoint.kind, checkpoint.files, lambda p: materialize(checkpoint.tensors[p]))
    assert torch.equal(state["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_a_cut_off_torch_save_file_whose_last_record_is_another_zip_is_refused(tmp_path):
    """Cut just after a record that is itself a torch.save zip (TransformerEngine's _extra_state), the file read as
    that inner checkpoint: zipfile accepts bytes before an archive, torch.load does not (mutation audit)."""
    from ckptstore.errors import CheckpointFormatError

    inner = io.BytesIO()
    torch.save({"inner": torch.full((4,), 7.0)}, inner)
    extra = torch.frombuffer(bytearray(inner.getvalue()), dtype=torch.uint8)
    whole = io.BytesIO()
    torch.save({"w": torch.ones(4), "te._extra_state": extra}, whole)
    end = whole.getvalue().index(inner.getvalue()) + len(inner.getvalue())
    path = tmp_path / "c.pt"
    path.write_bytes(whole.getvalue()[:end])  # the writer has got as far as the end of that record
    for trust in (False, True):
        with pytest.raises(CheckpointFormatError, match="c.pt is not a whole torch.save file: bytes come before"):
            formats.read_checkpoint(path, trust_pickle=trust)


def _two_records_at_one_place() -> bytes:
    """A torch.save zip whose central directory points data/1 at data/0's local record (torch.load reads it)."""
    buffer = io.BytesIO()
    torch.save({"a": torch.arange(16.0), "b": torch.arange(16.0) * 2}, buffer)
    data = bytearray(buffer.getvalue())
    at = data.index(b"PK\x05\x06")
    at = struct.unpack_from("<L", data, at + 16)[0]  # the central directory's start
    entries = {}
    while data[at : at + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack_from("<3H", data, at + 28)
        entries[data[at + 46 : at + 46 + n].decode().split("/", 1)[1]] = at
        at += 46 + n + m + k
    struct.pack_into("<L", data, entries["data/1"] + 42, struct.unpack_from("<L", data, entries["data/0"] + 42)[0])
    return bytes(data)


def test_a_zip_whose_directory_points_two_records_at_one_checks_out_its_state(repo, tmp_path):
    """Two storage records on the same bytes overlap: cut out of the container anyway, the commit could not be
    checked out at all; not split, it is written with torch.save and says so (mutation audit)."""
    path = tmp_path / "c.pt"
    path.write_bytes(_two_records_at_one_place())
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["b"], torch.arange(16.0))  # torch.load reads data/0's bytes for b
    cid = repo.commit(path)
    assert repo.manifest(cid).rewritten_files() == [""]
    repo.checkout_to(cid, tmp_path / "out.pt")
    for back in (torch.load(tmp_path / "out.pt", weights_only=True), repo.checkout(cid)):
        assert list(back) == ["a", "b"] and all(torch.equal(back[k], v) for k, v in loaded.items())

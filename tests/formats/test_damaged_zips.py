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

"""Typed ids and blake3 helpers: one place decides how content becomes a name."""

from __future__ import annotations

from typing import NewType

import blake3
import xxhash

ObjectId = NewType("ObjectId", str)
TensorId = NewType("TensorId", str)
CommitId = NewType("CommitId", str)

HEX_LENGTH = 64


def _hasher(data: bytes | memoryview | None = None) -> blake3.blake3:
    # Always one thread: callers hash many buffers at once on ckptstore's pool, and blake3's rayon
    # mode starts a pool that, where its threads cannot start (a memory limit), panics and hangs.
    hasher = blake3.blake3(max_threads=1)
    if data is not None:
        hasher.update(data)
    return hasher


def object_id(data: bytes | memoryview) -> ObjectId:
    """The id of a stored object: blake3 of exactly its bytes."""
    return ObjectId(_hasher(data).hexdigest())


def object_id_of_parts(parts) -> ObjectId:
    """object_id of the concatenation of `parts`, without concatenating them."""
    hasher = _hasher()
    for part in parts:
        hasher.update(part)
    return ObjectId(hasher.hexdigest())


def tensor_id(dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> TensorId:
    """The id of a tensor: blake3 over its dtype, shape and raw bytes, so equal content is stored once."""
    return tensor_id_of_parts(dtype, shape, [data])


def tensor_id_of_parts(dtype: str, shape: tuple[int, ...], parts) -> TensorId:
    """tensor_id of the concatenation of `parts`, without concatenating them."""
    hasher = _hasher(f"tensor\0{dtype}\0{','.join(map(str, shape))}\0".encode())
    for part in parts:
        hasher.update(part)
    return TensorId(hasher.hexdigest())


def chunk_checksum(data: bytes | memoryview) -> str:
    """A fast check of one decoded chunk (xxh3-128, about 6x cheaper than blake3 here).

    Recorded at commit and compared right after each chunk is replayed, while it is still in
    cache, so checkout need not hash whole tensors with blake3; it guards against damaged storage
    and decoding faults, not against an attacker (who could rewrite the metadata as well), which
    is what the blake3 ids and `ckpt fsck --full` are for.
    """
    return xxhash.xxh3_128_hexdigest(data)


def commit_id(canonical_record: bytes) -> CommitId:
    """The id of a commit: blake3 of its canonical JSON record."""
    return CommitId(_hasher(canonical_record).hexdigest())


def bytes_digest(data: bytes | memoryview) -> str:
    """blake3 of `data` on this thread: a whole file's digest (formats/filemap.py's `file_digest`).

    Files go to ckptstore's own pool one a task (repo/commit.py), where a thread that cannot start
    raises a Python error; blake3's rayon mode panicked there instead, and hung the command.
    """
    return _hasher(data).hexdigest()


def is_hex_id(text: str) -> bool:
    """True for a full-length lowercase hex digest."""
    return len(text) == HEX_LENGTH and all(c in "0123456789abcdef" for c in text)

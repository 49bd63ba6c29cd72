"""The object store contract, as functions any store implementation's tests can call.

Each check takes a fresh, empty store and exercises one part of `objectstore.base.ObjectStore`;
`ALL_CHECKS` lists them all, so a new store (S3, say) passes the same list as the local one.
`DAMAGE_CHECKS` also take `overwrite(oid, data)`, which puts raw bytes under a name behind the
store's back (what a crash or a bad disk does), so each store shows it does not trust such a name.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId, object_id
from ckptstore.objectstore import ObjectStore, read_whole
from ckptstore.objectstore.base import KnowsItsObjects, lacking


def check_protocol(store: ObjectStore) -> None:
    """The store names every method of the protocol and says where it lives."""
    assert isinstance(store, ObjectStore)
    assert isinstance(store.url, str) and "://" in store.url


def check_round_trip(store: ObjectStore) -> None:
    """Put returns the blake3 id; get returns the same bytes; put is idempotent."""
    data = os.urandom(10_000)
    oid = store.put(data)
    assert oid == object_id(data)
    assert store.has(oid)
    assert store.get(oid) == data and bytes(read_whole(store, oid)) == data
    assert store.put(memoryview(data)) == oid
    assert store.put(b"") == object_id(b"") and store.get(object_id(b"")) == b""


def check_delete_and_iter(store: ObjectStore) -> None:
    """iter_ids lists exactly what was put and not deleted; delete of a missing id is fine."""
    ids = {store.put(os.urandom(100 + i)) for i in range(5)}
    assert ids == set(store.iter_ids())
    assert dict(store.iter_sizes()) == {oid: store.size(oid) for oid in ids}
    victim = sorted(ids)[0]
    store.delete(victim)
    store.delete(victim)
    assert not store.has(victim)
    assert set(store.iter_ids()) == ids - {victim}
    assert lacking(store, ids) in (set(), {victim})  # a store that tells cheaply tells exactly
    assert not isinstance(store, KnowsItsObjects) or lacking(store, ids) == {victim}


def check_missing(store: ObjectStore) -> None:
    """Get, size and range reads of an absent id raise CorruptObjectError naming it."""
    absent = ObjectId("0" * 64)
    assert not store.has(absent)
    with pytest.raises(CorruptObjectError, match="0" * 64):
        store.get(absent)
    with pytest.raises(CorruptObjectError, match="0" * 64):
        store.size(absent)
    ranges = store.open_ranges()
    try:
        with pytest.raises(CorruptObjectError, match="0" * 64):
            ranges.read(absent, 0, 1)
    finally:
        ranges.close()


def check_size(store: ObjectStore) -> None:
    """Size is the stored length."""
    for length in (0, 1, 4097):
        assert store.size(store.put(os.urandom(length))) == length


def check_ranges(store: ObjectStore) -> None:
    """Range reads return exactly the bytes asked for, into a buffer too; past the end is an error."""
    data = os.urandom(5000)
    oid = store.put(data)
    ranges = store.open_ranges()
    try:
        assert bytes(ranges.read(oid, 0, 5000)) == data
        assert bytes(ranges.read(oid, 1234, 100)) == data[1234:1334]
        buffer = bytearray(200)
        view = ranges.read(oid, 4900, 100, buffer)
        assert bytes(view) == data[4900:] and buffer[:100] == data[4900:]
        with pytest.raises(CorruptObjectError):
            ranges.read(oid, 4990, 100)
    finally:
        ranges.close()


def check_batch(store: ObjectStore) -> None:
    """Objects put inside a batch are all present and whole once it ends, from several threads too."""
    payloads = [os.urandom(1000 + i) for i in range(8)]
    with store.batch():
        threads = [threading.Thread(target=store.put, args=(p,)) for p in payloads]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(store.get(object_id(p)) == p for p in payloads)


def check_clear_tmp(store: ObjectStore) -> None:
    """Clearing leftovers of interrupted writes never removes a stored object."""
    oid = store.put(b"kept")
    assert store.clear_tmp() >= 0
    assert store.get(oid) == b"kept"


ALL_CHECKS = [check_protocol, check_round_trip, check_delete_and_iter, check_missing, check_size, check_ranges,
              check_batch, check_clear_tmp]


def check_put_replaces_a_damaged_object(store: ObjectStore, overwrite: Callable[[ObjectId, bytes], None]) -> None:
    """Putting bytes whose id is stored damaged (cut short, or flipped at the same size) stores them whole."""
    data = os.urandom(20_000)
    oid = store.put(data)
    for damaged in (data[: len(data) // 2], b"", data[:-1] + bytes([data[-1] ^ 1])):
        overwrite(oid, damaged)
        with pytest.raises(CorruptObjectError):
            store.get(oid)
        assert store.put(memoryview(data)) == oid
        assert store.get(oid) == data and store.size(oid) == len(data)
    overwrite(oid, data[:100])
    with store.batch():
        store.put(data)
    assert store.get(oid) == data


DAMAGE_CHECKS = [check_put_replaces_a_damaged_object]

"""The object store contract, as functions any store implementation's tests can call."""

from __future__ import annotations

import os

import pytest

from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId, object_id
from ckptstore.objectstore import ObjectStore


def check_round_trip(store: ObjectStore) -> None:
    """Put returns the blake3 id; get returns the same bytes; put is idempotent."""
    data = os.urandom(10_000)
    oid = store.put(data)
    assert oid == object_id(data)
    assert store.has(oid)
    assert store.get(oid) == data
    assert store.put(data) == oid
    assert store.put(b"") == object_id(b"") and store.get(object_id(b"")) == b""


def check_delete_and_iter(store: ObjectStore) -> None:
    """iter_ids lists exactly what was put and not deleted; delete of a missing id is fine."""
    ids = {store.put(os.urandom(100 + i)) for i in range(5)}
    assert ids <= set(store.iter_ids())
    victim = sorted(ids)[0]
    store.delete(victim)
    store.delete(victim)
    assert not store.has(victim)
    assert victim not in set(store.iter_ids())
    assert (ids - {victim}) <= set(store.iter_ids())


def check_missing(store: ObjectStore) -> None:
    """Get of an absent id raises CorruptObjectError naming it."""
    absent = ObjectId("0" * 64)
    with pytest.raises(CorruptObjectError, match="0" * 64):
        store.get(absent)


ALL_CHECKS = [check_round_trip, check_delete_and_iter, check_missing]

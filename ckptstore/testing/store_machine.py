"""A hypothesis state machine for object stores, shipped once so every store (local, memory, S3) reuses it.

`store_machine(new_store)` returns a `RuleBasedStateMachine` class that drives a fresh store
through random puts, gets, deletes and listings and compares it after every step with a plain
dict (id -> bytes). Run it from a test module::

    TestMyStore = store_machine(lambda: MyStore(...)).TestCase

Stores whose bytes a test can reach directly (a folder, a bucket) pass `damage` and `heal`, which
adds a rule that damages a stored object and checks that `get()` refuses it while
`get(oid, verify=False)` hands the damaged bytes back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId, object_id

# Small payloads keep hundreds of steps fast; the edge cases (empty, one byte, repeats) are what matter.
PAYLOADS = st.one_of(st.just(b""), st.binary(min_size=1, max_size=64), st.binary(min_size=65, max_size=4096))


class StoreMachine(RuleBasedStateMachine):
    """The store against a dict of what it must hold; `damaged` is what was changed behind its back.

    `store_machine` makes a subclass with the store's factory and hooks set.
    """

    new_store: Callable[[], Any]
    damage: Callable[[Any, ObjectId, bytes], None] | None = None
    dispose: Callable[[Any], None] | None = None

    payloads = Bundle("payloads")

    def __init__(self) -> None:
        super().__init__()
        self.store = type(self).new_store()
        self.model: dict[ObjectId, bytes] = {}
        self.damaged: dict[ObjectId, tuple[bytes, bytes]] = {}  # id -> (good bytes, bytes stored now)

    @initialize()
    def starts_empty(self) -> None:
        assert list(self.store.iter_ids()) == []

    @rule(target=payloads, data=PAYLOADS)
    def put(self, data: bytes) -> bytes:
        self._put(data)
        return data

    @rule(data=payloads)
    def put_again(self, data: bytes) -> None:
        """A duplicate put (of bytes that may have been deleted since) returns the same id."""
        self._put(data)

    def _put(self, data: bytes) -> None:
        oid = self.store.put(memoryview(data) if len(data) % 2 else data)  # both accepted types
        assert oid == object_id(data)
        self.damaged.pop(oid, None)  # put does not trust a damaged object under the name: it writes it whole
        self.model[oid] = data
        assert self.store.get(oid) == data

    @rule(data=payloads)
    def get(self, data: bytes) -> None:
        oid = object_id(data)
        if oid in self.damaged:
            return  # checked by the damage rule and the invariant
        if oid in self.model:
            assert self.store.get(oid) == data
            assert self.store.get(oid, verify=False) == data
        else:
            self._assert_missing(oid)

    @rule(data=PAYLOADS)
    def get_never_stored(self, data: bytes) -> None:
        oid = object_id(data + b"\0never")
        if oid not in self.model:
            self._assert_missing(oid)

    def _assert_missing(self, oid: ObjectId) -> None:
        assert not self.store.has(oid)
        try:
            self.store.get(oid)
        except CorruptObjectError as exc:
            assert exc.object_id == oid and oid in str(exc)
        else:
            raise AssertionError(f"get of absent {oid} did not raise CorruptObjectError")

    @rule(data=payloads)
    def has(self, data: bytes) -> None:
        oid = object_id(data)
        assert self.store.has(oid) == (oid in self.model or oid in self.damaged)

    @rule(data=payloads)
    def delete(self, data: bytes) -> None:
        """Deleting twice, or deleting what was never there, is not an error."""
        oid = object_id(data)
        self.store.delete(oid)
        self.store.delete(oid)
        self.model.pop(oid, None)
        self.damaged.pop(oid, None)
        assert not self.store.has(oid)

    @rule(data=payloads)
    def size(self, data: bytes) -> None:
        oid = object_id(data)
        if oid in self.model:
            assert self.store.size(oid) == len(data)

    @precondition(lambda self: type(self).damage is not None and self.model)
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "extend", "empty"]))
    def damage_object(self, data: st.DataObject, how: str) -> None:
        oid = data.draw(st.sampled_from(sorted(self.model)), label="victim")
        good = self.model[oid]
        bad = _damaged(good, how, data.draw(st.integers(0, max(len(good) - 1, 0)), label="at"))
        if bad == good:  # nothing to damage in an empty object that "empty" would produce
            return
        type(self).damage(self.store, oid, bad)
        del self.model[oid]
        self.damaged[oid] = (good, bad)
        self._assert_damaged(oid, bad)

    @precondition(lambda self: self.damaged)
    @rule(data=st.data(), restore=st.booleans())
    def repair(self, data: st.DataObject, restore: bool) -> None:
        """Delete a damaged object, then (if `restore`) put its good bytes back."""
        oid = data.draw(st.sampled_from(sorted(self.damaged)), label="damaged")
        good, _ = self.damaged.pop(oid)
        self.store.delete(oid)
        self._assert_missing(oid)
        if restore:
            self._put(good)
            assert self.store.get(oid) == good

    def _assert_damaged(self, oid: ObjectId, bad: bytes) -> None:
        assert self.store.has(oid)
        try:
            self.store.get(oid)
        except CorruptObjectError as exc:
            assert exc.object_id == oid
        else:
            raise AssertionError(f"get of damaged {oid} did not raise CorruptObjectError")
        assert self.store.get(oid, verify=False) == bad

    @invariant()
    def lists_exactly_the_model(self) -> None:
        assert sorted(self.store.iter_ids()) == sorted({*self.model, *self.damaged})

    def teardown(self) -> None:
        try:
            for oid, data in self.model.items():
                assert self.store.get(oid) == data and self.store.size(oid) == len(data)
            for oid, (_, bad) in self.damaged.items():
                self._assert_damaged(oid, bad)
        finally:
            if type(self).dispose is not None:
                type(self).dispose(self.store)


def store_machine(new_store: Callable[[], Any], damage: Callable[[Any, ObjectId, bytes], None] | None = None,
                  dispose: Callable[[Any], None] | None = None) -> type[RuleBasedStateMachine]:
    """A state machine class checking a store made by `new_store()` (called once per example).

    Args:
        new_store: returns an empty store.
        damage: `damage(store, oid, bad_bytes)` replaces the stored bytes of `oid` behind the
            store's back; None for stores a test cannot reach into (the damage rule is then off).
        dispose: `dispose(store)` frees what `new_store` made (a temporary folder, a bucket
            prefix) once an example is done, whether it passed or not.
    """
    hooks = {"new_store": staticmethod(new_store), "damage": staticmethod(damage) if damage else None,
             "dispose": staticmethod(dispose) if dispose else None}
    return type("StoreMachine", (StoreMachine,), hooks)


def _damaged(good: bytes, how: str, at: int) -> bytes:
    """`good` with one byte flipped, cut short, extended or emptied."""
    if how == "flip" and good:
        return good[:at] + bytes([good[at] ^ 0x5A]) + good[at + 1:]
    if how == "truncate" and good:
        return good[:at]
    if how == "extend":
        return good + b"\0"
    return b""

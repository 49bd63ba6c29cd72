"""The object store state machine (ckptstore/testing/store_machine.py) against the local, memory and S3 stores.

Bounded by the hypothesis profiles of tests/conftest.py: `CKPT_HYPOTHESIS_PROFILE=long` for a long run.
"""

import shutil
import tempfile
from pathlib import Path

import pytest

from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId, object_id
from ckptstore.objectstore import LocalObjectStore, MemoryObjectStore
from ckptstore.objectstore.s3 import S3ObjectStore
from ckptstore.testing.store_machine import store_machine
from tests.conftest import machine_settings


def _local_store() -> LocalObjectStore:
    # A folder per example: hypothesis builds many machines within one test, so tmp_path cannot serve.
    folder = Path(tempfile.mkdtemp(prefix="ckpt-store-machine-"))
    return LocalObjectStore(folder / "objects", folder / "tmp")


def _remove_folder(store: LocalObjectStore) -> None:
    shutil.rmtree(store.root.parent)


def _overwrite_file(store: LocalObjectStore, oid: ObjectId, bad: bytes) -> None:
    """Damage as a disk would: the object's file changes in place and the store is not told."""
    store.path_of(oid).write_bytes(bad)


LocalStoreMachine = store_machine(_local_store, damage=_overwrite_file, dispose=_remove_folder)
LocalStoreMachine.TestCase.settings = machine_settings()
TestLocalStoreMachine = LocalStoreMachine.TestCase

MemoryStoreMachine = store_machine(MemoryObjectStore)
MemoryStoreMachine.TestCase.settings = machine_settings()
TestMemoryStoreMachine = MemoryStoreMachine.TestCase

_servers = {}


@pytest.fixture(autouse=True)
def _s3_server(s3_server):
    """Hypothesis builds the machines itself, so they reach the session's S3 server through this module."""
    _servers["s3"] = s3_server


# A bucket per example. No damage rule: the S3 store verifies every read, even get(verify=False).
S3StoreMachine = store_machine(lambda: S3ObjectStore(f"s3://{_servers['s3'].new_bucket('machine')}/m"))
S3StoreMachine.TestCase.settings = machine_settings(0.25)  # HTTP round trips: a quarter of the examples
TestS3StoreMachine = S3StoreMachine.TestCase


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_size_of_a_missing_object_is_a_corrupt_object_error(kind, tmp_path):
    """Like get(): gc asks size() of ids it listed, which a concurrent delete may have removed."""
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp") if kind == "local" else MemoryObjectStore()
    absent = object_id(b"never stored")
    with pytest.raises(CorruptObjectError, match=absent):
        store.size(absent)

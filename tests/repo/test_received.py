"""Received records checked before a commit reuses them (ckptstore/repo/received.py), on a shared repository."""

import time

import torch

from ckptstore import Repository
from ckptstore.hashing import tensor_id
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore.local import FileRanges, LocalObjectStore
from ckptstore.repo import fsck, remote
from tests.conftest import assert_same, received_lie


def _ident(tensor: torch.Tensor) -> str:
    return tensor_id(str(tensor.dtype), tuple(tensor.shape), tensor.contiguous().numpy().view("uint8").reshape(-1))


def _slow_once_written(monkeypatch, slow: set[str], seconds: float) -> None:
    """Once an object was put (the commit's manifest: its records were checked before), the next read of an object in
    `slow` answers `seconds` late: a slow bucket's GET, where only the commit's write transaction reads them."""
    armed = []
    put = LocalObjectStore.put

    def arming(self, data):
        armed.append(True)
        return put(self, data)

    monkeypatch.setattr(LocalObjectStore, "put", arming)
    for owner, name in ((LocalObjectStore, "get"), (LocalObjectStore, "view"), (FileRanges, "read")):
        monkeypatch.setattr(owner, name, _late(getattr(owner, name), slow, armed, seconds))


def _late(read, slow: set[str], armed: list, seconds: float):
    """`read`, answering `seconds` late once `armed`, for an object in `slow`."""
    def late(self, oid, *args, **kwargs):
        if armed and oid in slow:
            armed.clear()
            time.sleep(seconds)
        return read(self, oid, *args, **kwargs)

    return late


def test_a_commit_decoding_what_rests_on_a_replaced_record_from_a_slow_store_outlasts_the_idle_limit(
        tmp_path, postgres_url, monkeypatch):
    """A commit replacing a received record that lies decodes the records resting on it inside its write
    transaction; that read the store with the idle limit (3 request limits: 3 s here) still on, so a slow bucket
    failed the commit "sat idle", again on every rerun (reviewer 366). The limit is lifted where it reads."""
    monkeypatch.setenv("CKPT_PG_REQUEST_SECONDS", "1")
    generator = torch.Generator().manual_seed(5)
    w, v = torch.randn(64, 128, generator=generator), torch.randn(64, 128, generator=generator)
    w2 = w.clone()
    w2[0, :10] += 1
    with Repository.init(tmp_path / "a") as origin:  # its record of w holds v's bytes: a crafted remote
        origin.commit({"w": w, "v": v}, message="one")
        second = origin.commit({"w": w2, "v": v}, message="two")
        with origin.db.read() as tx:  # the lie holds v's objects: the commit's write transaction decodes them
            on_top = tensor_rows.load_records(tx, [origin.manifest(second).entries["w"].tensor], with_bases=False)
            lie = tensor_rows.load_records(tx, [_ident(v)])[_ident(v)]
        assert next(iter(on_top.values())).base_id == _ident(w)
    received_lie(tmp_path / "a" / ".ckpt", _ident(w), _ident(v), listed=False)
    with Repository.init(tmp_path / "b", metadata_url=postgres_url) as mine:
        remote.add(mine, "a", str(tmp_path / "a"))
        remote.fetch(mine, "a")
        _slow_once_written(monkeypatch, {c.object_id for c in lie.chunks}, 3.5)
        cid = mine.commit({"w": w, "v": v}, message="mine")  # w encoded anew; w2 rests on the lie: decoded
        monkeypatch.undo()
        assert_same({"w": w, "v": v}, mine.checkout(cid))
        assert fsck(mine).ok

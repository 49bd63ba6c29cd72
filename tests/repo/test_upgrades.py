"""repo/upgrades.py: what an older ckptstore kept in `.ckpt/` files, taken over by this one's first writable open."""

import torch

from ckptstore import Repository
from ckptstore.hashing import tensor_id
from ckptstore.repo import fsck
from tests.conftest import assert_same, received_lie, unchecked


def test_an_older_ckptstores_list_of_received_records_is_checked_before_a_commit_reuses_one(tmp_path):
    """Before schema 0009 the list was `.ckpt/received`; an upgraded repository forgot it, and a commit of the
    user's zeros reused a crafted remote's record of them, restoring other bytes (rolling-upgrade audit)."""
    with Repository.init(tmp_path) as repo:
        honest = repo.manifest(repo.commit({"v": torch.arange(16.0)})).entries["v"].tensor
    zeros = torch.zeros(16)
    poisoned = tensor_id("torch.float32", (16,), zeros.numpy().view("uint8"))
    received_lie(tmp_path / ".ckpt", poisoned, honest, listed=False)  # the record as the older fetch left it
    (tmp_path / ".ckpt" / "received").write_text(f"{poisoned}\nnot-an-id\n")  # the older ckptstore's list
    (tmp_path / ".ckpt" / "received.lock").touch()
    with Repository.open(tmp_path, read_only=True) as reader:  # a read-only open writes nothing
        assert unchecked(reader, {poisoned}) == set()
    assert (tmp_path / ".ckpt" / "received").exists()
    with Repository.open(tmp_path) as repo:
        assert unchecked(repo, {poisoned}) == {poisoned}
        assert not (tmp_path / ".ckpt" / "received").exists() and not (tmp_path / ".ckpt" / "received.lock").exists()
        cid = repo.commit({"v": zeros}, message="my zeros")
        assert_same({"v": zeros}, repo.checkout(cid))
        assert unchecked(repo, {poisoned}) == set() and fsck(repo, full=True).ok

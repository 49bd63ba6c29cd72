"""Retention on sharded (DCP) commits: `prune` of a sharded history, and `[retention]` after a sharded commit.

The commits come from one process's `dcp.save` through CkptStorageWriter (the cheapest way to
make many sharded commits); with long chains, kept commits' shards are residuals on removed
ones, so prune re-encodes them. Every kept commit must load bit-exact through CkptStorageReader
and through `checkout -o` read by DCP's own FileSystemReader, with its DCP metadata unchanged.
The kill test runs tests/repo/test_prune.py's campaign on a sharded repository.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore import Repository
from ckptstore.dcp import CkptStorageReader, CkptStorageWriter
from ckptstore.errors import CkptError, PrunedCommitError
from ckptstore.repo import fsck, pruning
from ckptstore.repo.checkout import restore
from ckptstore.repo.config import RepoConfig, RetentionPolicy
from ckptstore.repo.sharded import dcp_problem
from tests.conftest import assert_same
from tests.repo.test_prune import COMMITS, KEPT_POSITIONS, LONG_CHAINS, POLICY, _trial

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(weight: torch.Tensor, step: int) -> dict:
    return {"w": weight.clone(), "half": weight[:8].to(torch.bfloat16), "extra": {"step": step, "name": "run"}}


def _blank() -> dict:
    return {"w": torch.zeros(128, 64), "half": torch.zeros(8, 64, dtype=torch.bfloat16),
            "extra": {"step": -1, "name": ""}}


def _save_sharded(repo: Repository, commits: int, seed: int = 7) -> tuple[list[str], list[dict]]:
    """`commits` sharded commits on the current branch, each a small step from the last: their ids and states."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(128, 64, generator=generator)
    cids, states = [], []
    for step in range(commits):
        weight = weight + torch.randn(weight.shape, generator=generator) * 1e-3
        states.append(_state(weight, step))
        writer = CkptStorageWriter(repo, step=step)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(states[-1], storage_writer=writer)
        cids.append(writer.commit_id)
    return cids, states


def _stored(repo: Repository, cid: str) -> dict:
    """A sharded commit as stored: its DCP metadata and every shard's dtype, shape and bytes (torch-free)."""
    manifest = repo.manifest(cid)
    shards = {k: (r.dtype, tuple(r.shape), r.data.tobytes()) for k, r in restore(repo, manifest).items()}
    return {"dcp": manifest.dcp, "shards": shards}


def _loaded(repo: Repository, cid: str, out: Path) -> tuple[dict, dict]:
    """Commit `cid` loaded by dcp.load through CkptStorageReader, and through `checkout -o` and FileSystemReader."""
    ours, theirs = _blank(), _blank()
    dcp.load(ours, storage_reader=CkptStorageReader(repo, cid))
    repo.checkout_to(cid, out)
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(out))
    return ours, theirs


def test_prune_of_sharded_commits_keeps_every_survivor_bit_exact_and_frees_the_rest(tmp_path):
    with Repository.init(tmp_path / "repo", encoding=LONG_CHAINS) as repo:
        cids, states = _save_sharded(repo, 6)
        repo.tag("picked", cids[1])
        stored = {cid: _stored(repo, cid) for cid in cids}
        manifests = {cid: repo.commit_info(cid).manifest_object for cid in cids}
        report = pruning.prune(repo, RetentionPolicy(keep_last=2, keep_tagged=True))
        kept = {cids[1], cids[4], cids[5]}
        assert set(report.pruned) == set(cids) - kept
        assert report.tensors_reencoded > 0  # commit 1 on removed 0, commit 4 down 3 and 2: their shards move
        assert report.bytes_after < report.bytes_before
        for i, cid in enumerate(cids):
            if cid in kept:
                assert_same(stored[cid], _stored(repo, cid))  # the same shards and DCP metadata
                assert dcp_problem(repo.manifest(cid)) is None
                for loaded in _loaded(repo, cid, tmp_path / f"out{i}"):
                    assert_same(loaded, states[i])
            else:
                assert not repo.store.has(manifests[cid])
                with pytest.raises(PrunedCommitError, match="ckpt prune"):
                    repo.checkout_to(cid, tmp_path / f"gone{i}")
                with pytest.raises(CheckpointException, match="removed by `ckpt prune`"):
                    dcp.load(_blank(), storage_reader=CkptStorageReader(repo, cid))
        checked = fsck(repo, full=True)
        assert checked.ok and not checked.broken_commits and checked.unreferenced_objects == 0, checked
        more, after = _save_sharded(repo, 1, seed=8)  # a save whose shards are residuals on re-encoded ones
        assert_same(_loaded(repo, more[0], tmp_path / "more")[0], after[0])


def _set_retention(root: Path, policy: RetentionPolicy) -> None:
    path = root / ".ckpt" / "config.toml"
    config = RepoConfig.load(path)
    config.retention = policy
    config.save(path)


def test_config_retention_prunes_after_a_dcp_save_and_a_committed_dcp_directory(tmp_path):
    with Repository.init(tmp_path / "repo") as repo:
        _save_sharded(repo, 3)
    _set_retention(tmp_path / "repo", RetentionPolicy(keep_last=2))
    cids, states = _save_sharded(Path(tmp_path / "repo"), 1, seed=9)  # the writer opens the repository itself
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.pruned for c in repo.log()] == [False, False, True, True]
        assert_same(_loaded(repo, cids[0], tmp_path / "out")[0], states[0])
        dcp.save(_state(torch.ones(128, 64), 9), storage_writer=dcp.FileSystemWriter(tmp_path / "dir"))
        repo.commit(str(tmp_path / "dir"), message="a DCP directory")  # `ckpt commit DIR`
        assert [c.pruned for c in repo.log()] == [False, False, True, True, True]
        assert fsck(repo, full=True).ok


def test_a_failed_retention_after_a_dcp_save_keeps_the_recorded_commit(tmp_path, monkeypatch):
    with Repository.init(tmp_path / "repo") as repo:
        _save_sharded(repo, 2)
    _set_retention(tmp_path / "repo", RetentionPolicy(keep_last=1))

    def failing(*args, **kwargs):
        raise CkptError("the store refused a delete")

    monkeypatch.setattr(pruning, "prune", failing)
    writer = CkptStorageWriter(tmp_path / "repo", step=5)
    state = _state(torch.full((128, 64), 2.0), 5)
    with pytest.raises(CheckpointException, match="was recorded, but the \\[retention\\] policy's prune after"):
        dcp.save(state, storage_writer=writer)
    with Repository.open(tmp_path / "repo") as repo:
        assert writer.commit_id is not None and repo.resolve("main") == writer.commit_id
        assert_same(_loaded(repo, writer.commit_id, tmp_path / "out")[0], state)


@pytest.fixture(scope="module")
def sharded_template(tmp_path_factory):
    """COMMITS sharded commits with long chains (so prune re-encodes shards), and what each stores."""
    work = tmp_path_factory.mktemp("sharded-prune-kill") / "template"
    with Repository.init(work, encoding=LONG_CHAINS) as repo:
        cids, _ = _save_sharded(repo, COMMITS)
        before = {cid: _stored(repo, cid) for cid in cids}
        planned = pruning.prune(repo, POLICY, dry_run=True)
        assert planned.pruned == sorted(cids[i] for i in range(COMMITS) if i not in KEPT_POSITIONS)
        assert planned.tensors_reencoded > 0  # kept commits 3 and 6 are residuals on removed ones
    return work, cids, before, None


def test_a_prune_of_sharded_commits_killed_after_its_transaction_loses_nothing(sharded_template, tmp_path):
    result = _trial(sharded_template, tmp_path, "trial", point="prune:db-committed", restore=_stored)
    assert result["killed"] and result["problems"] == []

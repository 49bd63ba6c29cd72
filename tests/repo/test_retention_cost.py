"""The [retention] policy after each commit: what it walks, and what it must refuse (auditor 333, reviewer 347).

Counted, not timed: first-parent steps walked; and the damage a check of kept commits alone let through.
"""

from __future__ import annotations

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import RetentionError
from ckptstore.repo.config import RetentionPolicy
from ckptstore.repo.retention import History, _doomed_by_branch, doomed
from tests.conftest import assert_same


class _CountedParents(dict):
    """Parents that count the lookups made of them: each is one step of a first-parent walk."""

    looked_up = 0

    def get(self, key, default=None):
        self.looked_up += 1
        return super().get(key, default)


def _with_policy(root, line: str) -> None:
    with open(root / ".ckpt" / "config.toml", "a") as config:
        config.write(f"\n[retention]\n{line}\n")


def _refused(repo, state, why: str) -> None:
    """The commit is recorded and its policy run refuses, saying `why`: it deletes nothing of damaged metadata."""
    with pytest.raises(RetentionError, match=why):
        repo.commit(state)


def test_the_policy_after_a_commit_still_refuses_a_kept_commit_whose_rows_were_lost(tmp_path):
    """The policy after a commit compares kept commits' manifests with their rows: lost rows delete nothing."""
    states = [{"w": torch.full((3000,), float(i)), "b": torch.zeros(8)} for i in range(4)]
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit(state) for state in states[:3]]
    _with_policy(tmp_path, "keep_last = 3")
    with Repository.open(tmp_path) as repo:
        with repo.db.write() as tx:
            tx.execute(f"DELETE FROM commit_tensors WHERE commit_id = '{cids[2]}'")
        _refused(repo, states[3], "prune refused to delete anything: the repository is damaged")
        assert not any(info.pruned for info in repo.log())
        with repo.db.write() as tx:
            tx.executemany("INSERT INTO commit_tensors (commit_id, tensor_id) VALUES (?, ?)",
                           [(cids[2], e.tensor) for e in repo.manifest(cids[2]).entries.values()])
        for cid, state in zip(cids, states):
            assert_same(state, repo.checkout(cid))


def test_the_policy_after_a_commit_refuses_where_a_pruned_commits_parent_row_was_lost(tmp_path):
    """Pruned rows place keep_every's positions: a check of kept commits alone (7bcf20e, reverted) let a lost
    parent row of a pruned commit shift them, and the next commit deleted commits keep_every keeps (reviewer 347)."""
    generator = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(5000, generator=generator)} for _ in range(7)]
    Repository.init(tmp_path).close()
    _with_policy(tmp_path, "keep_every = 2\nkeep_last = 1")
    with Repository.open(tmp_path) as repo:
        cids = [repo.commit(state) for state in states[:6]]
        kept = [cid for cid in cids if not repo.commit_info(cid).pruned]
        with repo.db.write() as tx:
            tx.execute(f"DELETE FROM commit_parents WHERE commit_id = '{cids[1]}'")
        _refused(repo, states[6], "prune refused to delete anything: the repository is damaged")
        with repo.db.read() as tx:
            pruned = {row[0] for row in tx.rows("SELECT commit_id FROM pruned_commits")}
        assert [cid for cid in cids if cid not in pruned] == kept


def test_the_policy_after_a_commit_refuses_where_a_kept_commits_object_was_lost(tmp_path):
    """A kept commit's object lost on disk: skipping the store listing (7bcf20e, reverted) deleted the older,
    whole commit while the broken one stayed, and said nothing (reviewer 347)."""
    states = [{"w": torch.full((3000,), float(i))} for i in range(3)]
    with Repository.init(tmp_path) as repo:
        first, second = repo.commit(states[0]), repo.commit(states[1])
        lost = {oid for oid in repo.store.iter_ids()} - {repo.commit_info(first).manifest_object}
        lost = [oid for oid in lost if repo.commits_needing([oid]) == [second]]
        assert lost
        for oid in lost:
            repo.store.path_of(oid).unlink()
    _with_policy(tmp_path, "keep_last = 2")
    with Repository.open(tmp_path) as repo:
        _refused(repo, states[2], "not in the store")
        assert_same(states[0], repo.checkout(first))


def test_doomed_walks_each_first_parent_chain_once_for_all_branches():
    """60 branches near the end of one history walked it 60 times, after every commit."""
    ids = [f"c{i:05d}" for i in range(600)]
    parents = _CountedParents({c: [ids[i - 1]] if i else [] for i, c in enumerate(ids)})
    branches = {f"b{j}": ids[-1 - 5 * j] for j in range(60)}
    history = History(branches, parents, {}, set(branches.values()), set(ids[:200]))
    gone = doomed(history, RetentionPolicy(keep_last=2))
    assert parents.looked_up <= len(ids) + 60 * 2 + 60  # once per commit, then each branch's newest two
    assert gone == _doomed_by_branch(history, RetentionPolicy(keep_last=2))


def test_doomed_of_a_forged_first_parent_loop_ends_and_reads_each_branch_alone():
    parents = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    for policy in (RetentionPolicy(keep_last=1), RetentionPolicy(keep_every=2), RetentionPolicy(keep_best="loss")):
        history = History({"main": "d"}, parents, {"b": {"loss": 1.0}}, {"d"})
        assert doomed(history, policy) == _doomed_by_branch(history, policy)

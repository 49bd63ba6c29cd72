"""The [retention] policy after each commit: its work is a policy's worth, not the whole history's (auditor 333).

Counted, not timed: commit rows hashed, store listings, first-parent steps walked.
"""

from __future__ import annotations

import copy

import torch

from ckptstore import Repository
from ckptstore.errors import RetentionError
from ckptstore.metadata.commits import CommitInfo
from ckptstore.objectstore.local import LocalObjectStore
from ckptstore.repo import fsck, gc
from ckptstore.repo.config import RetentionPolicy
from ckptstore.repo.retention import History, _doomed_by_branch, doomed
from tests.conftest import Trainer, assert_same


class _CountedParents(dict):
    """Parents that count the lookups made of them: each is one step of a first-parent walk."""

    looked_up = 0

    def get(self, key, default=None):
        self.looked_up += 1
        return super().get(key, default)


def _with_policy(root, line: str) -> None:
    with open(root / ".ckpt" / "config.toml", "a") as config:
        config.write(f"\n[retention]\n{line}\n")


def test_the_policy_after_a_commit_hashes_only_kept_commits_and_lists_no_store(tmp_path, monkeypatch):
    """Every commit hashed every commit row ever made (pruned ones too) twice and listed the store twice."""
    trainer = Trainer()
    with Repository.init(tmp_path) as repo:
        for _ in range(40):
            trainer.train(1)
            repo.commit(trainer.state())
    _with_policy(tmp_path, "keep_last = 3")
    with Repository.open(tmp_path) as repo:
        trainer.train(1)
        repo.commit(trainer.state())  # the one-off prune of the history before the policy
        hashed, listed = [0], [0]
        computed, iter_ids, iter_sizes = CommitInfo.computed_id, LocalObjectStore.iter_ids, LocalObjectStore.iter_sizes
        monkeypatch.setattr(CommitInfo, "computed_id", lambda *a, **k: (hashed.__setitem__(0, hashed[0] + 1),
                                                                        computed(*a, **k))[1])
        monkeypatch.setattr(LocalObjectStore, "iter_ids", lambda s: (listed.__setitem__(0, listed[0] + 1),
                                                                     iter_ids(s))[1])
        monkeypatch.setattr(LocalObjectStore, "iter_sizes", lambda s: (listed.__setitem__(0, listed[0] + 1),
                                                                       iter_sizes(s))[1])
        states = []
        for _ in range(3):
            trainer.train(1)
            states.append(copy.deepcopy(trainer.state()))
            repo.commit(states[-1])
        assert listed[0] == 0
        assert hashed[0] <= 3 * (3 + 1) * 2  # per commit: the kept and the doomed one (two spellings of a step)
        monkeypatch.undo()
        assert [info.pruned for info in repo.log()] == [False] * 3 + [True] * 41
        for cid, state in zip([c.id for c in repo.log()][:3], reversed(states)):
            assert_same(state, repo.checkout(cid))
        assert fsck(repo).ok
        assert gc(repo).objects_removed == 0  # what the prunes freed went with them, though no store was listed


def test_the_policy_after_a_commit_still_refuses_a_kept_commit_whose_rows_were_lost(tmp_path):
    """The check limited to kept commits still compares their manifests with their rows: lost rows delete nothing."""
    states = [{"w": torch.full((3000,), float(i)), "b": torch.zeros(8)} for i in range(4)]
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit(state) for state in states[:3]]
    _with_policy(tmp_path, "keep_last = 3")
    with Repository.open(tmp_path) as repo:
        with repo.db.write() as tx:
            tx.execute(f"DELETE FROM commit_tensors WHERE commit_id = '{cids[2]}'")
        try:
            repo.commit(states[3])
        except RetentionError as exc:
            assert "prune refused to delete anything: the repository is damaged" in str(exc)
        else:
            raise AssertionError("the policy pruned a repository whose kept commit lost its rows")
        assert not any(info.pruned for info in repo.log())
        with repo.db.write() as tx:
            tx.executemany("INSERT INTO commit_tensors (commit_id, tensor_id) VALUES (?, ?)",
                           [(cids[2], e.tensor) for e in repo.manifest(cids[2]).entries.values()])
        for cid, state in zip(cids, states):
            assert_same(state, repo.checkout(cid))


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

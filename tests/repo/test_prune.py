"""`ckpt prune`: which commits it keeps, that they restore bit for bit afterwards, and that a kill loses nothing.

The selection rules are checked against a reference written differently (counting positions
instead of slicing one chain) over random small histories. The round trips run a real training
run's commits (tests/conftest.py's Trainer), lossless and lossy: every kept commit must check
out exactly as it did before the prune, fsck --full must pass, and the store must shrink. The
kill campaign stops `ckpt prune` with SIGKILL at each durable step and at random moments
(CKPT_PRUNE_KILLS of them, default 2; docs/reliability.md has a longer run) and checks that
every kept commit still restores bit-exact, fsck is clean, and running prune again completes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.errors import CkptError, NothingToCommitError, PrunedCommitError, UnknownMetricError
from ckptstore.policy import EncodingSettings
from ckptstore.repo import fsck, gc, remote
from ckptstore.repo.config import RepoConfig, RetentionPolicy
from ckptstore.repo.pruning import prune
from ckptstore.repo.retention import History, doomed
from tests.conftest import Trainer, assert_same, ckpt_env, ckpt_here, wait_until_held

ROOT = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("CKPT_PRUNE_KILLS") or 2)
COMMITS = 8
POLICY = RetentionPolicy(keep_last=2, keep_every=3)
KEPT_POSITIONS = {0, 3, 6, 7}  # of COMMITS commits on main, under POLICY
LONG_CHAINS = EncodingSettings(max_chain=6)  # kept commits are residuals on removed ones more often


# ---------------------------------------------------------------------- selection rules
@st.composite
def histories(draw):
    """A random small DAG: commits added one at a time to existing or new branches, some merges, tags, metrics."""
    parents: dict[str, list[str]] = {}
    branches: dict[str, str] = {}
    metrics: dict[str, dict[str, float]] = {}
    for n in range(draw(st.integers(1, 24))):
        cid = f"c{n:02d}"
        if not branches or draw(st.integers(0, 5)) == 0:
            name = f"b{len(branches)}"
            start = draw(st.sampled_from(sorted(parents))) if parents and draw(st.booleans()) else None
        else:
            name = draw(st.sampled_from(sorted(branches)))
            start = branches[name]
        parents[cid] = [start] if start else []
        if start and len(parents) > 2 and draw(st.integers(0, 4)) == 0:
            parents[cid].append(draw(st.sampled_from(sorted(set(parents) - {cid, start}))))
        branches[name] = cid
        if draw(st.booleans()):
            metrics[cid] = {"loss": draw(st.sampled_from([0.5, 1.0, 2.0, float("nan")]))}
    tags = set(draw(st.lists(st.sampled_from(sorted(parents)), max_size=3)))
    pruned = set(draw(st.lists(st.sampled_from(sorted(parents)), max_size=3))) - set(branches.values()) - tags
    return branches, parents, metrics, tags, pruned


def _reference(branches, parents, metrics, tags, pruned, policy: RetentionPolicy) -> tuple[set[str], bool]:
    """What must go, by counting (a commit's age is how many first-parent steps separate it from its branch's
    tip), and whether keep_best must refuse: commits would go and no commit has a finite value of the metric."""
    def age(tip, cid):
        steps, current = 0, tip
        while current != cid:
            current, steps = (parents[current] or [None])[0], steps + 1
            if current is None:
                return None
        return steps

    def height(cid):  # first-parent ancestors below it
        return 0 if not parents[cid] else 1 + height(parents[cid][0])

    keep = set(branches.values()) | (tags if policy.keep_tagged else set())
    on_chains, unranked = set(), set()  # unranked: chains of branches that have not logged the metric yet
    for tip in branches.values():
        chain = [c for c in parents if age(tip, c) is not None]
        on_chains |= set(chain)
        keep |= {c for c in chain if age(tip, c) < policy.keep_last}
        keep |= {c for c in chain if policy.keep_every and height(c) % policy.keep_every == 0}
        scored = [metrics[c]["loss"] for c in chain if c in metrics and c not in pruned
                  and metrics[c]["loss"] == metrics[c]["loss"]]
        if policy.keep_best and scored:
            best = max(scored) if policy.keep_best.endswith(":max") else min(scored)
            tied = [c for c in chain if c in metrics and c not in pruned and metrics[c]["loss"] == best]
            keep.add(min(tied, key=height))  # one of those tied: the oldest, lowest on the chain
        elif policy.keep_best and not policy.keep_last and not policy.keep_every:
            unranked |= set(chain)
    gone = on_chains - keep - pruned
    logged = any(m["loss"] == m["loss"] for m in metrics.values())  # NaN is not a value
    return gone - unranked, bool(policy.keep_best and gone and not logged)


@settings(max_examples=200, deadline=None)
@given(histories(), st.integers(0, 4), st.integers(0, 5), st.sampled_from(["", "loss", "loss:max"]), st.booleans())
def test_selection_matches_an_independent_reference(history, keep_last, keep_every, keep_best, keep_tagged):
    branches, parents, metrics, tags, pruned = history
    policy = RetentionPolicy(keep_last, keep_every, keep_best, keep_tagged)
    protected = set(branches.values()) | (tags if keep_tagged else set())
    expected, refused = _reference(branches, parents, metrics, tags, pruned, policy)
    if refused:
        with pytest.raises(UnknownMetricError, match="keep_best: no commit has"):
            doomed(History(branches, parents, metrics, protected, pruned), policy)
    else:
        assert doomed(History(branches, parents, metrics, protected, pruned), policy) == expected


def test_positions_count_from_the_first_commit_so_a_second_prune_keeps_what_the_first_kept():
    parents = {f"c{i}": [f"c{i - 1}"] if i else [] for i in range(10)}
    policy = RetentionPolicy(keep_last=3, keep_every=4)
    first = doomed(History({"main": "c9"}, parents, {}, {"c9"}), policy)
    assert first == {"c1", "c2", "c3", "c5", "c6"}
    parents.update({"c10": ["c9"], "c11": ["c10"]})  # two more commits, then the policy again
    again = doomed(History({"main": "c11"}, parents, {}, {"c11"}, pruned=first), policy)
    assert again == {"c7"}  # c8 is a multiple of 4; c9-c11 are the last three


def test_a_tag_alone_does_not_protect_its_commit(tmp_path):
    """Without keep_tagged a tagged old commit goes; with it, it stays (mutation audit round 10)."""
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit({"w": torch.full((10,), float(n))}) for n in range(3)]
        repo.tag("v1", cids[0])
        assert prune(repo, RetentionPolicy(keep_last=1), dry_run=True).pruned == sorted(cids[:2])
        assert prune(repo, RetentionPolicy(keep_last=1, keep_tagged=True), dry_run=True).pruned == [cids[1]]


# ---------------------------------------------------------------------- round trips on a real run
def _train(repo: Repository, commits: int = COMMITS, lossy: str | None = None, **knobs) -> list[str]:
    trainer, cids = Trainer(), []
    for _ in range(commits):
        losses = trainer.train(2)
        cids.append(repo.commit(trainer.state(), step=trainer.step, metrics={"loss": losses[-1]}, lossy=lossy,
                                **knobs))
    return cids


def _snapshot(repo: Repository, cids: list[str]) -> dict:
    return {cid: repo.checkout(cid) for cid in cids}


def _check_kept(repo: Repository, cids: list[str], before: dict, kept: set[str]) -> None:
    for cid in cids:
        if cid in kept:
            assert_same(before[cid], repo.checkout(cid))
        else:
            with pytest.raises(PrunedCommitError, match="ckpt prune"):
                repo.checkout(cid)
    report = fsck(repo, full=True)
    assert report.ok and not report.broken_commits and report.unreferenced_objects == 0, report


@pytest.mark.both_backends
def test_prune_frees_space_and_every_kept_commit_restores_bit_exact(repo):
    cids = _train(repo)
    before = _snapshot(repo, cids)
    report = prune(repo, POLICY)
    kept = {cids[i] for i in KEPT_POSITIONS}
    assert set(report.pruned) == set(cids) - kept
    assert report.tensors_reencoded > 0  # kept commits 4 and 8 were residuals on removed ones
    assert report.bytes_after < report.bytes_before
    assert report.bytes_after == sum(size for _, size in repo.store.iter_sizes())
    _check_kept(repo, cids, before, kept)
    assert [c.pruned for c in repo.log()] == [cids[i] not in kept for i in reversed(range(COMMITS))]
    again = prune(repo, POLICY)  # nothing left to do
    assert again.pruned == [] and again.tensors_reencoded == 0 and again.bytes_after == report.bytes_after


@pytest.mark.parametrize("level", ["balanced"])
def test_lossy_commits_keep_their_exact_reconstruction(tmp_path, level):
    with Repository.init(tmp_path, encoding=LONG_CHAINS) as repo:
        cids = _train(repo, lossy=level)
        before = _snapshot(repo, cids)
        kept = {cids[i] for i in KEPT_POSITIONS}
        shown = {cid: repo.show(cid)["fidelity"] for cid in kept}
        report = prune(repo, POLICY)
        assert report.tensors_reencoded > 0 and report.bytes_after < report.bytes_before
        _check_kept(repo, cids, before, kept)
        assert {cid: repo.show(cid)["fidelity"] for cid in kept} == shown  # same bits: the same measured figures
        trainer = Trainer()
        trainer.train(30)
        after = repo.commit(trainer.state(), lossy=level)  # a lossy commit on top of re-encoded parents
        assert repo.checkout(after)["step"] == 30


def _files(root: Path) -> dict[str, str]:
    """Every file under .ckpt by path, with its content hash (the database by its rows, not its pages)."""
    found = {}
    for path in sorted((root / ".ckpt").rglob("*")):
        if path.is_file() and path.name not in ("ckpt.db-wal", "ckpt.db-shm", "lock", "lock.gate"):
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    with sqlite3.connect(root / ".ckpt" / "ckpt.db") as db:
        found["rows"] = hashlib.sha256("\n".join(db.iterdump()).encode()).hexdigest()
    return found


def test_dry_run_changes_nothing_and_says_what_would_go(tmp_path):
    with Repository.init(tmp_path) as repo:
        cids = _train(repo, commits=4)
        state = _files(tmp_path)
        report = prune(repo, RetentionPolicy(keep_last=2), dry_run=True)
        assert report.pruned == sorted(cids[:2]) and report.bytes_after is None
        assert _files(tmp_path) == state
        assert not any(c.pruned for c in repo.log())
        losses = {cid: repo.commit_info(cid).metrics["loss"] for cid in cids}
        best = prune(repo, RetentionPolicy(keep_best="loss:max"), dry_run=True)  # the tip and the worst loss stay
        assert set(best.pruned) == set(cids) - {cids[-1], max(losses, key=losses.get)}


def test_cli_prune_log_show_and_refusals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Repository.init(tmp_path) as repo:
        cids = _train(repo, commits=5)
        repo.tag("best", cids[1])
    run = CliRunner().invoke
    result = run(cli, ["prune"])
    assert result.exit_code != 0 and "needs a rule" in str(result.exception)
    result = run(cli, ["prune", "--keep-last", "1", "--keep-tagged", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert sorted(data["pruned"]) == sorted([cids[0], cids[2], cids[3]]) and data["bytes_after"] < data["bytes_before"]
    assert "Pruned: " in run(cli, ["log"]).output
    assert "[pruned]" in run(cli, ["log", "--graph"]).output
    shown = json.loads(run(cli, ["show", cids[0], "--json"]).output)
    assert shown["pruned"] is True and shown["tensors"] == []
    assert "pruned by `ckpt prune`" in run(cli, ["show", cids[0]]).output
    assert "stored - (pruned)" in run(cli, ["show", cids[0]]).output
    assert "pruned" not in run(cli, ["show", cids[1]]).output
    stats = json.loads(run(cli, ["stats", "--json"]).output)  # pruned rows stay, marked; the totals leave them out
    assert [row["pruned"] for row in stats["commits"]] == [c in data["pruned"] for c in cids]
    assert stats["raw_bytes"] == sum(row["raw_bytes"] for row in stats["commits"] if not row["pruned"])
    assert stats["reachable_commits"] == 2 and "total: 2 commits (3 more pruned)" in run(cli, ["stats"]).output
    result = run(cli, ["checkout", cids[2][:12], "-o", str(tmp_path / "x.pt")])
    assert result.exit_code != 0 and isinstance(result.exception, PrunedCommitError)
    result = run(cli, ["branch", "retry", cids[2][:12]])  # a dead end: no commit could go on it
    assert result.exit_code == 1 and "branch from a kept commit" in str(result.exception)
    assert "retry" not in run(cli, ["branch"]).output


def test_config_policy_prunes_only_after_a_commit_succeeds(tmp_path):
    with Repository.init(tmp_path) as repo:
        trainer = Trainer()
        for _ in range(4):
            trainer.train(1)
            repo.commit(trainer.state())
    config_path = tmp_path / ".ckpt" / "config.toml"
    config = RepoConfig.load(config_path)
    config.retention = RetentionPolicy(keep_last=2)
    config.save(config_path)
    assert RepoConfig.load(config_path).retention == RetentionPolicy(keep_last=2)
    with Repository.open(tmp_path) as repo:
        with pytest.raises(NothingToCommitError):
            repo.commit(trainer.state())
        assert not any(c.pruned for c in repo.log())  # a failed commit prunes nothing
        trainer.train(1)
        repo.commit(trainer.state())
        assert [c.pruned for c in repo.log()] == [False, False, True, True, True]
        assert fsck(repo).ok


@pytest.mark.parametrize("line", ["keep_last = 2.5", "keep_every = true", "keep_best = 1", 'keep_tagged = "false"',
                                  "keep_lst = 2", 'keep_best = "loss:MAX"'])
def test_retention_settings_of_the_wrong_type_are_one_clear_line_and_prune_nothing(tmp_path, line):
    with Repository.init(tmp_path) as repo:
        for seed in range(3):
            repo.commit({"w": torch.full((8,), float(seed))}, metrics={"loss": float(seed)})
    config = tmp_path / ".ckpt" / "config.toml"
    config.write_text(config.read_text() + f"\n[retention]\n{line}\n")
    result = ckpt_here(tmp_path, "prune", "--keep-last", "1", "--dry-run")
    assert result.returncode == 1 and "retention" in result.stderr and "unexpected" not in result.stderr
    assert "RetentionPolicy" not in result.stderr and line.split(" =")[0] in result.stderr  # names the key
    config.write_text(config.read_text().replace(line, ""))
    with Repository.open(tmp_path) as repo:
        assert not any(c.pruned for c in repo.log())


def test_keep_best_on_a_metric_no_commit_has_refuses_and_prunes_nothing(tmp_path):
    with Repository.init(tmp_path) as repo:
        for seed in range(3):
            repo.commit({"w": torch.full((8,), float(seed))}, metrics={"loss": float(seed)})
        with pytest.raises(UnknownMetricError, match="no commit has .* metric 'los'"):
            prune(repo, RetentionPolicy(keep_best="los"))
        assert len(prune(repo, RetentionPolicy(keep_best="loss")).pruned) == 1  # the tip and the best stay
        assert [c.pruned for c in repo.log()] == [False, True, False]


def test_a_retention_policy_on_a_metric_not_logged_yet_lets_commits_succeed_and_prunes_once_it_is(tmp_path):
    with Repository.init(tmp_path) as repo:
        repo.config.retention = RetentionPolicy(keep_last=1, keep_best="eval_loss")
        with pytest.warns(RuntimeWarning, match="names metric .eval_loss., which no commit records yet") as told:
            for seed in range(3):  # saves before the first evaluation: the metric is not there yet
                repo.commit({"w": torch.full((8,), float(seed))}, metrics={"loss": float(seed)})
        assert len(told) == 1  # once, not at each commit: a misspelt name would otherwise keep everything unsaid
        assert not any(c.pruned for c in repo.log())
        repo.commit({"w": torch.full((8,), 9.0)}, metrics={"eval_loss": 0.5})
        assert [c.pruned for c in repo.log()] == [False, True, True, True]


def test_keep_best_prunes_nothing_of_a_branch_that_has_not_logged_its_metric_though_another_has(tmp_path):
    """The 'no commit has this metric' guard counted the whole repository: once another branch logged it, a branch
    that had not yet lost every commit but its tip, which alone it would have been refused (mutation audit round 10,
    high: a [retention] policy deletes them after each commit)."""
    with Repository.init(tmp_path) as repo:
        main = [repo.commit({"w": torch.full((8,), float(n))}, metrics={"train_loss": 1.0 / (n + 1)}) for n in range(4)]
        with pytest.raises(UnknownMetricError):
            prune(repo, RetentionPolicy(keep_best="val_loss"), dry_run=True)
        repo.branch("exp", main[0])
        evaluated = [repo.commit({"w": torch.full((8,), 7.0 + n)}, metrics={"val_loss": loss}, branch="exp")
                     for n, loss in enumerate((0.9, 0.5, 0.7))]
        with_last = prune(repo, RetentionPolicy(keep_last=1, keep_best="val_loss"), dry_run=True)
        assert set(main[1:3]) <= set(with_last.pruned)  # keep_last still decides there (reader 38)
        report = prune(repo, RetentionPolicy(keep_best="val_loss"))
        assert set(report.pruned) == {evaluated[0]}  # exp: its best and its tip stay; main: all of it
        assert not any(repo.commit_info(cid).pruned for cid in main)


def test_a_base_re_encoded_after_chunk_bytes_changed_keeps_its_chunks_for_the_tensors_on_it(tmp_path):
    """Re-encoded with today's [encoding] chunk_bytes, the kept tip's residuals no longer lined up with it."""
    generator = torch.Generator().manual_seed(0)
    weights, states = torch.randn(300_000, generator=generator), []
    with Repository.init(tmp_path, encoding=EncodingSettings(max_chain=8, chunk_bytes=1 << 20)) as repo:
        for step in range(4):
            weights = weights + 0.01 * torch.randn(300_000, generator=generator)
            states.append({"w": weights.clone(), "step": step})
            repo.commit(states[-1], step=step)
    config = RepoConfig.load(tmp_path / ".ckpt" / "config.toml")
    config.encoding = EncodingSettings(max_chain=8, chunk_bytes=1 << 16)  # tuned later, as the docs allow
    config.save(tmp_path / ".ckpt" / "config.toml")
    with Repository.open(tmp_path) as repo:
        assert prune(repo, RetentionPolicy(keep_last=2)).tensors_reencoded
        for back, state in ((0, states[3]), (1, states[2])):
            assert_same(state, repo.checkout(f"main~{back}"))
        assert fsck(repo, full=True).ok


def test_a_checkout_that_read_its_records_before_a_prune_still_restores_bit_exact(tmp_path):
    with Repository.init(tmp_path, encoding=EncodingSettings(max_chain=6)) as repo:
        cids = _train(repo, commits=4)
        want = repo.checkout(cids[-1])
    release = tmp_path / "release"
    env = ckpt_env(CKPT_WAIT_AT=f"checkout:records-read={release}")
    reading = subprocess.Popen([sys.executable, "-m", "ckptstore", "checkout", cids[-1], "-o", "tip.pt"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, reading)
        pruned = ckpt_here(tmp_path, "prune", "--keep-last", "1")  # re-encodes the tip's chains, deletes their objects
        assert pruned.returncode == 0 and "re-encoded" in pruned.stdout, pruned.stdout + pruned.stderr
    finally:
        release.touch()
    assert reading.wait(timeout=120) == 0, reading.communicate()
    assert_same(want, torch.load(tmp_path / "tip.pt", weights_only=False))  # written by this test just now (RNG state)


@pytest.mark.parametrize("point", ["checkout:records-read", "checkout:resolved"])  # resolved: helper 290
@pytest.mark.parametrize("remover", [["prune", "--keep-last", "1"], ["gc", "--prune"]])
def test_a_checkout_of_a_commit_removed_while_it_runs_says_so_not_damage(tmp_path, remover, point):
    with Repository.init(tmp_path) as repo:
        cids = _train(repo, commits=3)
        if remover[0] == "gc":  # gc --prune removes an unreachable commit: one on a deleted branch
            cids = [repo.commit(Trainer(seed=9).state(), branch="side")]
            repo.delete_branch("side")
    release = tmp_path / "release"
    env = ckpt_env(CKPT_WAIT_AT=f"{point}={release}")
    reading = subprocess.Popen([sys.executable, "-m", "ckptstore", "checkout", cids[0], "-o", "old.pt"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, reading)
        removed = ckpt_here(tmp_path, *remover)
        assert removed.returncode == 0, removed.stdout + removed.stderr
    finally:
        release.touch()
    _, err = reading.communicate(timeout=120)
    assert reading.returncode == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "removed by `ckpt prune` or `ckpt gc --prune` while this command ran" in err, err
    assert "damaged" not in err and "fsck" not in err, err
    assert ckpt_here(tmp_path, "fsck").returncode == 0  # and indeed nothing is


def test_a_pruned_history_pushes_and_clones(tmp_path):
    with Repository.init(tmp_path / "work") as repo:
        cids = _train(repo, commits=4)
        before = _snapshot(repo, cids)
        prune(repo, RetentionPolicy(keep_last=2))
        Repository.init(tmp_path / "hub").close()
        remote.add(repo, "origin", str(tmp_path / "hub"))
        remote.push(repo, "origin")
    with Repository.open(tmp_path / "hub") as hub:
        _check_kept(hub, cids, before, set(cids[2:]))


# ---------------------------------------------------------------------- SIGKILL campaign
def _prune_process(trial: Path, env: dict | None = None) -> subprocess.Popen:
    full = ckpt_env(**(env or {}))
    return subprocess.Popen([sys.executable, "-m", "ckptstore", "prune", "--keep-last", "2", "--keep-every", "3"],
                            cwd=trial, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def killed_template(tmp_path_factory):
    """A repository of COMMITS commits with long chains (so prune re-encodes), and what each commit restores to."""
    work = tmp_path_factory.mktemp("prune-kill") / "template"
    with Repository.init(work, encoding=LONG_CHAINS) as repo:
        cids = _train(repo)
        before = _snapshot(repo, cids)
    timing = work.with_name("timing")  # how long a whole prune runs, start-up included: kills spread over it
    shutil.copytree(work, timing)
    start = time.perf_counter()
    assert _prune_process(timing).wait(timeout=120) == 0
    duration = time.perf_counter() - start
    shutil.rmtree(timing)
    return work, cids, before, duration


def _checkout(repo: Repository, cid: str):
    return repo.checkout(cid)


def _lost(trial: Path, cids: list[str], before: dict, restore: Callable = _checkout) -> list[str]:
    """What a killed prune lost: a kept commit not restoring bit-exact, damage fsck finds (garbage is not loss).

    `restore(repo, cid)` is what `before` holds of each commit (default: its in-memory checkout).
    """
    problems = []
    with Repository.open(trial) as repo:
        report = fsck(repo, full=True)
        if not report.ok or report.broken_commits:
            problems.append(f"fsck: {report}")
        for i, cid in enumerate(cids):
            try:
                assert_same(before[cid], restore(repo, cid))
            except PrunedCommitError:
                if i in KEPT_POSITIONS:
                    problems.append(f"kept commit {i} was pruned")
            except (CkptError, AssertionError) as exc:
                problems.append(f"commit {i}: {exc}")
    return problems


def _trial(template, tmp_path: Path, name: str, point: str | None = None, delay: float | None = None,
           restore: Callable = _checkout) -> dict:
    """Kill a prune of a copy of `template` (at fault `point`, or after `delay` s), check it, rerun it, check again."""
    work, cids, before, _ = template
    trial = tmp_path / name
    shutil.copytree(work, trial)
    proc = _prune_process(trial, {"CKPT_CRASH_AT": point} if point else None)
    if delay is not None:
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    killed = proc.returncode == -signal.SIGKILL
    problems = _lost(trial, cids, before, restore)
    rerun = _prune_process(trial)
    out, err = rerun.communicate(timeout=120)
    if rerun.returncode != 0:
        problems.append(f"rerun failed: {out}{err}")
    problems += _lost(trial, cids, before, restore)
    with Repository.open(trial) as repo:
        if fsck(repo).unreferenced_objects or {c for c in cids if repo.commit_info(c).pruned} != {
                cids[i] for i in range(COMMITS) if i not in KEPT_POSITIONS}:
            problems.append("the rerun did not finish the prune")
    shutil.rmtree(trial)
    report = os.environ.get("CKPT_PRUNE_REPORT")
    if report:
        with open(report, "a") as out_file:
            out_file.write(json.dumps({"point": point, "delay": delay, "killed": killed, "lost": problems}) + "\n")
    return {"killed": killed, "problems": problems}


@pytest.mark.parametrize("point", ["prune:objects-written", "prune:db-committed", "gc:object-deleted@2"])
def test_kill_at_each_durable_step_loses_nothing(killed_template, tmp_path, point):
    result = _trial(killed_template, tmp_path, "trial", point=point)
    assert result["killed"] and result["problems"] == []


def test_kill_at_random_moments_loses_nothing(killed_template, tmp_path):
    rng = random.Random(int(os.environ.get("CKPT_PRUNE_SEED") or 2026))
    delays = [rng.uniform(0.2, 1.0) * killed_template[3] for _ in range(KILLS)]
    results = [_trial(killed_template, tmp_path, f"trial{n}", delay=delay) for n, delay in enumerate(delays)]
    assert [r["problems"] for r in results if r["problems"]] == []


@pytest.mark.parametrize("point", ["prune:objects-written", "prune:db-committed"])
def test_kill_on_postgresql_metadata_loses_nothing(tmp_path, postgres_url, point):
    """The same on a shared database: its transaction and its advisory lock, held by a process that dies."""
    with Repository.init(tmp_path, metadata_url=postgres_url, encoding=LONG_CHAINS) as repo:
        cids = _train(repo)
        before = _snapshot(repo, cids)
    proc = _prune_process(tmp_path, {"CKPT_CRASH_AT": point})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert _lost(tmp_path, cids, before) == []
    rerun = _prune_process(tmp_path)
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, out + err
    assert _lost(tmp_path, cids, before) == []
    with Repository.open(tmp_path) as repo:
        assert fsck(repo).unreferenced_objects == 0
        assert {c for c in cids if repo.commit_info(c).pruned} == {cids[i] for i in range(COMMITS)
                                                                   if i not in KEPT_POSITIONS}


def test_a_failed_policy_prune_says_to_run_prune_not_the_command_again():
    """Running the commit again finds nothing changed and prunes nothing: the advice is `ckpt prune`."""
    from ckptstore.errors import RetentionError, disk_full

    error = str(RetentionError("a" * 64, disk_full("writing /data/run.v2/x; 2024")))
    assert error.startswith("commit aaaaaaaaaaaa was recorded") and "writing /data/run.v2/x; 2024" in error
    assert error.endswith("To finish the prune, run `ckpt prune` once that is fixed (committing again finds nothing "
                          "changed; the next commit's policy prunes again)")


def test_prune_removes_nothing_while_a_kept_commits_manifest_or_object_is_lost(tmp_path):
    """Pruning down to a broken tip would leave no commit that restores: it refuses, as gc does on damage."""
    states = [{"w": torch.randn(20_000, generator=torch.Generator().manual_seed(i)), "step": i} for i in range(4)]
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit(state, message=f"c{i}") for i, state in enumerate(states)]
        manifest = repo.commit_info(cids[-1]).manifest_object
        lost = repo.store.path_of(manifest)
        kept = lost.read_bytes()
        lost.unlink()
        with pytest.raises(CkptError, match=f"prune refused to delete anything.*manifest {manifest}"):
            prune(repo, RetentionPolicy(keep_last=1))
        lost.write_bytes(kept)
        assert not any(info.pruned for info in repo.log())
        for cid, state in zip(cids, states):
            assert_same(state, repo.checkout(cid))


def test_a_dry_run_refuses_a_damaged_repository_as_the_prune_would(tmp_path):
    """The dry run listed commits that the prune then refused to remove (mutation audit round 10)."""
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit({"w": torch.randn(20_000, generator=torch.Generator().manual_seed(i))}) for i in range(3)]
        repo.store.path_of(repo.commit_info(cids[-1]).manifest_object).unlink()
        with pytest.raises(CkptError, match="prune refused to delete anything"):
            prune(repo, RetentionPolicy(keep_last=1), dry_run=True)


POLICY_PRUNE_ON_A_FULL_DISK = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, 1 << 19))  # files past 512 KiB fail, as on a full disk
sys.argv = ["ckpt", "commit", "state.pt", "-m", "second"]
runpy.run_module("ckptstore", run_name="__main__")
"""


def test_a_full_disk_in_the_policy_prune_after_a_commit_says_the_commit_was_recorded(tmp_path):
    """The OS's own error escaped the policy as itself, and `ckpt commit` said "nothing was lost: the write is undone".

    The commit's residual is small; the prune re-keyframes it (1.2 MB), which the full disk refuses.
    """
    weight = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    torch.save({"w": weight}, tmp_path / "state.pt")
    assert ckpt_here(tmp_path, "init").returncode == 0
    assert ckpt_here(tmp_path, "commit", "state.pt", "-m", "first").returncode == 0
    with open(tmp_path / ".ckpt" / "config.toml", "a") as config:
        config.write("\n[retention]\nkeep_last = 1\n")
    weight[:100] += 1.0
    torch.save({"w": weight}, tmp_path / "state.pt")
    ended = subprocess.run([sys.executable, "-c", POLICY_PRUNE_ON_A_FULL_DISK], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env=ckpt_env())
    assert ended.returncode == 1 and "Traceback" not in ended.stderr
    assert ended.stderr.startswith("error: commit ") and ("was recorded, but the [retention] policy's prune after "
                                                          "it failed: a file reached the largest size") in ended.stderr
    with Repository.open(tmp_path) as repo:
        assert [info.message for info in repo.log()] == ["second", "first"]
        assert ended.stdout.startswith(f"[{repo.resolve('HEAD')[:12]}] second  (")  # the id, as on success
        assert not any(info.pruned for info in repo.log()) and fsck(repo).ok
        assert torch.equal(repo.checkout("HEAD")["w"], weight)
    assert ckpt_here(tmp_path, "prune").returncode == 0  # room again: the prune the error advised
    with Repository.open(tmp_path) as repo:
        assert [info.pruned for info in repo.log()] == [False, True]
        assert torch.equal(repo.checkout("HEAD")["w"], weight)


def test_prune_on_a_full_disk_clears_what_interrupted_writes_left_and_says_so_if_still_full(tmp_path):
    """The full disk's read-only database refused prune before it cleared `.ckpt/tmp`: the leftovers stayed, and
    the refusal never said where the room had gone (auditor helper 281)."""
    from ckptstore.errors import ReadOnlyRepoError
    from tests.test_cli_errors import fill, small_disk

    with small_disk(tmp_path / "disk", "3m") as mounted:
        if not mounted:
            pytest.skip("needs a tmpfs to fill (root)")
        root = tmp_path / "disk" / "repo"
        with Repository.init(root) as repo:
            for step in range(2):
                repo.commit({"w": torch.full((1000,), float(step))})
        (root / ".ckpt" / "tmp" / "leftover").write_bytes(b"x")  # freeing its page leaves the disk full still
        fill(tmp_path / "disk" / "filler")
        with Repository.open(root) as repo:
            with pytest.raises(ReadOnlyRepoError, match=r"prune first removed what interrupted writes left in "
                                                        r".*/\.ckpt/tmp \(1 file\(s\), 1 bytes\), and the disk is "
                                                        r"still full"):
                prune(repo, RetentionPolicy(keep_last=1))
        assert not list((root / ".ckpt" / "tmp").iterdir())
        (tmp_path / "disk" / "filler").unlink()
        with Repository.open(root) as repo:
            assert len(prune(repo, RetentionPolicy(keep_last=1)).pruned) == 1  # room again: it prunes


def _drifting_commits(repo: Repository, steps: int) -> tuple[list[str], torch.Tensor]:
    """`steps` commits (c0, c1, ...) of a weight whose next 100 elements move by 1.0 each: a residual chain.

    Returns the commit ids and the last weight.
    """
    weights = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    cids = []
    for step in range(steps):
        weights[step * 100:(step + 1) * 100] += 1.0
        cids.append(repo.commit({"w": weights.clone()}, message=f"c{step}"))
    return cids, weights


def test_kept_residuals_above_a_re_encoded_tensor_record_their_shorter_chains(tmp_path):
    """Their rows kept the depth of the old chain: the next commit counted from it and keyframed early (auditor)."""
    from ckptstore.metadata import tensors as tensor_rows

    with Repository.init(tmp_path, encoding=EncodingSettings(max_chain=8)) as repo:
        cids, weights = _drifting_commits(repo, 6)
        tip = repo.manifest(cids[-1]).entries["w"].tensor
        with repo.db.read() as tx:
            assert tensor_rows.load_records(tx, {tip})[tip].depth == 5  # a residual on each commit before
        prune(repo, RetentionPolicy(keep_last=2))
        with repo.db.read() as tx:
            records = tensor_rows.load_records(tx, {tip})  # and every record down its chain
        links, below = 0, records[tip].base_id
        while below is not None:
            links, below = links + 1, records[below].base_id
        assert records[tip].depth == links == 1  # on c4's tensor, a keyframe now
        assert torch.equal(repo.checkout(cids[-1])["w"], weights) and fsck(repo).ok


def _chain_links(repo: Repository, cid: str) -> tuple[int, int]:
    """The depth recorded for commit `cid`'s tensor w and the links of its chain down to its keyframe."""
    from ckptstore.metadata import tensors as tensor_rows

    tip = repo.manifest(cid).entries["w"].tensor
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {tip})  # and every record down its chain
    links, below = 0, records[tip].base_id
    while below is not None:
        links, below = links + 1, records[below].base_id
    return records[tip].depth, links


def test_a_re_encoded_tensor_whose_old_payload_shares_a_pack_with_removed_ones_gets_one_record(tmp_path):
    """Compaction moved the old payload of a re-encoded tensor too, and its record (old base, old codec) overwrote
    the new one: fsck reported damage (mutation audit round 10)."""
    generator = torch.Generator().manual_seed(0)
    s0, u = torch.randn(50_000, generator=generator), torch.randn(50_000, generator=generator)
    s1 = s0.clone()
    s1[:100] += 1
    u1 = u.clone()
    u1[100:200] += 1
    u2 = u1.clone()
    u2[200:300] += 1
    with Repository.init(tmp_path, encoding=EncodingSettings(max_chain=8)) as repo:
        repo.commit({"s": s0, "u": u})
        repo.commit({"s": s1, "u": u1})  # s1 and u1 share this commit's pack
        tip = repo.commit({"s": s1, "u": u2})  # s1 listed by the kept tip, its payload beside the removed u1
        assert [t["depth"] for t in repo.show(tip)["tensors"]] == [1, 2]
        assert prune(repo, RetentionPolicy(keep_last=1)).tensors_reencoded == 2
        out = repo.checkout(tip)
        assert torch.equal(out["s"], s1) and torch.equal(out["u"], u2)
        found = fsck(repo, full=True)
        assert found.ok and found.unreferenced_objects == 0, found


def test_a_tensor_re_encoded_onto_a_kept_tensor_whose_chain_shortened_records_its_true_depth(tmp_path):
    """w4 is re-encoded onto w2 while w2's row still says depth 2 (w1 below it becomes a keyframe in the same
    prune): w4 was recorded at depth 3, not 2 (mutation audit round 10)."""
    with Repository.init(tmp_path, encoding=EncodingSettings(max_chain=8)) as repo:
        cids, weights = _drifting_commits(repo, 5)
        repo.tag("one", cids[1])
        repo.tag("two", cids[2])
        assert sorted(prune(repo, RetentionPolicy(keep_tagged=True)).pruned) == sorted([cids[0], cids[3]])
        assert _chain_links(repo, cids[4]) == (2, 2)
        assert torch.equal(repo.checkout(cids[4])["w"], weights)
        found = fsck(repo, full=True)
        assert found.ok, found


def test_a_re_encoded_residual_never_passes_max_chain(tmp_path):
    """w5 goes onto w3 (depth 3) once c4 is removed: under max_chain = 3 that must be a keyframe (which does not
    pay, so w5 is left as it was), never a residual at depth 4 (mutation audit round 10)."""
    with Repository.init(tmp_path, encoding=EncodingSettings(max_chain=5)) as repo:
        cids, weights = _drifting_commits(repo, 6)
        for n in range(4):
            repo.tag(f"t{n}", cids[n])
    config = tmp_path / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace("max_chain = 5", "max_chain = 3"))
    with Repository.open(tmp_path) as repo:
        report = prune(repo, RetentionPolicy(keep_tagged=True))
        assert report.pruned == [cids[4]] and report.tensors_reencoded == 0
        assert _chain_links(repo, cids[5]) == (5, 5)  # its old chain, through c4's tensor
        assert torch.equal(repo.checkout(cids[5])["w"], weights)


def test_a_lossy_tip_whose_lossless_re_encoding_would_not_pay_is_left_as_it_is(tmp_path):
    """The tip's lossy residual, stored again losslessly, outweighs the whole removed chain: it was re-encoded
    anyway, with the integer tensor whose relink pays, and the store grew (mutation audit round 10)."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(400, 300, generator=generator) * 0.02
    counts = torch.randint(0, 1000, (100_000,), generator=generator)  # stored losslessly: its relink pays
    with Repository.init(tmp_path, encoding=EncodingSettings(max_chain=6)) as repo:
        cids = []
        for step in range(4):
            weights = weights + torch.randn(weights.shape, generator=generator) * 1e-3
            counts = counts.clone()
            counts[step * 10:(step + 1) * 10] += 1
            cids.append(repo.commit({"w": weights.clone(), "n": counts.clone()}, lossy="balanced"))
        before = repo.checkout(cids[-1])["w"]
        assert prune(repo, RetentionPolicy(keep_last=1), dry_run=True).tensors_reencoded == 2  # the candidates
        report = prune(repo, RetentionPolicy(keep_last=1))
        assert report.tensors_reencoded == 1 and report.bytes_after <= report.bytes_before
        assert torch.equal(repo.checkout(cids[-1])["w"], before)


def test_a_detached_commit_whose_policy_prune_failed_still_says_it_is_on_no_branch(tmp_path):
    """The note went with the summary line's old place: a commit on no branch said nothing of it (reader)."""
    assert ckpt_here(tmp_path, "init").returncode == 0
    for value in (0.0, 1.0):
        torch.save({"w": torch.full((300_000,), value)}, tmp_path / "c.pt")
        assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    with open(tmp_path / ".ckpt" / "config.toml", "a") as config:
        config.write("\n[retention]\nkeep_last = 1\n")
    assert ckpt_here(tmp_path, "checkout", "HEAD~1").returncode == 0  # detached
    torch.save({"w": torch.full((300_000,), 2.0)}, tmp_path / "c.pt")
    ended = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "c.pt", "-m", "off"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120,
                           env=ckpt_env(CKPT_FAIL_AT="prune:objects-written"))
    assert ended.returncode == 1 and "was recorded, but the [retention] policy's prune" in ended.stderr
    assert "note: HEAD is detached, so this commit is on no branch" in ended.stdout


def test_a_prune_whose_clean_up_finds_the_disk_full_says_it_was_recorded(tmp_path, monkeypatch):
    """gc's write after the prune found the disk full: "nothing was lost: the interrupted write is undone", while
    the commits were pruned; the rerun said it removed 0 commits (auditor)."""
    import errno

    from ckptstore.repo import maintenance

    def full(_repo, *_args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".ckpt" / "ckpt.db-wal"))

    with Repository.init(tmp_path) as repo:
        cids = [repo.commit({"w": torch.full((3000,), float(i))}) for i in range(3)]
        monkeypatch.setattr(maintenance, "collect", full)
        with pytest.raises(CkptError, match=r"^the prune of 2 commit\(s\) was recorded, but its clean-up failed: the "
                                            r"disk is full \(No space left on device .*\); run `ckpt gc` to delete"):
            prune(repo, RetentionPolicy(keep_last=1))
        monkeypatch.undo()
        assert [bool(repo.show(cid).get("pruned")) for cid in cids] == [True, True, False]
        assert fsck(repo).ok


def test_a_prune_that_leaves_more_bytes_in_a_local_repository_names_no_origin(tmp_path, monkeypatch):
    """Objects left in place for want of permission: "read from the origin to re-encode" of a repository that has
    none (reader)."""
    from ckptstore.objectstore.local import LocalObjectStore

    base = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    with Repository.init(tmp_path) as repo:
        for step in range(3):
            repo.commit({"w": base + step * 1e-3})

    def refuse(store, oid):
        raise PermissionError(13, "Permission denied", str(store.path_of(oid)))

    monkeypatch.setattr(LocalObjectStore, "delete", refuse)
    said = ckpt_here(tmp_path, "prune", "--keep-last", "1")
    assert said.returncode == 0 and "more: the survivors re-encoded)" in said.stdout and "origin" not in said.stdout
    assert "no commit needs were left in place" in said.stderr


def test_keep_best_keeps_one_commit_of_those_tied_the_oldest(tmp_path):
    """A Trainer's training loss logged at step 6 was carried to the saves at 8 and 10: all three were kept as
    "the best" (auditor)."""
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit({"w": torch.full((100,), float(i))}, metrics={"loss": loss})
                for i, loss in enumerate((4.0, 3.5, 3.5, 3.5, 3.9))]
        prune(repo, RetentionPolicy(keep_best="loss"))
        assert [bool(repo.show(cid).get("pruned")) for cid in cids] == [True, False, True, True, False]  # the tip
        cids += [repo.commit({"w": torch.zeros(100)}, metrics={"loss": 3.5}),
                 repo.commit({"w": torch.ones(100)}, metrics={"loss": 9.0})]
        prune(repo, RetentionPolicy(keep_best="loss"))  # a later tie does not take its place
        assert not repo.show(cids[1]).get("pruned") and repo.show(cids[-2]).get("pruned")


def test_keep_best_scores_only_commits_still_stored(tmp_path):
    """The best loss belonged to a commit an earlier prune removed: where keep_best scored it, the best commit still
    stored was removed too (mutation audit: no test held it)."""
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit({"w": torch.full((64,), float(i))}, step=i, metrics={"loss": float(i)})
                for i in range(6)]
        prune(repo, RetentionPolicy(keep_last=2, keep_every=2))  # c0, c2, c4, c5 stay
        prune(repo, RetentionPolicy(keep_last=4))  # c0 (the best loss) goes
        assert repo.show(cids[0]).get("pruned") and not repo.show(cids[2]).get("pruned")
        prune(repo, RetentionPolicy(keep_last=1, keep_best="loss"))
        assert [i for i, cid in enumerate(cids) if not repo.show(cid).get("pruned")] == [2, 5]


def test_commits_a_newer_ckptstore_wrote_are_not_called_damage_by_fsck_prune_or_retention(tmp_path, monkeypatch):
    """An older ckptstore's prune called a newer manifest "damaged" and sent the user to restore a backup, while its
    fsck said ok (mixed-versions auditor). This one, reading manifests of a version it does not know, says so."""
    from ckptstore.repo import manifest as manifest_module

    torch.save({"w": torch.randn(32, 48).t()}, tmp_path / "a.pt")  # a transposed weight: a version 3 manifest
    with Repository.init(tmp_path / "repo") as repo:
        newer = repo.commit(tmp_path / "a.pt")
        repo.commit({"w": torch.ones(4)})
        monkeypatch.setattr(manifest_module, "KNOWN_VERSIONS", (1, 2))  # as the ckptstore of before version 3
        report = fsck(repo)
        assert report.newer == [newer] and not report.damaged_records and not report.ok
        with pytest.raises(CkptError, match=r"prune refused to delete anything: 1 commit\(s\) \(.{12}\) were written "
                                            r"by a newer ckptstore.*Nothing else was found damaged: upgrade"):
            prune(repo, RetentionPolicy(keep_last=1))
        result = CliRunner().invoke(cli, ["--repo", str(repo.root), "fsck"])
        assert result.exit_code == 1 and f"1 commit(s) ({newer[:12]}) were written by a newer" in result.output
        assert "damaged" not in result.output, result.output
        # damage beside them: the damage is what prune says (reader 11)
        kept = repo.manifest(repo.resolve("HEAD")).entries["w"].tensor
        with repo.db.write() as tx:
            tx.execute(f"DELETE FROM tensors WHERE id = '{kept}'")
        with pytest.raises(CkptError, match="prune refused to delete anything: the repository is damaged"):
            prune(repo, RetentionPolicy(keep_last=1))


def test_a_branch_made_at_a_doomed_commit_while_prune_runs_keeps_that_commit(tmp_path):
    """A branch made while prune wrote its objects, at a commit it had chosen to remove: the commit was pruned
    anyway, and the new branch named a commit that no longer restores (mutation audit)."""
    with Repository.init(tmp_path) as repo:
        states = [{"w": torch.full((1000,), float(i)) + torch.randn(1000)} for i in range(3)]
        cids = [repo.commit(state) for state in states]
    release = tmp_path / "release"
    pruning = subprocess.Popen([sys.executable, "-m", "ckptstore", "prune", "--keep-last", "1"], cwd=tmp_path,
                               env=ckpt_env(CKPT_WAIT_AT=f"prune:objects-written={release}"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, pruning)  # it has chosen cids[0] and cids[1] to go
        made = ckpt_here(tmp_path, "branch", "keep", cids[0])
        assert made.returncode == 0, made.stdout + made.stderr
    finally:
        release.touch()
    _, err = pruning.communicate(timeout=120)
    assert pruning.returncode == 3 and "refs moved while prune ran" in err, err
    with Repository.open(tmp_path) as repo:
        assert [repo.commit_info(cid).pruned for cid in cids] == [False, False, False]
        assert_same(repo.checkout("keep"), states[0])
        assert fsck(repo, full=True).ok


def test_a_checkout_whose_commit_prune_removes_meanwhile_leaves_head_where_it_was(tmp_path):
    """HEAD moved onto the pruned commit after the checkout's files were written: fsck called the repository
    damaged and gc and prune refused until `checkout --force` (auditor)."""
    with Repository.init(tmp_path) as repo:
        for i in range(3):
            torch.save({"w": torch.full((1000,), float(i)) + torch.randn(1000)}, tmp_path / "model.pt")
            repo.commit(tmp_path / "model.pt")
        old, tip = repo.log()[-1].id, repo.resolve("main")
    release = tmp_path / "release"
    checking_out = subprocess.Popen([sys.executable, "-m", "ckptstore", "checkout", old], cwd=tmp_path,
                                    env=ckpt_env(CKPT_WAIT_AT=f"checkout:renamed={release}"),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, checking_out)  # the old commit's file is in place; HEAD not moved yet
        with Repository.open(tmp_path) as repo:
            assert old in prune(repo, RetentionPolicy(keep_last=1)).pruned
    finally:
        release.touch()
    _, err = checking_out.communicate(timeout=120)
    assert checking_out.returncode != 0 and "HEAD stays where it was" in err and "Traceback" not in err, err
    with Repository.open(tmp_path) as repo:
        assert repo.head() == ("main", tip)
        assert fsck(repo, full=True).ok


def test_a_dead_checkouts_head_move_to_a_commit_gc_deleted_is_warned_of_not_made(tmp_path):
    from ckptstore.repo import maintenance, refs

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(10)})
        repo.branch("side")
        repo.commit({"w": torch.zeros(10)}, branch="side")
        gone, tip = repo.resolve("side"), repo.resolve("main")
        with pytest.warns(RuntimeWarning, match="leaves 1 commit behind"):
            repo.delete_branch("side")
        maintenance.gc(repo, prune_unreachable=True)
        with pytest.raises(PrunedCommitError, match=r"removed by `ckpt gc --prune` while this checkout"):
            refs.move_head(repo, gone, None)
        with pytest.warns(RuntimeWarning, match="finishing an interrupted checkout"):
            refs.finish_head_move(repo, gone, None)  # as the next open finishes a dead checkout's journal
        assert repo.head() == ("main", tip)


def test_an_in_memory_checkout_whose_commit_gc_removes_after_its_ref_resolved_says_so(tmp_path, monkeypatch):
    """The ref resolved, then `gc --prune` elsewhere removed the commit before its manifest was read: "metadata has no
    commit …; run `ckpt fsck`", damage that was not there (model-based audit helper 290)."""
    from ckptstore import faults
    from ckptstore.errors import PrunedCommitError

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.zeros(5000)})
        side = repo.commit({"w": torch.ones(5000)}, branch="side")
        passing = faults.point

        def another_process_collects(name):
            if name == "checkout:resolved":
                monkeypatch.setattr(faults, "point", passing)
                with Repository.open(tmp_path) as other:
                    other.delete_branch("side")
                    assert gc(other, prune_unreachable=True).commits_removed == 1
            passing(name)

        monkeypatch.setattr(faults, "point", another_process_collects)
        with pytest.raises(PrunedCommitError, match="removed by `ckpt prune` or `ckpt gc --prune` while this command"):
            repo.checkout(side)
        assert fsck(repo).ok


def test_a_tag_of_a_pruned_commit_is_made_and_warned_of_a_branch_there_refused(tmp_path):
    """`ckpt tag` of a pruned commit said only 'Tagged': a user tagging it to keep it (--keep-tagged) learned that
    its checkpoint was gone only at checkout (auditor 438)."""
    with Repository.init(tmp_path) as repo:
        cids = _train(repo, commits=3)
        prune(repo, RetentionPolicy(keep_last=1))
        with pytest.warns(RuntimeWarning, match=rf"commit {cids[0][:12]} was removed by `ckpt prune`: tag 't1'"):
            assert repo.tag("t1", cids[0]) == cids[0]
        with pytest.raises(CkptError, match="a branch there could take no commit"):
            repo.branch("b1", cids[0])
        assert repo.tags() == {"t1": cids[0]} and "b1" not in repo.branches()

"""Remotes between repositories on this disk: push, fetch, pull, clone (lazy too), races and interruptions."""

import contextlib
import re
import shutil
import signal
import sqlite3
import subprocess
import sys

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError, ConflictError, CorruptObjectError, InvalidRefNameError, RefNotFoundError
from ckptstore.repo import fsck, remote
from tests.conftest import assert_same, ckpt_env, ckpt_here, received_lie, unchecked, wait_until_held


def _state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200_000, generator=generator), "b": torch.randn(64, generator=generator), "step": seed}


@pytest.fixture
def pair(tmp_path):
    """A working repository with two commits on main and an empty hub as its remote origin."""
    Repository.init(tmp_path / "hub").close()
    with Repository.init(tmp_path / "work") as work:
        remote.add(work, "origin", str(tmp_path / "hub"))
        cids = [work.commit(_state(seed), message=f"c{seed}") for seed in range(2)]
        yield work, tmp_path / "hub", cids


def _object_files(root):
    return sorted(p.name for p in (root / ".ckpt" / "objects").rglob("*") if p.is_file())


def test_push_sends_what_the_remote_lacks_and_nothing_twice(pair):
    work, hub_path, cids = pair
    first = remote.push(work, "origin")
    assert first.commits == 2 and first.refs_moved == [("main", None, cids[1])]
    assert _object_files(hub_path) == _object_files(work.root)
    assert first.object_bytes == sum(p.stat().st_size for p in (hub_path / ".ckpt" / "objects").rglob("*")
                                     if p.is_file())
    again = remote.push(work, "origin")
    assert (again.commits, again.objects, again.object_bytes) == (0, 0, 0)
    third = work.commit(_state(2))
    assert remote.push(work, "origin").commits == 1
    with Repository.open(hub_path) as hub:
        assert hub.resolve("main") == third and fsck(hub).ok
        for seed, cid in enumerate([*cids, third]):
            assert_same(_state(seed), hub.checkout(cid))
    assert work.resolve("origin/main") == third


def _theirs_pushed(work, hub_path, clone_path):
    """Push `work`'s main, then a commit from another clone on top of it there: the hub's main moved on."""
    remote.push(work, "origin")
    with remote.clone(str(hub_path), clone_path) as other:
        other.commit(_state(7), message="theirs")
        remote.push(other, "origin")
        return other.resolve("main")


def test_a_push_that_drops_remote_commits_is_refused_unless_forced(pair, tmp_path):
    work, hub_path, cids = pair
    theirs = _theirs_pushed(work, hub_path, tmp_path / "other")
    work.commit(_state(8), message="ours")
    with pytest.raises(ConflictError, match="diverged") as refused:
        remote.push(work, "origin")
    advice = str(refused.value)
    assert "pull" not in advice  # pull refuses diverged branches: it only fast-forwards
    assert "`ckpt branch NEW main`, then `ckpt push origin NEW`" in advice and "--force" in advice
    ours = work.resolve("main")
    with pytest.raises(ConflictError, match="diverged") as diverged:
        remote.pull(work, "origin")
    assert work.resolve("main") == ours and work.resolve("origin/main") == theirs
    # its advice, followed (it said "move 'main' yourself", which no command does; advice auditor)
    assert "`ckpt branch theirs origin/main`, then `ckpt checkout theirs`" in str(diverged.value)
    assert work.branch("theirs", "origin/main") == theirs
    work.branch("ours-7", "main")  # the advice, followed: ours arrives beside theirs
    assert remote.push(work, "origin", "ours-7").refs_moved == [("ours-7", None, ours)]
    remote.push(work, "origin", force=True)
    with Repository.open(hub_path) as hub:
        assert hub.resolve("main") == ours and hub.resolve("ours-7") == ours


def test_a_push_from_behind_the_remote_advises_the_pull_that_works(pair, tmp_path):
    work, hub_path, cids = pair
    theirs = _theirs_pushed(work, hub_path, tmp_path / "other")
    with pytest.raises(ConflictError, match="is ahead of yours") as refused:  # work's main: an ancestor of theirs
        remote.push(work, "origin")
    assert "`ckpt pull origin main`" in str(refused.value)
    remote.pull(work, "origin", "main")  # as advised: a fast-forward
    assert work.resolve("main") == theirs


def test_pull_fast_forwards_and_clone_checks_out_bit_exact(pair, tmp_path):
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with remote.clone(str(hub_path), tmp_path / "copy") as copy:
        assert copy.resolve("main") == cids[1] and copy.head()[0] == "main"
        assert_same(_state(0), copy.checkout(cids[0]))
        newer = work.commit(_state(5))
        remote.push(work, "origin")
        report, moved = remote.pull(copy, "origin")
        assert moved == newer and report.commits == 1 and copy.resolve("main") == newer
        assert remote.pull(copy, "origin")[1] is None  # up to date
        assert_same(_state(5), copy.checkout("main"))
        with Repository.open(hub_path) as hub:  # legal there: the hub has no remote named origin
            hub.branch("origin/main", newer)
        remote.fetch(copy, "origin")
        with pytest.raises(InvalidRefNameError, match="would hide remote 'origin''s tracking ref"):
            remote.pull(copy, "origin", "origin/main")  # a branch origin/main here hid origin/main, the hub's main
        assert copy.resolve("origin/main") == newer and "origin/main" not in copy.branches()


def test_a_lazy_clone_reads_only_the_chains_a_checkout_needs(tmp_path):
    with Repository.init(tmp_path / "hub") as hub:
        first = hub.commit(_state(0))
        for seed in range(1, 6):
            hub.commit(_state(seed))
        total = len(_object_files(tmp_path / "hub"))
    with remote.clone(str(tmp_path / "hub"), tmp_path / "lazy", lazy=True) as lazy:
        manifests_only = len(_object_files(tmp_path / "lazy"))
        assert manifests_only == 6
        assert_same(_state(0), lazy.checkout(first))
        fetched = len(_object_files(tmp_path / "lazy")) - manifests_only
        assert 0 < fetched < (total - 6) / 3  # the first commit's keyframe chunks, not the run
    with Repository.open(tmp_path / "lazy") as reopened:  # lazy survives reopening: the config says so
        assert_same(_state(5), reopened.checkout("main"))
    with remote.clone(str(tmp_path / "hub"), tmp_path / "lazier", lazy=True) as lazier:
        for held in (tmp_path / "hub" / ".ckpt" / "objects").rglob("*"):  # collected there (gc --prune, a prune)
            if held.is_file() and held.name not in _object_files(tmp_path / "lazier"):
                held.unlink()
        with pytest.raises(CorruptObjectError, match=r"the origin it comes from .* no longer holds it: a prune there "
                                                     r".*\(clone it again"):
            lazier.checkout(first)


def test_a_lazy_clone_restores_what_it_pulls_after_the_origin_pruned_below_a_tensor_it_has(tmp_path):
    """The origin's prune re-encoded step 5's tensor and left step 6's (its residual) alone: the pull of step 7 stopped
    at step 6's, which the clone had alike, and kept its stale record of step 5's below it: no commit pulled since,
    the new tip included, could be restored in the clone (auditor 403)."""
    from ckptstore.policy import EncodingSettings
    from ckptstore.repo.config import RetentionPolicy
    from ckptstore.repo.pruning import prune

    generator = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=generator)
    with Repository.init(tmp_path / "hub", encoding=EncodingSettings(max_chain=8)) as hub:
        for step in range(1, 7):
            w = w + 1e-3 * torch.randn(256, 256, generator=generator)
            hub.commit({"w": w.clone()}, step=step)
    remote.clone(str(tmp_path / "hub"), tmp_path / "lazy", lazy=True).close()
    with Repository.open(tmp_path / "hub") as hub:
        prune(hub, RetentionPolicy(keep_last=2))
        w = w + 1e-3 * torch.randn(256, 256, generator=generator)
        newest = hub.commit({"w": w.clone()}, step=7)
        kept = {c.id: hub.checkout(c.id)["w"] for c in hub.log() if not c.pruned}
    with Repository.open(tmp_path / "lazy") as lazy:
        assert remote.pull(lazy, "origin")[1] == newest
        assert torch.equal(lazy.checkout(newest)["w"], w) and len(kept) == 3
        for cid, kept_w in kept.items():  # what the origin keeps restores here too; the rest it pruned is gone
            assert torch.equal(lazy.checkout(cid)["w"], kept_w)


def test_fsck_in_a_lazy_clone_verifies_what_it_lacks_at_the_origin_and_keeps_none_of_it(tmp_path):
    """One fsck downloaded and kept every object of the run: the lazy clone of a long run became a full one
    (auditor 403)."""
    with Repository.init(tmp_path / "hub") as hub:
        for seed in range(3):
            hub.commit(_state(seed))
    with remote.clone(str(tmp_path / "hub"), tmp_path / "lazy", lazy=True) as lazy:
        before = sorted(_object_files(tmp_path / "lazy"))
        report = fsck(lazy)
        assert report.ok and report.objects_checked > len(before)
        assert sorted(_object_files(tmp_path / "lazy")) == before
        full = fsck(lazy, full=True)  # every commit replayed from the origin's objects, none kept (reviewer 404)
        assert full.ok and full.tensors_verified > 0 and sorted(_object_files(tmp_path / "lazy")) == before
        lacking = next(p for p in (tmp_path / "hub" / ".ckpt" / "objects").rglob("*")
                       if p.is_file() and p.name not in before and p.stat().st_size > 1000)
        lacking.write_bytes(lacking.read_bytes()[:-1] + b"x")  # damaged at the origin: found from here too
        assert lacking.parent.name + lacking.name in fsck(lazy).damaged_objects


def test_a_read_only_lazy_clone_reads_from_its_origin_and_writes_nothing_here(tmp_path):
    """--read-only promises reading commands write nothing: a lazy clone's reads go to the origin, uncopied."""
    with Repository.init(tmp_path / "hub") as hub:
        cids = [hub.commit(_state(seed)) for seed in range(3)]  # residual chains: range reads of packs too
    remote.clone(str(tmp_path / "hub"), tmp_path / "lazy", lazy=True).close()
    before = sorted(_object_files(tmp_path / "lazy"))
    with Repository.open(tmp_path / "lazy", read_only=True) as lazy:
        for seed, cid in enumerate(cids):
            assert_same(_state(seed), lazy.checkout(cid))
        lazy.checkout_to(cids[-1], tmp_path / "out.pt")
        assert fsck(lazy, full=True).ok
    assert sorted(_object_files(tmp_path / "lazy")) == before
    assert_same(_state(2), torch.load(tmp_path / "out.pt", weights_only=True))
    with Repository.open(tmp_path / "lazy") as writable:  # writable, it fills in as before
        assert_same(_state(0), writable.checkout(cids[0]))
    assert len(_object_files(tmp_path / "lazy")) > len(before)


def test_wrong_bytes_from_a_remote_are_refused_with_the_object_named(pair, tmp_path):
    work, hub_path, cids = pair
    remote.push(work, "origin")
    victim = next(p for p in (hub_path / ".ckpt" / "objects").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptObjectError, match=victim.parent.name + victim.name) as refused:
        remote.clone(str(hub_path), tmp_path / "copy")
    assert f"the repository at {hub_path} holds a damaged object" in str(refused.value)  # where fsck finds it
    own = next(p for p in (work.dir / "objects").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    own.write_bytes(own.read_bytes()[:-1])
    Repository.init(tmp_path / "empty").close()
    remote.add(work, "empty", str(tmp_path / "empty"))
    with pytest.raises(CorruptObjectError, match=f"this repository \\({work.root}\\) holds a damaged object"):
        remote.push(work, "empty")  # the damage is here, and plain fsck here finds it


@pytest.mark.parametrize("point", ["transfer:object-sent@2", "transfer:objects-sent", "transfer:records-sent"])
def test_an_interrupted_push_leaves_the_remote_consistent_and_resumes(pair, point):
    work, hub_path, cids = pair
    env = ckpt_env(CKPT_CRASH_AT=point)
    work.close()
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "push"], cwd=work.root, env=env, capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == -9
    with Repository.open(hub_path) as hub:
        assert hub.branches() == {} and fsck(hub).ok
        before = set(_object_files(hub_path))
    resumed = ckpt_here(work.root, "push")
    assert resumed.returncode == 0, resumed.stderr
    sent = int(resumed.stdout.split(" objects")[0].rsplit(", ", 1)[1])
    assert sent == len(set(_object_files(hub_path)) - before)  # only what was still missing travelled
    with Repository.open(hub_path) as hub:
        assert hub.resolve("main") == cids[1]
        assert_same(_state(1), hub.checkout(cids[1]))


def test_ctrl_c_in_a_push_says_to_run_it_again_not_to_collect_here(pair):
    """Ctrl-C in a push said how a commit and a checkout end, and sent the user to a local gc (auditor)."""
    work, hub_path, cids = pair
    work.close()
    release = hub_path.parent / "release"
    pushing = subprocess.Popen([sys.executable, "-m", "ckptstore", "push"], cwd=work.root, text=True,
                               env=ckpt_env(CKPT_WAIT_AT=f"transfer:objects-sent={release}"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until_held(release, pushing)
        pushing.send_signal(signal.SIGINT)
        _, err = pushing.communicate(timeout=60)
    finally:
        pushing.kill()
    assert pushing.returncode == 130 and "run the same command again to finish it" in err and "Traceback" not in err
    assert ckpt_here(work.root, "push").returncode == 0
    with Repository.open(hub_path) as hub:
        assert hub.resolve("main") == cids[1] and fsck(hub).ok


def test_remote_commands_at_the_cli(tmp_path):
    torch.save(_state(0), tmp_path / "c.pt")
    assert ckpt_here(tmp_path, "init", "hub").returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    assert ckpt_here(work, "init").returncode == 0
    assert ckpt_here(work, "commit", "../c.pt").returncode == 0
    missing = ckpt_here(work, "push")
    assert missing.returncode != 0 and "no remote named 'origin'" in missing.stderr
    assert ckpt_here(work, "remote", "add", "origin", "../nowhere").returncode != 0
    assert ckpt_here(work, "remote", "add", "origin", "../hub").returncode == 0
    assert "origin" in ckpt_here(work, "remote", "list").stdout
    pushed = ckpt_here(work, "push")
    assert pushed.returncode == 0 and pushed.stdout.startswith("1 commits,") and ") sent" in pushed.stdout
    assert ckpt_here(tmp_path, "clone", "hub", "copy").returncode == 0
    assert ckpt_here(tmp_path / "copy", "checkout", "HEAD", "-o", "back.pt").returncode == 0
    assert_same(_state(0), torch.load(tmp_path / "copy" / "back.pt", weights_only=True))
    assert "origin/main" in ckpt_here(tmp_path / "copy", "log").stdout
    torch.save(_state(1), tmp_path / "c.pt")
    assert ckpt_here(work, "commit", "../c.pt").returncode == 0 and ckpt_here(work, "push").returncode == 0
    fetched = ckpt_here(tmp_path / "copy", "fetch")
    assert fetched.returncode == 0 and fetched.stdout.startswith("1 commits,") and ") received" in fetched.stdout
    assert ckpt_here(tmp_path / "copy", "fsck", "--remote", "origin").stdout.strip().endswith("ok")
    victim = next(p for p in (tmp_path / "hub" / ".ckpt" / "objects").rglob("*") if p.is_file())
    victim.write_bytes(victim.read_bytes()[:-1])
    damaged = ckpt_here(tmp_path / "copy", "fsck", "--remote", "origin")
    assert damaged.returncode == 1 and victim.parent.name + victim.name in damaged.stdout
    assert ckpt_here(tmp_path / "copy", "fsck").returncode == 0  # the clone's own copy is sound


def test_an_object_cut_short_on_the_remote_is_sent_again(pair):
    work, hub_path, cids = pair
    # what a power cut inside an earlier push's batch can leave: the right name, half the bytes, no records
    with work.db.read() as tx:
        chunk = tx.scalar("SELECT object_id FROM tensor_chunks ORDER BY object_id LIMIT 1")
    source = work.store.path_of(chunk)
    leftover = hub_path / ".ckpt" / "objects" / source.parent.name / source.name
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    remote.push(work, "origin")
    assert leftover.read_bytes() == source.read_bytes()
    with Repository.open(hub_path) as hub:
        assert fsck(hub).ok
        assert_same(_state(1), hub.checkout(cids[1]))


def test_a_gc_while_a_fetch_runs_keeps_what_was_fetched(pair, tmp_path):
    work, hub_path, cids = pair
    remote.push(work, "origin")
    remote.clone(str(hub_path), tmp_path / "copy").close()
    with Repository.open(hub_path) as hub:
        newer = hub.commit(_state(5), message="newer")
    release = tmp_path / "release"
    env = ckpt_env(CKPT_WAIT_AT=f"fetch:tracking={release}")
    fetching = subprocess.Popen([sys.executable, "-m", "ckptstore", "fetch"], cwd=tmp_path / "copy", env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, fetching)
        collecting = subprocess.Popen([sys.executable, "-m", "ckptstore", "gc", "--prune"], cwd=tmp_path / "copy",
                                      env=ckpt_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):  # the fetched commit is not yet tracked: gc must wait
            collecting.wait(timeout=3)
    finally:
        release.touch()
    assert fetching.wait(timeout=120) == 0, fetching.communicate()
    assert collecting.wait(timeout=120) == 0, collecting.communicate()
    with Repository.open(tmp_path / "copy") as copy:
        assert copy.resolve("origin/main") == newer and fsck(copy).ok
        assert_same(_state(5), copy.checkout("origin/main"))


def test_a_prune_while_a_push_runs_waits_and_the_push_sends_whole_commits(pair, tmp_path):
    """A second shell's prune used to delete chain objects the push was about to send: "damaged object" here."""
    work, hub_path, cids = pair
    newest = work.commit(_state(2), message="c2")
    release = tmp_path / "release"
    env = ckpt_env(CKPT_WAIT_AT=f"transfer:object-sent={release}")
    pushing = subprocess.Popen([sys.executable, "-m", "ckptstore", "push", "origin", "main"], cwd=work.root, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, pushing)
        pruning = subprocess.Popen([sys.executable, "-m", "ckptstore", "prune", "--keep-last", "1"], cwd=work.root,
                                   env=ckpt_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):  # the push holds the repository: the prune must wait
            pruning.wait(timeout=3)
    finally:
        release.touch()
    assert pushing.wait(timeout=120) == 0, pushing.communicate()
    assert pruning.wait(timeout=120) == 0, pruning.communicate()
    with Repository.open(hub_path) as hub:
        assert hub.resolve("main") == newest and fsck(hub, full=True).ok
        for seed, cid in enumerate([*cids, newest]):
            assert_same(_state(seed), hub.checkout(cid))


def test_a_push_that_loses_the_race_for_the_branch_says_its_commits_went_but_the_branch_did_not(pair, monkeypatch):
    """It said "nothing changed there" of commits it had recorded; the rerun then said why it was refused (auditor)."""
    from ckptstore import faults

    work, hub_path, cids = pair
    remote.push(work, "origin")
    newer = work.commit(_state(2), message="c2")
    passing = faults.point

    def another_push_lands(name):  # another clone's push moves the hub's main once our records are sent
        if name == "transfer:records-sent":
            with Repository.open(hub_path) as hub:
                hub.commit(_state(9), message="theirs", branch="main")
        passing(name)

    monkeypatch.setattr(faults, "point", another_push_lands)
    with pytest.raises(ConflictError, match="lost a race: while the commits were sent, its branch 'main' moved there "
                                            "and was not moved again; run the push again"):
        remote.push(work, "origin")
    monkeypatch.undo()
    with pytest.raises(ConflictError, match="diverged"):  # the rerun says how to send ours
        remote.push(work, "origin")
    with Repository.open(hub_path) as hub:
        assert hub.log("main")[0].message == "theirs" and fsck(hub).ok
        assert_same(_state(2), hub.checkout(newer))  # our commit is there, whole, unreferenced


def test_tracking_refs_follow_the_remote_and_never_move_a_branch_or_tag(pair, tmp_path):
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with Repository.open(hub_path) as hub:
        hub.branch("dev", "main")
        hub.tag("rel", "main")
    with remote.clone(str(hub_path), tmp_path / "copy") as copy:
        assert copy.resolve("origin/dev") == cids[1]
        with Repository.open(hub_path) as hub:
            hub.delete_branch("dev")
        assert remote.fetch(copy, "origin").refs_moved == [("origin/dev", cids[1], None)]
        with pytest.raises(RefNotFoundError, match="has no branch 'dev'"):
            remote.pull(copy, "origin", "dev")
        assert copy.branches()["dev"] == cids[1]  # the clone's own branch stays; only the tracking ref went
        with pytest.raises(InvalidRefNameError, match="remotes/"):
            copy.branch("remotes/origin/main", "main")
        with pytest.raises(InvalidRefNameError, match="would hide remote 'origin'"):  # origin/main resolves to it
            copy.branch("origin/main", "main~1")
        with pytest.raises(InvalidRefNameError, match="would hide remote 'origin'"):  # nor made by a commit
            copy.commit({"w": torch.ones(3)}, branch="origin/dev2")
        copy.branch("originals/main", "main")  # only a remote's own name is taken
        copy.tag("mine", "main")
        with pytest.raises(CkptError, match="this repository has a tag named 'mine', not a branch"):
            remote.pull(copy, "origin", "mine")
    work.tag("v1", "main")
    with pytest.raises(CkptError, match="'v1' is a tag here"):
        remote.push(work, "origin", "v1")
    work.branch("rel", "main")
    with pytest.raises(CkptError, match="remote 'origin' has a tag named 'rel', not a branch"):
        remote.push(work, "origin", "rel", force=True)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CkptError, match="is a file, not a folder"):
        remote.clone(str(hub_path), tmp_path / "afile")


def test_a_machine_without_the_remote_still_cannot_hide_the_tracking_refs_another_fetched(pair, tmp_path):
    """On a shared repository the tracking refs are everyone's, the remotes each machine's own config."""
    from ckptstore.repo.config import RepoConfig

    work, hub_path, cids = pair
    remote.push(work, "origin")
    remote.clone(str(hub_path), tmp_path / "copy").close()
    config_path = tmp_path / "copy" / ".ckpt" / "config.toml"
    config = RepoConfig.load(config_path)
    config.remotes.clear()  # as the config of a machine that never added origin
    config.save(config_path)
    with Repository.open(tmp_path / "copy") as other:
        with pytest.raises(InvalidRefNameError, match="would hide remote 'origin'"):
            other.branch("origin/main", "main~1")
        with pytest.raises(InvalidRefNameError, match="would hide remote 'origin'"):
            other.commit({"w": torch.ones(3)}, branch="origin/dev2")
        assert other.resolve("origin/main") == cids[1]


def test_a_push_cannot_make_a_branch_there_that_hides_the_remotes_own_tracking_refs(pair, tmp_path):
    """The hub has a remote `up` and fetched its main: a branch `up/main` pushed to the hub would hide it there."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with Repository.init(tmp_path / "up") as up:
        up.commit({"w": torch.full((3,), 7.0)}, "upstream")
    with Repository.open(hub_path) as hub:
        remote.add(hub, "up", str(tmp_path / "up"))
        remote.fetch(hub, "up")
        upstream = hub.resolve("up/main")
    work.branch("up/main", "main")  # a legal name here, where no remote `up` exists
    with pytest.raises(InvalidRefNameError, match="push to origin refused: on origin, 'up/main' would hide"):
        remote.push(work, "origin", "up/main")
    with Repository.open(hub_path) as hub:
        assert hub.resolve("up/main") == upstream and "up/main" not in hub.branches()


def test_a_push_to_the_branch_checked_out_with_its_files_in_a_folder_remote_is_refused(tmp_path):
    """As git's receive.denyCurrentBranch: the files there would stay stale, and their next commit undo the push."""
    hub_path = tmp_path / "hub"
    with Repository.init(hub_path) as hub:
        torch.save(_state(0), hub_path / "ck.pt")
        first = hub.commit(hub_path / "ck.pt", "on the hub")
    with remote.clone(str(hub_path), tmp_path / "work") as work:
        torch.save(_state(1), tmp_path / "work" / "ck.pt")
        pushed = work.commit(tmp_path / "work" / "ck.pt", "from the clone")
        with pytest.raises(ConflictError, match="'main' is checked out there, with its files at"):
            remote.push(work, "origin", "main")
        with Repository.open(hub_path) as hub:
            assert hub.resolve("main") == first
            hub.branch("elsewhere")
            hub.checkout_to("elsewhere")
        remote.push(work, "origin", "main")  # not checked out there any more
    with Repository.open(hub_path) as hub:
        assert hub.resolve("main") == pushed and fsck(hub).ok


@pytest.mark.parametrize("head", ["../../evil", "remotes/origin/main", "x\nfake"])
def test_a_clone_takes_no_branch_or_head_named_as_no_ref_may_be(pair, tmp_path, head):
    """A damaged or crafted origin's refs ("x\nfake", "a..b", HEAD on "../../evil") became refs here."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    db = sqlite3.connect(hub_path / ".ckpt" / "ckpt.db")
    for name in ("bad..name", "x\nfake", "-rf", "ok/fine"):
        db.execute("INSERT INTO refs (name, kind, commit_id, target) VALUES (?, 'branch', ?, NULL)", (name, cids[0]))
    db.execute("UPDATE refs SET target = ? WHERE name = 'HEAD'", (head,))
    db.commit()
    db.close()
    with pytest.warns(RuntimeWarning, match="names no ref may have"):
        copy = remote.clone(str(hub_path), tmp_path / "copy")
    with copy:
        assert sorted(copy.branches()) == ["main", "ok/fine"] and copy.head() == ("main", cids[1])
        assert copy.resolve("origin/ok/fine") == cids[0] and fsck(copy).ok


def test_a_fetch_leaves_the_commits_of_a_branch_it_cannot_name_where_they_are(pair, tmp_path):
    """Fetch copied a badly named branch's commits and objects, then left the name out: data no ref here reaches."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    work.branch("side")
    side = work.commit({**_state(7), "extra": torch.randn(100_000)}, "only on side", branch="side")
    remote.push(work, "origin", "side")
    db = sqlite3.connect(hub_path / ".ckpt" / "ckpt.db")
    db.execute("UPDATE refs SET name = 'bad..name' WHERE name = 'side' AND kind = 'branch'")
    db.commit()
    db.close()
    with Repository.init(tmp_path / "copy") as copy:
        remote.add(copy, "origin", str(hub_path))
        with pytest.warns(RuntimeWarning, match="names no ref may have"):
            report = remote.fetch(copy, "origin")
        assert report.commits == 2 and copy.resolve("origin/main") == cids[1]
        with pytest.raises(RefNotFoundError):
            copy.resolve(side)


def test_a_tensor_record_received_from_a_remote_is_encoded_anew_before_a_commit_here_reuses_it(pair, tmp_path):
    """A crafted remote's record can claim the id of bytes it does not hold: your commit of those bytes restored its."""
    from ckptstore.hashing import tensor_id
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with remote.clone(str(hub_path), tmp_path / "copy") as copy:
        received_ids = {e.tensor for e in copy.manifest(cids[1]).entries.values()}
        received_w = copy.manifest(cids[1]).entries["w"].tensor
        assert unchecked(copy, received_ids) == received_ids
        copy.commit({**_state(1), "b": torch.zeros(64)}, "w unchanged")  # w's received record: checked, reused
        assert copy.commit_info("HEAD").stored_bytes < 20_000  # not w's 800 KB encoded again
        assert received_w not in unchecked(copy, received_ids)
        zeros = torch.zeros(16)
        poisoned = tensor_id("torch.float32", (16,), zeros.numpy().view("uint8"))
        copy.commit({"v": torch.arange(16.0)}, "a record whose bytes are arange", branch="side")
        honest = copy.manifest(copy.resolve("side")).entries["v"].tensor
        received_lie(copy.dir, poisoned, honest)  # the remote's forged row: zeros' id over arange's chunks
        mine = copy.commit({"v": zeros}, "my own zeros", branch="mine")
        assert torch.equal(copy.checkout(mine)["v"], zeros)
        assert not unchecked(copy, {poisoned})  # checked once, then reused
        assert fsck(copy, full=True).ok


def test_a_clones_received_records_load_onto_the_meta_device_and_stay_listed(pair, tmp_path):
    """The check of received records read a meta tensor's bytes: NotImplementedError ('Cannot copy out of meta
    tensor') in a fresh clone only (devices auditor)."""
    import ckptstore

    work, hub_path, cids = pair
    remote.push(work, "origin")
    with remote.clone(str(hub_path), tmp_path / "copy") as copy:
        ids = {e.tensor for e in copy.manifest(cids[1]).entries.values()}
        listed = unchecked(copy, ids)
        meta = ckptstore.load(cids[1], repo=copy, map_location="meta")
        assert meta["w"].is_meta and meta["w"].shape == (200_000,) and meta["step"] == 1
        assert unchecked(copy, ids) == listed and listed  # nothing was checked on meta
        assert_same(_state(1), ckptstore.load(cids[1], repo=copy))
        assert not unchecked(copy, ids)


def test_a_received_lossy_record_is_not_reused_for_the_source_it_claims(tmp_path):
    """A lossy record's `source` is no part of its id: a crafted one made your lossy commit restore its values."""
    import copy
    import json

    from ckptstore.hashing import tensor_id
    from tests.conftest import Trainer

    trainer = Trainer()
    trainer.train(5)
    state = copy.deepcopy(trainer.state())
    mine = copy.deepcopy(state)
    mine["model"]["fc1.weight"] = -state["model"]["fc1.weight"]
    weight = mine["model"]["fc1.weight"]
    with Repository.init(tmp_path / "origin") as origin:
        made = origin.commit(state, "the remote's", lossy="balanced")
        entry = origin.manifest(made).entries["model/fc1.weight"].tensor
    db = sqlite3.connect(tmp_path / "origin" / ".ckpt" / "ckpt.db")
    params = json.loads(db.execute("SELECT params FROM tensors WHERE id = ?", (entry,)).fetchone()[0])
    params["source"] = tensor_id(str(weight.dtype), tuple(weight.shape), weight.numpy().view("uint8"))
    db.execute("UPDATE tensors SET params = ? WHERE id = ?", (json.dumps(params), entry))
    db.commit()
    db.close()
    with remote.clone(str(tmp_path / "origin"), tmp_path / "copy") as clone:
        resumed = clone.checkout("main")  # resumed and committed lossless: the record checks out against its id...
        resumed["step"] += 1
        clone.commit(resumed, "resumed")
        back = clone.checkout(clone.commit(mine, "my own", lossy="balanced"))["model"]["fc1.weight"]
    assert ((back - weight).norm() / weight.norm()).item() < 0.1  # ...but its source claim still is not reused


def test_in_a_shared_repository_a_record_one_machine_fetched_is_checked_by_anothers_commit(tmp_path):
    """The unchecked list is in the shared database: machine B's commit reused what machine A fetched, unchecked."""
    from ckptstore.hashing import tensor_id

    zeros = torch.zeros(16)
    poisoned = tensor_id("torch.float32", (16,), zeros.numpy().view("uint8"))
    with Repository.init(tmp_path / "origin") as origin:
        made = origin.commit({"v": torch.arange(16.0)}, "arange")
        honest = origin.manifest(made).entries["v"].tensor
        origin.commit({"v": torch.arange(16.0), "z": zeros}, "zeros")  # reachable: a fetch sends its record
    received_lie(tmp_path / "origin" / ".ckpt", poisoned, honest, listed=False)
    shared = {"metadata_url": f"sqlite:///{tmp_path}/shared.db", "objects_url": str(tmp_path / "objects")}
    Repository.init(tmp_path / "A", **shared).close()
    with Repository.init(tmp_path / "B", **shared) as b:
        b.commit({"x": torch.ones(2)}, "B's first")
    with Repository.open(tmp_path / "A") as a:
        remote.add(a, "origin", str(tmp_path / "origin"))
        remote.fetch(a, "origin")
    with Repository.open(tmp_path / "B") as b:
        assert torch.equal(b.checkout(b.commit({"x": torch.ones(2), "z": zeros}, "B's zeros"))["z"], zeros)


def test_a_parent_whose_received_record_lies_does_not_make_your_bytes_nothing_to_commit(tmp_path):

    with Repository.init(tmp_path) as repo:
        zeros = repo.manifest(repo.commit({"v": torch.zeros(16)}, "zeros")).entries["v"].tensor
        other = repo.manifest(repo.commit({"v": torch.arange(16.0)}, "arange", branch="side")).entries["v"].tensor
        received_lie(repo.dir, zeros, other)  # as a crafted remote's: zeros' id over arange's chunks
        mine = repo.commit({"v": torch.zeros(16)}, "my zeros")  # "nothing changed" before: the entries are equal
        assert torch.equal(repo.checkout(mine)["v"], torch.zeros(16))
        assert torch.equal(repo.checkout("main~1")["v"], torch.zeros(16))  # the row is right for every commit now




def test_a_lazy_clone_keeps_its_origin_and_is_no_origin_for_another(pair, tmp_path):
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with remote.clone(str(hub_path), tmp_path / "lazy", lazy=True) as lazy:
        with pytest.raises(CkptError, match="lazy clone reads the objects"):
            remote.remove(lazy, "origin")
        assert "origin" in lazy.config.remotes
        with Repository.open(hub_path) as hub:
            hub.commit(_state(3), message="newer")
        before = set(_object_files(lazy.root))
        fetched = remote.fetch(lazy, "origin", lazy=False)  # sent and counted, not filled in behind the report
        assert fetched.commits == 1 and fetched.objects == len(set(_object_files(lazy.root)) - before) > 0
    with pytest.raises(CkptError, match="is itself a lazy clone"):  # it holds only what its checkouts read
        remote.clone(str(tmp_path / "lazy"), tmp_path / "lazier", lazy=True)
    assert not (tmp_path / "lazier").exists()
    with remote.clone(str(tmp_path / "lazy"), tmp_path / "eager") as eager:  # read through the lazy clone
        assert_same(_state(1), eager.checkout(cids[1]))


def test_a_bucket_remote_names_its_metadata_as_the_shell_means_it(tmp_path, s3_url):
    """A relative SQLite URL is the current folder's; a metadata URL that holds no repository is refused, not made."""
    torch.save(_state(0), tmp_path / "c.pt")
    work = tmp_path / "work"
    work.mkdir()
    assert ckpt_here(work, "init").returncode == 0 and ckpt_here(work, "commit", "../c.pt").returncode == 0
    added = ckpt_here(tmp_path, "--repo", str(work), "remote", "add", "hub", s3_url, "--metadata", "sqlite:///hub.db")
    assert added.returncode == 0, added.stderr
    env = ckpt_env(CKPT_CRASH_AT="transfer:objects-sent")
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "push", "hub"], cwd=work, env=env, timeout=120)
    assert killed.returncode == -9  # its objects are up, no commit recorded: the next push must still go
    again = ckpt_here(work, "push", "hub")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "hub.db").is_file()  # where the user ran the command, not in a cache folder
    copy = ckpt_here(tmp_path, "clone", s3_url, "copy", "--metadata", "sqlite:///hub.db")
    assert copy.returncode == 0, copy.stderr
    assert ckpt_here(tmp_path / "copy", "checkout", "HEAD", "-o", "back.pt").returncode == 0
    assert_same(_state(0), torch.load(tmp_path / "copy" / "back.pt", weights_only=True))
    typo = ckpt_here(tmp_path, "clone", s3_url, "typo", "--metadata", "sqlite:///hbu.db")
    assert typo.returncode != 0 and "holds no repository" in typo.stderr and "Traceback" not in typo.stderr
    assert not (tmp_path / "hbu.db").exists() and not (tmp_path / "typo").exists()
    # a new database over a prefix that holds the hub's objects would call them garbage
    other = ckpt_here(work, "remote", "add", "other", s3_url, "--metadata", f"sqlite:///{tmp_path / 'other.db'}")
    assert other.returncode != 0 and "already holds objects that no commit" in other.stderr


def test_a_damaged_commit_record_does_not_travel(pair, tmp_path):
    """Records are verified as objects are: a rewritten row stays where it is, the other side is untouched."""
    work, hub, cids = pair
    with contextlib.closing(sqlite3.connect(work.dir / "ckpt.db")) as db, db:
        db.execute("UPDATE commits SET step = 777, message = 'tampered' WHERE id = ?", (cids[1],))
    with pytest.raises(CkptError, match=f"^this repository .* holds a damaged record of commit {cids[1][:12]} .*"
                                        r"nothing was sent. Run `ckpt fsck` here$"):
        remote.push(work, "origin")
    with Repository.open(hub) as other:
        assert other.log() == [] and fsck(other).ok
    sender = re.escape(str(work.root))
    with pytest.raises(CkptError, match=f"^the repository at {sender} holds a damaged record .* `ckpt fsck --remote "
                                        "NAME` from a repository that has it as a remote$"):
        remote.clone(str(work.root), tmp_path / "copy")


_RECORD_DAMAGE = {  # what a lost row or a damaged page leaves of the first commit's tensor record
    "base record lost": "DELETE FROM tensors WHERE id = :tid",
    "chunk rows lost": "DELETE FROM tensor_chunks WHERE tensor_id = :tid",
    "commit's tensor list lost": "DELETE FROM commit_tensors WHERE commit_id = :cid",
    "shape unparseable": "UPDATE tensors SET shape = '[[' WHERE id = :tid",
}


@pytest.mark.parametrize("damage", sorted(_RECORD_DAMAGE))
def test_damaged_tensor_records_do_not_travel(tmp_path, damage):
    """Push and fetch sent a history fsck here called broken (rc 0), and broke the healthy side's commits, fsck and
    gc: the records that move are checked as fsck checks them, before anything is sent (auditor helper 314)."""
    Repository.init(tmp_path / "hub").close()
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=generator)
    with Repository.init(tmp_path / "work") as work:
        remote.add(work, "origin", str(tmp_path / "hub"))
        first = work.commit({"w": w}, "keyframe")
        work.commit({"w": w + 1e-3 * torch.randn(256, 256, generator=generator)}, "a residual on it")
        tid = work.manifest(first).entries["w"].tensor
        with contextlib.closing(sqlite3.connect(work.dir / "ckpt.db")) as db, db:
            assert db.execute("SELECT COUNT(*) FROM tensors WHERE base_id = ?", (tid,)).fetchone()[0] == 1
            db.execute(_RECORD_DAMAGE[damage], {"tid": tid, "cid": first})
        assert not fsck(work).ok
        with pytest.raises(CkptError, match=f"^this repository .* holds damaged records that commit {first[:12]} "
                                            r"needs \(.*\); nothing was sent. Run `ckpt fsck` here$"):
            remote.push(work, "origin")
    with Repository.open(tmp_path / "hub") as hub:
        assert hub.log(all_refs=True) == [] and fsck(hub).ok and not _object_files(tmp_path / "hub")
    with Repository.init(tmp_path / "fresh") as fresh:
        remote.add(fresh, "origin", str(tmp_path / "work"))
        with pytest.raises(CkptError, match=f"^the repository at .* holds damaged records that commit {first[:12]} "
                                            r"needs .*nothing was sent. Check that repository"):
            remote.fetch(fresh, "origin")
        assert fresh.log(all_refs=True) == [] and fsck(fresh).ok and not _object_files(tmp_path / "fresh")


def _lose_one_listed_tensor(database, cid):
    """Delete one of commit `cid`'s commit_tensors rows in the SQLite file `database`; returns the tensor it listed."""
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        listed = sorted(t for (t,) in db.execute("SELECT tensor_id FROM commit_tensors WHERE commit_id = ?", (cid,)))
        assert len(listed) == 2
        db.execute("DELETE FROM commit_tensors WHERE commit_id = ? AND tensor_id = ?", (cid, listed[0]))
    return listed[0]


@pytest.mark.parametrize("kind", ["folder", "bucket"])
def test_a_commit_whose_tensor_list_lost_some_rows_does_not_travel(tmp_path, request, kind):
    """A commit whose commit_tensors rows were partly lost was pushed and fetched as it was: the other side held a
    commit it could not restore. Its rows are checked against its manifest first (auditor helper 356)."""
    url, database = str(tmp_path / "hub"), tmp_path / "hub" / ".ckpt" / "ckpt.db"
    if kind == "bucket":
        url, database = request.getfixturevalue("s3_url"), tmp_path / "hub.db"
    else:
        Repository.init(url).close()
    with Repository.init(tmp_path / "work") as work:
        remote.add(work, "origin", url, f"sqlite:///{database}" if kind == "bucket" else "")
        cids = [work.commit(_state(seed), message=f"c{seed}") for seed in range(2)]
        remote.push(work, "origin")
        with remote.open_remote(remote.named(work, "origin")) as hub:
            sent = sorted(hub.store.iter_ids())
        lost = _lose_one_listed_tensor(database, cids[0])  # the hub's: a fetch from it must refuse
        with Repository.init(tmp_path / "fresh") as fresh:
            remote.add(fresh, "origin", url, f"sqlite:///{database}" if kind == "bucket" else "")
            with pytest.raises(CkptError, match=rf"^the repository at .* holds damaged records that commit "
                                                rf"{cids[0][:12]} needs \(its rows \(commit_tensors\) list 1 "
                                                rf"tensors, its manifest 2: tensor {lost} is not listed\); nothing "
                                                r"was sent. Check that repository: `ckpt fsck` in it"):
                remote.fetch(fresh, "origin")
            assert fresh.log(all_refs=True) == [] and not _object_files(fresh.root)
        third = work.commit(_state(2), message="c2")
        lost = _lose_one_listed_tensor(work.dir / "ckpt.db", third)
        assert not fsck(work).ok
        with pytest.raises(CkptError, match=rf"^this repository .* holds damaged records that commit {third[:12]} "
                                            rf"needs \(its rows \(commit_tensors\) list 1 tensors, its manifest 2: "
                                            rf"tensor {lost} is not listed\); nothing was sent. Run `ckpt fsck` "
                                            r"here$"):
            remote.push(work, "origin")
        with remote.open_remote(remote.named(work, "origin")) as hub:
            assert hub.resolve("main") == cids[1] and sorted(hub.store.iter_ids()) == sent


def _zero_commits_page(repo_path):
    """Overwrite the page that holds the commits table of a closed repository's database with zeros."""
    with contextlib.closing(sqlite3.connect(repo_path / ".ckpt" / "ckpt.db")) as db:
        size = db.execute("PRAGMA page_size").fetchone()[0]
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'commits'").fetchone()[0]
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with open(repo_path / ".ckpt" / "ckpt.db", "r+b") as file:
        file.seek((root - 1) * size)
        file.write(bytes(size))


def test_a_damaged_database_on_one_side_of_a_transfer_is_named_as_that_sides(pair, tmp_path):
    """The sender's damaged database was reported as the healthy receiver's, with advice to restore that one from a
    backup: each transaction now says only what its own connection raised (auditor helper 314)."""
    work, hub, _ = pair
    work.close()
    _zero_commits_page(tmp_path / "work")
    pushed = ckpt_here(tmp_path / "work", "push", "origin", "main")
    assert pushed.returncode == 1 and "Traceback" not in pushed.stderr
    assert f"the metadata database {tmp_path / 'work' / '.ckpt' / 'ckpt.db'} is damaged" in pushed.stderr
    assert str(hub) not in pushed.stderr
    assert ckpt_here(hub, "fsck").returncode == 0
    assert ckpt_here(tmp_path, "init", "fresh").returncode == 0
    assert ckpt_here(tmp_path / "fresh", "remote", "add", "d", str(tmp_path / "work")).returncode == 0
    fetched = ckpt_here(tmp_path / "fresh", "fetch", "d")
    assert fetched.returncode == 1 and "Traceback" not in fetched.stderr
    assert f"the metadata database {tmp_path / 'work' / '.ckpt' / 'ckpt.db'} is damaged" in fetched.stderr
    assert str(tmp_path / "fresh") not in fetched.stderr
    assert ckpt_here(tmp_path / "fresh", "fsck").returncode == 0


def test_a_remote_whose_branch_names_a_commit_it_has_no_record_of_is_named_as_the_damaged_one(pair, tmp_path):
    """The fetch said "metadata has no commit X; run `ckpt fsck`", read as this repository's damage, and fsck here
    found nothing: the message meant for it was never reached (mutation audit round 12)."""
    work, hub, cids = pair
    remote.push(work, "origin")
    with contextlib.closing(sqlite3.connect(hub / ".ckpt" / "ckpt.db")) as db, db:
        db.execute("PRAGMA foreign_keys = OFF")
        for table, column in (("commit_tensors", "commit_id"), ("commit_parents", "commit_id"), ("commits", "id")):
            db.execute(f"DELETE FROM {table} WHERE {column} = ?", (cids[-1],))
    with Repository.init(tmp_path / "fresh") as fresh:
        remote.add(fresh, "origin", str(hub))
        sender = re.escape(str(hub))
        with pytest.raises(CkptError, match=f"^the repository at {sender} has no record of commit {cids[-1][:12]}, "
                                            r"which its refs reach; nothing was sent. Check that repository: "
                                            r"`ckpt fsck` in it, or `ckpt fsck --remote NAME`"):
            remote.fetch(fresh, "origin")
        assert fresh.log(all_refs=True) == [] and fsck(fresh).ok


def test_an_interrupted_clone_resumes_only_as_the_kind_it_began(pair, tmp_path):
    """A lazy clone killed midway, rerun without --lazy, said 'Cloned' and stayed lazy (and the reverse)."""
    work, _, cids = pair
    env = ckpt_env(CKPT_CRASH_AT="transfer:records-sent")
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "clone", "--lazy", str(work.root), "copy"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9
    other_kind = ckpt_here(tmp_path, "clone", str(work.root), "copy")
    assert other_kind.returncode == 1 and "a lazy clone" in other_kind.stderr and "with --lazy" in other_kind.stderr
    assert ckpt_here(tmp_path, "clone", "--lazy", str(work.root), "copy").returncode == 0
    with Repository.open(tmp_path / "copy") as copy:
        assert copy.config.remotes["origin"].lazy and copy.resolve("main") == cids[1]
        assert_same(_state(1), copy.checkout(cids[1]))


def test_pull_writes_heads_files_as_git_does_and_unsaved_ones_stop_it(tmp_path):
    """Files left at the old commit read as changes, and committing them undid the pull."""
    assert ckpt_here(tmp_path, "init", "work").returncode == 0
    work, copy = tmp_path / "work", tmp_path / "copy"
    torch.save(_state(0), work / "c.pt")
    assert ckpt_here(work, "commit", "c.pt").returncode == 0
    assert ckpt_here(tmp_path, "clone", "work", "copy").returncode == 0
    assert ckpt_here(tmp_path, "clone", "work", "mirror").returncode == 0  # never checked out: it holds no files
    assert ckpt_here(copy, "checkout", "main").returncode == 0
    torch.save(_state(1), work / "c.pt")
    assert ckpt_here(work, "commit", "c.pt").returncode == 0
    assert ckpt_here(copy, "pull").returncode == 0 and ckpt_here(tmp_path / "mirror", "pull").returncode == 0
    assert_same(_state(1), torch.load(copy / "c.pt", weights_only=True))
    assert "unchanged: c.pt" in ckpt_here(copy, "status").stdout
    assert sorted(p.name for p in (tmp_path / "mirror").iterdir()) == [".ckpt"]  # and pull writes none there
    torch.save(_state(2), work / "c.pt")
    assert ckpt_here(work, "commit", "c.pt").returncode == 0
    torch.save(_state(3), copy / "c.pt")  # training wrote it meanwhile: not in the store
    before = ckpt_here(copy, "log", "--json").stdout
    refused = ckpt_here(copy, "pull")
    assert refused.returncode == 1 and "pull stopped" in refused.stderr and "c.pt" in refused.stderr
    assert ckpt_here(copy, "log", "--json").stdout == before  # main stayed where it was
    assert_same(_state(3), torch.load(copy / "c.pt", weights_only=True))


def test_a_pull_into_a_branch_head_is_not_on_says_which_branch_moved_and_that_head_stayed(tmp_path):
    """`ckpt pull origin teammate` on branch mine said only "fast-forwarded to X": mine and its files stayed at the
    old checkpoint, and a new local branch teammate was made (git-habits auditor)."""
    assert ckpt_here(tmp_path, "init", "work").returncode == 0
    work, copy = tmp_path / "work", tmp_path / "copy"
    torch.save(_state(0), work / "c.pt")
    assert ckpt_here(work, "commit", "c.pt").returncode == 0
    assert ckpt_here(work, "branch", "teammate").returncode == 0
    assert ckpt_here(tmp_path, "clone", "work", "copy").returncode == 0
    assert ckpt_here(copy, "checkout", "main").returncode == 0
    assert ckpt_here(work, "checkout", "teammate").returncode == 0
    torch.save(_state(1), work / "c.pt")
    assert ckpt_here(work, "commit", "c.pt").returncode == 0
    pulled = ckpt_here(copy, "pull", "origin", "teammate")
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.splitlines()[-1].startswith("fast-forwarded teammate to ")
    assert pulled.stdout.rstrip().endswith("HEAD stays on main: `ckpt checkout teammate` writes its files")
    assert_same(_state(0), torch.load(copy / "c.pt", weights_only=True))  # main's file, as said
    again = ckpt_here(copy, "pull")
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == "main is already up to date"


def test_a_branch_only_a_remote_has_is_named_with_the_command_that_makes_it_here(pair, tmp_path):
    """After a fetch, `ckpt checkout teammate` said only "unknown ref 'teammate'" though origin/teammate was there
    (git-habits auditor)."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with Repository.open(hub_path) as hub:
        hub.branch("teammate", cids[0])
    remote.fetch(work, "origin")
    with pytest.raises(RefNotFoundError, match=r"unknown ref 'teammate' as a branch here; origin/teammate is a "
                                               r"remote's: `ckpt branch teammate origin/teammate`, then"):
        work.resolve("teammate")
    with pytest.raises(RefNotFoundError, match=r"unknown ref 'nobody'\.$"):
        work.resolve("nobody")


def test_a_pull_killed_before_it_wrote_its_files_is_ended_by_the_next_pull(tmp_path):
    """The first pull moved the branch; the rerun used to find it up to date and leave the old file in place."""
    with Repository.init(tmp_path / "work") as work:
        torch.save(_state(0), tmp_path / "work" / "c.pt")
        work.commit(tmp_path / "work" / "c.pt")
        with remote.clone(str(tmp_path / "work"), tmp_path / "copy") as copy:
            copy.checkout_to("main")
        torch.save(_state(1), tmp_path / "work" / "c.pt")
        work.commit(tmp_path / "work" / "c.pt")
    env = ckpt_env(CKPT_CRASH_AT="checkout:records-read")
    for settled_by_hand in (False, True):
        if settled_by_hand:  # killed again, then the user checks out and edits: the rerun must not undo either
            with Repository.open(tmp_path / "work") as work:
                torch.save(_state(2), tmp_path / "work" / "c.pt")
                pulled = work.commit(tmp_path / "work" / "c.pt")
        killed = subprocess.run([sys.executable, "-m", "ckptstore", "pull"], cwd=tmp_path / "copy", env=env,
                                timeout=120)
        assert killed.returncode == -9
        with Repository.open(tmp_path / "copy") as copy:
            if settled_by_hand:
                copy.checkout_to("main")
                torch.save(_state(3), tmp_path / "copy" / "c.pt")
            remote.pull(copy, "origin")
            assert_same(_state(3 if settled_by_hand else 1), torch.load(tmp_path / "copy" / "c.pt", weights_only=True))
            assert not (copy.dir / remote.PULLING).exists()
    with Repository.open(tmp_path / "copy") as copy:
        assert copy.resolve("main") == pulled


def test_a_pull_killed_before_it_wrote_its_files_then_files_changed_stops_the_next_pull(tmp_path):
    """The killed pull's rerun closed it out unsaid when the file had changed meanwhile: the branch stayed on the
    pulled commit, the file kept the old run's content, and the next commit undid the pull (code reviewer)."""
    from ckptstore.errors import DirtyWorktreeError

    with Repository.init(tmp_path / "work") as work:
        torch.save(_state(0), tmp_path / "work" / "c.pt")
        work.commit(tmp_path / "work" / "c.pt")
        with remote.clone(str(tmp_path / "work"), tmp_path / "copy") as copy:
            copy.checkout_to("main")
            before = copy.resolve("main")
        torch.save(_state(1), tmp_path / "work" / "c.pt")
        work.commit(tmp_path / "work" / "c.pt")
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "pull"], cwd=tmp_path / "copy",
                            env=ckpt_env(CKPT_CRASH_AT="checkout:records-read"), timeout=120)
    assert killed.returncode == -9
    torch.save(_state(3), tmp_path / "copy" / "c.pt")  # the user's job, on the old weights, saves meanwhile
    with Repository.open(tmp_path / "copy") as copy:
        with pytest.raises(DirtyWorktreeError, match="pull stopped, 'main' back at [0-9a-f]{12}: checkout would "
                                                     "overwrite .*; move it away, or keep it on a branch of its own"
                           ) as stopped:
            remote.pull(copy, "origin")
        assert "-o PATH" not in str(stopped.value) and "commit it first" not in str(stopped.value)  # checkout's
        assert copy.resolve("main") == before and not (copy.dir / remote.PULLING).exists()
    assert_same(_state(3), torch.load(tmp_path / "copy" / "c.pt", weights_only=True))


def test_ctrl_c_while_a_pull_writes_its_files_moves_the_branch_back(pair, tmp_path, monkeypatch):
    work, hub_path, cids = pair
    torch.save(_state(5), work.root / "c.pt")
    work.commit(work.root / "c.pt")
    remote.push(work, "origin")
    with remote.clone(str(hub_path), tmp_path / "copy") as copy:
        copy.checkout_to("main")
        torch.save(_state(6), work.root / "c.pt")
        work.commit(work.root / "c.pt")
        remote.push(work, "origin")
        before = copy.resolve("main")

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr("ckptstore.repo.checkout.checkout_to", interrupted)
        with pytest.raises(KeyboardInterrupt):
            remote.pull(copy, "origin")
        assert copy.resolve("main") == before and not (copy.dir / remote.PULLING).exists()


def test_a_lazy_clone_whose_origin_is_gone_names_what_it_lacks(pair, tmp_path):
    """Checkout says where the objects it lacks were to come from; fsck lists them instead of stopping."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with remote.clone(str(hub_path), tmp_path / "lazy", lazy=True) as lazy:
        assert_same(_state(1), lazy.checkout(cids[1]))  # read once: now held here
    shutil.rmtree(hub_path)
    with Repository.open(tmp_path / "lazy") as lazy:
        assert_same(_state(1), lazy.checkout(cids[1]))
        with pytest.raises(CorruptObjectError, match="origin it comes from cannot be opened.*holds no repository"):
            lazy.checkout(cids[0])
        report = fsck(lazy)
        assert not report.ok and report.damaged_objects
        assert all("cannot be opened" in problem for problem in report.damaged_objects.values())
        assert set(report.broken_commits) == {cids[0]}


def _commit(folder, value, name="ck.pt", *args):
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.full((256,), float(value))}, folder / name)
    assert ckpt_here(folder, "commit", name, "-m", f"c{value}", *args).returncode == 0


def _pushed(tmp_path) -> None:
    """Work tree a with commits c1-c3 on main, pushed to repository b, its origin."""
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        ckpt_here(tmp_path / side, "init")
    for value in (1, 2, 3):
        _commit(tmp_path / "a", value)
    assert ckpt_here(tmp_path / "a", "remote", "add", "origin", "../b").returncode == 0
    assert ckpt_here(tmp_path / "a", "push").returncode == 0


def _cloned(tmp_path) -> None:
    """Work tree a with c1 on main, cloned to c, whose files are checked out."""
    (tmp_path / "a").mkdir()
    ckpt_here(tmp_path / "a", "init")
    _commit(tmp_path / "a", 1)
    assert ckpt_here(tmp_path, "clone", "a", "c").returncode == 0
    assert ckpt_here(tmp_path / "c", "checkout", "main").returncode == 0


def test_a_commit_the_other_side_pruned_travels_again_and_restores_there(tmp_path):
    _pushed(tmp_path)
    assert ckpt_here(tmp_path / "b", "prune", "--keep-last", "1").returncode == 0  # b drops c2's data, keeps its record
    assert ckpt_here(tmp_path / "a", "branch", "keep", "main~1").returncode == 0
    assert ckpt_here(tmp_path / "a", "push", "origin", "keep").returncode == 0
    restored = ckpt_here(tmp_path / "b", "checkout", "keep", "-o", str(tmp_path / "out.pt"))
    assert restored.returncode == 0, restored.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.full((256,), 2.0))
    with Repository.open(tmp_path / "b") as hub:
        assert not hub.commit_info(hub.resolve("keep")).pruned and fsck(hub).ok
        assert hub.commit_info(hub.resolve("main~2")).pruned  # only the tip pushed travels again
    _commit(tmp_path / "a", 4)
    assert ckpt_here(tmp_path / "a", "push").returncode == 0
    with Repository.open(tmp_path / "b") as hub:  # a push of new work leaves the hub's retention as it was
        assert [hub.commit_info(hub.resolve(f"main~{n}")).pruned for n in range(4)] == [False, False, False, True]


def test_a_pull_whose_files_cannot_be_written_leaves_the_branch_where_it_was(tmp_path):
    _cloned(tmp_path)
    before = ckpt_here(tmp_path / "c", "show", "main").stdout.split()[1]
    _commit(tmp_path / "a", 2, "d/ck.pt")
    (tmp_path / "c" / "d").write_text("a file where the pulled commit needs a folder")
    pulled = ckpt_here(tmp_path / "c", "pull")
    assert pulled.returncode == 1 and pulled.stderr.startswith("error: pull stopped, 'main' back at ")
    assert "Traceback" not in pulled.stderr and ckpt_here(tmp_path / "c", "show", "main").stdout.split()[1] == before


def test_a_remote_needs_a_url(tmp_path):
    ckpt_here(tmp_path, "init")
    added = ckpt_here(tmp_path, "remote", "add", "empty", "")
    assert added.returncode == 1 and "needs a URL" in added.stderr  # it was a remote of the repository itself


def test_a_bucket_remote_made_by_push_is_whole_to_fsck(tmp_path):
    (tmp_path / "a").mkdir()
    ckpt_here(tmp_path / "a", "init")
    _commit(tmp_path / "a", 1)
    assert ckpt_here(tmp_path / "a", "remote", "add", "origin", f"file://{tmp_path}/remote/objects", "--metadata",
                f"sqlite:///{tmp_path}/remote.db").returncode == 0
    assert ckpt_here(tmp_path / "a", "push").returncode == 0
    checked = ckpt_here(tmp_path / "a", "fsck", "--remote", "origin")
    assert checked.returncode == 0 and checked.stdout.strip().endswith("ok"), checked.stdout + checked.stderr


def test_a_local_branch_never_hides_a_remote_tracking_ref(pair, tmp_path):
    work, hub_path, cids = pair
    work.branch("up/main", cids[0])
    with pytest.raises(CkptError, match="'up/main' would hide remote 'up'"):
        remote.add(work, "up", str(hub_path))
    remote.push(work, "origin")
    with Repository.open(hub_path) as hub:
        hub.branch("x", cids[1])
        hub.branch("origin/x", cids[0])  # a branch of the hub that would read as a tracking ref in its clone
    with remote.clone(str(hub_path), tmp_path / "copy") as copy:
        assert copy.resolve("origin/x") == cids[1] and "origin/x" not in copy.branches()


def _damaged_ref(repo_dir, name: str, kind: str) -> None:
    """A `kind` row named `name` that points at no commit: damage its listings warn of."""
    with contextlib.closing(sqlite3.connect(repo_dir / "ckpt.db")) as db, db:
        db.execute("INSERT INTO refs (name, kind, commit_id) VALUES (?, ?, NULL)", (name, kind))


def test_remote_add_is_not_refused_for_an_unrelated_damaged_branch_or_tag(pair, tmp_path):
    """A branch or tag row naming no commit made every `remote add` fail on its damage (reviewer 366): only names
    are needed, and a damaged one still hides a tracking ref."""
    work, hub_path, _ = pair
    _damaged_ref(work.dir, "bad", "branch")
    _damaged_ref(work.dir, "t-bad", "tag")
    assert remote.add(work, "up", str(hub_path)).url == str(hub_path)
    _damaged_ref(work.dir, "other/x", "branch")
    with pytest.raises(CkptError, match="'other/x' would hide remote 'other'"):
        remote.add(work, "other", str(hub_path))


def test_a_clone_into_a_repository_with_a_damaged_branch_says_it_exists(pair, tmp_path):
    """A repository whose origin is the clone's URL and that holds a branch row naming no commit is no interrupted
    clone (a clone makes its branches last): the clone said the branch was damaged, not that it exists."""
    from ckptstore.errors import RepoExistsError

    work, hub_path, _ = pair
    with Repository.init(tmp_path / "copy") as copy:
        remote.add(copy, "origin", str(hub_path))
    _damaged_ref(tmp_path / "copy" / ".ckpt", "bad", "branch")
    with pytest.raises(RepoExistsError, match="already exists; clone into a new folder"):
        remote.clone(str(hub_path), tmp_path / "copy")


def test_remote_add_takes_a_relative_folder_from_where_it_is_typed_and_keeps_it_relative_to_the_root(tmp_path):
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "backup").mkdir()
    ckpt_here(tmp_path / "a", "init")
    ckpt_here(tmp_path / "a" / "backup", "init")
    _commit(tmp_path / "a", 1)
    # a/backup, as typed there
    assert ckpt_here(tmp_path / "a" / "sub", "remote", "add", "bk", "../backup").returncode == 0
    assert ckpt_here(tmp_path / "a", "push", "bk").returncode == 0
    with Repository.open(tmp_path / "a" / "backup") as backup:
        assert list(backup.branches()) == ["main"]
    shutil.copytree(tmp_path / "a", tmp_path / "copy")  # the copy's remote is its own backup/, as the root says
    with Repository.open(tmp_path / "copy") as copy:
        assert copy.config.remotes["bk"].url == "backup"


def test_a_prune_in_a_lazy_clone_says_what_it_read_from_the_origin_not_a_negative_amount_freed(pair, tmp_path):
    """"objects: 4.8 KiB before, 253.6 KiB after (-248.8 KiB freed)" (auditor)."""
    work, hub_path, _ = pair
    base = torch.randn(200_000, generator=torch.Generator().manual_seed(7))
    for step in range(3):  # residuals on one another: a prune re-encodes the newest, whose chain it reads first
        work.commit({"w": base + step * 1e-3}, message=f"step {step}")
    remote.push(work, "origin")
    remote.clone(str(hub_path), tmp_path / "lazy", lazy=True).close()
    said = ckpt_here(tmp_path / "lazy", "prune", "--keep-last", "1")
    assert said.returncode == 0 and "more: the survivors re-encoded, read from the origin)" in said.stdout
    assert "(-" not in said.stdout
    said = ckpt_here(work.root, "prune", "--keep-last", "1")
    assert said.returncode == 0 and " freed)" in said.stdout, said.stdout


def test_a_push_does_not_trust_an_object_of_the_right_size_that_holds_other_bytes(pair):
    """Push skipped an object whose name held other bytes of the same size: the remote's main then broke (auditor)."""
    work, hub_path, cids = pair
    manifest_oid = work.commit_info(cids[0]).manifest_object
    with Repository.open(hub_path) as hub:
        planted = hub.store.path_of(manifest_oid)
    planted.parent.mkdir(parents=True, exist_ok=True)
    size = len(work.read_object(manifest_oid))
    planted.write_bytes(b"\0" * size)  # another writer's bytes, or a damaged file, under the right name
    assert remote.push(work, "origin").commits == 2
    with Repository.open(hub_path) as hub:
        assert fsck(hub).ok
        for seed, cid in enumerate(cids):
            assert_same(_state(seed), hub.checkout(cid))


def test_a_folder_remote_whose_database_cannot_be_reached_is_named(pair):
    """"cannot reach PostgreSQL at …" pointed at the metadata URL of this repository's config, not the remote's."""
    from ckptstore.testing.net import free_port

    work, hub_path, _ = pair
    config = hub_path / ".ckpt" / "config.toml"
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/x"
    config.write_text(config.read_text().replace('metadata_url = ""', f'metadata_url = "{dead}"', 1))
    said = ckpt_here(work.root, "fetch", "origin")
    assert said.returncode == 1 and f"remote 'origin' ({hub_path}): cannot reach PostgreSQL" in said.stderr, said.stderr


def test_a_remote_may_be_named_with_hex_digits_alone(pair, tmp_path):
    """The commit-id rule of branch names refused 'beef' with the charset's message (auditor): a remote's
    name stands only in NAME/BRANCH, which no commit id abbreviates."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with Repository.init(tmp_path / "other") as other:
        remote.add(other, "beef", str(hub_path))
        remote.fetch(other, "beef")
        assert other.resolve("beef/main") == cids[1]
        with pytest.raises(CkptError, match="not a valid remote name"):
            remote.add(other, "be ef", str(hub_path))


def test_a_prune_of_the_remote_while_a_clone_copies_from_it_waits(pair, tmp_path):
    """The clone held no lock there: the prune deleted chain objects it was about to copy, and the clone called
    the remote damaged, which its fsck denied (auditor)."""
    work, hub_path, cids = pair
    newest = work.commit(_state(2), message="c2")
    remote.push(work, "origin")
    release = tmp_path / "release"
    cloning = subprocess.Popen([sys.executable, "-m", "ckptstore", "clone", str(hub_path), str(tmp_path / "copy")],
                               cwd=tmp_path, env=ckpt_env(CKPT_WAIT_AT=f"transfer:object-sent={release}"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, cloning)
        pruning = subprocess.Popen([sys.executable, "-m", "ckptstore", "prune", "--keep-last", "1"], cwd=hub_path,
                                   env=ckpt_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):  # the clone reads the hub: the prune must wait
            pruning.wait(timeout=3)
    finally:
        release.touch()
    assert cloning.wait(timeout=120) == 0, cloning.communicate()
    assert pruning.wait(timeout=120) == 0, pruning.communicate()
    with Repository.open(tmp_path / "copy") as copy:
        assert fsck(copy, full=True).ok
        for seed, cid in enumerate([*cids, newest]):
            assert_same(_state(seed), copy.checkout(cid))


def _dcp_dir(path, value: float) -> None:
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(Exception), pytest.warns(UserWarning):  # "torch.distributed is disabled"
        dcp.save({"w": torch.full((64, 64), value)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def test_a_pull_onto_a_sharded_commit_warns_that_the_dcp_directory_here_is_stale(tmp_path):
    """It said only "fast-forwarded": a DCP directory committed here kept the old checkpoint, and the next
    commit of it undid the pulled one without a word (auditor)."""
    Repository.init(tmp_path / "hub").close()
    with Repository.init(tmp_path / "a") as a:
        remote.add(a, "origin", str(tmp_path / "hub"))
        _dcp_dir(tmp_path / "a" / "step", 1.0)
        a.commit(tmp_path / "a" / "step", message="A")
        remote.push(a, "origin")
        with remote.clone(str(tmp_path / "hub"), tmp_path / "b") as b:
            _dcp_dir(tmp_path / "b" / "step", 2.0)
            theirs = b.commit(tmp_path / "b" / "step", message="B")
            remote.push(b, "origin")
        with pytest.warns(RuntimeWarning, match=f"main now points at {theirs[:12]}, a sharded .DCP. commit, which is "
                                                 "never written in place: a DCP directory committed here still "
                                                 f"holds .*`ckpt checkout {theirs[:12]} -o NEWDIR`"):
            remote.pull(a, "origin")
        assert a.head() == ("main", theirs)


def test_a_fetch_waiting_for_a_gc_on_the_remote_says_so(pair, tmp_path):
    """It waited for the remote's gc without a word (reader)."""
    import threading

    work, hub_path, cids = pair
    remote.push(work, "origin")
    release = tmp_path / "release"
    collecting = subprocess.Popen([sys.executable, "-m", "ckptstore", "gc"], cwd=hub_path,
                                  env=ckpt_env(CKPT_WAIT_AT=f"gc:tmp-cleared={release}"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, collecting)
        threading.Timer(1.0, release.touch).start()
        with pytest.warns(RuntimeWarning, match="waiting for remote origin's repository lock: a gc or prune runs"):
            remote.fetch(work, "origin")
    finally:
        release.touch()
    assert collecting.wait(timeout=120) == 0, collecting.communicate()
    assert work.resolve("origin/main") == cids[1]


def test_remote_add_and_remove_keep_what_others_wrote_to_the_config_since_it_was_read(pair, tmp_path):
    """Each saved the config it had read when the repository opened: a remote added at once by another
    process (two `remote add`s racing), or a [retention] policy written since, was lost (auditor)."""
    from ckptstore.repo.config import RepoConfig

    work, hub_path, cids = pair
    with Repository.open(work.root) as other:
        remote.add(other, "second", str(hub_path))
    with open(work.dir / "config.toml", "a") as config:
        config.write("\n[retention]\nkeep_last = 7\n")
    remote.add(work, "third", str(hub_path))  # `work` read its config before either
    saved = RepoConfig.load(work.dir / "config.toml")
    assert sorted(saved.remotes) == ["origin", "second", "third"] and saved.retention.keep_last == 7
    with pytest.raises(CkptError, match="remote 'second' already exists"):
        remote.add(work, "second", str(hub_path))
    remote.remove(work, "third")
    assert sorted(RepoConfig.load(work.dir / "config.toml").remotes) == ["origin", "second"]


def test_a_lazy_clone_follows_its_origin_to_a_new_place_with_set_url(tmp_path):
    """`remote remove` refuses a lazy clone's origin and `remote add` said it exists: only a hand edit of the
    config pointed a clone at its moved origin (auditor)."""
    with Repository.init(tmp_path / "origin") as origin:
        cid = origin.commit(_state(3), message="c3")
    copy = remote.clone(str(tmp_path / "origin"), tmp_path / "copy", lazy=True)
    copy.close()
    shutil.move(tmp_path / "origin", tmp_path / "moved")
    with Repository.open(tmp_path / "copy") as copy:
        with pytest.raises(CorruptObjectError, match="ckpt remote set-url origin NEW-URL"):
            copy.checkout(cid)
        with pytest.raises(CkptError, match="remote 'origin' already exists .*ckpt remote set-url origin URL"):
            remote.add(copy, "origin", str(tmp_path / "moved"))
        remote.set_url(copy, "origin", str(tmp_path / "moved"))
        assert copy.config.remotes["origin"].lazy
    with Repository.open(tmp_path / "copy") as copy:  # read from the config it wrote
        assert_same(_state(3), copy.checkout(cid))
    assert ckpt_here(tmp_path / "copy", "remote", "set-url", "nowhere", "../moved").returncode == 1


def test_a_lazy_clone_never_makes_its_origins_missing_objects_folder(tmp_path):
    """Reading from an origin whose --objects folder was moved away made it anew, empty, in its place, and blamed
    a prune there (fourth reader)."""
    with Repository.init(tmp_path / "origin", objects_url=str(tmp_path / "objects")) as origin:
        cid = origin.commit(_state(4))
    remote.clone(str(tmp_path / "origin"), tmp_path / "copy", lazy=True).close()
    shutil.move(tmp_path / "objects", tmp_path / "elsewhere")
    with Repository.open(tmp_path / "copy") as copy, pytest.raises(CorruptObjectError, match="does not exist"):
        copy.checkout(cid)
    assert not (tmp_path / "objects").exists()


def test_push_of_head_sends_heads_branch_and_a_repository_is_no_remote_of_its_own(pair):
    """`ckpt push origin HEAD` said "unknown ref 'HEAD'"; git takes it for HEAD's branch. `remote add self .` was
    taken, and `push self main` "sent" (auditor)."""
    work, hub_path, cids = pair
    with pytest.raises(CkptError, match=r"is this repository itself: a remote is another repository"):
        remote.add(work, "self", str(work.root))
    remote.push(work, "origin", "HEAD")
    with Repository.open(hub_path) as hub:
        assert hub.branches() == {"main": cids[-1]}


def test_another_folder_joined_over_the_same_database_and_objects_is_no_remote(tmp_path):
    """`remote add machine1 /other/joined/folder` of the same shared repository was taken, and push 'succeeded'
    with nothing sent (reader)."""
    database, store = f"sqlite:///{tmp_path / 'shared.db'}", str(tmp_path / "objects")
    Repository.init(tmp_path / "a", metadata_url=database, objects_url=store).close()
    with Repository.init(tmp_path / "b", metadata_url=database, objects_url=store) as joined:
        with pytest.raises(CkptError, match=r"is this repository itself \(the same database and objects\)"):
            remote.add(joined, "machine1", str(tmp_path / "a"))
        assert joined.config.remotes == {}


def test_a_received_tensor_records_the_depth_of_its_chain_here(tmp_path):
    """A sender whose retention re-encoded each base as a keyframe pushed records of depth 1 while the remote's
    real chains grew a link per push: their depths stayed 1, so max_chain never held there (retention auditor)."""
    from ckptstore.policy import EncodingSettings
    from ckptstore.repo.config import RetentionPolicy
    from ckptstore.repo.pruning import prune

    Repository.init(tmp_path / "hub", encoding=EncodingSettings(max_chain=2)).close()
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=generator)
    with Repository.init(tmp_path / "work", encoding=EncodingSettings(max_chain=2)) as work:
        remote.add(work, "origin", str(tmp_path / "hub"))
        for step in range(5):
            w = w + 1e-3 * torch.randn(256, 256, generator=generator)
            work.commit({"w": w}, step=step)
            prune(work, RetentionPolicy(keep_last=1))
            remote.push(work, "origin")
    hub = sqlite3.connect(tmp_path / "hub" / ".ckpt" / "ckpt.db")
    with contextlib.closing(hub):
        rows = {tid: (base, depth) for tid, base, depth in hub.execute("SELECT id, base_id, depth FROM tensors")}
    lengths = {}
    for tid in rows:
        link, length = tid, 0
        while rows[link][0] is not None:
            link, length = rows[link][0], length + 1
        lengths[tid] = length
    assert max(lengths.values()) > 2  # the remote's chains do grow: only its own commits re-keyframe
    assert {tid: depth for tid, (_, depth) in rows.items()} == lengths
    with Repository.open(tmp_path / "hub") as opened:
        assert torch.equal(opened.checkout("main")["w"], w)


def _clone_of_a_pruned_hub(tmp_path, states: list[dict]) -> Repository:
    """A clone of repository hub, which holds `states` as steps 1, 2, ... (pushed by a seed) and was pruned to the
    last after the clone: its prune re-encoded that one as a keyframe."""
    from ckptstore.repo.config import RetentionPolicy
    from ckptstore.repo.pruning import prune

    Repository.init(tmp_path / "hub").close()
    with Repository.init(tmp_path / "seed") as seed:
        remote.add(seed, "origin", str(tmp_path / "hub"))
        for step, state in enumerate(states, 1):
            seed.commit(state, step=step)
        remote.push(seed, "origin")
    clone = remote.clone(str(tmp_path / "hub"), tmp_path / "clone")
    with Repository.open(tmp_path / "hub") as hub:
        prune(hub, RetentionPolicy(keep_last=1))
    return clone


def test_a_push_after_the_remote_pruned_sends_no_links_below_what_it_has(tmp_path):
    """After the origin's prune re-encoded step 2 as a keyframe, a clone's push of step 3 (a residual on step 2)
    sent step 1's keyframe again: bytes the origin did not need, left there for gc (retention auditor)."""
    from ckptstore.repo import gc

    generator = torch.Generator().manual_seed(0)
    w = torch.randn(512, 512, generator=generator)
    states = []
    for _ in (1, 2):
        w = w + 1e-3 * torch.randn(512, 512, generator=generator)
        states.append({"w": w})
    with _clone_of_a_pruned_hub(tmp_path, states) as clone:
        w = w + 1e-3 * torch.randn(512, 512, generator=generator)
        clone.commit({"w": w}, step=3)
        sent = remote.push(clone, "origin")
    with Repository.open(tmp_path / "hub") as hub:
        assert sent.commits == 1 and gc(hub).bytes_removed == 0  # nothing sent was garbage there
        assert torch.equal(hub.checkout("main")["w"], w) and fsck(hub).ok


def test_a_push_to_a_remote_on_a_read_only_file_system_names_the_remote(pair, monkeypatch):
    """"this repository is read-only here" blamed the user's own, writable repository (filesystems auditor); one
    found read-only on open was sent objects before the refusal, its message nested in another (reader 10)."""
    import errno

    from ckptstore.errors import ReadOnlyRepoError

    work, hub_path, _ = pair

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(hub_path / ".ckpt" / "objects" / "ab"))

    monkeypatch.setattr(remote, "_send_objects", read_only)
    with pytest.raises(ReadOnlyRepoError, match=rf"push to origin stopped: the remote \({hub_path}\) cannot be "
                                                r"written from here \(\[Errno 30\] Read-only file system: '.*'\); "
                                                r"'main' was not moved there"):
        remote.push(work, "origin")
    with Repository.open(hub_path) as hub:
        assert hub.branches() == {}
    monkeypatch.undo()
    from ckptstore.repo import repository  # one found read-only on open is refused before anything is sent

    monkeypatch.setattr(repository, "unwritable", lambda folder, *_: f"{folder} is not writable" if hub_path in
                        folder.parents or folder == hub_path / ".ckpt" else "")
    with pytest.raises(ReadOnlyRepoError, match=rf"push to origin refused: the remote \({hub_path}\) cannot be "
                                                r"written from here \(.*is not writable\); nothing was sent"):
        remote.push(work, "origin")
    assert _object_files(hub_path) == []
    monkeypatch.undo()
    remote.push(work, "origin")
    monkeypatch.setattr(repository, "unwritable", lambda folder, *_: f"{folder} is not writable" if hub_path in
                        folder.parents or folder == hub_path / ".ckpt" else "")
    again = remote.push(work, "origin")  # nothing to send: no write, so no refusal (reader 11)
    assert (again.commits, again.objects, again.refs_moved) == (0, 0, [])


@pytest.mark.parametrize("sharded", [False, True])
def test_a_received_record_that_lies_is_refused_at_checkout_load_and_export(tmp_path, sharded):
    """A forged origin's record named another tensor's chunks (its checksums copied): a clone's checkout, load and
    export wrote the other tensor's bytes and said nothing (hostile-input auditor, high). A true one is taken off
    the list at its first restore."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStorageReader
    from ckptstore.errors import CorruptRecordError

    state = {"a": torch.randn(256, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(256)}
    with Repository.init(tmp_path / "origin") as origin:
        if sharded:
            dcp.save(state, checkpoint_id=tmp_path / "step-1", no_dist=True)
            origin.commit(tmp_path / "step-1")
        else:
            origin.commit(state)
        entries = {p.split("/", 1)[0]: e.tensor for p, e in origin.manifest(origin.resolve("HEAD")).entries.items()
                   if e.shape == (256,)}  # "a" or "a/%shard/0/256"
    with remote.clone(str(tmp_path / "origin"), tmp_path / "honest") as honest:
        assert unchecked(honest, set(entries.values())) == set(entries.values())
        out = honest.checkout_to("HEAD", tmp_path / "honest-out")
        assert not unchecked(honest, set(entries.values())) and out.exists()
    received_lie(tmp_path / "origin" / ".ckpt", entries["b"], entries["a"], listed=False)
    with remote.clone(str(tmp_path / "origin"), tmp_path / "copy") as copy:
        lies = "does not rebuild the bytes its id names"
        if sharded:  # DCP wraps the reader's error: its text is in the rank's failure
            with pytest.raises(BaseException) as raised:  # CheckpointException is no Exception
                dcp.load({"a": torch.empty(256), "b": torch.empty(256)}, storage_reader=CkptStorageReader(copy),
                         no_dist=True)
            assert lies in str(getattr(raised.value, "failures", {0: raised.value})[0])
        else:
            with pytest.raises(CorruptRecordError, match=lies):
                copy.checkout("HEAD")
        assert unchecked(copy, {entries["b"]}) == {entries["b"]}
    for args in (("checkout", "HEAD", "-o", "out"), ("export", "HEAD", "-o", "out.safetensors")):
        refused = ckpt_here(tmp_path / "copy", *args)
        assert refused.returncode == 1 and lies in refused.stderr, refused.stderr
    assert not (tmp_path / "copy" / "out").exists() and not (tmp_path / "copy" / "out.safetensors").exists()


def test_a_received_records_lie_is_no_base_of_a_commit_here(tmp_path):
    """A commit chained on a received record naming another tensor's chunks; once a later commit encoded that
    record again, the first one's own checkout failed (hostile-input auditor, high)."""
    g = torch.Generator().manual_seed(1)
    honest = torch.randn(4096, generator=g)
    other = honest + 0.5 * torch.randn(4096, generator=g)
    with Repository.init(tmp_path / "origin") as origin:
        origin.commit({"b": honest, "c": other})
        entries = {p: e.tensor for p, e in origin.manifest(origin.resolve("HEAD")).entries.items()}
    received_lie(tmp_path / "origin" / ".ckpt", entries["b"], entries["c"], listed=False)
    with remote.clone(str(tmp_path / "origin"), tmp_path / "copy") as copy:
        near = other + 1e-4 * torch.randn(4096, generator=g)
        mine = copy.commit({"b": near, "c": other})
        copy.commit({"b": honest, "c": other})  # b's true bytes: the lie is encoded again, taking its row
        assert_same({"b": near, "c": other}, copy.checkout(mine))
        assert fsck(copy, full=True).ok


def test_a_commit_over_a_received_parent_that_lies_is_no_residual_on_it(tmp_path):
    """A listed parent record found false stayed the commit's base where it claimed no lossy source: the commit's
    residual rested on another tensor's chunks under a false id (mutation audit round 8)."""
    from ckptstore.metadata import tensors as tensor_rows

    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(4096, generator=generator), torch.randn(4096, generator=generator)
    with Repository.init(tmp_path / "origin") as origin:
        origin.commit({"w": a})
        other = origin.manifest(origin.commit({"w": b}, branch="side")).entries["w"].tensor
        claimed = origin.manifest(origin.resolve("main")).entries["w"].tensor
    received_lie(tmp_path / "origin" / ".ckpt", claimed, other, listed=False)  # a's id over b's chunks
    with remote.clone(str(tmp_path / "origin"), tmp_path / "copy") as copy:
        near = b + 1e-4 * torch.randn(4096, generator=generator)  # on main: its parent's 'w' is the lie
        mine = copy.commit({"w": near})
        tid = copy.manifest(mine).entries["w"].tensor
        with copy.db.read() as tx:
            assert tensor_rows.load_records(tx, [tid], with_bases=False)[tid].base_id != claimed
        assert_same(near, copy.checkout(mine)["w"])


def test_a_received_record_found_true_in_this_process_lets_no_forged_one_through_unchecked(tmp_path):
    """What this process found true is keyed by the records down to the keyframe: keyed without the keyframe,
    every received keyframe had the same key, and once one was found true a forged one restored its false bytes
    unchecked (mutation audit round 8)."""
    from ckptstore.errors import CorruptRecordError

    with Repository.init(tmp_path / "origin") as origin:
        honest = origin.commit({"t": torch.full((16,), 7.0)}, "honest")
        zeros = origin.manifest(origin.commit({"v": torch.zeros(16)}, "zeros")).entries["v"].tensor
        other = origin.manifest(origin.commit({"v": torch.arange(16.0)}, "arange", branch="side")).entries["v"].tensor
    received_lie(tmp_path / "origin" / ".ckpt", zeros, other, listed=False)  # zeros' id over arange's chunks
    with remote.clone(str(tmp_path / "origin"), tmp_path / "copy") as copy:
        assert_same(torch.full((16,), 7.0), copy.checkout(honest)["t"])  # a true keyframe, found so
        with pytest.raises(CorruptRecordError, match="does not rebuild the bytes its id names"):
            copy.checkout("main")
        assert unchecked(copy, {zeros}) == {zeros}


def _stepped_linear() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    """A layer and its Adam after one step: a state a lossy commit quantizes, weight and moments paired."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 256)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_received_manifests_claim_of_its_input_makes_no_lossy_commit_here_reuse_other_bytes(tmp_path, monkeypatch):
    """A received manifest's `sources` claimed that its exact record of other weights was made from the weight your
    lossy commit holds: your commit stored its weights, and fsck --full said ok (hostile-input auditor, high)."""
    from ckptstore.repo import manifest as manifests

    model, optimizer = _stepped_linear()
    mine = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with Repository.init(tmp_path / "probe") as probe:  # the id the weight has as a lossy input: anyone can compute it
        claimed = probe.manifest(probe.commit(mine, lossy="balanced")).sources["model/weight"]
    written = manifests.Manifest.to_record

    def forged(self):
        record = written(self)
        record["sources"] = {"model/weight": claimed}
        return record

    with Repository.init(tmp_path / "origin") as origin, monkeypatch.context() as forging:
        forging.setattr(manifests.Manifest, "to_record", forged)
        origin.commit({"model": {"weight": torch.full((256, 128), 0.1234), "bias": model.bias.detach().clone()},
                       "optimizer": optimizer.state_dict()})
    with remote.clone(str(tmp_path / "origin"), tmp_path / "copy") as copy:
        restored = copy.checkout(copy.commit(mine, lossy="balanced"))["model"]["weight"]
    assert (restored - model.weight.detach()).abs().max() < 0.01  # quantized, not the other weights


def test_a_received_manifests_claim_on_a_record_made_here_makes_no_lossy_commit_reuse_it(tmp_path, monkeypatch):
    """A pulled commit naming your own lossy record of Y, its manifest claiming that record was made from X: your
    next lossy commit of X stored Y's weights, and fsck --full said ok (reader, after d04e18e)."""
    from ckptstore.repo import manifest as manifests

    model, optimizer = _stepped_linear()
    y = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    x = {"model": {"weight": torch.full((256, 128), 0.1234), "bias": model.bias.detach().clone()},
         "optimizer": optimizer.state_dict()}
    with Repository.init(tmp_path / "probe") as probe:
        claimed = probe.manifest(probe.commit(x, lossy="balanced")).sources["model/weight"]
    Repository.init(tmp_path / "origin").close()
    with remote.clone(str(tmp_path / "origin"), tmp_path / "user") as user:
        user.commit(y, lossy="balanced")
        remote.push(user, "origin")
    written = manifests.Manifest.to_record

    def forged(self):
        record = written(self)
        record.setdefault("sources", {})["model/weight"] = claimed
        return record

    with remote.clone(str(tmp_path / "origin"), tmp_path / "other") as other, monkeypatch.context() as forging:
        forging.setattr(manifests.Manifest, "to_record", forged)
        other.commit(y, lossy="balanced", allow_empty=True)
        forging.undo()
        remote.push(other, "origin")
    with Repository.open(tmp_path / "user") as user:
        remote.pull(user, "origin")
        back = user.checkout(user.commit(x, lossy="balanced"))["model"]["weight"]
    assert (back - x["model"]["weight"]).abs().max() < 0.01


def test_a_pull_where_the_branch_here_is_ahead_moves_nothing(pair, tmp_path):
    """A commit made here after the clone: pull is up to date, not "diverged" (mutation audit: no test held it)."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with remote.clone(str(hub_path), tmp_path / "copy") as copy:
        ahead = copy.commit(_state(7), "only here")
        assert remote.pull(copy, "origin")[1] is None and copy.resolve("main") == ahead


def test_a_lazy_clone_reading_an_object_its_origin_holds_damaged_says_it_is_corrupted_and_keeps_no_copy(tmp_path):
    """Read unverified from the origin, rotten bytes were stored here under the id they no longer match and the
    checkout said the object was missing (mutation audit: no test held the check)."""
    from ckptstore.hashing import object_id

    with Repository.init(tmp_path / "origin") as origin:
        cid = origin.commit({"w": torch.randn(300_000, generator=torch.Generator().manual_seed(0))}, "one")
    objects = sorted((tmp_path / "origin" / ".ckpt" / "objects").glob("??/*"), key=lambda p: p.stat().st_size)
    with remote.clone(str(tmp_path / "origin"), tmp_path / "lazy", lazy=True) as lazy:
        biggest = objects[-1]
        biggest.chmod(0o644)
        data = bytearray(biggest.read_bytes())
        data[len(data) // 2] ^= 0xFF  # bit rot at the origin, same size
        biggest.write_bytes(bytes(data))
        with pytest.raises(CorruptObjectError, match="corrupted"):
            lazy.checkout(cid)
    held = list((tmp_path / "lazy" / ".ckpt" / "objects").glob("??/*"))
    assert all(p.parent.name + p.name == object_id(p.read_bytes()) for p in held)


def test_a_fetch_into_a_repository_holding_a_ref_named_as_its_tracking_ref_says_what_to_delete(tmp_path):
    """A tag `remotes/origin/main` (older versions allowed the name) met the tracking ref with a database error
    (UNIQUE constraint) where the guard is gone (mutation audit)."""
    with Repository.init(tmp_path / "a") as a:
        a.commit({"w": torch.arange(4.0)}, step=1)
    with Repository.init(tmp_path / "b") as b:
        remote.add(b, "origin", str(tmp_path / "a"))
    with contextlib.closing(sqlite3.connect(tmp_path / "b" / ".ckpt" / "ckpt.db")) as db, db:
        db.execute("INSERT INTO refs (name, kind, commit_id, target) VALUES ('remotes/origin/main', 'tag', NULL, "
                   "NULL)")
    with Repository.open(tmp_path / "b") as b, pytest.raises(CkptError, match="ckpt tag -d"):
        remote.fetch(b, "origin")


def test_a_push_of_a_history_holding_commits_pruned_here_sends_their_rows_and_restores_the_rest(pair):
    """A commit pruned here travels as one pruned there: its row and mark, never its manifest (gone with the
    prune); the push asked for that manifest and refused the history as damaged (mutation audit)."""
    from ckptstore.repo import gc
    from ckptstore.repo.config import RetentionPolicy
    from ckptstore.repo.pruning import prune

    work, hub_path, cids = pair
    tip = work.commit(_state(2), message="c2")
    assert sorted(prune(work, RetentionPolicy(keep_last=1)).pruned) == sorted(cids)
    gc(work)
    report = remote.push(work, "origin")
    assert report.commits == 3 and report.refs_moved == [("main", None, tip)]
    assert _object_files(hub_path) == _object_files(work.root)
    with Repository.open(hub_path) as hub:
        assert [(c.id, c.pruned) for c in hub.log()] == [(tip, False), (cids[1], True), (cids[0], True)]
        assert_same(_state(2), hub.checkout(tip)) and fsck(hub).ok
        with pytest.raises(CkptError, match="pruned"):
            hub.checkout(cids[0])


def test_a_read_only_push_is_refused_as_this_repository_being_read_only_before_the_remote_changes(pair):
    """`ckpt --read-only push` sent the objects and records, then failed recording the tracking ref, blaming the
    remote ("the remote cannot be written from here") for this repository's --read-only (mutation audit)."""
    work, hub_path, _ = pair
    refused = ckpt_here(work.root, "--read-only", "push")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"error: push (it records the remote's branch here) would write to the "
                                     f"repository at {work.root}, which is read-only here (opened with --read-only)")
    assert "remote (" not in refused.stderr
    assert _object_files(hub_path) == []
    with Repository.open(hub_path) as hub:
        assert hub.branches() == {} and hub.log() == []
    assert "origin/main" not in work.branches()


def test_a_push_does_not_recreate_a_remote_branch_deleted_while_it_sent(pair, monkeypatch):
    """The compare-and-swap expected the branch where the push found it: one deleted meanwhile was made again at
    our tip, undoing the remote owner's delete without a word (mutation audit)."""
    from ckptstore import faults

    work, hub_path, cids = pair
    work.branch("exp", "HEAD")
    remote.push(work, "origin", "exp")
    newer = work.commit(_state(2), message="c2", branch="exp")
    passing = faults.point

    def deleted_there(name):  # the remote's owner deletes exp once our records are sent
        if name == "transfer:records-sent":
            with Repository.open(hub_path) as hub, pytest.warns(RuntimeWarning, match="leaves 2 commits behind"):
                hub.delete_branch("exp")
        passing(name)

    monkeypatch.setattr(faults, "point", deleted_there)
    with pytest.raises(ConflictError, match="push to origin lost a race: while the commits were sent, its branch "
                                            "'exp' was deleted there; run the push again to make it anew"):
        remote.push(work, "origin", "exp")
    monkeypatch.undo()
    with Repository.open(hub_path) as hub:
        assert hub.branches() == {} and fsck(hub).ok
        assert_same(_state(2), hub.checkout(newer))  # the commit went, whole, unreferenced
    assert work.resolve("origin/exp") == cids[1]  # the tracking ref did not move either


def test_fsck_of_a_remote_says_to_collect_its_unreferenced_objects_there(pair, monkeypatch):
    """`fsck --remote` said "run `ckpt gc`", which collected the local repository and left the remote's (auditor)."""
    from ckptstore import faults

    work, hub_path, _ = pair

    def dies(name):
        if name == "transfer:objects-sent":
            raise KeyboardInterrupt  # the push stops with its objects there and no records
    monkeypatch.setattr(faults, "point", dies)
    with pytest.raises(KeyboardInterrupt):
        remote.push(work, "origin")
    monkeypatch.undo()
    checked = ckpt_here(work.root, "fsck", "--remote", "origin")
    assert checked.returncode == 0 and "unreferenced objects (run `ckpt gc` there to remove them" in checked.stdout
    assert "(run `ckpt gc` to remove them" in ckpt_here(hub_path, "fsck").stdout  # in the remote itself: plain


@pytest.mark.parametrize("branch_there", [False, True])
def test_a_push_that_another_push_of_the_same_commit_beats_succeeds(pair, monkeypatch, branch_there):
    """A retried job pushing the commit its first try was still pushing: the branch ended at that commit, but
    the loser said "lost a race" with exit 3 and set no tracking ref (auditor)."""
    from ckptstore import faults
    from ckptstore.metadata import refs as ref_rows

    work, hub_path, cids = pair
    if branch_there:
        remote.push(work, "origin")
    passing = faults.point

    def same_commit_pushed_there(name):  # the other push of this commit lands once our records are sent
        if name == "transfer:records-sent":
            with Repository.open(hub_path) as hub, hub.db.write() as tx:
                if branch_there:
                    assert ref_rows.swap(tx, "main", ref_rows.BRANCH, cids[1], newest)
                else:
                    ref_rows.insert_ref(tx, "main", ref_rows.BRANCH, newest)
        passing(name)

    newest = work.commit(_state(2), message="c2") if branch_there else cids[1]
    monkeypatch.setattr(faults, "point", same_commit_pushed_there)
    remote.push(work, "origin")
    monkeypatch.undo()
    assert work.resolve("origin/main") == newest
    with Repository.open(hub_path) as hub:
        assert hub.resolve("main") == newest and fsck(hub).ok


def test_a_push_whose_new_branch_name_became_a_remote_tag_meanwhile_says_so_not_to_push_again(pair, monkeypatch):
    """A tag made under the branch's name while it sent was called 'its branch was made', with advice to push
    again, which was refused as a tag (reader 27)."""
    from ckptstore import faults

    work, hub_path, cids = pair
    remote.push(work, "origin")
    work.branch("exp", "HEAD")
    work.commit(_state(2), message="c2", branch="exp")
    passing = faults.point

    def tagged_there(name):  # the remote's owner tags its main under the name once our records are sent
        if name == "transfer:records-sent":
            with Repository.open(hub_path) as hub:
                hub.tag("exp", "main")
        passing(name)

    monkeypatch.setattr(faults, "point", tagged_there)
    with pytest.raises(ConflictError, match=r"lost a race: while the commits were sent, a tag named 'exp' was made "
                                            r"there, so no branch of that name can be; branch your commit under "
                                            r"another name here \(`ckpt branch NAME`\) and push that"):
        remote.push(work, "origin", "exp")
    monkeypatch.undo()
    with Repository.open(hub_path) as hub:
        assert "exp" not in hub.branches() and hub.resolve("exp") == hub.resolve("main") and fsck(hub).ok


def _lossy_origin_in_small_chunks(root, w0, w1):
    """A repository cut into 64 KiB chunks holding w0 and w1 at balanced (w1 a residual on w0's record)."""
    Repository.init(root).close()
    config = root / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace("chunk_bytes = 4194304", "chunk_bytes = 65536"))
    with Repository.open(root) as origin:
        c0 = origin.commit({"w": w0}, message="c0", lossy="balanced")
        c1 = origin.commit({"w": w1}, message="c1", lossy="balanced")
        return c1, origin.manifest(c0).entries["w"].tensor, origin.checkout(c1)


def _w0_w1():
    generator = torch.Generator().manual_seed(0)
    w0 = torch.randn(256, 256, generator=generator)
    return w0, w0 + 0.01 * torch.randn(256, 256, generator=generator)


def test_a_received_lossy_record_committed_again_under_other_chunking_keeps_the_commits_chained_on_it(tmp_path):
    """A commit that encoded a listed record's tensor again took its rows; cut into other chunks (a clone with
    its own chunk_bytes), the residuals chained on it no longer decoded: an older commit unrestorable (reader 30).
    Found true, it keeps its rows and leaves the list."""
    w0, w1 = _w0_w1()
    c1, listed, restored = _lossy_origin_in_small_chunks(tmp_path / "a", w0, w1)
    with remote.clone(str(tmp_path / "a"), tmp_path / "b") as copy:  # the default 4 MiB chunks here
        assert unchecked(copy, {listed}) == {listed}
        again = copy.commit({"w": w0}, message="w0 again", lossy="balanced")
        assert copy.manifest(again).entries["w"].tensor == listed
        # its manifest is the origin's c0's, and its encoding's objects are no record's (left to gc): nothing stored
        assert copy.commit_info(again).stored_bytes == 0
        assert_same(restored, copy.checkout(c1))
        assert unchecked(copy, {listed}) == set() and fsck(copy, full=True).ok


@pytest.mark.parametrize("damage", ["lie", "chunks lost"])
def test_a_false_or_damaged_received_record_cut_otherwise_takes_the_rows_of_the_commit_that_encodes_it(
        tmp_path, damage):
    """Cut otherwise, a listed record kept its rows whatever they held: a lie (the origin chose its chunks) or rows
    lost in the database, and the user's new commit named it, unrestorable (reader 31)."""
    w0, w1 = _w0_w1()
    c1, listed, _ = _lossy_origin_in_small_chunks(tmp_path / "a", w0, w1)
    with remote.clone(str(tmp_path / "a"), tmp_path / "b") as copy:
        if damage == "lie":  # the listed record's rows are w1's, cut in the origin's 64 KiB chunks: otherwise
            received_lie(copy.dir, listed, copy.manifest(c1).entries["w"].tensor)
        else:
            with sqlite3.connect(copy.dir / "ckpt.db") as db:
                db.execute("DELETE FROM tensor_chunks WHERE tensor_id = ?", (listed,))
        mine = copy.commit({"w": w0}, message="my w0", lossy="balanced")
        assert copy.manifest(mine).entries["w"].tensor == listed
        expected = copy.checkout(mine)["w"]
        assert (expected - w0).abs().max() < 0.1  # the balanced reconstruction of my own w0
        assert unchecked(copy, {listed}) == set()
        assert set(fsck(copy, full=True).broken_commits) <= {c1}  # chained on the false rows: broken before too




def _renamed(repo_dir, old: str, new: str) -> None:
    """Give tensor `old`'s record, chunks and listing the id `new`, and point what rests on it there: a crafted
    remote's lie whose own records chain on it consistently."""
    with sqlite3.connect(repo_dir / "ckpt.db") as db:
        for statement in ("UPDATE tensors SET id = ? WHERE id = ?", "UPDATE tensors SET base_id = ? WHERE base_id = ?",
                          "UPDATE tensor_chunks SET tensor_id = ? WHERE tensor_id = ?",
                          "UPDATE unchecked_tensors SET tensor_id = ? WHERE tensor_id = ?"):
            db.execute(statement, (new, old))


@pytest.mark.parametrize("lie", ["moved", "copied"])
def test_a_received_record_true_only_through_a_false_base_stays_true_once_a_commit_replaces_that_base(tmp_path, lie):
    """A received record decoded true through a listed base that lies about its id; a commit reused it, and a later
    commit of the bytes that base claims replaced its rows: the first commit no longer restored (stop 57, left).
    The false base now moves, rows and all, to the id of the bytes it holds (or gives way to that id's own record),
    and what rests on it follows."""
    generator = torch.Generator().manual_seed(3)
    held, claimed = torch.randn(128, 64, generator=generator), torch.randn(128, 64, generator=generator)
    on_top = held + 0.001 * torch.randn(128, 64, generator=generator)
    Repository.init(tmp_path / "a").close()
    with Repository.open(tmp_path / "a") as origin:
        first = origin.commit({"w": held}, message="held")
        second = origin.commit({"w": on_top}, message="on top")
        on_top_id = origin.manifest(second).entries["w"].tensor
    with remote.clone(str(tmp_path / "a"), tmp_path / "b") as copy:
        if lie == "moved":  # held's record now claims `claimed`, and on_top rests on it
            _renamed(copy.dir, _ident(held), _ident(claimed))
        else:  # a copy of held's record claims `claimed`, and on_top rests on the copy
            received_lie(copy.dir, _ident(claimed), _ident(held))
            with sqlite3.connect(copy.dir / "ckpt.db") as db:
                db.execute("UPDATE tensors SET base_id = ? WHERE id = ?", (_ident(claimed), on_top_id))
        mine = copy.commit({"w": on_top}, message="mine, as received", allow_empty=True)
        assert copy.manifest(mine).entries["w"].tensor == on_top_id and unchecked(copy, {on_top_id}) == set()
        theirs = copy.commit({"w": claimed}, message="the bytes the lie claims")
        assert_same(on_top, copy.checkout(mine)["w"])
        assert_same(claimed, copy.checkout(theirs)["w"])
        assert_same(on_top, copy.checkout(second)["w"])
        assert_same(held, copy.checkout(first)["w"])  # the lie's rows hold `held`: its commit restores again
        assert fsck(copy, full=True).ok


def _ident(tensor: torch.Tensor) -> str:
    from ckptstore.hashing import tensor_id

    return tensor_id(str(tensor.dtype), tuple(tensor.shape), tensor.contiguous().numpy().view("uint8").reshape(-1))


def _base_of(repo_dir, tid: str) -> str | None:
    with contextlib.closing(sqlite3.connect(repo_dir / "ckpt.db")) as db:
        return db.execute("SELECT base_id FROM tensors WHERE id = ?", (tid,)).fetchone()[0]


def _chain_ends(repo_dir, tid: str) -> bool:
    """Whether `tid`'s chain of base_ids in the database reaches a keyframe without coming back on itself."""
    seen = set()
    with contextlib.closing(sqlite3.connect(repo_dir / "ckpt.db")) as db:
        while tid is not None and tid not in seen:
            seen.add(tid)
            row = db.execute("SELECT base_id FROM tensors WHERE id = ?", (tid,)).fetchone()
            tid = row[0] if row else None
    return tid is None


def _exact_or_refused(repo, cid: str, key: str, want: torch.Tensor) -> bool:
    """Whether `cid` restores `want` at `key` bit-exact; False where it is refused: never other bytes."""
    try:
        got = repo.checkout(cid)[key]
    except CkptError:
        return False
    assert_same(want, got)
    return True


def _held_on_top_origin(root, chunk_bytes: int | None = None, shape=(128, 64)):
    """An origin holding `held`, then `on_top` (a residual on held's record); and `claimed`, which it never holds."""
    generator = torch.Generator().manual_seed(3)
    held, claimed = torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)
    on_top = held + 0.001 * torch.randn(*shape, generator=generator)
    Repository.init(root).close()
    if chunk_bytes is not None:
        config = root / ".ckpt" / "config.toml"
        config.write_text(config.read_text().replace("chunk_bytes = 4194304", f"chunk_bytes = {chunk_bytes}"))
    with Repository.open(root) as origin:
        first = origin.commit({"w": held}, message="held")
        second = origin.commit({"w": on_top}, message="on top")
        assert _base_of(root / ".ckpt", origin.manifest(second).entries["w"].tensor) == _ident(held)
        return held, claimed, on_top, first, second


@pytest.mark.parametrize("together", [False, True])
def test_a_false_base_moved_to_the_id_whose_own_record_rests_on_it_makes_no_loop(tmp_path, together):
    """A false base's move rebased its records onto its bytes' id's own record, resting on them: a loop (reader 33)."""
    held, claimed, on_top, first, second = _held_on_top_origin(tmp_path / "a")
    with remote.clone(str(tmp_path / "a"), tmp_path / "b") as copy:
        _renamed(copy.dir, _ident(held), _ident(claimed))  # held's record claims `claimed`; on_top rests on it
        on_top_id = copy.manifest(second).entries["w"].tensor
        mine = copy.commit({"w": on_top}, message="mine, as received", allow_empty=True)
        if together:  # held as a residual on on_top (the parent's record at 'w'), in the commit that replaces the lie
            x = theirs = copy.commit({"w": held, "v": claimed}, message="both")
        else:
            x = copy.commit({"w": held}, message="the bytes the lie holds")
            assert _base_of(copy.dir, _ident(held)) == on_top_id  # X's own record rests on on_top, on the lie
            assert_same(held, copy.checkout(x)["w"])
            theirs = copy.commit({"w": claimed}, message="the bytes the lie claims")
        assert all(_chain_ends(copy.dir, tid) for tid in (_ident(held), on_top_id, _ident(claimed)))
        assert_same(held, copy.checkout(x)["w"])
        assert_same(claimed, copy.checkout(theirs)["v" if together else "w"])
        assert_same(on_top, copy.checkout(mine)["w"])
        assert_same(on_top, copy.checkout(second)["w"])
        assert_same(held, copy.checkout(first)["w"])
        assert fsck(copy, full=True).ok


@pytest.mark.parametrize("held_depth", [1, 3])
def test_records_rebased_onto_a_deeper_own_record_record_their_new_depth(tmp_path, held_depth):
    """A false base's records rebased onto its bytes' id's own record, three levels deep, kept their old depth: the
    chain limit, which reads it, let later commits chain past it (reader 33, left in stop 58)."""
    held, claimed, on_top, first, second = _held_on_top_origin(tmp_path / "a")
    remote.clone(str(tmp_path / "a"), tmp_path / "b").close()
    config = tmp_path / "b" / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace('max_chain = "auto"', "max_chain = 8"))
    generator = torch.Generator().manual_seed(11)
    with Repository.open(tmp_path / "b") as copy:
        _renamed(copy.dir, _ident(held), _ident(claimed))  # held's record claims `claimed`; on_top rests on it
        on_top_id = copy.manifest(second).entries["w"].tensor
        mine = copy.commit({"w": on_top}, message="mine, as received", allow_empty=True)
        above = on_top + 1e-4 * torch.randn(on_top.shape, generator=generator)
        over = copy.commit({"w": above}, message="a residual resting on on_top")
        over_id = copy.manifest(over).entries["w"].tensor
        for k in range(held_depth, -1, -1):  # held's own record, at the end of a chain of its own under another key
            copy.commit({"u": held + k * 1e-4 * torch.randn(held.shape, generator=generator)}, branch="other")
        assert [_depth(copy.dir, tid) for tid in (_ident(held), on_top_id, over_id)] == [held_depth, 1, 2]
        assert _base_of(copy.dir, over_id) == on_top_id
        theirs = copy.commit({"w": claimed}, message="the bytes the lie claims")
        assert _base_of(copy.dir, on_top_id) == _ident(held)  # rebased onto held's own record
        # and what rests on it follows (at 1, each was as deep as its new base: reader 39's `<` mutant)
        assert [_depth(copy.dir, tid) for tid in (on_top_id, over_id)] == [held_depth + 1, held_depth + 2]
        assert_same(above, copy.checkout(over)["w"])
        assert_same(on_top, copy.checkout(mine)["w"])
        assert_same(claimed, copy.checkout(theirs)["w"])
        assert fsck(copy, full=True).ok


def _depth(repo_dir, tid: str) -> int:
    with contextlib.closing(sqlite3.connect(repo_dir / "ckpt.db")) as db:
        return db.execute("SELECT depth FROM tensors WHERE id = ?", (tid,)).fetchone()[0]


@pytest.mark.parametrize("lower_first", [True, False])
def test_two_false_records_in_one_chain_replaced_by_one_commit_keep_what_rests_on_them(tmp_path, lower_first):
    """Two false bases in a chain, one commit: the upper moved as loaded, onto replaced rows; broke (reader 33)."""
    generator = torch.Generator().manual_seed(5)
    a0 = torch.randn(128, 64, generator=generator)
    b0 = a0 + 0.001 * torch.randn(128, 64, generator=generator)
    c0 = b0 + 0.001 * torch.randn(128, 64, generator=generator)
    while True:  # the lies' ids in the order the case needs: the loop takes the one sorting lower first
        a1, b1 = torch.randn(128, 64, generator=generator), torch.randn(128, 64, generator=generator)
        if (_ident(a1) < _ident(b1)) == lower_first:
            break
    Repository.init(tmp_path / "a").close()
    with Repository.open(tmp_path / "a") as origin:
        cids = [origin.commit({"w": w}, message=f"w{i}") for i, w in enumerate((a0, b0, c0))]
    with remote.clone(str(tmp_path / "a"), tmp_path / "b") as copy:
        _renamed(copy.dir, _ident(a0), _ident(a1))  # a0's record claims a1, b0's claims b1 and rests on it
        _renamed(copy.dir, _ident(b0), _ident(b1))
        assert _base_of(copy.dir, _ident(b1)) == _ident(a1)
        mine = copy.commit({"w": c0}, message="mine, as received", allow_empty=True)
        assert_same(c0, copy.checkout(mine)["w"])
        theirs = copy.commit({"u": a1, "v": b1}, message="the bytes both lies claim")
        assert_same({"u": a1, "v": b1}, copy.checkout(theirs))
        assert_same(c0, copy.checkout(mine)["w"])
        for cid, w in zip(cids, (a0, b0, c0)):
            assert_same(w, copy.checkout(cid)["w"])
        assert all(_chain_ends(copy.dir, tid) for tid in map(_ident, (a0, b0, c0, a1, b1)))
        assert fsck(copy, full=True).ok


def test_a_lossy_false_base_moved_to_the_id_of_its_bytes_stays_listed_there(tmp_path):
    """A lossy false base moved to its bytes' id stays listed there: its `source` is no more checked (reader 33)."""
    w0, w1 = _w0_w1()
    claimed = torch.randn(256, 256, generator=torch.Generator().manual_seed(9))
    Repository.init(tmp_path / "a").close()
    with Repository.open(tmp_path / "a") as origin:
        c0 = origin.commit({"w": w0}, message="c0", lossy="balanced")
        c1 = origin.commit({"w": w1}, message="c1", lossy="balanced")
        held, restored = origin.manifest(c0).entries["w"].tensor, origin.checkout(c0)
    with remote.clone(str(tmp_path / "a"), tmp_path / "b") as copy:
        on_top = copy.manifest(c1).entries["w"].tensor
        with contextlib.closing(sqlite3.connect(copy.dir / "ckpt.db")) as db:
            assert '"source"' in db.execute("SELECT params FROM tensors WHERE id = ?", (held,)).fetchone()[0]
        expected = copy.checkout(c1)
        _renamed(copy.dir, held, _ident(claimed))  # the lossy w0 record claims `claimed`; c1's record rests on it
        assert _base_of(copy.dir, on_top) == _ident(claimed) and unchecked(copy, {held}) == set()
        theirs = copy.commit({"w": claimed}, message="the bytes the lie claims")
        assert _base_of(copy.dir, on_top) == held  # the lie moved to the id of what it holds, c1 with it
        assert unchecked(copy, {held}) == {held}  # lossy: its source is as unchecked as it was
        assert_same(claimed, copy.checkout(theirs)["w"])
        assert_same(expected, copy.checkout(c1))
        assert_same(restored, copy.checkout(c0))
        assert fsck(copy, full=True).ok


@pytest.mark.parametrize("own", ["cut otherwise", "false"])
def test_what_rests_on_a_false_base_is_not_rebased_onto_an_own_record_that_cannot_carry_it(tmp_path, own):
    """Records on a false base stay on it, not onto its bytes' id's own record cut otherwise or false (reader 33)."""
    chunking = {"chunk_bytes": 65536, "shape": (256, 256)} if own == "cut otherwise" else {}
    held, claimed, on_top, first, second = _held_on_top_origin(tmp_path / "a", **chunking)
    other = torch.randn(*held.shape, generator=torch.Generator().manual_seed(11))
    with remote.clone(str(tmp_path / "a"), tmp_path / "b") as copy:  # the default 4 MiB chunks here
        _renamed(copy.dir, _ident(held), _ident(claimed))  # held's record claims `claimed`; on_top rests on it
        on_top_id = copy.manifest(second).entries["w"].tensor
        mine = copy.commit({"w": on_top}, message="mine, as received", allow_empty=True)
        assert_same(on_top, copy.checkout(mine)["w"])
        if own == "cut otherwise":  # held's own record, made here: one 4 MiB chunk, the lie's rows four of 64 KiB
            own_commit, own_key, own_bytes = copy.commit({"x": held}, message="held, here"), "x", held
            with contextlib.closing(sqlite3.connect(copy.dir / "ckpt.db")) as db:
                count = "SELECT count(*) FROM tensor_chunks WHERE tensor_id = ?"
                assert [db.execute(count, (t,)).fetchone()[0] for t in (_ident(held), _ident(claimed))] == [1, 4]
        else:  # held's own record, received and listed, holds `other`'s bytes
            own_commit, own_key, own_bytes = copy.commit({"o": other}, message="other, here"), "o", other
            received_lie(copy.dir, _ident(held), _ident(other))
        theirs = copy.commit({"v": claimed}, message="the bytes the lie claims")
        assert _base_of(copy.dir, on_top_id) == _ident(claimed)  # left on the false id, as before 0a9c15e
        assert_same(claimed, copy.checkout(theirs)["v"])
        assert_same(own_bytes, copy.checkout(own_commit)[own_key])
        # on the replaced rows they no longer decode, as before; but none restores other bytes
        for cid, want in ((mine, on_top), (second, on_top), (first, held)):
            _exact_or_refused(copy, cid, "w", want)
        if own == "cut otherwise":
            assert_same(held, copy.checkout(first)["w"])  # its id's own record, made here
        else:
            assert unchecked(copy, {_ident(held)}) == {_ident(held)}
        assert set(fsck(copy, full=True).broken_commits) <= {first, second, mine}


def test_a_push_keeps_the_tracking_refs_of_the_remotes_other_branches(pair):
    """A push moves its branch's tracking ref and leaves the remote's others as they are (mutation audit round 12)."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    with Repository.open(hub_path) as hub:
        hub.branch("dev", "main")
    remote.fetch(work, "origin")
    newer = work.commit(_state(2), message="mine")
    assert remote.push(work, "origin", "main").refs_moved == [("main", cids[1], newer)]
    assert work.resolve("origin/main") == newer and work.resolve("origin/dev") == cids[1]


def test_a_fetch_reads_only_its_own_remotes_tracking_refs(pair, tmp_path):
    """A fetch from one remote never takes another's tracking refs for its own (mutation audit round 12)."""
    work, _, cids = pair
    remote.push(work, "origin")
    with Repository.init(tmp_path / "other") as other:  # a remote whose name is as long as origin's
        theirs = other.commit(_state(5), message="theirs")
    remote.add(work, "backup", str(tmp_path / "other"))
    assert remote.fetch(work, "backup").refs_moved == [("backup/main", None, theirs)]
    assert work.resolve("backup/main") == theirs and work.resolve("origin/main") == cids[1]


@pytest.mark.parametrize("spelled", ["hub", "hub/", "hub/.", "./hub/./"])
def test_a_clone_without_a_folder_makes_one_named_after_the_remote(pair, tmp_path, spelled):
    """`ckpt clone ../hub/.` took the URL's last part, ".", and made the repository in the current folder (auditor)."""
    work, hub_path, cids = pair
    remote.push(work, "origin")
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine\n")
    cloned = ckpt_here(here, "clone", f"../{spelled}")
    assert cloned.returncode == 0, cloned.stderr
    assert not (here / ".ckpt").exists()
    with Repository.open(here / "hub") as copy:
        assert copy.resolve("main") == cids[1]


@pytest.mark.parametrize("lazy_fetch", [True, False])
def test_a_tensor_the_origin_stored_anew_reaches_a_lazy_clone_in_its_new_objects(tmp_path, lazy_fetch):
    """The origin collected a branch's tensor, then committed the same bytes on main in other objects: a lazy clone
    kept its record of the old objects (gone everywhere), so the fetched main could not be restored there, nor after a
    pull, and fsck called it broken (model-based audit, helper 288, high)."""
    from ckptstore.repo import gc

    g = torch.Generator().manual_seed(1)
    w0, w2 = torch.randn(5000, generator=g), torch.randn(5000, generator=g)
    w1 = w0.clone()
    w1[7] += 1.0  # a residual against w0 where it is first stored
    with Repository.init(tmp_path / "origin") as origin:
        origin.commit({"w": w0, "step": 0})
        origin.branch("dev")
        origin.commit({"w": w2, "step": 1})
        origin.commit({"w": w1, "step": 2}, branch="dev")
    with remote.clone(str(tmp_path / "origin"), tmp_path / "lazy", lazy=True) as clone:
        clone.delete_branch("dev")
        with Repository.open(tmp_path / "origin") as origin:
            origin.delete_branch("dev")
            assert gc(origin, prune_unreachable=True).commits_removed == 1
            y = origin.commit({"w": w1, "step": 3})  # the same tensor again, now on w2's chain
        report = remote.fetch(clone, "origin", lazy=lazy_fetch)
        assert clone.resolve("origin/main") == y and report.tensors >= 1
        assert_same(clone.checkout("origin/main"), {"w": w1, "step": 3})
        assert fsck(clone).ok
        remote.pull(clone, "origin")
        assert_same(clone.checkout("main"), {"w": w1, "step": 3})


def test_a_second_remote_never_replaces_a_lazy_clones_record_its_origin_holds(tmp_path):
    """A hostile remote recorded the origin's tensor in another tensor's chunks and committed on it: fetching it into a
    lazy clone that had not read the tensor yet replaced the clone's record, so the origin's own commit could not be
    checked out there, and plain fsck said ok (auditor helper 308, high)."""
    w, v = torch.randn(4096, generator=torch.Generator().manual_seed(3)), torch.ones(4096)
    with Repository.init(tmp_path / "origin") as origin:
        mine = origin.commit({"w": w}, message="origin's")
    shutil.copytree(tmp_path / "origin", tmp_path / "evil")
    with Repository.open(tmp_path / "evil") as evil:
        theirs = evil.commit({"w": w, "v": v}, message="innocent")
        tw, tv = (evil.manifest(theirs).entries[name].tensor for name in ("w", "v"))
    db = sqlite3.connect(tmp_path / "evil" / ".ckpt" / "ckpt.db")
    columns = 'position, object_id, raw_bytes, "offset", length, checksum'
    db.execute("DELETE FROM tensor_chunks WHERE tensor_id = ?", (tw,))
    db.execute(f"INSERT INTO tensor_chunks (tensor_id, {columns}) SELECT ?, {columns} FROM tensor_chunks "
               "WHERE tensor_id = ?", (tw, tv))
    db.execute("UPDATE tensors SET codec = (SELECT codec FROM tensors WHERE id = ?), params = (SELECT params FROM "
               "tensors WHERE id = ?) WHERE id = ?", (tv, tv, tw))
    db.commit()
    db.close()
    with remote.clone(str(tmp_path / "origin"), tmp_path / "lazy", lazy=True) as clone:
        remote.add(clone, "evil", str(tmp_path / "evil"))
        with pytest.raises(CkptError, match="not this repository's lazy origin"):  # its objects would come from nowhere
            remote.fetch(clone, "evil", lazy=True)
        assert remote.fetch(clone, "evil").commits == 1
        assert_same(clone.checkout(mine), {"w": w})
        assert_same(clone.checkout("evil/main"), {"w": w, "v": v})  # w read through the origin, which holds it
        assert fsck(clone, full=True).ok

"""Clone, pull and push at their edges (repo/remote.py, metadata/transfer.py): what a damaged, crafted or unusual
origin or work tree makes of them. Each test fails on a mutant that survived the suite (mutation audit round 12b)."""
import pytest
import torch

from ckptstore import Repository
from ckptstore.repo import remote
from tests.conftest import ckpt_here
from tests.repo.test_remote import _clone_of_a_pruned_hub, _cloned, _commit, _pushed


def test_a_pull_onto_an_in_memory_commit_moves_the_branch_and_leaves_the_files(tmp_path):
    """The pull tried to write an
    in-memory commit in place, failed, and moved the branch back: a plain fast-forward refused."""
    _cloned(tmp_path)
    with Repository.open(tmp_path / "a") as a:
        new = a.commit({"w": torch.full((256,), 7.0)}, message="in memory")
    pulled = ckpt_here(tmp_path / "c", "pull")
    assert pulled.returncode == 0, pulled.stderr
    with Repository.open(tmp_path / "c") as c:
        assert c.resolve("main") == new
    assert torch.equal(torch.load(tmp_path / "c" / "ck.pt", weights_only=True)["w"], torch.full((256,), 1.0))


def _hub_with(tmp_path, branches, head):
    """A hub whose refs were written raw (a damaged or crafted origin, or one an older ckptstore made)."""
    import sqlite3

    with Repository.init(tmp_path / "hub") as hub:
        cid = hub.commit({"w": torch.full((256,), 1.0)}, message="one")
    db = sqlite3.connect(tmp_path / "hub" / ".ckpt" / "ckpt.db")
    for name in branches:
        db.execute("INSERT INTO refs (name, kind, commit_id, target) VALUES (?, 'branch', ?, NULL)", (name, cid))
    db.execute("UPDATE refs SET target = ? WHERE name = 'HEAD'", (head,))
    db.commit()
    db.close()
    return cid


def test_a_clone_makes_no_local_branch_named_as_a_tracking_ref_of_origin(tmp_path):
    """Origin's branch 'origin/x' became local branch origin/x, hiding the tracking ref of its 'x'."""
    _hub_with(tmp_path, ["origin/x", "x"], "main")
    with remote.clone(str(tmp_path / "hub"), tmp_path / "copy") as copy:
        assert "origin/x" not in copy.branches() and sorted(copy.branches()) == ["main", "x"]


def test_a_clone_makes_no_local_branch_that_reads_as_a_commit_id(tmp_path):
    """Origin's branch 'abcdef12' (legal there, from an older ckptstore) became a local branch
    that hides every commit whose id starts so."""
    _hub_with(tmp_path, ["abcdef12"], "main")
    with remote.clone(str(tmp_path / "hub"), tmp_path / "copy") as copy:
        assert sorted(copy.branches()) == ["main"]


def test_a_clone_of_an_origin_whose_head_names_a_tracking_ref_checks_out_main(tmp_path):
    """HEAD 'origin/main' there put HEAD here on an unborn branch origin/main (hiding the tracking ref)."""
    cid = _hub_with(tmp_path, [], "origin/main")
    with remote.clone(str(tmp_path / "hub"), tmp_path / "copy") as copy:
        assert copy.head() == ("main", cid) and "origin/main" not in copy.branches()


def test_a_clone_of_an_origin_with_a_damaged_head_prefers_main_over_the_first_name(tmp_path):
    """With main there, a damaged HEAD put HEAD here on whichever branch sorted first."""
    cid = _hub_with(tmp_path, ["alpha"], "x\nfake")
    with remote.clone(str(tmp_path / "hub"), tmp_path / "copy") as copy:
        assert copy.head() == ("main", cid)


def test_a_clone_of_an_origin_with_a_damaged_head_and_no_main_takes_a_branch_it_has(tmp_path):
    """With no main there, a damaged HEAD put HEAD here on an unborn main: `ckpt log` empty."""
    import sqlite3

    cid = _hub_with(tmp_path, ["dev"], "x\nfake")
    db = sqlite3.connect(tmp_path / "hub" / ".ckpt" / "ckpt.db")
    db.execute("DELETE FROM refs WHERE name = 'main'")
    db.commit()
    db.close()
    with remote.clone(str(tmp_path / "hub"), tmp_path / "copy") as copy:
        assert copy.head() == ("dev", cid)


def test_a_clone_checks_out_the_branch_origins_head_is_on(tmp_path):
    """HEAD here was always main, whatever branch origin's HEAD was on."""
    dev = _hub_with(tmp_path, ["dev"], "dev")
    with remote.clone(str(tmp_path / "hub"), tmp_path / "copy") as copy:
        assert copy.head() == ("dev", dev) and sorted(copy.branches()) == ["dev", "main"]


def test_a_clone_into_a_finished_clone_of_the_same_origin_is_refused_and_moves_nothing(tmp_path):
    """A second clone into a finished clone took it as interrupted,
    fetched, and put HEAD back on origin's branch, said 'Cloned' over the user's repository."""
    import pytest

    from ckptstore.errors import RepoExistsError

    with Repository.init(tmp_path / "hub") as hub:
        first = hub.commit({"w": torch.full((256,), 1.0)}, message="one")
    remote.clone(str(tmp_path / "hub"), tmp_path / "copy").close()
    with Repository.open(tmp_path / "copy") as copy:
        copy.branch("mine", first)
    import sqlite3
    db = sqlite3.connect(tmp_path / "copy" / ".ckpt" / "ckpt.db")
    db.execute("UPDATE refs SET target = 'mine' WHERE name = 'HEAD'")
    db.commit()
    db.close()
    with pytest.raises(RepoExistsError, match="already exists"):
        remote.clone(str(tmp_path / "hub"), tmp_path / "copy")
    with Repository.open(tmp_path / "copy") as copy:
        assert copy.head()[0] == "mine"


def test_a_clone_into_an_empty_repository_whose_origin_is_elsewhere_is_refused(tmp_path):
    """A clone of hub into a repository made with origin = other resumed it as an
    interrupted clone, fetched other's branches, and said it cloned hub."""
    import pytest

    from ckptstore.errors import RepoExistsError

    for name, value in (("hub", 1.0), ("other", 2.0)):
        with Repository.init(tmp_path / name) as hub:
            hub.commit({"w": torch.full((256,), value)}, message=name)
    with Repository.init(tmp_path / "copy") as copy:
        remote.add(copy, "origin", str(tmp_path / "other"))
    with pytest.raises(RepoExistsError, match="already exists"):
        remote.clone(str(tmp_path / "hub"), tmp_path / "copy")
    with Repository.open(tmp_path / "copy") as copy:
        assert copy.branches() == {}



def test_a_pull_that_wrote_no_files_leaves_no_marker_that_a_later_pull_takes_as_interrupted(tmp_path):
    """The user had deleted ck.pt, so
    the pull wrote none; training then wrote ck.pt, and the next pull took the finished one as interrupted, found
    the file changed, and moved main back to the commit before the pull (error: pull stopped)."""
    _cloned(tmp_path)
    (tmp_path / "c" / "ck.pt").unlink()
    _commit(tmp_path / "a", 2)
    assert ckpt_here(tmp_path / "c", "pull").returncode == 0
    with Repository.open(tmp_path / "c") as c:
        pulled = c.resolve("main")
    torch.save({"w": torch.full((256,), 9.0)}, tmp_path / "c" / "ck.pt")  # training writes its checkpoint again
    again = ckpt_here(tmp_path / "c", "pull")
    assert again.returncode == 0, again.stderr
    with Repository.open(tmp_path / "c") as c:
        assert c.resolve("main") == pulled


def test_a_lazy_clone_pointed_at_another_lazy_clone_says_so_at_its_first_read(tmp_path):
    """A lazy clone whose origin was set to another lazy clone (by hand, or by an older ckptstore's set-url)
    read that one's bare store, and said an object it never fetched was pruned at the origin."""
    from ckptstore.errors import CorruptObjectError

    with Repository.init(tmp_path / "hub") as hub:
        cid = hub.commit({"w": torch.randn(100_000, generator=torch.Generator().manual_seed(0))}, message="one")
    remote.clone(str(tmp_path / "hub"), tmp_path / "second", lazy=True).close()
    remote.clone(str(tmp_path / "hub"), tmp_path / "lazy", lazy=True).close()
    config = tmp_path / "lazy" / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace(str(tmp_path / "hub"), str(tmp_path / "second")))
    with Repository.open(tmp_path / "lazy") as lazy:
        with pytest.raises(CorruptObjectError, match="is itself a lazy clone"):
            lazy.checkout(cid)


def test_a_push_of_a_branch_at_a_commit_pruned_on_both_sides_leaves_it_pruned_there(tmp_path):
    """A tip pruned here and there was sent as a row
    with no manifest and unmarked there: the remote then held a 'whole' commit with no data (fsck damage)."""
    _pushed(tmp_path)
    for side in ("a", "b"):
        assert ckpt_here(tmp_path / side, "prune", "--keep-last", "1").returncode == 0
    import sqlite3  # `ckpt branch` refuses a pruned commit; a branch left there (raw, or by an older version) is not

    with Repository.open(tmp_path / "a") as a:
        old = a.resolve("main~2")
    db = sqlite3.connect(tmp_path / "a" / ".ckpt" / "ckpt.db")
    db.execute("INSERT INTO refs (name, kind, commit_id, target) VALUES ('old', 'branch', ?, NULL)", (old,))
    db.commit()
    db.close()
    pushed = ckpt_here(tmp_path / "a", "push", "origin", "old")
    assert pushed.returncode == 0, pushed.stderr
    with Repository.open(tmp_path / "b") as hub:
        assert hub.commit_info(hub.resolve("old")).pruned  # (fsck names the branch at a pruned commit either way)



def test_a_push_report_counts_the_tensor_records_it_sent(tmp_path):
    """TransferReport.tensors is API: a push reports the tensor records it sent."""
    Repository.init(tmp_path / "hub").close()
    with Repository.init(tmp_path / "work") as work:
        remote.add(work, "origin", str(tmp_path / "hub"))
        work.commit({"w": torch.full((256,), 1.0), "b": torch.zeros(3)}, message="one")
        first = remote.push(work, "origin")
        assert first.commits == 1 and first.tensors == 2
        work.commit({"w": torch.full((256,), 1.0), "b": torch.ones(3)}, message="two")
        assert remote.push(work, "origin").tensors == 1  # the unchanged w is there already


def _received(*rows):
    from ckptstore.metadata import transfer

    found = transfer.RecordSet()
    found.rows["tensors"] = (["id", "base_id", "depth"], list(rows))
    return found


def test_a_received_keyframe_is_at_depth_zero_whatever_the_sender_says(tmp_path):
    """A sender's depth 6 on a row with no base was kept, and every
    link received on it counted from 6 (the next commit here re-encoded the chain early)."""
    from ckptstore.metadata import transfer

    with Repository.init(tmp_path) as repo, repo.db.read() as tx:
        found = _received(("k", None, 6), ("a", "k", 9))
        transfer._depths_here(tx, found)
    assert {row[0]: row[2] for row in found.rows["tensors"][1]} == {"k": 0, "a": 1}


def test_a_forged_loops_depth_of_infinity_is_taken_as_none(tmp_path):
    """A REAL 'inf' depth in a hostile sender's row ended the
    clone in an OverflowError traceback, half made."""
    from ckptstore.metadata import transfer

    with Repository.init(tmp_path) as repo, repo.db.read() as tx:
        found = _received(("inf", "inf", float("inf")))
        transfer._depths_here(tx, found)
    assert {row[0]: row[2] for row in found.rows["tensors"][1]} == {"inf": 0}


def test_the_tensors_a_commit_needs_end_at_a_forged_base_loop():
    """A hostile sender's base loop (x on y, y on x) made every
    fetch, clone or pull from it walk for ever."""
    from ckptstore.metadata import transfer

    bases = {"x": "y", "y": "x"}
    calls = []

    class Tx:
        def rows_in(self, sql, ids):
            calls.append(sql)
            assert len(calls) < 50, "the walk does not end"
            if "commit_tensors" in sql:
                return [("x",)]
            return [(bases[i],) for i in ids if bases.get(i)]

    assert transfer.tensors_of(Tx(), ["c"]) == {"x", "y"}


def test_a_clone_of_a_folder_inside_a_repositorys_work_tree_is_refused_not_of_that_repository(tmp_path):
    """A URL naming a plain folder inside a work tree opened
    the repository above it, and the clone said it cloned the folder."""
    import pytest

    from ckptstore.errors import CkptError

    with Repository.init(tmp_path / "hub") as hub:
        hub.commit({"w": torch.full((256,), 1.0)}, message="one")
    (tmp_path / "hub" / "models").mkdir()
    with pytest.raises(CkptError, match="is not a ckptstore repository"):
        remote.clone(str(tmp_path / "hub" / "models"), tmp_path / "copy")


def test_an_objects_url_without_metadata_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    """`remote add` of objects URL with no --metadata was
    taken, its records kept in a private database in this user's cache: pushes there reached no one."""
    import pytest

    from ckptstore.errors import CkptError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "bucket").mkdir()
    with Repository.init(tmp_path / "work") as work:
        with pytest.raises(CkptError, match="names objects but no metadata"):
            remote.add(work, "origin", (tmp_path / "bucket").as_uri())
    assert not (tmp_path / "cache" / "ckptstore" / "remotes").exists()


def test_a_push_sends_no_links_below_an_unchanged_tensor_the_remote_has(tmp_path):
    """A tensor the new commit names unchanged,
    which the remote holds (re-encoded as a keyframe by its prune), had its chain below sent again: bytes the
    remote did not need, left there for its gc (cost only)."""
    from ckptstore.repo import gc

    generator = torch.Generator().manual_seed(0)
    w = torch.randn(512, 512, generator=generator)
    b = torch.randn(512, 512, generator=generator)
    states = []
    for _ in (1, 2):
        w = w + 1e-3 * torch.randn(512, 512, generator=generator)
        b = b + 1e-3 * torch.randn(512, 512, generator=generator)
        states.append({"w": w, "b": b})
    with _clone_of_a_pruned_hub(tmp_path, states) as clone:
        w = w + 1e-3 * torch.randn(512, 512, generator=generator)
        clone.commit({"w": w, "b": b}, step=3)  # b as at step 2
        sent = remote.push(clone, "origin")
    with Repository.open(tmp_path / "hub") as hub:
        assert sent.commits == 1 and sent.tensors == 1 and gc(hub).bytes_removed == 0


def test_remote_set_url_of_a_lazy_clone_refuses_another_lazy_clone_as_its_origin(tmp_path):
    """`clone --lazy` refuses a lazy origin; set-url took one, and the clone failed at its next read (mutation
    audit round 12b, a defect of the code)."""
    from ckptstore.errors import CkptError

    with Repository.init(tmp_path / "hub") as hub:
        cid = hub.commit({"w": torch.randn(10_000)}, message="one")
    remote.clone(str(tmp_path / "hub"), tmp_path / "second", lazy=True).close()
    with remote.clone(str(tmp_path / "hub"), tmp_path / "lazy", lazy=True) as lazy:
        with pytest.raises(CkptError, match="is itself a lazy clone"):
            remote.set_url(lazy, "origin", str(tmp_path / "second"))
    with Repository.open(tmp_path / "lazy") as lazy:  # still reads from its origin
        assert lazy.checkout(cid)["w"].shape == (10_000,)

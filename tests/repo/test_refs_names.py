"""Ref names: what a branch or tag may be called, that every accepted name resolves, and tag deletion."""

import string

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.errors import CkptError, InvalidRefNameError, RefNotFoundError
from ckptstore.repo.refs import check_name, check_range_safe, split_range
from tests.conftest import machine_settings


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    with Repository.init(tmp_path_factory.mktemp("refs")) as repo:
        repo.commit({"w": torch.ones(2)}, step=1)
        yield repo


@pytest.mark.parametrize("name", ["v1\n", "v1\r", "v1 ", "\tv1", ""])
def test_names_with_whitespace_or_empty_are_refused(repo, name):
    with pytest.raises(InvalidRefNameError):
        repo.branch(name)
    with pytest.raises(InvalidRefNameError):
        repo.tag(name)
    assert name not in repo.branches() and name not in repo.tags()


@given(st.text(string.ascii_letters + string.digits + "._/-\n \t~^", min_size=1, max_size=12))
@machine_settings(scale=4)
def test_every_name_that_is_accepted_resolves_to_its_commit(repo, name):
    try:
        check_name(name)
    except InvalidRefNameError:
        return
    with repo.db.write() as tx:  # create and drop again, so examples do not collide
        from ckptstore.metadata import refs as ref_rows

        ref_rows.insert_ref(tx, name, "tag", repo.resolve())
    try:
        assert repo.resolve(name) == repo.resolve()
    finally:
        with repo.db.write() as tx:
            ref_rows.delete_ref(tx, name)


@given(st.text(string.ascii_letters + string.digits + "._/-", min_size=1, max_size=12))
@machine_settings(scale=4)
def test_every_accepted_name_reads_back_as_one_side_of_a_range(name):
    """`v1.` was accepted, and `ckpt log v1...main` read as v1 ... main (reader 39): git refuses such names too."""
    try:
        check_name(name)
        check_range_safe(name)
    except InvalidRefNameError:
        return
    assert split_range(name) is None
    for dots, three in (("..", False), ("...", True)):
        assert split_range(f"{name}{dots}{name}") == (name, name, three)
        assert split_range(f"{dots}{name}") == ("HEAD", name, three)


def test_a_name_that_reads_as_a_commit_prefix_is_refused(repo):
    head = repo.resolve()
    for name in (head[:7], head[:4], "deadbeef", "abc1234"):
        with pytest.raises(InvalidRefNameError, match="commit id"):
            repo.branch(name, "HEAD")
    assert repo.resolve(head[:7]) == head
    repo.branch("cafe-ok")  # not all hex: fine


def test_a_ref_that_shadows_a_commit_prefix_is_ambiguous(repo):
    """A ref that an older ckptstore let through must not silently win over the commit it reads as."""
    head = repo.resolve()
    other = repo.commit({"w": torch.zeros(2)}, branch="side")
    from ckptstore.errors import AmbiguousRefError
    from ckptstore.metadata import refs as ref_rows

    with repo.db.write() as tx:
        ref_rows.insert_ref(tx, head[:8], "branch", other)
    try:
        with pytest.raises(AmbiguousRefError, match="both"):
            repo.resolve(head[:8])
        assert repo.resolve(head) == head
    finally:
        with repo.db.write() as tx:
            ref_rows.delete_ref(tx, head[:8])


def test_a_branch_an_older_ckptstore_named_in_hex_digits_still_takes_commits(tmp_path):
    """Today's rules stop new names; a branch that already exists keeps working."""
    from ckptstore.metadata import refs as ref_rows

    with Repository.init(tmp_path) as repo:
        first = repo.commit({"w": torch.ones(2)}, step=1)
        with repo.db.write() as tx:  # as an older version let `ckpt branch 2024` through
            ref_rows.insert_ref(tx, "2024", "branch", first)
        second = repo.commit({"w": torch.zeros(2)}, step=2, branch="2024")
        assert repo.commit_info(second).parents == [first]
        with pytest.raises(InvalidRefNameError, match="commit id"):
            repo.commit({"w": torch.full((2,), 3.0)}, step=3, branch="2025")


def test_cli_branch_with_empty_name_is_an_error_not_a_listing(repo):
    result = CliRunner().invoke(cli, ["--repo", str(repo.root), "branch", ""])
    assert result.exit_code != 0 and "not a valid" in str(result.exception)


def test_tags_can_be_deleted(repo):
    head = repo.resolve()
    repo.tag("doomed")
    assert repo.delete_tag("doomed") == head
    assert "doomed" not in repo.tags()
    with pytest.raises(RefNotFoundError, match="no such tag"):
        repo.delete_tag("doomed")
    with pytest.raises(CkptError, match="'main' is a branch, not a tag: delete it with `ckpt branch -d main`"):
        repo.delete_tag("main")  # a branch is not deleted by tag -d
    assert "main" in repo.branches()
    repo.tag("gone")
    result = CliRunner().invoke(cli, ["--repo", str(repo.root), "tag", "-d", "gone"])
    assert result.exit_code == 0 and f"Deleted tag gone (was {head[:12]})" in result.output
    assert "gone" not in repo.tags()


def test_a_name_ending_in_a_dot_is_not_made_here_but_one_an_older_ckptstore_made_still_clones(tmp_path):
    """Names made here may not end in '.' (a range would swallow it); an older repository's `release.` cloned into
    an empty repository with HEAD on an unborn main, without a word (reader 40): it travels as before."""
    from ckptstore.metadata import refs as ref_rows
    from ckptstore.repo import remote

    with Repository.init(tmp_path / "old") as old:
        cid = old.commit({"w": torch.ones(4)})
        for make in (lambda: old.branch("v2."), lambda: old.tag("t."), lambda: old.commit({"w": torch.ones(4)},
                                                                                        branch="v3.")):
            with pytest.raises(InvalidRefNameError, match="ends with '.'"):
                make()
        with old.db.write() as tx:  # as an older ckptstore made it
            ref_rows.insert_ref(tx, "release.", "branch", cid)
            ref_rows.point_head(tx, "release.", None)
    with remote.clone(str(tmp_path / "old"), tmp_path / "copy") as copy:
        assert copy.head() == ("release.", cid) and set(copy.branches()) >= {"release."}
        assert copy.log("release.")[0].id == cid


@pytest.mark.parametrize("name", ["c.lock/d", "y/.hidden", "c/./d"])
def test_a_part_git_refuses_is_not_made_here_but_a_branch_an_older_ckptstore_made_so_still_works(tmp_path, name):
    """git refuses a part starting with '.' or ending in '.lock' anywhere in a name; only the whole name was
    checked, so `c.lock/d`, `y/.hidden` and `c/./d` were made. A branch made so before still reads, takes commits,
    passes fsck and is deleted."""
    from ckptstore.metadata import refs as ref_rows
    from ckptstore.repo import fsck

    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"w": torch.ones(4)})
        part = next(p for p in name.split("/") if p.startswith(".") or p.endswith(".lock"))
        for make in (lambda: repo.branch(name), lambda: repo.tag(name),
                     lambda: repo.commit({"w": torch.zeros(4)}, branch=name)):
            with pytest.raises(InvalidRefNameError, match=f"has a part '{part}' that starts with '.' or ends with"):
                make()
        assert name not in repo.branches() and name not in repo.tags() and [c.id for c in repo.log()] == [cid]
        with repo.db.write() as tx:  # as an older ckptstore made it
            ref_rows.insert_ref(tx, name, "branch", cid)
        assert repo.resolve(name) == cid and fsck(repo).ok
        second = repo.commit({"w": torch.zeros(4)}, branch=name)
        assert repo.resolve(name) == second and [c.id for c in repo.log(name)] == [second, cid]
        assert repo.delete_branch(name) == second
        assert name not in repo.branches()

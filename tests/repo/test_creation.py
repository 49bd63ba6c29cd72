"""`ckpt init` and `ckpt clone` killed (SIGKILL) at each step of making the repository (repo/creation.py).

Whatever the step, the folder holds no half-made `.ckpt`: every command there says there is no
repository yet and to run `ckpt init` (one line, no traceback), and running the same init or
clone again makes a whole repository that fsck finds clean, leaving no temporary folder behind.
Metadata on PostgreSQL (outside the folder) and objects on S3 must tolerate the redo as well.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError, RepoNotFoundError
from ckptstore.repo import fsck, gc
from tests.conftest import assert_same, ckpt_env, ckpt_here

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["init:folder-made", "init:config-written", "init:metadata-made", "init:renamed"]


def _ckpt(cwd: Path, *args: str, crash_at: str = "") -> subprocess.CompletedProcess:
    env = ckpt_env(**({"CKPT_CRASH_AT": crash_at} if crash_at else {}))
    return subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _half_made_is_explained(folder: Path, step: str, at_the_cli: bool = False) -> None:
    """Commands in the folder a killed init left: one line saying to run init (none yet), or a working repository.

    Every command opens the repository the same way: the CLI's line is checked once (`at_the_cli`),
    the opening at every step.
    """
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".ckpt")]
    if step == "init:renamed":  # killed after the rename: the repository is whole already
        assert leftovers == [".ckpt"], leftovers
        return
    assert ".ckpt" not in leftovers, leftovers
    with pytest.raises(RepoNotFoundError, match="run `ckpt init`"):
        Repository.open(folder)
    for args in (["log"], ["fsck"], ["commit", "m.pt"]) if at_the_cli else ():
        said = _ckpt(folder, *args)
        assert said.returncode == 1 and "Traceback" not in said.stderr, said.stderr
        assert said.stderr.strip().count("\n") == 0 and "run `ckpt init`" in said.stderr, said.stderr


def _whole(folder: Path) -> None:
    assert [p.name for p in folder.iterdir() if p.name.startswith(".ckpt")] == [".ckpt"]  # no leftover
    with Repository.open(folder) as repo:
        assert fsck(repo).ok


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "s3"])
@pytest.mark.parametrize("step", STEPS)
def test_init_killed_at_each_step_is_redone_by_the_next_init(tmp_path, step, backend, request):
    where = tmp_path / "repo"
    urls = {"sqlite": [], "postgresql": ["--metadata", "postgres_url"], "s3": ["--objects", "s3_url"]}[backend]
    urls = urls[:1] + [request.getfixturevalue(name) for name in urls[1:]]
    killed = _ckpt(tmp_path, "init", *urls, str(where), crash_at=step)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    _half_made_is_explained(where, step, at_the_cli=(backend, step) == ("sqlite", STEPS[1]))

    again = ckpt_here(tmp_path, "init", *urls, str(where))  # the next init: a plain command
    if step == "init:renamed":
        assert again.returncode == 1 and "already exists" in again.stderr, again.stderr
    else:
        assert again.returncode == 0, again.stderr
    with Repository.open(where) as repo:
        repo.commit({"w": torch.arange(100.0)}, message="first")
    _whole(where)


@pytest.mark.parametrize("step", STEPS)
def test_clone_killed_at_each_step_of_making_its_repository_is_finished_by_the_next_clone(tmp_path, step):
    source = tmp_path / "source"
    state = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(1))}
    with Repository.init(source) as repo:
        repo.commit(state, message="one")
    where = tmp_path / "copy"
    killed = _ckpt(tmp_path, "clone", str(source), str(where), crash_at=step)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    _half_made_is_explained(where, step)

    again = ckpt_here(tmp_path, "clone", str(source), str(where))
    assert again.returncode == 0, again.stderr
    _whole(where)
    with Repository.open(where) as clone:
        assert_same(state, clone.checkout("main"))


def test_a_leftover_of_a_running_init_is_left_alone(tmp_path):
    """Another init still at work there (its process alive) keeps its folder; the later init removes only the dead."""
    running = tmp_path / f".ckpt-init-{socket.gethostname()}-1"  # pid 1 always lives
    dead = tmp_path / f".ckpt-init-{socket.gethostname()}-{2**22 + 7}"  # above pid_max: no such process
    running.mkdir()
    dead.mkdir()
    Repository.init(tmp_path).close()
    assert running.exists() and not dead.exists()


def test_a_leftover_init_folder_of_another_host_is_no_part_of_a_commit_of_the_root(tmp_path):
    """On a shared home another machine's killed init stays (its process cannot be asked): commit skips it."""
    from safetensors.torch import save_file

    from ckptstore.repo.creation import STAGING

    with Repository.init(tmp_path) as repo:
        leftover = tmp_path / f"{STAGING}otherhost-4242"
        leftover.mkdir()
        (leftover / "config.toml").write_text("")
        save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
        cid = repo.commit(tmp_path)
        assert [f.name for f in repo.manifest(cid).files] == ["model.safetensors"]


@pytest.mark.parametrize("name", ["run?1", "lr%201e-3", "a#b"])
def test_a_repository_in_a_folder_whose_name_reads_as_url_syntax_works_and_writes_nothing_beside(tmp_path, name):
    """The schema went through SQLAlchemy's URL parser: "?" cut the path (a stray database beside the
    folder, then "damaged"), "%20" was decoded (auditor)."""
    folder = tmp_path / name
    folder.mkdir()
    with Repository.init(folder) as repo:
        cid = repo.commit({"w": torch.ones(3)}, message="first")
    with Repository.open(folder) as repo:
        assert [c.id for c in repo.log()] == [cid] and torch.equal(repo.checkout(cid)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_repository_made_under_a_group_umask_leaves_its_database_and_locks_to_the_group(tmp_path):
    """ckpt.db (SQLite's 0644), its -wal and -shm, and the lock files (0644) ignored umask 002: a team's other
    members could not commit, and one member's read left a -wal that locked out the repository's maker (auditor)."""
    import os
    import stat

    old = os.umask(0o002)
    try:
        with Repository.init(tmp_path) as repo:
            repo.commit({"w": torch.ones(8)}, "one")
            files = [repo.dir / name for name in ("ckpt.db", "ckpt.db-wal", "ckpt.db-shm", "lock", "lock.gate")]
            modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in files}
    finally:
        os.umask(old)
    assert modes == dict.fromkeys(modes, 0o664), modes


def test_an_init_leaves_the_folder_of_another_hosts_init_whatever_its_pid(tmp_path):
    """A pid means something only on its own host: another machine's init at work on a shared file system keeps
    its folder though no process here has that pid (mutation audit)."""
    from ckptstore.repo.creation import STAGING

    other_host = f"{socket.gethostname()}x-node-17"  # not this host, its name holding '-' as hosts' names do
    building = tmp_path / f"{STAGING}{other_host}-{2**22 + 7}"  # above pid_max: no such process here
    building.mkdir()
    (building / "config.toml").write_text("# being written by node 17\n")
    made = ckpt_here(tmp_path, "init", str(tmp_path), timeout=120)
    assert made.returncode == 0, made.stderr
    assert (building / "config.toml").read_text() == "# being written by node 17\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".ckpt", building.name])


def test_ckpt_repo_names_the_python_apis_repository_before_the_one_holding_the_cwd(tmp_path, monkeypatch):
    """`ckptstore.save(..., repo=None)` and `Repository.open()` go to CKPT_REPO's repository, as the CLI does
    (mutation audit)."""
    import ckptstore

    for name in ("cwd_repo", "named_repo"):
        Repository.init(tmp_path / name).close()
    monkeypatch.chdir(tmp_path / "cwd_repo")
    monkeypatch.setenv("CKPT_REPO", str(tmp_path / "named_repo"))
    cid = ckptstore.save({"w": torch.ones(4)}, step=1)
    with Repository.open() as repo:
        assert Path(repo.root).resolve() == (tmp_path / "named_repo").resolve()
        assert [c.id for c in repo.log()] == [cid]
    monkeypatch.delenv("CKPT_REPO")
    with Repository.open() as repo:  # without it: the repository holding the cwd, which got nothing
        assert Path(repo.root).resolve() == (tmp_path / "cwd_repo").resolve()
        assert repo.log() == []


def test_init_inside_a_repositorys_own_folder_or_object_store_is_refused(tmp_path):
    """`ckpt --repo .ckpt init` and an init in .ckpt/objects made repositories whose objects lay in the outer store,
    unseen by its fsck and gc (auditor)."""
    Repository.init(tmp_path).close()
    for inside in (tmp_path / ".ckpt", tmp_path / ".ckpt" / "objects", tmp_path / ".ckpt" / "objects" / "new"):
        with pytest.raises(CkptError, match=r"is inside .*\.ckpt(/objects)?, a repository's own folder or object"):
            Repository.init(inside)
        assert not (inside / ".ckpt").exists()
    Repository.init(tmp_path / "run" / "nested").close()  # a repository in another's working folder: fine


@pytest.mark.parametrize("step", STEPS[2:3])  # after the metadata and the S3 claim are made, before the rename
def test_an_s3_init_that_fails_after_its_claim_gives_the_prefix_back(tmp_path, step, s3_url):
    """The failure's handler removed the half-made folder, and with it the id its claim named: every later init of
    the folder over that prefix was refused as another repository's (review helper 289)."""
    where = tmp_path / "repo"
    failed = ckpt_here(tmp_path, "init", "--objects", s3_url, str(where), env={"CKPT_FAIL_AT": step})
    assert failed.returncode == 1 and "injected at" in failed.stderr, failed.stderr
    again = ckpt_here(tmp_path, "init", "--objects", s3_url, str(where))
    assert again.returncode == 0, again.stderr
    with Repository.open(where) as repo:
        cid = repo.commit({"w": torch.arange(100.0)})
        assert_same({"w": torch.arange(100.0)}, repo.checkout(cid))
    _whole(where)


@pytest.mark.parametrize("where", ["postgresql", "sqlite file elsewhere"])
def test_an_init_joining_metadata_whose_objects_are_in_another_folder_is_refused(tmp_path, where, request):
    """A second folder's init with only --metadata joined the first's database unchecked: its first commit stored
    everything in its own .ckpt/objects, recorded a commit no other folder could restore, and the first
    repository's fsck failed and its gc refused from then on (model-based audit helper 287, high)."""
    url = request.getfixturevalue("postgres_url") if where == "postgresql" else f"sqlite:///{tmp_path}/shared.db"
    Repository.init(tmp_path / "a", metadata_url=url).close()
    for joiner, value in (("b", 100.0), ("c", 101.0)):  # before its first commit too (docs audit helper 293)
        refused = ckpt_here(tmp_path, "init", "--metadata", url, str(tmp_path / joiner))
        assert refused.returncode == 1, refused.stderr
        assert "already holds a repository, whose objects are not in this new folder's .ckpt/objects: join it with " \
               "--objects too" in refused.stderr and "nothing was made" in refused.stderr, refused.stderr
        assert not (tmp_path / joiner / ".ckpt").exists()
        with Repository.open(tmp_path / "a") as a:
            cid = a.commit({"w": torch.full((100,), value)})
    with Repository.open(tmp_path / "a") as a:
        assert fsck(a, full=True).ok and gc(a).objects_removed == 0
        assert_same({"w": torch.full((100,), 101.0)}, a.checkout(cid))



def test_a_postgresql_init_that_failed_after_making_its_schema_is_taken_up_by_the_next_init(tmp_path, postgres_url):
    """Its schema outlives the half-made folder; the next init of the same folder must not be refused it as another
    repository's (the join check of objects in the folder's own .ckpt)."""
    where = tmp_path / "repo"
    failed = ckpt_here(tmp_path, "init", "--metadata", postgres_url, str(where),
                       env={"CKPT_FAIL_AT": "init:metadata-made"})
    assert failed.returncode == 1 and "injected at" in failed.stderr, failed.stderr
    again = ckpt_here(tmp_path, "init", "--metadata", postgres_url, str(where))
    assert again.returncode == 0, again.stderr
    assert [p.name for p in where.iterdir()] == [".ckpt"]  # the failed init's note went with its leftover
    with Repository.open(where) as repo:
        cid = repo.commit({"w": torch.arange(100.0)})
        assert_same({"w": torch.arange(100.0)}, repo.checkout(cid))


@pytest.mark.parametrize("step", ["init:metadata-made", "init:config-written"])
def test_an_init_killed_over_a_schema_its_migrations_alone_made_is_taken_up_and_no_other_folder_joins(
        tmp_path, step):
    """Such a schema is the first init's; one killed after it wrote HEAD there left no note of it, and every later
    init of the same folder was refused as joining another's repository (reviewer helper 295, of ef1776f)."""
    from ckptstore.metadata.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'meta.db'}"
    upgrade(url)
    killed = _ckpt(tmp_path, "init", "--metadata", url, str(tmp_path / "a"), crash_at=step)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = ckpt_here(tmp_path, "init", "--metadata", url, str(tmp_path / "a"))
    assert again.returncode == 0, again.stderr
    other = ckpt_here(tmp_path, "init", "--metadata", url, str(tmp_path / "b"))
    assert other.returncode == 1 and "already holds a repository" in other.stderr, other.stderr
    with Repository.open(tmp_path / "a") as repo:
        cid = repo.commit({"w": torch.arange(100.0)})
        assert_same({"w": torch.arange(100.0)}, repo.checkout(cid))
    _whole(tmp_path / "a")


@pytest.mark.parametrize("objects", ["tmp", "tmp/sub", "..", ".", "/", "final .ckpt/objects"])
def test_an_objects_folder_in_the_repositorys_own_temporary_folder_or_holding_it_is_refused(tmp_path, objects):
    """`init --objects tmp` made the store .ckpt/tmp, which gc empties first: every object deleted (CLI fuzz helper
    323); `..` or `/` held the work tree, `/` ended in "unexpected ValueError", and `.ckpt/objects` named
    outright left a half-made .ckpt in which no command worked."""
    where = tmp_path / "repo"
    url = f"file://{where / '.ckpt' / 'objects'}" if objects.startswith("final") else objects
    said = ckpt_here(tmp_path, "init", "--objects", url, str(where))
    assert said.returncode == 1 and said.stderr.count("\n") == 1 and "objects_url" in said.stderr, said.stderr
    assert "unexpected" not in said.stderr and not (where / ".ckpt").exists()
    assert ckpt_here(tmp_path, "init", str(where)).returncode == 0  # the folder is as it was: an init works


def test_a_config_naming_the_temporary_folder_as_the_store_is_refused_before_gc_empties_it(tmp_path):
    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"w": torch.arange(100.0)})
    objects = tmp_path / ".ckpt" / "objects"
    shutil.copytree(objects, tmp_path / ".ckpt" / "tmp" / "store")
    config = tmp_path / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace('objects_url = ""', 'objects_url = "tmp/store"'))
    said = ckpt_here(tmp_path, "gc")
    assert said.returncode == 1 and "lies in the repository's folder of temporary files" in said.stderr, said.stderr
    assert sorted(p.name for p in (tmp_path / ".ckpt" / "tmp" / "store").rglob("*") if p.is_file()) == sorted(
        p.name for p in objects.rglob("*") if p.is_file())
    config.write_text(config.read_text().replace('objects_url = "tmp/store"', 'objects_url = ""'))
    with Repository.open(tmp_path) as repo:
        assert_same({"w": torch.arange(100.0)}, repo.checkout(cid))

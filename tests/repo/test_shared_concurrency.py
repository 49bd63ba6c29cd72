"""Many processes on one shared repository (objects on the S3 server, records in SQLite or PostgreSQL) at once."""

import json

import pytest

from ckptstore import Repository
from ckptstore.repo import fsck
from tests.conftest import assert_same
from tests.forked import Forked
from tests.repo.shared_workers import state

pytestmark = pytest.mark.both_backends

WRITERS, COMMITS = 4, 15


def _start(role: str, *args: str, env: dict | None = None) -> Forked:
    """A process of its own running `role` (tests/repo/shared_workers.py), as `python -m` would."""
    return Forked("tests.repo.shared_workers", [role, *args], env)


@pytest.mark.slow
def test_four_writers_a_reader_and_gc_on_one_shared_repository(tmp_path, s3_url, metadata_url):
    Repository.init(tmp_path, objects_url=s3_url, metadata_url=metadata_url).close()
    writers = [_start("writer", str(tmp_path), str(w), str(COMMITS)) for w in range(WRITERS)]
    reader = _start("reader", str(tmp_path))
    collector = _start("collector", str(tmp_path), str(WRITERS * COMMITS))
    outputs = {}
    for process in [*writers, reader, collector]:
        out, err = process.communicate(timeout=900)
        assert process.returncode == 0, err
        assert "locked" not in err.lower()
        outputs[process.pid] = out
    assert json.loads(outputs[reader.pid].splitlines()[-1])["checked"] >= 40
    assert int(outputs[collector.pid].split()[-1]) >= 3  # gc ran between commits, not only after them
    with Repository.open(tmp_path) as repo:
        commits = repo.log(all_refs=True)
        assert len(commits) == WRITERS * COMMITS
        for info in commits:
            writer, index = map(int, info.message.split())
            assert_same(state(writer, index), repo.checkout(info.id))
        assert fsck(repo).ok


def test_two_writers_on_one_branch_of_a_shared_repository_one_conflict_nothing_lost(tmp_path, s3_url, metadata_url):
    import os
    import time

    Repository.init(tmp_path, objects_url=s3_url, metadata_url=metadata_url).close()
    go = tmp_path / "go"
    # the first writer stops once its objects are uploaded, before its metadata transaction
    first = _start("one-commit", str(tmp_path), "1", env=dict(os.environ, CKPT_WAIT_AT=f"commit:objects-written={go}"))
    deadline = time.monotonic() + 120
    while not (tmp_path / "go.reached").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _start("one-commit", str(tmp_path), "2").wait(300)
    go.touch()
    out, err = first.communicate(timeout=300)
    assert first.returncode == second.returncode == 0, err + second.stderr
    assert out.startswith("conflict") and "same" in out, out
    with Repository.open(tmp_path) as repo:
        assert [info.message for info in repo.log("same")] == ["2"]
        assert_same(state(2, 0), repo.checkout("same"))
        assert fsck(repo).ok

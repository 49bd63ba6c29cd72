"""Many processes on one shared repository (objects on the S3 server, records in SQLite or PostgreSQL) at once."""

import json
import subprocess
import sys
import textwrap

import pytest

from ckptstore import Repository
from ckptstore.repo import fsck
from tests.test_cli import ROOT

pytestmark = pytest.mark.both_backends

WRITERS, COMMITS = 4, 15

# Each process regenerates the state of (writer, index) from its seed, so any process can check any commit.
_STATE = """
import torch
def state(writer, index):
    g = torch.Generator().manual_seed(writer * 1000 + index)
    return {"w": torch.randn(20_000, generator=g), "b": torch.randn(64, generator=g), "step": index}
"""

_WRITER = _STATE + """
import sys
from ckptstore import Repository
writer, commits = int(sys.argv[2]), int(sys.argv[3])
with Repository.open(sys.argv[1]) as repo:
    for index in range(commits):
        repo.commit(state(writer, index), message=f"{writer} {index}", branch=f"job{writer}")
"""

_READER = _STATE + """
import json, sys, time
from ckptstore import Repository
from tests.conftest import assert_same
checked = 0
with Repository.open(sys.argv[1]) as repo:
    deadline = time.monotonic() + 600
    while checked < 40 and time.monotonic() < deadline:
        for info in repo.log(all_refs=True)[:3]:
            writer, index = map(int, info.message.split())
            assert_same(state(writer, index), repo.checkout(info.id))
            checked += 1
print(json.dumps({"checked": checked}))
"""

_COLLECTOR = """
import sys, time
from ckptstore import Repository
from ckptstore.repo import gc
during = 0  # gc runs that ended while commits were still coming
with Repository.open(sys.argv[1]) as repo:
    deadline = time.monotonic() + 600
    while len(repo.log(all_refs=True)) < int(sys.argv[2]) and time.monotonic() < deadline:
        gc(repo)
        during += len(repo.log(all_refs=True)) < int(sys.argv[2])
        time.sleep(0.2)
print(during)
"""


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_four_writers_a_reader_and_gc_on_one_shared_repository(tmp_path, s3_url, metadata_url):
    Repository.init(tmp_path, objects_url=s3_url, metadata_url=metadata_url).close()
    writers = [_spawn(_WRITER, str(tmp_path), str(w), str(COMMITS)) for w in range(WRITERS)]
    reader = _spawn(_READER, str(tmp_path))
    collector = _spawn(_COLLECTOR, str(tmp_path), str(WRITERS * COMMITS))
    outputs = {}
    for process in [*writers, reader, collector]:
        out, err = process.communicate(timeout=900)
        assert process.returncode == 0, err
        assert "locked" not in err.lower()
        outputs[process.pid] = out
    assert json.loads(outputs[reader.pid].splitlines()[-1])["checked"] >= 40
    assert int(outputs[collector.pid].split()[-1]) >= 3  # gc ran between commits, not only after them
    exec(_STATE, namespace := {})
    from tests.conftest import assert_same

    with Repository.open(tmp_path) as repo:
        commits = repo.log(all_refs=True)
        assert len(commits) == WRITERS * COMMITS
        for info in commits:
            writer, index = map(int, info.message.split())
            assert_same(namespace["state"](writer, index), repo.checkout(info.id))
        assert fsck(repo).ok


_ONE_COMMIT = _STATE + """
import sys
from ckptstore import Repository
from ckptstore.errors import ConflictError
with Repository.open(sys.argv[1]) as repo:
    try:
        print(repo.commit(state(int(sys.argv[2]), 0), message=sys.argv[2], branch="same"))
    except ConflictError as exc:
        print("conflict", exc)
"""


def test_two_writers_on_one_branch_of_a_shared_repository_one_conflict_nothing_lost(tmp_path, s3_url, metadata_url):
    import os
    import time

    Repository.init(tmp_path, objects_url=s3_url, metadata_url=metadata_url).close()
    go = tmp_path / "go"
    # the first writer stops once its objects are uploaded, before its metadata transaction
    first = subprocess.Popen([sys.executable, "-c", _ONE_COMMIT, str(tmp_path), "1"], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, CKPT_WAIT_AT=f"commit:objects-written={go}"))
    deadline = time.monotonic() + 120
    while not (tmp_path / "go.reached").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-c", _ONE_COMMIT, str(tmp_path), "2"], cwd=ROOT, text=True,
                            capture_output=True, timeout=300)
    go.touch()
    out, err = first.communicate(timeout=300)
    assert first.returncode == second.returncode == 0, err + second.stderr
    assert out.startswith("conflict") and "same" in out, out
    exec(_STATE, namespace := {})
    from tests.conftest import assert_same

    with Repository.open(tmp_path) as repo:
        assert [info.message for info in repo.log("same")] == ["2"]
        assert_same(namespace["state"](2, 0), repo.checkout("same"))
        assert fsck(repo).ok

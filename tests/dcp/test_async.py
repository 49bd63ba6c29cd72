"""`dcp.async_save` through CkptStorageWriter in one process (the 4-rank run is in test_ranks.py)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckptstore import Repository
from ckptstore.dcp import CkptStorageReader, CkptStorageWriter
from ckptstore.errors import CkptError, RepoLockedError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_async_save_commits_the_state_as_it_was_when_the_call_returned(tmp_path):
    with Repository.init(tmp_path) as repo:
        state = {"w": torch.randn(300, 40), "step": 3}
        before = state["w"].clone()
        writer = CkptStorageWriter(repo, message="async", step=3)
        future = dcp.async_save(state, storage_writer=writer)
        state["w"].add_(1.0)  # training goes on: DCP's stager copied the state first
        state["step"] = 4
        assert type(future.result()).__name__ == "Metadata"
        assert [c.id for c in repo.log()] == [writer.commit_id] and repo.log()[0].step == 3
        loaded = {"w": torch.zeros(300, 40), "step": 0}
        dcp.load(loaded, storage_reader=CkptStorageReader(repo))
        assert torch.equal(loaded["w"], before) and loaded["step"] == 3
        dcp.async_save(state, storage_writer=writer).result()  # the same writer again, once the first is done
        assert repo.log()[0].id == writer.commit_id and repo.log()[0].parents == [repo.log()[1].id]
    with Repository.init(tmp_path / "other") as other:  # DCP's checkpoint_id names the repository
        dcp.async_save(state, checkpoint_id=tmp_path / "other", storage_writer=writer).result()
        assert [c.id for c in other.log()] == [writer.commit_id]


def test_a_save_overlapping_one_still_running_on_the_same_writer_is_refused(tmp_path):
    planned, release = threading.Event(), threading.Event()

    class Slow(DefaultSavePlanner):
        """The async save stops after planning until the test lets it go."""

        def finish_plan(self, new_plan):
            planned.set()
            release.wait(60)
            return super().finish_plan(new_plan)

    with Repository.init(tmp_path) as repo:
        writer = CkptStorageWriter(repo, message="first")
        dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=writer)  # a finished save on this thread is no bar
        first = dcp.async_save({"w": torch.ones(4)}, storage_writer=writer, planner=Slow())
        assert planned.wait(60)
        with pytest.raises(CheckpointException, match="still saving the previous checkpoint") as raised:
            dcp.save({"w": torch.zeros(4)}, storage_writer=writer)
        assert isinstance(raised.value.failures[0][0], CkptError)
        release.set()
        first.result()
        assert [c.message for c in repo.log()] == ["first", "first"] and repo.log()[0].id == writer.commit_id


def test_a_writer_travels_to_async_saves_checkpoint_process_by_path(tmp_path):
    with Repository.init(tmp_path) as repo:
        writer = CkptStorageWriter(repo, branch="bg", message="from a copy")
        copy = pickle.loads(pickle.dumps(writer))  # what AsyncCheckpointerType.PROCESS sends
        dcp.save({"w": torch.arange(6.0)}, storage_writer=copy)
        copy.close()
        assert repo.resolve("bg") == copy.commit_id and repo.commit_info("bg").message == "from a copy"


def test_after_a_failed_save_on_the_main_thread_an_async_save_releases_its_lock_and_commits(tmp_path):
    class Fails(DefaultSavePlanner):
        """Fails after the coordinator took the lock, as a save does when another rank dies."""

        def finish_plan(self, new_plan):
            raise RuntimeError("another rank died")

    with Repository.init(tmp_path) as repo:
        writer = CkptStorageWriter(repo, message="after a failure")
        with pytest.raises(CheckpointException, match="another rank died"):
            dcp.save({"w": torch.ones(4)}, storage_writer=writer, planner=Fails())
        with pytest.raises(RepoLockedError):  # the failed save still holds the lock: gc would wait
            with repo.lock(exclusive=True, wait=False):
                pass
        dcp.async_save({"w": torch.ones(4)}, storage_writer=writer).result()
        assert [c.message for c in repo.log()] == ["after a failure"] and repo.log()[0].id == writer.commit_id
        with repo.lock(exclusive=True, wait=False):  # released
            pass

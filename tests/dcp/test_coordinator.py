"""The DCP coordinators in one process: what the writer's `finish` records, the locks and checks around it, and the
reader's plan check and byte ranges (each stored shard's region read from the chunks that hold it, no more)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ckptstore import Repository
from ckptstore.dcp import CkptStorageReader, CkptStorageWriter
from ckptstore.errors import CkptError, RepoLockedError
from ckptstore.policy import EncodingSettings

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ---------------------------------------------------------------------- the writer's coordinator
def _one_shard_short(results):
    """The last shard reported by no rank (lost on its way to the coordinator)."""
    return [results[0][:-1]]


def _one_shard_unplanned(results):
    """One shard more than DCP's metadata describes: a rank's report from another save."""
    first = results[0][0]
    return [[*results[0], replace(first, storage_data={**first.storage_data, "key": first.storage_data["key"] + "x"})]]


class _ResultsChanged(CkptStorageWriter):
    """A coordinator whose `finish` gets the ranks' results as `change` makes them."""

    def __init__(self, *args, change, **kwargs):
        super().__init__(*args, **kwargs)
        self.change = change

    def finish(self, metadata, results):
        return super().finish(metadata, self.change(results))


@pytest.mark.parametrize("change", [_one_shard_short, _one_shard_unplanned], ids=["a-shard-missing",
                                                                                  "a-shard-unplanned"])
def test_finish_records_nothing_unless_the_ranks_wrote_exactly_the_planned_shards(repo, change):
    """A rank's shard missing, or a stray one, records no commit at all (mutation audit round 12)."""
    repo.commit({"first": torch.ones(3)}, "before")
    tip = repo.resolve("main")
    writer = _ResultsChanged(repo, message="short", change=change)
    with pytest.raises(CheckpointException, match="nothing was recorded"):
        dcp.save({"a": torch.randn(8), "b": torch.randn(8), "c": torch.randn(8)}, storage_writer=writer)
    assert writer.commit_id is None
    assert repo.resolve("main") == tip and [c.message for c in repo.log()] == ["before"]


def test_the_repository_lock_is_held_from_planning_to_finish(repo):
    """A gc between the ranks' writes and the record waits, or it deletes their objects (mutation audit round 12)."""
    seen = []

    class TriesAGc(DefaultSavePlanner):
        """Another process's gc, after the coordinator planned and before any rank writes."""

        def finish_plan(self, new_plan):
            with Repository.open(repo.root) as other:
                try:
                    with other.lock(exclusive=True, wait=False):
                        seen.append("gc could run")
                except RepoLockedError:
                    seen.append("gc waits")
            return super().finish_plan(new_plan)

    dcp.save({"w": torch.randn(16)}, storage_writer=CkptStorageWriter(repo), planner=TriesAGc())
    assert seen == ["gc waits"] and repo.resolve("main") is not None


def test_a_save_that_reuses_every_tensor_counts_every_shards_raw_bytes(repo):
    """A commit's raw size counts every shard, a reused or repeated one too, never 0 (mutation audit round 12)."""
    a = torch.randn(32)
    state = {"a": a, "b": torch.randn(8, 8), "c": a.clone()}  # a and c: one content twice
    writers = [CkptStorageWriter(repo, message=message) for message in ("first", "again")]
    for writer in writers:
        dcp.save(state, storage_writer=writer)
    raw = [repo.commit_info(writer.commit_id).raw_bytes for writer in writers]
    assert raw == [(32 + 64 + 32) * 4] * 2


def test_the_coordinator_refuses_ranks_that_resolved_different_commits(repo):
    """A load whose ranks resolved the ref to two commits is refused before any rank reads (mutation audit round 12)."""
    reader = CkptStorageReader(repo)
    plans = [LoadPlan([], storage_data={"commit": "a" * 64}), LoadPlan([], storage_data={"commit": "b" * 64})]
    with pytest.raises(CkptError, match="different commits"):
        reader.prepare_global_plan(plans)
    assert reader.prepare_global_plan(plans[:1] * 2) == plans[:1] * 2


# ---------------------------------------------------------------------- the reader's byte ranges
class _Collect:
    """The parts of a LoadPlanner that read_data calls: each requested region lands in a tensor of its own."""

    def __init__(self):
        self.got = {}

    def resolve_tensor(self, item):
        return torch.empty(tuple(item.lengths), dtype=torch.float32)

    def commit_tensor(self, item, tensor):
        self.got[tuple(item.dest_offsets)] = tensor.clone()


@pytest.fixture
def rows(tmp_path):
    """A 64x64 float32 `w` saved by DCP into a repository of 1 KiB chunks (16 chunks of 4 rows); returns `w`."""
    Repository.init(tmp_path, encoding=EncodingSettings(chunk_bytes=1024)).close()
    w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    dcp.save({"w": w}, storage_writer=CkptStorageWriter(tmp_path))
    return w


def _rows(start: int, stop: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The region of rows [start, stop) of `w`, as a box ((row, col), (rows, cols))."""
    return (start, 0), (stop - start, 64)


def _read(root, boxes) -> tuple[dict, int]:
    """read_data of one ReadItem per box of `w`, in this order: the regions by their offsets, and bytes replayed."""
    reader = CkptStorageReader(root)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    items = [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", list(at)), dest_offsets=torch.Size(at),
                      storage_index=index, storage_offsets=torch.Size(at), lengths=torch.Size(size))
             for at, size in boxes]
    planner = _Collect()
    reader.read_data(LoadPlan(items), planner).wait()
    return planner.got, reader.bytes_replayed


@pytest.mark.parametrize("order", [[_rows(0, 4), _rows(60, 64)], [_rows(60, 64), _rows(0, 4)],
                                   [_rows(8, 12), _rows(32, 36), _rows(20, 24)]])
def test_two_regions_of_one_stored_shard_both_come_back_exact(tmp_path, rows, order):
    """Regions of one stored shard read together each come back as their own bytes (mutation audit round 12)."""
    got, _ = _read(tmp_path, order)
    for (row, col), (count, cols) in order:
        assert torch.equal(got[(row, col)], rows[row:row + count, col:col + cols]), row


@pytest.mark.parametrize("order", [[_rows(10, 10), _rows(60, 64)], [_rows(60, 64), _rows(10, 10)]])
def test_an_empty_region_never_widens_what_a_rank_reads(tmp_path, rows, order):
    """An empty region beside one at the end reads that one's chunk only, not from byte 0 (mutation audit round 12)."""
    got, replayed = _read(tmp_path, order)
    assert torch.equal(got[(60, 0)], rows[60:64])
    assert replayed == 1024  # one chunk of 16


@pytest.mark.parametrize("box", [((0, 0), (5, 1)), ((3, 63), (2, 1)), ((3, 62), (2, 2)), ((4, 0), (4, 64))],
                         ids=["ends-on-a-chunks-first-element", "starts-on-a-chunks-last-element", "crosses", "whole"])
def test_a_region_at_a_chunk_boundary_reads_every_chunk_it_touches(tmp_path, rows, box):
    """A region whose first or last element is alone in its chunk reads that chunk too (mutation audit round 12)."""
    (row, col), (count, cols) = box
    got, _ = _read(tmp_path, [box])
    assert torch.equal(got[(row, col)], rows[row:row + count, col:col + cols])

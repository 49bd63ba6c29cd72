"""The DCP plugins in one process (no process group): metadata as JSON, refusals, the pickle guard."""

from __future__ import annotations

import collections
import enum
import io
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore import Repository
from ckptstore.dcp import CkptStorageReader, CkptStorageWriter, meta
from ckptstore.errors import CkptError, ConflictError, CorruptObjectError, PickledObjectsError, UnsupportedStateError
from ckptstore.formats import dcpmeta
from ckptstore.repo import export, fsck
from ckptstore.repo.manifest import Manifest, ManifestVersionError
from ckptstore.repo.sharded import dcp_problem

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Opaque:
    """A class torch's restricted unpickler refuses: loading it would import and run this module's code."""

    def __init__(self, value: int) -> None:
        self.value = value


def _metadata() -> Metadata:
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])),
              ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 4]))]
    return Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([5, 4]), chunks),
                             "opt.lr": BytesStorageMetadata()},
        planner_data={"w": ("w",), "opt.lr": ("opt", "param_groups", 0, "lr")},
        storage_meta=StorageMeta(checkpoint_id="x", save_id="s1", modules=["m"]), version="1.0.0")


def test_metadata_round_trips_through_json_without_pickle():
    original = _metadata()
    data = dcpmeta.to_json(original)
    back = meta.from_json(data, "0" * 64)
    assert back.state_dict_metadata == original.state_dict_metadata
    assert back.planner_data == original.planner_data  # tuples stay tuples, ints stay ints
    assert back.storage_meta == original.storage_meta and back.version == "1.0.0"
    assert back.storage_data == {MetadataIndex("w", [0, 0]): "w/%shard/0,0/3,4",
                                 MetadataIndex("w", [3, 0]): "w/%shard/3,0/2,4",
                                 MetadataIndex("opt.lr"): "opt.lr/%bytes"}


def test_unknown_dcp_metadata_versions_and_unstorable_planner_data_are_refused():
    data = dict(dcpmeta.to_json(_metadata()), version=99)
    with pytest.raises(ManifestVersionError, match="version 99"):
        meta.from_json(data, "0" * 64)
    mangled = dict(dcpmeta.to_json(_metadata()), items=[{"fqn": "w", "type": "tensor"}])
    with pytest.raises(CorruptObjectError, match="DCP metadata is missing or mangling a field"):
        meta.from_json(mangled, "0" * 64)
    odd = _metadata()
    odd.planner_data = {"w": object()}
    with pytest.raises(UnsupportedStateError, match="JSON"):
        dcpmeta.to_json(odd)


def test_sharded_manifests_are_version_2_and_ordinary_ones_keep_version_1():
    sharded = Manifest("dcp", [], {}, {}, dcp=dcpmeta.to_json(_metadata()))
    plain = Manifest("state", [], {}, {})
    assert sharded.to_record()["version"] == 2 and "dcp" not in plain.to_record()
    assert plain.to_record()["version"] == 1
    assert Manifest.from_bytes(sharded.to_bytes()).dcp == sharded.dcp
    assert Manifest.from_bytes(plain.to_bytes()).dcp is None


def test_single_process_save_load_and_the_in_memory_checkout_refusal(tmp_path):
    repo = Repository.init(tmp_path)
    state = {"w": torch.randn(6, 3), "n": torch.arange(4), "note": {"text": "hi", "k": 3}}
    writer = CkptStorageWriter(tmp_path, message="single", step=1)
    dcp.save(state, storage_writer=writer)
    assert repo.resolve("main") == writer.commit_id
    loaded = {"w": torch.zeros(6, 3), "n": torch.zeros(4, dtype=torch.int64), "note": {"text": "", "k": 0}}
    dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path, "main"))
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["n"], state["n"])
    assert loaded["note"] == {"text": "hi", "k": 3}
    with pytest.raises(CkptError, match="CkptStorageReader"):
        repo.checkout("main")
    second = CkptStorageWriter(tmp_path, message="second")
    dcp.save(dict(state, w=state["w"] + 1), storage_writer=second)
    assert repo.checkout_to("main~1") == repo.root  # nothing to write in place: HEAD moves, detached
    assert repo.head() == (None, writer.commit_id) and sorted(p.name for p in tmp_path.iterdir()) == [".ckpt"]
    repo.checkout_to("main")  # and back onto the branch, which a sharded tip refused (auditor)
    assert repo.head() == ("main", second.commit_id)
    with pytest.raises(CkptError, match="check it out whole"):  # a partial checkout: dcp.load reads parts
        repo.checkout_to("main", tmp_path / "part", keys=["w"])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(CkptError, match="not an empty folder"):
        repo.checkout_to("main", tmp_path / "busy")
    repo.checkout_to("main~1", tmp_path / "out")  # a DCP directory: plain dcp.load reads it
    again = {"w": torch.zeros(6, 3), "n": torch.zeros(4, dtype=torch.int64), "note": {"text": "", "k": 0}}
    dcp.load(again, storage_reader=dcp.FileSystemReader(tmp_path / "out"))
    assert torch.equal(again["w"], state["w"]) and torch.equal(again["n"], state["n"])
    assert again["note"] == state["note"]
    repo.commit({"plain": torch.ones(2)}, "ordinary")
    with pytest.raises(CheckpointException, match="not a sharded"):  # DCP wraps every rank's error in one
        dcp.load({"plain": torch.zeros(2)}, storage_reader=CkptStorageReader(tmp_path, "main"))
    repo.close()


def test_bytes_items_that_need_full_unpickling_are_refused_unless_trusted(tmp_path):
    Repository.init(tmp_path).close()
    dcp.save({"obj": Opaque(5), "w": torch.ones(2)}, storage_writer=CkptStorageWriter(tmp_path))
    target = {"obj": None, "w": torch.zeros(2)}
    with pytest.raises(CheckpointException, match="beyond plain data") as raised:
        dcp.load(target, storage_reader=CkptStorageReader(tmp_path))
    assert target["obj"] is None
    assert isinstance(raised.value.failures[0][0], PickledObjectsError)
    dcp.load(target, storage_reader=CkptStorageReader(tmp_path, trust_pickle=True))
    assert isinstance(target["obj"], Opaque) and target["obj"].value == 5
    # a checkout -o writes what a plain dcp.load unpickles in full: never the stored pickle as it is
    with pytest.raises(PickledObjectsError, match="obj: this non-tensor item"):
        Repository.open(tmp_path).checkout_to("main", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_trusted_reads_and_checkouts_of_plain_non_tensor_items(tmp_path):
    """Plain values are JSON skeletons: trust_pickle=True reads them too; -o into a missing folder is refused."""
    with Repository.init(tmp_path / "repo") as repo:
        dcp.save({"w": torch.arange(4.0), "step": 100, "name": "run-1"},
                 storage_writer=CkptStorageWriter(tmp_path / "repo"))
        loaded = {"w": torch.zeros(4), "step": 0, "name": ""}
        dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path / "repo", trust_pickle=True))
        assert loaded["step"] == 100 and loaded["name"] == "run-1" and torch.equal(loaded["w"], torch.arange(4.0))
        with pytest.raises(CkptError, match="does not exist; create it first"):
            repo.checkout_to("main", tmp_path / "missing" / "out")
        assert not (tmp_path / "missing").exists()


def test_a_second_save_of_the_same_state_reuses_every_tensor(tmp_path):
    repo = Repository.init(tmp_path)
    state = {"w": torch.randn(64, 64), "b": io.BytesIO(b"raw bytes item")}
    first, second = CkptStorageWriter(tmp_path, message="a"), CkptStorageWriter(tmp_path, message="b")
    dcp.save(state, storage_writer=first)
    dcp.save(state, storage_writer=second)
    info = repo.commit_info("main")
    assert info.parents == [first.commit_id]
    assert repo.manifest(first.commit_id).entries == repo.manifest(second.commit_id).entries
    assert info.stored_bytes < 2000  # only the manifest is new
    loaded = {"w": torch.zeros(64, 64), "b": io.BytesIO()}
    dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path))
    assert torch.equal(loaded["w"], state["w"]) and loaded["b"].getvalue() == b"raw bytes item"
    repo.close()


def test_fsck_checks_a_sharded_manifest_against_its_dcp_metadata(tmp_path):
    repo = Repository.init(tmp_path)
    dcp.save({"w": torch.randn(4, 4), "note": "x"}, storage_writer=CkptStorageWriter(tmp_path))
    manifest = repo.manifest(repo.resolve("main"))
    assert dcp_problem(manifest) is None and fsck(repo).ok
    key = next(k for k in manifest.entries if k.startswith("w/"))
    wrong_shape = replace(manifest, entries={**manifest.entries, key: replace(manifest.entries[key], shape=(2, 8))})
    assert "its DCP metadata says torch.float32 [4, 4]" in dcp_problem(wrong_shape)
    missing = replace(manifest, entries={k: e for k, e in manifest.entries.items() if k != key})
    assert "not among its entries" in dcp_problem(missing)
    unnamed = replace(manifest, entries={**manifest.entries, "x/%bytes": manifest.entries["note/%bytes"]})
    assert "not named by its DCP metadata" in dcp_problem(unnamed)
    assert "version 7" in dcp_problem(replace(manifest, dcp={**manifest.dcp, "version": 7}))
    w = next(item for item in manifest.dcp["items"] if item["fqn"] == "w")
    twice = {**manifest.dcp, "items": [*manifest.dcp["items"], {**w, "fqn": "w2"}]}  # one stored shard for two
    assert "names entry" in dcp_problem(replace(manifest, dcp=twice)) and "twice" in dcp_problem(
        replace(manifest, dcp=twice))
    repo.close()


def test_the_reader_refuses_a_commit_whose_dcp_metadata_disagrees_with_its_entries(tmp_path):
    """A crafted remote's sharded commit (its ids recomputed) said a (4, 4) shard was (2, 8): loaded silently wrong.

    Checkout and export checked the metadata against the entries; CkptStorageReader did not, and
    read the rows at the stored shape's strides (row 1 came back as elements 4-11).
    """
    from ckptstore.repo.commit import CommitOptions
    from ckptstore.repo.sharded import WrittenShard, record_sharded
    from ckptstore.repo.target import start_now

    repo = Repository.init(tmp_path)
    dcp.save({"w": torch.arange(16, dtype=torch.float32).reshape(4, 4)}, storage_writer=CkptStorageWriter(tmp_path))
    manifest = repo.manifest(repo.resolve("main"))
    items = [{**item, "size": [2, 8], "chunks": [[[0, 0], [2, 8], key] for _, _, key in item["chunks"]]}
             if item["fqn"] == "w" else item for item in manifest.dcp["items"]]
    forged = record_sharded(repo, start_now(repo, None),
                            [WrittenShard(k, e, None, {}, 64) for k, e in manifest.entries.items()],
                            {**manifest.dcp, "items": items}, CommitOptions(message="forged", allow_empty=True))
    loaded = {"w": torch.zeros(2, 8)}
    with pytest.raises(CheckpointException, match=f"{forged[:12]} .* cannot be loaded: entry .* DCP metadata says"):
        dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path, forged))
    assert not loaded["w"].any()
    repo.close()


def test_the_reader_says_upgrade_for_a_newer_ckptstores_sharded_commit_not_damage(tmp_path):
    from ckptstore.repo.commit import CommitOptions
    from ckptstore.repo.sharded import WrittenShard, record_sharded
    from ckptstore.repo.target import start_now

    repo = Repository.init(tmp_path)
    dcp.save({"w": torch.ones(4, 4)}, storage_writer=CkptStorageWriter(tmp_path))
    manifest = repo.manifest(repo.resolve("main"))
    newer = record_sharded(repo, start_now(repo, None),
                           [WrittenShard(k, e, None, {}, 64) for k, e in manifest.entries.items()],
                           {**manifest.dcp, "version": 2}, CommitOptions(message="newer", allow_empty=True))
    with pytest.raises(CheckpointException, match="upgrade ckptstore to load it"):
        dcp.load({"w": torch.zeros(4, 4)}, storage_reader=CkptStorageReader(tmp_path, newer))
    repo.close()


def test_a_shard_given_twice_or_naming_a_tensor_no_record_holds_records_nothing(tmp_path):
    """Two ranks writing one shard, and a shard reusing a tensor no record holds, made a commit that does not read
    where either check was gone: no test held them (mutation audit)."""
    from dataclasses import replace

    from ckptstore.repo.commit import CommitOptions
    from ckptstore.repo.sharded import WrittenShard, record_sharded
    from ckptstore.repo.target import start_now

    repo = Repository.init(tmp_path)
    dcp.save({"w": torch.ones(4, 4)}, storage_writer=CkptStorageWriter(tmp_path))
    tip = repo.resolve("main")
    manifest = repo.manifest(tip)
    shards = [WrittenShard(k, e, None, {}, 64) for k, e in manifest.entries.items()]
    options = CommitOptions(message="again", allow_empty=True)
    with pytest.raises(CkptError, match="two ranks wrote the same shard"):
        record_sharded(repo, start_now(repo, None), [*shards, shards[0]], manifest.dcp, options)
    unknown = [replace(shards[0], entry=replace(shards[0].entry, tensor="ab" * 32)), *shards[1:]]
    with pytest.raises(CkptError, match="name tensors that have no record"):
        record_sharded(repo, start_now(repo, None), unknown, manifest.dcp, options)
    assert repo.resolve("main") == tip and len(repo.log()) == 1
    repo.close()


def test_a_branch_moved_during_the_save_records_nothing(tmp_path):
    repo = Repository.init(tmp_path)
    repo.commit({"first": torch.ones(3)}, "before")

    class MovesTheBranch(DefaultSavePlanner):
        """Another writer commits to the branch after the coordinator chose the parent, before finish."""

        def finish_plan(self, new_plan):
            repo.commit({"other": torch.zeros(3)}, "meanwhile")
            return super().finish_plan(new_plan)

    with pytest.raises(CheckpointException, match="moved to") as raised:
        dcp.save({"w": torch.randn(4)}, storage_writer=CkptStorageWriter(tmp_path, message="lost race"),
                 planner=MovesTheBranch())
    assert isinstance(raised.value.failures[0][0], ConflictError)
    assert [c.message for c in repo.log()] == ["meanwhile", "before"]
    assert fsck(repo).ok
    repo.close()


def test_export_writes_an_ordinary_commit_too(tmp_path):
    from safetensors.torch import load_file

    repo = Repository.init(tmp_path / "repo")
    state = {"w": torch.randn(3, 5), "step": 7, "nested": {"b": torch.arange(4, dtype=torch.int16)}}
    cid = repo.commit(state, "plain")
    report = export(repo, "main", "safetensors", tmp_path / "plain.safetensors")
    assert report.commit == cid and report.tensors == 2 and report.skipped == ["step"]  # a number: named as left out
    loaded = load_file(str(tmp_path / "plain.safetensors"))
    assert sorted(loaded) == sorted(repo.manifest(cid).entries)
    assert {tuple(t.shape) for t in loaded.values()} == {(3, 5), (4,)}
    assert any(torch.equal(t, state["w"]) for t in loaded.values())
    export(repo, "main", "torch", tmp_path / "plain.pt")
    back = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 7 and torch.equal(back["nested"]["b"],
                                                                                  state["nested"]["b"])
    repo.close()


def test_dcp_unpickles_a_fresh_pickle_of_what_the_restricted_loader_read_never_the_stored_bytes():
    import io

    from ckptstore.formats.dcpdir import item_pickle

    stored = io.BytesIO()
    torch.save({"step": 7, "lr": [1e-3, 2e-3]}, stored, _use_new_zipfile_serialization=False)  # not what DCP writes
    handed = item_pickle("optim.extra", stored.getvalue())
    assert handed != stored.getvalue()
    assert torch.load(io.BytesIO(handed), weights_only=True) == {"step": 7, "lr": [1e-3, 2e-3]}


def test_plain_bytes_items_are_stored_as_skeletons_never_as_pickles(tmp_path):
    from ckptstore.formats.dcpmeta import SKELETON_MAGIC, bytes_key
    from ckptstore.repo.checkout import restore

    repo = Repository.init(tmp_path)
    note = {"text": "hi", "k": 3, "lr": [1e-3, 2.5], "nested": {"none": None, "flag": True}}
    dcp.save({"w": torch.ones(3), "note": note, "obj": Opaque(2)}, storage_writer=CkptStorageWriter(tmp_path))
    manifest = repo.manifest(repo.resolve("main"))
    items = [path for path in manifest.entries if path.endswith("/%bytes")]  # DCP flattens `note` into leaves
    stored = restore(repo, manifest, paths=items)
    assert len(items) >= 5 and bytes_key("obj") in items
    for path in items:  # plain data as a skeleton; an object beyond it keeps DCP's pickle
        assert bytes(stored[path].data).startswith(SKELETON_MAGIC) == (path != bytes_key("obj")), path
    loaded = {"w": torch.zeros(3), "note": {"text": "", "k": 0, "lr": [0.0, 0.0], "nested": {"none": 1, "flag": False}}}
    dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path))
    assert loaded["note"] == note and torch.equal(loaded["w"], torch.ones(3))
    repo.close()


def test_dcp_plan_caching_is_refused_before_anything_is_written(tmp_path):
    """A cached plan is the first save's, parent commit and all: later saves would encode against a stale parent."""
    with Repository.init(tmp_path) as repo:
        with pytest.raises(CheckpointException, match="enable_plan_caching"):
            dcp.save({"w": torch.ones(4)}, storage_writer=CkptStorageWriter(tmp_path),
                     planner=DefaultSavePlanner(enable_plan_caching=True))
        assert repo.head()[1] is None and list(repo.store.iter_ids()) == []
        dcp.save({"w": torch.ones(4)}, storage_writer=CkptStorageWriter(tmp_path))  # the lock was released
        assert repo.head()[1] is not None


class Mode(enum.IntEnum):
    TRAIN = 1


Point = collections.namedtuple("Point", "x y")


def test_subclasses_of_plain_types_keep_their_type_or_are_refused_never_converted(tmp_path):
    """The JSON skeleton would turn an IntEnum into an int and a namedtuple into a tuple: DCP's pickle keeps them."""
    with Repository.init(tmp_path):
        dcp.save({"w": torch.ones(2), "mode": Mode.TRAIN, "pt": Point(1, 2), "plain": (1, 2)},
                 storage_writer=CkptStorageWriter(tmp_path))
    with pytest.raises(CheckpointException, match="beyond plain data"):
        dcp.load({"w": torch.zeros(2), "mode": None, "pt": None, "plain": None},
                 storage_reader=CkptStorageReader(tmp_path))
    loaded = {"w": torch.zeros(2), "mode": None, "pt": None, "plain": None}
    dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path, trust_pickle=True))
    assert type(loaded["mode"]) is Mode and type(loaded["pt"]) is Point and loaded["pt"] == Point(1, 2)
    assert loaded["plain"] == (1, 2) and type(loaded["plain"]) is tuple


def test_numpy_scalars_among_non_tensor_items_load_without_trust_as_their_values(tmp_path):
    """np.float64 subclasses float, np.str_ str: stored by value as before (a metric logged from numpy is common)."""
    import numpy as np

    with Repository.init(tmp_path):
        dcp.save({"w": torch.ones(2), "loss": np.float64(0.5), "name": np.str_("run")},
                 storage_writer=CkptStorageWriter(tmp_path))
    loaded = {"w": torch.zeros(2), "loss": None, "name": None}
    dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path))
    assert loaded["loss"] == 0.5 and loaded["name"] == "run"


def test_a_shard_whose_id_a_received_record_claims_is_encoded_anew(tmp_path):
    """As for ordinary commits (repo/received.py): a crafted remote's record must not be reused unchecked."""
    from ckptstore.hashing import tensor_id
    from tests.conftest import received_lie, unchecked

    repo = Repository.init(tmp_path)
    honest = repo.manifest(repo.commit({"v": torch.arange(16.0)})).entries["v"].tensor
    zeros = torch.zeros(16)
    poisoned = tensor_id("torch.float32", (16,), zeros.numpy().view("uint8"))
    received_lie(repo.dir, poisoned, honest)  # zeros' id over arange's bytes
    dcp.save({"v": zeros}, storage_writer=CkptStorageWriter(tmp_path, message="my zeros"))
    loaded = {"v": torch.ones(16)}
    dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path))
    assert torch.equal(loaded["v"], zeros) and fsck(repo, full=True).ok
    assert not unchecked(repo, {poisoned})


def test_diff_of_a_sharded_commit_and_a_file_commit_compares_tensors_by_name(tmp_path):
    """It listed DCP's storage keys (`model.w/%shard/...`, `%container`) as removed and added, and every
    tensor as differing, for the very same state (auditor)."""
    state = {"model": {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0)),
                       "layer.0.bias": torch.ones(3)}, "extra": {"step": 7}}
    with Repository.init(tmp_path) as repo:
        dcp.save(state, storage_writer=CkptStorageWriter(repo, message="sharded"), no_dist=True)
        torch.save(state, tmp_path / "same.pt")
        repo.commit(tmp_path / "same.pt", message="same state")
        rows = {d.path: (d.status, d.relative_l2) for d in repo.diff("HEAD~1", "HEAD")}
        assert rows == {"model.w": ("unchanged", 0.0), "model.layer.0.bias": ("unchanged", 0.0),
                        "extra.step": ("uncompared", None)}
        state["model"]["w"][0, 0] += 1.0
        state["model"]["new"] = torch.zeros(2)
        torch.save(state, tmp_path / "same.pt")
        repo.commit(tmp_path / "same.pt", message="changed")
        rows = {d.path: (d.status, d.relative_l2) for d in repo.diff("HEAD~2", "HEAD")}
        assert rows["model.w"][0] == "changed" and rows["model.w"][1] == pytest.approx(1 / 64, rel=0.2)
        assert rows["model.new"] == ("added", None) and rows["model.layer.0.bias"] == ("unchanged", 0.0)
        backwards = {d.path: d.status for d in repo.diff("HEAD", "HEAD~2")}
        assert backwards == {"model.w": "changed", "model.new": "removed", "model.layer.0.bias": "unchanged",
                             "extra.step": "uncompared"}


def test_a_load_whose_commit_a_prune_removes_between_planning_and_reading_says_so(tmp_path):
    """The load said the repository was damaged and sent the user to fsck, which found nothing (sharded auditor)."""
    from ckptstore.repo.config import RetentionPolicy
    from ckptstore.repo.pruning import prune

    repo = Repository.init(tmp_path)
    cids = []
    for step in range(3):
        writer = CkptStorageWriter(repo, step=step)
        dcp.save({"w": torch.full((64, 64), float(step)), "extra": {"step": step}}, storage_writer=writer)
        cids.append(writer.commit_id)

    class PrunedMeanwhile(CkptStorageReader):  # another process's retention, between planning and reading
        def read_data(self, plan, planner):
            with Repository.open(tmp_path) as other:
                prune(other, RetentionPolicy(keep_last=1))
            return super().read_data(plan, planner)

    with pytest.raises(CheckpointException, match="removed by `ckpt prune`") as raised:
        dcp.load({"w": torch.zeros(64, 64), "extra": {"step": -1}}, storage_reader=PrunedMeanwhile(repo, cids[0]))
    assert "damaged" not in str(raised.value) and fsck(repo, full=True).ok


def test_diff_lists_a_sharded_commits_non_tensor_items_as_values_and_says_which_it_could_not_compare(tmp_path):
    """Two sharded commits listed their changed bytes items as tensors ('5 of 12 tensors differ' for one tensor),
    and a sharded commit beside a file commit said nothing of the values it left out (auditor 415)."""
    from click.testing import CliRunner

    from ckptstore.cli import cli
    from ckptstore.repo.diff import UNCOMPARED, VALUE

    with Repository.init(tmp_path) as repo:
        for step, last in ((1, [1, 2]), (2, [1, 3])):
            dcp.save({"w": torch.ones(3), "extra": {"step": step, "name": "a", "l": last}},
                     storage_writer=CkptStorageWriter(repo, message=str(step)))
        rows = repo.diff("HEAD~1", "HEAD")
        assert [(r.path, r.status) for r in rows if r.dtype != VALUE] == [("w", "unchanged")]
        assert {r.path for r in rows if r.dtype == VALUE} == {"extra.step", "extra.l"}
        assert {r.status for r in rows if r.dtype == VALUE} == {"changed"}
        repo.commit({"w": torch.ones(3), "extra": {"step": 99}})
        mixed = repo.diff("HEAD~1", "HEAD")
    assert {(r.path, r.status) for r in mixed if r.dtype == VALUE} == {
        ("extra.step", UNCOMPARED), ("extra.name", UNCOMPARED), ("extra.l", UNCOMPARED)}
    shown = [CliRunner().invoke(cli, ["--repo", str(tmp_path), "diff", *revs]) for revs in (["HEAD~2", "HEAD~1"],
                                                                                          ["HEAD~1", "HEAD"])]
    assert shown[0].output.endswith("0 of 1 tensors differ; 2 non-tensor values differ\n"), shown[0].output
    assert shown[1].output.endswith("0 of 1 tensors differ; 3 non-tensor values not compared: one commit is sharded, "
                                    "the other not (--all lists them)\n"), shown[1].output


def test_diff_of_a_sharded_commit_shows_a_tensors_dtype_and_shape_change_as_old_to_new(tmp_path):
    """Two sharded commits never showed a dtype or shape change, and a sharded commit beside a file commit showed
    the older side's dtype and shape as the newer's (auditor 442)."""
    with Repository.init(tmp_path) as repo:
        dcp.save({"w": torch.randn(40, 40)}, storage_writer=CkptStorageWriter(repo, message="f32"))
        dcp.save({"w": torch.randn(20, 20, dtype=torch.float64)}, storage_writer=CkptStorageWriter(repo, message="f64"))
        repo.commit({"w": torch.randn(20, 20, dtype=torch.float64)})
        pairs = [("HEAD~2", "HEAD~1"), ("HEAD~2", "HEAD"), ("HEAD", "HEAD~2")]
        rows = [[r for r in repo.diff(a, b) if r.path == "w"] for a, b in pairs]
    f32, f64 = ("torch.float32", (40, 40)), ("torch.float64", (20, 20))
    for (row,), (was, now) in zip(rows, [(f32, f64), (f32, f64), (f64, f32)]):
        assert (row.status, (row.dtype, row.shape), row.was) == ("changed", now, was), row


def test_diff_of_sharded_commits_where_a_value_became_a_tensor_lists_it_changed(tmp_path):
    """209fe76 read the older item's dtype, which a non-tensor item has none of: KeyError (reviewer 444)."""
    with Repository.init(tmp_path) as repo:
        dcp.save({"w": torch.ones(4), "lr": 0.1}, storage_writer=CkptStorageWriter(repo, message="value"))
        dcp.save({"w": torch.ones(4), "lr": torch.tensor(0.2)}, storage_writer=CkptStorageWriter(repo, message="t"))
        (row,) = [r for r in repo.diff("HEAD~1", "HEAD") if r.path == "lr"]
    assert (row.status, row.dtype, row.was) == ("changed", "torch.float32", None), row

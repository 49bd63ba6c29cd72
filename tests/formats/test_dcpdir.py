"""DCP directories (FileSystemWriter's output) read and written in one process: refusals and round trips."""

from __future__ import annotations

import errno
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.dcp import CkptStorageReader
from ckptstore.errors import CheckpointFormatError, CorruptRecordError, NothingToCommitError, PickledObjectsError
from ckptstore.formats import dcpdir
from tests.conftest import ckpt_here

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Planted:
    """What a hostile `.metadata` could carry: unpickling it would import and call this module's code."""

    def __reduce__(self):
        return (print, ("code ran",))


def _state() -> dict:
    return {"w": torch.randn(40, 8, dtype=torch.bfloat16), "ids": torch.arange(7), "scalar": torch.tensor(2.5),
            "note": {"lr": 1e-3, "names": ["a", "b"]}, "blob": io.BytesIO(b"raw bytes")}


def _empty() -> dict:
    return {"w": torch.zeros(40, 8, dtype=torch.bfloat16), "ids": torch.zeros(7, dtype=torch.int64),
            "scalar": torch.tensor(0.0), "note": {"lr": 0.0, "names": ["", ""]}, "blob": io.BytesIO()}


def _same(a: dict, b: dict) -> bool:
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    tensors = all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k]))
                  for k in ("w", "ids", "scalar"))
    return tensors and a["note"] == b["note"] and a["blob"].getvalue() == b["blob"].getvalue()


@pytest.mark.parametrize("batch", [256 << 20, 100])  # one batch, and an item or two at a time
def test_a_directory_committed_checked_out_and_committed_again_is_the_same_commit(tmp_path, monkeypatch, batch):
    from ckptstore.repo import dcpfiles

    monkeypatch.setattr(dcpfiles, "BATCH_BYTES", batch)
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    with Repository.init(tmp_path / "repo") as repo:
        cid = repo.commit(tmp_path / "saved", "from disk")
        assert repo.commit_info(cid).kind == "dcp"
        loaded = _empty()
        dcp.load(loaded, storage_reader=CkptStorageReader(repo, cid))
        assert _same(loaded, state)
        repo.checkout_to(cid, tmp_path / "out")
        again = _empty()
        dcp.load(again, storage_reader=dcp.FileSystemReader(str(tmp_path / "out")))
        assert _same(again, state)
        with pytest.raises(NothingToCommitError, match="holds the same shards"):
            repo.commit(tmp_path / "out", "round trip")  # every shard, and the bytes items, came back as stored


def test_a_directory_whose_parent_commits_manifest_is_lost_is_committed_whole_with_a_warning(tmp_path):
    """A lost parent manifest blocked the next DCP directory's commit on its branch (auditor helper 274)."""
    first, second = _state(), _state()
    dcp.save(first, storage_writer=dcp.FileSystemWriter(str(tmp_path / "a")))
    dcp.save(second, storage_writer=dcp.FileSystemWriter(str(tmp_path / "b")))
    with Repository.init(tmp_path / "repo") as repo:
        c1 = repo.commit(tmp_path / "a")
        repo.store.path_of(repo.commit_info(c1).manifest_object).unlink()
        with pytest.warns(RuntimeWarning, match=rf"the parent commit {c1[:12]}'s manifest is damaged"):
            c2 = repo.commit(tmp_path / "b")
        assert repo.commit_info(c2).parents == [c1]
        loaded = _empty()
        dcp.load(loaded, storage_reader=CkptStorageReader(repo, c2))
        assert _same(loaded, second)


def test_a_metadata_file_with_objects_beyond_dcps_classes_is_refused_without_running_them(tmp_path, capsys):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    metadata = dcpdir.read_metadata(tmp_path / "saved")
    metadata.planner_data = {"w": Planted()}
    (tmp_path / "saved" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(PickledObjectsError, match="builtins.print is not one of DCP's metadata classes"):
        dcpdir.read(tmp_path / "saved")
    Repository.init(tmp_path / "repo").close()
    result = CliRunner().invoke(cli, ["--repo", str(tmp_path / "repo"), "commit", str(tmp_path / "saved")])
    assert result.exit_code != 0 and "--trust-pickle" in str(result.exception)
    assert "code ran" not in capsys.readouterr().out
    described, _ = dcpdir.read(tmp_path / "saved", trust_pickle=True)  # the user vouches for the file
    assert "code ran" in capsys.readouterr().out and described["planner_data"] == ["dict", [["w", None]]]


def test_a_truncated_metadata_a_missing_data_file_or_a_wrong_shard_is_refused(tmp_path):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    metadata = dcpdir.read_metadata(tmp_path / "saved")
    whole = (tmp_path / "saved" / ".metadata").read_bytes()
    (tmp_path / "saved" / ".metadata").write_bytes(whole[:60])
    with pytest.raises(CheckpointFormatError, match="is not DCP metadata"):  # damaged, not hostile
        dcpdir.read(tmp_path / "saved")
    (tmp_path / "saved" / ".metadata").write_bytes(whole)
    data = next(p for p in (tmp_path / "saved").iterdir() if p.suffix == ".distcp")
    blob = data.read_bytes()
    data.unlink()
    with pytest.raises(CheckpointFormatError, match="is missing"):
        dcpdir.read(tmp_path / "saved")
    data.write_bytes(blob)
    metadata.state_dict_metadata["ids"].chunks[0].sizes = torch.Size([8])  # the metadata now disagrees
    metadata.state_dict_metadata["ids"].size = torch.Size([8])
    (tmp_path / "saved" / ".metadata").write_bytes(pickle.dumps(metadata))
    _, items = dcpdir.read(tmp_path / "saved")
    with pytest.raises(CheckpointFormatError, match=r"ids at 0: holds a torch.int64 \[7\], the metadata says"):
        dict(items)


@pytest.mark.parametrize("size, chunks, problem", [
    ([4, 2], [([0, 0], [2, 2]), ([2, 0], [2, 2])], None),
    ([0, 3], [([0, 0], [0, 3])], None),
    ([], [([], [])], None),
    ([4, 2], [([0, 0], [2, 2]), ([2, 0], [4, 2])], "lies outside"),
    ([4, 2], [([0, 0], [2, 2]), ([-1, 0], [2, 2])], "lies outside"),
    ([4, 2], [([0, 0], [8])], "another rank"),
    ([6, 2], [([0, 0], [2, 2]), ([2, 0], [2, 2])], "cover 8 of its 12"),
    ([4, 2], [([0, 0], [3, 2]), ([2, 0], [2, 2]), ([0, 0], [0, 2])], "overlap"),
    ([2, 4096], [([0, k], [2, 1]) for k in range(4096)], None),  # column shards: a sweep along dimension 1
    ([2, 4096], [([0, k], [2, 1]) for k in range(4095)] + [([0, 17], [2, 1])], "overlap"),
    ([16.0], [([0], [16])], "is not a list of counts"),  # a crafted remote's: 16.0 == 16, but no array has 16.0 rows
    ([16], [([0.0], [16])], "are not lists of counts"),
    ([True, 2], [([0, 0], [1, 2])], "is not a list of counts"),
    ([64, 64], [([i, j], [1, 1]) for i in range(64) for j in range(64)], None),  # a 64 x 64 grid of shards
    ([128, 256], [([i, 2 * j], [1, 2]) for i in range(128) for j in range(128)], None),  # grids: at once (reader)
    ([8, 64, 96], [([i, 2 * j, 3 * k], [1, 2, 3]) for i in range(8) for j in range(32) for k in range(32)], None),
    ([4, 4], [([0, 0], [2, 2]), ([2, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 2], [2, 1])], "cover 14 of its 16"),
    # repeated offsets whose counts multiply to the number of chunks: cells [0, 2] and [2, 0] never written, where
    # the grid check did not count its cells (mutation audit)
    ([4, 4], [([0, 0], [2, 2]), ([0, 0], [2, 2]), ([2, 2], [2, 2]), ([2, 2], [2, 2])], "overlap"),
    ([4, 4], [([0, 0], [2, 2]), ([2, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 2], [2, 3])], "lies outside"),
    # a staircase, each chunk to the end of the sweep's axis: quadratic, a minute at 12,000 (fuzz auditor)
    ([2000, 2000], [([i, i], [2000 - i, 1]) for i in range(2000)], "too many to check"),
])
def test_chunks_must_tile_their_tensor_exactly(size, chunks, problem):
    from ckptstore.formats.dcpmeta import chunk_problem

    found = chunk_problem({"size": size, "chunks": [[o, s, "k"] for o, s in chunks]})
    assert found is None if problem is None else problem in found


def test_a_directory_whose_metadata_leaves_a_gap_is_refused_and_fsck_catches_a_stored_one(tmp_path):
    """Chunks that do not cover the tensor would export the gap as zeros; the commit is refused instead."""
    from dataclasses import replace

    from ckptstore.repo.sharded import dcp_problem

    dcp.save({"w": torch.arange(8.0).reshape(4, 2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    metadata = dcpdir.read_metadata(tmp_path / "saved")
    metadata.state_dict_metadata["w"].size = torch.Size([6, 2])
    (tmp_path / "saved" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointFormatError, match="cover 8 of its 12 elements"):
        dcpdir.read(tmp_path / "saved")
    with Repository.init(tmp_path / "repo") as repo:
        dcp.save({"w": torch.arange(8.0).reshape(4, 2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ok")))
        manifest = repo.manifest(repo.commit(tmp_path / "ok"))
        assert dcp_problem(manifest) is None
        items = [{**item, "size": [6, 2]} if item["fqn"] == "w" else item for item in manifest.dcp["items"]]
        assert "cover 8 of its 12" in dcp_problem(replace(manifest, dcp={**manifest.dcp, "items": items}))


def test_a_metadata_pickle_naming_a_huge_memo_index_costs_no_memory(tmp_path):
    import resource

    (tmp_path / ".metadata").write_bytes(b"\x80\x02Nr" + (1 << 28).to_bytes(4, "little") + b".")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointFormatError, match="holds a NoneType, not DCP's Metadata"):
        dcpdir.read_metadata(tmp_path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 << 10  # KiB: it took 4 GiB
    with pytest.raises(CheckpointFormatError, match="holds a NoneType"):
        dcpdir.read_metadata(tmp_path, trust_pickle=True)  # the user trusts the file: still no blow-up
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 << 10


@pytest.mark.parametrize("target", [b"cpathlib\nPosixPath\n",  # a class every later path check uses
                                    b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R"])
def test_a_metadata_pickle_that_builds_on_shared_objects_is_refused_and_changes_nothing(tmp_path, target):
    import pathlib

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    # BUILD (None, {"exists": BytesStorageMetadata}) on the target, then None as the whole metadata
    (tmp_path / ".metadata").write_bytes(b"\x80\x02" + target + b"N}X\x06\x00\x00\x00exists"
                                         b"ctorch.distributed.checkpoint.metadata\nBytesStorageMetadata\ns\x86b0N.")
    with pytest.raises(PickledObjectsError, match="BUILD on a"):
        dcpdir.read_metadata(tmp_path)
    assert not pathlib.Path(tmp_path / "absent").exists()
    assert "exists" not in vars(pathlib.PosixPath) and "exists" not in vars(_MEM_FORMAT_ENCODING(0))


def _stored(metadata):
    return next(info for index, info in metadata.storage_data.items() if index.fqn == "w")


MANGLED = {
    "an empty tensor shard": lambda m: setattr(_stored(m), "length", 0),
    "an offset in text": lambda m: setattr(_stored(m), "offset", "0"),
    "a file name that is a list": lambda m: setattr(_stored(m), "relative_path", ["__0_0.distcp"]),
    "storage_data that is a number": lambda m: setattr(m, "storage_data", 5),
    "chunks that are None": lambda m: setattr(m.state_dict_metadata["w"], "chunks", None),
    "chunk offsets in text": lambda m: setattr(m.state_dict_metadata["w"].chunks[0], "offsets", ["0", "0"]),
    # dcp.load ignores these; a commit of them was one that checkout then refused as a damaged manifest
    "a layout that is None": lambda m: setattr(m.state_dict_metadata["w"].properties, "layout", None),
    "a dtype in text": lambda m: setattr(m.state_dict_metadata["w"].properties, "dtype", "torch.float32"),
}


@pytest.mark.parametrize("mangle", MANGLED.values(), ids=MANGLED.keys())
def test_metadata_of_dcps_own_classes_with_a_mangled_field_is_a_format_error(tmp_path, mangle):
    dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    metadata = dcpdir.read_metadata(tmp_path)
    mangle(metadata)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata, protocol=2))
    with pytest.raises(CheckpointFormatError):
        list(dcpdir.read(tmp_path)[1])


def test_a_non_tensor_item_that_is_no_pickle_is_refused_at_commit_and_named_damaged_at_checkout(tmp_path):
    """Stored as it was, it reached checkout as 'objects beyond plain data: trust it' (wrong advice for garbage)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    dcp.save({"w": torch.arange(12.0), "step": 7}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    info = dcpdir.read_metadata(tmp_path / "saved").storage_data[MetadataIndex("step")]
    with open(tmp_path / "saved" / info.relative_path, "r+b") as data:
        data.seek(info.offset)
        data.write(b"\xfe" * info.length)  # no pickle opcode
    with Repository.init(tmp_path / "repo") as repo, pytest.raises(CheckpointFormatError, match="step is not the"):
        repo.commit(tmp_path / "saved")
    with pytest.raises(CorruptRecordError, match="bytes item step.*not a torch.save archive"):
        dcpdir.item_pickle("step", b"\xfe" * 8)


def test_files_the_metadata_does_not_name_are_warned_of_and_a_shard_linked_from_outside_is_refused(tmp_path):
    import warnings

    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved"), thread_count=4))
    assert any(p.stat().st_size == 0 for p in (tmp_path / "saved").glob("*.distcp"))  # DCP's own empty shards
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcpdir.read(tmp_path / "saved")  # a plain DCP directory: nothing to say
    (tmp_path / "saved" / "config.yaml").write_text("lr: 1e-3\n")
    (tmp_path / "saved" / "tokenizer").mkdir()
    with pytest.warns(RuntimeWarning, match=r"config.yaml, tokenizer/ not stored"):
        dcpdir.read(tmp_path / "saved")
    shard = next(p for p in (tmp_path / "saved").glob("*.distcp") if p.stat().st_size)
    shard.rename(tmp_path / "elsewhere.distcp")
    shard.symlink_to(tmp_path / "elsewhere.distcp")
    with pytest.raises(CheckpointFormatError, match="outside the DCP directory"):
        dcpdir.read(tmp_path / "saved")



def test_a_shard_reached_through_a_symlinked_folder_outside_is_refused(tmp_path):
    """Only the last part of the shard's path was checked: `.metadata` naming `sub/x.distcp`, with `sub` a link to a
    folder elsewhere, committed a file from outside the directory (auditor helper 278, high)."""
    dcp.save({"w": torch.arange(8.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    (tmp_path / "elsewhere").mkdir()
    shard = next(p for p in (tmp_path / "saved").glob("*.distcp") if p.stat().st_size)
    shard.rename(tmp_path / "elsewhere" / shard.name)
    (tmp_path / "saved" / "sub").symlink_to(tmp_path / "elsewhere")
    with open(tmp_path / "saved" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = f"sub/{shard.name}"
    with open(tmp_path / "saved" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointFormatError, match=r"sub/\S+ is, through a symlinked folder, .*elsewhere.*, outside "
                                                    "the DCP directory"):
        dcpdir.read(tmp_path / "saved")
    (tmp_path / "saved" / "sub").unlink()
    (tmp_path / "saved" / "sub").mkdir()  # the same shard moved in: read
    (tmp_path / "elsewhere" / shard.name).rename(tmp_path / "saved" / "sub" / shard.name)
    assert dcpdir.read(tmp_path / "saved")

def test_a_dcp_directory_saved_into_again_while_it_is_committed_is_refused(tmp_path, monkeypatch):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "latest")))
    reading = dcpdir.read

    def the_job_saves_again_meanwhile(*args, **kwargs):
        found = reading(*args, **kwargs)
        dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "latest")))
        return found

    monkeypatch.setattr(dcpdir, "read", the_job_saves_again_meanwhile)
    with Repository.init(tmp_path / "repo") as repo:
        with pytest.raises(CheckpointFormatError, match="changed while it was being committed"):
            repo.commit(tmp_path / "latest")
        assert repo.log() == []


def test_only_the_files_a_dcp_directory_names_must_hold_still_while_it_is_committed(tmp_path, monkeypatch):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "run")))
    (tmp_path / "run" / "train.log").write_text("step 1\n")
    reading = dcpdir.read

    def the_job_logs_meanwhile(*args, **kwargs):
        found = reading(*args, **kwargs)
        with open(tmp_path / "run" / "train.log", "a") as log:
            log.write("step 2\n")
        return found

    monkeypatch.setattr(dcpdir, "read", the_job_logs_meanwhile)
    with Repository.init(tmp_path / "repo") as repo, pytest.warns(RuntimeWarning, match="train.log not stored"):
        assert repo.commit(tmp_path / "run")  # the log is no part of it


def test_diff_compares_non_tensor_items_by_value_not_by_how_they_are_stored(tmp_path):
    """A DCP directory keeps DCP's pickles, CkptStorageWriter stores plain JSON: the same values showed as changed."""
    from ckptstore.dcp import CkptStorageWriter
    from ckptstore.repo.diff import diff

    state = {"a": torch.arange(20.0).reshape(4, 5), "step": 7, "cfg": {"lr": 0.1, "name": "x"}}
    repo = Repository.init(tmp_path / "repo")
    dcp.save(state, storage_writer=CkptStorageWriter(repo), no_dist=True)
    dcp.save(state, checkpoint_id=tmp_path / "fs", no_dist=True)
    repo.commit(tmp_path / "fs")
    shown = {d.path: d.status for d in diff(repo, "HEAD~1", "HEAD")}
    assert shown == {"a": "unchanged"}, shown  # values are listed where they differ, as a file commit's are
    dcp.save({**state, "step": 8}, checkpoint_id=tmp_path / "fs", no_dist=True)
    repo.commit(tmp_path / "fs")
    changed = {d.path: d.status for d in diff(repo, "HEAD~2", "HEAD")}
    assert [p for p, status in changed.items() if status != "unchanged"] == ["step"], changed  # by fully qualified name
    repo.close()


def test_numpy_rng_state_in_a_dcp_directory_checks_out_and_a_refusal_carries_no_terminal_codes(tmp_path):
    """np.random.get_state() was refused at checkout (no CLI way round), in a message cut mid-way with ANSI codes."""
    import numpy as np

    rng = np.random.RandomState(3).get_state()
    dcp.save({"w": torch.ones(4), "rng": {"numpy": rng}}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")))
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "s")
        repo.checkout_to("HEAD", tmp_path / "out")
    back = {"w": torch.zeros(4), "rng": {"numpy": None}}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "out")))
    restored = back["rng"]["numpy"]
    assert restored[0] == rng[0] and np.array_equal(restored[1], rng[1]) and restored[2:] == rng[2:]
    with pytest.raises(PickledObjectsError) as refused:
        out = io.BytesIO()
        torch.save({"planted": Planted()}, out)
        dcpdir.item_value("x", out.getvalue())
    assert "\x1b" not in str(refused.value) and "(print is not among the classes" in str(refused.value)


def test_a_non_tensor_item_a_checkout_could_not_write_back_is_refused_at_commit_unless_trusted(tmp_path):
    """A non-tensor item of a class weights_only refuses (a best metric as a Fraction) committed silently from a DCP
    directory, then no checkout could write it back: a torch.save file holding one is refused at commit, and so is
    this now (interop auditor). A numeric numpy scalar is read by both since auditor helper 384: a Fraction here."""
    from fractions import Fraction

    dcp.save({"w": torch.ones(4), "best_metric": Fraction(1, 4)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")))
    with Repository.init(tmp_path / "repo") as repo:
        with pytest.raises(PickledObjectsError, match=r"best_metric: .*fractions.Fraction.*nothing was "
                                                      r"committed. Commit with --trust-pickle"):
            repo.commit(tmp_path / "s")
        assert repo.log() == []
        repo.commit(tmp_path / "s", trust_pickle=True)
        loaded = {"w": torch.zeros(4), "best_metric": None}
        dcp.load(loaded, storage_reader=CkptStorageReader(tmp_path / "repo", trust_pickle=True))
        with pytest.raises(PickledObjectsError, match="or write it with `ckpt checkout --trust-pickle`"):
            repo.checkout_to("HEAD", tmp_path / "refused")
        repo.checkout_to("HEAD", tmp_path / "out", trust_pickle=True)  # no CLI way before (mixed-versions auditor)
    assert loaded["best_metric"] == 0.25 and torch.equal(loaded["w"], torch.ones(4))
    again = {"w": torch.zeros(4), "best_metric": None}
    dcp.load(again, storage_reader=dcp.FileSystemReader(str(tmp_path / "out")))
    assert again["best_metric"] == 0.25 and torch.equal(again["w"], torch.ones(4))


def test_a_directory_checked_out_through_a_dangling_symlink_is_refused_in_one_line(tmp_path):
    """`checkout -o LINK` of a sharded commit, LINK leading nowhere: "unexpected FileExistsError" (auditor 301)."""
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "saved")
    (tmp_path / "dang").symlink_to(tmp_path / "nowhere")
    said = ckpt_here(tmp_path / "repo", "checkout", "HEAD", "-o", str(tmp_path / "dang"))
    assert said.returncode == 1 and said.stderr == f"error: {tmp_path / 'dang'} is a symlink to " \
        f"{tmp_path / 'nowhere'}, which does not exist; create it first or pass another -o path\n", said.stderr
    assert not (tmp_path / "nowhere").exists()


def test_a_folder_holding_only_a_killed_checkouts_temporary_file_is_written_and_an_old_one_removed(tmp_path):
    """`checkout -o DIR` killed while it wrote left `.__0_0.distcp.<hex>.ckpt-tmp`, and every later checkout into DIR
    was refused ("not an empty folder") until it was removed by hand (auditor helper 301)."""
    state = {"w": torch.randn(40, 8), "ids": torch.arange(7)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "saved")
    out = tmp_path / "out"
    out.mkdir()
    leftover = out / f".{dcpdir.DATA_FILE}.0123456789abcdef.ckpt-tmp"
    leftover.write_bytes(bytes(1000))
    os.utime(leftover, (0, 0))
    said = ckpt_here(tmp_path / "repo", "checkout", "HEAD", "-o", str(out))
    assert said.returncode == 0, said.stderr
    assert not leftover.exists() and sorted(p.name for p in out.iterdir()) == [dcpdir.METADATA, dcpdir.DATA_FILE]
    loaded = {"w": torch.zeros(40, 8), "ids": torch.zeros(7, dtype=torch.int64)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(out)))
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def _raising(exc: BaseException):
    def read(*args, **kwargs):
        raise exc
    return read


@pytest.mark.parametrize("where", ["metadata", "tensor", "non-tensor item"])
@pytest.mark.parametrize("limit", [MemoryError(), OSError(errno.EMFILE, "Too many open files")],
                         ids=["memory", "open files"])
def test_a_limit_met_while_reading_a_directory_is_the_limit_not_damage(tmp_path, monkeypatch, where, limit):
    """Out of memory or of file descriptors while reading, the directory was called damaged ("not DCP metadata this
    torch reads", "not a tensor torch reads"), or its plain values pickled objects to trust: the limit goes through,
    and the CLI names it (errors.explain)."""
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "saved")))
    if where == "metadata":
        monkeypatch.setattr(dcpdir._MetadataUnpickler, "load", _raising(limit))
    elif where == "tensor":
        monkeypatch.setattr(dcpdir.torch, "load", _raising(limit))
    else:
        monkeypatch.setattr(dcpdir, "item_value", _raising(limit))
    with Repository.init(tmp_path / "repo") as repo, pytest.raises(type(limit)) as raised:
        repo.commit(tmp_path / "saved", "from disk")
    assert raised.value is limit

"""The folder walk: in-folder links followed, everything else that cannot be stored refused by name; modes kept."""

import os
import stat
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import formats
from ckptstore.errors import CheckpointFormatError
from ckptstore.formats import CheckpointFile
from ckptstore.formats.folder import folder_files
from ckptstore.repo.manifest import Manifest
from tests.conftest import ROOT, ckpt_env


def _folder(tmp_path):
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    torch.save({"w": torch.arange(4.0)}, run / "model.pt")
    (run / "sub" / "config.json").write_text('{"a": 1}')
    return run


def test_links_inside_the_folder_are_stored_as_their_targets_content(tmp_path):
    run = _folder(tmp_path)
    os.symlink("model.pt", run / "latest.pt")
    os.symlink("sub", run / "alias")
    checkpoint = formats.read_checkpoint(run)
    names = [f.name for f in checkpoint.files]
    assert names == ["alias/config.json", "latest.pt", "model.pt", "sub/config.json"]
    assert checkpoint.tensors["latest.pt/w"].data.tobytes() == checkpoint.tensors["model.pt/w"].data.tobytes()


@pytest.mark.parametrize("make, message", [
    (lambda run, out: os.symlink(out / "secret", run / "shadow"), "outside the checkpoint folder"),
    (lambda run, out: os.symlink(out, run / "outdir"), "outside the checkpoint folder"),
    (lambda run, out: os.symlink("gone.pt", run / "dangling"), "does not exist"),
    (lambda run, out: os.symlink("..", run / "sub" / "loop"), "never end"),
    (lambda run, out: os.mkfifo(run / "pipe"), "is a FIFO"),
])
def test_what_cannot_be_stored_is_refused_naming_the_path(tmp_path, make, message):
    run = _folder(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("root:x:0")
    make(run, outside)
    with pytest.raises(CheckpointFormatError, match=message) as info:
        formats.read_checkpoint(run)
    assert str(run) in str(info.value)


def test_excluded_folders_and_leftover_temporaries_are_not_part_of_the_checkpoint(tmp_path):
    run = _folder(tmp_path)
    (run / ".ckpt").mkdir()
    (run / ".ckpt" / "ckpt.db").write_bytes(b"SQLite format 3\0")
    (run / ".model.pt.new-0123456789abcdef.ckpt-tmp").write_bytes(b"half a write")
    names = [f.name for f in formats.read_checkpoint(run, exclude=[run / ".ckpt"]).files]
    assert names == ["model.pt", "sub/config.json"]
    os.symlink(".ckpt/ckpt.db", run / "db")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint folder"):
        formats.read_checkpoint(run, exclude=[run / ".ckpt"])


def test_permission_bits_are_recorded_per_file(tmp_path):
    run = _folder(tmp_path)
    os.chmod(run / "model.pt", 0o600)
    os.chmod(run / "sub" / "config.json", 0o754)
    modes = {f.name: f.mode for f in formats.read_checkpoint(run).files}
    assert modes == {"model.pt": 0o600, "sub/config.json": 0o754}
    assert formats.read_checkpoint(run / "model.pt").files[0].mode == 0o600


@settings(max_examples=30, deadline=None)
@given(mode=st.one_of(st.none(), st.integers(0, 0o777)), reason=st.sampled_from(["", "pickled objects"]))
def test_file_records_round_trip_and_older_records_read(mode, reason):
    record = CheckpointFile("a/b.pt", "torch", ["dict", []], 12, reason, mode)
    assert CheckpointFile.from_json(record.to_json()) == record
    assert ("mode" in record.to_json()) == (mode is not None)  # no new field where there is nothing to say
    older = {"name": "a/b.pt", "format": "torch", "skeleton": ["dict", []], "size": 12}  # before modes
    assert CheckpointFile.from_json(older).mode is None
    manifest = Manifest("folder", [record], {}, {})
    assert Manifest.from_bytes(manifest.to_bytes()).files == [record]


def test_a_lone_file_keeps_what_stat_says(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    os.chmod(tmp_path / "a.pt", 0o640)
    record = formats.read_checkpoint(tmp_path / "a.pt").files[0]
    assert record.mode == stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == 0o640


def test_links_that_fan_out_are_refused_and_links_that_fan_in_are_followed(tmp_path):
    import time

    for level in range(31):  # d0/{a,b} -> d1, d1/{a,b} -> d2 ...: 2**30 paths to d30
        (tmp_path / f"d{level}").mkdir()
    (tmp_path / "d30" / "w.bin").write_bytes(b"x")
    for level in range(30):
        for name in "ab":
            (tmp_path / f"d{level}" / name).symlink_to(tmp_path / f"d{level + 1}")
    started = time.monotonic()
    with pytest.raises(CheckpointFormatError, match="more than 1000 times over"):
        folder_files(tmp_path)
    assert time.monotonic() - started < 60  # it never ended
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "vocab.txt").write_text("a b")
    for step in range(10):  # checkpoints that each link one tokenizer: stored, as its content each time
        (run / f"ckpt-{step}").mkdir()
        (run / f"ckpt-{step}" / "tokenizer").symlink_to(run / "tokenizer")
    assert len(folder_files(run)) == 11


def test_a_zip_of_another_program_with_a_torch_suffix_is_a_plain_file_of_the_folder(tmp_path):
    import zipfile

    folder = tmp_path / "ck"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    with zipfile.ZipFile(folder / "assets.bin", "w") as assets:
        assets.writestr("readme.txt", "hi")
    checkpoint = formats.read_checkpoint(folder)
    kinds = {record.name: record.format for record in checkpoint.files}
    assert kinds == {"assets.bin": formats.BLOB, "pytorch_model.bin": formats.TORCH}
    with pytest.raises(CheckpointFormatError, match="is not a checkpoint"):
        formats.read_checkpoint(folder / "assets.bin")  # alone, it is no torch.save file either


@pytest.mark.parametrize("protocol", [2, 3, 4])
def test_a_plain_pickle_with_a_torch_suffix_is_a_plain_file_of_the_folder(tmp_path, protocol):
    """A tokenizer's or a trainer's own pickle (vocab_stats.bin) is no legacy torch.save file: kept as bytes."""
    import pickle

    folder = tmp_path / "ck"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    with open(folder / "vocab_stats.bin", "wb") as handle:
        pickle.dump({"counts": [3, 1, 2]}, handle, protocol=protocol)
    checkpoint = formats.read_checkpoint(folder)
    kinds = {record.name: record.format for record in checkpoint.files}
    assert kinds == {"legacy.pt": formats.TORCH, "vocab_stats.bin": formats.BLOB}
    with pytest.raises(CheckpointFormatError, match="is not a checkpoint"):
        formats.read_checkpoint(folder / "vocab_stats.bin")  # alone, it is no torch.save file either


def test_a_fifo_or_a_device_given_to_commit_is_refused_in_one_line(tmp_path):
    from ckptstore import Repository

    os.mkfifo(tmp_path / "ckpt.pt")
    with Repository.init(tmp_path / "repo") as repo:
        for source in (tmp_path / "ckpt.pt", "/dev/null"):
            with pytest.raises(CheckpointFormatError, match="is neither a file nor a folder"):
                repo.commit(source)


FEW_DESCRIPTORS = """
import resource, sys, torch
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ckptstore import Repository
with Repository.init(sys.argv[1] + "/repo") as repo:
    cid = repo.commit(sys.argv[1] + "/run")
    if sys.argv[2] == "dcp":
        repo.checkout_to(cid, sys.argv[1] + "/back")
        import torch.distributed.checkpoint as dcp
        back = {f"t{i:03d}": torch.zeros(8) for i in range(150)}
        dcp.load(back, checkpoint_id=sys.argv[1] + "/back")
        print(all(torch.equal(back[f"t{i:03d}"], torch.full((8,), float(i))) for i in range(150)))
    else:
        back = repo.checkout(cid)
        print(sorted(back) == sorted(f"f{i:03d}.bin" for i in range(150)) and all(
            bytes(back[f"f{i:03d}.bin"]) == bytes([i]) * 5000 for i in range(150)))
"""


@pytest.mark.parametrize("kind", ["folder", "dcp"])
def test_a_folder_of_more_files_than_the_open_file_limit_commits(tmp_path, kind):
    """Each file's map holds a descriptor until the commit is recorded: 150 files under a soft limit of 64."""
    run = tmp_path / "run"
    if kind == "dcp":  # a DCP directory with a data file per tensor
        import torch.distributed.checkpoint as dcp

        dcp.save({f"t{i:03d}": torch.full((8,), float(i)) for i in range(150)},
                 storage_writer=dcp.FileSystemWriter(run, single_file_per_rank=False))
        assert len(list(run.glob("*.distcp"))) == 150
    else:
        run.mkdir()
        for i in range(150):
            (run / f"f{i:03d}.bin").write_bytes(bytes([i]) * 5000)
    done = subprocess.run([sys.executable, "-c", FEW_DESCRIPTORS, str(tmp_path), kind], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=ckpt_env())
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_a_file_system_without_modes_records_none_and_a_refused_chmod_is_a_warning(repo, tmp_path, monkeypatch):
    """exFAT shows 0777 for every file: restored elsewhere, each checkpoint file was world-writable and executable;
    on a file system that refuses chmod (fusefat: ENOSYS), every checkout ended in "unexpected OSError" (auditor)."""
    import errno

    from ckptstore.formats import folder as folder_module

    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "model.pt")
    os.chmod(run / "model.pt", 0o777)
    monkeypatch.setattr(folder_module, "keeps_modes", lambda path, device=None: False)  # as on exFAT
    cid = repo.commit(run)
    assert [f.mode for f in repo.manifest(cid).files] == [None]
    monkeypatch.undo()
    repo.checkout_to(cid, tmp_path / "out")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out" / "model.pt").stat().st_mode) == 0o666 & ~umask
    os.chmod(run / "model.pt", 0o640)
    with_mode = repo.commit(run)
    chmod = os.chmod
    monkeypatch.setattr(os, "chmod", lambda path, mode, **k: (_ for _ in ()).throw(OSError(errno.ENOSYS, "no"))
                        if ".new-" in os.fspath(path) else chmod(path, mode, **k))
    with pytest.warns(RuntimeWarning, match="this file system keeps no file modes"):
        repo.checkout_to(with_mode, tmp_path / "again")
    assert torch.load(tmp_path / "again" / "model.pt", weights_only=True)["w"].equal(torch.ones(3))


def test_a_folders_sub_folders_holding_no_file_are_listed_innermost_only(tmp_path):
    """Empty sub-folders were dropped from folder commits (a trainer's `runs/`; fixer helper 329)."""
    from ckptstore.formats.folder import folder_listing

    for folder in ("runs", "optimizer/shards", "logs/.git", "full"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "full" / "w.bin").write_bytes(b"x")
    (tmp_path / "linked").symlink_to(tmp_path / "runs")
    with pytest.warns(RuntimeWarning, match="git's own files"):
        listing = folder_listing(tmp_path)
    assert [f.name for f in listing.files] == ["full/w.bin"]
    assert listing.empty_folders == ["linked", "logs", "optimizer/shards", "runs"]


def test_a_folder_holding_only_what_a_commit_excludes_is_no_empty_folder_of_it(tmp_path):
    """A sub-folder holding only a repository (its .ckpt excluded, as commit and status exclude them) was listed
    as an empty folder: a commit recorded it and status called it untracked (the last read of this stop)."""
    from ckptstore.formats.folder import folder_listing

    (tmp_path / "nested" / ".ckpt").mkdir(parents=True)
    (tmp_path / "deeper" / "repo" / ".ckpt").mkdir(parents=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "w.bin").write_bytes(b"x")
    listing = folder_listing(tmp_path, [tmp_path / "nested" / ".ckpt", tmp_path / "deeper" / "repo" / ".ckpt"])
    assert listing.empty_folders == ["runs"]

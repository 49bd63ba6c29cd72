"""A checkpoint cut short while a commit reads it (the trainer's next torch.save): refused, not a SIGBUS.

The commit reads through memory maps; before formats/filemap.py's guard, touching a page past the
file's new end killed the commit process (the daemon, under `ckpt daemon`) with SIGBUS. The
commit runs as `ckpt commit` in a process of its own, held at the fault point `commit:read`
(parsed and hashed, tensors not yet read) while the test truncates the file.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptstore import Repository
from ckptstore.errors import CheckpointFormatError
from ckptstore.repo import commit as commit_module
from ckptstore.repo import fsck
from tests.conftest import ckpt_env

ROOT = Path(__file__).resolve().parents[2]



def _ckpt(cwd: Path, *args: str, **env: str) -> subprocess.Popen:
    environ = ckpt_env(**env)
    return subprocess.Popen([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=environ, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def commit_while_cut_short(root: Path, source: str, victim: Path, *flags: str) -> subprocess.CompletedProcess:
    """`ckpt commit source`, with `victim` truncated (as torch.save(..., victim) does first) mid-commit."""
    gate = root.parent / "gate"
    process = _ckpt(root, "commit", source, *flags, CKPT_WAIT_AT=f"commit:read={gate}")
    _wait_for(Path(f"{gate}.reached"), process)
    open(victim, "wb").close()
    gate.touch()
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _torch_file(root: Path) -> tuple[str, Path]:
    torch.save({"model": {"w": torch.randn(512, 512)}, "step": 3}, root / "ckpt.pt")
    return "ckpt.pt", root / "ckpt.pt"


def _safetensors_file(root: Path) -> tuple[str, Path]:
    save_file({"w": torch.randn(512, 512), "b": torch.randn(512)}, root / "model.safetensors")
    return "model.safetensors", root / "model.safetensors"


def _folders_blob(root: Path) -> tuple[str, Path]:
    folder = root / "run"
    folder.mkdir()
    save_file({"w": torch.randn(64, 64)}, folder / "model.safetensors")
    (folder / "rng_state.bin").write_bytes(os.urandom(1 << 20))  # neither torch nor safetensors: a blob
    return "run", folder / "rng_state.bin"


@pytest.mark.parametrize("make, flags", [(_torch_file, ()), (_safetensors_file, ()), (_folders_blob, ()),
                                         (_torch_file, ("--trust-pickle",))])  # torch's own map, adopted
def test_a_checkpoint_cut_short_while_committed_is_refused_and_committed_whole_afterwards(tmp_path, make, flags):
    root = tmp_path / "repo"
    Repository.init(root).close()
    source, victim = make(root)
    whole = victim.read_bytes()
    result = commit_while_cut_short(root, source, victim, *flags)
    assert result.returncode == 1, (result.returncode, result.stderr)  # -7 was SIGBUS
    assert result.stderr.startswith(f"error: {victim} changed while it was being committed (is a save still "
                                    "writing it?); nothing was recorded"), result.stderr
    with Repository.open(root) as repo:
        assert list(repo.log()) == []
        assert fsck(repo).ok
    victim.write_bytes(whole)  # the save finished
    with Repository.open(root) as repo:
        repo.commit(root / source, trust_pickle=bool(flags))
        (commit,) = repo.log()
        out = repo.checkout_to(commit.id, tmp_path / "out")
        assert (out if victim.parent == root else out / victim.name).read_bytes() == whole
        assert fsck(repo).ok


def test_a_checkpoint_saved_over_in_place_at_the_same_size_while_committed_is_refused(tmp_path):
    """Half of a same-size save written over the file in place while it was committed: recorded, half old, half new
    (mutation audit)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    source, victim = _torch_file(root)
    torch.save({"model": {"w": torch.randn(512, 512)}, "step": 3}, tmp_path / "next.pt")  # the next save
    new = (tmp_path / "next.pt").read_bytes()
    assert len(new) == victim.stat().st_size and new != victim.read_bytes()
    gate = tmp_path / "gate"
    process = _ckpt(root, "commit", source, CKPT_WAIT_AT=f"commit:read={gate}")
    _wait_for(Path(f"{gate}.reached"), process)
    time.sleep(0.01)  # past the file system's clock tick: a later modification time
    with open(victim, "r+b") as handle:  # torch.save over it, half done: same inode, same size
        handle.write(new[: len(new) // 2])
    gate.touch()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1, (process.returncode, stderr)
    assert stderr.startswith(f"error: {victim} changed while it was being committed (is a save still "
                             "writing it?); nothing was recorded"), stderr
    with Repository.open(root) as repo:
        assert list(repo.log()) == [] and fsck(repo).ok


def test_a_plain_file_in_a_folder_rewritten_in_place_after_it_was_hashed_is_refused(tmp_path, monkeypatch):
    """A folder's plain file rewritten in place (same size) after its tensor id was taken: recorded with the new
    bytes under the old id, and its checkout then refused (mutation audit)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    source, victim = _folders_blob(root)
    whole = victim.read_bytes()
    encode = commit_module._encode_or_keep_whole

    def rewritten_first(*args, **kwargs):  # the run writes over it as the commit encodes
        time.sleep(0.01)  # past the file system's clock tick
        with open(victim, "r+b") as handle:
            handle.write(os.urandom(4096))
        return encode(*args, **kwargs)

    monkeypatch.setattr(commit_module, "_encode_or_keep_whole", rewritten_first)
    with Repository.open(root) as repo:
        with pytest.raises(CheckpointFormatError, match="changed while it was being committed"):
            repo.commit(root / source)
        assert list(repo.log()) == []
        monkeypatch.undo()
        victim.write_bytes(whole)
        out = repo.checkout_to(repo.commit(root / source), tmp_path / "out")
        assert (out / victim.name).read_bytes() == whole
        assert fsck(repo).ok


def test_a_plain_file_in_a_folder_only_touched_while_committed_is_kept(tmp_path, monkeypatch):
    """A folder's plain file whose times changed at the same size (touched, or written again with the same bytes) is
    no torn save: its bytes are checked against its id and kept. Such a commit was refused as "changed while it was
    being committed" (mutation audit round 11)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    source, victim = _folders_blob(root)
    whole = victim.read_bytes()
    encode = commit_module._encode_or_keep_whole

    def touched_first(*args, **kwargs):  # the run touches it as the commit encodes
        stamp = victim.stat()
        os.utime(victim, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 5_000_000_000))
        return encode(*args, **kwargs)

    monkeypatch.setattr(commit_module, "_encode_or_keep_whole", touched_first)
    with Repository.open(root) as repo:
        out = repo.checkout_to(repo.commit(root / source), tmp_path / "out")
        assert (out / victim.name).read_bytes() == whole


def test_a_plain_file_in_a_folder_replaced_by_a_shorter_one_while_committed_keeps_the_bytes_read(tmp_path,
                                                                                                 monkeypatch):
    """A folder's plain file replaced (renamed over, as a log rotation does) after it was read is no torn save: the
    commit keeps the bytes it read, which no writer touches. A new file shorter than the old one was refused as
    "changed while it was being committed" (mutation audit round 11)."""
    from ckptstore import formats

    root = tmp_path / "repo"
    Repository.init(root).close()
    source, victim = _folders_blob(root)
    whole = victim.read_bytes()
    reading = formats.read_checkpoint

    def replaced_after_reading(*args, **kwargs):
        checkpoint = reading(*args, **kwargs)
        (tmp_path / "new.bin").write_bytes(b"y" * 10)
        os.replace(tmp_path / "new.bin", victim)
        return checkpoint

    monkeypatch.setattr(formats, "read_checkpoint", replaced_after_reading)
    with Repository.open(root) as repo:
        cid = repo.commit(root / source)
        monkeypatch.undo()
        assert (repo.checkout_to(cid, tmp_path / "out") / victim.name).read_bytes() == whole
        assert fsck(repo).ok

"""blake3 helpers (hashing.py): ids and file digests are hashed on the calling thread, never by blake3's own pool."""

import json
import subprocess
import sys

import blake3
import torch

from ckptstore.hashing import bytes_digest
from tests.conftest import ckpt_env


def test_a_file_digest_is_blake3_of_the_whole_bytes():
    """What earlier versions stored: a commit compares a file's digest with the recorded one."""
    data = bytes(range(256)) * 40_000  # 10 MiB: past every size at which blake3 splits its input
    assert bytes_digest(data) == blake3.blake3(data).hexdigest()
    assert bytes_digest(memoryview(data)) == bytes_digest(data)


def test_a_commit_where_no_native_thread_can_start_hashes_its_files_and_ends(tmp_path):
    """A Trainer folder's files were hashed by blake3's rayon pool, which panicked where its threads could not
    start: under a memory limit (RLIMIT_AS ~170 MiB) `ckpt commit` hung for ever on the panic's backtrace lock,
    or ended with a Rust traceback (auditor 383). RUST_MIN_STACK of 1 TiB makes every Rust thread start fail."""
    folder = tmp_path / "checkpoint-10"
    folder.mkdir()
    torch.save({"w": torch.randn(200_000)}, folder / "optimizer.pt")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run([sys.executable, "-m", "ckptstore", "init"], cwd=repo, env=ckpt_env(), check=True,
                   capture_output=True, timeout=120)
    try:
        result = subprocess.run([sys.executable, "-m", "ckptstore", "commit", str(folder)], cwd=repo,
                                env=ckpt_env(RUST_MIN_STACK=str(1 << 40)), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("`ckpt commit` still ran after 120 s") from None
    assert result.returncode == 0, result.stderr
    assert "panicked" not in result.stderr and "Traceback" not in result.stderr, result.stderr

"""Atomic writes under real concurrent processes: the path always holds one writer's complete bytes."""

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptstore.formats.atomic import atomic_write, write_parts
from tests.conftest import ckpt_env

ROOT = Path(__file__).resolve().parents[2]
SIZE = 1 << 18

WRITER = """
import os, sys, time
from pathlib import Path
from ckptstore.formats.atomic import write_parts
path, me, rounds, go, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
while not go.exists():
    time.sleep(0.001)
for i in range(rounds):
    # each write is one byte value repeated: any mix of two writes shows as two values
    write_parts(path, [bytes([me]) * (size // 2), bytes([me]) * (size // 2)])
"""

READER = """
import sys, time
from pathlib import Path
path, go, stop, size = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
while not go.exists():
    time.sleep(0.001)
seen = bad = 0
while not stop.exists():
    data = path.read_bytes()
    seen += 1
    if len(data) != size or len(set(data)) != 1:
        bad += 1
print(seen, bad)
"""


def _python(code, *args):
    env = ckpt_env()
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_concurrent_writers_never_tear_the_file(tmp_path):
    path, go, stop = tmp_path / "x.bin", tmp_path / "go", tmp_path / "stop"
    write_parts(path, [bytes([9]) * SIZE])
    writers = [_python(WRITER, path, me, 150, go, SIZE) for me in (1, 2, 3)]
    reader = _python(READER, path, go, stop, SIZE)
    time.sleep(1.5)  # let every process import before they all start at once
    go.touch()
    results = [w.communicate(timeout=120) for w in writers]
    stop.touch()
    seen, bad = map(int, reader.communicate(timeout=60)[0].split())
    for writer, (_, err) in zip(writers, results):
        assert writer.returncode == 0, err[-2000:]
    assert seen > 0 and bad == 0, f"{bad} of {seen} reads saw a torn file"
    data = path.read_bytes()
    assert len(data) == SIZE and len(set(data)) == 1 and data[0] in (1, 2, 3)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".ckpt-tmp")] == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"old")

    def fail(handle):
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_new_files_get_the_umask_mode_or_the_one_asked(tmp_path):
    old = os.umask(0o027)
    try:
        write_parts(tmp_path / "a", [b"x"])
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o640
    atomic_write(tmp_path / "b", lambda h: h.write(b"y"), mode=0o751)
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o751


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsynced file by /proc/self/fd")
def test_atomic_write_fsyncs_the_file_before_its_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Without the temporary file's fsync before the rename, a power cut could leave a ref or config empty
    (mutation audit)."""
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda source, target: events.append(
        ("replace", os.path.realpath(source), os.path.realpath(target))) or replace(source, target))
    atomic_write(tmp_path / "f.bin", lambda handle: handle.write(b"x" * 10))
    target = os.path.realpath(tmp_path / "f.bin")
    (_, temp, _), = (event for event in events if event[0] == "replace")
    assert events == [("fsync", temp), ("replace", temp, target), ("fsync", os.path.dirname(target))]
    assert (tmp_path / "f.bin").read_bytes() == b"x" * 10

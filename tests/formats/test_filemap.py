"""Guarded file maps (formats/filemap.py): a file cut short under a guarded map reads zeros and is refused.

Each case runs in a process of its own: an unguarded read past a file's new end is a SIGBUS,
which would kill pytest.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

from ckptstore.formats import filemap

ROOT = Path(__file__).resolve().parents[2]
SIGBUS = -7


def test_the_native_guard_is_built():
    assert filemap.native, "ckptstore/formats/_sigbus.c is not built: a file cut short mid-commit kills the process"


def _run(script: str, path: Path) -> subprocess.CompletedProcess:
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB, no zero page in it
    code = "import mmap, os\nfrom ckptstore.formats import filemap\npath = " + repr(str(path)) + "\n"
    return subprocess.run([sys.executable, "-c", code + textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_a_file_cut_short_under_a_guarded_map_reads_zeros_and_the_guard_refuses_it(tmp_path):
    result = _run("""
        from ckptstore.errors import CheckpointFormatError
        try:
            with filemap.guard():
                data = filemap.array(path)
                first = int(data[300])
                os.truncate(path, 0)  # the trainer's next torch.save opens the file with "wb"
                print(first, int(data[300]), int(data[-1]))
        except CheckpointFormatError as exc:
            print(exc)
    """, tmp_path / "f.bin")
    assert result.returncode == 0, result.stderr
    values, error = result.stdout.splitlines()
    assert values == "44 0 0"
    assert error.startswith(f"{tmp_path / 'f.bin'} changed while it was being committed")


def test_a_native_build_from_before_address_still_guards_a_file_cut_short(tmp_path):
    """A checkout updated without a rebuild keeps its older _sigbus (no `address`): every commit failed with an
    AttributeError; it takes the map's address through numpy instead, still guarded (reader 27)."""
    result = _run("""
        from ckptstore.errors import CheckpointFormatError
        del filemap._sigbus.address  # the older build's module
        try:
            with filemap.guard():
                digest = filemap.file_digest(path)
                data = filemap.array(path)
                os.truncate(path, 0)
                print(len(digest), int(data[300]))
        except CheckpointFormatError as exc:
            print(exc)
    """, tmp_path / "f.bin")
    assert result.returncode == 0, result.stderr
    values, error = result.stdout.splitlines()
    assert values == "64 0"
    assert error.startswith(f"{tmp_path / 'f.bin'} changed while it was being committed")


def test_a_guard_names_the_files_whose_maps_were_read_past_their_end(tmp_path):
    result = _run("""
        filemap.guard().__enter__()  # installs the handler
        guard = filemap.Guard()
        data, slot = filemap._open(path, False, guard)
        os.truncate(path, 0)
        print(bytes(data[:4]) == bytes(4), len(guard.faulted()))
        guard.close()
    """, tmp_path / "f.bin")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "1"]


def test_a_map_not_registered_still_dies_of_sigbus_with_the_handler_installed(tmp_path):
    result = _run("""
        with filemap.guard():
            filemap.array(path)[0]  # the handler is installed now, and stays
        with open(path, "rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate(path, 0)
        print(data[300])
    """, tmp_path / "f.bin")
    assert result.returncode == SIGBUS, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""


def test_a_map_closed_inside_a_guard_gives_up_its_slot(tmp_path):
    """Its addresses may be anyone's next: a stale slot would turn their SIGBUS into zeros in our name."""
    result = _run("""
        import gc
        with filemap.guard() as guard:
            data = filemap.open_map(path)
            print(len(guard._slots))
            del data
            gc.collect()
            print(len(guard._slots))
    """, tmp_path / "f.bin")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "0"]


def test_a_sigbus_that_is_no_fault_and_one_handed_to_faulthandler_end_the_process_once(tmp_path):
    """kill -BUS is not swallowed; faulthandler enabled between guards dumps once, then SIGBUS, no loop."""
    killed = _run("""
        import signal
        with filemap.guard():
            pass
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived")
    """, tmp_path / "f.bin")
    assert killed.returncode == SIGBUS and killed.stdout == ""
    handled = _run("""
        import signal
        signal.signal(signal.SIGBUS, lambda *_: print("handled", flush=True))  # a program's own handler
        for _ in range(2):  # each is the program's, however many guards came between
            with filemap.guard():
                pass
            os.kill(os.getpid(), signal.SIGBUS)
    """, tmp_path / "f.bin")
    assert handled.returncode == 0 and handled.stdout.split() == ["handled", "handled"], handled.stderr
    dumped = _run("""
        import faulthandler
        with filemap.guard():
            pass
        faulthandler.enable()
        with filemap.guard():
            pass
        with open(path, "rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate(path, 0)
        print(data[300])
    """, tmp_path / "f.bin")
    assert dumped.returncode == SIGBUS and dumped.stderr.count("Fatal Python error: Bus error") == 1


def test_a_file_cut_short_while_a_command_reads_it_is_not_said_to_be_committed(tmp_path):
    result = _run("""
        from ckptstore.errors import CheckpointFormatError
        real = filemap.bytes_digest
        def cut_then_hash(data):  # the trainer's next torch.save truncates it while `ckpt status` hashes it
            os.truncate(path, 0)
            return real(data)
        filemap.bytes_digest = cut_then_hash
        try:
            filemap.file_digest(path)
        except CheckpointFormatError as exc:
            print(exc)
    """, tmp_path / "f.bin")
    assert result.returncode == 0, result.stderr
    assert "changed while it was being read" in result.stdout and "committed" not in result.stdout

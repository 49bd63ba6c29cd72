"""Processes for the tests' multi-process runs, forked from a server that imported torch and ckptstore once.

A fresh interpreter spends 2-4 s of CPU importing torch (with torch.distributed and DCP, 3-4 s)
before its first line of work, and the suite starts dozens of them: DCP ranks, writers on one
shared repository. Each process started here is still a process of its own, forked from
multiprocessing's forkserver (which imported PRELOAD, nothing of the test process): it gets the
environment, argv and working directory it is given, runs MODULE's `main()` as `python -m MODULE
ARGV` would, and exits as that would (atexit handlers run), sharing nothing with the test process
or the others.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ["tests.dcp.worker", "tests.dcp.worker_more", "tests.dcp.lossy_worker", "tests.repo.shared_workers"]


def _run_main(module: str, argv: list[str], env: dict[str, str], cwd: str, logs: str) -> None:
    """The forked process's life: what `python -m MODULE ARGV` with `env` in `cwd` does."""
    import torch

    for fd, name in ((1, "out"), (2, "err")):
        os.dup2(os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [module, *argv]
    if "OMP_NUM_THREADS" in env:  # torch read it at import, in the server
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        importlib.import_module(module).main()
    finally:  # a forked process ends with os._exit: the interpreter's exit, in its order
        threading._shutdown()  # non-daemon threads joined, threading's exit hooks (background commits wait there)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


class Forked:
    """A running `python -m MODULE ARGV` (forked): `pid`, `communicate`, `returncode` and `kill` as subprocess's."""

    def __init__(self, module: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # once the server runs, it keeps what it loaded
        self.args = [module, *argv]
        self._logs = tempfile.mkdtemp(prefix="forked-")
        self._process = context.Process(target=_run_main, args=(module, argv, dict(os.environ if env is None else env),
                                                                 str(cwd), self._logs))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the process has ended; subprocess.TimeoutExpired if it runs past `timeout`."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.returncode is None:
            self.returncode = self._process.exitcode
            logs = [Path(self._logs, name) for name in ("out", "err")]  # none if it failed before making them
            self._output = tuple(log.read_text(errors="replace") if log.exists() else "" for log in logs)
            shutil.rmtree(self._logs)
            self._process.close()
        return self._output

    def kill(self) -> None:
        if self.returncode is None:
            self._process.kill()

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """The ended process as subprocess.run gives it (stdout and stderr apart)."""
        out, err = self.communicate(timeout)
        return subprocess.CompletedProcess(self.args, self.returncode, out, err)

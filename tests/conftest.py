"""Shared fixtures: a fresh repository, and real (small) training runs that make checkpoints."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# One torch thread per test worker, in this process and every one it starts: the suite runs a worker per
# core, and a second OpenMP thread only spins against the other worker (measured: 15-40% longer runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

from ckptstore import Repository

# `max_chain = "auto"` measures decode costs per machine (repo/chaincost.py); the suite pins costs that
# give the old default of 2 levels, so chains (and every test that counts depths) do not depend on load.
os.environ.setdefault("CKPTSTORE_CHAIN_COSTS", '{"2": [1e-10, 1e-10, 4e-10, 1], "4": [1e-10, 1e-10, 4e-10, 1]}')
_MADE: list[str] = []


def _folder_of_our_own(variable: str, prefix: str) -> None:
    """Point `variable` at a new folder, removed at the end; inside the test's own where a test's child imports this.

    Each process gets a folder of its own, as before; a child's goes inside its test's (one level: a daemon's
    socket path must stay short), so that one killed with -9 (the fault tests' children) leaves nothing behind
    in /tmp, and xdist's workers, whose exit skips atexit, remove theirs at pytest_unconfigure.
    """
    inherited = os.environ.get(variable, "")
    parent = (inherited if "PYTEST_CURRENT_TEST" in os.environ and Path(inherited).name.startswith(prefix)
              and Path(inherited).is_dir() else None)
    os.environ[variable] = tempfile.mkdtemp(prefix=prefix, dir=parent)
    _MADE.append(os.environ[variable])
    atexit.register(shutil.rmtree, os.environ[variable], True)


# The per-user cache (a machine's chain costs, remotes' scratch) goes to a folder of the run's own,
# for this process and every one it starts: tests never read or leave anything in ~/.cache.
_folder_of_our_own("XDG_CACHE_HOME", "ckpt-test-cache-")
# So do daemons' sockets: a daemon sweeps the folder of dead ones, which another test worker's test inspects.
_folder_of_our_own("XDG_RUNTIME_DIR", "ckpt-test-run-")


def pytest_unconfigure(config) -> None:
    for folder in _MADE:
        shutil.rmtree(folder, True)


ROOT = Path(__file__).resolve().parents[1]


def ckpt_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs ckptstore from this checkout, with no CKPT_REPO but `extra`'s."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("CKPT_REPO", None)
    return {**env, **extra}


def assert_same(a, b, where: str = "<root>") -> None:
    """Deep equality where tensors must match in dtype, shape and every raw byte."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(raw(a), raw(b)), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def same(a, b) -> bool:
    """`assert_same` as a yes or no, for tests that count outcomes instead of stopping at the first."""
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


class TinyNet(torch.nn.Module):
    """Embedding, LayerNorm and an MLP head: the tensor kinds a real model has."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(self.embed(tokens)))))


def wait_until_held(release: Path, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Return once `process` waits at its CKPT_WAIT_AT point (faults.py creates RELEASE.reached there)."""
    deadline = time.monotonic() + timeout
    while not Path(f"{release}.reached").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"the process did not reach its wait point within {timeout:.0f} s"
        time.sleep(0.02)


def held_while(cwd: Path, args: list[str], point: str, meanwhile: Callable[[], Any]) -> subprocess.CompletedProcess:
    """`ckpt ARGS` in a process of its own, held at fault point `point` while `meanwhile()` runs, then let go."""
    release = cwd / f"release-{point.replace(':', '-')}"
    held = subprocess.Popen([sys.executable, "-m", "ckptstore", *args], cwd=cwd,
                            env=ckpt_env(CKPT_WAIT_AT=f"{point}={release}"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until_held(release, held)
        meanwhile()
    finally:
        release.touch()
        out, err = held.communicate(timeout=300)
    return subprocess.CompletedProcess(held.args, held.returncode, out, err)


def end_left_running(started: list[subprocess.Popen]) -> None:
    """Kill and reap the processes in `started` still running (a failed test's child held at a fault point for ever)."""
    while started:
        process = started.pop()
        if process.poll() is None:
            process.kill()
            process.wait()


def ckpt_here(cwd: str | os.PathLike, *args: str, env: dict[str, str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """`ckpt ARGS` typed in `cwd`, run by this process's `ckptstore.cli.main`: the exit code and output a shell gets.

    For command flows: no process start-up per command. What a process does (signals, pipes, exit, the
    daemon, two commands at once) is tested with real subprocesses. A command still running after
    `timeout` seconds ends this test process with every thread's traceback, as a subprocess's timeout would
    fail the test, instead of hanging the suite.
    """
    import faulthandler

    from click.testing import CliRunner

    from ckptstore.cli import main

    argv = [os.fspath(arg) for arg in args]
    with contextlib.chdir(cwd), CliRunner().isolation(env={"CKPT_REPO": None, **(env or {})}) as (out, err, _):
        faulthandler.dump_traceback_later(timeout, exit=True, file=sys.__stderr__)
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        finally:
            faulthandler.cancel_dump_traceback_later()
            sys.stdout.flush()
            sys.stderr.flush()
        return subprocess.CompletedProcess(["ckpt", *argv], code, out.getvalue().decode(), err.getvalue().decode())


def received_lie(repo_dir: Path, claimed: str, real: str, listed: bool = True) -> None:
    """Make tensor `claimed`'s record hold `real`'s chunks, listed unchecked: what a crafted remote's fetch leaves.

    The record of `claimed` is made (a copy of `real`'s) where there is none; its chunks are `real`'s either way.
    Not `listed`: the lie as the crafted remote itself holds it.
    """
    import sqlite3

    db = sqlite3.connect(Path(repo_dir) / "ckpt.db")
    db.execute("INSERT OR IGNORE INTO tensors SELECT ?, dtype, shape, codec, params, base_id, depth, raw_bytes, "
               "stored_bytes FROM tensors WHERE id = ?", (claimed, real))
    db.execute("DELETE FROM tensor_chunks WHERE tensor_id = ?", (claimed,))
    db.execute('INSERT INTO tensor_chunks SELECT ?, position, object_id, raw_bytes, "offset", length, checksum '
               "FROM tensor_chunks WHERE tensor_id = ?", (claimed, real))
    if listed:
        db.execute("INSERT OR IGNORE INTO unchecked_tensors (tensor_id) VALUES (?)", (claimed,))
    db.commit()
    db.close()


def unchecked(repo, ids) -> set[str]:
    """Those of `ids` the repository still lists as received and unchecked."""
    from ckptstore.metadata import tensors as tensor_rows

    with repo.db.read() as tx:
        return tensor_rows.unchecked_among(tx, ids)


def outlier_adam_rounds(rounds: int) -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """A small Adam run whose first weight holds one outlier (50.0), yielded after each round of five steps.

    The outlier makes that weight's lossy step coarse, so its small moves round to nothing and a lossy
    commit restores it as the parent's record: what the tests of per-commit figures need.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 128)
    for _ in range(rounds):
        for _ in range(5):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        with torch.no_grad():
            model[0].weight[0, 0] = 50.0
        yield model, optimizer


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@dataclass
class Trainer:
    """A tiny next-token model trained on a fixed synthetic sequence, with full resumable state."""

    optimizer_kind: str = "adamw"
    seed: int = 0
    model: TinyNet = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    scheduler: torch.optim.lr_scheduler.LRScheduler = field(init=False)
    step: int = 0

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        np.random.seed(self.seed)
        self.model = TinyNet()
        self.optimizer = make_optimizer(self.optimizer_kind, self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + 0.01 * s))

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            tokens = torch.randint(0, 64, (16, 8))
            noise = int(np.random.randint(0, 2)) + random.randint(0, 1)  # exercise numpy and python RNGs
            logits = self.model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ((tokens + 1 + noise) % 64).reshape(-1))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step += 1
            losses.append(loss.item())
        return losses

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        }

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])


# ---------------------------------------------------------------------- metadata backends
# A module marked `pytestmark = pytest.mark.both_backends` runs each test that asks for `repo`,
# `metadata_url` or `metadata_backend` twice: on SQLite (the repository's own ckpt.db) and on a
# fresh database of the session's PostgreSQL server. Unmarked tests get SQLite only.
BACKENDS = ("sqlite", "postgresql")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "both_backends: run on SQLite and on PostgreSQL metadata")


def pytest_generate_tests(metafunc) -> None:
    if "metadata_backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_backends"):
        metafunc.parametrize("metadata_backend", BACKENDS, indirect=True)


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server for the whole run (ckptstore/testing/postgres_server.py)."""
    from ckptstore.errors import CkptError
    from ckptstore.testing.postgres_server import PostgresServer

    try:
        server = PostgresServer()
    except CkptError as exc:
        pytest.fail(f"these tests need a PostgreSQL server: {exc}", pytrace=False)
    with server:
        yield server


@pytest.fixture
def postgres_url(postgres_server):
    """A fresh, empty database on the session's server, dropped after the test."""
    url = postgres_server.new_database()
    yield url
    if postgres_server.running:
        postgres_server.drop_database(url)


@pytest.fixture
def stalling(postgres_server, postgres_url, monkeypatch):
    """(proxy, URL through it): a server that can stop answering while its connections stay open; 1 s per answer."""
    from ckptstore.testing.fault_proxy import FaultProxy

    monkeypatch.setenv("CKPT_PG_REQUEST_SECONDS", "1")
    with FaultProxy(postgres_server.port) as proxy:
        try:
            yield proxy, postgres_url.replace(f":{postgres_server.port}/", f":{proxy.port}/")
        finally:
            proxy.stalled = False  # what was held goes on, so nothing waits on it after the test


@pytest.fixture
def metadata_backend(request) -> str:
    return getattr(request, "param", "sqlite")


@pytest.fixture
def metadata_url(request, metadata_backend) -> str:
    """"" (the repository's own SQLite file) or the URL of a fresh PostgreSQL database."""
    return "" if metadata_backend == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.fixture
def repo(tmp_path: Path, metadata_url: str):
    with Repository.init(tmp_path, metadata_url=metadata_url) as repository:
        yield repository


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 for the whole session, with the standard AWS variables pointing at it."""
    from ckptstore.testing.s3_server import S3Server

    with S3Server() as server, pytest.MonkeyPatch.context() as env:
        for name, value in server.environment().items():
            env.setenv(name, value)
        yield server


@pytest.fixture
def s3_url(s3_server) -> str:
    """An s3:// URL of a fresh, empty bucket on the test server."""
    return f"s3://{s3_server.new_bucket()}/repo"


@pytest.fixture
def http_proxy(s3_server, monkeypatch):
    """An HTTP proxy in front of the session's S3 server that alters requests by rule (testing/http_fault_proxy.py);
    clients made in and below the test talk through it."""
    from ckptstore.testing.http_fault_proxy import HttpFaultProxy

    with HttpFaultProxy(s3_server.port) as running:
        monkeypatch.setenv("AWS_ENDPOINT_URL", running.endpoint)
        monkeypatch.setenv("CKPT_S3_RETRY_SECONDS", "2")
        yield running


@pytest.fixture
def trainer() -> Trainer:
    return Trainer()


# Hypothesis profiles for the state machines (tests/repo/test_state_machine.py,
# tests/objectstore/test_store_machine.py). They are registered here but applied only to those
# machines (`machine_settings()`), so other property tests keep their own explicit settings.
#   ci   (default): bounded for every test run; both machines together in well under a minute.
#   long: many more and longer runs, for a soak before a release or after changing the repository
#         layer:  CKPT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/repo/test_state_machine.py \
#                 tests/objectstore/test_store_machine.py      (about 5 minutes on 2 cores; ci: about 20 s)
# database=None: no .hypothesis/ folder in the work tree; a failure prints its steps and seed instead.
HYPOTHESIS_PROFILE_ENV = "CKPT_HYPOTHESIS_PROFILE"
settings.register_profile("ci", max_examples=25, stateful_step_count=30, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=200, stateful_step_count=80, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def machine_settings(scale: float = 1.0) -> settings:
    """The profile named by CKPT_HYPOTHESIS_PROFILE (default "ci"), with examples scaled by `scale`.

    A machine whose steps are costly (a real repository per example) passes `scale` < 1 so that
    each profile stays within its time budget.
    """
    profile = settings.get_profile(os.environ.get(HYPOTHESIS_PROFILE_ENV, "ci"))
    return settings(profile, max_examples=max(1, round(profile.max_examples * scale)))

"""Crash points: `ckpt commit`, `checkout`, `gc`, `gc --prune` and `push` killed with SIGKILL lose nothing.

Each trial copies a prepared repository (two commits on main, one unreachable commit, one
orphan object), runs one command and kills it, either after a random delay within the
command's measured run time or at a named durable step (ckptstore/faults.py, CKPT_CRASH_AT).
Then: fsck finds no damage (only unreferenced garbage), every earlier commit still checks out
bit-exact, the checked-out file is the old or the new checkpoint (never a mix), and the same
command run again succeeds and leaves the repository clean. "Lost" counts trials where any of
that failed; it must be 0. Default run: each injected point once and RANDOM_KILLS random kills
on a small checkpoint; CKPT_HYPOTHESIS_PROFILE=long: 50 random kills per command on about
32 MB (CKPT_CRASH_TRIALS, CKPT_CRASH_MB override; CKPT_CRASH_ONLY=push,gc picks commands);
CKPT_CRASH_REPORT=FILE collects the counts. A push's remote (`hub/` inside the repository's
folder) must have its branch unmoved or complete, never at a commit it cannot restore.
Every trial runs on SQLite metadata and on PostgreSQL, where each trial's copy of the prepared
repository gets a copy of its database (CREATE DATABASE ... TEMPLATE); `push` runs on SQLite only
(it only reads the local metadata; its remote, where it writes, is a SQLite folder either way).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError
from ckptstore.repo import fsck, remote
from ckptstore.repo.config import RepoConfig
from tests.conftest import BACKENDS, assert_same, ckpt_env, ckpt_here, same

ROOT = Path(__file__).resolve().parents[2]
LONG = os.environ.get("CKPT_HYPOTHESIS_PROFILE") == "long"
MEGABYTES = float(os.environ.get("CKPT_CRASH_MB") or (32 if LONG else 2))
RANDOM_KILLS = int(os.environ.get("CKPT_CRASH_TRIALS") or (50 if LONG else 1))  # per command
COMMANDS = {"commit": ["commit", "new.pt", "-m", "new", "--allow-empty"], "checkout": ["checkout", "main~1"],
            "gc": ["gc"], "gc --prune": ["gc", "--prune"], "push": ["push"]}
# (command, CKPT_CRASH_AT): every durable step of the commit and gc paths
INJECTED = [("commit", "pack-written"), ("commit", "commit:objects-written"), ("commit", "commit:manifest-written"),
            ("commit", "commit:ref-moved"), ("gc", "gc:tmp-cleared"), ("gc", "gc:db-committed"),
            ("gc", "gc:object-deleted"), ("gc --prune", "gc:db-committed"), ("gc --prune", "gc:object-deleted@2"),
            ("push", "transfer:object-sent@2"), ("push", "transfer:objects-sent"), ("push", "transfer:records-sent")]


def _state(seed: int, base: dict | None = None) -> dict:
    """A training-like state of about MEGABYTES: big weights, small ones (packed), moments, a step."""
    g = torch.Generator().manual_seed(seed)
    n = int(MEGABYTES * (1 << 20) / 4 / 3)
    if base is not None:  # the next step: a small update, so commits chain as residuals
        model = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base["model"].items()}
    else:
        model = {"big": torch.randn(n, generator=g), "other": torch.randn(n // 2, 2, generator=g),
                 **{f"small{i}": torch.randn(200 + i, generator=g) for i in range(8)}}
    moments = {k: v * 0.1 for k, v in model.items() if k.startswith("big")}
    return {"model": model, "optimizer": {"state": {0: {"exp_avg": moments["big"], "step": torch.tensor(seed)}},
                                          "param_groups": [{"params": [0], "lr": 1e-3}]}}


def _ckpt(cwd: Path, args: list[str], env: dict | None = None) -> subprocess.Popen:
    full = ckpt_env(**(env or {}))
    return subprocess.Popen([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(cwd: Path, args: list[str], env: dict | None = None) -> tuple[int, str, float]:
    start = time.perf_counter()
    proc = _ckpt(cwd, args, env)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err, time.perf_counter() - start


@pytest.fixture(scope="module", params=BACKENDS)
def server(request):
    """None for SQLite metadata, else the session's PostgreSQL server."""
    return request.getfixturevalue("postgres_server") if request.param == "postgresql" else None


def _copy(work: Path, to: Path, server) -> None:
    """A copy of the repository at `work`; on PostgreSQL with a copy of its database, named in its config."""
    shutil.copytree(work, to)
    if server is not None:
        config_path = to / ".ckpt" / "config.toml"
        config = RepoConfig.load(config_path)
        config.metadata_url = server.new_database(template=config.metadata_url)
        config.save(config_path)


def _remove(trial: Path, server) -> None:
    if server is not None:
        server.drop_database(RepoConfig.load(trial / ".ckpt" / "config.toml").metadata_url)
    shutil.rmtree(trial)


@pytest.fixture(scope="module")
def template(tmp_path_factory, server):
    """The prepared repository, the states of its commits, and each command's run time on a copy."""
    root = tmp_path_factory.mktemp("crash")
    work = root / "template"
    work.mkdir()
    states = [_state(1)]
    states += [_state(2, states[0]), _state(3, states[0]), _state(4, states[0])]
    with Repository.init(work, metadata_url=server.new_database() if server else "") as repo:
        cids = []
        for i in range(2):
            torch.save(states[i], work / "ckpt.pt")
            cids.append(repo.commit(work / "ckpt.pt", message=f"c{i}"))
        torch.save(states[2], work / "ckpt.pt")
        doomed = repo.commit(work / "ckpt.pt", branch="doomed", message="doomed")
        repo.delete_branch("doomed")
        repo.store.put(os.urandom(5000))  # an orphan, as a crashed commit leaves behind
    Repository.init(work / "hub").close()  # the remote `push` sends main to, inside the folder so copies take it
    with Repository.open(work) as repo:
        remote.add(repo, "origin", "hub")
    torch.save(states[1], work / "ckpt.pt")  # the worktree as main's head left it
    torch.save(states[3], work / "new.pt")
    durations = dict.fromkeys(COMMANDS, 1.0)  # the default run's few kills land within a second
    for name, args in COMMANDS.items() if LONG else ():  # time each phase, so kills spread over all of it
        copy = root / f"timing-{name.replace(' ', '')}"
        _copy(work, copy, server)
        rc, out, durations[name] = _run(copy, args)
        assert rc == 0, out
        _remove(copy, server)
        _copy(work, copy, server)  # timed again warm: the first run pays for cold caches
        durations[name] = min(durations[name], _run(copy, args)[2])
        _remove(copy, server)
    return work, {"c0": (cids[0], states[0]), "c1": (cids[1], states[1]), "doomed": (doomed, states[2]),
                  "new": (None, states[3])}, durations


def _check(trial: Path, command: str, commits: dict) -> list[str]:
    """What the killed run lost or broke (empty: nothing)."""
    problems = []
    with Repository.open(trial) as repo:
        report = fsck(repo)
        if not report.ok:
            problems.append(f"fsck: {report.damaged_objects} {report.missing_records}")
        for name in ("c0", "c1", "doomed"):
            cid, state = commits[name]
            try:
                assert_same(state, repo.checkout(cid))
            except CkptError as exc:  # only a pruned unreachable commit may be gone, and then wholly
                if not (name == "doomed" and command == "gc --prune" and "unknown" in str(exc)):
                    problems.append(f"{name}: {exc}")
            except AssertionError as exc:
                problems.append(f"{name} checks out changed: {exc}")
    if command == "push":
        problems += _check_hub(trial / "hub", commits)
    if command == "checkout":  # the file is the old or the new checkpoint, never a mix
        on_disk = torch.load(trial / "ckpt.pt", weights_only=True)
        if not any(same(on_disk, commits[n][1]) for n in ("c0", "c1")):
            problems.append("ckpt.pt is neither checkpoint")
    return problems


def _check_hub(hub: Path, commits: dict, pushed: bool = False) -> list[str]:
    """The remote after a killed (or, `pushed`, a completed) push: its branch unmoved or at main, never broken."""
    problems = []
    with Repository.open(hub) as repo:
        if not fsck(repo).ok:
            problems.append("the remote's fsck failed")
        tip = repo.branches().get("main")
        if tip not in ((commits["c1"][0],) if pushed else (None, commits["c1"][0])):
            problems.append(f"the remote's main is at {tip}")
        for name in ("c0", "c1") if tip else ():
            if not same(commits[name][1], repo.checkout(commits[name][0])):
                problems.append(f"the remote's {name} checks out changed")
    return problems


def _after_rerun(trial: Path, command: str, commits: dict) -> list[str]:
    rerun = ckpt_here(trial, *COMMANDS[command])  # what is under test is the killed run; the rerun is a plain command
    if rerun.returncode != 0:
        return [f"rerun failed ({rerun.returncode}): {(rerun.stdout + rerun.stderr).strip()}"]
    problems = _check(trial, command, commits)
    with Repository.open(trial) as repo:
        if command == "commit" and not same(commits["new"][1], repo.checkout("HEAD")):
            problems.append("the rerun commit does not check out as committed")
        if command.startswith("gc") and fsck(repo).unreferenced_objects:
            problems.append("gc left unreferenced objects")
    if command == "push":
        problems += _check_hub(trial / "hub", commits, pushed=True)
    return problems


def _trial(template, server, tmp_path: Path, number: int, command: str, delay: float | None = None,
           point: str | None = None) -> dict:
    work, commits, _ = template
    trial = tmp_path / f"trial{number}"
    _copy(work, trial, server)
    proc = _ckpt(trial, COMMANDS[command], {"CKPT_CRASH_AT": point} if point else None)
    if delay is not None:
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=300)
    killed = proc.returncode == -signal.SIGKILL
    problems = _check(trial, command, commits) + _after_rerun(trial, command, commits)
    _remove(trial, server)
    return {"command": command, "point": point, "delay": delay, "killed": killed, "problems": problems}


def _report(name: str, results: list[dict], durations: dict | None = None) -> None:
    target = os.environ.get("CKPT_CRASH_REPORT")
    if target:
        with Path(target).open("a") as handle:
            for command in COMMANDS:
                mine = [r for r in results if r["command"] == command]
                if mine:
                    handle.write(json.dumps({"test": name, "command": command, "trials": len(mine),
                                             "killed": sum(r["killed"] for r in mine),
                                             "lost": sum(bool(r["problems"]) for r in mine),
                                             "run_s": round((durations or {}).get(command, 0), 2)}) + "\n")


def _commands(server) -> list[str]:
    return [c for c in COMMANDS if server is None or c != "push"]


def test_kill_at_each_durable_step_loses_nothing(template, server, tmp_path):
    results = [_trial(template, server, tmp_path, i, command, point=point)
               for i, (command, point) in enumerate(INJECTED) if command in _commands(server)]
    _report("injected" + (" postgresql" if server else ""), results)
    assert all(r["killed"] for r in results), [r["point"] for r in results if not r["killed"]]
    assert not [r for r in results if r["problems"]]


def test_kill_at_random_moments_loses_nothing(template, server, tmp_path):
    _, _, durations = template
    rng = random.Random(int(os.environ.get("CKPT_CRASH_SEED", "21")))
    only = os.environ.get("CKPT_CRASH_ONLY", "").split(",") if os.environ.get("CKPT_CRASH_ONLY") else COMMANDS
    results = [_trial(template, server, tmp_path, i * 100 + k, command,
                      delay=rng.uniform(0.02, 0.95) * durations[command])
               for i, command in enumerate(COMMANDS) if command in only and command in _commands(server)
               for k in range(RANDOM_KILLS)]
    _report("random" + (" postgresql" if server else ""), results, durations)
    assert not [r for r in results if r["problems"]]

"""The program's signal handlers held while a commit call runs (signals.py: signals_held).

A handler that saves must not run inside a commit (it would wait on the lane that commit holds): it waits and runs
once the call lets go. Holding them must change nothing else: the handlers the program sets, the order and number
of the calls. What can hang runs in a child with a deadline.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import Repository
from tests.conftest import ckpt_env, end_left_running

ROOT = Path(__file__).resolve().parents[2]
SPAWNED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    yield
    end_left_running(SPAWNED)


def _run_child(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `script` in a child from this checkout; one still running after `timeout` seconds fails the test."""
    child = subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=ckpt_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    SPAWNED.append(child)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the child still ran after {timeout} s") from None
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def test_a_handler_the_program_sets_during_a_commit_stays_set_after_it(tmp_path):
    """The end of the hold put back the handler each signal had before the commit, over one the program set meanwhile
    (a calibration function's, `ckpt watch`'s switch to Ctrl-C's default) (reviewer 367): the program's stays."""
    def old(signum, frame):
        pass

    def new(signum, frame):
        pass

    def calibrate(state):
        signal.signal(signal.SIGUSR1, new)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        return 1.0

    before = {signum: signal.signal(signum, old) for signum in (signal.SIGUSR1, signal.SIGHUP, signal.SIGUSR2)}
    try:
        with Repository.init(tmp_path) as repo:
            repo.commit({"w": torch.randn(4096)}, "c", lossy="balanced", calibration=calibrate, max_loss_change=0.5)
            assert [c.message for c in repo.log()] == ["c"]
        assert signal.getsignal(signal.SIGUSR1) is new
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR2) is old  # one the program left alone is its own again
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


SIGTERM_AFTER_AN_ALARM_IN_THE_PUT_BACK = """
import os, signal, sys, torch
import ckptstore
from ckptstore.repo import background
root, mode = sys.argv[1], sys.argv[2]

class Timeout(Exception):
    pass

def on_alarm(signum, frame):  # an evaluation's time limit
    raise Timeout("eval took too long")

def last_save(signum, frame):  # a requeue script's: save a last checkpoint, then exit
    ckptstore.save({"w": torch.ones(8)}, root, step=99)
    sys.exit(0)

signal.signal(signal.SIGALRM, on_alarm)
signal.signal(signal.SIGTERM, last_save)
real_signal, kept, alarms = signal.signal, [], []

def alarm_as_sigterms_handler_goes_back(signum, handler):  # the alarm is due just then: it runs first, and raises
    # the commit's own put-back, once its calibration ran (shorter holds around the kept repositories come before)
    if signum == signal.SIGTERM and handler is last_save and mode == "alarm" and kept and not alarms:
        alarms.append(signum)
        signal.raise_signal(signal.SIGALRM)
    return real_signal(signum, handler)

def keeps_sigterms_handler(state):  # a library that notes the handler it finds, and sets it again later
    kept.append(signal.getsignal(signal.SIGTERM))
    return 1.0

background.signal.signal = alarm_as_sigterms_handler_goes_back
try:
    ckptstore.save({"w": torch.randn(4096)}, root, step=1, lossy="balanced", calibration=keeps_sigterms_handler,
                   max_loss_change=0.5)
except Timeout as exc:
    print("save 1:", exc)
background.signal.signal = real_signal
if mode == "kept":
    signal.signal(signal.SIGTERM, kept[0])

def sigterm_meanwhile(state):  # SIGTERM lands during the loop's next save
    os.kill(os.getpid(), signal.SIGTERM)
    return 1.0

ckptstore.save({"w": torch.randn(4096)}, root, step=2, lossy="balanced", calibration=sigterm_meanwhile,
               max_loss_change=0.5)
print("the loop went on")
"""


@pytest.mark.parametrize("mode", ["alarm", "kept"])
def test_a_saving_sigterm_handler_waits_for_the_commit_after_an_alarm_cut_the_put_back_short(tmp_path, mode):
    """An alarm's exception raised as the handlers were put back stopped that: SIGTERM kept ckptstore's held_back,
    which the next commit took for a handler of ckptstore's own by its file and ran at once, so the program's saving
    handler ran inside that commit, was refused and the commit lost (reviewer 367). Every handler is put back, and
    a held_back the program set again itself is judged by the handler it runs: the handler's save comes after."""
    Repository.init(tmp_path).close()
    done = _run_child(SIGTERM_AFTER_AN_ALARM_IN_THE_PUT_BACK, str(tmp_path), mode)
    assert done.returncode == 0 and "the loop went on" not in done.stdout, done.stderr
    assert ("save 1: eval took too long" in done.stdout) == (mode == "alarm")
    assert "SIGTERM came during the commit at step 2" in done.stderr and "Traceback" not in done.stderr
    with Repository.open(tmp_path) as repo:
        assert [c.step for c in repo.log()] == [99, 2, 1]


def _commit_calibrated_by(calibrate, root: Path) -> None:
    """A blocking commit whose calibration function (run inside it, signals held) calls `calibrate` once."""
    calls = []

    def calibration(state):  # called more than once (the state as it was, then as it would be restored)
        if not calls:
            calls.append(calibrate())
        return 1.0

    with Repository.init(root) as repo:
        repo.commit({"w": torch.randn(4096)}, "c", lossy="balanced", calibration=calibration, max_loss_change=0.5)


def test_signals_held_during_a_commit_reach_their_handlers_once_each_in_the_order_they_came(tmp_path):
    """Held signals were raised again merged and by number: SIGUSR2, Ctrl-C, Ctrl-C to a handler that stops at the
    second press ran Ctrl-C's handler once, then SIGUSR2's; the second press was lost (reviewer 367)."""
    ran = []

    def on_int(signum, frame):  # first press: stop after this step; second press: stop now
        ran.append("SIGINT")
        if ran.count("SIGINT") == 2:
            raise KeyboardInterrupt("second Ctrl-C")

    def press_keys():
        for signum in (signal.SIGUSR2, signal.SIGINT, signal.SIGINT):
            signal.raise_signal(signum)  # its handler runs before raise_signal returns: held, one arrival each

    before = {signal.SIGINT: signal.signal(signal.SIGINT, on_int),
              signal.SIGUSR2: signal.signal(signal.SIGUSR2, lambda signum, frame: ran.append("SIGUSR2"))}
    try:
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            _commit_calibrated_by(press_keys, tmp_path)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert ran == ["SIGUSR2", "SIGINT", "SIGINT"]
    with Repository.open(tmp_path) as repo:
        assert [c.message for c in repo.log()] == ["c"]  # the commit was written before the handlers ran


def test_a_signal_that_keeps_coming_during_a_commit_reaches_its_handler_three_times_not_each_time(tmp_path):
    """A timer's signal during a minutes-long commit would run its handler thousands of times in a row once it is
    done: past three arrivals of one signal they are merged, as the kernel merges a pending signal."""
    ran = []

    def timer_fires_five_times():
        for _ in range(5):
            signal.raise_signal(signal.SIGUSR2)

    before = signal.signal(signal.SIGUSR2, lambda signum, frame: ran.append(signum))
    try:
        _commit_calibrated_by(timer_fires_five_times, tmp_path)
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert ran == [signal.SIGUSR2] * 3


def test_a_held_signal_goes_to_the_handler_it_came_to_not_one_set_after_it(tmp_path):
    """A held signal was raised again to whatever handler stood once the commit was done; one the program set after
    the signal came (`ckpt watch` sets Ctrl-C's default at the first press) got it. Held, it runs as it came."""
    ran = []

    def signal_then_new_handler():
        signal.raise_signal(signal.SIGUSR2)
        signal.signal(signal.SIGUSR2, lambda signum, frame: ran.append("set after it came"))

    before = signal.signal(signal.SIGUSR2, lambda signum, frame: ran.append("the handler it came to"))
    try:
        _commit_calibrated_by(signal_then_new_handler, tmp_path)
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert ran == ["the handler it came to"]


CALLBACK_OF_AN_ASYNCIO_PROGRAM = """
import asyncio, signal, sys, torch
import ckptstore
calls = []

def signal_during_the_save(state, raised=[]):
    if not raised:  # called more than once
        raised.append(signal.raise_signal(signal.SIGUSR1))
    return 1.0

async def main():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: calls.append(1))
    ckptstore.save({"w": torch.randn(4096)}, sys.argv[1], step=1, lossy="balanced",
                   calibration=signal_during_the_save, max_loss_change=0.5)  # blocking, on the loop's thread
    for _ in range(5):  # a few turns of the loop: each byte of its wakeup fd is one callback
        await asyncio.sleep(0.02)
    print(len(calls))

asyncio.run(main())
"""


def test_a_signal_held_during_a_commit_reaches_an_asyncio_programs_callback_once(tmp_path):
    """asyncio's add_signal_handler is told of a signal through set_wakeup_fd, which the interpreter writes as the
    signal arrives; raising a held signal again wrote it a second time: the callback ran twice (reviewer 367)."""
    Repository.init(tmp_path).close()
    done = _run_child(CALLBACK_OF_AN_ASYNCIO_PROGRAM, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "1\n"


@pytest.mark.parametrize("signum", [signal.SIGCHLD, signal.SIGWINCH], ids=["a child ended", "the terminal resized"])
def test_a_signal_that_only_informs_waits_for_the_commit_unsaid(tmp_path, capsys, signum):
    """torch sets a SIGCHLD handler with DataLoader workers: held, every commit during which any child ended said on
    stderr that SIGCHLD waited and that kill -9 abandons the commit (reviewer 367). Run at once, torch's raised
    inside a blocking commit when a worker died and threw the commit away (reviewer 374). It waits, said nowhere."""
    ran, inside = [], []

    def child_ends():
        signal.raise_signal(signum)
        inside.append(list(ran))  # what had run by then, still inside the commit

    before = signal.signal(signum, lambda signum, frame: ran.append(signum))
    try:
        _commit_calibrated_by(child_ends, tmp_path)
    finally:
        signal.signal(signum, before)
    assert inside == [[]] and ran == [signum]
    assert "came during the commit" not in capsys.readouterr().err


SIGTERM_WHILE_A_SAVE_BY_PATH_HOLDS_ITS_KEPT_REPOSITORIES = """
import os, signal, sys, torch
import ckptstore
import ckptstore.api as api
root = sys.argv[1]

def last_save(signum, frame):  # a requeue script's: save a last checkpoint, then exit
    ckptstore.save({"w": torch.full((8,), 99.0)}, root, step=99)
    sys.exit(7)

signal.signal(signal.SIGTERM, last_save)
ckptstore.save({"w": torch.zeros(8)}, root, step=0)
real, fired = api._identity, []

def identity(repository):  # read under the lock of the kept repositories: the scheduler's SIGTERM lands here
    if not fired:
        fired.append(api._KEPT_LOCK.locked())
        os.kill(os.getpid(), signal.SIGTERM)
    return real(repository)

api._identity = identity
ckptstore.save({"w": torch.ones(8)}, root, step=1)
print("the loop went on")
"""


def test_a_saving_sigterm_handler_during_a_save_by_path_holding_its_kept_repositories_lock_saves_after_it(tmp_path):
    """`ckptstore.save(state, path)` holds the lock of the kept repositories a moment; a SIGTERM handler that saved by
    path then took it again on the same thread and waited on itself until SIGKILL (reviewer 374, 2 in 110 random
    SIGTERMs). A call by path holds the program's handlers throughout: the handler's save comes after the loop's."""
    Repository.init(tmp_path).close()
    done = _run_child(SIGTERM_WHILE_A_SAVE_BY_PATH_HOLDS_ITS_KEPT_REPOSITORIES, str(tmp_path), timeout=60)
    assert done.returncode == 7 and "the loop went on" not in done.stdout and "Traceback" not in done.stderr, done
    with Repository.open(tmp_path) as repo:
        assert [c.step for c in repo.log()] == [99, 1, 0]
        assert torch.equal(repo.checkout("HEAD")["w"], torch.full((8,), 99.0))


SIGTERM_WHILE_THE_FIRST_CALL_IMPORTS = """
import os, signal, sys
import ckptstore  # before torch, as isort orders them
from ckptstore import Repository
mode, root = sys.argv[1], sys.argv[2]
if mode == "numpy":  # a trainer of numpy arrays: torch is never loaded
    import numpy as np
    state = lambda v: {"w": np.full(8, v, dtype=np.float32)}
else:
    import torch
    state = lambda v: {"w": torch.full((8,), v)}
# where the first call is a checkout or a diff (a resume), a module that commits need too
half = {"by attribute": "ckptstore.api", "checkout": "ckptstore.codecs", "diff": "ckptstore.codecs"}.get(
    mode, "ckptstore.repo.background")
repo = None

class SigtermMidImport:  # the scheduler's SIGTERM, landing while `half` is half-imported
    fired = False

    def find_spec(self, name, path=None, target=None):
        module = sys.modules.get(half)
        if not self.fired and module is not None and module.__spec__._initializing:
            SigtermMidImport.fired = True
            os.kill(os.getpid(), signal.SIGTERM)

def last_save(signum, frame):  # a requeue script's: save a last checkpoint, then exit
    if repo is not None:
        repo.commit(state(99.0), step=99)
    else:
        ckptstore.save(state(99.0), root, step=99)
    sys.exit(7)

sys.meta_path.insert(0, SigtermMidImport())
signal.signal(signal.SIGTERM, last_save)
if mode not in ("by path", "by attribute"):
    repo = Repository.open(root)
if mode == "checkout":
    repo.checkout("HEAD")
elif mode == "diff":
    repo.diff("HEAD", "HEAD")
elif repo is not None:
    repo.commit(state(1.0), step=1)
else:
    ckptstore.save(state(1.0), root, step=1)
print("the loop went on", SigtermMidImport.fired)
"""


@pytest.mark.parametrize("mode", ["by path", "by attribute", "torch", "numpy", "checkout", "diff"])
def test_a_saving_sigterm_handler_landing_while_the_first_call_imports_saves(tmp_path, mode):
    """A SIGTERM handler that saves, landing while a process's first save imported repo.background (or ckptstore.api,
    for `ckptstore.save` looked up then), or its first checkout or diff a module a commit needs too (replay),
    found it half-imported: ImportError, and both the save and the call were lost (reviewers 378, 379, 380:
    whatever the order of the program's imports). Its save now comes after that call; where the signal landed
    while the program opened its repository or looked `ckptstore.save` up, before the first save, as it would."""
    with Repository.init(tmp_path) as repo:
        if mode in ("checkout", "diff"):  # the run's last checkpoint, which the resume reads back first
            repo.commit({"w": torch.full((8,), 1.0)}, step=1)
    done = _run_child(SIGTERM_WHILE_THE_FIRST_CALL_IMPORTS, mode, str(tmp_path), timeout=90)
    assert done.returncode == 7 and "the loop went on" not in done.stdout and "Traceback" not in done.stderr, done
    with Repository.open(tmp_path) as repo:
        assert [c.step for c in repo.log()] == ([99] if mode in ("by attribute", "torch", "numpy") else [99, 1])
        assert repo.checkout("HEAD")["w"].tolist() == [99.0] * 8


EVERY_KIND_OF_COMMIT = """
import json, os, sys
import torch
from ckptstore import Repository
from safetensors.torch import save_file
work = sys.argv[1]
Repository.init(os.path.join(work, "r")).close()
with open(os.path.join(work, "r", ".ckpt", "config.toml"), "a") as f:  # a prune after each commit
    f.write("\\n[retention]\\nkeep_last = 2\\n")
repo = Repository.open(os.path.join(work, "r"))
opened = {name for name in sys.modules if name.startswith("ckptstore")}
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 8)).sum().backward()
optimizer.step()
state = lambda step: {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
repo.commit(state(1), "a state")
torch.save(state(2), os.path.join(work, "f.pt"))
repo.commit(os.path.join(work, "f.pt"), "a torch.save file")
save_file({"w": torch.ones(4)}, os.path.join(work, "f.safetensors"))
repo.commit(os.path.join(work, "f.safetensors"), "a safetensors file")
folder = os.path.join(work, "checkpoint-3")
os.makedirs(folder)
torch.save(state(3), os.path.join(folder, "optimizer.pt"))
with open(os.path.join(folder, "trainer_state.json"), "w") as f:
    json.dump({"global_step": 3}, f)
repo.commit(folder, "a Trainer folder")
repo.commit(state(4), "lossy", lossy="balanced", model=model, optimizer=optimizer)
repo.commit(state(5), "calibrated", lossy="balanced", model=model, calibration=lambda m: m(torch.ones(1, 8)).sum())
repo.commit(state(6), "in the background", blocking=False).result()
print(sorted(name for name in sys.modules if name.startswith("ckptstore") and name not in opened))
assert sum(not c.pruned for c in repo.log()) == 2  # the policy pruned the others
"""


def test_a_program_that_opened_a_repository_imports_nothing_more_of_ckptstore_to_commit(tmp_path):
    """Whatever a commit is given, and with the prune a retention policy runs after it, what it imports was loaded as
    the program opened the repository, with its signal handlers held (repo/warm.py: MACHINERY): a handler that
    saves never finds one half-imported (reviewer 381: the prune's repo.integrity was missing)."""
    done = _run_child(EVERY_KIND_OF_COMMIT, str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


SIGTERM_DURING_A_LAZY_CLONES_DOWNLOAD = """
import os, signal, sys, threading, faulthandler
faulthandler.dump_traceback_later(60, exit=True)
import torch
from ckptstore import Repository
from ckptstore.objectstore import fallback
repo = Repository.open(sys.argv[1])
real, fired = fallback.FallbackStore.from_source, []

def from_source(self, oid):  # the scheduler's SIGTERM, landing while the resume's checkout downloads its parent
    if not fired and threading.current_thread() is threading.main_thread():
        fired.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, oid)

def last_save(signum, frame):  # a requeue script's: its commit reads the same chain
    repo.commit({"w": torch.full((300000,), 99.0)}, step=99)
    sys.exit(7)

fallback.FallbackStore.from_source = from_source
signal.signal(signal.SIGTERM, last_save)
repo.checkout("HEAD")
print("the loop went on", fired)
"""


def test_a_saving_sigterm_handler_landing_while_a_lazy_clone_downloads_saves_after_the_download(tmp_path):
    """On a lazy clone, a checkout downloads what it lacks under a lock per object; a SIGTERM handler that saved then,
    on the same thread, read the same chain and waited on that lock forever (reviewer 381). The download holds the
    program's handlers: the handler's commit comes after it, on that chain."""
    from ckptstore.repo.remote import clone

    with Repository.init(tmp_path / "hub") as hub:
        hub.commit({"w": torch.ones(300000)}, step=1)
    clone(str(tmp_path / "hub"), str(tmp_path / "lazy"), lazy=True).close()
    done = _run_child(SIGTERM_DURING_A_LAZY_CLONES_DOWNLOAD, str(tmp_path / "lazy"), timeout=120)
    assert done.returncode == 7 and "the loop went on" not in done.stdout and "Traceback" not in done.stderr, done
    assert "SIGTERM came during the download of object" in done.stderr  # minutes, maybe: said (reviewer 389)
    with Repository.open(tmp_path / "lazy") as repo:
        assert [c.step for c in repo.log()] == [99, 1]
        assert torch.equal(repo.checkout("HEAD")["w"], torch.full((300000,), 99.0))


def test_a_program_that_ran_a_ckpt_command_in_process_still_loads_the_machinery_as_it_opens(tmp_path):
    """The `ckpt` command opens repositories without the commit machinery (`ckpt status` loads no numpy), but only for
    its length: run in-process first, it switched the loading off for the rest of the program (reviewer 381)."""
    Repository.init(tmp_path).close()
    script = ("import sys\nfrom ckptstore.cli.entry import main\ntry:\n    main(['status'])\nexcept SystemExit:\n"
              "    pass\nprint('numpy' in sys.modules)\nfrom ckptstore import Repository\n"
              "Repository.open(sys.argv[1])\nprint('ckptstore.repo.background' in sys.modules)")
    done = _run_child(script, str(tmp_path), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["False", "True"]


def test_a_ckpt_command_run_in_process_leaves_other_threads_loading_the_machinery(tmp_path):
    """Only the thread running a `ckpt` command opens repositories without the commit machinery: a process-wide
    switch let another thread's open skip it, and two overlapping commands left it off for good (reviewer 389)."""
    Repository.init(tmp_path).close()
    script = """if True:
        import sys, threading
        from ckptstore import Repository
        from ckptstore.repo import warm
        loaded = []
        with warm.machinery_as_needed():  # what ckptstore.cli.entry.main does for its call
            Repository.open(sys.argv[1]).close()
            loaded.append("ckptstore.repo.background" in sys.modules)
            other = threading.Thread(target=lambda: Repository.open(sys.argv[1]).close())
            other.start()
            other.join()
            loaded.append("ckptstore.repo.background" in sys.modules)
        print(loaded)
    """
    done = _run_child(script, str(tmp_path), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[False, True]"


def test_a_held_signal_says_nothing_where_there_is_no_stderr_and_never_writes_it_to_stdout():
    """With fd 2 closed at start sys.stderr is None, and print(file=None) wrote the notice into stdout, the program's
    data (reviewer 390). The handler still runs after the block."""
    import os

    script = """if True:
        import os, signal
        from ckptstore.signals import signals_waiting
        signal.signal(signal.SIGTERM, lambda *_: print("handler"))
        with signals_waiting("the download of object 0123456789ab from the origin", "it is here"):
            os.kill(os.getpid(), signal.SIGTERM)
            print("block went on")
    """
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ckpt_env(), stdout=subprocess.PIPE,
                          text=True, timeout=60, preexec_fn=lambda: os.close(2))
    assert done.returncode == 0
    assert done.stdout.split("\n") == ["block went on", "handler", ""]

"""Random byte and page damage to the metadata database: a clear error or a bit-exact restore, never a wrong tensor.

One small repository (a short training run: a residual chain, a branch, a tag) is made once; each
trial copies it, damages its ckpt.db and then opens it, checks out every commit and HEAD, and
runs fsck and fsck --full. Every outcome must be a ckptstore error (CkptError) or a restore equal
to the original bit for bit; fsck must return a report or a CkptError, never crash, and fsck --full
must not say ok where a restore failed.

    60 trials by default; CKPT_HYPOTHESIS_PROFILE=long (or CKPT_DB_FUZZ_TRIALS=N) runs more:
    CKPT_DB_FUZZ_TRIALS=1000 python -m pytest -q -s tests/metadata/test_db_fuzz.py
"""

# SQLite only: it damages the bytes and pages of the ckpt.db file
from __future__ import annotations

import os
import random
import shutil
import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import Repository
from ckptstore.errors import CkptError
from ckptstore.repo import fsck
from tests.conftest import HYPOTHESIS_PROFILE_ENV, Trainer, same

PAGE = 4096
KINDS = ["bytes", "noise page", "zero page", "copied page"]
TRIALS = int(os.environ.get("CKPT_DB_FUZZ_TRIALS") or (1000 if os.environ.get(HYPOTHESIS_PROFILE_ENV) == "long"
                                                      else 60))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A repository with a few commits, its database checkpointed into one file; expected states by ref."""
    root = tmp_path_factory.mktemp("fuzz-template")
    trainer, expected = Trainer(), {}
    with Repository.init(root) as repo:
        for i in range(3):
            trainer.train(2)
            expected[repo.commit(trainer.state(), message=f"c{i}", step=trainer.step)] = trainer.state()
        repo.tag("first", next(iter(expected)))
        repo.branch("side", "HEAD~1")
        trainer.train(1)
        state = trainer.state()
        state["model"]["fc2.bias"] = state["model"]["fc2.bias"] + 1
        expected[repo.commit(state, branch="side", message="side")] = state
        expected["HEAD"] = expected[repo.resolve("HEAD")]
        expected["first"] = expected[repo.resolve("first")]
        expected = {ref: repo.checkout(ref) for ref in expected}  # as restored: what must come back
        db_path = repo.db.path
    with sqlite3.connect(db_path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert not Path(f"{db_path}-wal").exists() or Path(f"{db_path}-wal").stat().st_size == 0
    return root, expected


def _damage(db: Path, kind: str, rng: random.Random) -> None:
    """Flip a few bytes, or overwrite one page with noise, zeros or another page (a misdirected write)."""
    data = bytearray(db.read_bytes())
    if kind == "bytes":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    else:
        pages = len(data) // PAGE
        start, other = rng.randrange(pages) * PAGE, rng.randrange(pages) * PAGE
        fill = {"zero page": bytes(PAGE), "noise page": rng.randbytes(PAGE),
                "copied page": bytes(data[other : other + PAGE])}[kind]
        data[start : start + PAGE] = fill
    db.write_bytes(bytes(data))


def _attempt(counts: Counter, action, check=None) -> None:
    """Run one operation and count its outcome: clear error, correct, wrong, or raw (any other exception)."""
    try:
        result = action()
    except CkptError:
        counts["clear error"] += 1
        return
    except Exception as exc:  # noqa: BLE001 - the outcome this test exists to catch
        counts["raw"] += 1
        counts[f"raw {type(exc).__name__}: {str(exc)[:80]}"] += 1
        return
    if check is None or check(result):
        counts["correct"] += 1
    else:
        counts["wrong"] += 1


def _trial(template, kind: str, seed: int, counts: Counter) -> None:
    root, expected = template
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        copy = Path(scratch)
        shutil.copytree(root / ".ckpt", copy / ".ckpt")
        _damage(copy / ".ckpt" / "ckpt.db", kind, random.Random(seed))
        try:
            repo = Repository.open(copy)
        except CkptError:
            counts["clear error"] += 1
            counts["trials refused at open"] += 1
            return
        except Exception as exc:  # noqa: BLE001
            counts["raw"] += 1
            counts[f"raw on open {type(exc).__name__}: {str(exc)[:80]}"] += 1
            return
        with repo:
            failed = counts["clear error"]
            for ref, state in expected.items():
                _attempt(counts, lambda ref=ref: repo.checkout(ref), lambda got, state=state: same(got, state))
            failed = counts["clear error"] > failed
            counts["trials with a restore refused" if failed else "trials restoring every ref bit-exact"] += 1
            # fsck names what is broken: a report that is not ok (or a clear error) wherever a restore failed
            # (--full: a damaged chunk checksum shows only when the chunk is decoded)
            _attempt(counts, lambda: fsck(repo), lambda report: True)
            _attempt(counts, lambda: fsck(repo, full=True), lambda report: not (failed and report.ok))


def test_damaged_database_never_restores_a_wrong_tensor(template):
    counts: Counter = Counter()

    @settings(max_examples=TRIALS, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
    def trial(kind: str, seed: int) -> None:
        counts["trials"] += 1
        before = counts["wrong"] + counts["raw"]
        _trial(template, kind, seed, counts)
        assert counts["wrong"] + counts["raw"] == before, (kind, seed, counts)

    torch.set_num_threads(1)
    trial()
    print(f"\ndatabase fuzz: {dict(sorted(counts.items()))}")
    assert counts["trials"] >= TRIALS and counts["wrong"] == 0 and counts["raw"] == 0


def test_json_columns_of_forged_nesting_are_damage_not_a_recursion_error(tmp_path):
    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"w": torch.randn(64)}, step=1)
    nested = "[" * 100_000 + "]" * 100_000
    with sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db") as conn:
        conn.execute("UPDATE tensors SET params = ?", (nested,))
    with Repository.open(tmp_path) as repo:
        report = fsck(repo)
        assert not report.ok and cid in report.broken_commits
    with sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db") as conn:
        conn.execute("UPDATE commits SET metrics = ?", (nested,))
    with Repository.open(tmp_path) as repo, pytest.warns(RuntimeWarning, match="metrics"):
        listed = repo.log()  # as `ckpt log`: the commit listed without its metrics, the damage warned of
    assert [c.id for c in listed] == [cid] and listed[0].metrics == {}

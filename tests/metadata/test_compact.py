"""Revision 0007: the same rows in far fewer bytes, and a repository written before it reads the same after."""

# SQLite only: WITHOUT ROWID and the file's bytes are SQLite's (PostgreSQL's round trip: test_postgres.py)
import contextlib
import sqlite3

import torch

from ckptstore import Repository
from ckptstore.metadata.db import HEAD_REVISION
from ckptstore.metadata.migrate import downgrade
from ckptstore.repo import fsck

TENSORS = 3000


def rows_and_bytes(db_path) -> tuple[dict, int]:
    """Row counts of the tables that grow with tensors, and the file's size once vacuumed."""
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as db:
        db.execute("VACUUM")
        counts = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                  for t in ("tensors", "tensor_chunks", "commit_tensors", "objects", "commits")}
        rows = {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall())
                for t in ("tensors", "tensor_chunks", "commit_tensors", "objects")}
    return {"counts": counts, "rows": rows}, db_path.stat().st_size


def test_compact_tables_keep_every_row_in_fewer_bytes(tmp_path):
    states = [{f"layer{i}.w": torch.randn(16, generator=torch.Generator().manual_seed(i + s)) for i in range(TENSORS)}
              for s in (0, 1)]
    with Repository.init(tmp_path) as repo:
        cids = [repo.commit(state, step=n) for n, state in enumerate(states)]
    db_path = tmp_path / ".ckpt" / "ckpt.db"
    url = f"sqlite:///{db_path}"
    new, new_bytes = rows_and_bytes(db_path)

    downgrade(url, "0006")  # the layout every repository had before
    old, old_bytes = rows_and_bytes(db_path)
    assert old == new
    assert new_bytes < 0.7 * old_bytes, (old_bytes / (2 * TENSORS), new_bytes / (2 * TENSORS))

    with Repository.open(tmp_path) as repo:  # upgrades again, keeping every row
        assert repo.db.revision() == HEAD_REVISION
        assert rows_and_bytes(db_path)[0] == old
        assert fsck(repo).ok
        for cid, state in zip(cids, states):
            back = repo.checkout(cid)
            assert all(back[k].view(torch.int32).equal(v.view(torch.int32)) for k, v in state.items())

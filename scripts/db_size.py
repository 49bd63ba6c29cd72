"""Metadata bytes per tensor: a commit of N tiny tensors, then one where every tensor changed.

Usage: PYTHONPATH=. python scripts/db_size.py [N [COMMITS]]   (default 50000 2; per-table bytes from dbstat)
"""

import os
import sqlite3
import sys
import tempfile
import time

import torch

from ckptstore import Repository

n = int(sys.argv[1]) if len(sys.argv) > 1 else 50000
commits = int(sys.argv[2]) if len(sys.argv) > 2 else 2
d = tempfile.mkdtemp()
torch.manual_seed(0)
state = {f"layer{i}.w": torch.randn(16) for i in range(n)}
with Repository.init(d) as repo:
    for step in range(1, commits + 1):
        t = time.time()
        repo.commit(state, message="tiny", step=step)
        print(f"commit {step}: {time.time() - t:.1f}s, database {os.path.getsize(repo.db.path)} B "
              f"(+ WAL {os.path.getsize(str(repo.db.path) + '-wal')} B)")
        state = {k: v + 0.01 for k, v in state.items()}
db = os.path.join(d, ".ckpt", "ckpt.db")
objs = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(d, ".ckpt", "objects"))
           for f in fs)
c = sqlite3.connect(db)
c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
size = os.path.getsize(db)
records = commits * n
print(f"db {size} B for {records} tensor records in {commits} commits ({size / records:.0f} B/tensor), "
      f"objects {objs} B")
for name, b in c.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name HAVING SUM(pgsize) > 8192 "
                         "ORDER BY 2 DESC"):
    print(f"  {name:40s} {b:>10} {b / records:8.1f} B/tensor")

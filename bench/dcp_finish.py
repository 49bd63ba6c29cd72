"""`python -m bench.dcp_finish [--entries N ...]`: the coordinator's serial tail of a sharded commit, at scale.

Every rank of a `dcp.save` waits while the coordinator records the commit (repo/sharded.py
`record_sharded`: the manifest with DCP's metadata, then one transaction inserting every new
tensor, chunk and object row and the commit). This times that step alone on a local repository
(SQLite) for N shard entries, each a one-chunk record of its own object, as the records of a
64-rank job would arrive (a 7B model with AdamW at 64 ranks: about 56,000 entries), from
records made up here: no tensor is encoded and no object is written.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ckptstore import Repository
from ckptstore.formats import dcpmeta
from ckptstore.hashing import ObjectId, TensorId
from ckptstore.records import Chunk, TensorRecord
from ckptstore.repo import sharded
from ckptstore.repo.commit import CommitOptions
from ckptstore.repo.manifest import Entry
from ckptstore.repo.target import start_now


def _shards(count: int, salt: int) -> tuple[list[sharded.WrittenShard], dict]:
    """`count` one-chunk shards of 1.5 MB (row shards of 3 x count/3 tensors) and DCP metadata naming them."""
    shards, items = [], []
    per_tensor = 64
    for t in range(count // per_tensor):
        chunks = []
        for r in range(per_tensor):
            key = dcpmeta.shard_key(f"model.layers.{t}.weight", [r * 96, 0], [96, 4096])
            tid = TensorId(f"{salt:08x}{t:08x}{r:08x}".ljust(64, "0"))
            oid = ObjectId(f"{salt:08x}{t:08x}{r:08x}".ljust(64, "1"))
            record = TensorRecord(tid, "torch.float32", (96, 4096), "bytegroup", {"chunk_bytes": 4194304}, None, 0,
                                  1572864, 1200000, [Chunk(oid, 1572864, 0, None, "0" * 16)])
            shards.append(sharded.WrittenShard(key, Entry(tid, "torch.float32", (96, 4096)), record,
                                               {oid: 1200000}, 1572864))
            chunks.append([[r * 96, 0], [96, 4096], key])
        items.append({"fqn": f"model.layers.{t}.weight", "type": "tensor", "dtype": "torch.float32",
                      "size": [96 * per_tensor, 4096], "layout": "torch.strided", "requires_grad": False,
                      "memory_format": "torch.contiguous_format", "pin_memory": False, "chunks": chunks})
    dcp = {"version": sharded.DCP_FORMAT_VERSION, "dcp_version": "1.0.0", "items": items, "planner_data": None,
           "storage_meta": None}
    return shards, dcp


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dcp_finish")
    parser.add_argument("--entries", type=int, nargs="+", default=[640, 6400, 56000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for i, count in enumerate(args.entries):
            with Repository.init(Path(tmp) / str(i)) as repo:
                shards, dcp = _shards(count, i)
                start = time.perf_counter()
                target, parent = start_now(repo, None)
                sharded.record_sharded(repo, target, parent, shards, dcp, CommitOptions(message="scale"))
                seconds = time.perf_counter() - start
                db = repo.db.size_on_disk()
                manifest = len(repo.store.get(repo.commit_info("HEAD").manifest_object))
            print(json.dumps({"entries": len(shards), "seconds": round(seconds, 3), "database_bytes": db,
                              "manifest_bytes": manifest}), flush=True)


if __name__ == "__main__":
    main()

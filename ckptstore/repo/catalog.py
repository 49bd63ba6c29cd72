"""Reading and writing tensor records and commit rows; the only place that maps rows to objects."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.dialects import postgresql, sqlite

from ckptstore.codecs.record import Chunk, TensorRecord
from ckptstore.errors import CkptError
from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.metadata.schema import commit_parents, commit_tensors, commits, objects, tensor_chunks, tensors

BATCH = 500


@dataclass
class CommitInfo:
    """One commit's row, with its parents in order."""

    id: CommitId
    manifest_object: ObjectId
    message: str
    author: str
    created_at: float
    step: int | None
    metrics: dict[str, Any]
    kind: str
    source_path: str | None
    raw_bytes: int
    stored_bytes: int
    parents: list[CommitId] = field(default_factory=list)
    lossy: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "parents": self.parents, "message": self.message, "author": self.author,
            "created_at": self.created_at, "step": self.step, "metrics": self.metrics, "kind": self.kind,
            "source_path": self.source_path, "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes,
            **({"lossy": self.lossy} if self.lossy else {}),
        }


def batches(items: list, size: int = BATCH) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def insert_ignore(conn: Connection, table, rows: list[dict]) -> None:
    """Insert rows, skipping those whose primary key exists (content-addressed rows never change)."""
    if not rows:
        return
    dialect = {"sqlite": sqlite, "postgresql": postgresql}.get(conn.dialect.name)
    for batch in batches(rows):
        if dialect is None:
            existing = set(conn.execute(select(*table.primary_key.columns)).all())
            batch = [r for r in batch if tuple(r[c.name] for c in table.primary_key.columns) not in existing]
            if batch:
                conn.execute(table.insert(), batch)
        else:
            conn.execute(dialect.insert(table).on_conflict_do_nothing(), batch)


_RECORD_SQL = ("SELECT id, dtype, shape, codec, params, base_id, depth, raw_bytes, stored_bytes "
               "FROM tensors WHERE id IN ({marks})")
_CHUNK_SQL = ('SELECT tensor_id, object_id, raw_bytes, "offset", length, checksum FROM tensor_chunks '
              "WHERE tensor_id IN ({marks}) ORDER BY tensor_id, position")


def load_records(conn: Connection, ids: Iterable[TensorId], with_bases: bool = True) -> dict[TensorId, TensorRecord]:
    """Records for `ids` and, with `with_bases`, every record down their chains.

    Every checkout starts here, so this is plain SQL on the driver's own cursor: through
    SQLAlchemy's statements, compiling them was 60% of it in a fresh process (bf16 benchmark
    checkpoint, 212 records: 7 ms -> 2.7 ms), and its result rows 15% of the rest. A
    checkpoint's tensors share a few shapes and coding params (that one: 12 and 9), so each
    distinct JSON text is parsed once.
    """
    found: dict[TensorId, TensorRecord] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    params: dict[str, dict[str, Any]] = {}
    if not conn.in_transaction():
        conn.begin()  # what SQLAlchemy's own first statement would do: one snapshot for every read
    cursor = conn.connection.driver_connection.cursor()
    pending = {i for i in ids if i}
    try:
        while pending:
            batch_ids, pending = list(pending), set()
            for batch in batches(batch_ids):
                rows, chunks = _read_rows(conn, cursor, batch)
                for tid, dtype, shape, codec, param_text, base_id, depth, raw_bytes, stored_bytes in rows:
                    if shape not in shapes:
                        shapes[shape] = tuple(json.loads(shape))
                    if param_text not in params:
                        params[param_text] = json.loads(param_text)
                    found[TensorId(tid)] = TensorRecord(
                        id=TensorId(tid), dtype=dtype, shape=shapes[shape], codec=codec,
                        params=dict(params[param_text]), base_id=TensorId(base_id) if base_id else None,
                        depth=depth, raw_bytes=raw_bytes, stored_bytes=stored_bytes, chunks=chunks.get(tid, []),
                    )
                    if with_bases and base_id and base_id not in found:
                        pending.add(TensorId(base_id))
    finally:
        cursor.close()
    return found


def _read_rows(conn: Connection, cursor, batch: list[TensorId]) -> tuple[list[tuple], dict[str, list[Chunk]]]:
    """The tensor rows of `batch` and their chunks in order, by tensor id."""
    marks = ", ".join(["?"] * len(batch))
    cursor.execute(_in_driver_style(conn, _RECORD_SQL.format(marks=marks)), batch)
    rows = cursor.fetchall()
    cursor.execute(_in_driver_style(conn, _CHUNK_SQL.format(marks=marks)), batch)
    chunks: dict[str, list[Chunk]] = {}
    for tensor, object_id, raw_bytes, offset, length, checksum in cursor.fetchall():
        chunks.setdefault(tensor, []).append(Chunk(ObjectId(object_id), raw_bytes, offset, length, checksum))
    return rows, chunks


def existing_tensor_ids(conn: Connection, ids: Iterable[TensorId]) -> set[TensorId]:
    present: set[TensorId] = set()
    for batch in batches(list(ids)):
        present.update(conn.execute(select(tensors.c.id).where(tensors.c.id.in_(batch))).scalars())
    return present


def insert_records(conn: Connection, records: list[TensorRecord], object_sizes: dict[ObjectId, int]) -> None:
    insert_ignore(conn, tensors, [{
        "id": r.id, "dtype": r.dtype, "shape": json.dumps(list(r.shape)), "codec": r.codec,
        "params": json.dumps(r.params, sort_keys=True), "base_id": r.base_id, "depth": r.depth,
        "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes,
    } for r in records])
    insert_ignore(conn, tensor_chunks, [
        {"tensor_id": r.id, "position": i, "object_id": c.object_id, "raw_bytes": c.raw_bytes,
         "offset": c.offset, "length": c.length, "checksum": c.checksum}
        for r in records for i, c in enumerate(r.chunks)
    ])
    insert_ignore(conn, objects, [{"id": oid, "size": size} for oid, size in object_sizes.items()])


def _info(row, parents: list[CommitId]) -> CommitInfo:
    return CommitInfo(
        id=CommitId(row.id), manifest_object=ObjectId(row.manifest_object), message=row.message,
        author=row.author, created_at=row.created_at, step=row.step, metrics=json.loads(row.metrics),
        kind=row.kind, source_path=row.source_path, raw_bytes=row.raw_bytes, stored_bytes=row.stored_bytes,
        parents=parents, lossy=row.lossy,
    )


def all_commits(conn: Connection) -> dict[CommitId, CommitInfo]:
    """Every commit, with parents, in one pass (repositories hold thousands, not millions)."""
    parents: dict[str, list[tuple[int, str]]] = {}
    for row in conn.execute(select(commit_parents)):
        parents.setdefault(row.commit_id, []).append((row.position, row.parent_id))
    return {
        CommitId(row.id): _info(row, [CommitId(p) for _, p in sorted(parents.get(row.id, []))])
        for row in conn.execute(select(commits))
    }


def driver_sql(conn: Connection, sql: str, params: tuple = ()):
    """Run `sql` through the database driver, "?" standing for each parameter.

    For the reads every checkout makes: SQLAlchemy compiles each statement the first time a process
    runs it, which in a process restarting after a crash cost more than the reads themselves.
    """
    return conn.exec_driver_sql(_in_driver_style(conn, sql), params)


def _in_driver_style(conn: Connection, sql: str) -> str:
    """`sql` with each "?" in the driver's own parameter style."""
    return sql if conn.dialect.paramstyle == "qmark" else sql.replace("?", "%s")


def manifest_object(conn: Connection, cid: CommitId) -> ObjectId:
    """The object holding commit `cid`'s manifest."""
    row = driver_sql(conn, "SELECT manifest_object FROM commits WHERE id = ?", (cid,)).first()
    if row is None:
        raise CkptError(f"metadata has no commit {cid}; run `ckpt fsck`")
    return ObjectId(row[0])


def commit_info(conn: Connection, cid: CommitId) -> CommitInfo:
    row = conn.execute(select(commits).where(commits.c.id == cid)).one()
    parent_rows = conn.execute(
        select(commit_parents.c.parent_id).where(commit_parents.c.commit_id == cid).order_by(commit_parents.c.position)
    ).scalars().all()
    return _info(row, [CommitId(p) for p in parent_rows])


def insert_commit(conn: Connection, info: CommitInfo, tensor_ids: Iterable[TensorId]) -> None:
    conn.execute(commits.insert().values(
        id=info.id, manifest_object=info.manifest_object, message=info.message, author=info.author,
        created_at=info.created_at, step=info.step, metrics=json.dumps(info.metrics, sort_keys=True),
        kind=info.kind, source_path=info.source_path, raw_bytes=info.raw_bytes, stored_bytes=info.stored_bytes,
        lossy=info.lossy,
    ))
    for position, parent in enumerate(info.parents):
        conn.execute(commit_parents.insert().values(commit_id=info.id, position=position, parent_id=parent))
    insert_ignore(conn, commit_tensors, [{"commit_id": info.id, "tensor_id": t} for t in set(tensor_ids)])

"""The metadata tables, as SQLAlchemy Core. Migrations own the schema; these mirror its head."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Index, Integer, MetaData, String, Table, Text, text

metadata = MetaData()
ID = String(64)

commits = Table(
    "commits", metadata,
    Column("id", ID, primary_key=True),
    Column("manifest_object", ID, nullable=False),
    Column("message", Text, nullable=False),
    Column("author", String(255), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("step", BigInteger),
    Column("metrics", Text, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("source_path", Text),
    Column("raw_bytes", BigInteger, nullable=False),
    Column("stored_bytes", BigInteger, nullable=False),
    Column("lossy", String(32)),
)

commit_parents = Table(
    "commit_parents", metadata,
    Column("commit_id", ID, primary_key=True),
    Column("position", Integer, primary_key=True),
    Column("parent_id", ID, nullable=False, index=True),
)

refs = Table(
    "refs", metadata,
    Column("name", String(255), primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("commit_id", ID),
    Column("target", String(255)),
)

tensors = Table(
    "tensors", metadata,
    Column("id", ID, primary_key=True),
    Column("dtype", String(64), nullable=False),
    Column("shape", Text, nullable=False),
    Column("codec", String(64), nullable=False),
    Column("params", Text, nullable=False),
    Column("base_id", ID),
    Column("depth", Integer, nullable=False),
    Column("raw_bytes", BigInteger, nullable=False),
    Column("stored_bytes", BigInteger, nullable=False),
    Index("ix_tensors_base_id", "base_id", sqlite_where=text("base_id IS NOT NULL"),
          postgresql_where=text("base_id IS NOT NULL")),
    sqlite_with_rowid=False,
)

tensor_chunks = Table(
    "tensor_chunks", metadata,
    Column("tensor_id", ID, primary_key=True),
    Column("position", Integer, primary_key=True),
    Column("object_id", ID, nullable=False),
    Column("raw_bytes", BigInteger, nullable=False),
    Column("offset", BigInteger, nullable=False, server_default="0"),
    Column("length", BigInteger),  # NULL: the whole object; else a range of a pack object
    Column("checksum", String(32)),  # xxh3-128 of the decoded chunk; NULL for chunks written before 0005
    sqlite_with_rowid=False,
)

objects = Table(
    "objects", metadata,
    Column("id", ID, primary_key=True),
    Column("size", BigInteger, nullable=False),
    sqlite_with_rowid=False,
)

commit_tensors = Table(
    "commit_tensors", metadata,
    Column("commit_id", ID, primary_key=True),
    Column("tensor_id", ID, primary_key=True),
    sqlite_with_rowid=False,
)

known_files = Table(
    "known_files", metadata,
    Column("digest", ID, primary_key=True),
    Column("commit_id", ID, primary_key=True, index=True),
    Column("size", BigInteger, nullable=False),
)

pruned_commits = Table(
    "pruned_commits", metadata,
    Column("commit_id", ID, primary_key=True),  # a commit `ckpt prune` removed: its row stays, its data went
    Column("pruned_at", Float, nullable=False),
    sqlite_with_rowid=False,
)

unchecked_tensors = Table(
    "unchecked_tensors", metadata,
    Column("tensor_id", ID, primary_key=True),  # a record received from elsewhere, not yet checked (repo/received.py)
    sqlite_with_rowid=False,
)

repository_identity = Table(
    "repository_identity", metadata,
    Column("id", String(32), primary_key=True),  # one random row: what an S3 prefix's owner.json names back
    sqlite_with_rowid=False,
)

gc_lease = Table(
    "gc_lease", metadata,
    Column("id", Integer, primary_key=True),  # one row (1): until when a gc's delete may land (repo/maintenance.py)
    Column("expires_at", Float, nullable=False),  # seconds since the epoch on the database's clock; 0: none
    sqlite_with_rowid=False,
)

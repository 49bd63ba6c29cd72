"""Compact metadata: tables keyed by text ids are WITHOUT ROWID; indexes only damage reports used go.

A table with a text primary key kept every id twice (the table, keyed by a hidden rowid, and the
primary key's index); 50,000 tiny tensors took about 1 KB of database each. The rebuilt tables
store each row once, in primary-key order. Two indexes served only the search for the commits a
damaged object breaks, which becomes a scan: `commit_tensors(tensor_id)` and
`tensor_chunks(object_id)`. `tensors(base_id)` is kept for residuals only (keyframes have none).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

ID = sa.String(64)


def _columns(table: str) -> list[sa.Column]:
    big = sa.BigInteger
    return {
        "tensors": [sa.Column("id", ID, primary_key=True), sa.Column("dtype", sa.String(64), nullable=False),
                    sa.Column("shape", sa.Text, nullable=False), sa.Column("codec", sa.String(64), nullable=False),
                    sa.Column("params", sa.Text, nullable=False), sa.Column("base_id", ID),
                    sa.Column("depth", sa.Integer, nullable=False), sa.Column("raw_bytes", big, nullable=False),
                    sa.Column("stored_bytes", big, nullable=False)],
        "tensor_chunks": [sa.Column("tensor_id", ID, primary_key=True), sa.Column("position", sa.Integer,
                                                                                   primary_key=True),
                          sa.Column("object_id", ID, nullable=False), sa.Column("raw_bytes", big, nullable=False),
                          sa.Column("offset", big, nullable=False, server_default="0"), sa.Column("length", big),
                          sa.Column("checksum", sa.String(32))],
        "commit_tensors": [sa.Column("commit_id", ID, primary_key=True), sa.Column("tensor_id", ID, primary_key=True)],
        "objects": [sa.Column("id", ID, primary_key=True), sa.Column("size", big, nullable=False)],
    }[table]


INDEXES = {"tensors": [("ix_tensors_base_id", "base_id", "base_id IS NOT NULL")]}
OLD_INDEXES = {"tensors": [("ix_tensors_base_id", "base_id", None)],
               "tensor_chunks": [("ix_tensor_chunks_object_id", "object_id", None)],
               "commit_tensors": [("ix_commit_tensors_tensor_id", "tensor_id", None)]}


def _rebuild(table: str, with_rowid: bool, indexes: dict) -> None:
    """Copy `table` into a new table of the same columns (WITHOUT ROWID unless `with_rowid`), then swap."""
    columns = _columns(table)
    names = ", ".join(f'"{c.name}"' for c in columns)
    op.create_table(f"{table}_new", *columns, sqlite_with_rowid=with_rowid)
    # in key order: pages fill completely instead of splitting at random
    keys = ", ".join(f'"{c.name}"' for c in columns if c.primary_key)
    op.execute(f"INSERT INTO {table}_new ({names}) SELECT {names} FROM {table} ORDER BY {keys}")
    op.drop_table(table)
    op.rename_table(f"{table}_new", table)
    _rename_key(f"{table}_new", table)
    for name, column, where in indexes.get(table, []):
        op.create_index(name, table, [column], sqlite_where=sa.text(where) if where else None,
                        postgresql_where=sa.text(where) if where else None)


def _rename_key(old: str, table: str) -> None:
    """PostgreSQL: the primary key keeps its name (`OLD_pkey`) through a table rename; the next rebuild needs it free.

    SQLite has no such name: nothing to do there.
    """
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT {old}_pkey TO {table}_pkey")


def upgrade() -> None:
    for table in ("tensors", "tensor_chunks", "commit_tensors", "objects"):
        _rebuild(table, False, INDEXES)


def downgrade() -> None:
    for table in ("tensors", "tensor_chunks", "commit_tensors", "objects"):
        _rebuild(table, True, OLD_INDEXES)

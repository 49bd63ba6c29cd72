"""The gc delete lease: until when a gc on a shared database may still have a delete of an object in flight.

A gc deletes garbage objects after its metadata transaction, confirming its repository lock before
each. A lock session that ended meanwhile (a server restart, an idle timeout) let a commit on another
machine take the lock, find an object present that gc was still deleting (a delete retried against a
throttling bucket lands up to a few minutes late), record it, and lose it. gc now sets this one row,
on its lock's own session, to the database's clock plus the longest a delete may take, before each
delete; whoever takes the repository lock while it is live waits it out first (metadata/db.py).

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "gc_lease",
        sa.Column("id", sa.Integer, primary_key=True),  # always 1: one lease per repository
        # seconds since the epoch on the DATABASE's clock (never a machine's); 0: none
        sa.Column("expires_at", sa.Float, nullable=False),
        sqlite_with_rowid=False,
    )
    op.bulk_insert(table, [{"id": 1, "expires_at": 0.0}])


def downgrade() -> None:
    op.drop_table("gc_lease")

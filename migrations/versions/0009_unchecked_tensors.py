"""Unchecked tensors: records received from another repository whose claim no commit here has checked yet.

fetch, pull, clone and a push into this repository copy tensor records as they are; a commit that
would reuse one decodes it and hashes it against its id first (repo/received.py). In the database,
not a file per machine: in a shared repository every machine's commits reuse every machine's
fetches. An upgraded repository lists every record it holds: the files' lists are not read.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "unchecked_tensors",
        sa.Column("tensor_id", sa.String(64), primary_key=True),
        sqlite_with_rowid=False,
    )
    # Before, each machine listed what it received in its own `.ckpt/received`, which no machine here
    # reads: every record is listed, so none is reused unchecked (each is decoded once, at its first reuse).
    op.execute("INSERT INTO unchecked_tensors (tensor_id) SELECT id FROM tensors")


def downgrade() -> None:
    op.drop_table("unchecked_tensors")

"""Unchecked tensors: records received from another repository whose claim no commit here has checked yet.

fetch, pull, clone and a push into this repository copy tensor records as they are; a commit that
would reuse one decodes it and hashes it against its id first (repo/received.py). In the database,
not a file per machine: in a shared repository every machine's commits reuse every machine's
fetches.

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


def downgrade() -> None:
    op.drop_table("unchecked_tensors")

"""Pruned commits: `ckpt prune` keeps a removed commit's row (its id, parents, message, metrics) and drops its data.

A commit id hashes its parents, so deleting a commit from the middle of a history would change the
id of every commit after it. A row here marks a commit whose manifest and tensors were removed:
`log` still shows it, `checkout` refuses it with an error saying so.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pruned_commits",
        sa.Column("commit_id", sa.String(64), primary_key=True),
        sa.Column("pruned_at", sa.Float, nullable=False),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("pruned_commits")

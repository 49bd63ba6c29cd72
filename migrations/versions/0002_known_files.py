"""Known file contents, so checkout can tell a stored checkpoint from unsaved work it would overwrite.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "known_files",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("commit_id", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("known_files")

"""Record which lossy level (if any) made each commit, so log and show can mark it.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("commits", sa.Column("lossy", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("commits") as batch:
        batch.drop_column("lossy")

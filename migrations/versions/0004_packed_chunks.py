"""Chunks may live inside a pack object: a byte range (offset, length) of it.

Small payloads of one commit are written together as one object, since creating a file costs
more than writing a few hundred kilobytes. NULL length means the chunk is the whole object.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tensor_chunks", sa.Column("offset", sa.BigInteger, nullable=False, server_default="0"))
    op.add_column("tensor_chunks", sa.Column("length", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tensor_chunks") as batch:
        batch.drop_column("length")
        batch.drop_column("offset")

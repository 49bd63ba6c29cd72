"""Each chunk records a fast checksum (xxh3-128) of its decoded bytes.

Checkout compares it right after replaying the chunk instead of hashing whole tensors with blake3
(the dominant cost of a lossless checkout). Chunks written before this revision have NULL and are
still verified against their tensor id.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tensor_chunks", sa.Column("checksum", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tensor_chunks") as batch:
        batch.drop_column("checksum")

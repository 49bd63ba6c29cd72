"""Initial schema: commits, parents, refs, tensors, chunks, objects.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.String(64)


def upgrade() -> None:
    op.create_table(
        "commits",
        sa.Column("id", ID, primary_key=True),
        sa.Column("manifest_object", ID, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("author", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("step", sa.BigInteger),
        sa.Column("metrics", sa.Text, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("source_path", sa.Text),
        sa.Column("raw_bytes", sa.BigInteger, nullable=False),
        sa.Column("stored_bytes", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "commit_parents",
        sa.Column("commit_id", ID, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("parent_id", ID, nullable=False, index=True),
    )
    op.create_table(
        "refs",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("commit_id", ID),
        sa.Column("target", sa.String(255)),
    )
    op.create_table(
        "tensors",
        sa.Column("id", ID, primary_key=True),
        sa.Column("dtype", sa.String(64), nullable=False),
        sa.Column("shape", sa.Text, nullable=False),
        sa.Column("codec", sa.String(64), nullable=False),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("base_id", ID, index=True),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("raw_bytes", sa.BigInteger, nullable=False),
        sa.Column("stored_bytes", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "tensor_chunks",
        sa.Column("tensor_id", ID, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("object_id", ID, nullable=False, index=True),
        sa.Column("raw_bytes", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "objects",
        sa.Column("id", ID, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "commit_tensors",
        sa.Column("commit_id", ID, primary_key=True),
        sa.Column("tensor_id", ID, primary_key=True, index=True),
    )


def downgrade() -> None:
    for table in ("commit_tensors", "objects", "tensor_chunks", "tensors", "refs", "commit_parents", "commits"):
        op.drop_table(table)

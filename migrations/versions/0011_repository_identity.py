"""Repository identity: a random id each database holds, which an S3 prefix's `owner.json` names back.

An object store on S3 is named by its URL alone: metadata joined with another repository's prefix (a
typo, or two repositories sharing a pretrained model's objects, so that the sampled objects were
there) called that repository's objects garbage, and `gc` deleted them. The prefix now names the
database it belongs to, and joins and deletions check it (repo/joining.py, repo/owner.py).

Revision ID: 0011
Revises: 0010
"""

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "repository_identity",
        sa.Column("id", sa.String(32), primary_key=True),
        sqlite_with_rowid=False,
    )
    op.bulk_insert(table, [{"id": uuid.uuid4().hex}])


def downgrade() -> None:
    op.drop_table("repository_identity")

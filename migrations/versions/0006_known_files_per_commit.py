"""Known files keyed by (digest, commit): every commit that holds a file's content is recorded.

Keyed by digest alone, only the first commit with a given file was recorded; once `gc --prune`
removed that commit, the content still held by later commits counted as unsaved.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _table(name: str, *key: str) -> None:
    op.create_table(
        name,
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("commit_id", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint(*key),
    )


def _rename_key(old: str) -> None:
    """PostgreSQL: the primary key keeps its name (`OLD_pkey`) through a table rename; give it the table's.

    SQLite has no such name: nothing to do there.
    """
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE known_files RENAME CONSTRAINT {old}_pkey TO known_files_pkey")


def upgrade() -> None:
    _table("known_files_new", "digest", "commit_id")
    op.execute("INSERT INTO known_files_new (digest, commit_id, size) SELECT digest, commit_id, size FROM known_files")
    op.drop_table("known_files")
    op.rename_table("known_files_new", "known_files")
    _rename_key("known_files_new")
    op.create_index("ix_known_files_commit_id", "known_files", ["commit_id"])


def downgrade() -> None:
    _table("known_files_old", "digest")
    op.execute("INSERT INTO known_files_old (digest, commit_id, size) "
               "SELECT digest, MIN(commit_id), MIN(size) FROM known_files GROUP BY digest")
    op.drop_table("known_files")
    op.rename_table("known_files_old", "known_files")
    _rename_key("known_files_old")

"""Store owners: gc and prune delete in a local object store only when its `<store>.owner` names them.

No table changes. The revision itself is the change: a ckptstore at 0009 knows no owner file, and its
gc or prune in a copy of a repository (`cp -a`, objects kept outside `.ckpt/`) deleted the objects of
the original's later commits. At 0010 such a ckptstore refuses the database ("written by a newer
ckptstore") instead of deleting in a store that is not its repository's.

Revision ID: 0010
Revises: 0009
"""

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass

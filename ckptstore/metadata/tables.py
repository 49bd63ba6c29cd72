"""The names of the metadata's tables: what a database must hold, and nothing else, to be ckptstore's.

Kept apart from schema.py so that opening a repository needs no SQLAlchemy import; a test keeps
the two in step.
"""

TABLES = ("alembic_version", "commits", "commit_parents", "refs", "tensors", "tensor_chunks", "objects",
          "commit_tensors", "known_files", "pruned_commits")

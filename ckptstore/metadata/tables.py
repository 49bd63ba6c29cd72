"""Every table the migrations create: what a database of ours holds (and `size_on_disk` adds up on a server).

Kept apart from schema.py so that opening a repository needs no SQLAlchemy import; a test keeps
the two in step.
"""

TABLES = ("alembic_version", "commits", "commit_parents", "refs", "tensors", "tensor_chunks", "objects",
          "commit_tensors", "known_files", "pruned_commits", "unchecked_tensors", "repository_identity",
          "gc_lease")
# tables a later revision added that only writers read: a database read where it cannot be upgraded may lack them
SINCE = {"repository_identity": "0011", "gc_lease": "0012"}

"""The repository: the verbs users call, built on the store, codecs, formats and metadata."""

from ckptstore.repo.maintenance import FsckReport, GcReport, fsck, gc
from ckptstore.repo.repository import Manifest, Repository, TensorDiff, find_root

__all__ = ["FsckReport", "GcReport", "Manifest", "Repository", "TensorDiff", "find_root", "fsck", "gc"]

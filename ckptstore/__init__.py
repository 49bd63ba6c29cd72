"""ckptstore: a git-like, content-addressed store for training checkpoints."""

from ckptstore.api import load, save
from ckptstore.errors import CkptError
from ckptstore.repo import Repository

__all__ = ["CkptError", "Repository", "load", "save"]
__version__ = "0.1.0"

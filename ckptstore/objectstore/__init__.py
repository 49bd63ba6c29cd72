"""Content-addressed object stores."""

from ckptstore.objectstore.base import ObjectStore
from ckptstore.objectstore.local import LocalObjectStore
from ckptstore.objectstore.memory import MemoryObjectStore

__all__ = ["LocalObjectStore", "MemoryObjectStore", "ObjectStore"]

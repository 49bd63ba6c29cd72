"""ckptstore: a git-like, content-addressed store for training checkpoints.

Imports are lazy: `import ckptstore` loads nothing heavy; `ckptstore.Repository`, `save` and
`load` load the repository layer on first use, and importing a codec never loads SQLAlchemy,
torch or the repository layer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CkptError", "Repository", "load", "save"]
__version__ = "0.1.0"

_WHERE = {"CkptError": "ckptstore.errors", "Repository": "ckptstore.repo", "load": "ckptstore.api",
          "save": "ckptstore.api"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ckptstore.signals import loading_held

    with loading_held(_WHERE[name]) as module:  # a handler that saves, landing mid-import, found it half-imported
        return getattr(module, name)

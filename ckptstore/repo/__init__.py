"""The repository layer: `Repository` and the verbs, one module each."""

from __future__ import annotations

from typing import Any

__all__ = ["LOSSY_LEVELS", "CommitOptions", "EncodingSettings", "FsckReport", "GcReport", "LossyOptions", "Manifest",
           "PruneReport", "Repository", "RetentionPolicy", "TensorDiff", "WatchOptions", "export", "export_format",
           "find_root", "named_root", "fsck", "check_knobs", "subject", "function_named", "gc", "prune", "keep_warm",
           "watch_folder", "log", "log_graph", "stats", "listed_refs", "remove_ref"]

_WHERE = {
    "Repository": "repository", "find_root": "location", "named_root": "location", "Manifest": "manifest",
    "TensorDiff": "diff",
    "CommitOptions": "commit", "LossyOptions": "commit", "check_knobs": "commit",
    "FsckReport": "maintenance", "GcReport": "maintenance",
    "fsck": "maintenance", "gc": "maintenance", "LOSSY_LEVELS": "config", "EncodingSettings": "config",
    "function_named": "calibrate", "export": "exporter", "export_format": "exporter", "WatchOptions": "watch",
    "watch_folder": "watch",
    "prune": "pruning", "keep_warm": "warm", "PruneReport": "pruning", "RetentionPolicy": "config",
    "subject": "history", "log": "history", "log_graph": "history", "stats": "history",  # cli: with `damage`
    "listed_refs": "refs", "remove_ref": "refs",
}


def __getattr__(name: str) -> Any:
    """Public names load their module on first use, so `import ckptstore.repo` costs nothing."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ckptstore.signals import loading_held

    with loading_held(f"{__name__}.{_WHERE[name]}") as module:  # as in ckptstore.__getattr__
        return getattr(module, name)

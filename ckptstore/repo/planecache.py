"""The byte planes of the tensors a commit just encoded, kept for the next commit's residuals.

A lossless residual XORs each byte plane with its base's, and the base is the same path in the
parent commit: in a training loop, the tensor this process encoded one commit ago. Rebuilding
it from the store (read its packs, verify them, entropy-decode its chain) cost about a third of
a residual commit's encoding work; the planes were in memory a moment before. The cache keeps
them, by tensor id and chunk, within a byte budget, and hands each out once (a base is needed by
one commit), so it holds about one checkpoint's planes between commits and no more. A miss (a
new process, an evicted entry, a base from an older commit) replays from the store as before;
the payloads are the same either way, since a tensor id names exactly these bytes.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ckptstore.hashing import TensorId
from ckptstore.repo.forked import ProcessLock

if TYPE_CHECKING:  # only attributes of the arrays are used: repository.py imports this without numpy
    import numpy as np

DEFAULT_BYTES = 512 << 20

# One cache per open Repository, kept beside it rather than on it (repository.py stays a thin
# holder); it goes when the Repository object does.
_CACHES: weakref.WeakKeyDictionary[Any, PlaneCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = ProcessLock()
# Repositories opened at these roots share one cache, whichever object opened them: a process that
# opens the repository for each command (the ckpt daemon) keeps the planes of its last commit.
_SHARED: dict[str, PlaneCache] = {}


def cache_of(repo: Any) -> PlaneCache:
    """The plane cache of `repo` (a Repository), made on first use."""
    with _CACHES_LOCK:
        cache = _CACHES.get(repo)
        if cache is None:
            shared = _SHARED.get(str(repo.root))
            cache = _CACHES[repo] = shared if shared is not None else PlaneCache()
        return cache


def share_plane_cache(root: Any) -> None:
    """From now on, every Repository opened at `root` (a resolved path) in this process shares one cache."""
    with _CACHES_LOCK:
        _SHARED.setdefault(str(root), PlaneCache())


def set_cache(repo: Any, cache: PlaneCache) -> None:
    """Give `repo` this cache (a smaller budget, or 0 to keep nothing)."""
    with _CACHES_LOCK:
        _CACHES[repo] = cache


class PlaneCache:
    """Grouped byte planes ((width, rows) uint8, read-only) by tensor id and the chunk's first byte.

    The chunk is named by where it starts, not by its index, so records of one tensor chunked at
    two sizes never mistake each other's chunks; `take` also checks the width and size.

    Entries put during one commit are the ones the next commit may take; `next_commit()`, called
    when a commit's encoding ends, drops what the commit before left untaken (a tensor that did
    not change, or that keyframes next) and makes this commit's entries the ones to take. Past
    the budget, the oldest entries go first.
    """

    def __init__(self, budget_bytes: int = DEFAULT_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._previous: OrderedDict[tuple[TensorId, int], np.ndarray] = OrderedDict()
        self._current: OrderedDict[tuple[TensorId, int], np.ndarray] = OrderedDict()
        self._held = 0
        self._lock = ProcessLock()

    def put(self, tensor: TensorId, start: int, planes: np.ndarray) -> None:
        """Keep `tensor`'s chunk at byte `start` as grouped planes (not copied: the caller must not change them)."""
        if planes.nbytes > self.budget_bytes:
            return
        planes.flags.writeable = False
        with self._lock:
            self._drop((tensor, start))
            self._current[(tensor, start)] = planes
            self._held += planes.nbytes
            while self._held > self.budget_bytes:
                _, evicted = (self._previous or self._current).popitem(last=False)
                self._held -= evicted.nbytes

    def take(self, tensor: TensorId, start: int, width: int, nbytes: int, keep: bool = False
             ) -> list[np.ndarray] | None:
        """The planes of `tensor`'s chunk at byte `start`, removed from the cache; None unless held with this layout.

        With `keep` they stay, for the next commit to take again (a base several commits code against).
        """
        with self._lock:
            planes = self._drop((tensor, start))
            if keep and planes is not None:
                self._current[(tensor, start)] = planes
                self._held += planes.nbytes
        if planes is None or planes.shape[0] != width or planes.nbytes != nbytes:
            return None
        return list(planes)

    def next_commit(self) -> None:
        """Drop the entries no commit took; the ones put since the last call become the ones to take."""
        with self._lock:
            self._held -= sum(p.nbytes for p in self._previous.values())
            self._previous, self._current = self._current, OrderedDict()

    @property
    def held_bytes(self) -> int:
        """Bytes of planes held now."""
        return self._held

    def _drop(self, key: tuple[TensorId, int]) -> np.ndarray | None:
        """Remove `key` from either generation (lock held); return its planes."""
        planes = self._previous.pop(key, None)
        if planes is None:
            planes = self._current.pop(key, None)
        if planes is not None:
            self._held -= planes.nbytes
        return planes

"""What hashing a tuple would cost, measured by a loop before anything hashes or recurses into it.

CPython 3.11 hashes a tuple by hashing each of its items, recursively and with no guard: a key of
tuples nested a million deep overflows the C stack (a segfault), and one that holds the same tuple
twice at each of sixty levels, only sixty deep, is hashed by visiting about 2**61 items (a hang).
`tuple_cost` measures both; the C walk over a pickle (_pickscan) counts the same for what it builds.
"""

from __future__ import annotations

from typing import Any

from ckptstore.errors import UnsupportedStateError

MAX_VISITS = 10**7  # items a hash of one key may visit: about a second of hashing, and past any real key


def tuple_cost(value: Any, depth_limit: int, visits_limit: int = MAX_VISITS) -> tuple[int, int]:
    """How deep tuples nest in `value` (0: none) and how many items hashing it visits (1 for a non-tuple).

    The depth is measured to `depth_limit` + 1 at most, the visits to `visits_limit` + 1 (a shared
    tuple counted each time it occurs, as the hash visits it); each distinct tuple is looked at once.
    """
    known: dict[int, tuple[int, int]] = {}  # id -> (nesting, visits) of each tuple measured; `value` keeps them alive
    frames = [[value, iter(value), 1, 1]] if isinstance(value, tuple) else []  # [tuple, items left, nesting, visits]
    while frames:
        frame = frames[-1]
        for item in frame[1]:
            if isinstance(item, tuple) and id(item) not in known:
                if len(frames) >= depth_limit:
                    return depth_limit + 1, frame[3]
                frames.append([item, iter(item), 1, 1])
                break
            nesting, visits = known.get(id(item), (0, 1))
            frame[2], frame[3] = max(frame[2], nesting + 1), frame[3] + visits
            if frame[3] > visits_limit:  # the tuples around it only add to it
                return max(len(frames), frame[2]), visits_limit + 1
        else:
            frames.pop()
            known[id(frame[0])] = frame[2], frame[3]
            if frames:
                parent = frames[-1]
                parent[2], parent[3] = max(parent[2], frame[2] + 1), min(parent[3] + frame[3], visits_limit + 1)
    return known.get(id(value), (0, 1))


def key_nesting(key: tuple, room: int, path: str) -> int:
    """`key`'s tuple nesting (to `room` + 1 at most), once refused where hashing it would visit too many items."""
    nesting, visits = tuple_cost(key, room)
    if nesting <= room and visits > MAX_VISITS:
        raise UnsupportedStateError(
            f"{path or '<root>'}: a dict key's tuples hold shared tuples so often that hashing it visits more than "
            f"{MAX_VISITS:,} items (a crafted key?); give the dict plainer keys")
    return nesting

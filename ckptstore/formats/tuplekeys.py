"""A tuple dict key as a skeleton gives it back, so the path flatten names it by is the one readers rebuild.

flatten stores a key's items as their base types (an IntEnum as an int, a namedtuple as a tuple, numpy's
str_ as a str), and select, diff and export name a value from the key as stored: naming it from the
original key's repr gave one tensor two paths.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def stored_tuple_key(key: tuple) -> tuple:
    """`key` with each item as the skeleton holds it; a plain tuple of plain items comes back equal, same repr."""
    return tuple(_stored_item(item) for item in key)


def _stored_item(item: Any) -> Any:
    """One item as state._ENCODERS stores it, in its order: str first, numpy scalars as themselves, then int, float."""
    if isinstance(item, tuple):
        return stored_tuple_key(item)
    if isinstance(item, str):
        return str.__str__(item)  # an exact str, whatever the subclass's __str__ says
    if item is None or isinstance(item, (bool, np.generic)):  # numpy's float64 is stored as one ("npscalar")
        return item
    if isinstance(item, int):
        return int.__int__(item)
    if isinstance(item, float):
        return float.__float__(item)
    return item

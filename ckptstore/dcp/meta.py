"""DCP's `Metadata` as the JSON of a sharded commit's manifest (ckptstore/formats/dcpmeta.py), version-checked."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ckptstore.errors import CorruptObjectError
from ckptstore.formats import dcpmeta
from ckptstore.repo.sharded import check_format


def from_json(data: dict[str, Any], manifest_oid: str) -> Metadata:
    """The `Metadata` that `to_json` described, from a `dcp` section of a version this ckptstore reads."""
    if not isinstance(data, dict):
        raise CorruptObjectError(manifest_oid, f"a manifest whose DCP metadata is not an object "
                                               f"({type(data).__name__})")
    check_format(data, f"manifest {manifest_oid}")
    return dcpmeta.from_json(data, manifest_oid)

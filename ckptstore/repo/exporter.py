"""`export`: one commit as one full state dict file (safetensors or torch.save), sharded commits gathered.

For a sharded (DCP) commit the shards of each logical tensor are put back together under its
fully qualified name; its non-tensor items are DCP's pickles, which ckptstore never unpickles, so
they are left out and named. An ordinary commit exports its tensors by path (safetensors) or its
whole state as checkout rebuilds it (torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError
from ckptstore.formats import safetensors_file, torchfile
from ckptstore.repo import sharded
from ckptstore.state import TORCH_PREFIX, RawTensor, materialize

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

FORMATS = ("safetensors", "torch")


@dataclass
class ExportReport:
    """What `export` wrote: the commit, how many tensors, and what it left out (with why)."""

    commit: str
    tensors: int
    skipped: list[str] = field(default_factory=list)
    why_skipped: str = ""


def export(repo: Repository, ref: str, fmt: str, output: str | os.PathLike) -> ExportReport:
    """Write the commit at `ref` to `output` as one file in `fmt` (safetensors or torch)."""
    if fmt not in FORMATS:
        raise CkptError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    cid = repo.resolve(ref)
    manifest = repo.manifest(cid)
    if sharded.is_sharded(manifest):
        tensors, skipped = sharded.gather(repo, manifest)
        why = "DCP stores non-tensor state as pickles, which ckptstore never unpickles"
    elif fmt == "torch":
        torchfile.save(repo.checkout(cid), output)
        return ExportReport(cid, len(manifest.entries))
    else:
        from ckptstore.repo.checkout import restore

        raws = restore(repo, manifest)
        tensors = {p: r for p, r in raws.items() if r.dtype in safetensors_file.SAFETENSORS_DTYPES}
        skipped = [p for p in raws if p not in tensors]
        why = "safetensors holds tensors only (these are file bytes, numpy arrays or unsupported dtypes)"
    if fmt == "safetensors":
        safetensors_file.write_tensors(output, tensors)
    else:
        torchfile.save({name: _torch(raw) for name, raw in tensors.items()}, output)
    return ExportReport(cid, len(tensors), skipped, why if skipped else "")


def _torch(raw: RawTensor) -> object:
    if not raw.dtype.startswith(TORCH_PREFIX):
        raise CkptError(f"a gathered tensor has dtype {raw.dtype}, not a torch dtype")
    return materialize(raw)

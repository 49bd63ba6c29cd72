"""`export`: one commit as one full state dict file (safetensors or torch.save), sharded commits gathered.

For a sharded (DCP) commit the shards of each logical tensor are put back together under its
fully qualified name; its non-tensor items are DCP's pickles, which ckptstore never unpickles, so
they are left out and named. A Hugging Face checkpoint folder exports its model weights only, under
their own names (formats/hfweights.py), so `from_pretrained` reads the file; `everything` (--all)
exports it like any other commit: its tensors under their key paths as written (safetensors) or its
whole state as checkout rebuilds it (torch).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptstore import formats
from ckptstore.errors import CkptError
from ckptstore.formats import hfweights, safetensors_file, torchfile
from ckptstore.formats.skeletons import check_headers
from ckptstore.repo import sharded, worktree
from ckptstore.repo.diff import format_own, skeleton_values
from ckptstore.repo.manifest import rebuilding_files
from ckptstore.repo.select import CONTAINERS, aliases, entries_of_file
from ckptstore.state import BYTES_DTYPE, TORCH_PREFIX, RawTensor, escape, materialize, readable_path

if TYPE_CHECKING:
    from ckptstore.formats import CheckpointFile
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.repository import Repository

FORMATS = ("safetensors", "torch")
WEIGHTS_ONLY = "a Hugging Face folder exports its model weights only, under their own names; --all exports every tensor"
NO_TORCH_DTYPE = "weights of a safetensors dtype torch has none for (F6_E2M3, say): a safetensors export keeps them"


@dataclass
class ExportReport:
    """What `export` wrote: the commit, how many tensors, what it left out (with why), and its lossy level."""

    commit: str
    tensors: int
    skipped: list[str] = field(default_factory=list)
    why_skipped: str = ""
    lossy: str | None = None  # the commit's level: its tensors are close to the originals, not equal


def export(repo: Repository, ref: str, fmt: str, output: str | os.PathLike, everything: bool = False
           ) -> ExportReport:
    """Write the commit at `ref` to `output` (replaced if it exists) as one file in `fmt` (safetensors or torch).

    A Hugging Face checkpoint folder gives its model weights only, unless `everything`.
    """
    if fmt not in FORMATS:
        raise CkptError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    cid = repo.resolve(ref)
    worktree.refuse_own_folders(repo, output)
    output = worktree.check_output_file(output)
    worktree.sweep_stale_temps([output])  # a killed export's file, as large as this one, an hour old
    manifest = repo.manifest(cid)
    weight_files = [] if everything or manifest.kind != "folder" else hfweights.weight_files(manifest.files)
    metadata, as_committed = None, {}
    if sharded.is_sharded(manifest):
        tensors, skipped = sharded.gather(repo, manifest)
        why = "DCP keeps non-tensor state as separate items: load them with dcp.load and CkptStorageReader"
    elif weight_files and fmt == "torch" and {record.format for record in weight_files} == {formats.TORCH}:
        with rebuilding_files(cid, manifest):
            state, skipped = _torch_weights(repo, manifest, weight_files)
        torchfile.save(state, output)
        return ExportReport(cid, len(state), skipped, WEIGHTS_ONLY if skipped else "", manifest.lossy)
    elif weight_files:
        with rebuilding_files(cid, manifest):
            tensors, odd, others, own, as_committed = _weights(repo, manifest, weight_files, fmt)
        metadata = {**own, "format": "pt"}  # transformers before 4.40 refuses a weights file without it
        skipped = odd + others
        why = "; ".join([*([WEIGHTS_ONLY] if others else []), *([NO_TORCH_DTYPE] if odd else [])])
    elif fmt == "torch":
        return _export_torch(repo, cid, manifest, output)
    else:
        from ckptstore.repo.checkout import restore

        raws = restore(repo, manifest)
        raws.update({path: raws[entry] for path, entry in aliases(manifest).items()})  # each tied key its copy
        lone = [record.format for record in manifest.files] == [formats.SAFETENSORS]
        if lone:  # its tensors of dtypes torch lacks are written back under their own
            header = raws[manifest.files[0].skeleton[1]]
            metadata, as_committed = safetensors_file.header_metadata(header), safetensors_file.header_dtypes(header)
        kept = {p: r for p, r in raws.items() if r.dtype in safetensors_file.SAFETENSORS_DTYPES
                or r.dtype == BYTES_DTYPE and not format_own(p) and readable_path(p) in as_committed}
        skipped = [p for p in raws if p not in kept and not format_own(p)]  # as `show` lists them, for --only
        skipped += _plain_values(manifest)
        tensors = _by_name(kept)
        why = ("safetensors holds tensors only (these are numbers, text, file bytes, numpy arrays or unsupported "
               "dtypes)")
    if fmt == "safetensors":
        safetensors_file.write_tensors(output, tensors, metadata, as_committed)
    else:
        torchfile.save({name: _torch(raw) for name, raw in tensors.items()}, output)
    return ExportReport(cid, len(tensors), skipped, why if skipped else "", manifest.lossy)


def _export_torch(repo: Repository, cid: str, manifest: Manifest, output: str | os.PathLike) -> ExportReport:
    """The commit's checkout as one torch.save file (what is not a Hugging Face folder's weights)."""
    state = repo.checkout(cid)
    # a safetensors file holds tensors only: bytes there are a dtype torch lacks, left out with why
    odd = []
    for record in manifest.files:
        tensors = state if manifest.kind != "folder" else state.get(record.name)
        if record.format == formats.SAFETENSORS and isinstance(tensors, dict):
            for name in [name for name, value in tensors.items() if isinstance(value, bytes)]:
                del tensors[name]
                odd.append(f"{record.name}/{name}" if manifest.kind == "folder" else name)
    torchfile.save(state, output)
    # a torch.save file's entries also hold its other records (bytes), and states numpy arrays; a tied key is
    # one entry but a tensor of the file written, as the safetensors export counts it
    torch_entries = {path for path, entry in manifest.entries.items() if entry.dtype.startswith(TORCH_PREFIX)}
    tied = sum(target in torch_entries for target in aliases(manifest).values())
    return ExportReport(cid, len(torch_entries) + tied, odd, NO_TORCH_DTYPE if odd else "", manifest.lossy)


def export_format(output: str | os.PathLike, given: str | None) -> str:
    """The export format: the one given; else torch for a torch.save name (.pt .pth .bin .ckpt), or safetensors."""
    if given is not None:
        return given
    return "torch" if os.path.splitext(output)[1].lower() in (".pt", ".pth", ".bin", ".ckpt") else "safetensors"


def _plain_values(manifest: Manifest) -> list[str]:
    """The paths of the values a state holds besides tensors (a step, a name, a dtype): left out, and said so.

    Not a module's `_metadata` (an OrderedDict attribute: versions load_state_dict reads) nor a file's own root
    node (a safetensors file's header layout).
    """
    roots = {record.name or "/" for record in manifest.files}
    return [path for path, value in skeleton_values(manifest).items()
            if value not in CONTAINERS and path not in roots and "%attrs" not in path.split("/")]


def _by_name(by_path: dict[str, RawTensor]) -> dict[str, RawTensor]:
    """Tensors under their keys' own text, so a safetensors file's names come back as they were.

    Where two paths would read alike, every tensor keeps its path (paths are distinct).
    """
    by_name = {readable_path(p): r for p, r in by_path.items()}
    return by_name if len(by_name) == len(by_path) else by_path


def _weights(repo: Repository, manifest: Manifest, files: list[CheckpointFile], fmt: str
             ) -> tuple[dict[str, RawTensor], list[str], list[str], dict[str, str], dict[str, tuple[str, list[int]]]]:
    """The weights in `files` by name (only their entries are decoded), those `fmt` cannot hold, the folder's others.

    With them, the weight files' own safetensors `__metadata__`, merged in file order, and the dtypes and
    shapes of their tensors torch has no dtype for (kept as bytes: a safetensors export writes them back).
    """
    raws = _decoded(repo, manifest, files)
    tensors: dict[str, RawTensor] = {}
    own: dict[str, str] = {}
    as_committed: dict[str, tuple[str, list[int]]] = {}
    for record in files:
        found = hfweights.weights(record, raws.__getitem__)
        if found is None:
            raise _not_flat(record)
        if record.format == formats.SAFETENSORS:
            own.update(safetensors_file.header_metadata(raws[record.skeleton[1]]) or {})
            dtypes = safetensors_file.header_dtypes(raws[record.skeleton[1]])
            as_committed.update((name, dtypes[name]) for name, raw in found.items()
                                if raw.dtype == BYTES_DTYPE and name in dtypes and fmt == "safetensors")
        tensors.update(found)
    odd = [name for name, raw in tensors.items()
           if raw.dtype not in safetensors_file.SAFETENSORS_DTYPES and name not in as_committed]
    kept = {name: raw for name, raw in tensors.items() if name not in odd}
    return kept, odd, _others(manifest, files), own, as_committed


def _torch_weights(repo: Repository, manifest: Manifest, files: list[CheckpointFile]
                   ) -> tuple[dict[str, Any], list[str]]:
    """A folder's torch weight files as one state dict, as torch.save wrote them; and the folder's other files.

    Tied weights share one storage, and the state dict's `_metadata` (its modules' versions) is kept.
    """
    raws = _decoded(repo, manifest, files)
    state: dict[str, Any] = OrderedDict()
    versions: dict[str, Any] = {}
    for record in files:
        found = hfweights.torch_state(record, raws.__getitem__)
        if found is None:
            raise _not_flat(record)
        state.update(found)
        versions.update(getattr(found, "_metadata", None) or {})
    if versions:
        state._metadata = versions  # type: ignore[attr-defined]  # as nn.Module.state_dict sets it
    return state, _others(manifest, files)


def _decoded(repo: Repository, manifest: Manifest, files: list[CheckpointFile]) -> dict[str, RawTensor]:
    """The entries of `files`, decoded (only theirs), each safetensors header checked against them as checkout does.

    A forged manifest's skeleton could name a header's tensors in another order: its weights would be exported
    under each other's names (MalformedSkeletonError, said by rebuilding_files as the commit's damage).
    """
    from ckptstore.repo.checkout import restore

    wanted = set().union(*(entries_of_file(manifest, escape(record.name)) for record in files))
    raws = restore(repo, manifest, paths=[p for p in manifest.entries if p in wanted])
    check_headers(files, manifest.entries.__getitem__, lambda p: raws[p].data.tobytes() if p in raws else None)
    return raws


def _not_flat(record: CheckpointFile) -> CkptError:
    return CkptError(f"{record.name} in this folder is no flat map of names to tensors (from_pretrained does not "
                     "read it either): export every tensor under its key path with --all")


def _others(manifest: Manifest, files: list[CheckpointFile]) -> list[str]:
    """The folder's files that are not `files`: left out of a weights export."""
    chosen = {record.name for record in files}
    return [record.name for record in manifest.files if record.name not in chosen]


def _torch(raw: RawTensor) -> object:
    if not raw.dtype.startswith(TORCH_PREFIX):
        raise CkptError(f"a gathered tensor has dtype {raw.dtype}, not a torch dtype")
    return materialize(raw)

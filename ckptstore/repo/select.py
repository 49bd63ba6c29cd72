"""Partial loads: the part of a commit whose logical paths match glob patterns (`keys=`, `--only`).

A pattern is a shell glob (`fnmatch`, case-sensitive) over the logical paths `ckpt show` lists,
in which "/" and "." both separate levels, so "model.*", "model/*" and "model" all select
everything under the state's "model" key, and "optimizer.state.*" every optimizer moment. A
pattern that names a container selects all of it; `*` also matches across levels. In a folder
commit the first level is the file's name: "model.safetensors", "optimizer.pt.state.*". A path as
`ckpt show` lists it selects that path alone, unfolded: "a.b" is not the key "a/b" ("a%2Fb") nor a
nested a -> b ("a/b").

Selecting prunes the manifest: each file's skeleton keeps only the matched values (and the
containers leading to them; a list keeps its matched items, in order), and the entries are only
those the kept values read, so checkout replays only their chains. A tensor that shares storage
with one left out still reads its own entry. An OrderedDict's attributes lie under
"<path>/%attrs/<name>": one selected alone comes back on its OrderedDict, emptied of items.
"""

from __future__ import annotations

import functools
import glob
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from ckptstore import formats
from ckptstore.errors import CkptError, MalformedSkeletonError
from ckptstore.formats import CheckpointFile
from ckptstore.formats.folder import set_mode
from ckptstore.repo.manifest import Manifest
from ckptstore.state import RawTensor, escape, join, join_key, readable_path, unflatten

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository
    from ckptstore.repo.worktree import CheckoutPlan

CONTAINERS = ("dict", "odict", "list", "tuple", "set", "frozenset")  # skeleton nodes holding others
LEAVES_WITH_ENTRY = ("tensor", "bytes", "bytearray", "ndarray")  # skeleton nodes naming a stored entry


class NothingSelectedError(CkptError):
    """No logical path of the commit matches the patterns given."""


def _level(text: str) -> str:
    """`text` with "." between levels; an escaped "/" (a folder's sub/file.pt) reads as one too."""
    return text.replace("%2F", "/").replace("/", ".")


@dataclass(frozen=True)
class KeyPatterns:
    """Glob patterns over logical paths; a path matches one itself or lies below what it names.

    `exact` patterns are paths as written: they select that path (and what lies below it) alone, with
    no folding of "/", "." and "%2F", so the keys "a.b" and "a/b" and a nested a -> b stay apart.
    """

    patterns: tuple[str, ...]
    exact: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.patterns or not all(isinstance(p, str) and p for p in self.patterns):
            raise CkptError(f"keys {list(self.patterns)!r}: give one or more non-empty patterns such as 'model.*'")

    def match(self, path: str) -> bool:
        """True when `path` (a logical path, or a container's path) is selected."""
        if not path:
            return False
        if any(path == p or path.startswith(p + "/") for p in self.exact):
            return True
        dotted = _level(path)
        return any(fnmatchcase(dotted, _level(p)) or fnmatchcase(dotted, _level(p) + ".*")
                   for p in self.patterns if p not in self.exact)


@dataclass
class Selection:
    """A commit pruned to the matched values: the manifest to restore, and which files are partial."""

    manifest: Manifest
    partial: set[str]  # names of the files that lost something: written anew, never byte for byte


def select(manifest: Manifest, keys: Iterable[str], commit: str = "") -> Selection:
    """`manifest` pruned to the values whose logical paths match `keys` (see the module docstring).

    Raises NothingSelectedError when nothing matches.
    """
    patterns = KeyPatterns(tuple(keys) if not isinstance(keys, str) else (keys,))
    try:  # skeletons walked as stored: one that no flatten wrote (a remote's forgery) is damage, not a crash
        wanted = _as_written(manifest, patterns)
        files, entries, partial = _selected_files(manifest, wanted)
    except MalformedSkeletonError.WALK_ERRORS as exc:
        raise MalformedSkeletonError.of(exc) from None
    if not files:
        own = [p for p in wanted.patterns if p in manifest.entries]  # copied from `ckpt show`, which lists them
        if own:
            yours = [k for k in (_as_key(p) for p in own) if k in manifest.entries]
            also = f" (your own key of that text is {', '.join(yours)}: select it so)" if yours else ""
            raise NothingSelectedError(f"{', '.join(own)} is the file format's own entry (its container or header "
                                       "bytes, which `ckpt show` lists beside the tensors), not a value of the "
                                       f"checkpoint{also}: select values, e.g. 'model.*', or check out the whole "
                                       "file")
        raise NothingSelectedError(f"no path of commit {commit[:12] or '(this commit)'} matches "
                                   f"{', '.join(wanted.patterns)}; `ckpt show {commit[:12] or 'REF'}` lists its "
                                   "paths (match them with '.' or '/' between levels, e.g. 'model.*')")
    pruned = replace(manifest, files=files, entries={p: e for p, e in manifest.entries.items() if p in entries},
                     digests={n: d for n, d in manifest.digests.items() if n not in partial},
                     empty_folders=[])  # files selected alone: the folders that hold none are no path of theirs
    return Selection(pruned, partial)


def _as_key(path: str) -> str:
    """A format's own entry's path (`f/%header`) as a user's key of the same text is stored (`f/%25header`)."""
    folder, _, last = path.rpartition("/")
    return f"{folder}/{escape(last)}" if folder else escape(last)


def _as_written(manifest: Manifest, wanted: KeyPatterns) -> KeyPatterns:
    """`wanted`, each pattern that names a path of `manifest` as written taken literally.

    A path copied from `ckpt show` selects itself alone, glob characters and all ("emb[1]", not "emb1"; "a.b",
    not the key "a/b" nor a nested a -> b); one that matches nothing as given but is a path's own text (a key
    "acc%" or "1", stored escaped as "acc%25" and "%31") selects that path. Other patterns fold separators.
    """
    stored = _prefixes(manifest.entries)  # cheap: most patterns name one of these
    entries = {_level(path) for path in stored}
    exact: set[str] = set()

    @functools.cache
    def readable() -> tuple[set[str], set[str], dict[str, str | None]]:  # every path, as stored and as read: made
        paths, found = _paths(manifest), {}  # only for a pattern that names no entry (walking every skeleton costs)
        for path in paths:
            key = _level(readable_path(path))
            found[key] = path if found.get(key, path) == path else None  # two paths reading alike: neither
        return paths, {_level(path) for path in paths}, found

    def literal(pattern: str) -> str:
        if pattern in stored or pattern in readable()[0]:  # a path as `ckpt show` lists it: that path alone
            exact.add(pattern)
            return pattern
        escaped = glob.escape(pattern)
        if escaped != pattern and _selected_files(manifest, KeyPatterns((escaped,)))[0]:
            return escaped  # the path as written first: "emb[1]" is that key, not a glob matching "emb1"
        if _level(pattern) in entries or _level(pattern) in readable()[1]:  # a path as stored: nothing to look up
            return pattern
        spelled = readable()[2].get(_level(pattern))
        if spelled and not _selected_files(manifest, KeyPatterns((pattern,)))[0]:
            exact.add(spelled)
            return spelled
        return pattern

    return KeyPatterns(tuple(map(literal, wanted.patterns)), frozenset(exact))


def _paths(manifest: Manifest) -> set[str]:
    """Every path of the commit and each level above it.

    Entries, a folder's files, and every value of a torch file's skeleton: tied tensors, and values that are
    no tensor (a step, a metric, None).
    """
    return _prefixes(manifest.entries) | {path for _, path in _skeleton_nodes(manifest) if path}


def _prefixes(paths: Iterable[str]) -> set[str]:
    """Each path and each level above it."""
    found = set()
    for path in paths:
        parts = path.split("/")
        found.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
    return found


def _selected_files(manifest: Manifest, wanted: KeyPatterns) -> tuple[list[CheckpointFile], set[str], set[str]]:
    """The files holding what `wanted` matches (pruned to it), the entries it reads, and the files that lost some."""
    files, entries, partial = [], set(), set()
    for record in manifest.files:
        root = escape(record.name) if manifest.kind == "folder" else ""
        if wanted.match(root):
            kept, used = record, entries_of_file(manifest, root)
        else:
            kept, used = _prune_file(record, root, wanted)
            if kept is None:
                continue
            partial.add(record.name)
        files.append(kept)
        entries |= used
    return files, entries, partial


def entries_of_file(manifest: Manifest, root: str) -> set[str]:
    """Every entry of the file whose paths start at `root` (all of them for a lone file)."""
    return {p for p in manifest.entries if not root or p.startswith(root + "/")}


def _prune_file(record: CheckpointFile, root: str, wanted: KeyPatterns) -> tuple[CheckpointFile | None, set[str]]:
    """The file with only its matched values (None when nothing matched), and the entries they read."""
    if record.format == formats.SAFETENSORS:
        order = [[name, entry] for name, entry in record.skeleton[2] if name is not None and wanted.match(entry)]
        skeleton = [record.skeleton[0], record.skeleton[1], order] if order else UNMATCHED
        used = {record.skeleton[1], *(entry for _, entry in order)}  # the header: its __metadata__ is kept
    elif record.format == formats.TORCH:
        skeleton = _Pruner(wanted).prune(record.skeleton, root)  # a matched value may be None (no scheduler)
        if skeleton is not UNMATCHED:
            skeleton = _carry_views(record.skeleton, skeleton)
        used = _entries_in(skeleton) if skeleton is not UNMATCHED else set()
    else:  # a blob is one entry: selected whole through its name (or its %blob path), or not at all
        skeleton = record.skeleton if wanted.match(record.skeleton[1]) else UNMATCHED
        used = {record.skeleton[1]}
    if skeleton is UNMATCHED:
        return None, set()
    return replace(record, skeleton=skeleton, container=None), used


UNMATCHED = object()  # what _Pruner.prune gives where nothing matched: None is a value a state holds


class _Pruner:
    """Walks a torch skeleton with the paths flatten gave its values, keeping what matches."""

    def __init__(self, wanted: KeyPatterns) -> None:
        self.wanted = wanted

    def prune(self, node: Any, path: str) -> Any:
        """`node` with only matched values, or UNMATCHED when nothing under it matched (a matched None is kept)."""
        if self.wanted.match(path):
            return node
        if not isinstance(node, list) or node[0] not in CONTAINERS:
            return UNMATCHED
        if node[0] in ("dict", "odict"):
            items = [[k, kept] for k, v in node[1]
                     if (kept := self.prune(v, item_path(path, k))) is not UNMATCHED]
            if items:
                return [node[0], items, *node[2:]]  # an odict keeps its attrs (module versions)
            attrs = [[name, kept] for name, v in _attrs(node)
                     if (kept := self.prune(v, attr_path(path, name))) is not UNMATCHED]
            return [node[0], [], {**node[2], "attrs": attrs}] if attrs else UNMATCHED  # only those selected
        items = [v for i, item in enumerate(node[1]) if (v := self.prune(item, join(path, str(i)))) is not UNMATCHED]
        return [node[0], items] if items else UNMATCHED


def _carry_views(whole: Any, pruned: Any) -> Any:
    """`pruned`, each tensor whose node placing it in a shared storage it dropped placed there by its first node kept.

    flatten writes a tensor's `view` on its first node only, a later reference to it being a bare
    ["tensor", path]; without this, keys ["same", "t"] of {"base": b, "same": b, "t": b.t()} read
    `same` standalone, no longer sharing `t`'s storage. Old commits are read the same way: no format change.
    """
    placed = {node[1]: node[2]["view"] for node, _ in _nodes_below(whole, "") if _has_view(node)}
    if placed:
        for node, _ in _nodes_below(pruned, ""):
            if _has_view(node):
                placed.pop(node[1], None)  # kept: it places the tensor itself
    return _with_views(pruned, placed) if placed else pruned


def _has_view(node: Any) -> bool:
    """True for a tensor node that places its tensor in a storage other views share (state.mark_shared_views)."""
    return (isinstance(node, list) and node[:1] == ["tensor"] and len(node) > 2 and isinstance(node[2], dict)
            and "view" in node[2])


def _with_views(node: Any, placed: dict[str, list]) -> Any:
    """`node` with the first reference to each tensor of `placed` given its view, copied where it changes.

    First in the order checkout decodes them (items, then an OrderedDict's attrs); `placed` loses those it gave.
    """
    if not placed or not isinstance(node, list) or not node or not isinstance(node[0], str):
        return node
    if node[0] == "tensor":
        view = placed.pop(node[1], None)
        return node if view is None else ["tensor", node[1], {**(node[2] if len(node) > 2 else {}), "view": view}]
    if node[0] in ("dict", "odict"):
        items = [[key, _with_views(value, placed)] for key, value in node[1]]
        attrs = _attrs(node)
        extras = [{**node[2], "attrs": [[name, _with_views(v, placed)] for name, v in attrs]}] if attrs else node[2:]
        return [node[0], items, *extras]
    if node[0] in CONTAINERS:
        return [node[0], [_with_views(item, placed) for item in node[1]]]
    return node


def aliases(manifest: Manifest) -> dict[str, str]:
    """The paths at which a torch file holds a tensor stored under another path, and that path.

    Tied weights (`head.weight` is `embed.weight`) are one entry in two places: the entries name
    the first only.
    """
    return {path: node[1] for node, path in _skeleton_nodes(manifest)
            if isinstance(node, list) and node and node[0] == "tensor" and node[1] != path}


def _skeleton_nodes(manifest: Manifest) -> Iterator[tuple[Any, str]]:
    """Every node of the commit's torch files' skeletons with the path flatten gave it."""
    for record in manifest.files:
        if record.format == formats.TORCH:
            yield from _nodes_below(record.skeleton, escape(record.name) if manifest.kind == "folder" else "")


def _nodes_below(skeleton: Any, root: str) -> Iterator[tuple[Any, str]]:
    """Every node of one torch skeleton with the path flatten gave it, `root` its own, in the order flatten met them."""
    stack = [(skeleton, root)]
    while stack:
        node, path = stack.pop()
        yield node, path
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            continue
        if node[0] in ("dict", "odict"):  # items, then an OrderedDict's attributes: pushed last to first
            stack.extend(reversed([*((v, item_path(path, k)) for k, v in node[1]),
                                   *((v, attr_path(path, name)) for name, v in _attrs(node))]))
        elif node[0] in CONTAINERS:
            stack.extend(reversed([(v, join(path, str(i))) for i, v in enumerate(node[1])]))


def respell_tuple_keys(manifest: Manifest) -> None:
    """Name the entries of tuple dict keys as flatten does now, where an older ckptstore named them by the key's repr.

    Before 65c1714 an IntEnum, namedtuple or str subclass in a tuple key gave `%tuple:(<E.A: 1>, 2)` while its
    skeleton holds the key as stored, `%tuple:(1, 2)`: show listed one path and diff, export and selection
    another, each tensor twice. Renamed in the manifest read (its stored bytes and id unchanged) where one
    path differs from the other in `%tuple:` parts alone; a tensor tied at two places takes the first's path, as
    flatten stored it there (the skeleton walked in flatten's order).
    """
    claims: dict[str, str] = {}
    try:
        nodes = list(_skeleton_nodes(manifest))
    except (MalformedSkeletonError, *MalformedSkeletonError.WALK_ERRORS):
        return  # damage: said where the skeleton is read
    rebuilt = {path for _, path in nodes}
    for node, path in nodes:
        if isinstance(node, list) and node and node[0] in LEAVES_WITH_ENTRY and isinstance(node[1], str) \
                and node[1] != path and node[1] not in rebuilt and path not in manifest.entries \
                and _respelled(node[1], path):
            claims.setdefault(node[1], path)  # the first place naming it: a later one is its tie
    renames = {old: new for old, new in claims.items() if old in manifest.entries}
    if not renames:
        return
    manifest.entries = {renames.get(path, path): entry for path, entry in manifest.entries.items()}
    manifest.measured = {renames.get(path, path): value for path, value in manifest.measured.items()}
    manifest.sources = {renames.get(path, path): value for path, value in manifest.sources.items()}
    for node, _ in nodes:
        if isinstance(node, list) and node and node[0] in LEAVES_WITH_ENTRY and node[1] in renames:
            node[1] = renames[node[1]]
    for record in manifest.files:
        for splice in (record.container or {}).get("splices", []):
            splice[2] = renames.get(splice[2], splice[2])


def _respelled(old: str, new: str) -> bool:
    """Whether two paths differ in `%tuple:` parts alone (one tuple key's two spellings)."""
    a, b = old.split("/"), new.split("/")
    return len(a) == len(b) and all(x == y or x.startswith("%tuple:") and y.startswith("%tuple:") for x, y in zip(a, b))


def item_path(path: str, key: Any) -> str:
    """The path flatten gave the dict item below `path` whose key the skeleton holds as `key` (a tuple's too)."""
    return join_key(path, unflatten(key, _no_lookup))


def attr_path(path: str, name: str) -> str:
    """The path flatten gave the attribute `name` of the OrderedDict at `path` (`ckpt show` lists it)."""
    return join(f"{path}/%attrs" if path else "%attrs", name)


def _attrs(node: list) -> list:
    """The [name, value] attributes of an OrderedDict's skeleton node (state_dict()._metadata); none for others."""
    extras = node[2] if node[0] == "odict" and len(node) > 2 and isinstance(node[2], dict) else {}
    return extras.get("attrs", [])


def _no_lookup(path: str) -> Any:
    raise MalformedSkeletonError(f"a dict key refers to stored data at {path!r:.200}")


def _entries_in(node: Any) -> set[str]:
    """The entries a pruned skeleton reads (attrs included)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list) and item and isinstance(item[0], str):
            if item[0] in LEAVES_WITH_ENTRY:
                found.add(item[1])
            elif item[0] in CONTAINERS:
                stack.extend(item[1] if item[0] not in ("dict", "odict") else [v for _, v in item[1]])
                if item[0] == "odict" and len(item) > 2:
                    stack.extend(v for _, v in item[2].get("attrs", []))
    return found


def write_selection(repo: Repository, selection: Selection, plan: CheckoutPlan,
                    value_of: Callable[[str], Any], raw_of: Callable[[str], RawTensor], exact: bool) -> None:
    """Write each selected file of `plan`: whole ones as checkout writes them, partial ones anew.

    A partial torch file becomes a torch.save of its selected state; a partial safetensors file a
    safetensors file of its selected tensors, in their committed order. Every file is written
    under a temporary name first, so a failure (a full disk) leaves the folder as it was, and
    nothing written there since the plan is replaced (as a full checkout refuses it); the renames
    into place are journalled (repo/journal.py; none in a read-only repository).
    """
    from ckptstore.formats.atomic import temp_beside
    from ckptstore.repo.worktree import (
        move_into_place,
        refuse_changed_meanwhile,
        refuse_folders_in_the_way,
        refuse_names_folded_together,
        staging_files,
        sweep_stale_temps,
    )

    refuse_folders_in_the_way(plan)
    refuse_names_folded_together(plan)
    sweep_stale_temps([target for _, target in plan.files])
    with staging_files() as staged:
        for record, target in plan.files:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging, handle = temp_beside(target, "new-")
            handle.close()
            staged.append((staging, target))
            if record.name not in selection.partial:
                formats.write_file(record, staging, value_of, raw_of, exact)
            elif record.format == formats.SAFETENSORS:
                from ckptstore.formats.safetensors_file import header_dtypes, header_metadata, write_tensors

                header = raw_of(record.skeleton[1])
                write_tensors(staging, {name: raw_of(entry) for name, entry in record.skeleton[2]},
                              header_metadata(header), header_dtypes(header))
            else:
                formats.write_file(record, staging, value_of, raw_of)
            if record.mode is not None:
                set_mode(staging, record.mode)
        refuse_changed_meanwhile(repo, plan)  # a -o plan has no extras: it deletes nothing
        move_into_place(None if repo.read_only else repo.dir, staged)

"""The work tree: checkpoint files on disk that commits came from and checkouts write to.

A file's content is known when some commit holds it (its blake3 digest is recorded), so a
checkout can refuse to overwrite or delete a file whose content would be lost. An in-place
folder checkout leaves exactly the commit's files (never touching the repository's .ckpt/ or
object store); one with -o only writes the commit's files and deletes nothing. No checkout
writes through a symlink that leads out of the destination; each file gets its permission bits.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ckptstore import faults
from ckptstore.errors import CkptError, CorruptRecordError, DirtyWorktreeError, listing, shown_name
from ckptstore.formats.atomic import missing_folder, missing_parent
from ckptstore.formats.filemap import file_digest
from ckptstore.formats.folder import LEADS_OUT, is_git_name, set_mode, unwritable_name
from ckptstore.hashing import CommitId
from ckptstore.metadata import files as file_rows
from ckptstore.repo import journal
from ckptstore.repo.location import REPO_DIR
from ckptstore.repo.repo_folders import is_repository_folder, nested_repositories, repository_part_holding

if TYPE_CHECKING:
    from ckptstore.formats import CheckpointFile
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.repository import Repository
    from ckptstore.state import RawTensor

SHOWN = 5  # paths an error lists before "and N more": the CLI prints one line


@dataclass
class CheckoutPlan:
    """What writing a commit to `dest` does: the files it writes, and what it removes first."""

    dest: Path
    files: list[tuple[CheckpointFile, Path]]
    extras: list[Path] = field(default_factory=list)  # files and links the commit does not have
    folders: list[Path] = field(default_factory=list)  # folders it does not have, deepest first
    made: list[Path] = field(default_factory=list)  # its folders that hold no file, made once the files are placed
    seen: dict[Path, tuple[int, ...] | None] = field(default_factory=dict)  # targets and extras as checked
    # the digest each file written must have (a lossless commit's files written byte for byte): a forged manifest
    # (a remote's: its hash is its own bytes') could rebuild other bytes, said to be the committed ones
    digests: dict[str, str] = field(default_factory=dict)


def plan_checkout(repo: Repository, manifest: Manifest, dest: Path, force: bool, output: bool, cid: str = ""
                  ) -> CheckoutPlan:
    """Check that writing `manifest` to `dest` is safe, and say what it will write and remove.

    `output`: `dest` was named with -o, so its parent folder must exist and nothing in it is
    deleted (only an in-place checkout makes a folder exact). Raises
    DirtyWorktreeError for files whose content is not in the store (unless `force`; `cid`, the
    commit, names a lossy one whose originals they are), CkptError for a destination the checkout
    cannot or must not write.
    """
    if output:
        _refuse_missing_parent(dest, folder=manifest.kind == "folder")
    if manifest.kind != "folder":
        if output:
            dest = regular_file(dest)
        else:
            refuse_special(dest)
        if dest.is_dir():
            raise CkptError(f"{dest} is a folder; this commit is one file: pass a file path" if output else
                            f"this commit was made from the file {dest}, which is now a folder: move the folder, "
                            "or write the commit elsewhere with -o PATH")
        inside = own_folder_holding(repo, dest)
        if inside is not None:  # a forged commit's (a remote's) path: commit never takes a file there
            raise CkptError(f"this commit's file would be written inside the repository's own {inside.name}/ (as "
                            f"{dest}): check it out elsewhere with -o PATH")
        other = None if output else repository_part_holding(dest)  # an -o path: refuse_own_folders looked at it
        if other is not None:  # the file's folder became another repository's since it was committed
            raise CkptError(f"this commit's file would be written inside {other}, another repository's own folder "
                            "or object store: write it elsewhere with -o PATH")
        plan = CheckoutPlan(dest, [(manifest.files[0], dest)])
    else:
        plan = _plan_folder(repo, manifest, dest, exact=not output)
    if not force:  # as they are before they are checked: write_checkout refuses if they change meanwhile
        plan.seen = {path: _signature(path) for path in [*(t for _, t in plan.files), *plan.extras]}
        unsaved = _unsaved(repo, [t for _, t in plan.files], plan.extras)
        if unsaved:
            raise DirtyWorktreeError(*_refusal(unsaved, _originals(manifest, plan, unsaved), cid, output))
    return plan


def _originals(manifest: Manifest, plan: CheckoutPlan, unsaved: list[tuple[str, Path]]) -> list[Path]:
    """The files in `unsaved` that the lossy commit `manifest` was made from, byte for byte (by digest)."""
    if not manifest.lossy:
        return []
    overwritten = {path for verb, path in unsaved if verb == "overwrite"}
    found = []
    for record, target in plan.files:
        digest = manifest.digests.get(record.name)
        if target in overwritten and digest:
            info = target.lstat()  # a FIFO would block the hash: only a regular file of the committed size
            if stat.S_ISREG(info.st_mode) and info.st_size == record.size and file_digest(str(target)) == digest:
                found.append(target)
    return found


def _refusal(unsaved: list[tuple[str, Path]], originals: list[Path], cid: str, output: bool) -> tuple[str, str]:
    """Why a checkout is refused, and what to do: committing a lossy commit's own originals again does nothing.

    `output`: the place was named with -o already, so the advice is another one.
    """
    others = [(verb, path) for verb, path in unsaved if path not in originals]
    said = [f"{_listed(others)}, whose content is not in the store"] if others else []
    if originals:
        said.append(f"overwrite {listing([str(p) for p in originals], SHOWN)}: the files lossy commit "
                    f"{cid[:12] or 'it'} was made from (resume from them directly)")
    elsewhere = "give -o another path" if output else "write elsewhere with -o PATH"
    advice = (f"commit it first, {elsewhere}, or pass --force" if others else
              f"{elsewhere}, or pass --force to write its lossy reconstruction over them")
    return f"checkout would {' and '.join(said)}", advice


def _refuse_missing_parent(dest: Path, folder: bool = False) -> None:
    problem = missing_folder(dest) if folder else missing_parent(dest)
    if problem:
        raise CkptError(problem)


def own_folder_holding(repo: Repository, path: str | os.PathLike) -> Path | None:
    """The repository's own folder (.ckpt/, or its object store kept elsewhere) that `path` lies in, if any."""
    return _holding(repo.own_folders(), Path(os.path.realpath(path)))


def _holding(folders: list[Path], real: Path) -> Path | None:
    """The first of `folders` that the resolved path `real` lies in, if any."""
    return next((folder for folder in folders if real.is_relative_to(folder)), None)


def refuse_own_folders(repo: Repository, output: str | os.PathLike) -> None:
    """Refuse an output path (-o) inside the repository's own .ckpt/ or object store: those files are the store's.

    Checked up front, as commit refuses a path there: nothing is written, even under --read-only.
    """
    own = own_folder_holding(repo, output)
    if own is not None:
        raise CkptError(f"{output} is inside the repository's own {own.name}/ folder: write it elsewhere")
    other = repository_part_holding(Path(output))
    if other is not None:  # a one-file or DCP output there overwrote that repository's database
        raise CkptError(f"{output} is inside {other}, another repository's own folder or object store: write it "
                        "elsewhere")


def check_output_file(output: str | os.PathLike) -> Path:
    """The file a one-file output path (-o) writes (see `regular_file`).

    Refused before any work if its folder is missing or it is a folder.
    """
    refuse_folder_spelling(output)
    dest = Path(output)
    _refuse_missing_parent(dest)
    if dest.is_dir():
        raise CkptError(f"{dest} is a folder: pass a file path")
    return regular_file(dest)


_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
            (stat.S_ISSOCK, "a socket"))


def regular_file(dest: Path) -> Path:
    """Where a one-file output (-o) to `dest` goes: the file a link leads to, not a file of its own in its place.

    A device, pipe or socket is refused (`refuse_special`).
    """
    refuse_special(dest)
    if not dest.is_symlink():
        return dest
    if _names_a_descriptor(dest):  # renamed over, /dev/stdout itself became a file (as root)
        raise CkptError(f"{dest} names an open descriptor, not a file: pass the path of a file to write")
    real = Path(os.path.realpath(dest))
    if not real.parent.is_dir():
        raise CkptError(f"{dest} is a symlink to {os.readlink(dest)}, whose folder {real.parent} does not exist; "
                        "create it first or pass another -o path")
    return real


def _names_a_descriptor(dest: Path) -> bool:
    """Whether `dest` leads through /proc (/dev/stdout, /dev/fd/N): a descriptor's link, not a file's name.

    Its "target" is whatever the shell opened, which a file written and renamed there would replace.
    """
    path = dest
    for _ in range(40):  # the kernel's own limit on links followed
        if os.path.realpath(path.parent).startswith("/proc/"):
            return True
        if not path.is_symlink():
            return False
        path = path.parent / os.readlink(path)  # an absolute target replaces the folder
    return True


def refuse_special(dest: Path) -> None:
    """Refuse to write one file at a device, pipe or socket.

    Written beside and renamed over, a device was replaced by a plain file (as root, /dev/null); a
    pipe's reader got nothing, and reading one to check it was saved hung.
    """
    try:
        mode = os.stat(dest).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet (or a link to nothing)
        mode = stat.S_IFREG
    except OSError as exc:  # a loop of links (ELOOP), a name too long
        raise CkptError(f"{dest} cannot be written: {exc.strerror}") from None
    kind = next((what for test, what in _SPECIAL if test(mode)), None)
    if kind is not None:
        raise CkptError(f"{dest} is {kind}, not a file: pass the path of a file to write")


def refuse_folder_spelling(output: str | os.PathLike) -> None:
    """Refuse a one-file output (-o) spelled as a folder (`out/`): Path drops the slash, and a file got that name."""
    if os.fspath(output).endswith(("/", os.sep)):
        raise CkptError(f"{os.fspath(output)} names a folder (it ends with a slash), and this writes one file: pass a "
                        "file path")


def _plan_folder(repo: Repository, manifest: Manifest, dest: Path, exact: bool) -> CheckoutPlan:
    """Check each of the commit's names; with `exact`, also list what to remove (the rest of `dest`)."""
    if dest.exists() and not dest.is_dir():
        raise CkptError(f"{dest} is not a folder; this commit is a folder: pass a folder path")
    real_dest, own = Path(os.path.realpath(dest)), repo.own_folders()
    plan = CheckoutPlan(dest, [])
    needed, written = {dest}, {}
    # per folder written into: another repository's part it lies in; dest's own looked up once, here in place
    # (an -o destination was, before any work, by refuse_own_folders)
    others: dict[Path, Path | None] = {dest: repository_part_holding(dest) if exact else None}
    for record in manifest.files:
        parts = _safe_parts(record.name)
        target = dest.joinpath(*parts)
        _refuse_links_out(target, dest, real_dest)
        # in place, links in the way are removed first; with -o they are followed, to where they lead
        real = real_dest.joinpath(*parts) if exact else Path(os.path.realpath(target.parent)) / target.name
        inside = _holding(own, real)
        if inside is not None:  # committed before commits left it out, or reached through a link
            raise CkptError(f"the commit holds {record.name}, which would be written inside the repository's own "
                            f"{inside.name}/ (as {real}): check it out elsewhere with -o PATH")
        if target.parent not in others:
            others[target.parent] = others[dest] or repository_part_holding(target.parent, below=dest)
        if others[target.parent] is not None:  # committed before commits left other repositories out
            raise CkptError(f"the commit holds {record.name}, which would be written inside {others[target.parent]}, "
                            "another repository's own folder or object store: write the checkout elsewhere")
        if written.setdefault(real, record.name) != record.name:
            raise CkptError(f"the commit's {written[real]} and {record.name} would both be written to {real} (a "
                            f"symlinked folder inside {dest}); remove the link or check out elsewhere with -o PATH")
        plan.files.append((record, target))
        needed.update(target.parents)
    _plan_empty_folders(repo, manifest, plan, real_dest, exact, needed)
    _refuse_a_file_that_is_a_folder(plan, needed)
    if exact and dest.is_dir():
        _scan(dest, {t for _, t in plan.files}, needed, _kept_in(repo, dest), plan)
    elif not exact:
        _refuse_files_in_the_way(plan, dest)
    return plan


def _safe_parts(name: str, what: str = "file") -> tuple[str, ...]:
    """The parts of a commit's file or folder name; refused where it leads out of the folder or into git's files."""
    why = unwritable_name(name)  # fsck's skeleton pass asks the same of every folder commit
    if why == LEADS_OUT:
        raise CkptError(f"the commit names a {what} {name!r} outside its folder; refusing to write it")
    if why is not None:  # a remote's commit could plant a config whose hooks run
        raise CkptError(f"the commit holds {name!r}, one of git's own files, whose config and hooks run "
                        "commands: ckptstore never writes them (commits leave .git out); check out the other "
                        "files with --only PATTERN")
    return PurePosixPath(name).parts


def _plan_empty_folders(repo: Repository, manifest: Manifest, plan: CheckoutPlan, real_dest: Path, exact: bool,
                        needed: set[Path]) -> None:
    """Add the commit's folders that hold no file to `plan.made`, refused as its files' names are.

    A trainer expects its `runs/` or an `optimizer/` placeholder; a manifest written before they were
    recorded lists none, and its checkout makes none, as before.
    """
    dest, files, own = plan.dest, {target for _, target in plan.files}, repo.own_folders()
    for name in manifest.empty_folders:
        target = dest.joinpath(*_safe_parts(name, "folder"))
        # with -o a link standing there would be followed (a checkout in place removes it, as for files)
        _refuse_links_out(target, dest, real_dest, itself=not exact)
        real = real_dest.joinpath(*target.relative_to(dest).parts) if exact else Path(os.path.realpath(target))
        inside = _holding(own, real)
        other = repository_part_holding(target, below=dest)
        if inside is not None or other is not None:
            where = f"the repository's own {inside.name}/" if inside else f"{other}, another repository's own folder"
            raise CkptError(f"the commit holds the folder {name}, which would be made inside {where}: check it out "
                            "elsewhere with -o PATH")
        clash = next((p for p in (target, *target.parents) if p in files), None)
        if clash is not None:
            raise CkptError(f"the commit names both a file {clash.relative_to(dest)} and a folder {name}, which no "
                            "folder can hold: it is damaged (or was made by another tool); nothing was written")
        plan.made.append(target)
        needed.update((target, *target.parents))


def _refuse_a_file_that_is_a_folder(plan: CheckoutPlan, needed: set[Path]) -> None:
    """Refuse, before anything is written, a commit naming a file and another inside it (`a` and `a/b`).

    No commit made here holds that, but a received one may: its checkout stopped midway, half written.
    """
    both = next((record.name for record, target in plan.files if target in needed), None)
    if both is not None:
        inside = next(record.name for record, _ in plan.files if record.name.startswith(both + "/"))
        raise CkptError(f"the commit names both a file {both} and a file {inside} inside it, which no folder can "
                        "hold: it is damaged (or was made by another tool); nothing was written")


BESIDE_LISTED = 100  # files_beside stops looking once it has found this many


def files_beside(plan: CheckoutPlan) -> list[str]:
    """Files in the plan's destination folder that it does not write (an -o checkout leaves them), relative.

    Other repositories' own folders are not looked into.
    """
    written, found = {target for _, target in plan.files}, []
    for folder, folders, files in os.walk(plan.dest):
        folders[:] = sorted(f for f in folders if f != REPO_DIR and not is_repository_folder(Path(folder, f)))
        found += [os.path.relpath(os.path.join(folder, name), plan.dest) for name in sorted(files)
                  if Path(folder, name) not in written]
        if len(found) >= BESIDE_LISTED:
            break
    return found


def _refuse_files_in_the_way(plan: CheckoutPlan, dest: Path) -> None:
    """With -o nothing is deleted: a file where the commit needs a folder is an error, not a loss."""
    needed = [*(target.parent for _, target in plan.files), *plan.made]
    for target in needed:
        for folder in (target, *target.parents):
            if folder.is_relative_to(dest) and folder != dest and os.path.lexists(folder) and not folder.is_dir():
                raise CkptError(f"{folder} is a file where the commit has a folder; move it away or check out "
                                "elsewhere with -o PATH")


def _refuse_links_out(target: Path, dest: Path, real_dest: Path, itself: bool = False) -> None:
    """Refuse a target reached through a symlinked folder that leads out of `dest` (`itself`: a folder to make)."""
    for folder in [*reversed(target.parents), *([target] if itself else [])]:
        if folder.is_relative_to(dest) and folder != dest and folder.is_symlink():
            real = Path(os.path.realpath(folder))
            if not real.is_relative_to(real_dest):
                raise CkptError(f"refusing to write {target}: {folder} is a symlink to {real}, outside {dest}; "
                                "remove the link or check out elsewhere with -o PATH")


def _scan(folder: Path, names: set[Path], needed: set[Path], kept: list[Path], plan: CheckoutPlan) -> None:
    """Collect what under `folder` the commit does not have, leaving out `kept` and git's; never follows a symlink."""
    with os.scandir(folder) as entries:
        listed = sorted(entries, key=lambda e: e.name)
    for entry in listed:
        path = Path(entry.path)
        if is_git_name(entry.name):
            continue  # a commit leaves git's files out (formats/folder.py): a checkout neither writes nor deletes them
        if (entry.is_symlink() or not entry.is_dir()) and Path(os.path.realpath(path)) in kept:
            continue  # the repository's own: a .ckpt linked in from another disk, the store's owner file
        if entry.is_dir(follow_symlinks=False):
            real = Path(os.path.realpath(path))
            if real in kept:
                continue  # the repository itself is never part of a checkout
            _scan(path, names, needed, kept, plan)
            if path not in needed and not any(k.is_relative_to(real) for k in kept):
                plan.folders.append(path)
        elif path not in names:
            plan.extras.append(path)


def _unsaved(repo: Repository, targets: list[Path], extras: list[Path]) -> list[tuple[str, Path]]:
    """("overwrite" or "delete", path) for each file whose content the store cannot give back.

    A symlink is replaced or removed without loss (its target is untouched); so is a leftover
    temporary file of an interrupted write. FIFOs, sockets and devices count as unsaved.
    """
    from ckptstore.formats.folder import is_temp_name

    with repo.db.read() as tx:
        sizes = file_rows.known_sizes(tx)
    digests, unsaved = {}, []
    for verb, paths in (("overwrite", targets), ("delete", extras)):
        for path in paths:
            try:
                info = path.lstat()
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISREG(info.st_mode) and not is_temp_name(path.name):
                if info.st_size in sizes:  # hash only what could be known: `-o` into a big folder stays quick
                    digests[path] = (verb, file_digest(str(path)))
                else:
                    unsaved.append((verb, path))
            elif not stat.S_ISREG(info.st_mode) and not stat.S_ISLNK(info.st_mode) and not stat.S_ISDIR(info.st_mode):
                unsaved.append((verb, path))
    with repo.db.read() as tx:
        known = file_rows.known_digests(tx, [d for _, d in digests.values()])
    unsaved += [(verb, path) for path, (verb, d) in digests.items() if d not in known]
    return sorted(unsaved, key=lambda item: str(item[1]))


def _listed(unsaved: list[tuple[str, Path]]) -> str:
    words = []
    for verb in ("overwrite", "delete"):
        paths = [str(p) for v, p in unsaved if v == verb]
        if paths:
            extra = " (not in the commit)" if verb == "delete" else ""
            words.append(f"{verb} {listing(paths, SHOWN)}{extra}")
    return " and ".join(words)


def write_checkout(repo: Repository, cid: CommitId, plan: CheckoutPlan, value_of: Callable[[str], Any],
                   raw_of: Callable[[str], RawTensor], exact: bool = False,
                   head: journal.HeadMove | None = None) -> None:
    """Write every file of the commit beside its target first, then remove what the commit lacks and rename.

    `exact`: the tensors are the committed ones (a lossless commit; formats.write_file). `head`:
    HEAD's move once the files are in place (a checkout in place; see journal.py).

    A failure while writing (a full disk) leaves the folder as it was, never one file of each
    commit; one after the renames began keeps their journal, for the next command to finish
    (staging_files). Each file's digest is recorded before it is renamed into place: another
    checkout that finds it there knows it.
    """
    refuse_folders_in_the_way(plan)
    refuse_names_folded_together(plan)
    sweep_stale_temps([target for _, target in plan.files])
    with staging_files() as staged:
        for record, target in plan.files:
            staged.append((_stage(repo, cid, record, target, value_of, raw_of, exact, plan.digests.get(record.name)),
                           target))
        refuse_changed_meanwhile(repo, plan)
        move_into_place(None if repo.read_only else repo.dir, staged, plan.extras, plan.folders, head, plan.made)


@contextlib.contextmanager
def staging_files() -> Iterator[list[tuple[Path, Path]]]:
    """A list for (staged file, its target) pairs, whose staged files are removed when the block ends.

    Not where a failure after the renames began kept their journal (journal.CheckoutInterruptedError): the
    next command finishes the checkout with them.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        yield staged
    except journal.CheckoutInterruptedError as exc:
        if exc.journal_kept:
            staged.clear()
        raise
    finally:
        for staging, _ in staged:
            staging.unlink(missing_ok=True)


def refuse_folders_in_the_way(plan: CheckoutPlan) -> None:
    """Refuse a folder (not one the checkout removes) standing where the commit has a file."""
    for _, target in plan.files:
        if target.is_dir() and not target.is_symlink() and target not in plan.folders:
            raise CkptError(f"{target} is a folder where the commit has a file; move it away and check out again")


def refuse_names_folded_together(plan: CheckoutPlan) -> None:
    """Refuse two of the commit's paths that the destination's file system takes for one (`A.pt` and `a.pt`).

    On a file system that ignores case or Unicode normalization (exFAT, FAT, macOS, Windows), the
    second file's rename replaced the first: one file lost, the checkout said whole. Looked at only
    where two paths fold together, by making one name there and looking for the other.
    """
    seen: dict[str, Path] = {}
    for _, target in plan.files:
        key = unicodedata.normalize("NFC", str(target)).casefold()
        other = seen.setdefault(key, target)
        if other != target and _one_name_there(other, target):
            raise CkptError(f"{shown_name(str(other))} and {shown_name(str(target))} would be one file on this file "
                            "system, which does not tell their names apart (case, or accents): nothing was written. "
                            "Check this commit out onto another file system, such as the machine's own disk")


def _one_name_there(a: Path, b: Path) -> bool:
    """Whether the file system where `a` and `b` differ first takes their differing names for one.

    Asked in a new folder of its own there, under the names themselves: a prefix could pass NAME_MAX.
    A name the file system refuses outright is no answer (False): writing it says so.
    """
    import shutil
    import tempfile

    first = next(i for i, (x, y) in enumerate(zip(a.parts, b.parts, strict=False)) if x != y)
    home = Path(*a.parts[:first])
    while not home.is_dir():
        home = home.parent
    try:
        probe = Path(tempfile.mkdtemp(prefix=".case-probe-", dir=home))
    except PermissionError as exc:  # the folder written into, not the probe, is what the user can act on
        raise PermissionError(exc.errno, exc.strerror, str(home)) from None
    try:
        (probe / a.parts[first]).touch()
        return (probe / b.parts[first]).exists()
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINVAL, errno.ENAMETOOLONG):  # refused names (run:1.pt on exFAT)
            return False
        raise
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def refuse_changed_meanwhile(repo: Repository, plan: CheckoutPlan) -> None:
    """Refuse to replace or delete a file written since the plan with content in no commit (a job saving).

    Another checkout's file (the store holds its content) is no loss: it is replaced.
    """
    changed = {path for path, seen in plan.seen.items() if _signature(path) != seen}
    unsaved = changed and _unsaved(repo, [t for _, t in plan.files if t in changed],
                                   [e for e in plan.extras if e in changed])
    if unsaved:
        raise DirtyWorktreeError(f"checkout would {_listed(unsaved)}, which changed while the checkout read the "
                                 "commit, to content that is not in the store; nothing was replaced or deleted",
                                 "commit it first to keep it, then check out again")


def move_into_place(journal_dir: Path | None, staged: list[tuple[Path, Path]], extras: Sequence[Path] = (),
                    folders: Iterable[Path] = (), head: journal.HeadMove | None = None,
                    made: Sequence[Path] = ()) -> None:
    """Delete `extras` (and `folders`, once empty), rename each staged file onto its target, make `made`, move `head`.

    `made`: the commit's folders that hold no file. Everything is synced before `head` moves.

    Journalled in `journal_dir` (repo/journal.py; None: a read-only repository, none): a process
    killed among these steps is finished by the next.
    """
    from ckptstore.formats.atomic import sync_dir

    with journal.renaming(journal_dir, staged, extras, head, made):
        for path in extras:
            path.unlink(missing_ok=True)
        for folder in folders:
            try:
                folder.rmdir()
            except OSError:  # something new appeared in it meanwhile: leave it rather than lose it
                pass
        for staging, target in staged:
            target.parent.mkdir(parents=True, exist_ok=True)  # where a file the commit lacks stood, maybe
            os.replace(staging, target)
            faults.point("checkout:renamed")
        for folder in made:
            folder.mkdir(parents=True, exist_ok=True)
        # durable before the journal goes
        for folder in {target.parent for _, target in staged} | {folder.parent for folder in made}:
            sync_dir(folder)


STALE_TEMP_S = 3600  # a temporary file this old beside a target was left by a checkout killed while writing it


def sweep_stale_temps(targets: list[Path]) -> int:
    """Remove the temporary files that killed checkouts of `targets` left beside them; returns how many.

    A checkout writes each file under a hidden temporary name beside it; `kill -9` while it writes
    leaves that file, as large as the checkpoint, and nothing else would ever remove it. Only files
    named as ckptstore names them, for these targets, untouched for an hour, are removed.
    """
    from ckptstore.formats.folder import is_temp_name

    stems: dict[Path, list[str]] = {}
    for target in targets:
        stems.setdefault(target.parent, []).append(target.name[:100])
    removed, cutoff = 0, time.time() - STALE_TEMP_S
    for folder, names in stems.items():
        prefixes = tuple(p for name in names for p in (f".{name}", f"..{name}"))  # ours, and an atomic write's in it
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(prefixes) and is_temp_name(entry.name):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
    return removed


def _signature(path: Path) -> tuple[int, ...] | None:
    """What tells a file changed: its size, mtime, inode and mode; None where nothing is."""
    try:
        info = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return info.st_size, info.st_mtime_ns, info.st_ino, info.st_mode


def _stage(repo: Repository, cid: CommitId, record: CheckpointFile, target: Path, value_of: Callable[[str], Any],
           raw_of: Callable[[str], RawTensor], exact: bool = False, expected: str | None = None) -> Path:
    """Write `record` under a temporary name beside `target`, with its digest recorded and its mode set.

    `expected`: the digest the file must have (CorruptRecordError, nothing kept, where it has not).
    """
    from ckptstore import formats
    from ckptstore.formats.atomic import temp_beside

    home = target.parent  # beside the target, or in the nearest folder above it that exists already
    while not home.is_dir():
        home = home.parent
    staging, handle = temp_beside(home / target.name, "new-")
    handle.close()
    try:
        formats.write_file(record, staging, value_of, raw_of, exact)
        faults.point("checkout:staged")  # tests stop a checkout here, its temporary file whole
        digest = file_digest(str(staging)) if expected is not None or not repo.read_only else None
        if expected is not None and digest != expected:
            raise CorruptRecordError(f"file {record.name or target.name} of commit {cid[:12]}", "the manifest rebuilds "
                                     "it into bytes that do not hash to the digest it records; nothing was written")
        if not repo.read_only:  # a read-only repository records nothing (checkout -o still works)
            with repo.db.write() as tx:
                file_rows.remember(tx, [(digest, cid, staging.stat().st_size)])
        if record.mode is not None:  # after hashing: a mode may deny reading
            set_mode(staging, record.mode)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return staging


def committed_from(repo: Repository, cid: CommitId, source_path: str, writing: bool = True) -> Path:
    """Where the files commit `cid` was made from lie here: inside the work tree, or the absolute path committed.

    A commit records a path inside the work tree relative to its root, never with "..": one that
    climbs out was forged (a hostile remote's), and is refused. A checkout in place (`writing`) of
    files committed from outside the work tree (an absolute path) writes there unless the commit
    came by fetch, pull or clone (see `remember_fetched`): then the path is one another machine
    chose, and the commit is written with -o.
    """
    path = PurePosixPath(source_path)
    if "\0" in source_path or not path.is_absolute() and ".." in path.parts:
        raise CkptError(f"commit {cid[:12]} names its files as {source_path!r}, outside this work tree: it was not "
                        "made by ckptstore here; write it elsewhere with -o PATH")
    if writing and any(is_git_name(part) for part in path.parts):  # git's own files: hooks run on checkout
        raise CkptError(f"commit {cid[:12]} names its files as {source_path!r}, inside a .git folder, where a "
                        "checkpoint never lies: it was forged; write it elsewhere with -o PATH")
    if writing and path.is_absolute() and not Path(path).is_relative_to(repo.root) and (
            repo.config.metadata_url or cid in fetched(repo.dir)):
        # a shared database holds every machine's commits (and fetches) alike: none is known to be this one's
        rule = ("in a shared repository, where any machine's commit may name any path, a checkout in place "
                "writes no file outside the work tree" if repo.config.metadata_url else
                "it came from another repository, and a checkout in place writes there only commits made here")
        raise CkptError(f"commit {cid[:12]} was made from {source_path}, outside this work tree: {rule}; write it "
                        "with -o PATH")
    return repo.root / path


FETCHED = "fetched"  # .ckpt/fetched: commits of files outside the work tree that came from another repository


def remember_fetched(repo_dir: Path, cids: Iterable[str]) -> None:
    """Add `cids` (commits received from another repository) to this machine's list of them.

    A local file, not the metadata: a shared database holds every machine's commits alike, and
    nothing else would tell a commit made here from one received (`-o` writes the same digests).
    """
    with open(repo_dir / FETCHED, "a") as handle:
        handle.write("".join(f"{cid}\n" for cid in cids))
        handle.flush()
        os.fsync(handle.fileno())


def fetched(repo_dir: Path) -> set[str]:
    """The commits `remember_fetched` listed here."""
    try:
        return set((repo_dir / FETCHED).read_text().split())
    except (FileNotFoundError, NotADirectoryError):
        return set()


def status(repo: Repository) -> dict[str, Any]:
    """HEAD, and whether the files HEAD was committed from still hold its content."""
    from ckptstore import formats

    branch, head = repo.head()
    report: dict[str, Any] = {"branch": branch, "head": head, "files": []}
    if head is None:
        return report
    info = repo.commit_info(head)
    if info.source_path is None:
        return report
    manifest = repo.read_manifest(info.manifest_object)
    base = committed_from(repo, head, info.source_path, writing=False)
    paths = [formats.destination(manifest.kind, record, base) for record in manifest.files]
    for record, path in zip(manifest.files, paths, strict=True):
        state, source = _file_state(repo, path, manifest.digests.get(record.name), head)
        item = {"path": _relative(repo, path), "state": state}
        if source and info.lossy:  # still the source: the only copy of what the level did not keep
            item["note"] = f"committed at lossy level {info.lossy}: HEAD may restore only an approximation of it"
        report["files"].append(item)
    if manifest.kind == "folder" and base.is_dir():  # what a checkout in place deletes, or refuses to
        report["files"] += [{"path": _relative(repo, p), "state": "untracked"} for p in _untracked(repo, base, paths)]
        report["files"] += _empty_folder_states(repo, manifest.empty_folders, base)
    return report


def _empty_folder_states(repo: Repository, committed: list[str], base: Path) -> list[dict[str, str]]:
    """The commit's folders that hold no file and are gone ("missing"), and such folders it lacks ("untracked").

    A commit records them: status said "unchanged" of a folder whose `runs/` was removed, and commit then
    recorded a change.
    """
    from ckptstore.errors import CheckpointFormatError
    from ckptstore.formats.folder import folder_listing

    try:  # the listing a commit of the folder would make (a .git left out is a commit's to warn of)
        now = folder_listing(base, _kept_in(repo, base), quiet=True).empty_folders
    except (CheckpointFormatError, OSError):  # a link out, a FIFO: commit says so; status lists the rest
        now = committed
    states = {name: "missing" for name in committed if not base.joinpath(*PurePosixPath(name).parts).is_dir()}
    states.update({name: "untracked" for name in now if name not in committed})
    return [{"path": _relative(repo, base.joinpath(*PurePosixPath(name).parts)) + "/", "state": state}
            for name, state in sorted(states.items())]


def _relative(repo: Repository, path: Path) -> str:
    return str(path.relative_to(repo.root)) if path.is_relative_to(repo.root) else str(path)


def _untracked(repo: Repository, folder: Path, committed: list[Path]) -> list[Path]:
    """The files in a committed `folder` that its commit does not hold (the repository's own left out)."""
    plan = CheckoutPlan(folder, [])
    _scan(folder, set(committed), {folder, *(p for path in committed for p in path.parents)}, _kept_in(repo, folder),
          plan)
    return plan.extras


def _kept_in(repo: Repository, folder: Path) -> list[Path]:
    """What under `folder` is no part of a checkout: the repository's own folders and other repositories, resolved."""
    own = repo.own_folders()
    return [*own, *(Path(os.path.realpath(p)) for p in nested_repositories(folder, own))]


def _file_state(repo: Repository, path: Path, committed: str | None, head: CommitId) -> tuple[str, bool]:
    """The file's state against HEAD, and whether it still holds the very bytes HEAD was committed from."""
    try:
        if not path.is_file():
            return "missing", False
        digest = file_digest(str(path))
    except PermissionError:  # restored with its committed mode 000 (or in a folder of it): said, the rest listed
        return "unreadable (permission denied)", False
    if digest == committed:
        return "unchanged", True
    with repo.db.read() as tx:
        known = file_rows.commits_of_digest(tx, digest)
    if head in known:
        return "unchanged", False
    return (f"modified (content of {known[0][:12]})" if known else "modified"), False

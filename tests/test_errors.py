"""Messages that name long lists stay short."""

from ckptstore.errors import REASONS_SHOWN, listing, shown_name, with_reasons


def test_a_warning_over_hundreds_of_unquantizable_tensors_names_a_few_and_counts_the_rest():
    reasons = {f"model/layer{i:03d}.weight": "too wide" for i in range(300)}
    text = with_reasons(reasons)
    assert text.count("too wide") == REASONS_SHOWN
    assert text.startswith("model/layer000.weight: too wide; model/layer001.weight")
    assert text.endswith(f" and {300 - REASONS_SHOWN} more")


def test_a_short_list_is_named_whole_without_a_count():
    assert with_reasons({"b": "y", "a": "x"}) == "a: x; b: y"
    assert listing(["a", "b"], 2) == "a, b"


def test_a_name_is_shown_on_one_line_and_a_written_out_newline_is_told_from_a_backslash_and_an_n():
    assert shown_name("a\nb") == "a\\nb"
    assert shown_name("a\\nb") == "a\\\\nb"  # a backslash, then n: no newline
    assert shown_name("r\udce9sum\udce9.pt") == "r\\xe9sum\\xe9.pt"  # os.fsdecode's bytes that are not UTF-8
    assert shown_name("lone\ud800") == "lone\\ud800"


def test_a_file_system_out_of_inodes_is_told_from_one_out_of_bytes(tmp_path, monkeypatch):
    """With bytes free and no inode left, every message said "the disk is full: free some space" (auditor)."""
    import errno
    import os

    from ckptstore.errors import explain

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "objects" / "ab" / "cd"))
    assert "the disk is full" in str(explain(full))
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096,) * 5 + (64, 0, 0, 0, 255))
                        if os.fspath(path) == str(tmp_path) else statvfs(path))
    said = str(explain(full))
    assert said.startswith(f"the file system holding {tmp_path} can make no more files (its inodes are used up: "
                           f"`df -i {tmp_path}`)") and "Remove files there" in said, said


def test_a_name_the_file_system_refuses_is_named_not_its_folder(tmp_path):
    """exFAT refused `run:1.txt` (ENOENT through FUSE, EINVAL in the kernel): the message blamed its folder."""
    import errno

    from ckptstore.errors import explain

    for code in (errno.ENOENT, errno.EINVAL):
        refused = OSError(code, "refused", str(tmp_path / ".run:1.txt.new-0123456789abcdef.ckpt-tmp"))
        said = str(explain(refused))
        assert said.startswith(f"the file system of {tmp_path} does not accept the name 'run:1.txt'"), said
    gone = FileNotFoundError(errno.ENOENT, "gone", str(tmp_path / "gone" / ".a.pt.0123456789abcdef.ckpt-tmp"))
    assert str(explain(gone)).startswith(f"cannot make a file in {tmp_path / 'gone'} (a folder where files cannot")
    for ordinary in ("a.pt", "model."):  # refused in /proc, say: a final dot is refused only at the rename (reader 15)
        special = FileNotFoundError(errno.ENOENT, "no", str(tmp_path / f".{ordinary}.0123456789abcdef.ckpt-tmp"))
        assert str(explain(special)).startswith(f"cannot make a file in {tmp_path} (a folder where files cannot")
    name = "model\tfinal.pt"  # a control character
    tab = OSError(errno.EINVAL, "refused", str(tmp_path / f".{name}.0123456789abcdef.ckpt-tmp"))
    assert str(explain(tab)).startswith(f"the file system of {tmp_path} does not accept the name {name!r}")


def test_a_name_shown_outside_the_cli_has_its_control_characters_written_out():
    """Library warnings name files with shown_name alone: an ESC in a name reached the terminal (code reviewer)."""
    assert shown_name("a\x1b]0;owned\x07b\r\n\\c\td") == "a\\x1b]0;owned\\x07b\\x0d\\n\\\\c\td"


def test_a_damaged_object_says_which_commits_are_unaffected_without_promising_every_other_one():
    """"other commits are unaffected" was said where every commit needed the object (shared-repository auditor)."""
    from ckptstore.errors import CorruptObjectError

    said = str(CorruptObjectError("ab" * 32, "missing", ["cd" * 32]))
    assert "needed by commits cdcdcdcdcdcd" in said and "commits that need no damaged object are unaffected" in said
    assert "other commits are unaffected" not in said


def test_a_damaged_record_named_with_its_commits_keeps_what_it_says_was_done():
    """`needed_by` dropped the outcome: a false received record's 'fsck --full decodes every record' became the
    generic advice to run plain fsck, which says ok (reader 31)."""
    from ckptstore.errors import CorruptRecordError

    named = CorruptRecordError("tensor t", "it lies", tensors=["t"], outcome="Nothing was restored (see fsck --full)")
    assert str(named.needed_by(["c" * 64])) == (f"the metadata of tensor t is damaged: it lies; needed by commits "
                                                f"{'c' * 12}. Nothing was restored (see fsck --full); run `ckpt fsck` "
                                                "to list all damage")


def _every_error_class() -> list[type]:
    """CkptError and every subclass ckptstore defines (in errors.py, and the few beside the code raising them)."""
    import ckptstore.daemon
    import ckptstore.repo.journal
    import ckptstore.repo.manifest
    import ckptstore.repo.select  # noqa: F401
    from ckptstore import errors

    found, stack = [], [errors.CkptError]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return sorted({cls for cls in found if cls.__module__.startswith("ckptstore.")}, key=lambda cls: cls.__qualname__)


class _Unpicklable(OSError):
    """A cause holding what pickle refuses (a lock): the error it caused must still travel."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        import threading

        self.lock = threading.Lock()


def _made(cls: type):
    """An instance of `cls`, made with the arguments its __init__ takes (a message where it takes only that)."""
    from ckptstore import errors as e
    from ckptstore.repo.journal import CheckoutInterruptedError
    from ckptstore.repo.manifest import UnreadableManifestError

    special = {
        e.CorruptObjectError: lambda: e.CorruptObjectError(["ab" * 32, "cd" * 32], "missing", ["ef" * 32]),
        e.SentObjectError: lambda: e.SentObjectError("ab" * 32, "bytes differ", "/hub", pushing=True),
        e.RefNotFoundError: lambda: e.RefNotFoundError("mian", ["main"], detail=" (a typo?)"),
        e.MalformedSkeletonError: lambda: e.MalformedSkeletonError("a list as a dict key"),
        e.DirtyWorktreeError: lambda: e.DirtyWorktreeError("a.pt changed", "commit it first"),
        e.UnquantizableTensorsError: lambda: e.UnquantizableTensorsError({"exp_avg": "values up to 1e11"}),
        e.RetentionError: lambda: e.RetentionError("ab" * 32, _Unpicklable("the bucket refused")),
        e.LostLockError: lambda: e.LostLockError("lost the lock", "its session ended", deleting=True),
        e.OutputError: lambda: e.OutputError(OSError(28, "No space left on device"), "commit ab12"),
        e.CorruptRecordError: lambda: e.CorruptRecordError("ref x", "it points at no commit", ["ab" * 32],
                                                           outcome="Nothing was read"),
        e.DamageListedPastError: lambda: e.DamageListedPastError(2),
        CheckoutInterruptedError: lambda: CheckoutInterruptedError(_Unpicklable("the disk went away"), True),
        UnreadableManifestError: lambda: UnreadableManifestError("ab" * 32, "is no manifest"),
    }
    return special[cls]() if cls in special else cls("what went wrong, and what to do")


def test_every_error_comes_back_from_pickle_as_itself():
    """DCP hands a rank's exception to the other ranks pickled: CorruptObjectError, LostLockError and four more
    came back as "TypeError: __init__() missing 1 required positional argument", and a rank whose peer failed so
    waited in a collective for its group's timeout, the real message lost (auditor helper 376)."""
    import pickle

    classes = _every_error_class()
    assert len(classes) > 35
    for cls in classes:
        error = _made(cls)
        error.add_note("a note added after it was made")
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and str(back) == str(error) and back.args == error.args, cls
        assert repr(vars(back)) == repr(vars(error)), cls


def test_a_failing_disk_and_a_full_output_disk_are_said_with_their_path_and_what_helps():
    """EIO reached the user as 'unexpected OSError ... please report it' with no path, and a full disk under an -o
    file sent the user to `ckpt gc` in the repository, which cannot free space there (auditor 434)."""
    import errno

    from ckptstore.errors import explain, naming_file

    failing = str(explain(OSError(errno.EIO, "Input/output error", "/r/.ckpt/objects/ab/cd")))
    assert "/r/.ckpt/objects/ab/cd" in failing and "input/output error" in failing and "ckpt fsck" in failing
    temp = "/mnt/out/.c.pt.new-0123456789abcdef.ckpt-tmp"  # formats.atomic's temporary file beside out/c.pt
    full = str(explain(OSError(errno.ENOSPC, "No space left on device", temp)))
    assert "the disk holding /mnt/out is full" in full and "ckpt gc" not in full and "write elsewhere" in full, full
    assert "ckpt gc" in str(explain(OSError(errno.ENOSPC, "No space left on device", "/r/.ckpt/tmp/x")))
    try:
        with naming_file("/r/out.pt"):
            raise OSError(errno.EIO, "Input/output error")  # a write or an fsync names no file
    except OSError as exc:
        assert exc.filename == "/r/out.pt" and exc.errno == errno.EIO
    try:
        with naming_file("/r/out.pt"):
            raise PermissionError(errno.EACCES, "Permission denied", "/r/other")
    except PermissionError as exc:  # one that names its file keeps it, and its type
        assert exc.filename == "/r/other"

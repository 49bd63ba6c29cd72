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

"""What a git user's words do here: click's errors with ckpt's command for a git word, no destructive guess."""

from __future__ import annotations

import re

import click

from ckptstore.cli.group import cli


def typed_command(argv: list[str]) -> str:
    """The command `argv` names ("ckpt commit"), for an error click raised before it made the command's context."""
    words, command, tokens = ["ckpt"], cli, iter(argv)
    for token in tokens:
        if not isinstance(command, click.Group):
            break
        if token == "--repo":
            next(tokens, None)  # its value, which may read as a command's name
        elif token in command.commands:
            command = command.commands[token]
            words.append(token)
    return " ".join(words)


# git's words ckpt has no command for, and what does it here: click's nearest spelling sent `switch` to
# `watch`, `remote rename` to `remote remove` (which forgets the remote), `gc --dry-run` to `--prune`
_GIT_WORDS = {
    "switch": "`ckpt checkout BRANCH` switches branch and writes its files",
    "restore": "`ckpt checkout HEAD` writes HEAD's files back (`--only PATTERN` for some of them)",
    "reset": "`ckpt checkout REF` writes a commit's files; `ckpt branch NAME REF` starts a branch there",
    "rename": "`ckpt remote add NEW URL`, then `ckpt remote remove OLD`",
    "stash": "commit the files on a branch of their own (`ckpt branch wip`, `ckpt checkout wip`, then commit)",
    "merge": "checkpoints are not merged: `ckpt branch NAME REF` goes on from the one you choose",
    "rebase": "checkpoints are not rebased: `ckpt branch NAME REF` goes on from the one you choose",
}


_DESTRUCTIVE = {"--prune", "--force", "remove"}  # offered only for a word typed nearly so (a typo of it)


def git_habit(exc: click.ClickException) -> str:
    """Click's message, with what ckpt offers for a git word, and no destructive command or option guessed."""
    if isinstance(exc, click.NoSuchOption):
        exc.possibilities = [p for p in exc.possibilities or [] if not _far_and_destructive(exc.option_name, p)]
        return exc.format_message()
    found = re.match(r"No such command '([^']*)'\.", exc.format_message())
    if found is None:
        return exc.format_message()
    word = found[1]
    if word in _GIT_WORDS:
        return f"No such command '{word}': {_GIT_WORDS[word]}"
    if any(f"'{d}'" in exc.format_message() and _far_and_destructive(word, d) for d in _DESTRUCTIVE):
        return f"No such command '{word}'."
    return exc.format_message()


def _far_and_destructive(typed: str, offered: str) -> bool:
    import difflib

    return offered in _DESTRUCTIVE and difflib.SequenceMatcher(None, typed, offered).ratio() < 0.8

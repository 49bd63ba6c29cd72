"""`.ckpt/config.toml`: where objects and metadata live (URLs), encoding defaults, the default lossy level."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from ckptstore.errors import CkptError, is_utf8, shown_name
from ckptstore.policy import LEVELS, EncodingSettings

LOSSY_LEVELS = tuple(LEVELS)  # names `--lossy` accepts


def user_cache() -> Path:
    """The per-user folder for what is the machine's, not a repository's (chain costs, remotes' scratch)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(cache) if os.path.isabs(cache) else Path.home() / ".cache") / "ckptstore"  # XDG: else unset


@dataclass
class RemoteConfig:
    """Where a remote lives: a repository folder, or objects at `url` (s3://...) with records at `metadata_url`.

    `lazy`: this repository was cloned lazily, so objects it lacks are read from this remote on demand.
    """

    url: str
    metadata_url: str = ""
    lazy: bool = False

    def resolved(self, root: Path) -> RemoteConfig:
        """This remote, a relative folder taken relative to the repository at `root`.

        The config keeps it relative, so a repository and its remotes can move together.
        """
        if "://" in self.url or Path(self.url).is_absolute():
            return self
        return RemoteConfig(str((root / self.url).resolve()), self.metadata_url, self.lazy)


@dataclass
class RetentionPolicy:
    """Which commits `ckpt prune` keeps (docs/reference.md); as `[retention]` in config.toml, applied after each commit.

    Per branch, along its first-parent history: the `keep_last` newest commits, every commit whose
    position counted from the branch's first commit (0) is a multiple of `keep_every`, and the
    commit(s) with the best value of metric `keep_best` ("NAME", "NAME:min" or "NAME:max"; min by
    default). `keep_tagged` keeps tagged commits. Zero and empty rules are off.
    """

    keep_last: int = 0
    keep_every: int = 0
    keep_best: str = ""
    keep_tagged: bool = False

    def __post_init__(self) -> None:
        # config.toml can hold any type here: a wrong one must be a clear error, never a policy that prunes
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CkptError(f"retention {name} must be a count (0 or more), not {value!r}")
        if not isinstance(self.keep_best, str):
            raise CkptError(f"retention keep_best must be METRIC, METRIC:min or METRIC:max, not {self.keep_best!r}")
        if not isinstance(self.keep_tagged, bool):
            raise CkptError(f"retention keep_tagged must be true or false, not {self.keep_tagged!r}")
        self.best()

    @property
    def active(self) -> bool:
        """True when some rule is set (`[retention]` in config.toml then prunes after each commit)."""
        return bool(self.keep_last or self.keep_every or self.keep_best or self.keep_tagged)

    def best(self) -> tuple[str, str] | None:
        """(metric, "min" or "max") of `keep_best`, or None."""
        if not self.keep_best:
            return None
        name, _, way = self.keep_best.rpartition(":") if self.keep_best.endswith((":min", ":max")) else (
            self.keep_best, "", "min")
        suffix = name.rpartition(":")[2] if ":" in name else None
        if not name or suffix is not None and suffix.lower() in ("", "min", "max"):  # "loss:" or "loss:MAX"
            raise CkptError(f"keep_best {self.keep_best!r}: write METRIC, METRIC:min or METRIC:max")
        return name, way


MAX_THREADS = 1024  # encoding threads: past the cores of any one machine, and each costs a stack
SECTIONS = ("core", "encoding", "remotes", "retention")
CORE_KEYS = ("objects_url", "metadata_url", "threads", "lossy")
ENCODING_KEYS = ("max_chain", "chunk_bytes", "zstd_level")
REMOTE_KEYS = ("url", "metadata_url", "lazy")


def _unknown(table: Any, where: str, known: tuple[str, ...]) -> str:
    """The first key of `table` not among `known`, said with those that are; "" for none (or no table)."""
    extra = sorted(table.keys() - set(known)) if isinstance(table, dict) else []
    return f"{where}unknown key {extra[0]!r} (a typo, or a newer ckptstore's?); the keys are {', '.join(known)}" \
        if extra else ""


def _remote(name: str, section: Any) -> RemoteConfig:
    """A [remotes.NAME] section, its values of the types written (lazy = "false" is no boolean).

    A misspelt key is refused as in the other sections: `metdata_url` ignored sent pushes without the database.
    """
    where = f"[remotes.{name}] "
    if not isinstance(section, dict):
        raise CkptError(f"{where}must be a table of settings (url = ...), not {section!r}")
    problem = _unknown(section, where, REMOTE_KEYS)
    if problem:
        raise CkptError(problem)
    if "url" not in section:
        raise CkptError(f"{where}needs url (the remote's folder or URL)")
    url, metadata_url, lazy = section["url"], section.get("metadata_url", ""), section.get("lazy", False)
    if not isinstance(url, str) or not isinstance(metadata_url, str) or not isinstance(lazy, bool):
        raise CkptError(f"{where}needs url and metadata_url strings and lazy true or false, not {section!r}")
    return RemoteConfig(url, metadata_url, lazy)


def _remotes(section: Any) -> dict[str, RemoteConfig]:
    """config.toml's remotes: [remotes.NAME] tables, each checked (`remotes = 5` is no table of them)."""
    if not isinstance(section, dict):
        raise CkptError(f"[remotes] must hold [remotes.NAME] tables, not {section!r}")
    return {name: _remote(name, remote) for name, remote in section.items()}


def _core_problem(core: Any) -> str:
    """What is wrong with config.toml's [core] table (a hand edit), or ""."""
    if not isinstance(core, dict):
        return f"must be a table of settings, not {core!r}"
    unknown = _unknown(core, "", CORE_KEYS)
    if unknown:
        return unknown
    if core.get("lossy", "") not in ("", "none", "lossless", *LEVELS):
        return f"lossy must be one of none, {', '.join(LEVELS)} (or empty), not {core['lossy']!r}"
    for name in ("metadata_url", "lossy", "objects_url"):
        if not isinstance(core.get(name, ""), str):
            return f"{name} must be a string, not {core[name]!r}"
    threads = core.get("threads", 0)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= MAX_THREADS:
        return f"threads must be a count up to {MAX_THREADS} (0: one per CPU), not {threads!r}"
    return ""


@dataclass
class RepoConfig:
    """Settings read from config.toml; missing keys take these defaults.

    `objects_url` and `metadata_url` empty mean the repository's own `.ckpt/objects` and
    `.ckpt/ckpt.db`.
    """

    encoding: EncodingSettings = field(default_factory=EncodingSettings)
    metadata_url: str = ""
    threads: int = 0
    lossy: str = ""
    objects_url: str = ""
    remotes: dict[str, RemoteConfig] = field(default_factory=dict)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    @classmethod
    def load(cls, path: Path) -> RepoConfig:
        try:
            data = tomllib.loads(path.read_text())
            problem = _core_problem(data.get("core", {}))
            problem = f"[core] {problem}" if problem else (
                _unknown(data, "", SECTIONS) or _unknown(data.get("encoding"), "[encoding] ", ENCODING_KEYS))
            if not problem and not isinstance(data.get("encoding", {}), dict):  # `encoding = "x"`, not [encoding]
                problem = f"[encoding] must be a table of settings, not {data['encoding']!r}"
            if problem:
                raise CkptError(problem)
            encoding = EncodingSettings(**data.get("encoding", {}))
            remotes = _remotes(data.get("remotes", {}))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError, ValueError, CkptError) as exc:
            raise CkptError(f"cannot read {path}: {exc}") from None
        core = data.get("core", {})
        section = data.get("retention", {})
        known = {f.name for f in fields(RetentionPolicy)}
        if not isinstance(section, dict) or section.keys() - known:
            what = (f"unknown key {sorted(section.keys() - known)[0]!r}" if isinstance(section, dict)
                    else f"must be a table, not {section!r}")
            raise CkptError(f"cannot read {path}: [retention] {what}; its keys are {', '.join(sorted(known))}")
        try:
            retention = RetentionPolicy(**section)
        except CkptError as exc:
            raise CkptError(f"cannot read {path}: {exc}") from None  # it names the retention key
        return cls(encoding, core.get("metadata_url", ""), core.get("threads", 0), core.get("lossy", ""),
                   core.get("objects_url", ""), remotes, retention)

    def save(self, path: Path) -> None:
        """Write the config to `path` atomically; an existing file keeps its comments and layout."""
        self._refuse_not_utf8()
        # json.dumps writes a TOML basic string: same quoting and escapes.
        lines = ["[core]", f"objects_url = {json.dumps(self.objects_url)}",
                 f"metadata_url = {json.dumps(self.metadata_url)}", f"threads = {self.threads}",
                 f"lossy = {json.dumps(self.lossy)}", "", "[encoding]"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in asdict(self.encoding).items()]
        for name, remote in sorted(self.remotes.items()):
            lines += ["", f"[remotes.{json.dumps(name)}]", f"url = {json.dumps(remote.url)}",
                      f"metadata_url = {json.dumps(remote.metadata_url)}", f"lazy = {str(remote.lazy).lower()}"]
        if self.retention.active:  # absent when off, so a config without a policy reads as before
            lines += ["", "[retention]"] + [f"{key} = {json.dumps(value)}"
                                             for key, value in asdict(self.retention).items()]
        text = "\n".join(lines) + "\n"
        if path.exists():  # an edit (`ckpt remote add`): the comments and order the user gave the file stay
            text = _into_existing(path.read_text(), text)
        # Imported here: opening a repository (every command) reads the config but never writes it.
        from ckptstore.formats.atomic import atomic_write

        atomic_write(path, lambda handle: handle.write(text.encode()))  # a crash never leaves half a config

    def _refuse_not_utf8(self) -> None:
        """Refuse a URL or folder whose name is not UTF-8 (os.fsdecode's surrogates): TOML cannot hold it.

        Written as an escape, no command could read the config again (and init said it made the repository).
        """
        named = [("objects", self.objects_url), ("metadata", self.metadata_url)] + [
            (f"remote {name}", url) for name, remote in self.remotes.items()
            for url in (remote.url, remote.metadata_url)]
        for what, text in named:
            if not is_utf8(text):
                raise CkptError(f"the {what} location '{shown_name(text)}' holds bytes that are not UTF-8; a "
                                "repository's config records it as UTF-8 text: rename that folder, or give "
                                "another; nothing was changed")


def _into_existing(old: str, new: str) -> str:
    """The settings of `new` written into the document `old`: its comments and layout kept, its values replaced."""
    import tomlkit  # only an edit needs it

    document = tomlkit.parse(old)
    _merge(document, tomllib.loads(new))
    merged = tomlkit.dumps(document)
    return merged if tomllib.loads(merged) == tomllib.loads(new) else new  # never a comment kept over a value


def _merge(table: Any, values: dict[str, Any]) -> None:
    """Make the tomlkit `table` hold `values`, touching only the keys whose values differ."""
    for key in [key for key in table if key not in values]:
        del table[key]
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(table.get(key), dict):
            _merge(table[key], value)
        elif key not in table or table[key] != value:
            table[key] = value


def edit_config(path: Path, change: Callable[[RepoConfig], None]) -> RepoConfig:
    """Apply `change` to the config file at `path` as it is now, under a lock, and return what was saved.

    Two `remote add`s at once each saved the config they had read: one remote was lost. So was
    any edit made since a long-lived Repository read its config.
    """
    import fcntl

    # read-only is enough for a flock: a lock file another user made (mode 644) still serves
    lock = os.open(path.with_name(path.name + ".lock"), os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        config = RepoConfig.load(path)
        change(config)
        config.save(path)
    finally:
        os.close(lock)
    return config

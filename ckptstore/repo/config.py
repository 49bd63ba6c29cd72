"""`.ckpt/config.toml`: where objects and metadata live (URLs), encoding defaults, the default lossy level."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomllib

from ckptstore.errors import CkptError
from ckptstore.policy import LEVELS, EncodingSettings

LOSSY_LEVELS = tuple(LEVELS)  # names `--lossy` accepts


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

    @classmethod
    def load(cls, path: Path) -> RepoConfig:
        try:
            data = tomllib.loads(path.read_text())
            encoding = EncodingSettings(**data.get("encoding", {}))
        except (OSError, tomllib.TOMLDecodeError, TypeError) as exc:
            raise CkptError(f"cannot read {path}: {exc}") from None
        core = data.get("core", {})
        try:
            remotes = {name: RemoteConfig(str(r["url"]), str(r.get("metadata_url", "")), bool(r.get("lazy", False)))
                       for name, r in data.get("remotes", {}).items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise CkptError(f"cannot read {path}: a [remotes.NAME] section lacks a url ({exc})") from None
        return cls(encoding, core.get("metadata_url", ""), int(core.get("threads", 0)), core.get("lossy", ""),
                   core.get("objects_url", ""), remotes)

    def save(self, path: Path) -> None:
        # json.dumps writes a TOML basic string: same quoting and escapes.
        lines = ["[core]", f"objects_url = {json.dumps(self.objects_url)}",
                 f"metadata_url = {json.dumps(self.metadata_url)}", f"threads = {self.threads}",
                 f"lossy = {json.dumps(self.lossy)}", "", "[encoding]"]
        lines += [f"{key} = {value}" for key, value in asdict(self.encoding).items()]
        for name, remote in sorted(self.remotes.items()):
            lines += ["", f"[remotes.{json.dumps(name)}]", f"url = {json.dumps(remote.url)}",
                      f"metadata_url = {json.dumps(remote.metadata_url)}", f"lazy = {str(remote.lazy).lower()}"]
        text = ("\n".join(lines) + "\n").encode()
        # Imported here: opening a repository (every command) reads the config but never writes it.
        from ckptstore.formats.atomic import atomic_write

        atomic_write(path, lambda handle: handle.write(text))  # a crash never leaves a half-written config

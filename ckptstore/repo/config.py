"""`.ckpt/config.toml`: encoding defaults and where the metadata lives."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomllib

from ckptstore.errors import CkptError
from ckptstore.policy import EncodingSettings


@dataclass
class RepoConfig:
    """Settings read from config.toml; missing keys take these defaults."""

    encoding: EncodingSettings = field(default_factory=EncodingSettings)
    metadata_url: str = ""
    threads: int = 0
    lossy: str = ""

    @classmethod
    def load(cls, path: Path) -> RepoConfig:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise CkptError(f"cannot read {path}: {exc}") from None
        encoding = EncodingSettings(**data.get("encoding", {}))
        core = data.get("core", {})
        return cls(encoding, core.get("metadata_url", ""), int(core.get("threads", 0)), core.get("lossy", ""))

    def save(self, path: Path) -> None:
        lines = ["[core]", f'metadata_url = "{self.metadata_url}"', f"threads = {self.threads}",
                 f'lossy = "{self.lossy}"', "",
                 "[encoding]"]
        lines += [f"{key} = {value}" for key, value in asdict(self.encoding).items()]
        path.write_text("\n".join(lines) + "\n")

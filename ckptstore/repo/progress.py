"""Progress reporting hooks; the library reports, the CLI decides how (or whether) to draw."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives byte counts as work proceeds."""

    def start(self, label: str, total: int) -> None: ...

    def advance(self, amount: int) -> None: ...

    def finish(self) -> None: ...


class NoProgress:
    """Reports nothing."""

    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass

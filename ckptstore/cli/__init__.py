"""`ckpt`: each command parses its arguments and calls one library function.

The commands live in modules by what they work on; importing this package registers them all on `cli`.
"""

from ckptstore.cli import daemons, history, maintenance, remotes, working  # noqa: F401 (they register the commands)
from ckptstore.cli.entry import main
from ckptstore.cli.group import cli
from ckptstore.cli.params import UrlGiven

__all__ = ["UrlGiven", "cli", "main"]

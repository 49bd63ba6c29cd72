"""What an older ckptstore kept in files of `.ckpt/` that this one keeps in the database, taken over on open.

Before schema 0009 the tensor records received from another repository and not yet checked were
listed in `.ckpt/received` (one id per line), a file per machine; the `unchecked_tensors` table
lists them since (repo/received.py). Upgraded without taking the file over, a repository forgot
them, and a commit reused a received record unchecked: a crafted remote's bytes restored for the
user's. Each machine's file is taken over by that machine's first writable open.
"""

from __future__ import annotations

from pathlib import Path

from ckptstore.errors import CkptError
from ckptstore.hashing import TensorId, is_hex_id
from ckptstore.metadata import Database
from ckptstore.metadata import tensors as tensor_rows

OLDER_RECEIVED = "received"  # and its lock file, "received.lock"


def take_over_received_list(repo_dir: Path, db: Database) -> None:
    """List the ids of an older ckptstore's `.ckpt/received` as unchecked, then remove the file (and its lock)."""
    path = repo_dir / OLDER_RECEIVED
    try:
        ids = path.read_text(errors="replace").split()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CkptError(f"cannot read {path}, the list of received records an older ckptstore kept ({exc}); "
                        "nothing was written: make it readable, or move it away if this repository never fetched "
                        "from a remote you do not trust") from None
    with db.write() as tx:  # listed first: a crash before the removal lists them again, which changes nothing
        tensor_rows.list_unchecked(tx, [TensorId(tid) for tid in ids if is_hex_id(tid)])
    path.unlink()
    (repo_dir / f"{OLDER_RECEIVED}.lock").unlink(missing_ok=True)

"""Bytes read per rank when loading at another world size: save 64 MiB at W1 ranks, load at each W2.

    PYTHONPATH=. python tests/dcp/measure_reads.py W1 W2 [W2 ...]    # e.g. 2 4 1

Not a test (several real multi-rank runs): a measurement for docs and reviews.
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ckptstore import Repository  # noqa: E402
from tests.dcp.launch import run_ranks  # noqa: E402

save_world, load_worlds = int(sys.argv[1]), [int(w) for w in sys.argv[2:]]
base = Path(tempfile.mkdtemp())
Repository.init(base / "repo").close()
for r in run_ranks("measure-save", base / "repo", base / "save", save_world, timeout=300):
    assert r.returncode == 0, r.stdout[-3000:]
for world in load_worlds:
    for r in run_ranks("measure-load", base / "repo", base / f"load{world}", world, timeout=300):
        assert r.returncode == 0, r.stdout[-3000:]
    for rank in range(world):
        rep = json.loads((base / f"load{world}" / f"rank{rank}.json").read_text())
        print(f"saved at {save_world}, loaded at {world}: rank {rank} read {rep['read_bytes']/2**20:.1f} MiB "
              f"(replayed {rep['replayed_bytes']/2**20:.1f} MiB of 64 MiB; share {64/world:.1f}); "
              f"bit-exact {rep['differences'] == []}")

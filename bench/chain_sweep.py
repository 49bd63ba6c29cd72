"""`python -m bench.chain_sweep`: how max_chain trades stored bytes against commit and checkout speed.

Commits the cached MiniLM fine-tune sequence with several max_chain values and checks out the last
commit (the one at the deepest point of its chain).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench.__main__ import warm
from bench.workloads import MiniLMFineTune
from ckptstore import Repository
from ckptstore.policy import EncodingSettings


def main() -> None:
    files = MiniLMFineTune().files()
    raw = sum(f.stat().st_size for f in files)
    print("| max_chain | stored MB | ratio | commit MB/s (median) | commit MB/s (slowest) | checkout last s |")
    print("|---|---|---|---|---|---|")
    for max_chain in (1, 2, 4, 8):
        work = Path(tempfile.mkdtemp(prefix="ckpt-sweep-"))
        try:
            with Repository.init(work, encoding=EncodingSettings(max_chain=max_chain)) as repo:
                speeds, stored = [], 0
                for path in files:
                    warm(path)
                    start = time.perf_counter()
                    cid = repo.commit(path)
                    speeds.append(path.stat().st_size / 1e6 / (time.perf_counter() - start))
                    stored += repo.commit_info(cid).stored_bytes
                start = time.perf_counter()
                repo.checkout(cid)
                checkout = time.perf_counter() - start
            speeds.sort()
            print(f"| {max_chain} | {stored / 1e6:.1f} | {raw / stored:.2f}x | {speeds[len(speeds) // 2]:.0f} | "
                  f"{speeds[0]:.0f} | {checkout:.2f} |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

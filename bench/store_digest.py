"""`python -m bench.store_digest [RUN ...] [--quick] [--json OUT]`: what each level stores, as one digest.

Commits every cached checkpoint of each run at every ckptstore level (lossless and the lossy
ones) into fresh repositories and prints, per run and level, the stored bytes and a digest of the
sorted object ids. Objects are named by the blake3 of their bytes, so two code versions that
print the same digests wrote byte-identical stores. Run it before and after a refactor, on the
same cached checkpoints, to show that nothing a user stores changed; the commit and checkout
times it prints are for a paired comparison in the same session, not absolute figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.workloads import SUITE_RUNS, WORKLOADS

LEVELS = (None, "optimizer", "balanced", "extreme")


def digest_level(files: list[Path], level: str | None, scratch: Path) -> dict:
    """Commit `files` in order at `level`, check each one out, and describe the store."""
    from ckptstore import Repository

    root = scratch / f"repo-{level or 'lossless'}"
    shutil.rmtree(root, ignore_errors=True)
    commit_s = checkout_s = 0.0
    with Repository.init(root) as repo:
        cids = []
        for path in files:
            start = time.perf_counter()
            cids.append(repo.commit(path, message=path.name, lossy=level))
            commit_s += time.perf_counter() - start
        for index, cid in enumerate(cids):
            start = time.perf_counter()
            repo.checkout_to(cid, scratch / f"out-{index}", force=True)
            checkout_s += time.perf_counter() - start
            shutil.rmtree(scratch / f"out-{index}", ignore_errors=True)
            (scratch / f"out-{index}").unlink(missing_ok=True)
        objects = sorted((oid, repo.store.size(oid)) for oid in repo.store.iter_ids())
    shutil.rmtree(root, ignore_errors=True)
    listing = "".join(f"{oid} {size}\n" for oid, size in objects).encode()
    return {"objects": len(objects), "stored_bytes": sum(size for _, size in objects),
            "digest": hashlib.sha256(listing).hexdigest()[:16],
            "commit_s": round(commit_s, 3), "checkout_s": round(checkout_s, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=list(SUITE_RUNS))
    parser.add_argument("--quick", action="store_true", help="the tiny runs of `python -m bench --quick`")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-digest-"))
    table: dict[str, dict] = {}
    try:
        for name in args.runs:
            files = WORKLOADS[name](quick=args.quick).files()
            for level in LEVELS:
                row = digest_level(files, level, scratch)
                table.setdefault(name, {})[level or "lossless"] = row
                print(f"{name:16} {level or 'lossless':9} {row['objects']:5} objects {row['stored_bytes']:>12} B "
                      f"digest {row['digest']}  commit {row['commit_s']:.2f} s  checkout {row['checkout_s']:.2f} s",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

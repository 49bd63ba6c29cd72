"""`python -m bench.s3_repo [RUN]`: a run's checkpoints on S3-compatible storage, against plain uploads of its files.

Against one local S3 server (moto's, 127.0.0.1) in one run, on the run's eight torch.save files
(default: the MiniLM fine-tune, 271 MB each):
- plain: each file uploaded with obstore's multipart upload (8 MiB parts, 8 in flight), and the
  latest downloaded and `torch.load`ed from memory;
- push: the files committed into a local repository (lossless, and `balanced` in a second one),
  then `push`ed to a remote whose objects are on the bucket: bytes sent and wall time; a second
  push with nothing new;
- shared: the same files committed straight into a repository on the bucket, against commits
  into a local repository (the upload overlaps the encoding), with the CPU time each took here
  and in the S3 server; and checkout of its latest commit into memory against the plain
  download and load (alternately, best of three each).
`--metadata postgresql` keeps the remote's and the shared repository's records in a throwaway
PostgreSQL server instead of SQLite beside them, durable as the local repository is (fsync on;
`--no-fsync` turns it off, as the test suite's server runs). The S3 server keeps objects in its
own memory and temporary files, never fsynced: that side is not durable here.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench.memory import cpu_seconds
from bench.workloads import WORKLOADS
from ckptstore.testing.s3_server import S3Server

MiB = 1 << 20


def _timed(action):
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def plain(files: list[Path], endpoint: str, bucket: str) -> tuple[float, object]:
    """(seconds to upload every file, a function timing a download of the last one and its torch.load)."""
    import obstore
    import torch
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})
    upload, _ = _timed(lambda: [obstore.put(store, f.name, f, chunk_size=8 * MiB, max_concurrency=8) for f in files])

    def load():
        data = obstore.get(store, files[-1].name).bytes()
        return torch.load(io.BytesIO(memoryview(data)), weights_only=True, map_location="cpu")

    return upload, lambda: _timed(load)[0]


def commit_all(repo, files: list[Path], lossy: str | None = None) -> float:
    return _timed(lambda: [repo.commit(f, message=f.name, lossy=lossy) for f in files])[0]


def commit_cpu(repo, files: list[Path], server: S3Server) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds, the S3 server's CPU seconds) of committing every file."""
    own, served = cpu_seconds(), server.cpu_seconds()
    wall = commit_all(repo, files)
    return wall, cpu_seconds() - own, server.cpu_seconds() - served


def stored_bytes(repo) -> int:
    return sum(repo.store.size(oid) for oid in repo.store.iter_ids())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", default="minilm-finetune")
    parser.add_argument("--metadata", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--no-fsync", action="store_true", help="PostgreSQL without fsync (the test suite's)")
    args = parser.parse_args()
    from ckptstore import Repository
    from ckptstore.repo import remote

    files = WORKLOADS[args.run]().files()
    raw = sum(f.stat().st_size for f in files)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-s3-bench-"))
    with ExitStack() as stack:
        server = stack.enter_context(S3Server())
        os.environ.update(server.environment())
        database = (lambda: "")
        if args.metadata == "postgresql":
            from ckptstore.testing.postgres_server import PostgresServer

            database = stack.enter_context(PostgresServer(durable=not args.no_fsync)).new_database
        rows = []
        up, down = plain(files, server.endpoint, server.new_bucket("plain"))
        rows.append(("plain upload of the files (obstore multipart)", up, raw, 1.0))
        for level in (None, "balanced"):
            with Repository.init(scratch / f"local-{level}") as local:
                commit_all(local, files, level)
                Repository.init(scratch / f"hub-{level}", objects_url=f"s3://{server.new_bucket('hub')}/hub",
                                metadata_url=database()).close()
                remote.add(local, "origin", str(scratch / f"hub-{level}"))
                took, report = _timed(lambda: remote.push(local, "origin"))
                again, second = _timed(lambda: remote.push(local, "origin"))
                name = level or "lossless"
                rows.append((f"push, {name} ({report.commits} commits)", took, report.object_bytes, took / up))
                rows.append((f"second push, {name} ({second.objects} objects)", again, second.object_bytes,
                             again / up))
                if level is None:
                    assert report.object_bytes == stored_bytes(local), "push sent other than what is stored"
        with Repository.init(scratch / "shared", objects_url=f"s3://{server.new_bucket('shared')}/run",
                             metadata_url=database()) as shared, Repository.init(scratch / "local2") as local:
            order = [("local", local), ("shared", shared)]
            costs = {name: commit_cpu(repo, files, server) for name, repo in order}
            commits = {name: cost[0] for name, cost in costs.items()}
            # alternately, three times each: the server's first read of a fresh upload is slower
            downloads, checkouts = [], []
            for _ in range(3):
                downloads.append(down())
                checkouts.append(_timed(lambda: shared.checkout("HEAD"))[0])
            down, checkout = min(downloads), min(checkouts)
        rows.append(("commit into a local repository", commits["local"], raw, commits["local"] / up))
        rows.append(("commit into the shared S3 repository", commits["shared"], raw, commits["shared"] / up))
        durability = " (fsync off)" if args.metadata == "postgresql" and args.no_fsync else ""
        print(f"{args.run}: {len(files)} files, {raw / 1e6:.0f} MB; metadata in {args.metadata}{durability}\n")
        print("| what | seconds | bytes | seconds vs plain upload |\n|---|---|---|---|")
        for what, seconds, size, ratio in rows:
            print(f"| {what} | {seconds:.2f} | {size / 1e6:.1f} MB | {ratio:.2f} |")
        print(f"\nfiles / bytes pushed: lossless {raw / rows[1][2]:.2f}x, balanced {raw / rows[3][2]:.1f}x")
        print(f"commit speed, shared S3 vs local: {commits['local'] / commits['shared']:.2f}x")
        print("CPU seconds while committing (this machine's cores are shared with the servers): "
              + "; ".join(f"{name}: ours {cost[1]:.1f}, S3 server's {cost[2]:.1f}" for name, cost in costs.items())
              + f"; our own CPU, shared / local: {costs['shared'][1] / costs['local'][1]:.2f}x")
        print(f"checkout of the latest commit from the shared repository {checkout:.2f} s vs plain download and "
              f"torch.load {down:.2f} s: {checkout / down:.2f}x the time (best of 3 each, alternating; first "
              f"{checkouts[0]:.2f} s vs {downloads[0]:.2f} s)")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

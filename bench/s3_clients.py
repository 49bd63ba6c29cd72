"""`python -m bench.s3_clients`: upload and download throughput of S3 client libraries, one run, one server.

Chooses the client behind ckptstore's S3 store. Every client talks to the same local S3-compatible
server (moto's, on 127.0.0.1) with the same objects: for each object size and number of objects in
flight, it uploads a set of objects, then downloads them, and prints MB/s per client and each
client's ratio to the first. Each client uses its own best settings for large objects (multipart
parts of 8 MiB, up to 8 parts in flight per object; the
server's memory is freed after each cell). Cells rotate the client order so drift in the
machine's speed hits all alike.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ckptstore.testing.s3_server import S3Server

MiB = 1 << 20
PART = 8 * MiB


class ObstoreClient:
    name = "obstore"

    def __init__(self, endpoint: str, bucket: str) -> None:
        from obstore.store import S3Store

        self.store = S3Store(bucket, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})

    def upload(self, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.store, key, data, chunk_size=PART, max_concurrency=8)

    def download(self, key: str) -> int:
        import obstore

        return len(obstore.get(self.store, key).bytes())

    def delete(self, key: str) -> None:
        import obstore

        obstore.delete(self.store, key)


class Boto3Client:
    name = "boto3"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                   config=Config(max_pool_connections=64))
        self.config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=8)
        self.bucket = bucket

    def upload(self, key: str, data: bytes) -> None:
        import io

        self.client.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=self.config)

    def download(self, key: str) -> int:
        import io

        sink = io.BytesIO()
        self.client.download_fileobj(self.bucket, key, sink, Config=self.config)
        return sink.getbuffer().nbytes  # parts land out of order: tell() is where the last one ended

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)


CLIENTS: list[Callable[[str, str], object]] = [ObstoreClient, Boto3Client]


def cell(client, size: int, in_flight: int, count: int) -> tuple[float, float]:
    """MB/s uploading then downloading `count` objects of `size` bytes, `in_flight` at a time."""
    data = os.urandom(size)
    keys = [f"bench/{size}/{in_flight}/{i}" for i in range(count)]
    with ThreadPoolExecutor(in_flight) as pool:
        start = time.perf_counter()
        list(pool.map(lambda key: client.upload(key, data), keys))
        up = time.perf_counter() - start
        start = time.perf_counter()
        got = list(pool.map(client.download, keys))
        down = time.perf_counter() - start
        list(pool.map(client.delete, keys))  # the server keeps objects in memory
    if got != [size] * count:
        raise RuntimeError(f"{client.name} downloaded {got[:3]}... bytes, wanted {size}")
    total = size * count / 1e6
    return total / up, total / down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,64,256", help="object sizes in MiB")
    parser.add_argument("--in-flight", default="1,4,8", help="objects in flight at once")
    parser.add_argument("--total", type=int, default=256, help="MiB moved per cell (at least one object per slot)")
    args = parser.parse_args()
    with S3Server() as server:
        os.environ.update(server.environment())
        print("| object | in flight | client | upload MB/s | download MB/s | upload vs first | download vs first |")
        print("|---|---|---|---|---|---|---|")
        for turn, size_mib in enumerate(int(s) for s in args.sizes.split(",")):
            for in_flight in (int(n) for n in args.in_flight.split(",")):
                count = max(in_flight, args.total // size_mib)
                order = CLIENTS[turn % len(CLIENTS):] + CLIENTS[:turn % len(CLIENTS)]
                results = {}
                for make in order:
                    client = make(server.endpoint, server.new_bucket("bench"))
                    results[client.name] = cell(client, size_mib * MiB, in_flight, count)
                first = results[CLIENTS[0].name]
                for name, (up, down) in results.items():
                    print(f"| {size_mib} MiB | {in_flight} | {name} | {up:.0f} | {down:.0f} | "
                          f"{up / first[0]:.2f} | {down / first[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()

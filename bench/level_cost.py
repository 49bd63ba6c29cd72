"""`python -m bench.level_cost`: what one lossless residual level costs to decode, and where it goes.

Encodes the AdamW-like chunk that `max_chain = "auto"` measures (repo/chaincost.py: a third each of
weights and both moments, 10 optimizer steps between versions) as a keyframe and six residuals,
then prints each payload's plane modes, the decode time of the chain at each depth (one thread,
best of 7, into new pages with its checksum taken, as checkout restores a chunk; torch.load's
tensors are new memory too) and the single-plane decoders' time per row (into one reused plane: the
decoders alone), beside torch.load of the same bytes.
"""

from __future__ import annotations

import numpy as np

from ckptstore.codecs import get_codec, huffman
from ckptstore.codecs.bytegroup import HUF, RAW, RUNS, XOR_HUF, XOR_RUNS, XOR_ZSTD, ZSTD
from ckptstore.formats.loadspeed import torch_load_seconds
from ckptstore.policy import LOSSLESS_CODEC
from ckptstore.repo import chaincost

MODES = {RAW: "raw", ZSTD: "zstd", XOR_ZSTD: "xor-zstd", HUF: "huf", XOR_HUF: "xor-huf", RUNS: "runs",
         XOR_RUNS: "xor-runs"}


def main() -> None:
    """Print the table (fp32)."""
    codec = get_codec(LOSSLESS_CODEC)
    params = {"width": 4, "level": 1, "chunk_bytes": chaincost.SAMPLE_BYTES}
    versions = chaincost._versions(4)
    nbytes, rows = versions[0].size, versions[0].size // 4
    payloads = [codec.encode(versions[0], None, params)]
    payloads += [codec.encode(newer, older, params) for older, newer in zip(versions, versions[1:])]
    load = torch_load_seconds(versions[-1]) / nbytes * 1e9
    print(f"AdamW-like fp32 chunk, {nbytes >> 20} MiB; torch.load {load:.3f} ns/byte\n")
    print("| depth | plane modes (share of a raw plane) | chain decode ns/byte | vs torch.load |")
    print("|---|---|---|---|")
    for depth, payload in enumerate(payloads):
        _, planes = codec._parse(payload)
        modes = ", ".join(f"{MODES[mode]} {length / rows:.2f}" for mode, _, length in planes)
        chain = payloads[depth::-1]
        seconds = chaincost._best(lambda chain=chain: chaincost.restore_into_new_pages(codec, chain, params, nbytes))
        seconds = seconds / nbytes * 1e9
        print(f"| {depth} | {modes} | {seconds:.3f} | {load / seconds:.2f}x |")
    if huffman.native is None:
        return
    _, key_planes = codec._parse(payloads[0])
    mode, offset, length = key_planes[-1]
    top = bytes(payloads[0][offset:offset + length])
    plane = np.empty(rows, dtype=np.uint8)
    print(f"\nthe keyframe's top plane ({MODES[mode]}): "
          f"{chaincost._best(lambda: huffman.native.decode(top, plane)) / rows * 1e9:.3f} ns/row")
    _, level_planes = codec._parse(payloads[2])
    mode, offset, length = level_planes[-1]
    if mode == XOR_RUNS:
        runs = bytes(payloads[2][offset:offset + length])
        print(f"depth 2's top plane (xor-runs, XORed in place): "
              f"{chaincost._best(lambda: huffman.native.decode_runs(runs, plane, 1)) / rows * 1e9:.3f} ns/row")


if __name__ == "__main__":
    main()

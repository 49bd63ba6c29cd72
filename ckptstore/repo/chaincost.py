"""Measure what a lossless residual level costs at checkout (for `max_chain = "auto"`).

A synthetic chunk shaped like a fine-tune's AdamW state (weights and both moments, a few optimizer
steps between commits) is encoded as a keyframe and a chain of residuals with the real codec, and its
decode is timed at depth 0 and at `LEVELS`, beside torch.load of the same bytes. Per element width
(fp32, and bf16-like 2-byte values), that gives policy/chaincost.py's `ChainCosts`, timed on one
thread and on every CPU at once (checkout decodes chunks on one per CPU), less the threads' waits for
a CPU: the first auto commit usually runs inside a training job, whose threads held the CPUs while
wall clocks measured, and the figures kept said chains never pay (keyframes only, for good). It takes
0.5 s, 2-3 s in a process that must import torch for it, so a machine measures once and keeps the
figures per user in `$XDG_CACHE_HOME/ckptstore/chaincost.json`, under the CPU's name, the CPUs the
process may use, this version and COSTS_REVISION; each repository copies them into
`.ckpt/chaincost.json` at its first "auto" commit (again where the process may use another number
of CPUs, at another COSTS_REVISION, or when the file is deleted or unreadable). Commits, every rank
of a sharded commit and prune all chain by the repository's figures (`auto_costs`).
`CKPTSTORE_CHAIN_COSTS` (JSON {width: [keyframe, level, load, workers]}, s/byte) pins them.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ckptstore import __version__
from ckptstore.codecs import get_codec
from ckptstore.errors import CkptError
from ckptstore.formats.atomic import atomic_write
from ckptstore.formats.loadspeed import torch_load_timer
from ckptstore.hashing import chunk_checksum
from ckptstore.policy import AUTO, LOSSLESS_CODEC, ChainCosts
from ckptstore.policy.chaincost import FALLBACK
from ckptstore.repo.config import user_cache
from ckptstore.repo.cpus import Crew, timer, usable_cpus
from ckptstore.repo.forked import ProcessLock
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore.codecs.base import ChainDecoder
    from ckptstore.repo.repository import Repository

SAMPLE_BYTES = 4 << 20  # one default chunk: per-call overheads stay small beside the bytes
LEVELS = 6
STEPS = 10  # optimizer steps between two versions of the sample
REPEATS = 7
HUGE_PAGES_FROM = 4 << 20  # numpy asks for transparent huge pages for buffers this large (checkout's tensors)
MEASURED_THREADS = 8  # at most this many restore a keyframe at once: a 256-CPU node measures 8, not 256, chunks
# Bumped when what a level costs changes, in the native decoders (tests/repo/test_chains.py holds their
# sources' digest) or in how it is measured: the costs a machine or a repository kept are measured again.
# 2: the streams the fastest of four leaves decode four lookups per load, zero runs scatter eight tokens
# at a time (a level costs half as much); 3: the restore's checksum and the threads' measured speedup;
# 4: restores and torch.load fill new memory, as a checkout does; 5: a zero-run level's gaps and bytes
# go in a buffer each thread keeps (allocated per call, they faulted new pages: 1.9 ns/byte at depth 2);
# 6: each restore's new pages are a mapping of its own, unmapped at once (kept, they grew with the CPUs);
# 7: timed less the waits for a CPU, and checkout's speedup capped by the CPUs the process may use (under load, the wall
# clock measured the load: costs kept from a busy moment chained nothing in that repository again); 8: the threads
# timed one restore each from their wake-up (7's first form timed each from its own start: 2.0x, chains too deep);
# 9: a restore that waited for a CPU counts its CPU time (beside a training job the GIL's waits read 1.0x again);
# 10: figures kept only where most timings were quiet (9's kept one quiet timing's 1.0x beside a load); 11: kept
# figures' speedup from the quiet timings alone (10's best of all was a loaded one's).
COSTS_REVISION = 11
ENV = "CKPTSTORE_CHAIN_COSTS"
FILE = "chaincost.json"
_lock = ProcessLock()  # held through a measurement (seconds): a worker forked meanwhile gets its own
_measured: dict[str, dict[int, ChainCosts]] = {}  # by machine_key(): a process pinned to fewer CPUs measures anew
_measured_at: dict[str, float] = {}  # when, by time.monotonic(): provisional figures serve PROVISIONAL_SECONDS


def chain_costs() -> dict[int, ChainCosts]:
    """This machine's costs per element width: pinned, kept by this process or the user's cache, else measured."""
    pinned = _pinned()
    if pinned:
        return pinned
    key = machine_key()
    with _lock:
        costs = _measured.get(key)
        if costs is None or (any(c.provisional for c in costs.values())
                             and time.monotonic() - _measured_at.get(key, -math.inf) >= PROVISIONAL_SECONDS):
            # provisional figures grow old in a long process too (a daemon, a training loop): measured again
            costs = _measured[key] = _machine_costs(key)
            _measured_at[key] = time.monotonic()
        return costs


def machine_file() -> Path:
    """The per-user file that keeps each machine's measurement."""
    return user_cache() / FILE


def machine_key() -> str:
    """What the costs depend on: the CPU (its name, and how many this process may use) and the codec (this version).

    The usable CPUs, not the machine's: a 1-CPU job and a whole node's share a home folder's cache.
    """
    # not platform.processor(): on Linux it runs `uname -p` in a subprocess, from a background commit's
    # thread, whose pipe a fork meanwhile (a DataLoader's workers) held open for the workers' whole life
    name = platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} x{usable_cpus()}, ckptstore {__version__}, costs r{COSTS_REVISION}"


def _machine_costs(key: str) -> dict[int, ChainCosts]:
    """The user's cache for this machine (`key`), else a new measurement added to it.

    Figures measured beside a load are kept marked provisional for PROVISIONAL_SECONDS: each command on a
    busy box measured again (reviewer 412: 2.2-7 s per CLI commit against 1.0), and none was ever kept.
    Repositories copy only figures that are not.
    """
    path = machine_file()
    try:
        entry = _read_kept(path)[key]
        costs = _costs_from(entry["costs"])
        if not entry.get("provisional"):
            return costs
        if 0 <= time.time() - float(entry["measured_at"]) < PROVISIONAL_SECONDS:
            return {width: replace(c, provisional=True) for width, c in costs.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # another machine's (or version's) figures only, or provisional ones grown old: measured and added
    try:
        costs = {width: measure(width) for width in (2, 4)}
    except (OSError, MemoryError, RuntimeError) as exc:  # no thread to start (a pids limit), no room: tunes chains only
        warn_caller(f'max_chain = "auto" could not measure what a chain level costs at checkout here ({exc}): this '
                    f"process's commits chain up to {FALLBACK} levels, and the next process measures again",
                    RuntimeWarning)
        return {}
    provisional = any(c.provisional for c in costs.values())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = _read_kept(path)  # again: another process may have added its own CPUs' figures meanwhile
        if provisional and _kept_quiet(kept.get(key)):
            return costs  # figures measured quietly meanwhile stay
        kept[key] = {"measured_at": time.time(), "costs": _costs_json(costs), "provisional": provisional}
        atomic_write(path, lambda handle: handle.write(json.dumps(kept, indent=1).encode()))
    except OSError:
        pass  # a read-only home measures in each process instead
    return costs


def _kept_quiet(entry: object) -> bool:
    """Whether a user cache's entry holds usable figures measured quietly (a damaged one is no such entry)."""
    try:
        return isinstance(entry, dict) and entry.get("provisional") is False and bool(_costs_from(entry["costs"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


PROVISIONAL_SECONDS = 3600  # figures measured beside a load serve this long, then a measurement is tried again


def _read_kept(path: Path) -> dict:
    """The user cache's figures by machine key; {} where there are none or they are damaged (rewritten)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def auto_costs(repo: Repository) -> dict[int, ChainCosts] | None:
    """The decode costs `max_chain = "auto"` chains `repo`'s tensors by (None when a number caps chains)."""
    if repo.config.encoding.max_chain != AUTO:
        return None
    return repository_costs(repo.dir)


def repository_costs(folder: Path) -> dict[int, ChainCosts]:
    """The costs of the repository whose `.ckpt` folder is `folder`: its file, else measured and kept there."""
    pinned = _pinned()
    if pinned:
        return pinned
    path = folder / FILE
    try:
        data = json.loads(path.read_text())
        if data["cpus"] == usable_cpus() and data.get("revision") == COSTS_REVISION:
            return _costs_from(data["costs"])
    except (OSError, ValueError, TypeError, KeyError):
        pass  # missing, unreadable or damaged: measured again and rewritten
    costs = chain_costs()
    if not costs or any(c.provisional for c in costs.values()):  # failed (and said so), or measured beside a load
        return costs  # nothing kept: the next process measures again
    text = json.dumps({"cpus": usable_cpus(), "revision": COSTS_REVISION, "measured_at": time.time(),
                       "costs": _costs_json(costs)})
    try:
        atomic_write(path, lambda handle: handle.write(text.encode()))
    except OSError:
        pass  # a read-only repository measures in each process instead
    return costs


def _costs_json(costs: dict[int, ChainCosts]) -> dict[int, list[float]]:
    return {w: [c.keyframe, c.level, c.load, c.workers] for w, c in costs.items()}


def _costs_from(data: dict[str, list[float]]) -> dict[int, ChainCosts]:
    """{width: ChainCosts} from their JSON form {width: [keyframe, level, load, workers]}; ValueError if not.

    Checked whole (a damaged `chaincost.json`'s list stopped every commit with an AttributeError; a string
    of digits passed as that many numbers).
    """
    if not isinstance(data, dict) or not data or not all(isinstance(v, list) and len(v) in (3, 4)
                                                          for v in data.values()):
        raise ValueError("costs are {width: [keyframe, level, load, workers]}, for one width or more")
    if any(isinstance(x, bool) for v in data.values() for x in v):  # JSON's true read as 1 s/byte: keyframes only
        raise ValueError("every cost must be a number")
    try:
        numbers = {int(w): list(map(float, v)) for w, v in data.items()}
    except OverflowError:  # an integer of 400 digits: "unexpected" where a damaged file is measured again
        raise ValueError("a cost is too large a number") from None
    if not all(0 < w < 256 for w in numbers):
        raise ValueError("widths are element sizes in bytes, 1 to 255")
    # a plausible machine's: 1e-320 s/byte overflowed the rule's level count and stopped every commit
    if not all(PLAUSIBLE[0] <= x <= PLAUSIBLE[1] for v in numbers.values() for x in v[:3]):
        raise ValueError(f"every cost must be a positive number of seconds per byte, {PLAUSIBLE[0]:g} to "
                         f"{PLAUSIBLE[1]:g}")
    if not all(1 <= v[3] <= MAX_WORKERS for v in numbers.values() if len(v) == 4):
        raise ValueError(f"the threads' speedup must be 1 to {MAX_WORKERS}")
    return {w: ChainCosts(*v) for w, v in numbers.items()}


PLAUSIBLE = (1e-15, 1.0)  # seconds per byte a decode or torch.load may take: NaN and infinity fall outside too
MAX_WORKERS = 1024


def _pinned() -> dict[int, ChainCosts] | None:
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        return _costs_from(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise CkptError(f"{ENV}={text!r} is not JSON {{width: [keyframe, level, load, workers]}} (s/byte) "
                        f"({exc}); unset it to measure") from None


def _versions(width: int) -> list[np.ndarray]:
    """Raw bytes of LEVELS + 1 successive versions of an AdamW state chunk, oldest first.

    A third each of weights and their two moments, STEPS optimizer steps apart: the moments change
    far more between commits than the weights, and their residual planes cost most of a level's
    decode (a chunk of weights alone predicted a third of what levels cost on a real fine-tune).
    """
    rng = np.random.default_rng(0)
    elements = SAMPLE_BYTES // 4
    n = -(-elements // 3)
    weights = (rng.standard_normal(n) * 0.02).astype(np.float32)
    first, second = np.zeros(n, np.float32), np.zeros(n, np.float32)
    scale = (0.5 + rng.random(n)).astype(np.float32) * 1e-3  # each parameter's gradient size
    keep_first, keep_second = 0.9**STEPS, 0.999**STEPS  # AdamW's betas over STEPS steps, taken as one
    versions = []
    for _ in range(LEVELS + 1):
        grad = rng.standard_normal(n).astype(np.float32) * scale
        first = keep_first * first + (1 - keep_first) * grad
        second = keep_second * second + (1 - keep_second) * grad * grad
        weights = weights - STEPS * 5e-5 * first / (np.sqrt(second) + 1e-8)
        bits = np.concatenate([weights, first, second])[:elements].view(np.uint32)
        # bf16 is the top half of an fp32: the same values at width 2
        versions.append((bits >> 16).astype(np.uint16).view(np.uint8) if width == 2 else bits.view(np.uint8).copy())
    return versions


def measure(width: int) -> ChainCosts:
    """Time restoring a keyframe chunk and a LEVELS-deep chain of element `width`, and torch.load of it."""
    codec = get_codec(LOSSLESS_CODEC)
    params = {"width": width, "level": 1, "chunk_bytes": SAMPLE_BYTES}
    versions = _versions(width)
    payloads = [codec.encode(versions[0], None, params)]
    for older, newer in zip(versions, versions[1:]):
        payloads.insert(0, codec.encode(newer, older, params))  # newest first, as replay hands them
    nbytes, workers = versions[0].size, min(usable_cpus(), MEASURED_THREADS)
    restore = partial(restore_into_new_pages, codec, params=params, nbytes=nbytes)
    # Best of REPEATS: the machine's capability rather than its load at this moment, which the
    # repository would keep. The timings take turns, so that a burst of load weighs on all of them,
    # not on the one it fell in, and each leaves out its threads' waits for a CPU. A keyframe restored
    # on every CPU at once says how much faster checkout's threads go than one (1.3-1.7x on the 2-core
    # benchmark VM, where the rule assumed 2x).
    with torch_load_timer(versions[-1]) as load_once, Crew(workers, lambda: restore(payloads[-1:])) as crew:
        key, deep, together, load = _best_in_turns(
            timer(lambda: restore(payloads[-1:])), timer(lambda: restore(payloads)), crew.timed, timer(load_once))
    if not np.array_equal(codec.decode_chain(payloads, params, nbytes), versions[-1]):
        raise CkptError("the chain-cost measurement decoded wrong bytes: the bytegroup codec is broken here; "
                        f"set {ENV} or max_chain to a number to commit without it")
    provisional = workers > 1 and crew.quiet_runs <= REPEATS // 2
    # kept figures come of quiet timings alone: a loaded one, timed by CPU time, reads lower (reviewer 412)
    together = together if provisional else crew.best_quiet
    speedup = min(float(workers), max(1.0, workers * key / together))
    # at least the least a kept figure may be: a chain no slower than its keyframe (noise) measured 0, and the
    # figure written was refused on reading, measured again in every process. Figures are kept only where most
    # timings of the threads were quiet: beside another process's load, by their CPU time, threads running apart
    # more than together read up to the cap (reviewer 409), and its few quiet timings are those that did not
    # overlap, down to 1.0x (reviewers 410, 411). Provisional figures serve an hour (_machine_costs).
    return ChainCosts(*(max(PLAUSIBLE[0], seconds / nbytes) for seconds in (key, (deep - key) / LEVELS, load)),
                      speedup, provisional=provisional)


def restore_into_new_pages(codec: ChainDecoder, chain: list[bytes], params: dict, nbytes: int) -> None:
    """Decode `chain` (newest first) as checkout restores a chunk: into new pages, its checksum taken.

    A buffer freed and allocated again comes back from the allocator with its pages in, where a
    checkout faults in every page of the tensors it keeps; a mapping of its own gives new pages and
    is unmapped once nothing holds it (kept instead, a measurement's outputs grew with the CPUs: 1.1
    GiB at 32). Not closed here: while a decoding error's traceback holds the array, closing raised
    BufferError in its place.
    """
    pages = mmap.mmap(-1, nbytes)
    if nbytes >= HUGE_PAGES_FROM and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)  # as numpy asks for a tensor's buffer this large
        except OSError:
            pass  # a kernel without transparent huge pages (EINVAL): numpy ignores it too
    chunk_checksum(codec.decode_chain(chain, params, nbytes, np.frombuffer(pages, dtype=np.uint8)))


def _best_in_turns(*timers: Callable[[], float], repeats: int | None = None) -> list[float]:
    """Each timer's best of `repeats` (REPEATS; each returns the seconds of one run), running them in turn."""
    best = [float("inf")] * len(timers)
    for _ in range(REPEATS if repeats is None else repeats):
        best = [min(seconds, each()) for seconds, each in zip(best, timers)]
    return best


def _best(call: Callable[[], object]) -> float:
    """The best of REPEATS runs of `call`, in seconds."""
    return _best_in_turns(timer(call))[0]

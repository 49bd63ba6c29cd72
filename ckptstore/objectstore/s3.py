"""Objects on S3-compatible storage (AWS S3, MinIO, Ceph, R2, ...), at `s3://bucket/prefix/objects/ab/cdef...`.

The client is obstore (Rust's object_store): it measured fastest here for both directions
(docs/benchmarks.md, "S3 clients"), signs requests itself and imports in milliseconds. Endpoint,
region and credentials are read the standard way: AWS_ENDPOINT_URL, AWS_REGION or
AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or a
profile of ~/.aws through boto3 when AWS_PROFILE is set.

A PUT is complete or absent, but a name can still hold other bytes (another writer's bug, a
tool that rewrote it): put() keeps an existing object when the server's ETag (the MD5 of its
content, per part for a multipart upload) matches `data`, or, with another ETag, when it reads
back as `data`; else it uploads over it. A PUT's answer whose ETag is not the MD5 of what was sent
has the object read back (`_upload`). Every object read is verified against its id, packs too:
they are read whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from ckptstore.errors import CkptError, CorruptObjectError, StoreUnavailableError
from ckptstore.hashing import ObjectId, is_hex_id, object_id
from ckptstore.objectstore.base import as_bytes, delivered
from ckptstore.paths import without_credentials

# Objects up to SINGLE_PUT go up in one PUT: a pack (at most 32 MiB) in parts took six requests,
# and twice the CPU of a local S3 server. Larger objects upload in parts of PART, several at once.
SINGLE_PUT = 64 << 20
PART = 8 << 20
PARTS_IN_FLIGHT = 8
UPLOADS_IN_FLIGHT = 8  # objects uploading at once inside batch()
DOWNLOADS_IN_FLIGHT = 16  # objects downloading at once inside read_ahead()
READ_AHEAD = 64  # objects read ahead and not yet used, at most (64 chunks of 4 MiB: 256 MiB)
BYTES_IN_FLIGHT = 512 << 20  # encoders wait when this much is queued for upload, so memory stays bounded
OWNER_KEY = "owner.json"  # beside objects/: which repository's database the prefix belongs to (repo/owner.py)
DAMAGED = "damaged/"  # beside objects/: an empty marker per object two verified reads found corrupted (_Damage)
MAX_OWNER_RECORD = 64 << 10
RETRY_SECONDS = 60.0  # how long a request is retried before the error reaches the user; CKPT_S3_RETRY_SECONDS
MAX_RETRIES = 1 << 16  # no bound of its own: RETRY_SECONDS is (at the longest backoff, 5 s, 60 s is 12-24 tries)
REQUEST_SECONDS = 300.0  # how long one request (a whole object's transfer) may take; CKPT_S3_REQUEST_SECONDS
MAX_BACKOFF_S = 5.0  # the longest wait between two tries of a request


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket[/prefix]`; the prefix has no leading or trailing slash.

    The prefix is taken as written, `#` and `?` included: they are legal in a key, and reading them
    as a URL's fragment or query would give `exp#1` and `exp#2` one prefix, so that gc in one
    repository deleted the other's objects. Segments that no key path can hold are refused.
    """
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if url.startswith("s3://") and any(c in bucket for c in "@:"):  # user:secret@bucket: never echoed
        raise StoreUnavailableError(f"{without_credentials(url)}: an S3 URL holds no credentials nor endpoint, and a "
                                    "bucket's name no '@' or ':'; give credentials as AWS_ACCESS_KEY_ID and "
                                    "AWS_SECRET_ACCESS_KEY or a profile (AWS_PROFILE), an endpoint as AWS_ENDPOINT_URL")
    if not url.startswith("s3://") or not bucket or any(c in bucket for c in "#?"):
        raise StoreUnavailableError(f"{url!r} is not an S3 URL; write s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise StoreUnavailableError(f"the prefix of {url!r} has an empty, '.' or '..' part; write s3://BUCKET/A/B")
    return bucket, prefix


def _legacy_hint(bucket: str, prefix: str) -> str:
    """Where an earlier ckptstore may have put this prefix's objects, when that was elsewhere (see parse_url)."""
    cut = min((prefix.index(mark) for mark in "#?" if mark in prefix), default=None)
    if cut is None:
        return ""
    return (f" (if an earlier ckptstore wrote this repository, it dropped {prefix[cut:]!r} from the prefix and put "
            f"the objects under s3://{bucket}/{prefix[:cut].strip('/')}: copy them here, or name that prefix)")


def _endpoint() -> str:
    """The S3 endpoint the environment names, or "" for AWS's own."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""


def _client(bucket: str) -> Any:
    """An obstore S3Store for `bucket`, configured from the environment (see the module docstring)."""
    from obstore.store import S3Store

    # the client's timeout covers a request's whole transfer, not only a silence: a 64 MiB PUT among
    # eight at once on a slow link needs minutes, so a stalled server is only found that late unless
    # the user, knowing the link, sets CKPT_S3_REQUEST_SECONDS lower
    request = _request_seconds()
    options: dict[str, Any] = {"connect_timeout": timedelta(seconds=10), "timeout": timedelta(seconds=request)}
    _check_endpoint()
    if _endpoint().startswith("http://"):
        options["allow_http"] = True
    config: dict[str, Any] = {}
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        config["region"] = region
    provider = None
    if os.environ.get("AWS_PROFILE") and not os.environ.get("AWS_ACCESS_KEY_ID"):
        from obstore.auth.boto3 import Boto3CredentialProvider  # needs boto3: only for profiles

        provider = Boto3CredentialProvider()
    # retry_timeout alone bounds the retries: 10 of them, at 0.1-5 s backoff with jitter, ran out in 3-5 s, so a
    # server restarting for 8 s failed the commit where CKPT_S3_RETRY_SECONDS promises 60 s
    retrying = timedelta(seconds=_seconds("CKPT_S3_RETRY_SECONDS", RETRY_SECONDS))
    retry = {"max_retries": MAX_RETRIES, "retry_timeout": retrying,
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=MAX_BACKOFF_S),
                         "base": 2}}
    return S3Store(bucket, config=config, client_options=options, retry_config=retry,
                   credential_provider=provider)


def _request_seconds() -> float:
    """How long one request may take (CKPT_S3_REQUEST_SECONDS, at least a second)."""
    return max(1.0, _seconds("CKPT_S3_REQUEST_SECONDS", REQUEST_SECONDS))


def _check_endpoint() -> None:
    """Refuse an endpoint variable set to what is no URL (the client library would panic on it)."""
    # the one in effect: the S3 one wins where set (an empty AWS_ENDPOINT_URL beside it is then not read)
    variable = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") is not None else "AWS_ENDPOINT_URL"
    value = os.environ.get(variable)
    if value is not None and not re.fullmatch(r"https?://[^\s/?#]+(/\S*)?", value):
        raise CkptError(f"{variable}={value!r} is not an endpoint URL: give http(s)://HOST[:PORT], or unset it "
                        "for AWS's own")


def _seconds(variable: str, default: float) -> float:
    """The environment's `variable`, else `default`; anything but a number of seconds, 0 or more, is refused."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < 10**9:  # NaN fails it too
        raise CkptError(f"{variable}={text!r}: give a number of seconds (0 to 10^9)")
    return seconds


class S3Ranges:
    """The S3 store's RangeReader: a pack is fetched whole once, verified, and kept while in use.

    A GET per payload cost a round trip for each of a pack's hundreds of small tensors; a
    whole pack (at most pack.PACK_BYTES) costs one, and is verified against its id on the way.
    """

    def __init__(self, store: S3ObjectStore) -> None:
        from ckptstore.objectstore.pack import PackReader

        self._packs = PackReader(store, verify=True)

    def read(self, oid: ObjectId, offset: int, length: int, into: Any = None) -> bytes | memoryview:
        return delivered(self._packs.read(oid, offset, length), into)

    def close(self) -> None:
        self._packs = None


class S3ObjectStore:
    """Immutable objects in a bucket; puts inside batch() upload in the background, several at once."""

    def __init__(self, url: str) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._objects = f"{self.prefix}/objects/" if self.prefix else "objects/"
        # the longest a delete sent now may take to land, as the client below is set up: its last try starts within
        # the retry budget (after at most one backoff) and takes at most one request's limit (gc's lease, maintenance)
        self.delete_lands_within = (_seconds("CKPT_S3_RETRY_SECONDS", RETRY_SECONDS) + MAX_BACKOFF_S
                                    + _request_seconds())
        try:
            self._client = _client(self.bucket)
        except CkptError:
            raise
        except BaseException as exc:  # a missing profile or secret key; the client library's panics are BaseExceptions
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CkptError(f"{self.url}: the S3 client cannot be set up from this environment ({_said(exc)}): check "
                            "AWS_PROFILE, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
        self._batch: _Uploads | None = None
        self._ahead: _ReadAhead | None = None
        self._etags_differ = False  # its ETags proved to be no MD5 of the bytes (see _upload, holds)
        self._etag_verdict = threading.Lock()
        self.damage = _Damage(self)

    def key(self, oid: ObjectId) -> str:
        """The object's key in the bucket."""
        return f"{self._objects}{oid[:2]}/{oid[2:]}"

    def call(self, operation: Any, oid: ObjectId, *args: Any, **kwargs: Any) -> Any:
        """`operation(client, key of oid, ...)`, with obstore's errors as ckptstore's (see `_errors`)."""
        with self._errors(oid):
            return operation(self._client, self.key(oid), *args, **kwargs)

    @contextlib.contextmanager
    def _errors(self, oid: ObjectId | None = None) -> Iterator[None]:
        """The client's errors in the block as ckptstore's: `oid` missing, or the store unavailable and why."""
        from obstore.exceptions import NotFoundError

        try:
            yield
        except (NotFoundError, FileNotFoundError) as exc:  # obstore raises either, by operation
            if "NoSuchBucket" in str(exc):  # the bucket, not the object: a PUT says so too
                raise unavailable(self.url, exc) from None
            if oid is None:
                raise
            raise CorruptObjectError(oid, "missing" + _legacy_hint(self.bucket, self.prefix)) from None
        except Exception as exc:
            if type(exc).__module__.startswith("obstore"):
                raise unavailable(self.url, exc) from None
            raise

    # ----------------------------------------------------------------- writing
    def put(self, data: bytes | memoryview) -> ObjectId:
        """Store `data` (in the background inside batch()); an object already there is kept when its ETag matches."""
        oid = object_id(data)
        if self._batch is not None:
            self._batch.submit(oid, data)
        else:
            self._upload(oid, data)
        return oid

    def _upload(self, oid: ObjectId, data: bytes | memoryview) -> None:
        import obstore

        data = as_bytes(data)
        if not self.damage.known(oid) and self.holds(oid, lambda: data):  # a damaged one: its ETag may be stale
            self.damage.discard([oid])  # its exact bytes are there: whole again (another machine's rewrite)
            return
        stored = self.call(obstore.put, oid, data, use_multipart=len(data) > SINGLE_PUT, chunk_size=PART,
                           max_concurrency=PARTS_IN_FLIGHT)
        self.damage.discard([oid])
        tag = (stored.get("e_tag") or "").strip('"')
        if not tag or self._etags_differ or tag == etag(data):
            return
        with self._etag_verdict:  # the first such answer decides while the other uploads wait
            if self._etags_differ:
                return
            if not self._reads_back(oid):
                raise StoreUnavailableError(
                    f"S3 store {self.url}: the server kept other bytes for object {oid[:12]} than were sent (its "
                    f"ETag {tag} is not theirs, and reading it back gives other bytes); nothing was recorded: run "
                    "the command again, and check the server or any proxy before it")
            self._etags_differ = True  # the bytes are right: this bucket's ETags are no MD5s (SSE-KMS, gateways)

    def holds(self, oid: ObjectId, data: Callable[[], bytes | memoryview]) -> bool:
        """Whether the bucket holds exactly `oid`'s bytes: its size and ETag (one HEAD), not its name alone.

        An object of the right size whose ETag is not the bytes' MD5 (uploaded by another tool in
        other parts, or in a bucket whose ETags are no MD5s: SSE-KMS) is read back and hashed instead.
        """
        import obstore

        try:
            found = self.call(obstore.head, oid)
        except CorruptObjectError:  # not there
            return False
        payload = as_bytes(data())
        if found["size"] != len(payload):
            return False
        if _holds(found, payload):  # an MD5 that matches is proof, whatever the bucket's kind
            return True
        # an ETag that is no MD5 of these bytes: another tool's part sizes, or this bucket's kind (only a PUT's own
        # answer decides the latter, see _upload); this one object is read back either way
        return self._reads_back(oid)

    def _reads_back(self, oid: ObjectId) -> bool:
        """Whether `oid` reads back as its bytes (a GET, hashed)."""
        try:
            self._fetch(oid)
        except CorruptObjectError:
            return False
        return True

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Upload the block's puts in the background; the block's end waits for all and raises the first error."""
        if self._batch is not None:  # nested: the outer block waits
            yield
            return
        self._batch = _Uploads(self)
        try:
            yield
        except BaseException:
            self._batch.wait(raise_errors=False)
            raise
        else:
            self._batch.wait(raise_errors=True)
        finally:
            self._batch = None

    def delete(self, oid: ObjectId) -> None:
        import obstore

        with contextlib.suppress(CorruptObjectError):
            self.call(obstore.delete, oid)
        self.damage.discard([oid])

    def clear_tmp(self) -> int:
        """Nothing to clear: a PUT that did not complete left no object.

        An unfinished multipart upload is invisible; the bucket's lifecycle rule reclaims it (docs/guide.md).
        """
        return 0

    # ----------------------------------------------------------------- reading
    def get(self, oid: ObjectId, verify: bool = True) -> bytes:
        """The bytes of `oid`, always verified: they crossed a network (`verify` is accepted and ignored)."""
        return bytes(self.view(oid))

    def view(self, oid: ObjectId, verify: bool = True) -> memoryview:
        """The bytes of `oid` without a copy, verified against the id (read ahead, where it was)."""
        ahead = self._ahead
        if ahead is not None:
            data = ahead.take(oid)
            if data is not None:
                return data
        return self._fetch(oid)

    @contextlib.contextmanager
    def read_ahead(self, oids: Iterable[ObjectId]) -> Iterator[None]:
        """Fetch `oids` in order, several at once and at most READ_AHEAD ahead of their use, during the block."""
        if self._ahead is not None:  # nested: the outer block reads ahead already
            yield
            return
        self._ahead = _ReadAhead(self, list(dict.fromkeys(oids)))
        try:
            yield
        finally:
            ahead, self._ahead = self._ahead, None
            ahead.close()

    def _fetch(self, oid: ObjectId) -> memoryview:
        """The bytes of `oid`, verified; bytes that do not match are read once more before `oid` is called corrupted.

        Bytes can be damaged on their way (a gateway's short body with a Content-Length that says so, a
        flipped bit), and a damaged/ marker counts for every machine using the bucket: only a second read
        that does not match either marks it. A read that matches takes off a marker this process knows of.
        """
        data = self._get(oid)
        if object_id(data) != oid:
            data = self._get(oid)
            if object_id(data) != oid:
                self.damage.add(oid)
                raise CorruptObjectError(oid, f"corrupted (the {len(data)} bytes {self.url} returned do not match "
                                              "its hash, also when read again)")
        self.damage.discard([oid])  # its exact bytes are there: a marker set on a read damaged in transit is false
        return data

    def _get(self, oid: ObjectId) -> memoryview:
        """The bytes the bucket returns for `oid`, unverified."""
        import obstore

        # the body streams in .bytes(): read inside call's error mapping, so a server lost mid-body is one line
        return memoryview(self.call(lambda client, key: obstore.get(client, key).bytes(), oid))

    def open_ranges(self) -> S3Ranges:
        return S3Ranges(self)

    # ----------------------------------------------------------------- the prefix's owner (repo/owner.py)
    def owner_record(self) -> dict | str | None:
        """The prefix's `owner.json`, which names the repository it belongs to; None where there is none.

        One that is no record comes back as its text: it still names someone, so nothing is deleted on its word.
        """
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            with self._errors():
                data = bytes(obstore.get(self._client, self._owner_key()).bytes())
        except (NotFoundError, FileNotFoundError):
            return None
        try:
            record = json.loads(data[:MAX_OWNER_RECORD])
        except (ValueError, RecursionError):
            record = None
        return record if isinstance(record, dict) else data[:200].decode(errors="replace")

    def write_owner(self, record: dict) -> None:
        """Write the prefix's `owner.json` over whatever is there."""
        import obstore

        with self._errors():
            obstore.put(self._client, self._owner_key(), json.dumps(record).encode())

    def delete_owner(self) -> None:
        """Delete the prefix's `owner.json` (a claim its failed init leaves behind)."""
        import obstore

        with self._errors():
            obstore.delete(self._client, self._owner_key())

    def claim_owner(self, record: dict) -> bool:
        """Write the prefix's `owner.json` where there is none (a create-only PUT); False where one came first."""
        import obstore
        from obstore.exceptions import AlreadyExistsError

        with self._errors():  # which would call the refusal the server's failure: caught inside it
            try:
                obstore.put(self._client, self._owner_key(), json.dumps(record).encode(), mode="create")
            except AlreadyExistsError:
                return False
        return True

    def _owner_key(self) -> str:
        return f"{self.prefix}/{OWNER_KEY}" if self.prefix else OWNER_KEY

    def has(self, oid: ObjectId) -> bool:
        try:
            self.size(oid)
        except CorruptObjectError:
            return False
        return True

    def size(self, oid: ObjectId) -> int:
        import obstore

        return int(self.call(obstore.head, oid)["size"])

    def iter_ids(self) -> Iterator[ObjectId]:
        return (oid for oid, _ in self.iter_sizes())

    def iter_sizes(self) -> Iterator[tuple[ObjectId, int]]:
        import obstore

        with self._errors():
            for page in obstore.list(self._client, prefix=self._objects, chunk_size=1000):
                for item in page:
                    name = item["path"][len(self._objects):].replace("/", "")
                    if is_hex_id(name):
                        yield ObjectId(name), int(item["size"])


class _Damage:
    """The bucket's list of objects two verified reads running found corrupted, as damaged/OID markers all can see.

    As a local store's damagelist.py: a commit stores such objects' tensors again instead of reusing a
    record (committing the file again reused the corrupted object, "0 B new"), and the put of an
    object's exact bytes, or a verified read that matches (the marker came of reads damaged in transit), takes
    its marker off. `ids` lists them (one request, at each commit); the markers this process knows of
    are what a put, a delete or a sound read removes. Best effort: a bucket this
    process may not write to keeps none, and the read's error still says the damage.
    """

    def __init__(self, store: S3ObjectStore) -> None:
        self._store = store
        self._prefix = f"{store.prefix}/{DAMAGED}" if store.prefix else DAMAGED
        self._known: set[ObjectId] = set()
        self._lock = threading.Lock()

    def ids(self) -> frozenset[ObjectId]:
        """The objects marked damaged now (an empty set where the bucket cannot be listed)."""
        import obstore

        found: set[ObjectId] = set()
        with contextlib.suppress(Exception):  # noqa: BLE001 - a listing refused: nothing to go by, as a local store
            for page in obstore.list(self._store._client, prefix=self._prefix, chunk_size=1000):
                found.update(ObjectId(name) for item in page if is_hex_id(name := item["path"][len(self._prefix):]))
        with self._lock:
            self._known = set(found)
        return frozenset(found)

    def known(self, oid: ObjectId) -> bool:
        """Whether this process found `oid` marked (a put then writes it whatever its ETag says)."""
        with self._lock:
            return oid in self._known

    def add(self, oid: ObjectId) -> None:
        import obstore

        with contextlib.suppress(Exception):  # noqa: BLE001 - best effort (see the class)
            obstore.put(self._store._client, self._prefix + oid, b"")
            with self._lock:
                self._known.add(oid)

    def discard(self, oids: Iterable[ObjectId]) -> None:
        import obstore

        with self._lock:
            gone = self._known & set(oids)
            self._known -= gone
        for oid in gone:
            with contextlib.suppress(Exception):  # noqa: BLE001 - best effort (see the class)
                obstore.delete(self._store._client, self._prefix + oid)


class _ReadAhead:
    """Objects fetched ahead of use: a feeder starts downloads in order while fewer than READ_AHEAD wait unused."""

    def __init__(self, store: S3ObjectStore, oids: list[ObjectId]) -> None:
        self._store = store
        self._pool = ThreadPoolExecutor(DOWNLOADS_IN_FLIGHT, thread_name_prefix="ckpt-s3-get")
        self._room = threading.Semaphore(READ_AHEAD)
        self._fetched: dict[ObjectId, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._feeder = threading.Thread(target=self._feed, args=(oids,), daemon=True, name="ckpt-s3-ahead")
        self._feeder.start()

    def _feed(self, oids: list[ObjectId]) -> None:
        for oid in oids:
            self._room.acquire()
            with self._lock:
                if self._closed:
                    return
                self._fetched[oid] = self._pool.submit(self._store._fetch, oid)

    def take(self, oid: ObjectId) -> memoryview | None:
        """The object's bytes if it was read ahead (waiting for its download), else None; errors re-raised."""
        with self._lock:
            future = self._fetched.pop(oid, None)
        if future is None:
            return None
        self._room.release()
        return future.result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            dropped, self._fetched = list(self._fetched.values()), {}
        for future in dropped:
            future.cancel()
        self._room.release()  # a feeder waiting for room wakes up and sees the block has ended
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Uploads:
    """Uploads in flight inside one batch(): bounded in count and bytes; the first failure ends the batch.

    Under a lasting outage each queued upload spent a whole retry budget of its own, eight at a time, so a
    commit failed after (objects / 8) x CKPT_S3_RETRY_SECONDS: once one upload has failed, those queued are
    dropped and every later submit raises that failure; the uploads in flight may finish.
    """

    def __init__(self, store: S3ObjectStore) -> None:
        self._store = store
        self._pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="ckpt-s3")
        self._futures: list[Future] = []
        self._room = threading.Condition()
        self._queued = 0
        self._submitted: set[ObjectId] = set()
        self._failed: BaseException | None = None  # the first upload's failure: what the batch raises

    def submit(self, oid: ObjectId, data: bytes | memoryview) -> None:
        self._raise_failure()
        if oid in self._submitted:
            return
        self._submitted.add(oid)
        data = data if isinstance(data, bytes) else bytes(data)  # the caller may reuse its buffer
        with self._room:  # a failure wakes it too: the uploads dropped never give their room back
            self._room.wait_for(lambda: self._failed is not None or self._queued == 0
                                or self._queued + len(data) <= BYTES_IN_FLIGHT)
            self._raise_failure()
            self._queued += len(data)
        self._futures.append(self._pool.submit(self._run, oid, data))

    def _run(self, oid: ObjectId, data: bytes) -> None:
        try:
            if self._failed is None:  # else queued behind a failure, and not dropped in time: not tried
                self._store._upload(oid, data)
        except BaseException as exc:
            with self._room:
                if self._failed is None:
                    self._failed = exc
            for future in list(self._futures):  # those not started yet; a running one is not cancelled
                future.cancel()
            raise
        finally:
            with self._room:
                self._queued -= len(data)
                self._room.notify_all()

    def _raise_failure(self) -> None:
        if self._failed is not None:
            raise self._failed

    def wait(self, raise_errors: bool) -> None:
        self._pool.shutdown(wait=True)
        if raise_errors:
            self._raise_failure()


def _holds(found: dict[str, Any], data: bytes | memoryview) -> bool:
    """Whether the object `found` (a HEAD's answer) holds `data`: as uploaded now, or in parts as before 64 MiB PUTs."""
    if found["size"] != len(data):
        return False
    tag = (found.get("e_tag") or "").strip('"')
    return tag == etag(data) or (PART < len(data) <= SINGLE_PUT and tag == parts_etag(data))


def etag(data: bytes | memoryview) -> str:
    """The ETag S3 gives `data` as this store uploads it: its MD5, or past SINGLE_PUT that of its parts."""
    import hashlib

    if len(data) <= SINGLE_PUT:
        return hashlib.md5(data, usedforsecurity=False).hexdigest()
    return parts_etag(data)


def parts_etag(data: bytes | memoryview) -> str:
    """The ETag of `data` uploaded in parts of PART: the MD5 of the parts' MD5s, and their count."""
    import hashlib

    view = memoryview(data)
    parts = [hashlib.md5(view[at:at + PART], usedforsecurity=False).digest() for at in range(0, len(view), PART)]
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


def _said(exc: BaseException) -> str:
    """The client's error on one line, without its dump of its own state ("Debug source: …": no help)."""
    return " ".join(str(exc).split()).split(" Debug source:")[0]


def unavailable(url: str, exc: BaseException) -> StoreUnavailableError:
    """The client's error as one line naming the store, what happened and what to do."""
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    dump = str(exc)  # the client's dump of its state is all that tells a request timed out from a refused connection
    text = _said(exc)
    endpoint = _endpoint() or "the default AWS endpoint"
    # said only where the client did ask again: a missing Content-Length, or a 403, is not retried
    again = ", also when asked again" if re.search(r"after [1-9]\d* retries", text) else ""
    # the response's error code, not a name in the URL (a prefix "ExpiredTokenTest" made every error an expiry)
    if re.search(r"<Code>(ExpiredToken|TokenRefreshRequired)</Code>", dump):  # refused, but the keys are right
        advice = ("the session token expired: refresh AWS_SESSION_TOKEN (with AWS_ACCESS_KEY_ID and "
                  "AWS_SECRET_ACCESS_KEY), or the credentials of the profile AWS_PROFILE names")
    elif isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or any(
            word in text for word in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403 Forbidden")):
        # a HEAD's refusal has no body to name its code: with a session token, it may be the token's expiry
        expired = (" (or, with AWS_SESSION_TOKEN set, the session token expired: refresh it)"
                   if os.environ.get("AWS_SESSION_TOKEN") and "<Code>" not in dump else "")
        advice = ("the credentials were refused: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                  f"and the bucket's permissions{expired}")
    elif "NoSuchBucket" in text:  # no "nothing was lost": a bucket gone took the objects in it along
        return StoreUnavailableError(
            f"S3 store {url}: the bucket does not exist: check the URL. If it held this repository's objects, they "
            "went with it, and a new empty bucket brings none back: restore it from a backup (`ckpt fsck` then "
            f"lists what is still missing); for a new repository, create it ({_short(text)})")
    elif "kind: Timeout" in dump:  # connected, and no whole answer in time (obstore says "error sending request")
        advice = (f"{endpoint} did not answer within CKPT_S3_REQUEST_SECONDS ({_request_seconds():g} s){again}: check "
                  "that it is up, or give a slow link more time with CKPT_S3_REQUEST_SECONDS")
    elif "error sending request" in text or "connection refused" in text.lower():
        advice = f"cannot reach {endpoint}: check that it is up and that AWS_ENDPOINT_URL names it"
    else:
        advice = f"the server at {endpoint} failed{again}"
    return StoreUnavailableError(f"S3 store {url}: {advice}. Nothing was lost: run the command again once it is "
                                 f"fixed; it resumes where it stopped ({_short(text)})")


def _short(text: str) -> str:
    return text if len(text) <= 300 else text[:297] + "..."

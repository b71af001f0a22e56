"""Uploader primitives for the drain (no fsmeta knowledge: callbacks/records only).

* :func:`upload_file` - single PUT or resumable multipart upload of one local
  file, with the file's BLAKE3 in ``x-amz-meta-blake3``.
* :func:`retry_forever` - exponential backoff with jitter, no time limit for
  retryable errors, visible retry state, immediate raise for permanent ones.
* :func:`hash_file` - BLAKE3 of a file off the event loop (pooled hashers).
* :func:`abort_stale_uploads` - abort multipart uploads we do not know about.

BLAKE3 and multipart: the hash must be known at CreateMultipartUpload time
(user metadata cannot be changed afterwards without rewriting the object).  We
hash first (one extra sequential read, normally from the page cache, BLAKE3
on all cores) and then upload; the alternative - upload, then a server-side
CopyObject onto itself with the metadata - would rewrite the whole object on
the server (UploadPartCopy beyond 5 GiB; radosgw copies the data), leave a
window where the object exists without its hash, and cost seconds per GiB of
cluster bandwidth instead of ~0.2 CPU s/GiB locally.  Small files (single PUT)
are read once: the same buffer is hashed and sent.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

import blake3
import trio

from . import localio
from .store import (
    MiB,
    NoSuchUploadError,
    ObjectStore,
    PartRecord,
    PutResult,
    StoreError,
    UploadInfo,
    collapse_exception_group,
    exception_leaves,
    normalize_etag,
)

log = logging.getLogger(__name__)

__all__ = [
    "META_BLAKE3",
    "UploadRecord",
    "UploadResult",
    "UploadAborted",
    "RetryState",
    "retry_forever",
    "backoff_delay",
    "hash_file",
    "upload_file",
    "upload_bytes",
    "plan_parts",
    "abort_stale_uploads",
]

META_BLAKE3 = "blake3"
DEFAULT_PART_SIZE = 64 * MiB
HASH_CHUNK = 8 * MiB

T = TypeVar("T")


class UploadAborted(Exception):
    """``should_abort()`` returned True; the multipart upload (if any) was aborted."""


# --------------------------------------------------------------------------
# records


@dataclasses.dataclass
class UploadRecord:
    """Persistable state of a multipart upload, enough to resume it.

    The caller stores ``to_dict()`` (JSON-safe) in ``on_created`` and
    ``on_part_done`` and passes ``UploadRecord.from_dict(...)`` back as
    ``resume=``.  ``parts`` maps part number -> :class:`PartRecord`.
    """

    key: str
    upload_id: str
    part_size: int
    size: int
    blake3: str
    checksum_algorithm: str | None
    parts: dict[int, PartRecord] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "upload_id": self.upload_id,
            "part_size": self.part_size,
            "size": self.size,
            "blake3": self.blake3,
            "checksum_algorithm": self.checksum_algorithm,
            "created": self.created,
            "parts": [p.to_dict() for _, p in sorted(self.parts.items())],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UploadRecord:
        parts = {int(p["number"]): PartRecord.from_dict(p) for p in d.get("parts", [])}
        return cls(
            key=d["key"],
            upload_id=d["upload_id"],
            part_size=int(d["part_size"]),
            size=int(d["size"]),
            blake3=d["blake3"],
            checksum_algorithm=d.get("checksum_algorithm"),
            parts=parts,
            created=float(d.get("created", 0.0)),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> UploadRecord:
        return cls.from_dict(json.loads(s))


@dataclasses.dataclass(frozen=True)
class UploadResult:
    key: str
    etag: str
    size: int
    blake3: str
    multipart: bool
    upload_id: str | None = None
    parts: int = 1
    parts_uploaded: int = 1  #: parts sent by this call (resume: only the missing ones)
    parts_reused: int = 0  #: parts taken over from the resumed upload
    bytes_uploaded: int = 0
    restarts: int = 0  #: times the upload was started over (upload id gone / record unusable)


# --------------------------------------------------------------------------
# retries


@dataclasses.dataclass(frozen=True)
class RetryState:
    """Passed to ``on_retry`` after each retryable failure."""

    what: str  #: operation description, e.g. "UploadPart 7 of run1/model.pt"
    attempt: int  #: failures so far (1 = first failure)
    error: StoreError
    delay: float  #: seconds we sleep before the next attempt
    since: float  #: time.monotonic() of the first failure of this streak

    @property
    def code(self) -> str:
        return self.error.code

    def describe(self) -> str:
        return f"retrying: {self.error.code} (attempt {self.attempt}) {self.what}".rstrip()


def backoff_delay(attempt: int, base: float = 0.2, cap: float = 30.0, rng: random.Random | None = None) -> float:
    """"Equal jitter" exponential backoff: d = min(cap, base * 2**(attempt-1)),
    sleep uniformly in [d/2, d].  Never ~0 (unlike full jitter), so a
    throttling server really gets relief."""
    d = min(cap, base * (2 ** min(attempt - 1, 62)))
    r = (rng or random).random()
    return d / 2 + r * d / 2


async def retry_forever(
    op: Callable[[], Awaitable[T]],
    *,
    what: str = "",
    base: float = 0.2,
    cap: float = 30.0,
    on_retry: Callable[[RetryState | None], Any] | None = None,
    should_abort: Callable[[], bool] | None = None,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[Any]] = trio.sleep,
) -> T:
    """Call ``await op()`` until it succeeds.

    * retryable :class:`StoreError` (``e.retryable``): back off
      (:func:`backoff_delay`) and retry, with no limit on time or attempts;
      ``on_retry(RetryState)`` is called before each sleep so the caller can
      expose e.g. ``"retrying: SlowDown (attempt 7)"``;
    * after a streak of failures, on success ``on_retry(None)`` (state cleared);
    * permanent StoreError or any other exception: raised immediately;
    * ``should_abort()`` is polled while sleeping -> :class:`UploadAborted`.
    Cancellation (trio) works at any point.
    """
    attempt = 0
    since = 0.0
    while True:
        if should_abort is not None and should_abort():
            raise UploadAborted(what or "aborted")
        try:
            result = await op()
        except StoreError as e:
            if not e.retryable:
                raise
            attempt += 1
            if attempt == 1:
                since = time.monotonic()
            delay = backoff_delay(attempt, base, cap, rng)
            state = RetryState(what or (e.op or ""), attempt, e, delay, since)
            log.warning("%s (next try in %.2fs): %s", state.describe(), delay, e)
            if on_retry is not None:
                await _maybe_await(on_retry(state))
            if should_abort is None:
                await sleep(delay)
            else:
                deadline = trio.current_time() + delay if sleep is trio.sleep else None
                if deadline is None:
                    await sleep(delay)
                else:
                    while trio.current_time() < deadline:
                        if should_abort():
                            raise UploadAborted(what or "aborted") from e
                        await trio.sleep(min(0.25, deadline - trio.current_time()))
            continue
        if attempt and on_retry is not None:
            await _maybe_await(on_retry(None))
        return result


async def _maybe_await(x):
    if inspect.isawaitable(x):
        return await x
    return x


# --------------------------------------------------------------------------
# hashing


class _HasherPool:
    """blake3 hashers with ``max_threads>1`` each own a thread pool: keep and
    ``reset()`` them instead of building one per file."""

    def __init__(self, max_idle: int = 4):
        self._free: list = []
        self._lock = threading.Lock()
        self._max_idle = max_idle

    def get(self):
        with self._lock:
            if self._free:
                return self._free.pop()
        return blake3.blake3(max_threads=blake3.blake3.AUTO)

    def put(self, h) -> None:
        h.reset()
        with self._lock:
            if len(self._free) < self._max_idle:
                self._free.append(h)


_hashers = _HasherPool()
_hash_buffers = localio.BufferPool(max_idle=4)


def hash_file_sync(path: str | os.PathLike | int, size: int | None = None) -> tuple[str, int]:
    """BLAKE3 hex of the file (blocking; worker thread only).  Returns (hex, bytes)."""
    own = not isinstance(path, int)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if own else path
    h = _hashers.get()
    buf = _hash_buffers.get(HASH_CHUNK)
    try:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        mv = memoryview(buf)[:HASH_CHUNK]
        pos = 0
        while size is None or pos < size:
            want = HASH_CHUNK if size is None else min(HASH_CHUNK, size - pos)
            n = os.preadv(fd, [mv[:want]], pos)
            if n == 0:
                break
            h.update(mv[:n])
            pos += n
        if size is not None and pos != size:
            raise localio.SourceChangedError(f"file has {pos} bytes, expected {size}")
        return h.hexdigest(), pos
    finally:
        _hash_buffers.put(buf)
        _hashers.put(h)
        if own:
            os.close(fd)


async def hash_file(path: str | os.PathLike, size: int | None = None) -> str:
    """BLAKE3 hex digest of a file, computed in a worker thread (BLAKE3 itself
    uses all cores and releases the GIL)."""
    # Abandon on cancel: a hash nobody waits for any more must not delay shutdown
    # (the thread finishes on its own; its result is dropped).
    hexd, _ = await trio.to_thread.run_sync(hash_file_sync, os.fspath(path), size, abandon_on_cancel=True)
    return hexd


_put_buffers = localio.BufferPool(max_idle=2)


def release_buffers() -> None:
    """Drop the uploader's idle read buffers (the drain calls this when it goes idle)."""
    _hash_buffers.clear()
    _put_buffers.clear()


def _read_whole_hashing(path: str, size: int) -> tuple[bytearray, str]:
    """Read a small file into a pooled buffer, hashing it on the way (one read
    for both the BLAKE3 and the PUT body).  Return the buffer to _put_buffers."""
    buf = _put_buffers.get(size)
    big = size >= 4 * MiB
    h = _hashers.get() if big else blake3.blake3()
    try:
        localio.read_range(path, 0, size, memoryview(buf), [h])
        return buf, h.hexdigest()
    except BaseException:
        _put_buffers.put(buf)
        raise
    finally:
        if big:
            _hashers.put(h)


# --------------------------------------------------------------------------
# upload


def plan_parts(
    size: int,
    part_size: int,
    *,
    min_part_size: int = 5 * MiB,
    max_part_size: int = 5 * 1024 * MiB,
    max_parts: int = 10_000,
) -> int:
    """Effective part size: within [min_part_size, max_part_size], and large
    enough (rounded up to a MiB) that the file fits in ``max_parts`` parts."""
    ps = min(max(part_size, min_part_size), max_part_size)
    if size > ps * max_parts:
        ps = math.ceil(size / max_parts / MiB) * MiB
        if ps > max_part_size:
            raise ValueError(f"{size} bytes do not fit in {max_parts} parts of at most {max_part_size} bytes")
    return ps


def _stat_id(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)


async def upload_file(
    store: ObjectStore,
    key: str,
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    size: int | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    concurrency: int = 8,
    part_limiter: trio.CapacityLimiter | None = None,
    resume: UploadRecord | Mapping | Any | None = None,
    on_created: Callable[[UploadRecord], Any] | None = None,
    on_part_done: Callable[[PartRecord], Any] | None = None,
    before_complete: Callable[[], bool | Awaitable[bool]] | None = None,
    should_abort: Callable[[], bool] | None = None,
    on_retry: Callable[[RetryState | None], Any] | None = None,
    retry: Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]] | None = None,
    storage_class: str | None = None,
    content_type: str | None = None,
    blake3_hex: str | None = None,
    retry_base: float = 0.2,
    retry_cap: float = 30.0,
    abort_poll: float = 0.2,
) -> UploadResult:
    """Upload the local file ``path`` to ``key``.

    * ``size <= part_size``: one PUT (file read once: hashed and sent from the
      same buffer).
    * otherwise multipart with ``concurrency`` parts in flight (and, if given,
      a ``part_limiter`` shared by all concurrent uploads of the process).
      The file's BLAKE3 is computed first (see module doc) and stored as user
      metadata ``blake3`` together with ``metadata``.
    * ``size``: expected size; a different file size raises
      :class:`~ckptfs.drain.localio.SourceChangedError`.
    * ``blake3_hex``: the file's BLAKE3 if the caller already knows it
      (trusted for multipart: skips the hash pass; checked for single PUTs).
    * ``resume``: state saved from an earlier attempt - an :class:`UploadRecord`,
      its ``to_dict()``, or any object with ``key, upload_id, part_size, size,
      blake3, parts`` attributes (parts: PartRecords or their dicts).  Used if it
      is for the same key, size, BLAKE3 (and checksum algorithm, when recorded)
      and the server still has the upload (``list_parts``); recorded parts whose
      etag/size match the server's are kept, the others are (re)sent.
      Otherwise the old upload is aborted (best effort) and a new one started.
    * ``on_created(record)``: after CreateMultipartUpload - persist
      ``record.upload_id``/``blake3``/``part_size`` here.
    * ``on_part_done(part)``: after each part (``record.parts`` already has it);
      called from concurrent worker tasks; may be async.  If it raises, the
      upload stops *without* aborting (it stays resumable) and the exception
      propagates.
    * ``before_complete()``: last check before the object becomes visible
      (before CompleteMultipartUpload, or before the single PUT; sync or
      async).  False -> the upload is aborted and :class:`UploadAborted` is
      raised.
    * ``should_abort()``: polled every ``abort_poll`` s (and between retries);
      when True, in-flight parts are cancelled, the multipart upload is
      aborted and :class:`UploadAborted` is raised.
    * ``on_retry``: see :func:`retry_forever` (retryable errors never give up).
      ``retry(what, op)``: replaces :func:`retry_forever` entirely with the
      caller's own policy.
    * Permanent store errors propagate; the multipart upload is left in place
      for a later resume (or :func:`abort_stale_uploads`).  If the file changes
      during the upload (size/mtime/inode), the upload is aborted and
      :class:`ckptfs.drain.localio.SourceChangedError` is raised.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    path = os.fspath(path)
    st0 = await trio.to_thread.run_sync(os.stat, path)
    if size is not None and st0.st_size != size:
        raise localio.SourceChangedError(f"{path} has {st0.st_size} bytes, expected {size}")
    size = st0.st_size
    meta = dict(metadata or {})
    user_retry = retry

    def retry(op, what):
        if user_retry is not None:
            return user_retry(what, op)
        return retry_forever(
            op, what=what, base=retry_base, cap=retry_cap, on_retry=on_retry, should_abort=should_abort
        )

    if should_abort is not None and should_abort():
        raise UploadAborted(key)

    # ---- small file: single PUT, one read --------------------------------
    resume = _coerce_record(resume)
    if size <= part_size:
        if resume is not None:
            await _abort_quietly(store, resume.key, resume.upload_id)
        buf, digest = await trio.to_thread.run_sync(_read_whole_hashing, path, size)
        try:
            if blake3_hex is not None and blake3_hex != digest:
                raise localio.SourceChangedError(f"{path}: blake3 {digest} != expected {blake3_hex}")
            meta[META_BLAKE3] = digest
            st1 = await trio.to_thread.run_sync(os.stat, path)
            if _stat_id(st1) != _stat_id(st0):
                raise localio.SourceChangedError(f"{path} changed while being read")
            data = memoryview(buf)[:size]
            if before_complete is not None and not await _maybe_await(before_complete()):
                raise UploadAborted(f"upload of {key} cancelled by before_complete()")
            res = await retry(
                lambda: store.put_object(key, data, meta, storage_class=storage_class, content_type=content_type),
                f"PutObject {key}",
            )
        finally:
            _put_buffers.put(buf)
        return UploadResult(key, res.etag, size, digest, False, bytes_uploaded=size)

    # ---- multipart -----------------------------------------------------------
    digest = blake3_hex or await hash_file(path, size)
    meta[META_BLAKE3] = digest
    job = _Multipart(
        store=store,
        key=key,
        path=path,
        size=size,
        st0=st0,
        meta=meta,
        digest=digest,
        part_size=plan_parts(
            size,
            part_size,
            min_part_size=store.limits.min_part_size,
            max_part_size=store.limits.max_part_size,
            max_parts=store.limits.max_parts,
        ),
        concurrency=concurrency,
        retry=retry,
        on_created=on_created,
        on_part_done=on_part_done,
        before_complete=before_complete,
        should_abort=should_abort,
        part_limiter=part_limiter,
        storage_class=storage_class,
        content_type=content_type,
        abort_poll=abort_poll,
    )
    try:
        await job.adopt(resume)
        return await job.run()
    except UploadAborted:
        if job.record is not None:
            with trio.CancelScope(shield=True):
                await _abort_quietly(store, job.record.key, job.record.upload_id)
        raise


@dataclasses.dataclass
class _Multipart:
    store: ObjectStore
    key: str
    path: str
    size: int
    st0: os.stat_result
    meta: dict
    digest: str
    part_size: int
    concurrency: int
    retry: Callable
    on_created: Callable | None
    on_part_done: Callable | None
    before_complete: Callable | None
    should_abort: Callable[[], bool] | None
    part_limiter: trio.CapacityLimiter | None
    storage_class: str | None
    content_type: str | None
    abort_poll: float
    record: UploadRecord | None = None
    reused: int = 0
    restarts: int = 0
    sent_parts: int = 0
    sent_bytes: int = 0

    async def adopt(self, resume: UploadRecord | None) -> None:
        """Take over a previous upload if the record and the server agree."""
        if resume is None:
            return
        store = self.store
        usable = (
            resume.key == self.key
            and resume.size == self.size
            and resume.blake3 == self.digest
            and resume.checksum_algorithm in (store.checksum_algorithm, _UNKNOWN)
            and resume.part_size >= store.limits.min_part_size
            and math.ceil(self.size / resume.part_size) <= store.limits.max_parts
        )
        if not usable:
            log.info("resume record for %s unusable (file or settings changed); starting over", self.key)
            await _abort_quietly(store, resume.key, resume.upload_id)
            self.restarts += 1
            return
        try:
            server = await self.retry(lambda: store.list_parts(self.key, resume.upload_id), f"ListParts {self.key}")
        except NoSuchUploadError:
            log.info("upload %s of %s is gone; starting over", resume.upload_id, self.key)
            self.restarts += 1
            return
        sp = {p.number: p for p in server}
        record = dataclasses.replace(resume, parts={}, checksum_algorithm=store.checksum_algorithm)
        for n, p in resume.parts.items():
            s = sp.get(n)
            expect = min(resume.part_size, self.size - (n - 1) * resume.part_size)
            if (
                s is not None
                and normalize_etag(s.etag) == normalize_etag(p.etag)
                and p.size == expect
                and s.size in (0, expect)
            ):
                record.parts[n] = p
        self.record = record
        self.reused = len(record.parts)
        self.part_size = record.part_size

    async def run(self) -> UploadResult:
        store, key = self.store, self.key
        while True:  # start over if the upload id disappears mid-way
            if self.record is None:
                upload_id = await self.retry(
                    lambda: store.create_multipart(
                        key, self.meta, storage_class=self.storage_class, content_type=self.content_type
                    ),
                    f"CreateMultipartUpload {key}",
                )
                self.record = UploadRecord(key, upload_id, self.part_size, self.size, self.digest, store.checksum_algorithm)
                self.reused = 0
                if self.on_created is not None:
                    await _maybe_await(self.on_created(self.record))
            try:
                await self._send_parts()
            except NoSuchUploadError:
                if self.restarts >= 3:
                    raise
                log.warning("upload %s of %s vanished mid-way; starting over", self.record.upload_id, key)
                self.record = None
                self.restarts += 1
                continue
            break

        record = self.record
        st1 = await trio.to_thread.run_sync(os.stat, self.path)
        if _stat_id(st1) != _stat_id(self.st0):
            await _abort_quietly(store, key, record.upload_id)
            raise localio.SourceChangedError(f"{self.path} changed during upload of {key}")
        nparts = math.ceil(self.size / record.part_size)
        parts = [record.parts[n] for n in range(1, nparts + 1)]
        if self.before_complete is not None and not await _maybe_await(self.before_complete()):
            raise UploadAborted(f"upload of {key} cancelled by before_complete()")

        async def complete():
            try:
                return await store.complete_multipart(key, record.upload_id, parts)
            except NoSuchUploadError:
                # an earlier attempt may have completed it and lost the response
                info = await store.head(key)
                if info is not None and info.size == self.size and info.metadata.get(META_BLAKE3) == self.digest:
                    return PutResult(info.etag)
                raise

        res = await self.retry(complete, f"CompleteMultipartUpload {key}")
        return UploadResult(
            key,
            res.etag,
            self.size,
            self.digest,
            True,
            upload_id=record.upload_id,
            parts=nparts,
            parts_uploaded=self.sent_parts,
            parts_reused=self.reused,
            bytes_uploaded=self.sent_bytes,
            restarts=self.restarts,
        )

    async def _send_parts(self) -> None:
        record = self.record
        size, ps = record.size, record.part_size
        nparts = math.ceil(size / ps)
        todo = iter([n for n in range(1, nparts + 1) if n not in record.parts])
        aborted = False
        store = self.store

        async def worker():
            for n in todo:
                off = (n - 1) * ps
                ln = min(ps, size - off)

                async def send(n=n, off=off, ln=ln):
                    if self.part_limiter is None:
                        return await store.upload_part(record.key, record.upload_id, n, self.path, off, ln)
                    async with self.part_limiter:
                        return await store.upload_part(record.key, record.upload_id, n, self.path, off, ln)

                p = await self.retry(send, f"UploadPart {n}/{nparts} {record.key}")
                record.parts[n] = p
                self.sent_parts += 1
                self.sent_bytes += ln
                if self.on_part_done is not None:
                    await _maybe_await(self.on_part_done(p))

        async def watcher(cancel_scope):
            nonlocal aborted
            while True:
                if self.should_abort():
                    aborted = True
                    cancel_scope.cancel()
                    return
                await trio.sleep(self.abort_poll)

        try:
            async with trio.open_nursery() as outer:
                if self.should_abort is not None:
                    outer.start_soon(watcher, outer.cancel_scope)
                async with trio.open_nursery() as n:
                    for _ in range(min(self.concurrency, nparts)):
                        n.start_soon(worker)
                outer.cancel_scope.cancel()  # workers done: stop the watcher
        except BaseExceptionGroup as eg:
            if any(isinstance(e, UploadAborted) for e in exception_leaves(eg)):
                aborted = True
            else:
                raise collapse_exception_group(eg) from None
        if aborted:
            raise UploadAborted(f"upload of {record.key} aborted")


_UNKNOWN = "?"


def _coerce_record(resume) -> UploadRecord | None:
    """Accept an UploadRecord, its dict form, or a duck-typed record (e.g. the
    metadata DB's own upload record) with key/upload_id/part_size/size/blake3/parts."""
    if resume is None or isinstance(resume, UploadRecord):
        return resume
    if isinstance(resume, Mapping):
        d = dict(resume)
        d.setdefault("checksum_algorithm", _UNKNOWN)
        return UploadRecord.from_dict(d)
    parts_in = getattr(resume, "parts", None) or []
    if isinstance(parts_in, Mapping):
        parts_in = list(parts_in.values())
    parts = {}
    for p in parts_in:
        pr = p if isinstance(p, PartRecord) else PartRecord.from_dict(p)
        parts[pr.number] = pr
    return UploadRecord(
        key=resume.key,
        upload_id=resume.upload_id,
        part_size=int(resume.part_size),
        size=int(resume.size),
        blake3=getattr(resume, "blake3", "") or "",
        checksum_algorithm=getattr(resume, "checksum_algorithm", _UNKNOWN),
        parts=parts,
    )


async def upload_bytes(
    store: ObjectStore,
    key: str,
    data: bytes | bytearray | memoryview | str,
    metadata: Mapping[str, str] | None = None,
    *,
    storage_class: str | None = None,
    content_type: str | None = None,
    on_retry: Callable[[RetryState | None], Any] | None = None,
    retry: Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]] | None = None,
) -> UploadResult:
    """Single PUT of in-memory ``data`` (e.g. a symlink target; str is UTF-8
    encoded) with ``blake3`` metadata.  Meant for small payloads."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    mv = memoryview(data).cast("B")
    if mv.nbytes > 1 * MiB:
        digest = await trio.to_thread.run_sync(lambda: blake3.blake3(mv, max_threads=blake3.blake3.AUTO).hexdigest())
    else:
        digest = blake3.blake3(mv).hexdigest()
    meta = dict(metadata or {})
    meta[META_BLAKE3] = digest

    def op():
        return store.put_object(key, data, meta, storage_class=storage_class, content_type=content_type)

    if retry is not None:
        res = await retry(f"PutObject {key}", op)
    else:
        res = await retry_forever(op, what=f"PutObject {key}", on_retry=on_retry)
    return UploadResult(key, res.etag, mv.nbytes, digest, False, bytes_uploaded=mv.nbytes)


async def _abort_quietly(store: ObjectStore, key: str, upload_id: str, attempts: int = 3) -> bool:
    """Best-effort abort (a few quick tries; abort_stale_uploads cleans up the rest)."""
    for i in range(attempts):
        try:
            with trio.move_on_after(30):
                await store.abort_multipart(key, upload_id)
                return True
        except StoreError as e:
            if not e.retryable:
                log.warning("abort of upload %s (%s) failed: %s", upload_id, key, e)
                return False
            await trio.sleep(backoff_delay(i + 1))
    log.warning("abort of upload %s (%s) did not succeed; leaving it to abort_stale_uploads", upload_id, key)
    return False


async def abort_stale_uploads(
    store: ObjectStore,
    known_upload_ids: Collection[str],
    older_than: float,
    *,
    prefix: str = "",
    now: float | None = None,
) -> list[UploadInfo]:
    """Abort multipart uploads under ``prefix`` that are not in
    ``known_upload_ids`` and were initiated more than ``older_than`` seconds
    ago (leaked by crashes between CreateMultipartUpload and persisting the
    id, or by lost create responses).  Returns the uploads aborted."""
    now = time.time() if now is None else now
    known = set(known_upload_ids)
    aborted = []
    for u in await store.list_multipart_uploads(prefix):
        if u.upload_id in known:
            continue
        if now - u.initiated.timestamp() < older_than:
            continue
        try:
            await store.abort_multipart(u.key, u.upload_id)
            aborted.append(u)
        except StoreError as e:
            log.warning("could not abort stale upload %s of %s: %s", u.upload_id, u.key, e)
    return aborted

"""Uploader primitives for the drain (it reports to an :class:`UploadJournal`; what
the journal persists, and where, is the caller's business).

* :func:`upload_file` - single PUT or resumable multipart upload of one local
  file, with the file's BLAKE3 in ``x-amz-meta-blake3``.
* :class:`Backoff` - the one exponential back-off schedule of ckptfs (uploads,
  the drain's permanent-error retry, the gateway's drain restarts).
* :func:`retry_forever` - exponential backoff with jitter, no time limit for
  retryable errors, visible retry state, immediate raise for permanent ones.
* :func:`hash_file` - BLAKE3 of a file off the event loop (pooled hashers);
  :func:`digest_file` - the same pass, also computing every part's checksum.
* :func:`abort_stale_uploads` - abort multipart uploads we do not know about.

BLAKE3 and multipart: the hash must be known at CreateMultipartUpload time
(user metadata cannot be changed afterwards without rewriting the object), and
each part's checksum header before its body is sent (radosgw 16 rejects
aws-chunked trailers).  So one sequential hashing pass (:func:`digest_file`)
reads each chunk once and feeds it to the whole-file BLAKE3 *and* to its
part's checksum (:class:`FileDigest`); the parts then go from the file to the
socket with ``sendfile`` (plain http), or stream from it in small chunks that
are re-checked against the checksum (TLS, proxies); no part-sized buffers.
A file that changed since it was hashed is never completed: the server
verifies the part checksum where it can, and the file's stat is compared
before CompleteMultipartUpload (DESIGN.md, "Uploads").  The alternative - upload, then a
server-side CopyObject onto itself with the metadata - would rewrite the
whole object on the server (UploadPartCopy beyond 5 GiB), leave a window where
the object exists without its hash, and change its ETag.  Small files (single
PUT) are read once: the same buffer is hashed and sent.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
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

from ckptfs.fsmeta.records import UNKNOWN_CHECKSUM, PartRecord, UploadRecord

from . import localio
from .store import (
    MiB,
    NoSuchUploadError,
    ObjectStore,
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
    "UploadJournal",
    "UploadOptions",
    "UploadResult",
    "UploadAborted",
    "RetryState",
    "Backoff",
    "retry_forever",
    "backoff_delay",
    "hash_file",
    "digest_file",
    "FileDigest",
    "upload_part_size",
    "upload_file",
    "upload_bytes",
    "plan_parts",
    "abort_stale_uploads",
]

META_BLAKE3 = "blake3"
DEFAULT_PART_SIZE = 64 * MiB
HASH_CHUNK = 8 * MiB
#: single PUTs up to this size are read into memory once (hashed and sent from there);
#: bigger ones are hashed, then streamed from the file
BUFFERED_PUT_MAX = 8 * MiB

T = TypeVar("T")


class UploadAborted(Exception):
    """The journal's ``should_abort()`` said so, or ``may_complete()`` vetoed; the
    multipart upload (if any) was aborted."""


# --------------------------------------------------------------------------
# back-off


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential back-off: ``base`` seconds after the first failure, doubling per
    consecutive failure, never more than ``cap``."""

    base: float
    cap: float

    def delay(self, attempt: int) -> float:
        """The wait after failure number ``attempt`` (1 = first), without jitter."""
        return min(self.cap, self.base * (2 ** min(attempt - 1, 62)))


def backoff_delay(attempt: int, base: float = 0.2, cap: float = 30.0, rng: random.Random | None = None) -> float:
    """:meth:`Backoff.delay` with "equal jitter": sleep uniformly in [d/2, d].  Never
    ~0 (unlike full jitter), so a throttling server really gets relief; spread, so
    parts that failed together do not all come back together."""
    d = Backoff(base, cap).delay(attempt)
    r = (rng or random).random()
    return d / 2 + r * d / 2


#: Retryable store errors: 0.1..0.2 s after the first failure, then up to 15..30 s.
RETRY_BACKOFF = Backoff(0.2, 30.0)


# --------------------------------------------------------------------------
# journal and options


class UploadJournal:
    """What :func:`upload_file` tells its caller while it works, and asks before it acts.

    This base records nothing and never objects (tests, benchmarks, one-off uploads).
    The drain's journal (:mod:`drain.worker`) persists the record in fsmeta after
    every step, so a restarted drain resumes the upload, and vetoes the Complete
    when the file's generation moved.
    """

    async def created(self, record: UploadRecord) -> None:
        """After CreateMultipartUpload: persist ``record`` (upload id, part size, BLAKE3)."""

    async def part_done(self, part: PartRecord) -> None:
        """After each part (``record.parts`` already has it); called from concurrent
        tasks.  If it raises, the upload stops *without* aborting (it stays
        resumable) and the exception propagates."""

    async def may_complete(self) -> bool:
        """Last check before the object becomes visible (before the Complete, or
        the single PUT).  False: the upload is aborted, :class:`UploadAborted` raised."""
        return True

    def should_abort(self) -> bool:
        """Polled on the event loop (keep it a flag check) every ``abort_poll`` s and
        between retries; True cancels the parts in flight, aborts the upload and
        raises :class:`UploadAborted`."""
        return False

    async def retrying(self, what: str, state: RetryState | None) -> None:
        """Operation ``what`` failed retryably and waits ``state.delay`` s; None: the
        streak of failures is over (it succeeded)."""


NO_JOURNAL = UploadJournal()

#: ``await retry(what, op)``: a caller's own retry loop in place of :func:`retry_forever`.
RetryPolicy = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]


@dataclasses.dataclass(frozen=True)
class UploadOptions:
    """How to upload (the same for every file of a caller)."""

    part_size: int = DEFAULT_PART_SIZE  #: also the single-PUT limit
    concurrency: int = 8  #: parts in flight per file
    #: parts in flight over all uploads of the process, if given
    part_limiter: trio.CapacityLimiter | None = None
    storage_class: str | None = None
    content_type: str | None = None
    backoff: Backoff = RETRY_BACKOFF  #: of retryable store errors
    abort_poll: float = 0.2  #: seconds between ``journal.should_abort()`` checks
    retry: RetryPolicy | None = None  #: replaces :func:`retry_forever` entirely


DEFAULT_OPTIONS = UploadOptions()


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
    """Passed to ``on_retry`` (``journal.retrying``) after each retryable failure."""

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


async def retry_forever(
    op: Callable[[], Awaitable[T]],
    *,
    what: str = "",
    backoff: Backoff = RETRY_BACKOFF,
    on_retry: Callable[[RetryState | None], Any] | None = None,
    should_abort: Callable[[], bool] | None = None,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[Any]] = trio.sleep,
) -> T:
    """Call ``await op()`` until it succeeds.

    * retryable :class:`StoreError` (``e.retryable``): back off
      (``backoff`` with jitter, :func:`backoff_delay`) and retry, with no limit on time or attempts;
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
            delay = backoff_delay(attempt, backoff.base, backoff.cap, rng)
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


@dataclasses.dataclass(frozen=True)
class FileDigest:
    """One hashing pass over a file: its BLAKE3 and, for a multipart upload with parts of
    ``part_size``, each part's :class:`~ckptfs.drain.localio.PartDigest` (None entries when
    the store needs none)."""

    blake3: str
    size: int
    part_size: int = 0
    parts: tuple = ()


def digest_file_sync(
    path: str | os.PathLike | int, size: int | None = None, part_size: int = 0, new_part_digest=None
) -> FileDigest:
    """BLAKE3 of the file and, if ``part_size``, each part's digest (``new_part_digest()``),
    from the same chunks of one sequential read (blocking; worker thread only)."""
    own = not isinstance(path, int)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if own else path
    h = _hashers.get()
    buf = _hash_buffers.get(HASH_CHUNK)
    parts = []
    try:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        mv = memoryview(buf)[:HASH_CHUNK]
        pos = 0
        part = None
        while size is None or pos < size:
            want = HASH_CHUNK if size is None else min(HASH_CHUNK, size - pos)
            if part_size:  # a chunk never spans two parts
                want = min(want, part_size - pos % part_size)
            n = os.preadv(fd, [mv[:want]], pos)
            if n == 0:
                break
            chunk = mv[:n]
            h.update(chunk)
            if part_size:
                if pos % part_size == 0:
                    part = new_part_digest() if new_part_digest is not None else None
                    parts.append(part)
                if part is not None:
                    part.update(chunk)
                    if (pos + n) % part_size == 0 or pos + n == size:
                        part.finish()
            pos += n
        if size is not None and pos != size:
            raise localio.SourceChangedError(f"file has {pos} bytes, expected {size}")
        if part is not None and part.checksum is None and part.payload_sha256 is None:
            part.finish()  # size None: the last part ended at EOF
        return FileDigest(h.hexdigest(), pos, part_size, tuple(parts))
    finally:
        _hash_buffers.put(buf)
        _hashers.put(h)
        if own:
            os.close(fd)


def hash_file_sync(path: str | os.PathLike | int, size: int | None = None) -> tuple[str, int]:
    """BLAKE3 hex of the file (blocking; worker thread only).  Returns (hex, bytes)."""
    d = digest_file_sync(path, size)
    return d.blake3, d.size


async def hash_file(path: str | os.PathLike, size: int | None = None) -> str:
    """BLAKE3 hex digest of a file, computed in a worker thread (BLAKE3 itself
    uses all cores and releases the GIL)."""
    # Abandon on cancel: a hash nobody waits for any more must not delay shutdown
    # (the thread finishes on its own; its result is dropped).
    hexd, _ = await trio.to_thread.run_sync(hash_file_sync, os.fspath(path), size, abandon_on_cancel=True)
    return hexd


async def digest_file(path: str | os.PathLike, size: int, part_size: int, store: ObjectStore) -> FileDigest:
    """:func:`digest_file_sync` in a worker thread, with ``store``'s part digests."""
    new = getattr(store, "new_part_digest", None)
    return await trio.to_thread.run_sync(
        digest_file_sync, os.fspath(path), size, part_size, new, abandon_on_cancel=True)


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


def _stat_and_read_small(path: str, buffered_max: int):
    """``os.stat(path)``, and for a file of at most ``buffered_max`` bytes also its bytes and
    BLAKE3 (:func:`_read_whole_hashing`) and a second stat after the read, to tell a change
    meanwhile: ``(st0, (buf, blake3, st1) or None)``. One thread hop where a small file took
    three; the caller returns ``buf`` to ``_put_buffers``."""
    st0 = os.stat(path)
    if st0.st_size > buffered_max:
        return st0, None
    buf, hexd = _read_whole_hashing(path, st0.st_size)
    try:
        st1 = os.stat(path)
    except BaseException:
        _put_buffers.put(buf)
        raise
    return st0, (buf, hexd, st1)


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
    # ctime too: in passthrough mode the gateway sees no writes, and a shared mapping can
    # change the file with no writer open; ctime moves with every change and cannot be set.
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def upload_part_size(
    store: ObjectStore, key: str, size: int, options: UploadOptions = DEFAULT_OPTIONS, resume=None
) -> int:
    """The part size :func:`upload_file` uses for a multipart upload of ``size`` bytes:
    the resumed upload's, if ``resume`` can be resumed at all, else :func:`plan_parts`'s.
    (A caller hashing ahead with :func:`digest_file` asks this first.)"""
    limits = store.limits
    resume = _coerce_record(resume)
    if (
        resume is not None
        and resume.key == key
        and resume.size == size
        and resume.part_size >= limits.min_part_size
        and math.ceil(size / resume.part_size) <= limits.max_parts
    ):
        return resume.part_size
    return plan_parts(
        size,
        options.part_size,
        min_part_size=limits.min_part_size,
        max_part_size=limits.max_part_size,
        max_parts=limits.max_parts,
    )


async def upload_file(
    store: ObjectStore,
    key: str,
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    size: int | None = None,
    blake3_hex: str | None = None,
    digest: FileDigest | None = None,
    resume: UploadRecord | Mapping | Any | None = None,
    journal: UploadJournal = NO_JOURNAL,
    options: UploadOptions = DEFAULT_OPTIONS,
) -> UploadResult:
    """Upload the local file ``path`` to ``key``.

    * ``size <= options.part_size``: one PUT (up to ``BUFFERED_PUT_MAX`` the file
      is read once: hashed and sent from the same buffer; above, streamed as a part).
    * otherwise multipart with ``options.concurrency`` parts in flight (and, if
      given, ``options.part_limiter`` shared by all concurrent uploads).  The
      file's BLAKE3 is computed first (see module doc) and stored as user
      metadata ``blake3`` together with ``metadata``.
    * ``size``: expected size; a different file size raises
      :class:`~ckptfs.drain.localio.SourceChangedError`.
    * ``blake3_hex``: the file's BLAKE3 if the caller already knows it (checked:
      a different content raises SourceChangedError).
    * ``digest``: the file's :class:`FileDigest` from the caller's own hashing pass
      (:func:`digest_file` with :func:`upload_part_size`); used if its part size is
      the one this upload uses, else the file is hashed here.
    * ``resume``: state saved from an earlier attempt - an :class:`UploadRecord`,
      its ``to_dict()``, or any object with ``key, upload_id, part_size, size,
      blake3, parts`` attributes (parts: PartRecords or their dicts).  Used if it
      is for the same key, size, BLAKE3 (and checksum algorithm, when known)
      and the server still has the upload (``list_parts``); recorded parts whose
      etag/size match the server's are kept, the others are (re)sent.
      Otherwise the old upload is aborted (best effort) and a new one started.
    * ``journal``: told of the upload's progress and asked before it completes
      (:class:`UploadJournal`); retryable errors never give up.
    * Permanent store errors propagate; the multipart upload is left in place
      for a later resume (or :func:`abort_stale_uploads`).  If the file changes
      during the upload (size/mtime/ctime/inode), the upload is aborted and
      :class:`ckptfs.drain.localio.SourceChangedError` is raised.
    """
    if options.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    path = os.fspath(path)
    # A file sent in one buffered PUT is read and hashed in the same thread hop as its stat.
    buffered_max = options.part_size if store.new_part_digest() is None else min(options.part_size, BUFFERED_PUT_MAX)
    st0, read = await trio.to_thread.run_sync(_stat_and_read_small, path, buffered_max)
    buf = read[0] if read is not None else None
    try:
        if size is not None and st0.st_size != size:
            raise localio.SourceChangedError(f"{path} has {st0.st_size} bytes, expected {size}")
        if journal.should_abort():
            raise UploadAborted(key)
    except BaseException:
        if buf is not None:
            _put_buffers.put(buf)
        raise
    size = st0.st_size
    meta = dict(metadata or {})
    retry = _retry_for(journal, options)

    # ---- small file: single PUT ------------------------------------------------
    resume = _coerce_record(resume)
    if size <= options.part_size:
        try:
            if resume is not None:
                await _abort_quietly(store, resume.key, resume.upload_id)
            if read is None:
                # hashed, then streamed from the file like a part (memory stays bounded)
                fdg = await digest_file(path, size, size, store)
                hexd, body, put_kw = fdg.blake3, path, {"digest": fdg.parts[0]}
                st1 = await trio.to_thread.run_sync(os.stat, path)
            else:  # read once: the same buffer is hashed and sent
                buf, hexd, st1 = read
                body, put_kw = memoryview(buf)[:size], {}
            if blake3_hex is not None and blake3_hex != hexd:
                raise localio.SourceChangedError(f"{path}: blake3 {hexd} != expected {blake3_hex}")
            meta[META_BLAKE3] = hexd
            if _stat_id(st1) != _stat_id(st0):
                raise localio.SourceChangedError(f"{path} changed while being read")
            if not await journal.may_complete():
                raise UploadAborted(f"upload of {key} cancelled by may_complete()")
            res = await retry(
                lambda: store.put_object(
                    key, body, meta, storage_class=options.storage_class, content_type=options.content_type, **put_kw
                ),
                f"PutObject {key}",
            )
        finally:
            if buf is not None:
                _put_buffers.put(buf)
        return UploadResult(key, res.etag, size, hexd, False, bytes_uploaded=size)

    # ---- multipart -----------------------------------------------------------
    part_size = upload_part_size(store, key, size, options, resume)
    if digest is None or (digest.size, digest.part_size) != (size, part_size):
        digest = await digest_file(path, size, part_size, store)
    if blake3_hex is not None and blake3_hex != digest.blake3:
        raise localio.SourceChangedError(f"{path}: blake3 {digest.blake3} != expected {blake3_hex}")
    meta[META_BLAKE3] = digest.blake3
    job = _Multipart(
        store=store,
        key=key,
        path=path,
        size=size,
        st0=st0,
        meta=meta,
        digest=digest.blake3,
        part_digests=digest.parts,
        part_size=part_size,
        options=options,
        journal=journal,
        retry=retry,
    )
    try:
        await job.adopt(resume)
        return await job.run()
    except UploadAborted:
        if job.record is not None:
            with trio.CancelScope(shield=True):
                await _abort_quietly(store, job.record.key, job.record.upload_id)
        raise


def _retry_for(journal: UploadJournal, options: UploadOptions) -> Callable[[Callable[[], Awaitable[T]], str], Awaitable[T]]:
    """``retry(op, what)``: the caller's policy, else :func:`retry_forever` reporting to the journal."""

    def retry(op, what):
        if options.retry is not None:
            return options.retry(what, op)
        return retry_forever(
            op,
            what=what,
            backoff=options.backoff,
            on_retry=functools.partial(journal.retrying, what),
            should_abort=journal.should_abort,
        )

    return retry


@dataclasses.dataclass
class _Multipart:
    store: ObjectStore
    key: str
    path: str
    size: int
    st0: os.stat_result
    meta: dict
    digest: str
    part_digests: tuple  #: PartDigest | None per part, for ``part_size``
    part_size: int
    options: UploadOptions
    journal: UploadJournal
    retry: Callable
    record: UploadRecord | None = None
    done: dict[int, PartRecord] = dataclasses.field(default_factory=dict)  #: parts in ``record``
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
            and resume.checksum_algorithm in (store.checksum_algorithm, UNKNOWN_CHECKSUM)
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
        kept = {}
        for n, p in resume.part_map().items():
            s = sp.get(n)
            expect = min(resume.part_size, self.size - (n - 1) * resume.part_size)
            if (
                s is not None
                and normalize_etag(s.etag) == normalize_etag(p.etag)
                and p.size == expect
                and s.size in (0, expect)
            ):
                kept[n] = p
        self.record = dataclasses.replace(
            resume, parts=[p.to_dict() for p in kept.values()], checksum_algorithm=store.checksum_algorithm
        )
        self.done = kept
        self.reused = len(kept)

    async def run(self) -> UploadResult:
        store, key, options = self.store, self.key, self.options
        while True:  # start over if the upload id disappears mid-way
            if self.record is None:
                upload_id = await self.retry(
                    lambda: store.create_multipart(
                        key, self.meta, storage_class=options.storage_class, content_type=options.content_type
                    ),
                    f"CreateMultipartUpload {key}",
                )
                self.record = UploadRecord(
                    key=key,
                    upload_id=upload_id,
                    generation=0,  # the caller's notion; its journal fills it in
                    part_size=self.part_size,
                    size=self.size,
                    blake3=self.digest,
                    checksum_algorithm=store.checksum_algorithm,
                )
                self.done = {}
                self.reused = 0
                await self.journal.created(self.record)
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
        parts = [self.done[n] for n in range(1, nparts + 1)]
        if not await self.journal.may_complete():
            raise UploadAborted(f"upload of {key} cancelled by may_complete()")

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
        todo = iter([n for n in range(1, nparts + 1) if n not in self.done])
        if ps != self.part_size:  # upload_part_size() gave a resumable record's part size
            raise AssertionError(f"part size {ps} != hashed part size {self.part_size}")
        digests = self.part_digests
        aborted = False
        store, journal, limiter = self.store, self.journal, self.options.part_limiter

        async def worker():
            for n in todo:
                off = (n - 1) * ps
                ln = min(ps, size - off)

                pd = digests[n - 1] if n <= len(digests) else None
                kw = {} if pd is None else {"digest": pd}

                async def send(n=n, off=off, ln=ln, kw=kw):
                    if limiter is None:
                        return await store.upload_part(record.key, record.upload_id, n, self.path, off, ln, **kw)
                    async with limiter:
                        return await store.upload_part(record.key, record.upload_id, n, self.path, off, ln, **kw)

                p = await self.retry(send, f"UploadPart {n}/{nparts} {record.key}")
                self.done[n] = p
                record.add_part(p)
                self.sent_parts += 1
                self.sent_bytes += ln
                await journal.part_done(p)

        async def watcher(cancel_scope):
            nonlocal aborted
            while True:
                if journal.should_abort():
                    aborted = True
                    cancel_scope.cancel()
                    return
                await trio.sleep(self.options.abort_poll)

        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(watcher, outer.cancel_scope)
                async with trio.open_nursery() as n:
                    for _ in range(min(self.options.concurrency, nparts)):
                        n.start_soon(worker)
                outer.cancel_scope.cancel()  # workers done: stop the watcher
        except BaseExceptionGroup as eg:
            if any(isinstance(e, UploadAborted) for e in exception_leaves(eg)):
                aborted = True
            else:
                raise collapse_exception_group(eg) from None
        if aborted:
            raise UploadAborted(f"upload of {record.key} aborted")


def _coerce_record(resume) -> UploadRecord | None:
    """Accept an UploadRecord, its dict form, or a duck-typed record with
    key/upload_id/part_size/size/blake3/parts (parts: PartRecords or their dicts)."""
    if resume is None or isinstance(resume, UploadRecord):
        return resume
    if isinstance(resume, Mapping):
        return UploadRecord.from_dict(resume)
    parts_in = getattr(resume, "parts", None) or []
    if isinstance(parts_in, Mapping):
        parts_in = list(parts_in.values())
    return UploadRecord(
        key=resume.key,
        upload_id=resume.upload_id,
        generation=int(getattr(resume, "generation", 0)),
        part_size=int(resume.part_size),
        size=int(resume.size),
        blake3=getattr(resume, "blake3", "") or "",
        parts=[p.to_dict() if isinstance(p, PartRecord) else dict(p) for p in parts_in],
        checksum_algorithm=getattr(resume, "checksum_algorithm", UNKNOWN_CHECKSUM),
    )


async def upload_bytes(
    store: ObjectStore,
    key: str,
    data: bytes | bytearray | memoryview | str,
    metadata: Mapping[str, str] | None = None,
    *,
    journal: UploadJournal = NO_JOURNAL,
    options: UploadOptions = DEFAULT_OPTIONS,
) -> UploadResult:
    """Single PUT of in-memory ``data`` (e.g. a symlink target; str is UTF-8
    encoded) with ``blake3`` metadata.  Meant for small payloads; of ``options``
    only the storage class, content type and retry settings apply."""
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
        return store.put_object(key, data, meta, storage_class=options.storage_class, content_type=options.content_type)

    res = await _retry_for(journal, options)(op, f"PutObject {key}")
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

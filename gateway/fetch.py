"""The read path: ranged GETs of a REMOTE file's object into its sparse cache file.

A REMOTE inode's content is in the bucket only. Its cache file ``CACHE/data/<ino>`` is filled
on demand, and which ranges it holds is recorded here, in memory only (:class:`RemoteFile`:
one byte of state per :data:`BLOCK`): a cache file of a REMOTE inode is never trusted as
complete, and start-up recovery discards any it finds (``gateway/recovery.py``).

- **Reads** (``OpenFiles.read`` of a file opened while REMOTE) wait only for the blocks they
  read. Each handle has a :class:`ReadAhead`: a reader that keeps going sequentially gets a
  read-ahead window that starts at :data:`INITIAL_READAHEAD` and doubles, each time the
  reader gets within half a window of its end, up to ``[read] max_readahead``. A read that is
  not sequential fetches only its own blocks. Missing runs are fetched as ranged GETs of at
  most ``[read] part_size``, aligned to that grid, at most ``[read] concurrency`` in flight in
  the whole gateway, all with ``if_match=etag``: an object replaced while it is read fails
  the reader with ESTALE instead of mixing two versions.
- **Where the bytes go**: ``ObjectStore.get_to_file`` streams each GET into the cache file
  from worker threads of the bucket client's loop (``gateway/bucket.py``); the bookkeeping and
  the hash below also run in such a worker thread, never in a trio loop.
- **Integrity**: the blake3 of the cache file is computed as its blocks land, over the present
  prefix in order (:meth:`Fetcher._hash_prefix`: one thread at a time feeds the blocks from the
  end of what it hashed up to the first block not present yet, read back from the page cache),
  so once every block is present only the last run is left to hash. The digest is compared
  with the object's ``x-amz-meta-blake3`` (``RemoteRecord.blake3``, else a HEAD). A match:
  the cache file is fdatasync'ed and the inode becomes CACHED_CLEAN
  (``durability.mark_cached_clean``), so later opens take the native data path. A mismatch:
  EIO from then on for every handle (a read that reaches the end of the file and ``close``
  wait for the check and report it), ``durability.mark_remote_corrupt`` (the state xattr
  shows ``error: RemoteHashMismatch``), a metric, and the cache file is emptied. An object
  with no blake3 (written by another tool) has nothing to check it against: it is taken as
  it is. Bytes a reader got before the last block arrived cannot be recalled; what is
  guaranteed is that such a reader's last read or its close fails, and that the file never
  becomes cached-clean.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
from blake3 import blake3 as new_blake3

from ckptfs.drain.store import NotFoundError, PreconditionFailedError, StoreError
from ckptfs.fsmeta import FileState, Inode, Txn, durability
from ckptfs.fsmeta.settings import MIB, Settings

from . import metrics, writeback
from .errors import FsError
from .state import EvictedMeanwhile

if TYPE_CHECKING:
    from .bucket import BucketClient
    from .state import CoreState

log = logging.getLogger("ckptfs.fetch")

BLOCK = 64 * 1024  # granularity of the present-ranges record (a random 4 KiB read fetches this)
INITIAL_READAHEAD = 1 * MIB  # first read-ahead window of a sequential reader
SEQUENTIAL_SLACK = 256 * 1024  # reads this far behind the last one still count as sequential
KEEP_IDLE = 256  # partly fetched files kept (with their fd) after their last close
HASH_CHUNK = 256 * 1024  # bytes read back per blake3 update: stays in the core's cache between the copy and the hash

ABSENT, FETCHING, PRESENT, FAILED = 0, 1, 2, 3


@dataclass(frozen=True)
class ReadSettings:
    """The ``[read]`` settings (``fsmeta/settings.py``)."""

    part_size: int = 8 * MIB
    max_readahead: int = 256 * MIB
    concurrency: int = 16

    @classmethod
    def from_settings(cls, settings: Settings) -> ReadSettings:
        return cls(int(settings.read_part_size), int(settings.read_max_readahead), int(settings.read_concurrency))


def _first_of(states: bytearray, values: tuple[int, ...], start: int, end: int) -> int:
    """The first index in [start, end) whose state is one of ``values``, else ``end``."""
    found = [i for i in (states.find(v, start, end) for v in values) if i >= 0]
    return min(found, default=end)


class ReadAhead:
    """One handle's read pattern: how far ahead of it to fetch."""

    def __init__(self) -> None:
        self.pos: int | None = None  # end of the last read
        self.window = 0  # 0: not sequential (fetch only what is read)
        self.ahead_end = 0

    def plan(self, offset: int, end: int, max_readahead: int) -> int:
        """The end of the range to have fetched (or in flight) for a read of [offset, end)."""
        if self.pos is None:
            sequential = offset == 0
        else:
            sequential = self.pos - max(self.window, SEQUENTIAL_SLACK) <= offset <= self.ahead_end
        if sequential:
            if end + self.window // 2 >= self.ahead_end:
                self.window = INITIAL_READAHEAD if self.window == 0 else min(self.window * 2, max_readahead)
                self.ahead_end = max(self.ahead_end, end) + self.window
        else:
            self.window = 0
            self.ahead_end = end
        self.pos = end
        return max(self.ahead_end, end)


class RemoteFile:
    """The fetch state of one REMOTE inode: its object, its cache file and what it holds."""

    def __init__(self, ino: int, generation: int, key: str, size: int, etag: str, record_etag: str,
                 blake3: str, fd: int):
        self.ino = ino
        self.generation = generation
        self.key = key
        self.size = size
        self.etag = etag  # every GET carries it (if_match)
        self.record_etag = record_etag  # as fsmeta recorded it (to see a refreshed record)
        self.blake3 = blake3  # "" = nothing to check against
        self.fd = fd
        self.nblocks = (size + BLOCK - 1) // BLOCK
        self.states = bytearray(self.nblocks)
        self.present = 0
        self.cond = threading.Condition()
        self.inflight = 0  # GETs not landed yet
        self.users = 0  # open files and whole-file fetches holding it
        self.error: FsError | None = None  # sticky: hash mismatch, object changed or gone
        self.last_error: BaseException | None = None  # of the last failed GET
        self.checking = False
        self.verified = False
        # blake3 of blocks [0, hashed), fed in order as they land (``Fetcher._hash_prefix``)
        self.hasher = new_blake3() if blake3 else None
        self.hashed = 0
        self.hashing = False  # a thread is feeding the hasher
        self.local = False  # detached: the cache file is the file's content now
        self.dropped = False  # out of the registry; the fd closes once unused

    @property
    def complete(self) -> bool:
        return self.present == self.nblocks

    def _missing(self, b0: int, b1: int) -> bool:
        return self.states.count(PRESENT, b0, b1) != b1 - b0

    def _present_run_end(self, b0: int) -> int:
        """The end of the run of present blocks that starts at ``b0``."""
        return _first_of(self.states, (ABSENT, FETCHING, FAILED), b0, self.nblocks)


class Fetcher:
    """The read path of one gateway: the REMOTE files being fetched, by inode."""

    def __init__(self, state: CoreState, bucket: BucketClient, settings: ReadSettings | None = None):
        self._state = state
        self._bucket = bucket
        self.settings = settings or ReadSettings()
        self._files: OrderedDict[int, RemoteFile] = OrderedDict()
        self._lock = threading.Lock()
        self._limiter: trio.CapacityLimiter | None = None  # created in the bucket client's loop

    # -- the registry ------------------------------------------------------------------

    def acquire(self, inode: Inode) -> RemoteFile:
        """The fetch state of a REMOTE inode (shared by every user until dropped).
        :class:`EvictedMeanwhile`: the inode is no longer what the caller read (read it again)."""
        with self._state.meta.read() as txn:
            record = txn.get_remote(inode.ino)
        with self._lock:
            rf = self._files.get(inode.ino)
            if rf is not None and (rf.error is not None or rf.generation != inode.generation or record is None):
                self._drop(rf, empty=rf.error is not None)
                rf = None
            if rf is not None:
                self._follow_record(rf, record)
                rf.users += 1
                self._files.move_to_end(inode.ino)
                return rf
        s = self._state
        fresh = self._open_remote(inode)
        while True:
            # The evictor removes the cache files of REMOTE inodes the fetcher does not hold
            # (``holds``): one it unlinked under our descriptor would be marked cached-clean
            # with no cache file. Register only with no eviction since the cache file was opened.
            with s.lock:
                s.wait_unclaimed(inode.ino)
                seen_claims = s.claim_seq
            fresh.fd = s.open_cache_file(inode.ino)
            # A truncate (a claim) that ended since the caller read ``inode`` made the cache
            # file the file's own: it must not be cut below. The caller reads it again.
            with s.meta.read() as txn:
                now = txn.get_inode(inode.ino)
            if now is None or now.state != FileState.REMOTE or now.generation != inode.generation:
                os.close(fresh.fd)
                raise EvictedMeanwhile
            with s.lock, self._lock:
                if inode.ino in s.claimed or s.claim_seq != seen_claims:
                    os.close(fresh.fd)
                    continue
                rf = self._files.get(inode.ino)
                if rf is None:
                    rf = fresh
                    # What a dropped or crashed fetch left there is not known to be anything.
                    os.ftruncate(rf.fd, 0)
                    os.ftruncate(rf.fd, rf.size)
                    self._files[inode.ino] = rf
                    self._bound_idle()
                else:
                    os.close(fresh.fd)
                rf.users += 1
            return rf

    def holds(self, ino: int) -> bool:
        """The fetcher has the inode's cache file open (being fetched, or idle and partly
        fetched): the evictor must leave it alone. Call with the state lock held."""
        with self._lock:
            return ino in self._files

    def _open_remote(self, inode: Inode) -> RemoteFile:
        with self._state.meta.read() as txn:
            record = txn.get_remote(inode.ino)
        if record is None or not record.key:
            raise FsError(errno.EIO, f"inode {inode.ino} is REMOTE without a bucket key")
        etag, blake3 = record.etag, record.blake3
        if not etag or not blake3:
            try:
                info = self._bucket.head(record.key)
            except StoreError as exc:
                raise FsError(errno.EIO, f"{record.key}: HEAD failed: {exc}") from None
            if info is None:
                raise FsError(errno.EIO, f"{record.key}: not in the bucket")
            if etag and info.etag != etag:
                raise FsError(errno.ESTALE, f"{record.key}: the object changed since it was listed")
            etag = info.etag
            blake3 = blake3 or info.metadata.get("blake3", "")
        # The cache file is opened by ``acquire`` (it must see no eviction meanwhile).
        return RemoteFile(inode.ino, inode.generation, record.key, inode.size, etag, record.etag, blake3, -1)

    def release(self, rf: RemoteFile) -> None:
        with self._lock:
            rf.users -= 1
            if rf.error is not None and self._files.get(rf.ino) is rf:
                self._drop(rf, empty=True)
            self._close_if_unused(rf)

    def discard(self, ino: int) -> None:
        """The inode's cache file is going away (purge): forget what it held."""
        with self._lock:
            rf = self._files.get(ino)
            if rf is not None:
                rf.local = True
                self._drop(rf, empty=False)

    def detach(self, ino: int) -> None:
        """The inode stops being REMOTE (truncate, open with O_TRUNC): wait for GETs still
        writing into its cache file, then leave the cache file to the ordinary write path."""
        with self._lock:
            rf = self._files.get(ino)
        if rf is None:
            return
        with rf.cond:
            rf.local = True
            rf.cond.notify_all()
            while rf.inflight:
                rf.cond.wait()
        with self._lock:
            if self._files.get(ino) is rf:
                self._drop(rf, empty=False)

    def _drop(self, rf: RemoteFile, *, empty: bool) -> None:
        """Out of the registry (with ``_lock``). ``empty``: its bytes are not to be trusted."""
        if self._files.get(rf.ino) is rf:
            del self._files[rf.ino]
        rf.dropped = True
        if empty and not rf.fd < 0:
            os.ftruncate(rf.fd, 0)
        self._close_if_unused(rf)

    def _close_if_unused(self, rf: RemoteFile) -> None:
        if rf.dropped and rf.users == 0 and rf.inflight == 0 and rf.fd >= 0:
            os.close(rf.fd)
            rf.fd = -1

    def _bound_idle(self) -> None:
        """Forget the oldest idle, partly fetched files beyond :data:`KEEP_IDLE`."""
        if len(self._files) <= KEEP_IDLE:
            return
        for rf in list(self._files.values()):
            if len(self._files) <= KEEP_IDLE:
                break
            if rf.users == 0 and rf.inflight == 0:
                self._drop(rf, empty=True)

    # -- reads -------------------------------------------------------------------------

    def read_through(self, rf: RemoteFile, ra: ReadAhead | None, offset: int, size: int) -> None:
        """Make [offset, offset+size) of the file present in its cache file (and fetch ahead
        as the handle's read pattern says). Raises FsError(EIO/ESTALE)."""
        end = min(offset + size, rf.size)
        if rf.local:
            return
        if end > offset:
            b0, b1 = offset // BLOCK, (end + BLOCK - 1) // BLOCK
            with rf.cond:
                if rf.error is not None:
                    raise rf.error
                ahead = ra.plan(offset, end, self.settings.max_readahead) if ra is not None else end
                a1 = (min(ahead, rf.size) + BLOCK - 1) // BLOCK
                hit = not rf._missing(b0, b1)
                requests = self._claim(rf, b0, max(b1, a1))
            self._submit(rf, requests, (b0, b1))
            if not hit:
                self._wait_present(rf, b0, b1)
            metrics.REMOTE_READ_BYTES.labels("cache" if hit else "bucket").inc(end - offset)
        if end >= rf.size:
            self.wait_checked(rf)

    def fetch_all(self, rf: RemoteFile, *, attempts: int = 3) -> int:
        """Fetch the whole object and wait for its check (and the cached-clean commit).
        Returns the bytes this call asked the bucket for."""
        fetched = 0
        for attempt in range(attempts):
            with rf.cond:
                if rf.error is not None:
                    raise rf.error
                if rf.local:
                    return fetched
                requests = self._claim(rf, 0, rf.nblocks)
            fetched += sum(min(b1 * BLOCK, rf.size) - b0 * BLOCK for b0, b1 in requests)
            self._submit(rf, requests)
            try:
                self._wait_present(rf, 0, rf.nblocks)
                break
            except FsError:
                if attempt == attempts - 1 or rf.error is not None:
                    raise
        self.wait_checked(rf, commit=True)
        return fetched

    def fetch_range(self, rf: RemoteFile, end: int) -> None:
        """Fetch [0, end) (what a truncate keeps); no hash check (it is not the whole object)."""
        end = min(end, rf.size)
        if end <= 0:
            return
        b1 = (end + BLOCK - 1) // BLOCK
        with rf.cond:
            if rf.error is not None:
                raise rf.error
            requests = self._claim(rf, 0, b1)
        self._submit(rf, requests)
        self._wait_present(rf, 0, b1)

    def wait_checked(self, rf: RemoteFile, *, commit: bool = False) -> None:
        """Once the whole object is present: its blake3 check (and, ``commit``, the cached-clean
        commit too), done here if nobody has started it, else waited for. Raises the file's
        error, if any. An empty object is whole without any GET, so only a caller of this
        checks it: a release with no read and no flush before it would otherwise wait for ever."""
        self._verify_if_due(rf)
        with rf.cond:
            while rf.error is None and rf.complete and not rf.local and not (rf.verified and (rf.dropped or not commit)):
                rf.cond.wait()
            if rf.error is not None:
                raise rf.error

    def _verify_if_due(self, rf: RemoteFile) -> None:
        """Start the check of a whole object if nobody has (the last GET to land starts it)."""
        with rf.cond:
            due = rf.complete and not rf.checking and not rf.local and rf.error is None
            rf.checking = rf.checking or due
        if due:
            self._verify(rf)

    def _wait_present(self, rf: RemoteFile, b0: int, b1: int) -> None:
        with rf.cond:
            while True:
                if rf.error is not None:
                    raise rf.error
                if rf.local or not rf._missing(b0, b1):
                    return
                if rf.states.find(FAILED, b0, b1) >= 0:
                    if isinstance(rf.last_error, FsError):  # no cache space for it (ENOSPC)
                        raise rf.last_error
                    raise FsError(errno.EIO, f"{rf.key}: GET failed: {rf.last_error}")
                rf.cond.wait()

    def _claim(self, rf: RemoteFile, b0: int, b1: int) -> list[tuple[int, int]]:
        """Mark the absent (or failed) blocks of [b0, b1) as being fetched, in runs that are
        each one GET (at most a part, aligned to the part grid). Call with ``rf.cond``.
        Every READ of a sequential reader passes its whole read-ahead window (up to 4,096
        blocks) through here: the scans are ``bytearray.find``, not a loop per block."""
        part_blocks = max(1, self.settings.part_size // BLOCK)
        out = []
        states = rf.states
        i = b0
        while i < b1:
            i = _first_of(states, (ABSENT, FAILED), i, b1)
            if i >= b1:
                break
            j = min(b1, (i // part_blocks + 1) * part_blocks)
            j = _first_of(states, (FETCHING, PRESENT), i, j)
            states[i:j] = bytes([FETCHING]) * (j - i)
            rf.inflight += 1
            out.append((i, j))
            i = j
        return out

    # -- GETs ------------------------------------------------------------------------------

    def _submit(self, rf: RemoteFile, requests: list[tuple[int, int]], needed: tuple[int, int] | None = None) -> None:
        """Start the GETs of claimed runs. Each reserves its bytes in the cache cap first
        (``gateway/space.py``): a run that overlaps ``needed`` (None: all are) waits for room
        (ENOSPC after the backpressure timeout); read-ahead without room is given back."""
        space = self._state.space
        for b0, b1 in requests:
            if space is not None:
                wanted = needed is None or (b0 < needed[1] and needed[0] < b1)
                try:
                    if not space.reserve_fetch(min(b1 * BLOCK, rf.size) - b0 * BLOCK, wait=wanted):
                        self._unclaim(rf, b0, b1)
                        continue
                except FsError as exc:  # ENOSPC: the readers of these blocks get it
                    self._landed(rf, b0, b1, 0, exc, reserved=False)
                    continue
            try:
                self._bucket.submit(lambda store, b0=b0, b1=b1: self._get(store, rf, b0, b1))
            except BaseException as exc:
                self._landed(rf, b0, b1, 0, exc)
                raise

    @staticmethod
    def _unclaim(rf: RemoteFile, b0: int, b1: int) -> None:
        """A claimed run that will not be fetched now after all (read-ahead without room)."""
        with rf.cond:
            rf.states[b0:b1] = bytes([ABSENT]) * (b1 - b0)
            rf.inflight -= 1
            rf.cond.notify_all()

    async def _get(self, store, rf: RemoteFile, b0: int, b1: int) -> None:
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(self.settings.concurrency)
        start, end = b0 * BLOCK, min(b1 * BLOCK, rf.size)
        landed = False
        try:
            async with self._limiter:
                metrics.FETCHES_IN_FLIGHT.inc()
                t0 = time.perf_counter()
                source = (rf.key, rf.etag)
                try:
                    n = await store.get_to_file(rf.key, rf.fd, start, end - start, if_match=rf.etag or None)
                    error = None
                except Exception as exc:  # noqa: BLE001 - handed to the readers waiting for these blocks
                    n, error = 0, exc
                finally:
                    metrics.FETCHES_IN_FLIGHT.dec()
                    metrics.BUCKET_GET_SECONDS.observe(time.perf_counter() - t0)
            landed = True
            await trio.to_thread.run_sync(self._landed, rf, b0, b1, n, error, source)
        finally:
            if not landed:  # cancelled (the client closes): wake the waiters, no disk I/O here
                self._landed(rf, b0, b1, 0, FsError(errno.EIO, "bucket client closed"))

    def _landed(self, rf: RemoteFile, b0: int, b1: int, n: int, error: BaseException | None,
                source: tuple[str, str] | None = None, *, reserved: bool = True) -> None:
        """A GET (of ``source``: key, etag) finished (a worker thread of the bucket client's
        loop); ``reserved``: its bytes were reserved in the cache cap."""
        if (isinstance(error, (PreconditionFailedError, NotFoundError)) and source is not None
                and self._follow_move(rf, source)):
            # The same blocks, from where the object is now (its cap reservation carries over).
            self._bucket.submit(lambda store: self._get(store, rf, b0, b1))
            return
        expected = min(b1 * BLOCK, rf.size) - b0 * BLOCK
        if error is None and n != expected:
            error = PreconditionFailedError(f"GetObject {rf.key!r}: got {n} of {expected} bytes",
                                            code="IncompleteBody", op="GetObject", key=rf.key)
        if error is None and rf.fd >= 0:
            # Start the disk write now, so the fdatasync before the cached-clean commit finds
            # little left to do (as the write path's write-behind does).
            writeback.start_writeback(rf.fd, b0 * BLOCK, n)
        if self._state.space is not None and reserved:
            try:
                allocated = os.fstat(rf.fd).st_blocks * 512 if n else None
            except OSError:
                allocated = None
            self._state.space.fetch_landed(rf.ino, expected, allocated)
        with rf.cond:
            if error is None:
                rf.states[b0:b1] = bytes([PRESENT]) * (b1 - b0)
                rf.present += b1 - b0
                metrics.BUCKET_GET_BYTES.inc(n)
            else:
                rf.states[b0:b1] = bytes([FAILED]) * (b1 - b0)
                rf.last_error = error
                if isinstance(error, PreconditionFailedError):
                    metrics.FETCH_ERRORS.labels("changed").inc()
                    rf.error = rf.error or FsError(errno.ESTALE, f"{rf.key}: the object changed while it was read")
                elif isinstance(error, NotFoundError):
                    metrics.FETCH_ERRORS.labels("missing").inc()
                    rf.error = rf.error or FsError(errno.EIO, f"{rf.key}: the object is gone from the bucket")
                else:
                    metrics.FETCH_ERRORS.labels("failed").inc()
                log.warning("GET %s [%d, %d): %s", rf.key, b0 * BLOCK, b0 * BLOCK + expected, error)
            rf.cond.notify_all()
        if error is None:
            # Still counted in flight: the cache file stays open and nobody cuts it meanwhile.
            try:
                self._hash_prefix(rf)
            except OSError as exc:  # the file has its error (EIO): a later open fetches it again
                log.error("%s: hashing the fetched prefix failed: %s", rf.key, exc)
        verify = False
        with rf.cond:
            rf.inflight -= 1
            if error is None:
                verify = rf.complete and not rf.checking and not rf.local and rf.error is None
                rf.checking = rf.checking or verify
            rf.cond.notify_all()
        if verify:
            self._verify(rf)
        with self._lock:
            if rf.error is not None and self._files.get(rf.ino) is rf and rf.users == 0:
                self._drop(rf, empty=True)
            self._close_if_unused(rf)

    def _follow_move(self, rf: RemoteFile, source: tuple[str, str]) -> bool:
        """A rename or chmod of the file, drained while it is read, moved its object (a new key,
        and on S3 perhaps a new ETag) with the same content (the same generation): read on from
        there. False if the object really changed or went."""
        with self._state.meta.read() as txn:
            inode = txn.get_inode(rf.ino)
            record = txn.get_remote(rf.ino)
        with rf.cond:
            if (rf.key, rf.etag) != source:
                return not rf.local  # another GET of it moved it already
        if inode is None or record is None or inode.generation != rf.generation:
            return False
        return self._follow_record(rf, record)

    @staticmethod
    def _follow_record(rf: RemoteFile, record) -> bool:
        """Point ``rf`` at the object fsmeta records for the same content now (a drained rename
        or chmod copied it: a new key, on S3 perhaps a new ETag). True if it moved."""
        with rf.cond:
            if rf.local or not record.key or (record.key, record.etag) == (rf.key, rf.record_etag):
                return False
            rf.key, rf.etag, rf.record_etag = record.key, record.etag, record.etag
            return True

    def _hash_prefix(self, rf: RemoteFile, *, to_end: bool = False) -> str:
        """Feed the hasher the present blocks from where it stopped, in order, up to the first
        block not present. One thread at a time: another one finding it busy returns at once,
        unless ``to_end`` (the verify, all blocks present), which waits and hashes what is
        left. Returns the hex digest once the whole file is hashed, else ""."""
        if rf.hasher is None:
            return ""
        buf = None
        with rf.cond:
            while True:
                if rf.hashing or (not to_end and (rf.local or rf.error is not None)):
                    if not to_end:
                        return ""
                    rf.cond.wait()
                    continue
                start = rf.hashed
                stop = rf._present_run_end(start)
                if stop == start:
                    return rf.hasher.hexdigest() if start == rf.nblocks else ""
                rf.hashing = True
                try:
                    rf.cond.release()
                    try:
                        if buf is None:
                            buf = bytearray(HASH_CHUNK)
                        self._feed(rf, buf, start * BLOCK, min(stop * BLOCK, rf.size))
                    finally:
                        rf.cond.acquire()
                    rf.hashed = stop
                except OSError as exc:
                    # The hasher may have taken part of the run: it can never match now.
                    rf.error = rf.error or FsError(errno.EIO, f"{rf.key}: reading the cache file back failed: {exc}")
                    raise
                finally:
                    rf.hashing = False
                    rf.cond.notify_all()

    @staticmethod
    def _feed(rf: RemoteFile, buf: bytearray, pos: int, end: int) -> None:
        view = memoryview(buf)
        while pos < end:
            n = os.preadv(rf.fd, [view[:min(len(buf), end - pos)]], pos)
            if n <= 0:
                raise OSError(errno.EIO, f"cache file of inode {rf.ino} ended at {pos} while hashing")
            rf.hasher.update(view[:n])
            pos += n

    def _verify(self, rf: RemoteFile) -> None:
        """The whole object is in the cache file: check its blake3, then make it cached-clean."""
        if rf.blake3:
            try:
                digest = self._hash_prefix(rf, to_end=True)
            except OSError as exc:  # the file has its error (EIO): a later open fetches it again
                log.error("%s: hashing the cache file failed: %s", rf.key, exc)
                return
        else:
            digest = ""  # written by another tool: nothing to check against
        if rf.local:
            return  # truncated or rewritten meanwhile (``detach``): its bytes are the file's own now
        if rf.blake3 and digest != rf.blake3:
            metrics.INTEGRITY_FAILURES.inc()
            log.error("%s: blake3 of the fetched content is %s, the object says %s: not served",
                      rf.key, digest, rf.blake3)
            # Recorded before the readers hear of it: whoever gets the EIO then sees the state.
            self._commit(rf, durability.mark_remote_corrupt)
            with rf.cond:
                rf.error = FsError(errno.EIO, f"{rf.key}: content does not match its blake3")
                rf.cond.notify_all()
            with self._lock:
                if self._files.get(rf.ino) is rf:
                    self._drop(rf, empty=True)
            return
        with rf.cond:
            rf.verified = True
            rf.cond.notify_all()
        os.fdatasync(rf.fd)  # CACHED_CLEAN trusts the cache file, so it must be on the device
        self._state.sync_cache_names(rf.ino)
        self._commit(rf, durability.mark_cached_clean)
        if self._state.space is not None:
            self._state.space.touch(rf.ino)  # just fetched: the last the evictor should take
        with self._lock:
            if self._files.get(rf.ino) is rf:
                self._drop(rf, empty=False)
        with rf.cond:
            rf.cond.notify_all()

    def _commit(self, rf: RemoteFile, transition) -> None:
        def apply(txn: Txn) -> None:
            inode = txn.get_inode(rf.ino)
            record = txn.get_remote(rf.ino)
            if (inode is None or inode.state != FileState.REMOTE or inode.generation != rf.generation
                    or record is None or record.key != rf.key or record.etag != rf.record_etag):
                return  # the file or its record moved on meanwhile: this fetch decides nothing
            transition(txn, inode)

        try:
            self._state.meta.write(apply)
        except Exception:  # the readers have their answer; a later fetch records it
            log.exception("%s: recording the fetch result failed", rf.key)

"""The drain: makes the bucket match fsmeta, one pending inode at a time per task.

It executes what fsmeta says (``pending``, ``tombstones``, ``uploads``) and
decides nothing about namespace semantics:

* a file whose content generation is not in the bucket is uploaded under its
  current name (multipart, resumable; the part list is persisted after every
  part), then committed only if its generation and name did not move;
* a file whose content is in the bucket under another name (rename, hard
  link, metadata change) is server-side copied, then the old key is deleted;
* an empty directory gets a ``dir/`` marker object;
* a tombstone is deleted unless its key is live again or is still the source
  of a pending copy.

Runs under trio; every LMDB transaction and every file read happens in a
worker thread, and no transaction spans an ``await``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import posixpath
import secrets
import time
from dataclasses import dataclass, field

import trio

from ckptfs.fsmeta import ROOT_INO, FileState, MetaStore, RemoteRecord, UploadPhase, UploadRecord, durability
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.fsmeta.recovery import reconcile_cache_lengths
from ckptfs.fsmeta.txn import Txn

from . import schedule
from .cluster import ClusterCommit
from .isolation import KeyQuarantine, unexpected_code
from .localio import SourceChangedError
from .metrics import DURABLE_BUCKETS, REQUEST_BUCKETS, Histogram, TimedStore
from .store import (
    MOVING_PREFIX,
    NotFoundError,
    ObjectInfo,
    ObjectStore,
    PartRecord,
    PreconditionFailedError,
    PutResult,
    StoreError,
)
from .upload import (
    Backoff,
    FileDigest,
    RetryState,
    UploadAborted,
    UploadJournal,
    UploadOptions,
    abort_stale_uploads,
    digest_file,
    release_buffers,
    retry_forever,
    upload_bytes,
    upload_file,
    upload_part_size,
)

log = logging.getLogger("ckptfs.drain")

POLL_SECONDS = 0.1
# A scan reads every pending inode (and tombstone): with a long queue it runs less often than
# the loop polls, so that scanning takes at most this share of a core.
SCAN_CPU_SHARE = 0.1
STATUS_SECONDS = 1.0
RATE_SAMPLES = 10  # status periods the published upload rate averages over
PERMANENT_RETRY_SECONDS = 60.0  # longest wait before retrying a file after a permanent error
PERMANENT_RETRY_FIRST = 5.0  # first wait; doubles per consecutive failure up to the above
STALE_UPLOAD_SECONDS = 24 * 3600
IDLE_RELEASE_SECONDS = 5.0
WAIT_SOURCE_SECONDS = 0.2  # re-check of a file whose key still holds another inode's content
STALE_SWEEP_SECONDS = 3600.0  # how often a long-running drain aborts stale multipart uploads
# Back-off of a file that is requeued (changed under its upload, unreadable, waiting for a
# source): first wait, doubling per consecutive requeue, up to the cap.
CHANGED_BACKOFF = Backoff(0.5, 30.0)
OSERROR_BACKOFF = Backoff(PERMANENT_RETRY_FIRST, PERMANENT_RETRY_SECONDS)
WAIT_SOURCE_BACKOFF = Backoff(WAIT_SOURCE_SECONDS, 5.0)
HELD_BY_NODES_BACKOFF = Backoff(0.5, 5.0)  # a marker waiting for other nodes' files: look again
RECORD_SWEEP_SECONDS = 0.5  # how often this node's in-flight records of finished directories are deleted
DELETE_ERROR_PREFIX = "delete "  # an error of a tombstone's delete in the status, by key


def object_metadata(mode: int, uid: int, gid: int, mtime_ns: int, blake3: str = "", rdev: int = 0) -> dict[str, str]:
    """s3fs/rclone-compatible object metadata (mode/uid/gid decimal, mtime in seconds;
    a device's number as ``rdev``, as s3fs does)."""
    meta = {
        "mode": str(mode),
        "uid": str(uid),
        "gid": str(gid),
        "mtime": f"{mtime_ns // 1_000_000_000}.{mtime_ns % 1_000_000_000:09d}",
    }
    if blake3:
        meta["blake3"] = blake3
    if rdev:
        meta["rdev"] = str(rdev)
    return meta


def _removed(txn: Txn, ino: int) -> bool:
    """The inode is gone from fsmeta, or has no name left."""
    inode = txn.get_inode(ino)
    return inode is None or inode.nlink == 0


@dataclass
class FileJob:
    """What a reconcile read from fsmeta, and compares against at commit."""

    ino: int
    generation: int
    keys: list[str]
    changed_ns: int
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    is_symlink: bool
    target: bytes
    durable_in_bucket: bool
    remote: RemoteRecord | None
    upload: UploadRecord | None
    reason: str
    prior_attempt: bool = False  # state UPLOADING: an earlier attempt may have left an upload behind
    special: bool = False  # FIFO, socket or device: an empty object, no cache file
    # The key may have unrecorded multipart uploads still to abort (an earlier attempt; or the
    # abort after this upload failed): its tombstone keeps that job at the commit.
    unknown_uploads_left: bool = False
    rdev: int = 0
    # A writer opened it after the scan chose it: its size in fsmeta may predate bytes already
    # written (persisted at close), under a generation no later write bumps. Left queued.
    held_open: bool = False
    # Its content is nowhere (durability.is_remote_lost): queued again by a rename or chmod.
    lost: bool = False


@dataclass
class DrainStats:
    uploaded_bytes: int = 0
    uploaded_files: int = 0
    copied_objects: int = 0
    deleted_objects: int = 0
    retries: int = 0
    upload_seconds: float = 0.0
    in_flight: dict = field(default_factory=dict)  # ino -> {path, size, done}
    retrying: dict = field(default_factory=dict)  # what -> message
    errors: dict = field(default_factory=dict)  # path -> permanent error
    unexpected_errors: int = 0  # unforeseen exceptions caught around one item (drain/isolation.py)
    durable_latency: list = field(default_factory=list)  # recent pending->durable seconds
    # for Prometheus (ckptfs.drain.metrics reads them back from fsmeta)
    retries_by_code: collections.Counter = field(default_factory=collections.Counter)
    errors_by_code: collections.Counter = field(default_factory=collections.Counter)
    request_seconds: dict = field(default_factory=dict)  # op -> Histogram
    time_to_durable: Histogram = field(default_factory=lambda: Histogram(DURABLE_BUCKETS))
    sent_samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RATE_SAMPLES))

    def observe_request(self, op: str, seconds: float) -> None:
        hist = self.request_seconds.get(op)
        if hist is None:
            hist = self.request_seconds[op] = Histogram(REQUEST_BUCKETS)
        hist.observe(seconds)

    def upload_rate(self, now: float) -> float | None:
        """Bytes per second over the last RATE_SAMPLES status periods (parts in flight count)."""
        sent = self.uploaded_bytes + sum(p["done"] for p in self.in_flight.values())
        self.sent_samples.append((now, sent))
        (t0, b0), (t1, b1) = self.sent_samples[0], self.sent_samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else None


class Drain:
    def __init__(self, cache_dir: str, meta: MetaStore, settings, store: ObjectStore, *, clock=time.time_ns):
        self.cache_dir = cache_dir
        self.cache = CacheDir(cache_dir)
        self.meta = meta
        self.settings = settings
        self.clock = clock
        self.markers = list(settings.markers)
        self.settle_ns = int(float(settings.settle_seconds) * 1e9)
        self.part_size = int(settings.part_size)
        self.concurrency = int(settings.concurrency)
        self.busy: set[int] = set()
        # Set when a reconcile ends: the loop starts the next ready file at once, not at its
        # next poll (small files would drain at most concurrency / POLL_SECONDS per second).
        self.slot_freed = trio.Event()
        self.busy_keys: set[str] = set()
        self.deleting_keys: set[str] = set()
        self.retry_after: dict[int, float] = {}  # ino -> monotonic time of next attempt
        self.failures: dict[int, int] = {}  # ino -> consecutive failures or requeues (backoff)
        self.lost: dict[str, str] = {}  # path -> code: files whose cache lost data (never uploaded)
        self.held: list[str] = []  # markers left waiting for lost files when until_empty ended
        self.next_stale_sweep = time.monotonic() + STALE_SWEEP_SECONDS
        self.tombstones_running = False
        self.tombstone_quarantine = KeyQuarantine(Backoff(PERMANENT_RETRY_FIRST, PERMANENT_RETRY_SECONDS))
        self.unreadable: dict[str, str] = {}  # "<inode N>" or a tombstone's key -> code: the scan could not read it
        self.stats = DrainStats()
        self.store = TimedStore(store, self.stats.observe_request)
        self.cluster = ClusterCommit(self.store, read=self._read, write=self._write,
                                     node_timeout=float(settings.node_timeout))
        self.next_record_sweep = 0.0
        self.record_sweep_running = False
        self.idle_since: float | None = None
        self.until_empty = False
        self.buffers_released = False
        self.part_limiter = trio.CapacityLimiter(self.concurrency)
        self.upload_options = UploadOptions(
            part_size=self.part_size, concurrency=self.concurrency, part_limiter=self.part_limiter)
        self.status_journal = RetryStatusJournal(self)
        # Whole-file BLAKE3 before CreateMultipartUpload, one file at a time (BLAKE3 uses
        # every core): the first file's parts go out while the next one is hashed, instead
        # of every file of a checkpoint being hashed before the first byte is sent.
        self.hash_limiter = trio.CapacityLimiter(1)
        # BLAKE3 and part checksums of closed files computed while their settle window
        # runs (ino -> (generation, size, FileDigest)); used only if the generation did
        # not move.
        self.prehashed: dict[int, tuple[int, int, FileDigest | None]] = {}
        self.prehashing: int | None = None
        # One marker invalidation at a time: a shard that finds its markers already
        # requeued must not upload before the delete another task started has finished.
        self.invalidate_lock = trio.Lock()
        self.leaving_markers: dict[str, list[str]] = {}  # see _scan
        self.cycle_breaks: set[int] = set()  # inodes whose object _move_aside parks (see _must_wait_for_sources)
        # file ino -> the marker whose object sits at the file's key and that waits for the
        # file (see _frees_key_held_by_marker): the file's reconcile parks that object.
        self.marker_parks: dict[int, int] = {}

    # -- fsmeta access (always in a worker thread) ---------------------------------

    async def _read(self, fn, *args):
        def run():
            with self.meta.read() as txn:
                return fn(txn, *args)

        return await trio.to_thread.run_sync(run)

    async def _write(self, fn, *args):
        return await trio.to_thread.run_sync(lambda: self.meta.write(lambda txn: fn(txn, *args)))

    def _scan(self, txn: Txn) -> tuple[list[schedule.Candidate], list[tuple[str, dict]], dict[str, str],
                                       dict[str, list[str]]]:
        gateway_alive = self.cache.gateway_pid() is not None
        candidates = []
        lost = {}
        stale_markers = {}  # bucket key of a marker that will move (its old name is gone) -> its names
        dir_paths: dict[int, bytes | None] = {ROOT_INO: b""}  # this scan's directories (most share a few)

        def path_of(ino: int) -> bytes | None:  # Txn.path_of, each directory looked up once
            if ino == ROOT_INO:
                return b""
            links = txn.links_of(ino)
            if not links:
                return None
            parent, name = links[0]
            if parent not in dir_paths:
                dir_paths[parent] = txn.path_of(parent)
            base = dir_paths[parent]
            return None if base is None else (base + b"/" + name if base else name)

        unreadable: dict[str, str] = {}
        note = functools.partial(self._note_unreadable, unreadable)

        def skip_inode(ino: int, exc: Exception) -> None:  # one inode's record: the others still drain
            cand = self._unreadable_candidate(txn, ino)
            note(cand.path if cand is not None else f"<inode {ino}>", exc)
            if cand is not None:
                candidates.append(cand)

        for ino, rec in txn.iter_pending(on_unreadable=skip_inode):
            try:
                cand = self._scan_one(txn, ino, rec, path_of, gateway_alive, lost, stale_markers)
            except Exception as exc:
                skip_inode(ino, exc)
                continue
            if cand is not None:
                candidates.append(cand)
        tombstones = []
        for key, rec in txn.iter_tombstones(on_unreadable=note):
            try:
                if (durability.awaits_its_writer(txn, key, rec) or durability.held_for_new_names(txn, rec)
                        or schedule.below_marker(key, list(stale_markers), self.markers)):
                    continue
            except Exception as exc:
                note(key, exc)
                continue
            tombstones.append((key, rec))
        self.unreadable = unreadable
        # Markers still in the bucket that are leaving: moving, or queued for deletion.
        leaving_markers = stale_markers | {
            key: [] for key, _ in tombstones if not key.endswith("/") and schedule.is_marker(key, self.markers)}
        return candidates, tombstones, lost, leaving_markers

    @staticmethod
    def _unreadable_candidate(txn: Txn, ino: int) -> schedule.Candidate | None:
        """A pending inode the scan could not read, where its names can still be found: it never
        starts, but holds back the markers above it, as a file whose cache lost data does."""
        try:
            paths = sorted(p.decode("utf-8", "surrogateescape") for p in txn.paths_of(ino))
        except Exception:
            return None
        if not paths:
            return None
        return schedule.Candidate(ino, paths[0], 0, 0, False, 0, False, lost=True, other_paths=tuple(paths[1:]))

    def _note_unreadable(self, unreadable: dict[str, str], what: str, exc: Exception) -> None:
        code = unexpected_code(exc)
        if what not in self.unreadable:  # once per item, not at every scan
            log.error("the drain cannot read the record of %s (%s); it is skipped, other files drain",
                      what, code, exc_info=exc)
            self.stats.errors_by_code[code] += 1
            self.stats.unexpected_errors += 1
        unreadable[what] = code

    def _scan_one(self, txn: Txn, ino: int, rec, path_of, gateway_alive: bool, lost: dict,
                  stale_markers: dict) -> schedule.Candidate | None:
        inode = txn.get_inode(ino)
        if inode is None:
            return None
        remote = txn.get_remote(ino)
        if remote is not None and inode.nlink > 0 and schedule.is_marker(remote.key, self.markers):
            names = [p.decode("utf-8", "surrogateescape") for p in txn.paths_of(ino)]
            if remote.key not in names:
                stale_markers[remote.key] = names
        path = path_of(ino)
        if path is None:
            return None
        is_lost = durability.is_cache_lost(txn, ino)
        if is_lost:
            # Nothing to upload until it is written again (or removed).
            lost[path.decode("utf-8", "surrogateescape")] = txn.get_error(ino)
        writers = txn.writer_count(ino) if gateway_alive else 0
        first = path.decode("utf-8", "surrogateescape")
        others: tuple[str, ...] = ()
        if inode.nlink > 1 and not inode.is_dir:
            # Every name of a hard-linked shard holds back the markers above it.
            others = tuple(sorted({p.decode("utf-8", "surrogateescape") for p in txn.paths_of(ino)} - {first}))
        return schedule.Candidate(
            ino, first, rec.since_ns, rec.changed_ns,
            inode.is_dir, writers, rec.urgent, is_lost, others,
        )

    # -- main loop -------------------------------------------------------------------

    async def run(self, *, until_empty: bool = False, stop: trio.Event | None = None) -> None:
        """Drain until ``stop`` is set, or, once ``until_empty`` (also settable later through
        the attribute of the same name), until nothing is left to do."""
        self.until_empty = self.until_empty or until_empty
        await self._startup()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._status_loop)
            ready: list[schedule.Candidate] = []  # regular files the last scan found ready, not started yet
            next_scan = 0.0
            while stop is None or not stop.is_set():
                if time.monotonic() < next_scan:
                    # Between scans, slots that free up take what the last scan found ready.
                    ready = self._start_ready(nursery, ready)
                    await self._poll_wait(bool(ready))
                    continue
                try:
                    (candidates, tombstones, self.lost, self.leaving_markers), scan_cpu = \
                        await self._read(self._timed_scan)
                    self._prune_errors(candidates, tombstones)
                    if time.monotonic() >= self.next_record_sweep and not self.record_sweep_running:
                        self.next_record_sweep = time.monotonic() + RECORD_SWEEP_SECONDS
                        self.record_sweep_running = True
                        nursery.start_soon(self._record_sweep_task)
                    if (self.until_empty and not tombstones and not self.busy
                            and all(c.lost or schedule.held_by_lost(c, candidates, self.markers)
                                    or c.path in self.cluster.held for c in candidates)
                            and not await self.cluster.pending_removals()):
                        # Empty, but for files that lost their cache data (self.lost) and the
                        # markers that wait for them.
                        self.held = [c.path for c in candidates if not c.lost]
                        break
                    if time.monotonic() >= self.next_stale_sweep:
                        self.next_stale_sweep = time.monotonic() + STALE_SWEEP_SECONDS
                        nursery.start_soon(self._sweep_stale_uploads)
                    if not candidates and not self.busy:
                        self._release_buffers_when_idle()
                    else:
                        self.idle_since = None
                    now = self.clock()
                    cpu_before = time.thread_time()
                    eligible = schedule.eligible(candidates, now_ns=now, settle_ns=self.settle_ns,
                                                 markers=self.markers, busy=self.busy)
                    scan_cpu += time.thread_time() - cpu_before
                    next_scan = time.monotonic() + self._scan_interval(scan_cpu)
                    # What waits for a slot may start before the next scan, except directories
                    # and markers: their turn depends on other pending inodes, judged at a scan.
                    ready = [c for c in self._start_ready(nursery, eligible)
                             if not c.is_dir and not any(schedule.is_marker(p, self.markers) for p in c.paths)]
                    if tombstones and not self.tombstones_running:
                        self.tombstones_running = True
                        nursery.start_soon(self._tombstone_task, tombstones)
                    if self.prehashing is None and self.settle_ns > 0:
                        self._start_prehash(nursery, candidates, eligible, now)
                except Exception:
                    # A defect in the loop itself: shown and retried, never the end of the
                    # drain (a restart would meet it again, and nothing would drain meanwhile).
                    log.exception("the drain's scan failed; it runs again in %.0fs", PERMANENT_RETRY_FIRST)
                    self.stats.unexpected_errors += 1
                    ready, next_scan = [], time.monotonic() + PERMANENT_RETRY_FIRST
                await self._poll_wait(bool(ready))
            nursery.cancel_scope.cancel()
        await self._publish_status()

    async def _poll_wait(self, waiting_for_a_slot: bool) -> None:
        """Until the next poll; or, while ready files wait for a slot, until one frees up."""
        if waiting_for_a_slot:
            with trio.move_on_after(POLL_SECONDS):
                await self.slot_freed.wait()
        else:
            await trio.sleep(POLL_SECONDS)
        self.slot_freed = trio.Event()

    @staticmethod
    def _scan_interval(scan_cpu: float) -> float:
        """Seconds until the next scan, after one that took ``scan_cpu`` CPU seconds."""
        return max(POLL_SECONDS, scan_cpu / SCAN_CPU_SHARE)

    def _timed_scan(self, txn: Txn) -> tuple[tuple, float]:
        """:meth:`_scan` and the CPU seconds it took (it runs in a worker thread)."""
        start = time.thread_time()
        return self._scan(txn), time.thread_time() - start

    def _start_ready(self, nursery, ready: list[schedule.Candidate]) -> list[schedule.Candidate]:
        """Start ``ready`` candidates (oldest first) while slots are free; returns those left
        for want of a slot. One in back-off or whose key is being deleted waits for a scan."""
        mono = time.monotonic()
        for i, cand in enumerate(ready):
            if len(self.busy) >= self.concurrency:
                return ready[i:]
            if cand.ino in self.busy or self.retry_after.get(cand.ino, 0) > mono:
                continue
            if cand.path in self.deleting_keys:
                continue
            self.busy.add(cand.ino)
            nursery.start_soon(self._reconcile_task, cand)
        return []

    def _release_buffers_when_idle(self) -> None:
        """Part buffers (concurrency x part size) go back to the OS after a quiet spell."""

        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
            self.buffers_released = False
        elif not self.buffers_released and now - self.idle_since >= IDLE_RELEASE_SECONDS:
            self.store.release_buffers()
            release_buffers()
            self.buffers_released = True

    def _prune_errors(self, candidates: list[schedule.Candidate], tombstones: list[tuple[str, dict]]) -> None:
        """Errors of files and keys that succeeded since, or are gone, leave the status."""
        live = {c.path for c in candidates} | set(self.lost) | set(self.unreadable)
        deleting = {DELETE_ERROR_PREFIX + k for k, _ in tombstones}
        for path in [p for p in self.stats.errors if p not in live and p not in deleting]:
            del self.stats.errors[path]
        self.tombstone_quarantine.forget_except({k for k, _ in tombstones})
        self.stats.errors.update(self.lost)
        self.stats.errors.update(self.unreadable)

    async def _startup(self) -> None:
        await self._retry("check bucket access", lambda: self.store.check_access(write=True))
        await self.cluster.start()
        if self.cache.gateway_pid() is None:
            # No gateway: nobody else reconciles cache files with fsmeta after a crash
            # (`ckptfs drain --until-empty` after a kill -9 or a power cut).
            await self._reconcile_cache_lengths()
        await self._sweep_stale_uploads()

    async def _reconcile_cache_lengths(self, inos: list[int] | None = None) -> None:
        result = await trio.to_thread.run_sync(
            functools.partial(reconcile_cache_lengths, self.meta, self.cache, inos=inos, skip_open=True))
        if result["trimmed_files"]:
            log.info("cut %d cache files to the size fsmeta recorded", result["trimmed_files"])
        for path, code in result["lost_files"].items():
            log.error("%s: its cache file lost bytes fsmeta recorded (%s); it will not be uploaded", path, code)
            self.stats.errors_by_code[code] += 1

    async def _sweep_stale_uploads(self) -> None:
        try:
            await self._abort_stale_uploads()
        except StoreError as exc:
            log.warning("could not list multipart uploads to abort stale ones: %s", exc)
        except Exception:
            log.exception("the sweep of stale multipart uploads failed; it runs again in an hour")
            self.stats.unexpected_errors += 1

    async def _abort_stale_uploads(self) -> None:
        """Abort multipart uploads nobody will complete: older than a day and not ours."""

        ours = {rec.upload_id for _, rec in await self._read(lambda txn: list(txn.iter_uploads()))}
        for info in await abort_stale_uploads(self.store, ours, STALE_UPLOAD_SECONDS):
            log.info("aborted stale multipart upload of %s (started %s)", info.key, info.initiated)

    async def _retry(self, what: str, op):
        """Run ``op`` until it succeeds; retryable errors back off forever, visibly."""
        return await retry_forever(op, what=what, on_retry=functools.partial(self._show_retry, what))

    async def _show_retry(self, what: str, state: RetryState | None) -> None:
        """Put a retry streak of ``what`` in the drain status (None: it is over)."""
        if state is None:
            self.stats.retrying.pop(what, None)
            return
        self.stats.retries += 1
        self.stats.retries_by_code[state.code] += 1
        self.stats.retrying[what] = f"{state.code} (attempt {state.attempt}, next in {state.delay:.1f}s)"
        if state.attempt == 1:
            # visible right away, also before the status loop runs (startup check)
            await self._publish_status()

    # -- one inode ---------------------------------------------------------------------

    async def _reconcile_task(self, cand: schedule.Candidate) -> None:
        try:
            if cand.is_dir:
                await self._reconcile_dir(cand)
            else:
                await self._reconcile_file(cand)
            if self.retry_after.get(cand.ino, 0) <= time.monotonic():
                self.retry_after.pop(cand.ino, None)
                self.failures.pop(cand.ino, None)
            self.stats.errors.pop(cand.path, None)
        except SourceChangedError as exc:
            # The cache file does not match fsmeta (yet): a write racing with the upload,
            # or, with no gateway alive, the remains of a crash, which reconciling settles.
            log.info("upload of %s abandoned, file changed meanwhile (%s); requeued", cand.path, exc)
            self._requeue(cand.ino, CHANGED_BACKOFF)
            if self.cache.gateway_pid() is None:
                await self._reconcile_cache_lengths([cand.ino])
        except StoreError as exc:
            # Permanent: keep the data dirty, show the error, try again later (5 s, 10 s, ...
            # up to a minute: an operator who fixes the bucket policy sees uploads resume soon).
            log.error("upload of %s failed permanently: %s", cand.path, exc)
            self.stats.errors[cand.path] = exc.code
            self.stats.errors_by_code[exc.code] += 1
            await self._write(durability.mark_error, cand.ino, exc.code)
            self._requeue(cand.ino, Backoff(PERMANENT_RETRY_FIRST, PERMANENT_RETRY_SECONDS))
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and await self._read(_removed, cand.ino):
                # Unlinked as its upload started (the gateway removes or recycles the cache
                # file of a closed, unlinked file): nothing is lost, and nothing to report.
                log.info("%s was removed as its upload started; not uploaded", cand.path)
            else:
                log.error("reading the cache for %s failed: %s", cand.path, exc)
            self._requeue(cand.ino, OSERROR_BACKOFF)
            if isinstance(exc, FileNotFoundError) and self.cache.gateway_pid() is None:
                await self._reconcile_cache_lengths([cand.ino])
        except Exception as exc:  # unforeseen, tied to this file: it waits, the others drain
            code = unexpected_code(exc)
            log.exception("draining %s failed unexpectedly (%s); it is retried later, other files go on",
                          cand.path, code)
            self.stats.errors[cand.path] = code
            self.stats.errors_by_code[code] += 1
            self.stats.unexpected_errors += 1
            try:
                await self._write(durability.mark_error, cand.ino, code)
            except Exception:
                log.exception("could not record the error of %s in fsmeta", cand.path)
            self._requeue(cand.ino, Backoff(PERMANENT_RETRY_FIRST, PERMANENT_RETRY_SECONDS))
        finally:
            self.busy.discard(cand.ino)
            self.stats.in_flight.pop(cand.ino, None)
            self.slot_freed.set()

    def _requeue(self, ino: int, backoff: Backoff) -> None:
        """Try ``ino`` again later, waiting longer after each consecutive requeue."""
        n = self.failures[ino] = self.failures.get(ino, 0) + 1
        self.retry_after[ino] = time.monotonic() + backoff.delay(n)

    def _load_file(self, txn: Txn, ino: int) -> FileJob | None:
        inode = txn.get_inode(ino)
        pending = txn.get_pending(ino)
        if inode is None or pending is None or inode.nlink == 0:
            return None
        keys = sorted(p.decode("utf-8", "surrogateescape") for p in txn.paths_of(ino))
        remote = txn.get_remote(ino)
        durable = (remote is not None and inode.durable_generation == inode.generation
                   and remote.generation == inode.generation)
        # An earlier attempt may have left a multipart upload nobody recorded: it was cut off
        # (UPLOADING), or its key says so (the file was written again since).
        prior_attempt = inode.state == FileState.UPLOADING or any(
            (txn.get_tombstone(k) or {}).get("multipart") for k in keys)
        return FileJob(
            ino, inode.generation, keys, pending.changed_ns, inode.size, inode.mode, inode.uid,
            inode.gid, inode.mtime_ns, inode.is_symlink, inode.target, durable, remote,
            txn.get_upload(ino), pending.reason, prior_attempt,
            special=not (inode.is_reg or inode.is_dir or inode.is_symlink), rdev=inode.rdev,
            unknown_uploads_left=prior_attempt,
            # Read with the inode, in this transaction: the scan's count may be stale.
            held_open=(not pending.urgent and txn.writer_count(ino) > 0
                       and self.cache.gateway_pid() is not None),
            lost=remote is None and durability.is_remote_lost(txn, inode),
        )

    async def _reconcile_file(self, cand: schedule.Candidate) -> None:
        job = await self._read(self._load_file, cand.ino)
        if job is None or not job.keys:
            await self._write(lambda txn: self._drop_if_gone(txn, cand.ino))
            return
        if job.lost and await self._write(self._take_off_if_lost, job.ino):
            return
        if any(k in self.deleting_keys or k in self.busy_keys for k in job.keys):
            return  # a delete of, or another write to, this name is in flight; next round
        if job.held_open:
            # The release restarts its settle window; the scan then sees no writer.
            log.info("%s: opened for writing since it was chosen; left queued", job.keys[0])
            return
        self.busy_keys.update(job.keys)
        started = time.monotonic()
        try:
            async with self.invalidate_lock:  # (its victims check is taken under it)
                clear = await self._read(self._nothing_in_the_way, job)
            if clear:
                pass  # the usual case: one read instead of the four below
            elif (await self._read(self._blocking_owner, job.ino, job.keys) is not None
                    and await self._write(self._must_wait_for_sources, job)):
                # Another inode's content still sits at one of our keys: give its move
                # the slot (with concurrency 1 we would otherwise be picked first forever).
                if job.ino in self.cycle_breaks:
                    try:
                        await self._move_aside(job)
                    finally:
                        self.cycle_breaks.discard(job.ino)
                marker = self.marker_parks.pop(job.ino, None)
                if marker is not None:
                    await self._move_marker_aside(marker)
                self._requeue(job.ino, WAIT_SOURCE_BACKOFF)
                return
            # Markers first: a marker moving away (RENAME_EXCHANGE of two checkpoints) is deleted
            # here, not waited for, since its move may wait for this very file.
            elif not await self._invalidate_markers(job):
                self._requeue(job.ino, WAIT_SOURCE_BACKOFF)
                return
            elif not await self._drop_moved_dir_markers(job):
                self._requeue(job.ino, WAIT_SOURCE_BACKOFF)
                return
            elif await self._read(self._must_wait_for_leaving_objects, job):
                await self._write(durability.release_held_in_the_way, job.keys)
                partner = await self._read(self._shape_cycle_partner, job)
                if partner is not None and not self.cycle_breaks & {job.ino, partner}:
                    await self._break_shape_cycle(job)
                marker = await self._read(self._leaving_marker_waiting_for, job)
                if marker is not None:
                    await self._move_marker_aside(marker)
                self._requeue(job.ino, WAIT_SOURCE_BACKOFF)
                return
            marker_keys = [k for k in job.keys if schedule.is_marker(k, self.markers)]
            if marker_keys:
                # Cluster commit: the other nodes' files of this checkpoint go first.
                holders = await self.cluster.holders(marker_keys)
                if holders:
                    self.cluster.note_held(marker_keys[0], sorted(holders), await self.cluster.lost(holders))
                    self._requeue(job.ino, HELD_BY_NODES_BACKOFF)
                    return
                self.cluster.note_released(marker_keys[0])
            primary = job.keys[0]
            await self._write(self._begin_writes, job)
            if job.durable_in_bucket:
                blake3 = job.remote.blake3
                meta = object_metadata(job.mode, job.uid, job.gid, job.mtime_ns, blake3, job.rdev)
                etag = source_etag = job.remote.etag
                etags = {job.remote.key: job.remote.etag}  # key -> ETag of the object now there
                for key in job.keys:
                    if key != job.remote.key or job.reason == "meta":
                        try:
                            copied = await self._move_copy(job.remote.key, key, meta, if_match=source_etag)
                        except (NotFoundError, PreconditionFailedError) as exc:
                            await self._copy_source_lost(job, exc)
                            return
                        self.stats.copied_objects += 1
                        etags[key] = copied.etag
                        if key == job.remote.key:
                            source_etag = copied.etag  # (copied onto itself: the next copy's source)
                        if key == primary:
                            # S3 gives a copy of a multipart object a new ETag: reads send If-Match.
                            etag = copied.etag
                link_etags = {k: etags[k] for k in job.keys[1:] if etags.get(k)}
                size = job.remote.size
            else:
                etag, blake3, size = await self._upload(job, primary)
                if etag is None:
                    return  # generation moved during the upload: requeued
                meta = object_metadata(job.mode, job.uid, job.gid, job.mtime_ns, blake3, job.rdev)
                link_etags = {}
                for key in job.keys[1:]:
                    try:
                        copied = await self._retry(f"copy {primary} -> {key}", lambda key=key: self.store.copy(
                            primary, key, metadata=meta, if_match=etag))
                    except (NotFoundError, PreconditionFailedError):
                        # Another node or tool wrote the first key meanwhile: copying its bytes
                        # under this file's blake3 would fail every read. The cache holds the
                        # file: upload it again (the local content wins, as in a listing).
                        log.warning("%s: replaced or deleted outside ckptfs right after its upload; "
                                    "uploading it again", primary)
                        self._requeue(job.ino, WAIT_SOURCE_BACKOFF)
                        return
                    if copied.etag:
                        link_etags[key] = copied.etag
                self.stats.uploaded_files += 1
                self.stats.uploaded_bytes += size
                self.stats.upload_seconds += time.monotonic() - started
            record = RemoteRecord(primary, size, blake3, job.generation, etag or "", link_etags=link_etags)
            latency = await self._write(self._commit_file, job, record)
            if latency is not None:
                since_first_change, since_last_close = latency
                self.stats.durable_latency = (self.stats.durable_latency + [since_first_change])[-1000:]
                self.stats.time_to_durable.observe(since_last_close)
        finally:
            self.busy_keys.difference_update(job.keys)

    def _nothing_in_the_way(self, txn: Txn, job: FileJob) -> bool:
        """In one read, that none of the checks before a write finds anything to wait for or
        to do: no other inode's content at one of ``job``'s keys (``_blocking_owner``), no
        marker to invalidate, no moved directory's marker, no object on its way out. Each of
        them is a thread hop of its own otherwise, the dearest part of a small file's
        reconcile; when one finds something, the reconcile runs them in turn as before."""
        return (self._blocking_owner(txn, job.ino, job.keys) is None
                and not self._markers_to_invalidate(txn, job)
                and not self._moved_dir_markers(txn, job)
                and not self._must_wait_for_leaving_objects(txn, job))

    def _must_wait_for_leaving_objects(self, txn: Txn, job: FileJob) -> bool:
        """Objects on their way out of the bucket must be gone before ``job`` is written: a
        marker that vouches for an object it would replace, or objects of the other shape
        (:func:`durability.key_shape_in_flux`)."""
        return (self._replaces_below_leaving_marker(txn, job)
                or any(durability.key_shape_in_flux(txn, k) for k in job.keys))

    @classmethod
    def _shape_cycle_partner(cls, txn: Txn, job: FileJob) -> int | None:
        """An inode whose object of the other shape ``job`` waits for and which waits, through
        such waits or for another inode's object at its own key (a copy source), for ``job``'s
        own object to leave: a file exchanged with a directory that holds files (``d/b``'s move
        to ``a/b`` waits for the file object ``a``, whose move to ``d`` waits for ``d/b``), or a
        rotation through both kinds of wait (``c``'s move from ``d`` waits for the object
        ``c/f``, whose file's move to ``b/f`` waits for the object there, whose file's move to
        ``d/f`` waits for the object ``d``). None can go first, so ``job``'s object leaves
        first (:meth:`_break_shape_cycle`). None if there is no such cycle."""
        if job.remote is None:
            return None
        first: dict[int, int] = {}  # inode reached -> the blocker of job's keys it was reached through
        todo = []
        for key in job.keys:
            for owner in durability.shape_blockers(txn, key):
                first.setdefault(owner, owner)
                todo.append(owner)
        while todo:
            cur = todo.pop()
            paths = [p.decode("utf-8", "surrogateescape") for p in txn.paths_of(cur)]
            waits = {owner for path in paths for owner in durability.shape_blockers(txn, path)}
            source = cls._blocking_owner(txn, cur, paths)
            if source is not None:
                waits.add(source)
            for owner in waits:
                if owner == job.ino:
                    return first[cur]
                if owner not in first:
                    first[owner] = first[cur]
                    todo.append(owner)
        return None

    async def _break_shape_cycle(self, job: FileJob) -> None:
        """Take ``job``'s object out of a :meth:`_shape_cycle_partner` cycle: park it aside if
        it is the file's content; if the cache has replaced that content, delete it now."""
        self.cycle_breaks.add(job.ino)  # (the partner, reconciled meanwhile, waits)
        try:
            if job.durable_in_bucket:
                await self._move_aside(job)
                return

            def drop(txn: Txn) -> bool:
                inode = txn.get_inode(job.ino)
                return inode is not None and self._cache_holds(inode) and durability.drop_superseded_object(txn, inode)

            if await self._write(drop):
                log.info("%s: its old object %s stands in the way of moves it waits for; deleting it now",
                         job.keys[0], job.remote.key)
        finally:
            self.cycle_breaks.discard(job.ino)

    def _replaces_below_leaving_marker(self, txn: Txn, job: FileJob) -> bool:
        """Writing ``job`` would replace an object below the old directory of a marker that is
        still in the bucket there and is leaving (moving with its renamed checkpoint, or being
        deleted): it waits until the marker is gone. (Not for a file below the marker's new
        directory: the marker's move waits for that file.)"""
        return bool(self._leaving_markers_in_the_way(txn, job))

    def _leaving_markers_in_the_way(self, txn: Txn, job: FileJob) -> list[str]:
        """The keys of the leaving markers :meth:`_replaces_below_leaving_marker` waits for."""
        out = []
        for key in job.keys:
            if schedule.is_marker(key, self.markers):
                continue
            if txn.owner_of_remote_key(key) is None and txn.get_tombstone(key) is None:
                continue  # no object there: nothing a marker vouched for changes
            for marker, names in self.leaving_markers.items():
                if (schedule.below_marker(key, [marker], self.markers)
                        and not schedule.below_marker(key, names, self.markers)):
                    out.append(marker)
        return out

    def _leaving_marker_waiting_for(self, txn: Txn, job: FileJob) -> int | None:
        """A marker in the way of ``job`` (:meth:`_leaving_markers_in_the_way`) whose move
        waits for ``job``'s object (directly or through other files' moves: evicted files
        rotating names through the marker, ``s0 -> .metadata -> sub/s2 -> s0``), or for a file
        below its new directory that waits for ``job`` (two checkpoints exchanged, a shard
        written again: :meth:`_waits_of`), and whose content the cache does not hold: neither
        can go first, so the marker's object is parked aside (:meth:`_move_marker_aside`),
        which deletes it from its old key. None if there is no such marker. (A marker the cache
        holds is not waited for: it is deleted and uploaded again, :meth:`_invalidate_markers`;
        one it does not hold could not be put back.)"""
        pending_files: list[tuple[int, list[str]]] | None = None
        for key in self._leaving_markers_in_the_way(txn, job):
            marker = txn.owner_of_remote_key(key)
            inode = txn.get_inode(marker) if marker is not None else None
            if inode is None or inode.nlink == 0 or self._cache_holds(inode):
                continue
            if pending_files is None:
                pending_files = self._pending_file_paths(txn)
            seen = {marker}
            todo = [marker]
            while todo:
                for nxt in self._waits_of(txn, todo.pop(), pending_files):
                    if nxt == job.ino:
                        return marker
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
        return None

    @staticmethod
    def _pending_file_paths(txn: Txn) -> list[tuple[int, list[str]]]:
        """(inode, its paths) of every pending file that is not a directory."""
        out = []
        for ino in txn.pending_inos():
            inode = txn.get_inode(ino)
            if inode is not None and inode.nlink > 0 and not inode.is_dir:
                out.append((ino, [p.decode("utf-8", "surrogateescape") for p in txn.paths_of(ino)]))
        return out

    def _waits_of(self, txn: Txn, ino: int, pending_files: list[tuple[int, list[str]]]) -> list[int]:
        """The inodes whose bucket writes the write of ``ino`` waits for: the owner of an
        object at one of its keys (:meth:`_blocking_owner`) and, for a marker, the pending
        files below its directory (:func:`schedule.marker_waits_for`)."""
        keys = [p.decode("utf-8", "surrogateescape") for p in txn.paths_of(ino)]
        out = []
        owner = self._blocking_owner(txn, ino, keys)
        if owner is not None:
            out.append(owner)
        for key in keys:
            if schedule.is_marker(key, self.markers):
                out.extend(other for other, paths in pending_files if other != ino
                           and any(schedule.marker_waits_for(key, p, self.markers) for p in paths))
        return out

    @staticmethod
    def _moved_dir_markers(txn: Txn, job: FileJob) -> list[tuple[int, str]]:
        """(directory inode, ``k/``) for each of ``job``'s keys ``k`` that still has the marker
        of a directory renamed away from that name."""
        out = []
        for key in job.keys:
            marker = key + "/"
            owner = txn.owner_of_remote_key(marker)
            inode = txn.get_inode(owner) if owner is not None else None
            if inode is None or not inode.is_dir:
                continue
            path = txn.path_of(owner)
            if path is None or path.decode("utf-8", "surrogateescape") != key:
                out.append((owner, marker))
        return out

    async def _drop_moved_dir_markers(self, job: FileJob) -> bool:
        """A file takes the name of an empty directory that moved (``RENAME_EXCHANGE`` of a file
        and an empty directory): the old ``name/`` marker is deleted now, not moved. Its move
        (a marker at the directory's new name) waits for the file's old object to leave, which
        waits for this file: the directory puts its marker afresh instead. False: that marker
        is being written or deleted right now; try again later."""
        moved = await self._read(self._moved_dir_markers, job)
        if any(marker in self.busy_keys or marker in self.deleting_keys for _, marker in moved):
            return False
        keys = {marker for _, marker in moved}
        self.busy_keys.update(keys)  # (no marker put or tombstone delete of them meanwhile)
        try:
            for dir_ino, marker in moved:
                log.info("%s: its directory moved and a file takes the name; deleting it", marker)
                await self._retry(f"delete {marker}", lambda marker=marker: self.store.delete(marker))
                self.stats.deleted_objects += 1

                def forget(txn: Txn, dir_ino=dir_ino, marker=marker) -> None:
                    remote = txn.get_remote(dir_ino)
                    if remote is not None and remote.key == marker:
                        txn.delete_remote(dir_ino)
                        inode = txn.get_inode(dir_ino)
                        if inode is not None and inode.nlink > 0:
                            # Its round puts its marker at its current name. Renamed itself,
                            # it is queued already; moved with its parent it is not (only the
                            # parent is, whose round queues the children whose record names an
                            # old key: with the record gone, it would never be).
                            durability.mark_moved(txn, dir_ino, self.clock())

                await self._write(forget)
        finally:
            self.busy_keys.difference_update(keys)
        return True

    def _begin_writes(self, txn: Txn, job: FileJob) -> None:
        """Record the keys this reconcile writes before it writes them (a crash before the
        commit must not leave an object, or a multipart upload, nobody knows about), and,
        for an upload, that it starts (state UPLOADING): one synced commit for both."""
        if job.durable_in_bucket:
            keys = [k for k in job.keys if k != job.remote.key or job.reason == durability.META]
            multipart_key = None
        else:
            keys = job.keys
            uploads_parts = job.size > self.part_size and not (job.is_symlink or job.special)
            multipart_key = job.keys[0] if uploads_parts else None
            durability.mark_uploading(txn, job.ino, job.generation)
        durability.begin_bucket_writes(txn, job.ino, keys, multipart_key=multipart_key)

    # -- markers of a checkpoint whose shards are replaced -----------------------------------

    def _markers_to_invalidate(self, txn: Txn, job: FileJob) -> list[tuple[int, str]]:
        """Markers in the bucket (inode, key) in the directories above ``job``'s keys, if writing
        those keys replaces an object (a re-save into an existing checkpoint directory)."""
        keys = [k for k in job.keys if not schedule.is_marker(k, self.markers)]
        if job.durable_in_bucket:
            keys = [k for k in keys if k != job.remote.key]  # rewritten in place: same content
        def replaces_object(key: str) -> bool:
            if txn.owner_of_remote_key(key) is not None:
                return True
            # Nobody's record, but an object still there (a parked object's old key).
            tombstone = txn.get_tombstone(key)
            return tombstone is not None and tombstone.get("writer") != job.ino

        if not any(replaces_object(k) for k in keys):
            return []  # new names only: nothing the markers vouched for changes
        out: dict[int, str] = {}
        dirs = set()
        for key in keys:
            d = posixpath.dirname(key)
            while d not in dirs:
                dirs.add(d)
                if not d:
                    break
                d = posixpath.dirname(d)
        for d in dirs:
            if d:
                # Markers whose object is in ``d`` but whose inode was renamed away (not moved
                # in the bucket yet): they still vouch for what is in ``d``.
                for key, owner in txn.remote_keys_below(d + "/"):
                    if posixpath.dirname(key) == d and schedule.is_marker(key, self.markers):
                        inode = txn.get_inode(owner)
                        if (inode is not None and inode.nlink > 0
                                and (inode.state != FileState.REMOTE or inode.is_symlink)):
                            out[owner] = key
            dir_ino = txn.resolve(d.encode("utf-8", "surrogateescape")) if d else ROOT_INO
            if dir_ino is None:
                continue
            for name, child in txn.iter_dir(dir_ino):
                if not schedule.is_marker(name.decode("utf-8", "surrogateescape"), self.markers):
                    continue
                inode = txn.get_inode(child)
                remote = txn.get_remote(child)
                if inode is None or inode.nlink == 0:
                    continue
                if remote is None:
                    # An upload of it a crash cut off before its commit may have landed.
                    key = posixpath.join(d, name.decode("utf-8", "surrogateescape"))
                    intent = txn.get_tombstone(key)
                    if intent is not None and intent.get("writer") == child:
                        out[child] = key
                    continue
                if inode.state == FileState.REMOTE and not inode.is_symlink:
                    continue  # the cache does not hold its content: it could not be put back
                if not schedule.is_marker(remote.key, self.markers):
                    # Its object is a shard's (a shard renamed or exchanged onto the marker's
                    # name): it vouches for nothing; the object at the marker's key, if any,
                    # is found above by its key.
                    continue
                if remote.key in keys or txn.owner_of_remote_key(remote.key) != child:
                    # Its object is the one this write replaces (a shard's key), or another
                    # inode's content replaced it since (a record kept for a re-upload): no marker.
                    continue
                # (a marker written again but not uploaded yet still has its old object out)
                out[child] = remote.key
        return sorted(out.items())

    def _requeue_markers(self, txn: Txn, victims: list[tuple[int, str]]) -> None:
        now = self.clock()
        for ino, key in victims:
            inode = txn.get_inode(ino)
            remote = txn.get_remote(ino)
            if inode is None or remote is None or remote.key != key:
                continue
            pending = txn.get_pending(ino)
            if (pending is not None and pending.reason == durability.DATA
                    and not any(schedule.is_marker(p.decode("utf-8", "surrogateescape"), self.markers)
                                for p in txn.paths_of(ino))):
                # A marker that is a shard now (renamed or exchanged), with new content queued
                # (maybe uploading right now): its old object is gone, and requeuing it would
                # leave it DURABLE and still pending for its data after that upload commits.
                txn.delete_remote(ino)
                continue
            durability.mark_needs_upload(txn, inode, now)  # uploaded again, after the shards

    async def _invalidate_markers(self, job: FileJob) -> bool:
        """Before a shard below a durable marker is replaced, the marker leaves the bucket
        (deleted, then requeued: it is uploaded again after every shard below its directory),
        so the bucket never shows it next to a half-replaced checkpoint. False: such a
        marker is being uploaded right now; try the shard again later."""
        async with self.invalidate_lock:
            victims = await self._read(self._markers_to_invalidate, job)
            if any(key in self.busy_keys for _, key in victims):
                return False
            if victims:
                # A write to one of those keys may have committed since that read began (it
                # leaves busy_keys only after its commit): its new object is not the marker's.
                # Read again; a write that starts now waits for this lock before it writes.
                victims = await self._read(self._markers_to_invalidate, job)
                if any(key in self.busy_keys for _, key in victims):
                    return False
            for _, key in victims:
                log.info("%s: a shard below it is being replaced; deleting it until it is re-uploaded", key)
                await self._retry(f"delete {key}", lambda key=key: self.store.delete(key))
                self.stats.deleted_objects += 1
            if victims:
                await self._write(self._requeue_markers, victims)
        return True

    @staticmethod
    def _blocking_owner(txn: Txn, ino: int, keys: list[str]) -> int | None:
        """Another live, still-pending inode whose bucket content is the object at one of ``keys``."""
        for key in keys:
            owner = txn.owner_of_remote_key(key)
            if owner is None or owner == ino:
                continue
            inode = txn.get_inode(owner)
            if inode is None or inode.nlink == 0:
                continue
            if txn.get_pending(owner) is None and not durability.pending_ancestor(txn, owner):
                continue  # (below a renamed directory not expanded yet: it will move)
            if inode.durable_generation != inode.generation:
                continue  # it will be uploaded from the cache, not copied from this object
            return owner
        return None

    def _must_wait_for_sources(self, txn: Txn, job: FileJob) -> bool:
        """True if writing ``job.keys`` now would destroy content another inode still needs.

        After ``mv a a.bak; mv new a`` (or RENAME_EXCHANGE), the object at ``a`` is
        the copy source of the inode now named ``a.bak``: uploading or copying onto
        ``a`` must wait until that copy is done. If the moves form a cycle (exchange,
        rotation), this inode stops depending on its own object — it is uploaded
        again from the cache instead of copied, or, if the cache does not hold it, its
        object is moved aside first (:meth:`_move_aside`) — so the others can go first.
        """
        blocker = self._blocking_owner(txn, job.ino, job.keys)
        if blocker is None:
            return False
        seen = {job.ino, blocker}
        cur = blocker
        for _ in range(1024):
            if self._frees_key_held_by_marker(txn, job, cur, seen):
                return True
            keys = [p.decode("utf-8", "surrogateescape") for p in txn.paths_of(cur)]
            nxt = self._blocking_owner(txn, cur, keys)
            if nxt is None or (nxt in seen and nxt != job.ino):
                return True  # a plain wait (or a cycle that does not pass through us)
            if nxt == job.ino:
                break
            seen.add(nxt)
            cur = nxt
        else:
            return True
        inode = txn.get_inode(job.ino)
        remote = txn.get_remote(job.ino)
        if inode is None or remote is None:
            return True
        cached = self._cache_holds(inode)
        if not cached and job.durable_in_bucket:
            if not self.cycle_breaks & seen:  # (one object of the cycle moves aside, not each)
                self.cycle_breaks.add(job.ino)
            return True
        if not cached:
            log.warning("%s: its bucket object is needed elsewhere and the cache no longer holds it",
                        job.keys[0])
            return True
        log.info("%s: renames form a cycle; uploading it again from the cache", job.keys[0])
        durability.mark_reupload_keeping_object(txn, inode, self.clock())
        return True

    def _cache_holds(self, inode) -> bool:
        """The cache holds the inode's whole content (or it has none to hold: a symlink, a
        special file). A REMOTE file's cache file (evicted, or partly fetched) never does."""
        if not inode.is_reg:
            return True
        try:
            return (inode.state != FileState.REMOTE
                    and os.stat(self.cache.data_path(inode.ino)).st_size >= inode.size)
        except FileNotFoundError:
            return False

    def _frees_key_held_by_marker(self, txn: Txn, job: FileJob, marker: int, chain: set[int]) -> bool:
        """``marker``, whose object sits at a key that ``job`` waits for (directly or through
        other files' moves: ``chain``), is a marker that drains only after one of those files
        (below its directory: ``mv ck/s0 ck/.metadata`` then a new ``ck/s0``, a marker exchanged
        with a shard, or such moves across checkpoints). None can go first: the marker's object
        leaves that key instead, uploaded again from the cache or, if the cache does not hold
        it, parked aside by this reconcile (:meth:`_move_marker_aside`). True if so."""
        marker_keys = [p.decode("utf-8", "surrogateescape") for p in txn.paths_of(marker)]
        waited_for = [p.decode("utf-8", "surrogateescape") for ino in chain - {marker} for p in txn.paths_of(ino)]
        if not any(schedule.marker_waits_for(m, k, self.markers) for m in marker_keys for k in waited_for):
            return False
        inode = txn.get_inode(marker)
        if self._cache_holds(inode):
            log.info("%s: the marker %s waits for it; uploading the marker again from the cache",
                     job.keys[0], marker_keys[0])
            durability.mark_reupload_keeping_object(txn, inode, self.clock())
        else:
            self.marker_parks[job.ino] = marker
        return True

    async def _move_marker_aside(self, ino: int) -> None:
        """Park the object of the marker ``ino`` (see :meth:`_frees_key_held_by_marker`)."""
        if ino in self.busy:
            return  # reconciled right now: the next round decides again
        self.busy.add(ino)
        try:
            job = await self._read(self._load_file, ino)
            if job is not None and job.keys and job.durable_in_bucket:
                await self._move_aside(job)
        finally:
            self.busy.discard(ino)

    async def _move_aside(self, job: FileJob) -> None:
        """Break a rename cycle among files the cache does not hold: copy this file's object to
        a key outside the namespace (``MOVING_PREFIX``) and record it there, so the inode whose
        new name is the object's old key can go first. This file is copied from the parked
        object later, and that commit tombstones it. The intent tombstone written first deletes
        the parked object if a crash loses the record."""
        src = job.remote.key
        parked = f"{MOVING_PREFIX}{job.ino}-{secrets.token_hex(8)}"
        self.busy_keys.add(parked)  # (the tombstone task leaves the intent alone meanwhile)
        try:
            await self._write(lambda txn: durability.begin_bucket_writes(txn, job.ino, [parked]))
            meta = object_metadata(job.mode, job.uid, job.gid, job.mtime_ns, job.remote.blake3, job.rdev)
            try:
                copied = await self._move_copy(src, parked, meta, if_match=job.remote.etag)
            except (NotFoundError, PreconditionFailedError) as exc:
                await self._copy_source_lost(job, exc)
                return
            record = dataclasses.replace(job.remote, key=parked, etag=copied.etag or "", listed_modified_ns=0)
            if await self._write(durability.moved_aside, job.ino, src, record):
                self.stats.copied_objects += 1
                log.info("%s: renames form a cycle and the cache does not hold it; its object %s "
                         "moved aside to %s", job.keys[0], src, parked)
        finally:
            self.busy_keys.discard(parked)

    async def _move_copy(self, src: str, dst: str, meta: dict, *, if_match: str | None = None) -> PutResult:
        """Server-side copy for a rename: keeps the object's storage class and tags.

        A plain CopyObject lands in STANDARD, and radosgw drops tags when the
        metadata is replaced, so a tiered checkpoint renamed through the mount
        would silently move back to the hot class.

        ``if_match``: the ETag the file's record holds; an object another node or tool put at
        ``src`` since is not this file's content (:class:`PreconditionFailedError`), and
        copying it would stamp this file's blake3 on other bytes.
        """
        info = await self._retry(f"head {src}", lambda: self.store.head(src))
        if info is None:
            raise NotFoundError(f"copy source {src} does not exist", code="NoSuchKey", op="CopyObject", key=src)
        if_match = if_match or None  # (a record without an ETag: nothing to compare)
        tags = await self._retry(f"get tags {src}", lambda: self.store.get_tags(src))
        storage_class = info.storage_class if info.storage_class not in (None, "STANDARD") else None
        copied = await self._retry(f"copy {src} -> {dst}", lambda: self.store.copy(
            src, dst, metadata=meta, storage_class=storage_class, if_match=if_match))
        if tags:
            await self._retry(f"put tags {dst}", lambda: self.store.put_tags(dst, tags))
        return copied

    async def _copy_source_lost(self, job: FileJob, exc: StoreError) -> None:
        """The object a copy would start from is no longer this file's content: deleted, or
        replaced by another node or tool. A file the cache holds is uploaded from the cache
        (the local content wins, as in a listing); an evicted file takes the replacing object
        as its content (the cache holds nothing of the old one; a listing would have done the
        same had it seen the object first), or has no content left."""
        src = job.remote.key
        replacing = None
        if isinstance(exc, PreconditionFailedError):
            replacing = await self._retry(f"head {src}", lambda: self.store.head(src))
        log.warning("%s: copy source %s is %s outside ckptfs", job.keys[0], src,
                    "replaced" if replacing is not None else "gone")
        await self._write(self._forget_bucket_copy, job, replacing)

    def _forget_bucket_copy(self, txn: Txn, job: FileJob, replacing: ObjectInfo | None = None) -> None:
        """The object at ``job.remote.key`` is no longer this inode's content (``replacing``:
        what is there now): see :meth:`_copy_source_lost`."""
        inode = txn.get_inode(job.ino)
        record = txn.get_remote(job.ino)
        if inode is None:
            txn.delete_remote(job.ino)
        elif record is None or record.key != job.remote.key or record.etag != job.remote.etag:
            return  # moved on meanwhile (a listing, a new copy): the next round decides
        elif inode.state != FileState.REMOTE:
            durability.mark_needs_upload(txn, inode, self.clock())
        elif replacing is not None:
            inode.size = replacing.size  # (mode, owner, mtime: the local ones, still to be copied)
            durability.mark_remote_changed(txn, inode, RemoteRecord(
                record.key, replacing.size, replacing.metadata.get("blake3", ""), 0, replacing.etag))
        else:
            durability.mark_remote_lost(txn, inode)  # the cache never held it: nothing to upload

    @staticmethod
    def _take_off_if_lost(txn: Txn, ino: int) -> bool:
        """A file whose content was lost (its object went before a move) and that was queued
        again since (renamed, chmod'ed): nothing to copy or upload, so off the queue again,
        its error kept. (Otherwise the drain would look for its cache file for ever.)"""
        inode = txn.get_inode(ino)
        if inode is None or not durability.is_remote_lost(txn, inode):
            return False
        log.warning("%s: its content was lost (its object went outside ckptfs); nothing to move",
                    (txn.path_of(ino) or b"?").decode("utf-8", "surrogateescape"))
        durability.mark_remote_lost(txn, inode)
        return True

    def _drop_if_gone(self, txn: Txn, ino: int) -> None:
        inode = txn.get_inode(ino)
        if inode is None or inode.nlink == 0 or txn.path_of(ino) is None:
            upload = txn.get_upload(ino)
            if upload is not None:
                # its multipart upload would leak: the tombstone task aborts it
                txn.add_tombstone(upload.key, upload_id=upload.upload_id)
                txn.delete_upload(ino)
            txn.clear_pending(ino)

    def _still_current(self, txn: Txn, job: FileJob) -> bool:
        inode = txn.get_inode(job.ino)
        return inode is not None and inode.nlink > 0 and inode.generation == job.generation

    async def _upload(self, job: FileJob, key: str) -> tuple[str | None, str, int]:
        """Upload the file's current generation to ``key``: (etag, blake3, size), or (None, "", 0)
        if its generation moved meanwhile (the caller leaves it queued). The caller has
        committed its keys' intents and the state UPLOADING (``_begin_writes``)."""

        meta = object_metadata(job.mode, job.uid, job.gid, job.mtime_ns, rdev=job.rdev)
        if job.is_symlink or job.special or job.size == 0:
            # Empty content needs no cache file (``mknod`` creates none).
            content = job.target if job.is_symlink or job.special else b""
            if job.upload is not None:
                # A multipart upload of an earlier, bigger generation (cut off by a crash).
                await self._abort_recorded(job.ino, job.upload)
            result = await upload_bytes(self.store, key, content, meta, journal=self.status_journal)
            if job.prior_attempt:
                job.unknown_uploads_left = not await self._abort_orphans_at_every_name(job, key, None)
            return result.etag, result.blake3, len(content)

        resume = None
        if job.upload is not None:
            if job.upload.generation == job.generation and job.upload.key == key:
                if job.upload.phase == int(UploadPhase.COMPLETING):
                    done = await self._completed_before_crash(job.upload)
                    if done is not None:
                        etag = await self._metadata_since_created(key, meta, done, job.upload.blake3)
                        return etag, job.upload.blake3, job.size
                resume = job.upload
            else:
                await self._abort_recorded(job.ino, job.upload)
        path = self.cache.data_path(job.ino)
        journal = FileUploadJournal(self, job)

        self.stats.in_flight[job.ino] = {"path": key, "size": job.size, "done": 0}
        failure: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(journal.watch_generation)
                try:
                    digest = None
                    if job.size > self.part_size:
                        part_size = upload_part_size(self.store, key, job.size, self.upload_options, resume)
                        async with self.hash_limiter:
                            pre = self.prehashed.pop(job.ino, None)
                            if pre is not None and pre[:2] == (job.generation, job.size) and pre[2] is not None \
                                    and pre[2].part_size == part_size:
                                digest = pre[2]
                            else:
                                digest = await digest_file(path, job.size, part_size, self.store)
                    result = await upload_file(
                        self.store, key, path, meta, size=job.size, digest=digest, resume=resume,
                        journal=journal, options=self.upload_options,
                    )
                except Exception as exc:
                    # Raised below, outside the nursery: from inside it would come out
                    # wrapped in an ExceptionGroup, which no `except StoreError` matches.
                    failure = exc
                finally:
                    nursery.cancel_scope.cancel()
            if failure is not None:
                raise failure
        except (UploadAborted, SourceChangedError) as exc:
            # The multipart upload is of content nobody will complete: abort it (a failed
            # abort is left to the stale sweep), then forget it.
            if journal.upload_id is not None:
                await self._abort_quietly(key, journal.upload_id)
            await self._write(lambda txn: txn.delete_upload(job.ino))
            if isinstance(exc, SourceChangedError):
                raise
            log.info("upload of %s abandoned, file changed meanwhile (%s); requeued", key, exc)
            return None, "", 0
        if job.prior_attempt or (result.multipart and journal.creates > 1):
            keep = result.upload_id if result.multipart else None
            job.unknown_uploads_left = not await self._abort_orphans_at_every_name(job, key, keep)
        etag = result.etag
        if resume is not None:
            etag = await self._metadata_since_created(key, meta, etag, result.blake3)
        return etag, result.blake3, job.size

    async def _metadata_since_created(self, key: str, meta: dict, etag: str, blake3: str) -> str:
        """A multipart upload resumed after a crash carries the metadata of its
        CreateMultipartUpload: a chmod, chown or utimes since then is copied onto the object
        (in place, as for new metadata), while the object is still the one uploaded (ETag
        ``etag``). Returns the ETag to record.

        An object deleted or replaced by another node or tool since the upload completed is
        left alone, and the upload's ETag recorded: this file's metadata and blake3 copied
        onto other bytes would fail every later read's integrity check. A bucket listing then
        sees the change as it sees any other node's later write."""
        info = await self._retry(f"head {key}", lambda: self.store.head(key))
        if info is None or info.etag != etag or all(info.metadata.get(k) == v for k, v in meta.items()):
            return etag
        log.info("%s: its metadata changed since its upload was created; copying it in place", key)
        try:
            copied = await self._move_copy(key, key, {**meta, "blake3": blake3} if blake3 else meta, if_match=etag)
        except (NotFoundError, PreconditionFailedError):
            log.warning("%s: replaced or deleted outside ckptfs right after its upload; its new "
                        "metadata is not copied onto that object", key)
            return etag
        return copied.etag

    async def _abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            await self.store.abort_multipart(key, upload_id)
        except StoreError as exc:
            if exc.code != "NoSuchUpload":
                log.warning("abort of upload %s of %s failed (the stale sweep retries): %s", upload_id, key, exc)

    async def _abort_orphans_at_every_name(self, job: FileJob, key: str, keep: str | None) -> bool:
        """:meth:`_abort_orphans` at each of the file's names (``keep``: of ``key``): the cut-off
        attempt uploaded to its first name then, which a hard link made since may have put
        second (``ln c b/a``: ``b/a`` sorts first now)."""
        aborted = True
        for name in job.keys:
            aborted = await self._abort_orphans(name, keep if name == key else None) and aborted
        return aborted

    async def _abort_orphans(self, key: str, keep: str | None) -> bool:
        """Abort multipart uploads of exactly ``key`` that no fsmeta record knows.

        A crash between CreateMultipartUpload and recording its id, or a Create whose
        response was lost and retried, leaves an upload nobody will complete (the
        24-hour stale sweep would only get it a day later). Called after such a
        file's upload succeeded; another node writing the very same key at the same
        time would lose its upload, which for a checkpoint shard is a conflict anyway.
        """
        try:
            await self._abort_unknown_uploads(key, keep)
        except StoreError as exc:
            log.warning("could not clean up earlier multipart uploads of %s (its tombstone retries): %s", key, exc)
            return False
        return True

    async def _abort_unknown_uploads(self, key: str, keep: str | None) -> None:
        """Abort the multipart uploads of exactly ``key`` but ``keep`` and those fsmeta records
        (the caller holds the key: no upload of it of ours is starting meanwhile)."""
        uploads = await self.store.list_multipart_uploads(key)

        def known(txn: Txn) -> set[str]:
            ids = {rec.upload_id for _, rec in txn.iter_uploads()}
            return ids | {rec["upload_id"] for _, rec in txn.iter_tombstones() if rec.get("upload_id")}

        recorded = await self._read(known)
        for info in uploads:
            if info.key != key or info.upload_id == keep or info.upload_id in recorded:
                continue
            log.info("aborting multipart upload %s of %s left by an earlier attempt", info.upload_id, key)
            try:
                await self.store.abort_multipart(key, info.upload_id)
            except StoreError as exc:
                if exc.code != "NoSuchUpload":
                    raise

    # -- hashing ahead of the settle window --------------------------------------------------

    def _start_prehash(self, nursery, candidates, ready, now_ns: int) -> None:
        """Hash one closed, still-settling file now, so its upload starts with the hash known
        (the settle window and the whole-file BLAKE3 no longer add up in ack -> durable)."""
        ready_inos = {c.ino for c in ready}
        for cand in candidates:
            if (cand.is_dir or cand.lost or cand.writers or cand.ino in self.busy or cand.ino in ready_inos
                    or cand.ino in self.prehashed or now_ns - cand.changed_ns >= self.settle_ns):
                continue
            if len(self.prehashed) > 1024:
                self.prehashed.clear()
            self.prehashing = cand.ino
            nursery.start_soon(self._prehash_task, cand.ino)
            return

    def _prehash_info(self, txn: Txn, ino: int) -> tuple[int, int] | None:
        inode = txn.get_inode(ino)
        pending = txn.get_pending(ino)
        if (inode is None or not inode.is_reg or inode.nlink == 0 or inode.size <= self.part_size
                or txn.writer_count(ino) or pending is None or pending.reason != "data"
                or inode.durable_generation == inode.generation):
            return None  # small (one read does both), still open, or a move (copied, not uploaded)
        return inode.generation, inode.size

    async def _prehash_task(self, ino: int) -> None:
        try:
            info = await self._read(self._prehash_info, ino)
            if info is None:
                self.prehashed[ino] = (-1, -1, None)  # not worth it; do not look again
                return
            path = self.cache.data_path(ino)
            async with self.hash_limiter:
                if ino in self.busy:
                    return  # its upload started; it hashes itself
                part_size = upload_part_size(self.store, "", info[1], self.upload_options)
                digest = await digest_file(path, info[1], part_size, self.store)
                # stored before the limiter is released: an upload waiting for it finds it
                if await self._read(self._prehash_info, ino) == info:
                    self.prehashed[ino] = (*info, digest)
        except (OSError, SourceChangedError):
            pass
        except Exception:  # only an optimisation: the upload hashes the file itself
            log.exception("hashing inode %d ahead of its upload failed", ino)
            self.stats.unexpected_errors += 1
            self.prehashed[ino] = (-1, -1, None)
        finally:
            self.prehashing = None

    async def _completed_before_crash(self, rec: UploadRecord) -> str | None:
        """A crash after CompleteMultipartUpload, before the fsmeta commit: is the object there?"""
        info = await self._retry(f"head {rec.key}", lambda: self.store.head(rec.key))
        if info is not None and info.size == rec.size and info.metadata.get("blake3") == rec.blake3:
            log.info("%s: completed before a crash; recording it as durable", rec.key)
            return info.etag
        return None

    async def _abort_recorded(self, ino: int, rec: UploadRecord) -> None:
        try:
            await self._retry(f"abort upload {rec.key}", lambda: self.store.abort_multipart(rec.key, rec.upload_id))
        except StoreError as exc:
            if exc.code != "NoSuchUpload":
                raise
        await self._write(lambda txn: txn.delete_upload(ino))

    def _commit_file(self, txn: Txn, job: FileJob, record: RemoteRecord) -> tuple[float, float] | None:
        """Record what is now in the bucket; clear pending only if nothing moved meanwhile.

        Returns the seconds since the file first became pending and since its last change."""
        inode = txn.get_inode(job.ino)
        txn.delete_upload(job.ino)
        current_keys = sorted(p.decode("utf-8", "surrogateescape") for p in txn.paths_of(job.ino)) if inode else []
        if inode is None or inode.nlink == 0 or not current_keys:
            # Unlinked meanwhile: what we wrote must go again.
            for key in job.keys:
                txn.add_tombstone(key)
            return None
        if inode.generation != job.generation:
            durability.upload_superseded(txn, inode)
            return None  # content moved on; pending stays, next round uploads again
        old = txn.get_remote(job.ino)
        durability.mark_durable(txn, inode, job.generation, record)
        durability.end_bucket_writes(txn, job.ino, job.keys, current_keys,
                                     keep_multipart=job.unknown_uploads_left)
        if old is not None and old.key != record.key and old.key not in current_keys:
            txn.add_tombstone(old.key)
        pending = txn.get_pending(job.ino)
        if current_keys != job.keys or pending is None or pending.changed_ns != job.changed_ns:
            return None  # renamed or changed meanwhile: the next round moves it
        durability.mark_settled(txn, job.ino)
        now = self.clock()
        return (now - pending.since_ns) / 1e9, (now - pending.changed_ns) / 1e9

    # -- directories -----------------------------------------------------------------------

    def _expand_dir(self, txn: Txn, ino: int) -> dict | None:
        """Queue every descendant whose bucket name is stale (after a directory rename)."""
        inode = txn.get_inode(ino)
        pending = txn.get_pending(ino)
        path = txn.path_of(ino)
        if inode is None or pending is None or path is None or inode.nlink == 0:
            txn.clear_pending(ino)
            return None
        now = self.clock()
        for rel, child in txn.iter_subtree(ino):
            remote = txn.get_remote(child)
            if remote is None:
                continue
            full = (path + b"/" + rel if path else rel).decode("utf-8", "surrogateescape")
            child_inode = txn.get_inode(child)
            expected = full + "/" if child_inode is not None and child_inode.is_dir else full
            if remote.key != expected and txn.get_pending(child) is None:
                durability.mark_moved(txn, child, now)
        return {
            "path": path.decode("utf-8", "surrogateescape"),
            "empty": txn.dir_is_empty(ino),
            "remote": txn.get_remote(ino),
            "changed_ns": pending.changed_ns,
            "reason": pending.reason,
            "mode": inode.mode, "uid": inode.uid, "gid": inode.gid, "mtime_ns": inode.mtime_ns,
        }

    async def _reconcile_dir(self, cand: schedule.Candidate) -> None:
        info = await self._write(self._expand_dir, cand.ino)
        if info is None:
            return
        marker = info["path"] + "/" if info["path"] else None
        remote = info["remote"]
        # A marker kept while the directory holds files (harmless) still takes new metadata:
        # it shows again as the directory once the files go.
        keeps_marker = remote is not None and remote.key == marker
        put_marker = marker is not None and (
            (info["empty"] and not keeps_marker) or (keeps_marker and info["reason"] == durability.META))

        def commit(txn: Txn) -> None:
            inode = txn.get_inode(cand.ino)
            if inode is None or inode.nlink == 0:
                if put_marker:
                    txn.add_tombstone(marker)
                return
            if put_marker:
                txn.put_remote(cand.ino, RemoteRecord(marker, 0, "", inode.generation))
                current_path = txn.path_of(cand.ino)
                live = [] if current_path is None else [current_path.decode("utf-8", "surrogateescape") + "/"]
                durability.end_bucket_writes(txn, cand.ino, [marker], live)
            if remote is not None and remote.key != marker:
                txn.add_tombstone(remote.key)
                if not put_marker:
                    txn.delete_remote(cand.ino)
            pending = txn.get_pending(cand.ino)
            current = txn.path_of(cand.ino)
            if (pending is not None and pending.changed_ns == info["changed_ns"]
                    and current is not None and current.decode("utf-8", "surrogateescape") == info["path"]):
                durability.mark_settled(txn, cand.ino)

        if not put_marker:
            await self._write(commit)
            return
        if marker in self.deleting_keys or marker in self.busy_keys:
            return  # the old directory's marker is being deleted; next round
        # Reserved in the same step as the check, and until the commit: a tombstone task that
        # starts meanwhile (the old directory's, after ``rmdir d; mkdir d``) must not decide to
        # delete the key and land that delete after this marker.
        self.busy_keys.add(marker)
        try:
            if await self._read(durability.key_shape_in_flux, marker):
                self._requeue(cand.ino, WAIT_SOURCE_BACKOFF)  # a file of that name is still leaving
                return
            meta = object_metadata(info["mode"], info["uid"], info["gid"], info["mtime_ns"])
            await self._write(lambda txn: durability.begin_bucket_writes(txn, cand.ino, [marker]))
            await self._retry(f"put {marker}", lambda: self.store.put_object(marker, b"", meta))
            await self._write(commit)
        finally:
            self.busy_keys.discard(marker)

    # -- deletions -------------------------------------------------------------------------

    def _classify_tombstones(self, txn: Txn, items: list[tuple[str, dict]]) -> tuple[list, list]:
        """(to delete, to drop): a key that is live again or a copy source is not deleted; the
        intent of a write whose inode is still pending under the key is left to that inode."""
        delete, drop = [], []
        for key, rec in items:
            if durability.awaits_its_writer(txn, key, rec):
                continue
            raw = key.rstrip("/").encode("utf-8", "surrogateescape")
            live = txn.resolve(raw)
            if live is not None:
                # ``x/`` is live only as a directory, ``x`` only as a file: after
                # ``rm x; mkdir x`` the object ``x`` must still go.
                live_inode = txn.get_inode(live)
                is_live = live_inode is not None and live_inode.is_dir == key.endswith("/")
            else:
                is_live = False
            owner = txn.owner_of_remote_key(key)
            if owner is not None:
                # A removed directory (rmdir, replaced by a rename) keeps its inode and
                # remote record while the kernel holds a reference: that protects nothing.
                # A removed file keeps its record only while it is open and its content is
                # still that object (Namespace._drop_link): its purge (Txn.delete_inode)
                # tombstones it again.
                owner_inode = txn.get_inode(owner)
                if owner_inode is None or (owner_inode.nlink == 0 and owner_inode.is_dir):
                    owner = None
            if is_live and owner is None and key.endswith("/") and not txn.dir_is_empty(live):
                # A marker no live inode owns (the directory there now would own it: the
                # ``remote_keys`` index), e.g. another directory's old marker at a name this
                # one has taken since (``RENAME_EXCHANGE`` of two directories): it carries the
                # other one's mode and owner, and this directory, holding files, puts none
                # over it. Deleted: if this one empties later, it puts its own (drain model
                # seed 431).
                is_live = False
            if is_live and owner is None and txn.get_pending(live) is not None:
                # The name is live again but not written yet (a new file, a new or renamed
                # directory): the object there is an old one of someone else. Its new owner may
                # never write that key (a directory that gets a file first puts no marker; a
                # file moved on, or with its directory, before its upload): kept, it would be
                # nobody's and never deleted. Deleted now; the owner writes its own after (the
                # key stays reserved meanwhile). Found by the churn hunt.
                is_live = False
            if is_live and owner is None and not key.endswith("/") and schedule.is_marker(key, self.markers):
                # The name is a marker again, not uploaded yet (a new save): the old marker
                # must not stay visible next to the new shards meanwhile.
                is_live = False
            if is_live or owner is not None:
                drop.append((key, rec))
            else:
                delete.append((key, rec))
        return delete, drop

    async def _tombstone_task(self, items: list[tuple[str, dict]]) -> None:
        """Delete the tombstoned objects of ``items``: in one batch, or one key at a time
        after a batch failed (:class:`~.isolation.KeyQuarantine`), so that a key whose delete
        fails waits alone and every other key is deleted."""
        try:
            batches = self.tombstone_quarantine.batches(items)
            done = [await self._delete_tombstones(batch) for batch in batches]
            if len(batches) > 1 and not any(done):
                # Every key failed on its own: the bucket refuses deletes (a policy), not one
                # key. Wait as long as for one failed file before the next round.
                await trio.sleep(PERMANENT_RETRY_SECONDS)
        finally:
            self.tombstones_running = False

    async def _delete_tombstones(self, items: list[tuple[str, dict]]) -> bool:
        """One batch of tombstones; False if it failed (shown in the status, kept)."""
        try:
            items = [(k, r) for k, r in items if k not in self.busy_keys]
            # Reserve the keys before deciding: a file that gets one of these names while
            # the decision is made must not be uploaded until the delete is done.
            self.deleting_keys.update(k for k, _ in items)
            try:
                delete, drop = await self._read(self._classify_tombstones, items)
            except BaseException:
                self.deleting_keys.clear()
                raise
            # Still reserved: keys to delete, and keys whose unrecorded uploads are listed and
            # aborted (an upload of ours must not start meanwhile).
            reserved = {k for k, _ in delete} | {k for k, r in drop if r.get("multipart")}
            self.deleting_keys.difference_update(k for k, _ in items if k not in reserved)
            try:
                # A dropped tombstone (its name is live again) still carries a dead upload.
                for key, rec in delete + drop:
                    if rec.get("upload_id"):
                        try:
                            await self._retry(f"abort upload {key}",
                                              lambda key=key, rec=rec: self.store.abort_multipart(key, rec["upload_id"]))
                        except StoreError as exc:
                            if exc.code != "NoSuchUpload":
                                raise
                    if rec.get("multipart"):
                        # A crash between CreateMultipartUpload and recording its id.
                        await self._retry(f"abort unrecorded uploads of {key}",
                                          lambda key=key: self._abort_unknown_uploads(key, None))
                for batch in schedule.order_tombstones([k for k, _ in delete], self.markers):
                    failed = await self._retry(f"delete {len(batch)} objects", lambda batch=batch: self._delete_batch(batch))
                    self.stats.deleted_objects += len(batch) - len(failed)
            finally:
                self.deleting_keys.clear()

            def commit(txn: Txn) -> None:
                current = dict(txn.iter_tombstones())
                for key, rec in delete + drop:
                    if current.get(key) == rec:
                        txn.remove_tombstone(key)

            await self._write(commit)
        except StoreError as exc:
            log.error("deleting %s failed: %s", self._what_deletes(items), exc)
            self._deletes_failed(items, exc.code)
        except Exception as exc:  # unforeseen, tied to these keys: the others go on
            code = unexpected_code(exc)
            log.exception("deleting %s failed unexpectedly (%s); retried later", self._what_deletes(items), code)
            self.stats.unexpected_errors += 1
            self._deletes_failed(items, code)
        else:
            keys = [k for k, _ in items]
            self.tombstone_quarantine.succeeded(keys)
            for key in keys:
                self.stats.errors.pop(DELETE_ERROR_PREFIX + key, None)
            return True
        return False

    @staticmethod
    def _what_deletes(items: list[tuple[str, dict]]) -> str:
        return items[0][0] if len(items) == 1 else f"{len(items)} objects"

    def _deletes_failed(self, items: list[tuple[str, dict]], code: str) -> None:
        self.stats.errors_by_code[code] += 1
        keys = [k for k, _ in items]
        self.tombstone_quarantine.failed(keys)
        if len(keys) == 1:
            self.stats.errors[DELETE_ERROR_PREFIX + keys[0]] = code

    async def _record_sweep_task(self) -> None:
        try:
            await self.cluster.remove_done()
            await self.cluster.beat()
        except Exception:  # a failure here must not stop the uploads
            log.exception("deleting this node's finished in-flight records failed; retried")
            self.stats.unexpected_errors += 1
        finally:
            self.record_sweep_running = False

    async def _delete_batch(self, keys: list[str]) -> dict:
        failed = await self.store.delete_many(keys)
        retryable = [e for e in failed.values() if e.retryable]
        if retryable:
            raise retryable[0]
        if failed:
            raise next(iter(failed.values()))
        return failed

    # -- status ------------------------------------------------------------------------------

    async def _status_loop(self) -> None:
        while True:
            try:
                await self._publish_status()
            except Exception:  # the status is for people; the uploads go on without it
                log.exception("publishing the drain status failed")
                self.stats.unexpected_errors += 1
            await trio.sleep(STATUS_SECONDS)

    async def _publish_status(self) -> None:
        s = self.stats
        status = {
            "pid": os.getpid(),
            "updated_ns": self.clock(),
            "uploaded_bytes": s.uploaded_bytes,
            "uploaded_files": s.uploaded_files,
            "copied_objects": s.copied_objects,
            "deleted_objects": s.deleted_objects,
            "retries": s.retries,
            "upload_seconds": s.upload_seconds,
            "in_flight": {str(k): v for k, v in s.in_flight.items()},
            "retrying": dict(s.retrying),
            "errors": dict(s.errors),
            "durable_latency": s.durable_latency[-100:],
            "upload_rate_bytes_per_second": s.upload_rate(time.monotonic()),
            "retries_by_code": dict(s.retries_by_code),
            "errors_by_code": dict(s.errors_by_code),
            "unexpected_errors": s.unexpected_errors,
            "node": self.cluster.node,
            "held_markers": self.cluster.status(),
            "histograms": {
                "upload_request_duration_seconds": {op: h.to_json() for op, h in s.request_seconds.items()},
                "time_to_durable_seconds": s.time_to_durable.to_json(),
            },
        }
        await self._write(lambda txn: txn.put_drain_status(status))



class RetryStatusJournal(UploadJournal):
    """Shows an upload's retry streaks in the drain status; records nothing else."""

    def __init__(self, drain: Drain):
        self.drain = drain

    async def retrying(self, what: str, state: RetryState | None) -> None:
        await self.drain._show_retry(what, state)


class FileUploadJournal(RetryStatusJournal):
    """One file's upload as fsmeta records it: upload id and part list after every step
    (a restarted drain resumes from them), the generation checked before the Complete,
    and an abort as soon as the file's generation moves."""

    def __init__(self, drain: Drain, job: FileJob):
        super().__init__(drain)
        self.job = job
        self.moved = trio.Event()
        # CreateMultipartUpload requests sent: more than one may have left an upload
        # nobody records (a lost response, or an upload that vanished and was redone).
        self.creates = 0
        self.upload_id: str | None = None  # the latest CreateMultipartUpload's id

    async def created(self, record: UploadRecord) -> None:
        self.creates += 1
        self.upload_id = record.upload_id
        job = self.job
        rec = dataclasses.replace(record, generation=job.generation, parts=[])

        def put(txn: Txn) -> bool:
            if self.drain._still_current(txn, job):
                txn.put_upload(job.ino, rec)
                return True
            return False

        if not await self.drain._write(put):
            self.moved.set()  # changed or unlinked before the id was recorded: stop; _upload aborts it

    async def part_done(self, part: PartRecord) -> None:
        ino = self.job.ino

        def add(txn: Txn) -> None:
            rec = txn.get_upload(ino)
            if rec is not None:
                rec.add_part(part)
                txn.put_upload(ino, rec)

        await self.drain._write(add)
        progress = self.drain.stats.in_flight.get(ino)
        if progress is not None:
            progress["done"] += part.size

    async def may_complete(self) -> bool:
        """Last check before the object becomes visible: still this generation?"""
        job = self.job

        def check(txn: Txn) -> bool:
            if not self.drain._still_current(txn, job):
                return False
            rec = txn.get_upload(job.ino)
            if rec is not None:
                rec.phase = int(UploadPhase.COMPLETING)
                txn.put_upload(job.ino, rec)
            return True

        return await self.drain._write(check)

    def should_abort(self) -> bool:
        # polled on the loop: a flag that watch_generation keeps up to date from a thread
        return self.moved.is_set()

    async def retrying(self, what: str, state: RetryState | None) -> None:
        if state is not None and what.startswith("CreateMultipartUpload"):
            self.creates += 1  # the failed request may still have created an upload
        await super().retrying(what, state)

    async def watch_generation(self) -> None:
        while not self.moved.is_set():
            await trio.sleep(0.2)
            if not await self.drain._read(self.drain._still_current, self.job):
                self.moved.set()

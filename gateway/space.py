"""Cache space: the cap, least-recently-used eviction of clean files, and backpressure.

``[cache] max_size`` caps the bytes the cache files take (``used``: allocated blocks, so a
sparse file counts what it holds). Above ``high_watermark`` of the cap, clean files are
evicted least recently used first until ``low_watermark``; writers that would take the cache
past the cap (or the cache device past its reserve) wait for room, and after
``backpressure_timeout`` get ENOSPC. docs/DESIGN.md ("Cache space") has the reasoning.

- **What counts as used.** A full scan of ``data/`` (every :data:`SCAN_SECONDS`, or less
  often for a cache of many files: :data:`SCAN_COST_FACTOR`; in the space task's worker
  thread) gives each cache file's allocated bytes; between scans the
  space task adds the growth of open files (``fstat`` of their descriptors, every
  :data:`TICK_SECONDS`), the last release of a file records its size at once
  (:meth:`CacheSpace.note_closed`), and writes the gateway serves are counted when admitted
  (:meth:`CacheSpace.admit`). The read path reserves the bytes of each GET before it starts
  and adds them to the file's allocation when it lands (:meth:`CacheSpace.reserve_fetch`,
  :meth:`CacheSpace.fetch_landed`).
- **Recency** is in memory: ``ino -> last use`` (wall-clock ns), set at every open and at the
  last release (:meth:`CacheSpace.touch`), one dictionary store under a lock. Files the
  gateway has not touched since it started are seeded by the scan from the cache file's
  ``max(atime, mtime)``.
- **Eviction** (:meth:`CacheSpace.evict`) of a file: under the state lock it must not be open
  and is claimed (``CoreState.claim``: opens and truncates of it wait); then one fsmeta write
  transaction calls ``durability.mark_evicted`` (state -> REMOTE, only if clean, not pending,
  no upload in flight); only if that succeeded is ``CACHE/data/<ino>`` removed, after the
  commit. A crash in between leaves a REMOTE file with its old cache file: a REMOTE file's
  cache file is never trusted as complete, and the next scan removes it like any other
  REMOTE leftover. Commit markers are never evicted (the drain may have to re-upload one
  from the cache when a shard below it is replaced).
- **Backpressure** (:meth:`CacheSpace.admit`): a write that extends a file waits while
  ``used + its bytes`` would pass the cap or leave the device less than its reserve. A GET
  the reader needs waits the same way; read-ahead that finds no room is not fetched.
  Passthrough writes never reach the gateway: while the cache is above the high watermark,
  a file opened for writing that nobody has open yet is served by the gateway instead
  (:meth:`CacheSpace.under_pressure`, ``OpenFiles.open_handle``), so its writes can wait.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptfs.fsmeta import Txn, durability
from ckptfs.fsmeta.records import FileState
from ckptfs.fsmeta.settings import Settings, is_marker_name

from .errors import FsError

if TYPE_CHECKING:
    from .state import CoreState

log = logging.getLogger("ckptfs.space")

TICK_SECONDS = 0.25  # the space task: open files' growth, eviction, waking writers
SCAN_SECONDS = 5.0  # full scan of data/ (allocated bytes per file, recency seeds)...
# ...or, for a cache of many files, this many times as long as the last scan took: a scan
# costs some 10 µs of CPU per file (60,000 files: 0.6 s), and the counts between scans are
# kept exact anyway; this bounds the scan to 2% of a CPU.
SCAN_COST_FACTOR = 50
SCAN_MAX_SECONDS = 120.0  # the device's free space is measured at each scan: at least this often
PUBLISH_SECONDS = 1.0  # meta/space_status for `ckptfs status` and the metrics
DEVICE_RESERVE_FRACTION = 0.01  # of the cache device, kept free whatever the cap says...
DEVICE_RESERVE_MAX = 1 << 30  # ...up to 1 GiB
EVICT_BATCH = 64  # files per fsmeta transaction
NOTHING_TO_EVICT_PAUSE = 1.0  # seconds between eviction attempts that find only dirty files
OPEN_GROWTH_MAX_AGE = 0.05  # seconds an open-time pressure decision may reuse a measurement


@dataclass(frozen=True)
class SpaceLimits:
    cap: int  # bytes the cache files may take
    high: int  # eviction starts above this...
    low: int  # ...and stops at this
    timeout: float  # seconds a write waits for room before ENOSPC
    device_reserve: int  # bytes of the device left free for everything else

    @classmethod
    def from_settings(cls, settings: Settings, cache_root: str) -> SpaceLimits:
        fs = os.statvfs(cache_root)
        device = fs.f_blocks * fs.f_frsize
        cap = settings.cache_cap_bytes(device)
        high, low = settings.watermarks()
        return cls(cap, int(cap * high), int(cap * low), float(settings.backpressure_timeout),
                   min(DEVICE_RESERVE_MAX, int(device * DEVICE_RESERVE_FRACTION)))


class CacheSpace:
    """Cache use, LRU eviction and backpressure of one gateway (thread-safe)."""

    def __init__(self, state: CoreState, limits: SpaceLimits, *, markers=(),
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs):
        self._state = state
        self.limits = limits
        self._markers = list(markers)
        self._statvfs = statvfs
        # Lock order: never take the state lock while holding this one.
        self._cond = threading.Condition()
        self._allocated: dict[int, int] = {}  # ino -> allocated bytes when last measured
        self._total = 0  # sum of _allocated
        self._growth = 0  # open files' allocation beyond _allocated, at the last tick
        self._growth_at = 0.0  # monotonic time of that measurement
        self._admitted = 0  # bytes of gateway-served writes admitted since that measurement
        self._fetching = 0  # bytes of read-path GETs reserved and not landed yet
        self._device_avail: int | None = None  # free bytes on the device at the last scan
        self._changed_since_scan = 0  # allocation recorded since the scan (releases, evictions)
        self._recency: dict[int, int] = {}  # ino -> last use (ns)
        self._waiters: dict[int, tuple[float, int]] = {}  # token -> (monotonic start, bytes wanted)
        self._next_token = 0
        self._next_scan = 0.0  # monotonic time the next full scan is due (see SCAN_COST_FACTOR)
        self._idle_until = 0.0  # no eviction attempt before this (monotonic): nothing was evictable
        self.bytes_by_state = {"dirty": 0, "clean": 0, "remote": 0}
        self.wait_seconds_total = 0.0
        self.enospc_total = 0
        self.evictions_total = 0
        self.evicted_bytes_total = 0

    # -- recency -----------------------------------------------------------------------

    def touch(self, ino: int) -> None:
        """The file was opened or released: it is the most recently used."""
        now = time.time_ns()
        with self._cond:
            self._recency[ino] = now

    def note_closed(self, ino: int, allocated: int) -> None:
        """Last release of a file: its allocation as it is now (writes through it are done)."""
        now = time.time_ns()
        with self._cond:
            self._recency[ino] = now
            delta = allocated - self._allocated.get(ino, 0)
            self._allocated[ino] = allocated
            self._total += delta
            self._changed_since_scan += delta

    # -- measuring ---------------------------------------------------------------------

    def scan(self) -> None:
        """Allocated bytes of every cache file (and the device's free space), from the disk."""
        started = time.monotonic()
        allocated, seeds = {}, {}
        try:
            with os.scandir(self._state.cache.data_dir) as entries:
                for entry in entries:
                    try:
                        ino = int(entry.name, 16)
                        st = entry.stat(follow_symlinks=False)
                    except (ValueError, FileNotFoundError):
                        continue
                    allocated[ino] = st.st_blocks * 512
                    seeds[ino] = max(st.st_atime_ns, st.st_mtime_ns)
        except FileNotFoundError:
            pass
        fs = self._statvfs(self._state.cache.root)
        by_state = self._bytes_by_state(allocated)
        with self._cond:
            self._allocated = allocated
            self._total = sum(allocated.values())
            self._device_avail = fs.f_bavail * fs.f_frsize
            self._changed_since_scan = 0
            self._recency = {ino: self._recency.get(ino, seeds[ino]) for ino in allocated}
            finished = time.monotonic()
            took = finished - started
            self._next_scan = finished + min(SCAN_MAX_SECONDS, max(SCAN_SECONDS, SCAN_COST_FACTOR * took))
            self.bytes_by_state = by_state
        self._measure_open_files()

    def _bytes_by_state(self, allocated: dict[int, int]) -> dict[str, int]:
        out = {"dirty": 0, "clean": 0, "remote": 0}
        with self._state.meta.read() as txn:
            for ino, size in allocated.items():
                inode = txn.get_inode(ino)
                if inode is None:
                    continue
                if inode.state == FileState.REMOTE:
                    out["remote"] += size
                elif txn.get_pending(ino) is not None or inode.state in (FileState.DIRTY, FileState.UPLOADING):
                    out["dirty"] += size
                else:
                    out["clean"] += size
        return out

    def _measure_open_files(self) -> None:
        """Growth of the open files since their allocation was last recorded (passthrough
        writes never reach the gateway: their cache files are the only witness)."""
        s = self._state
        with s.lock:  # fstat only: the descriptors must not be closed meanwhile
            sizes = []
            for of in s.open_files.values():
                try:
                    sizes.append((of.ino, os.fstat(of.fd).st_blocks * 512))
                except OSError:
                    pass
        with self._cond:
            self._growth = sum(max(0, size - self._allocated.get(ino, 0)) for ino, size in sizes)
            self._growth_at = time.monotonic()
            self._admitted = 0

    def _used(self) -> int:
        """Bytes the cache files take, as best known (call with ``_cond`` held)."""
        return self._total + self._growth + self._admitted + self._fetching

    def _device_room(self) -> int | None:
        """Bytes the device can still take before its reserve (call with ``_cond`` held)."""
        if self._device_avail is None:
            return None
        return (self._device_avail - self._changed_since_scan - self._growth - self._admitted
                - self._fetching - self.limits.device_reserve)

    def _room(self) -> int:
        """Bytes writers may still add (call with ``_cond`` held)."""
        room = self.limits.cap - self._used()
        device_room = self._device_room()
        return room if device_room is None else min(room, device_room)

    def used_bytes(self) -> int:
        with self._cond:
            return self._used()

    # -- backpressure -----------------------------------------------------------------

    def under_pressure(self) -> bool:
        """Above the high watermark (or the device nearly full): files opened for writing now
        should be served by the gateway, whose writes can wait (passthrough mode)."""
        with self._cond:
            fresh = time.monotonic() - self._growth_at < OPEN_GROWTH_MAX_AGE
        if not fresh:
            self._measure_open_files()
        with self._cond:
            return self._used() >= self.limits.high or self._room() <= 0

    def admit(self, nbytes: int) -> None:
        """A write is about to add ``nbytes`` to the cache: wait until there is room, or raise
        ENOSPC after the backpressure timeout (the write is then not made at all)."""
        self._take_room(nbytes, fetch=False, wait=True)

    def reserve_fetch(self, nbytes: int, *, wait: bool) -> bool:
        """A GET of the read path is about to put ``nbytes`` into a cache file: count them from
        now until :meth:`fetch_landed`, so a cold read or a prefetch makes room (eviction) or
        waits for it instead of passing the cap. ``wait``: wait as a write does (ENOSPC after
        the backpressure timeout); otherwise (read-ahead) take the room only if it is there."""
        return self._take_room(nbytes, fetch=True, wait=wait)

    def fetch_landed(self, ino: int, reserved: int, allocated: int | None) -> None:
        """A GET that :meth:`reserve_fetch` counted finished; ``allocated``: the inode's cache
        file's allocation measured after it (None: not measured). The bytes of GETs of the
        file still in flight may count twice (reserved, and partly landed) until they end."""
        with self._cond:
            self._fetching -= reserved
            if allocated is not None:
                delta = allocated - self._allocated.get(ino, 0)
                self._allocated[ino] = allocated
                self._total += delta
                self._changed_since_scan += delta

    def _take_room(self, nbytes: int, *, fetch: bool, wait: bool) -> bool:
        with self._cond:
            if self._room() >= nbytes:
                self._count(nbytes, fetch)
                return True
            if not wait:
                return False
        self._measure_open_files()  # the last tick's figure may be stale
        start = time.monotonic()
        with self._cond:
            token = self._next_token = self._next_token + 1
            self._waiters[token] = (start, nbytes)
            try:
                while self._room() < nbytes:
                    remaining = start + self.limits.timeout - time.monotonic()
                    if remaining <= 0:
                        self.enospc_total += 1
                        raise FsError(errno.ENOSPC, f"no cache space within {self.limits.timeout:g}s")
                    self._cond.wait(min(remaining, TICK_SECONDS))
                self._count(nbytes, fetch)
                return True
            finally:
                del self._waiters[token]
                self.wait_seconds_total += time.monotonic() - start

    def _count(self, nbytes: int, fetch: bool) -> None:
        if fetch:
            self._fetching += nbytes
        else:
            self._admitted += nbytes

    # -- eviction -----------------------------------------------------------------------

    def tick(self) -> tuple[int, int]:
        """One round of the space task: measure, evict if above the high watermark, wake the
        writers that wait. Returns (files, bytes) evicted."""
        if time.monotonic() >= self._next_scan:
            self.scan()
        else:
            self._measure_open_files()
        evicted = self.evict()
        with self._cond:
            self._cond.notify_all()
        return evicted

    def _to_free(self) -> int:
        """Bytes to evict now: down to the low watermark once above the high one, or what the
        largest waiting writer lacks, or what the device lacks for its reserve."""
        with self._cond:
            used = self._used()
            short = max((want for _, want in self._waiters.values()), default=0) - self._room()
            if used > self.limits.high or short > 0:
                return max(used - self.limits.low, short)
            device_room = self._device_room()
            return -device_room if device_room is not None and device_room < 0 else 0

    def evict(self) -> tuple[int, int]:
        """Evict clean files, least recently used first, from above the high watermark down to
        the low one. Returns (files, bytes) evicted."""
        to_free = self._to_free()
        if to_free <= 0 or time.monotonic() < self._idle_until:
            return 0, 0
        with self._cond:
            order = sorted((self._recency.get(ino, 0), ino) for ino, size in self._allocated.items() if size > 0)
            sizes = dict(self._allocated)
        candidates = self._candidates([ino for _, ino in order])
        if not candidates:
            # All dirty (the drain is behind): look again in a while, not at every tick.
            self._idle_until = time.monotonic() + NOTHING_TO_EVICT_PAUSE
            return 0, 0
        files = freed = 0
        i = 0
        while i < len(candidates) and freed < to_free:
            batch, planned = [], 0
            while i < len(candidates) and freed + planned < to_free and len(batch) < EVICT_BATCH:
                batch.append(candidates[i])
                planned += sizes.get(candidates[i], 0)
                i += 1
            n, size = self._evict_batch(batch)
            files += n
            freed += size
        return files, freed

    def evict_now(self, inos: list[int]) -> tuple[int, int]:
        """Evict these files now, whatever the watermarks say (``user.ckptfs.evict``): those
        that may go (clean, not open, not a commit marker). Returns (files, bytes) evicted."""
        return self._evict_batch(self._candidates(inos))

    def _candidates(self, inos: list[int]) -> list[int]:
        """The inodes, in order, whose cache file may go: clean (or already REMOTE: a leftover
        of a crash or a partial fetch), and not a commit marker."""
        out = []
        with self._state.meta.read() as txn:
            for ino in inos:
                inode = txn.get_inode(ino)
                if inode is None or not inode.is_reg:
                    continue
                if not (inode.state == FileState.REMOTE or durability.is_evictable(txn, inode)):
                    continue
                if any(is_marker_name(os.path.basename(p.decode("utf-8", "surrogateescape")), self._markers)
                       for p in txn.paths_of(ino)):
                    continue
                out.append(ino)
        return out

    def _evict_batch(self, inos: list[int]) -> tuple[int, int]:
        s = self._state
        claimed = []
        with s.lock:
            for ino in inos:
                if ino in s.open_files or ino in s.claimed or (s.fetcher is not None and s.fetcher.holds(ino)):
                    continue  # open files (and files being fetched) are never evicted
                s.claim(ino)
                claimed.append(ino)
        done: set[int] = set()
        try:
            def mark(txn: Txn) -> list[int]:
                out = []
                for ino in claimed:
                    inode = txn.get_inode(ino)
                    if inode is None:
                        continue
                    if inode.state == FileState.REMOTE or durability.mark_evicted(txn, inode):
                        out.append(ino)
                return out

            marked = s.meta.write(mark) if claimed else []
            if marked:
                # REMOTE must be on the device before the cache file goes (commits are deferred
                # and not meta-synced): otherwise a crash could bring back a clean file without
                # its bytes. One sync per batch.
                s.meta.sync()
            for ino in marked:  # the cache file of a REMOTE file is never trusted
                if s.backing is not None:
                    s.backing.unwatch(ino)
                s.remove_data(ino)
                done.add(ino)
        finally:
            s.end_claims(claimed)
        freed = 0
        with self._cond:
            for ino in done:
                size = self._allocated.pop(ino, 0)
                self._recency.pop(ino, None)
                self._total -= size
                self._changed_since_scan -= size
                freed += size
            self.evictions_total += len(done)
            self.evicted_bytes_total += freed
        if done:
            log.info("evicted %d clean file(s), %d bytes", len(done), freed)
        return len(done), freed

    # -- status -------------------------------------------------------------------------

    def status(self) -> dict:
        """What ``meta/space_status`` holds (``ckptfs status``, the metrics)."""
        now = time.monotonic()
        with self._cond:
            longest = max((now - t for t, _ in self._waiters.values()), default=0.0)
            return {
                "updated_ns": time.time_ns(),
                "cap_bytes": self.limits.cap,
                "high_bytes": self.limits.high,
                "low_bytes": self.limits.low,
                "backpressure_timeout": self.limits.timeout,
                "used_bytes": self._used(),
                "bytes_by_state": dict(self.bytes_by_state),
                "evictions_total": self.evictions_total,
                "evicted_bytes_total": self.evicted_bytes_total,
                "waiting_writers": len(self._waiters),
                "longest_wait_seconds": longest,
                "wait_seconds_total": self.wait_seconds_total + sum(now - t for t, _ in self._waiters.values()),
                "enospc_total": self.enospc_total,
            }

    def publish(self) -> None:
        status = self.status()
        self._state.meta.write(lambda txn: txn.put_space_status(status))

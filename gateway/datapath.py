"""The passthrough data path: backing ids of open files, and cache files changed behind our back.

In passthrough mode (``[mount] data_path``, decided in ``gateway/mount.py``) the kernel sends
READ, WRITE, splice and mmap of an open regular file straight to its cache file: the gateway
sees OPEN/CREATE, FLUSH, FSYNC, SETATTR, GETATTR and RELEASE only. So:

- *backing ids* (``gateway/passthrough.py``): the first open of an inode registers its cache
  file and every later open while a handle is open reuses that id (the kernel allows one per
  inode); the last release closes it (:class:`Backing`);
- *dirty tracking*: the generation moves at open for writing, O_TRUNC and truncate, before
  any byte can change (``OpenFiles.open_handle``, ``FsCore.setattr``). The size and times
  written to fsmeta at flush/fsync/release are the cache file's (``fstat``), taken whenever
  the file's ``(size, mtime, ctime)`` moved since the gateway last looked (:func:`refresh`);
- *shared mappings*: with passthrough the kernel maps the cache file itself, so a MAP_SHARED
  mapping can outlive the last release and keep changing the cache file. Files released after
  being open for writing stay *watched* for :data:`WATCH_SECONDS`: the sweep
  (:meth:`Backing.changed`, every :data:`SWEEP_SECONDS`, comparing each file at doubling
  intervals) and the next open compare the cache file's stat with the one persisted; if it
  moved, the gateway bumps the generation and persists the new size and times (the drain
  uploads it again). The drain itself refuses to commit an upload whose
  source's (size, mtime, ctime) moved during it (``drain/upload.py``). docs/SEMANTICS.md says
  what this does and does not cover.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from .files import OpenFile

log = logging.getLogger("ckptfs.datapath")

WATCH_SECONDS = 3600.0  # how long a released, written file's cache file stays watched
SWEEP_SECONDS = 1.0  # how often the sweep runs: a file is compared at the first after its release...
SWEEP_INTERVAL_MAX = 64.0  # ...then, while unchanged, at doubling intervals up to this
SWEEP_BUDGET = 2_000  # files compared per sweep at most (about 10 ms of one CPU)
WATCH_MAX = 100_000  # the oldest are dropped beyond this


def stat_id(st: os.stat_result) -> tuple[int, int, int]:
    """What moves when a file's bytes change: size, mtime and ctime (ctime cannot be set)."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def refresh(of: OpenFile, st: os.stat_result | None = None) -> bool:
    """Take an open file's size and times from its cache file if it changed since last seen
    (``st``: the cache file's ``fstat``, if the caller just took it).

    Returns True if it did (``of.attrs_dirty`` and ``of.cache_moved`` are then set: the next
    persist needs both, whoever called this). Call with the state lock held.
    """
    if st is None:
        st = os.fstat(of.fd)
    of.last_fstat = st
    sid = stat_id(st)
    if sid == of.cache_stat:
        return False
    of.cache_stat = sid
    of.cache_moved = True
    of.size = st.st_size
    of.mtime_ns = st.st_mtime_ns
    of.ctime_ns = max(of.ctime_ns, st.st_ctime_ns)
    of.attrs_dirty = True
    return True


def align(of: OpenFile, atime_ns: int, mtime_ns: int) -> None:
    """After a truncate or utimes of an open file: give its cache file the inode's times
    (the kernel shows the cache file's times after each passthrough read/write) and take
    the result as the new baseline."""
    os.utime(of.fd, ns=(atime_ns, mtime_ns))
    of.cache_stat = stat_id(os.fstat(of.fd))


@dataclass
class _Watch:
    """A released, written file whose cache file a shared mapping may still change."""

    path: str  # its cache file
    sid: tuple  # the stat_id last persisted
    since: float  # released at (monotonic seconds)
    due: float  # compared at the first sweep at or after this
    interval: float  # then, if unchanged, again this much later (doubling up to the max)
    seq: int  # of its entry in the due heap (older entries of the inode are stale)


@dataclass
class Backing:
    """Passthrough mode of one gateway: how to open/close backing ids, and the watch list.

    The watch list's cost must not grow with the number of files written in the last hour:
    a checkpoint run writes tens of thousands, and comparing each of them every second took a
    third of a CPU at 60,000 (docs/DESIGN.md, "Round 9"). A file is compared at the first
    sweep after its release, then at doubling intervals up to :data:`SWEEP_INTERVAL_MAX`
    (a file that moved is compared again at the base interval), the longest-due first and at
    most :data:`SWEEP_BUDGET` per sweep.
    """

    open_id: Callable[[int], int]  # fd -> backing id (passthrough.open_backing)
    close_id: Callable[[int], None]  # passthrough.close_backing
    watched: dict[int, _Watch] = field(default_factory=dict)  # ino -> watch, oldest first
    lock: threading.Lock = field(default_factory=threading.Lock)
    clock: Callable[[], float] = time.monotonic  # (tests move it on)
    _due: list[tuple[float, int, int]] = field(default_factory=list)  # heap of (due, seq, ino)
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def attach(self, of: OpenFile) -> None:
        """First open of an inode: register its cache file; the id serves every open after."""
        if of.backing_id == 0:
            of.backing_id = self.open_id(of.fd)

    def session_ended(self) -> None:
        """The FUSE session is gone, and with it every backing id (its fd may name another file
        by now): releases after this close none."""
        self.close_id = lambda bid: None

    def detach(self, of: OpenFile) -> None:
        """Last release of an inode: its backing id goes (the kernel holds its own reference)."""
        bid, of.backing_id = of.backing_id, 0
        if bid:
            try:
                self.close_id(bid)
            except OSError as exc:  # the id is gone with the session (unmount): nothing to leak
                log.warning("closing backing id %d of inode %d: %s", bid, of.ino, exc)

    def watch(self, ino: int, path: str, sid: tuple) -> None:
        """Watch a file just released after being open for writing: compared at the next sweep."""
        with self.lock:
            self.watched.pop(ino, None)
            now = self.clock()
            entry = _Watch(path, sid, now, now, SWEEP_SECONDS, 0)
            self.watched[ino] = entry
            self._schedule(ino, entry)
            while len(self.watched) > WATCH_MAX:
                self.watched.pop(next(iter(self.watched)))

    def _schedule(self, ino: int, entry: _Watch) -> None:
        """Put ``entry`` in the due heap (call with ``lock``); drop the stale entries of
        unwatched or rescheduled files once they outnumber the live ones."""
        entry.seq = next(self._seq)
        heapq.heappush(self._due, (entry.due, entry.seq, ino))
        if len(self._due) > 2 * len(self.watched) + 1024:
            self._due = [(w.due, w.seq, i) for i, w in self.watched.items()]
            heapq.heapify(self._due)

    def unwatch(self, ino: int) -> tuple | None:
        """Stop watching ``ino``; its persisted stat_id, if it was watched."""
        with self.lock:
            entry = self.watched.pop(ino, None)
        return entry.sid if entry else None

    def rebase(self, ino: int, st: os.stat_result) -> bool:
        """Take ``st`` as the persisted stat of a watched file if it moved from it; True if so
        (the caller stores it). False: unwatched since (opened), or unchanged."""
        with self.lock:
            entry = self.watched.get(ino)
            if entry is None or entry.sid == stat_id(st):
                return False
            entry.sid = stat_id(st)
            return True

    def changed(self) -> list[tuple[int, os.stat_result]]:
        """Watched files due for a comparison whose cache file moved since persisted (they stay
        watched, with the old baseline until :meth:`rebase`); expired and removed ones are
        dropped. At most :data:`SWEEP_BUDGET` files are compared: the rest are still due at
        the next sweep."""
        now = self.clock()
        due = []
        with self.lock:
            while self._due and len(due) < SWEEP_BUDGET and self._due[0][0] <= now:
                _, seq, ino = heapq.heappop(self._due)
                entry = self.watched.get(ino)
                if entry is not None and entry.seq == seq:
                    due.append((ino, entry))
        out = []
        for ino, entry in due:
            st, gone = None, False
            try:
                st = os.stat(entry.path)
            except FileNotFoundError:
                gone = True
            except OSError as exc:  # (EIO...) compared again later, as if unchanged
                log.warning("watched cache file of inode %d: %s", ino, exc)
            with self.lock:
                if self.watched.get(ino) is not entry:
                    continue  # unwatched (opened) or released again meanwhile
                moved = st is not None and stat_id(st) != entry.sid
                if gone or (not moved and now - entry.since > WATCH_SECONDS):
                    del self.watched[ino]
                    continue
                if moved:
                    out.append((ino, st))
                    entry.due, entry.interval = now + SWEEP_SECONDS, 2 * SWEEP_SECONDS
                else:
                    entry.due = now + entry.interval
                    entry.interval = min(2 * entry.interval, SWEEP_INTERVAL_MAX)
                self._schedule(ino, entry)
        return out

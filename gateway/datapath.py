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
  being open for writing stay *watched* for :data:`WATCH_SECONDS`: :meth:`Backing.sweep`
  (every :data:`SWEEP_SECONDS`) and the next open compare the cache file's stat with the one
  persisted; if it moved, the gateway bumps the generation and persists the new size and
  times (the drain uploads it again). The drain itself refuses to commit an upload whose
  source's (size, mtime, ctime) moved during it (``drain/upload.py``). docs/SEMANTICS.md says
  what this does and does not cover.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .files import OpenFile

log = logging.getLogger("ckptfs.datapath")

WATCH_SECONDS = 3600.0  # how long a released, written file's cache file stays watched
SWEEP_SECONDS = 1.0  # how often the watched files are compared
WATCH_MAX = 100_000  # the oldest are dropped beyond this


def stat_id(st: os.stat_result) -> tuple[int, int, int]:
    """What moves when a file's bytes change: size, mtime and ctime (ctime cannot be set)."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def refresh(of: OpenFile) -> bool:
    """Take an open file's size and times from its cache file if it changed since last seen.

    Returns True if it did (``of.attrs_dirty`` and ``of.cache_moved`` are then set: the next
    persist needs both, whoever called this). Call with the state lock held.
    """
    st = os.fstat(of.fd)
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
class Backing:
    """Passthrough mode of one gateway: how to open/close backing ids, and the watch list."""

    open_id: Callable[[int], int]  # fd -> backing id (passthrough.open_backing)
    close_id: Callable[[int], None]  # passthrough.close_backing
    # ino -> (cache path, persisted stat_id, released at monotonic seconds)
    watched: dict[int, tuple[str, tuple, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

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
        with self.lock:
            self.watched.pop(ino, None)
            self.watched[ino] = (path, sid, time.monotonic())
            while len(self.watched) > WATCH_MAX:
                self.watched.pop(next(iter(self.watched)))

    def unwatch(self, ino: int) -> tuple | None:
        """Stop watching ``ino``; its persisted stat_id, if it was watched."""
        with self.lock:
            entry = self.watched.pop(ino, None)
        return entry[1] if entry else None

    def rebase(self, ino: int, st: os.stat_result) -> bool:
        """Take ``st`` as the persisted stat of a watched file if it moved from it; True if so
        (the caller stores it). False: unwatched since (opened), or unchanged."""
        with self.lock:
            entry = self.watched.get(ino)
            if entry is None or entry[1] == stat_id(st):
                return False
            self.watched[ino] = (entry[0], stat_id(st), entry[2])
            return True

    def changed(self) -> list[tuple[int, os.stat_result]]:
        """Watched files whose cache file moved since persisted (they stay watched, with the
        old baseline until :meth:`rebase`); expired and removed ones are dropped."""
        now = time.monotonic()
        with self.lock:
            items = list(self.watched.items())
        out = []
        for ino, (path, sid, since) in items:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                self.unwatch(ino)
                continue
            if stat_id(st) != sid:
                out.append((ino, st))
            elif now - since > WATCH_SECONDS:
                self.unwatch(ino)
        return out

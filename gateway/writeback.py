"""Write-behind for cache files: start writing dirty pages to disk early, and bound them.

Without it, a file written through the mount sits in the page cache until the
application's fsync, which then writes everything at once after the FUSE
pipeline has finished: the two phases add up. Starting writeback of each
newly written chunk (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous,
no flush of metadata) overlaps them, so fsync finds little left to do.

Only the range written since the last start is handed to the kernel (not the
whole file: that walk grows with the file and, on a congested queue, blocks
longer). Ranges whose writeback was started more than ``window`` bytes ago
are waited for (``SYNC_FILE_RANGE_WAIT_BEFORE``), so one file never has more
than about ``window`` bytes dirty or under writeback in the cache: when the
disk is slower than the FUSE pipeline, the writer thread waits here (and the
kernel holds the application back) instead of the page cache filling until
the kernel's global dirty limit throttles every writer on the node.

Every call happens in a worker thread, outside the file's I/O lock, so a
request that waits for the disk does not hold back the others. Write-behind
is advisory: its errors are not raised (the data is in the page cache and
the write succeeded); a failed writeback is reported by ``fsync``. Waiting
goes through a private file description (``/proc/self/fd/N`` reopened),
because ``SYNC_FILE_RANGE_WAIT_BEFORE`` reports a writeback error once per
open file and would otherwise consume the error the application's ``fsync``
of the shared descriptor must return.
Measured in docs/DESIGN.md ("Write path performance").
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import threading

SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4

WRITE_BEHIND_BYTES = 8 << 20  # start writeback after this many new bytes
WINDOW_BYTES = 256 << 20  # wait for ranges started more than this many bytes ago

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
try:
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int
except AttributeError:  # not Linux
    _sync_file_range = None


def _sfr(fd: int, offset: int, length: int, flags: int) -> None:
    if _sync_file_range is None:
        return
    if _sync_file_range(fd, offset, length, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue the range's dirty pages for writing; returns without waiting for the disk."""
    _sfr(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def wait_writeback(fd: int, offset: int, length: int) -> None:
    """Wait until pages of the range that are under writeback are written (starts nothing new).

    Uses its own open file description, so a writeback error it meets stays
    unreported on ``fd`` (the next fsync of ``fd`` returns it).
    """
    if _sync_file_range is None:
        return
    private = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _sfr(private, offset, length, SYNC_FILE_RANGE_WAIT_BEFORE)
    finally:
        os.close(private)


class WriteBehind:
    """Write-behind bookkeeping of one open cache file.

    :meth:`note` is called under the file's I/O lock after each ``pwrite`` and
    is cheap (no system call); it says when a chunk is due. :meth:`run` is then
    called by the same thread after it let go of the lock: it starts writeback
    of the chunk and waits for chunks that fell out of the window.
    """

    __slots__ = ("chunk", "window", "lo", "hi", "pending", "started", "in_flight", "lock")

    def __init__(self, chunk: int = WRITE_BEHIND_BYTES, window: int = WINDOW_BYTES):
        self.chunk = chunk
        self.window = window
        self.lo = -1  # bounds of what was written since the last start
        self.hi = 0
        self.pending = 0
        self.started: collections.deque[tuple[int, int, int]] = collections.deque()
        self.in_flight = 0  # bytes written in the ranges in ``started``
        self.lock = threading.Lock()

    def note(self, offset: int, length: int) -> tuple[int, int, int] | None:
        """Record a write; (offset, length, bytes written in it) to start writeback of, when due."""
        end = offset + length
        if self.lo < 0 or offset < self.lo:
            self.lo = offset
        if end > self.hi:
            self.hi = end
        self.pending += length
        if self.pending < self.chunk:
            return None
        rng = (self.lo, self.hi - self.lo, self.pending)
        self.lo, self.hi, self.pending = -1, 0, 0
        return rng

    def run(self, fd: int, rng: tuple[int, int, int]) -> None:
        """Start writeback of ``rng``; wait for older ranges beyond the window. Never raises."""
        try:
            start_writeback(fd, rng[0], rng[1])
        except OSError:
            pass  # advisory; fsync reports a failed writeback
        due = []
        with self.lock:
            self.started.append(rng)
            self.in_flight += rng[2]
            while self.in_flight > self.window and len(self.started) > 1:
                old = self.started.popleft()
                self.in_flight -= old[2]
                due.append(old)
        for offset, length, _ in due:
            try:
                wait_writeback(fd, offset, length)
            except OSError:
                pass

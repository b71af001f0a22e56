"""Write-behind for cache files: start writing dirty pages to disk early.

Without it, a file written through the mount sits in the page cache until the
application's fsync, which then writes everything at once after the FUSE
pipeline has finished: the two phases add up. Starting writeback every few MiB
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous, no flush of
metadata) overlaps them, so fsync finds little left to do. Measured in
docs/DESIGN.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

SYNC_FILE_RANGE_WRITE = 2
WRITE_BEHIND_BYTES = 8 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
try:
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int
except AttributeError:  # not Linux
    _sync_file_range = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue the range's dirty pages for writing; returns without waiting for the disk."""
    if _sync_file_range is None:
        return
    if _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

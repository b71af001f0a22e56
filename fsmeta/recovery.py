"""Cache-file lengths reconciled with fsmeta after a crash: run by the gateway's start-up
recovery and by a drain that starts while no gateway is alive (one function, both processes).

fsmeta records a file's size when its bytes were handed to the cache file (flush, close,
fsync). After a crash the two can disagree:

* the cache file is **longer** (writes that extended it were never flushed; a crash between
  the size commit and the ``ftruncate`` of a shrinking truncate): the bytes past the recorded
  size were never acknowledged by fsync, so the file is cut to the recorded size;
* the cache file is **shorter**, or **missing** (a power cut after ``close`` lost page-cache
  data the synced LMDB commit still counts; a crash between the size commit and the
  ``ftruncate`` of a growing truncate): the missing bytes cannot be recovered. The file gets a
  permanent, visible error (``CacheFileShort`` / ``CacheFileMissing``) instead of an upload
  of wrong content; the drain skips it until the file is written again (which clears the
  error) or removed. Only files whose content is not in the bucket yet are checked for this.

A missing cache file of an empty file is simply empty content (``mknod`` creates none).
"""

from __future__ import annotations

import os

from . import durability
from .layout import CacheDir
from .store import MetaStore
from .txn import Txn


def _candidates(txn: Txn, inos: list[int] | None, skip_open: bool) -> list[tuple[int, int, int, bool]]:
    """(ino, generation, recorded size, content still to upload) of pending regular files."""
    out = []
    source = inos if inos is not None else list(txn.pending_inos())
    for ino in source:
        if not txn.is_pending(ino):
            continue
        inode = txn.get_inode(ino)
        if inode is None or not inode.is_reg or inode.nlink == 0:
            continue
        if skip_open and txn.writer_count(ino):
            continue  # a writer may still be extending it
        out.append((ino, inode.generation, inode.size, inode.durable_generation != inode.generation))
    return out


def reconcile_cache_lengths(meta: MetaStore, cache: CacheDir, *, inos: list[int] | None = None,
                            skip_open: bool = False) -> dict:
    """Cut too-long cache files of pending files to their recorded size and mark too-short
    or missing ones as lost. Call only while no gateway holds any of them open for writing
    (gateway start-up, or a drain with no gateway alive). ``skip_open``: leave files with an
    open-writer count alone (the drain's call; ``ckptfs drain`` without a gateway clears the
    stale counts of a crashed one first). Returns counts and the lost paths."""
    with meta.read() as txn:
        files = _candidates(txn, inos, skip_open)
    trimmed = 0
    lost: dict[int, tuple[int, str]] = {}  # ino -> (generation, code)
    for ino, generation, size, to_upload in files:
        try:
            # O_NOFOLLOW: a symlink planted in data/ must not be followed (and truncated).
            fd = os.open(cache.data_path(ino), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if to_upload and size > 0:
                lost[ino] = (generation, durability.CACHE_FILE_MISSING)
            continue
        try:
            actual = os.fstat(fd).st_size
            if actual > size:
                os.ftruncate(fd, size)
                trimmed += 1
            elif actual < size and to_upload:
                lost[ino] = (generation, durability.CACHE_FILE_SHORT)
        finally:
            os.close(fd)

    def mark(txn: Txn) -> dict[str, str]:
        paths = {}
        for ino, (generation, code) in lost.items():
            inode = txn.get_inode(ino)
            if inode is None or inode.generation != generation:
                continue  # written again meanwhile: that write decides
            durability.mark_cache_lost(txn, ino, code)
            raw = txn.path_of(ino)
            paths[raw.decode("utf-8", "surrogateescape") if raw is not None else f"<inode {ino}>"] = code
        return paths

    lost_paths = meta.write(mark) if lost else {}
    return {"trimmed_files": trimmed, "lost_files": lost_paths}

"""Start-up after a (crashed) run: fsmeta and the cache files made consistent again."""

from __future__ import annotations

import logging
import os

from ckptfs.fsmeta import FileState, Txn
from ckptfs.fsmeta.recovery import reconcile_cache_lengths

from .state import CoreState

log = logging.getLogger("ckptfs.gateway")


def recover(state: CoreState) -> dict:
    """Bring fsmeta and the cache files to a consistent state after a (crashed) run.

    No handle or kernel reference survives a restart, so: open-writer counts
    are cleared, unlinked-but-open inodes are purged, and the cache files of
    pending inodes are reconciled with the sizes fsmeta recorded
    (:func:`ckptfs.fsmeta.recovery.reconcile_cache_lengths`, which the drain
    runs too: too long is cut, too short or missing is a permanent error).
    Cache files whose inode no longer exists (a crash between the commit that
    dropped the inode and the unlink of its file) are removed, and so are those of
    REMOTE inodes (a fetch the crashed run did not finish: never taken for complete).
    """
    def fix(txn: Txn) -> dict:
        txn.clear_writers()
        purged = []
        for ino in txn.iter_orphans():
            inode = txn.get_inode(ino)
            if inode is None or inode.nlink == 0:
                txn.delete_inode(ino)
                purged.append(ino)
            else:
                txn.remove_orphan(ino)
        return {"purged": purged}

    result = state.meta.write(fix)
    for ino in result["purged"]:
        state.remove_data(ino)
    lengths = reconcile_cache_lengths(state.meta, state.cache)
    for path, code in lengths["lost_files"].items():
        log.error("%s: its cache file lost bytes fsmeta recorded (%s); it will not be uploaded", path, code)
    strays = remove_stray_cache_files(state)
    # Names created by the crashed run may still be only in the page cache: from here
    # on, fsync of a file syncs data/ only for cache files this run creates.
    state.sync_data_dir()
    state.meta.sync()
    return {"purged_orphans": len(result["purged"]), "trimmed_files": lengths["trimmed_files"],
            "lost_files": lengths["lost_files"], "stray_cache_files": strays}


def remove_stray_cache_files(state: CoreState) -> int:
    """Remove ``data/<hex>`` files whose inode is not in fsmeta; leave anything else alone."""
    by_ino = {}
    with os.scandir(state.cache.data_dir) as entries:
        for entry in entries:
            try:
                ino = int(entry.name, 16)
            except ValueError:
                ino = None
            if ino is None or f"{ino:x}" != entry.name:
                log.warning("cache directory: %s is not a cache file name; leaving it alone", entry.path)
                continue
            by_ino[ino] = entry.name
    with state.meta.read() as txn:
        strays = [ino for ino in by_ino if txn.get_inode(ino) is None]
        # The present-ranges record of a fetch lives in memory only (gateway/fetch.py): the
        # cache file of a file still REMOTE may be partly filled, and is never taken for complete.
        partial = [ino for ino in by_ino if (inode := txn.get_inode(ino)) is not None
                   and inode.state == FileState.REMOTE]
    for ino in strays:
        log.info("cache directory: removing %s, the cache file of a deleted inode", by_ino[ino])
        state.remove_data(ino)
    for ino in partial:
        log.info("cache directory: removing %s, a fetch of a remote file the last run did not finish",
                 by_ino[ino])
        state.remove_data(ino)
    return len(strays)

"""Start-up after a (crashed) run: fsmeta and the cache files made consistent again."""

from __future__ import annotations

import logging

from ckptfs.fsmeta import Txn
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
    state.meta.sync()
    return {"purged_orphans": len(result["purged"]), "trimmed_files": lengths["trimmed_files"],
            "lost_files": lengths["lost_files"]}

"""Start-up after a (crashed) run: fsmeta and the cache files made consistent again."""

from __future__ import annotations

import os

from ckptfs.fsmeta import Txn

from .state import CoreState


def recover(state: CoreState) -> dict:
    """Bring fsmeta and the cache files to a consistent state after a (crashed) run.

    No handle or kernel reference survives a restart, so: open-writer counts
    are cleared, unlinked-but-open inodes are purged, and cache files of
    modified inodes are cut to the size fsmeta recorded (bytes past it were
    never acknowledged by fsync).
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
        sizes = {}
        for ino, _ in txn.iter_pending():
            inode = txn.get_inode(ino)
            if inode is not None and inode.is_reg:
                sizes[ino] = inode.size
        return {"purged": purged, "sizes": sizes}

    result = state.meta.write(fix)
    for ino in result["purged"]:
        state.remove_data(ino)
    trimmed = 0
    for ino, size in result["sizes"].items():
        path = state.data_path(ino)
        try:
            if os.stat(path).st_size > size:
                os.truncate(path, size)
                trimmed += 1
        except FileNotFoundError:
            pass
    state.meta.sync()
    return {"purged_orphans": len(result["purged"]), "trimmed_files": trimmed}

"""Kernel lookup counts, and dropping an unlinked inode once nothing refers to it.

An inode without names stays in fsmeta (an orphan) while the kernel holds a
reference from lookup/create/readdirplus or a handle keeps it open.
"""

from __future__ import annotations

from ckptfs.fsmeta import Txn

from .state import CoreState


class LookupCounts:
    def __init__(self, state: CoreState):
        self._state = state

    def count(self, ino: int, n: int = 1) -> None:
        """The kernel got ``n`` more references to ``ino``."""
        s = self._state
        with s.lock:
            s.lookups[ino] = s.lookups.get(ino, 0) + n

    def forget(self, items: list[tuple[int, int]]) -> None:
        """The kernel dropped references (FORGET). The inodes it no longer references are
        purged soon (``MetaStore.write_soon``): by the gateway's next write or before the batch
        commits, not in a write of their own beside the kernel's next request (a FORGET follows
        every unlink, and nobody waits for it)."""
        for ino in self.drop(items):
            self._state.meta.write_soon(self._purge_fn(ino), self._after_purge(ino))

    def drop(self, items: list[tuple[int, int]]) -> list[int]:
        """The kernel dropped references; returns the inodes it no longer references and no
        handle keeps open (to purge if unlinked)."""
        s = self._state
        purge = []
        with s.lock:
            for ino, n in items:
                left = s.lookups.get(ino, 0) - n
                if left > 0:
                    s.lookups[ino] = left
                else:
                    s.lookups.pop(ino, None)
                    if ino not in s.open_files:
                        purge.append(ino)
        return purge

    def maybe_purge(self, ino: int) -> None:
        if self._state.in_use(ino):
            return
        self.purge_if_unlinked(ino)

    def purge_if_unlinked(self, ino: int) -> None:
        """Drop an inode once it has no name, no kernel reference and no open handle."""
        self._after_purge(ino)(self._state.meta.write(self._purge_fn(ino)))

    def _purge_fn(self, ino: int):
        s = self._state

        def purge(txn: Txn) -> bool:
            inode = txn.get_inode(ino)
            if inode is None or inode.nlink > 0:
                return False
            if s.in_use(ino):
                return False
            txn.delete_inode(ino)
            return True
        return purge

    def _after_purge(self, ino: int):
        def then(purged: bool) -> None:
            if purged:
                self._state.remove_data_after_commit(ino)
        return then

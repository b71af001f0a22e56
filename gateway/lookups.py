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
        for ino in self.drop(items):
            self.purge_if_unlinked(ino)

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
        s = self._state

        def purge(txn: Txn) -> bool:
            inode = txn.get_inode(ino)
            if inode is None or inode.nlink > 0:
                return False
            if s.in_use(ino):
                return False
            txn.delete_inode(ino)
            return True

        if s.meta.write(purge):
            s.remove_data_after_commit(ino)

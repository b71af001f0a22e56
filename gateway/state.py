"""What the parts of :class:`~ckptfs.gateway.core.FsCore` share: fsmeta, the cache
directory, the clock, and the in-memory tables of kernel references and open files.

One re-entrant lock guards the tables, so a part may call another while holding it.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ckptfs.fsmeta import Inode, MetaStore, Txn
from ckptfs.fsmeta.layout import CacheDir

from .errors import FsError

if TYPE_CHECKING:
    from .datapath import Backing
    from .files import Handle, OpenFile


@dataclass
class CoreState:
    cache: CacheDir
    meta: MetaStore
    clock: Callable[[], int]
    lock: threading.RLock = field(default_factory=threading.RLock)
    lookups: dict[int, int] = field(default_factory=dict)  # kernel references per inode
    open_files: dict[int, OpenFile] = field(default_factory=dict)  # by inode
    handles: dict[int, Handle] = field(default_factory=dict)  # by fh, files and directories
    next_fh: itertools.count = field(default_factory=lambda: itertools.count(1))
    backing: Backing | None = None  # passthrough mode (gateway/datapath.py); None: writeback

    def data_path(self, ino: int) -> str:
        return self.cache.data_path(ino)

    def remove_data(self, ino: int) -> None:
        try:
            os.unlink(self.data_path(ino))
        except FileNotFoundError:
            pass

    def in_use(self, ino: int) -> bool:
        """The kernel still references the inode, or a handle keeps it open."""
        with self.lock:
            return bool(self.lookups.get(ino)) or ino in self.open_files


def need_inode(txn: Txn, ino: int) -> Inode:
    inode = txn.get_inode(ino)
    if inode is None:
        raise FsError(errno.ENOENT, f"inode {ino} does not exist")
    return inode


def need_dir(txn: Txn, ino: int) -> Inode:
    inode = need_inode(txn, ino)
    if not inode.is_dir:
        raise FsError(errno.ENOTDIR)
    return inode

"""Extended attributes: ``user.*`` ones stored in fsmeta, and the read-only
``user.ckptfs.*`` ones that report durability."""

from __future__ import annotations

import errno

from ckptfs.fsmeta import Txn, durability

from .errors import FsError
from .state import CoreState, need_inode

XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 64 * 1024

XATTR_CREATE = 1
XATTR_REPLACE = 2

STATE_XATTR = b"user.ckptfs.state"
BLAKE3_XATTR = b"user.ckptfs.blake3"
# Reading it fetches the whole file into the cache first (``ckptfs prefetch``); the value is
# JSON: {"bytes": size, "fetched": bytes this call asked the bucket for}.
PREFETCH_XATTR = b"user.ckptfs.prefetch"
# Reading it evicts the file from the cache now if it is clean and not open (it stays
# visible and is fetched again when read); the value is JSON: {"bytes": size, "evicted":
# whether its cache file went}.
EVICT_XATTR = b"user.ckptfs.evict"


class Xattrs:
    def __init__(self, state: CoreState):
        self._state = state

    def getxattr(self, ino: int, name: bytes) -> bytes:
        with self._state.meta.read() as txn:
            inode = need_inode(txn, ino)
            if name == STATE_XATTR:
                return durability.state_label(txn, inode).encode()
            if name == BLAKE3_XATTR:
                remote = txn.get_remote(ino)
                if remote is None or txn.get_pending(ino) is not None or not remote.blake3:
                    raise FsError(errno.ENODATA, "no hash until the file is durable")
                return remote.blake3.encode()
            value = txn.get_xattr(ino, name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        if name.startswith(b"user.ckptfs."):
            raise FsError(errno.EPERM, "user.ckptfs.* attributes are read-only")
        if not name.startswith(b"user."):
            raise FsError(errno.ENOTSUP, "only user.* extended attributes are supported")
        if len(name) > XATTR_NAME_MAX:
            raise FsError(errno.ERANGE)
        if len(value) > XATTR_SIZE_MAX:
            raise FsError(errno.E2BIG)
        now = self._state.clock()

        def setx(txn: Txn) -> None:
            inode = need_inode(txn, ino)
            exists = txn.get_xattr(ino, name) is not None
            if flags & XATTR_CREATE and exists:
                raise FsError(errno.EEXIST)
            if flags & XATTR_REPLACE and not exists:
                raise FsError(errno.ENODATA)
            txn.set_xattr(ino, name, value)
            inode.ctime_ns = now
            txn.put_inode(inode)

        self._state.meta.write(setx)

    def listxattr(self, ino: int) -> list[bytes]:
        with self._state.meta.read() as txn:
            need_inode(txn, ino)
            return txn.list_xattrs(ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        if name.startswith(b"user.ckptfs."):
            raise FsError(errno.EPERM, "user.ckptfs.* attributes are read-only")
        now = self._state.clock()

        def remove(txn: Txn) -> None:
            inode = need_inode(txn, ino)
            if not txn.remove_xattr(ino, name):
                raise FsError(errno.ENODATA)
            inode.ctime_ns = now
            txn.put_inode(inode)

        self._state.meta.write(remove)

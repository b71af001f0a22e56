"""The filesystem core: POSIX semantics over fsmeta and the cache directory.

Synchronous and thread-safe: the FUSE layer calls every method from a worker
thread (``trio.to_thread``), and tests call it directly, without FUSE.

Data of a regular file lives in the sparse cache file ``CACHE/data/<ino hex>``;
attributes, names and durability state live in fsmeta. While a file is open,
its size and mtime are kept in memory (:class:`OpenFile`) and written to fsmeta
on flush, fsync and release, so a 1 MiB write costs one ``pwrite`` and no LMDB
transaction. The first write after each of those points bumps the generation
in fsmeta *before* the bytes change, so the drain never commits an upload of
content that was modified under it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field

from ckptfs.fsmeta import ROOT_INO, FileState, Inode, MetaStore, Txn, durability
from ckptfs.fsmeta.layout import CacheDir

from .errors import FsError
from .writeback import WriteBehind

log = logging.getLogger("ckptfs.core")

NAME_MAX = 255
S3_KEY_MAX = 1024
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 64 * 1024

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

XATTR_CREATE = 1
XATTR_REPLACE = 2

STATE_XATTR = b"user.ckptfs.state"
BLAKE3_XATTR = b"user.ckptfs.blake3"


@dataclass
class Caller:
    """Who makes a request (from the FUSE context)."""

    uid: int = 0
    gid: int = 0
    umask: int = 0o022
    pid: int = 0


@dataclass
class Attr:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0

    @property
    def blocks(self) -> int:
        return (self.size + 511) // 512


@dataclass
class OpenFile:
    """State of a regular file while at least one handle is open."""

    ino: int
    fd: int
    size: int
    mtime_ns: int
    ctime_ns: int
    refs: int = 0
    writers: int = 0
    attrs_dirty: bool = False  # size/mtime changed since last persisted
    needs_bump: bool = True  # next modification must bump the generation first
    new_cache_file: bool = False  # created since the data directory was last fsynced
    write_behind: WriteBehind = field(default_factory=WriteBehind)  # see gateway/writeback.py
    io_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Handle:
    fh: int
    ino: int
    writable: bool
    open_file: OpenFile | None = None  # None for directories
    dir_snapshot: list | None = None


@dataclass
class SetattrRequest:
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None  # UTIME_NOW is resolved by the caller
    mtime_ns: int | None = None
    ctime_ns: int | None = None


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name is {len(name)} bytes, the limit is {NAME_MAX}")
    if not name or b"/" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL, "invalid name")
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        raise FsError(errno.EILSEQ, "names must be valid UTF-8 to be stored as S3 keys") from None


class FsCore:
    def __init__(self, cache_dir: str, meta: MetaStore, *, key_prefix: str = "", clock=time.time_ns):
        self.cache_dir = cache_dir
        self.cache = CacheDir(cache_dir)
        self.data_dir = self.cache.data_dir
        self.cache.make_dirs()
        self.meta = meta
        self.key_prefix = key_prefix.strip("/")
        self.clock = clock
        self._lock = threading.RLock()
        self._lookups: dict[int, int] = {}
        self._open: dict[int, OpenFile] = {}
        self._handles: dict[int, Handle] = {}
        self._next_fh = itertools.count(1)

    # -- start-up and recovery -----------------------------------------------------

    def recover(self) -> dict:
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

        result = self.meta.write(fix)
        for ino in result["purged"]:
            self._remove_data(ino)
        trimmed = 0
        for ino, size in result["sizes"].items():
            path = self._data_path(ino)
            try:
                if os.stat(path).st_size > size:
                    os.truncate(path, size)
                    trimmed += 1
            except FileNotFoundError:
                pass
        self.meta.sync()
        return {"purged_orphans": len(result["purged"]), "trimmed_files": trimmed}

    # -- helpers ---------------------------------------------------------------------

    def _data_path(self, ino: int) -> str:
        return self.cache.data_path(ino)

    def _remove_data(self, ino: int) -> None:
        try:
            os.unlink(self._data_path(ino))
        except FileNotFoundError:
            pass

    def _attr(self, inode: Inode) -> Attr:
        of = self._open.get(inode.ino)
        size, mtime, ctime = inode.size, inode.mtime_ns, inode.ctime_ns
        if of is not None:
            size, mtime, ctime = of.size, of.mtime_ns, of.ctime_ns
        if inode.is_symlink:
            size = len(inode.target)
        return Attr(inode.ino, inode.mode, inode.nlink, inode.uid, inode.gid, size,
                    inode.atime_ns, mtime, ctime, inode.rdev)

    @staticmethod
    def _need_inode(txn: Txn, ino: int) -> Inode:
        inode = txn.get_inode(ino)
        if inode is None:
            raise FsError(errno.ENOENT, f"inode {ino} does not exist")
        return inode

    def _need_dir(self, txn: Txn, ino: int) -> Inode:
        inode = self._need_inode(txn, ino)
        if not inode.is_dir:
            raise FsError(errno.ENOTDIR)
        return inode

    def _key_length(self, rel_path: bytes) -> int:
        return len(self.key_prefix.encode()) + (1 if self.key_prefix else 0) + len(rel_path)

    def _check_key(self, txn: Txn, parent: int, name: bytes, *, is_dir: bool, subtree_extra: int = 0) -> None:
        """Refuse a name whose bucket key would exceed S3's 1024-byte limit."""
        base = txn.path_of(parent)
        if base is None:
            raise FsError(errno.ENOENT, "parent directory was removed")
        rel = base + b"/" + name if base else name
        # The directory's own marker key adds "/"; a key below it adds "/" + its path.
        length = self._key_length(rel) + max(1 if is_dir else 0, subtree_extra)
        if length > S3_KEY_MAX:
            raise FsError(
                errno.ENAMETOOLONG,
                f"bucket key would be {length} bytes, S3 allows {S3_KEY_MAX}",
            )

    def _longest_below(self, txn: Txn, dir_ino: int) -> int:
        """Bytes the longest key below a directory adds after ``dir/``."""
        longest = 0
        for rel, child in txn.iter_subtree(dir_ino):
            inode = txn.get_inode(child)
            extra = 1 if inode is not None and inode.is_dir else 0
            longest = max(longest, 1 + len(rel) + extra)
        return longest

    def _count_lookup(self, ino: int, n: int = 1) -> None:
        with self._lock:
            self._lookups[ino] = self._lookups.get(ino, 0) + n

    def _new_inode(self, txn: Txn, parent: Inode, mode: int, caller: Caller, now: int) -> Inode:
        gid = caller.gid
        if parent.mode & stat.S_ISGID:
            gid = parent.gid  # BSD group semantics of setgid directories
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return Inode(
            txn.alloc_ino(),
            mode,
            caller.uid,
            gid,
            nlink=1,
            atime_ns=now,
            mtime_ns=now,
            ctime_ns=now,
            state=FileState.DIRTY,
            parent=parent.ino,
            generation=1,
        )

    def _touch_dir(self, txn: Txn, inode: Inode, now: int) -> None:
        inode.mtime_ns = inode.ctime_ns = now
        txn.put_inode(inode)

    # -- lookup, attributes ------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Attr:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        with self.meta.read() as txn:
            parent_inode = self._need_dir(txn, parent)
            if name == b".":
                ino = parent
            elif name == b"..":
                ino = parent_inode.parent
            else:
                ino = txn.lookup(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT)
            inode = self._need_inode(txn, ino)
        with self._lock:
            self._count_lookup(ino)
            return self._attr(inode)

    def count_lookup(self, ino: int) -> None:
        """The FUSE layer handed the kernel a new reference (readdirplus)."""
        self._count_lookup(ino)

    def forget(self, items: list[tuple[int, int]]) -> None:
        purge = []
        with self._lock:
            for ino, n in items:
                left = self._lookups.get(ino, 0) - n
                if left > 0:
                    self._lookups[ino] = left
                else:
                    self._lookups.pop(ino, None)
                    if ino not in self._open:
                        purge.append(ino)
        for ino in purge:
            self._purge_if_unlinked(ino)

    def _purge_if_unlinked(self, ino: int) -> None:
        """Drop an inode once it has no name, no kernel reference and no open handle."""
        def purge(txn: Txn) -> bool:
            inode = txn.get_inode(ino)
            if inode is None or inode.nlink > 0:
                return False
            with self._lock:
                if self._lookups.get(ino) or ino in self._open:
                    return False
            txn.delete_inode(ino)
            return True

        if self.meta.write(purge):
            self._remove_data(ino)

    def getattr(self, ino: int) -> Attr:
        with self.meta.read() as txn:
            inode = self._need_inode(txn, ino)
        with self._lock:
            return self._attr(inode)

    def setattr(self, ino: int, req: SetattrRequest, fh: int | None = None) -> Attr:
        now = self.clock()
        with self._lock:
            of = self._open.get(ino)
            times_only = (of is not None and of.attrs_dirty and req.mtime_ns is not None
                          and req.size is None and req.mode is None and req.uid is None
                          and req.gid is None and req.atime_ns is None)
            if times_only:
                # The kernel's writeback cache flushing the times of a file being written
                # (tens of times per GiB, with its flusher waiting): keep them with the
                # unpersisted size; flush/fsync/release store both in one commit.
                of.mtime_ns = req.mtime_ns
                of.ctime_ns = req.ctime_ns if req.ctime_ns is not None else now
        if times_only:
            return self.getattr(ino)
        if req.size is not None and of is not None:
            # Persist in-memory attributes first so the truncate below is the latest state.
            self._persist(of)

        def apply(txn: Txn) -> Inode:
            inode = self._need_inode(txn, ino)
            if req.size is not None:
                if inode.is_dir:
                    raise FsError(errno.EISDIR)
                if not inode.is_reg:
                    raise FsError(errno.EINVAL)
                inode.size = req.size
                inode.mtime_ns = now
                durability.mark_dirty(txn, inode, now)
            if req.mode is not None:
                inode.mode = stat.S_IFMT(inode.mode) | stat.S_IMODE(req.mode)
            if req.uid is not None:
                inode.uid = req.uid
            if req.gid is not None:
                inode.gid = req.gid
            if req.atime_ns is not None:
                inode.atime_ns = req.atime_ns
            if req.mtime_ns is not None:
                inode.mtime_ns = req.mtime_ns
            inode.ctime_ns = req.ctime_ns if req.ctime_ns is not None else now
            if inode.is_reg and (req.mode is not None or req.uid is not None or req.gid is not None
                                 or req.mtime_ns is not None) and req.size is None:
                # Object metadata (mode/uid/gid/mtime) must follow.
                durability.mark_meta_changed(txn, inode, now)
            txn.put_inode(inode)
            return inode

        if req.size is not None:
            # Truncate under the inode's I/O lock so a concurrent write cannot land between.
            lock = of.io_lock if of is not None else threading.Lock()
            with lock:
                inode = self.meta.write(apply)
                self._truncate_data(ino, req.size)
                with self._lock:
                    of = self._open.get(ino)
                    if of is not None:
                        of.size = req.size
                        of.mtime_ns = inode.mtime_ns
                        of.ctime_ns = inode.ctime_ns
                        of.needs_bump = True
        else:
            inode = self.meta.write(apply)
            with self._lock:
                of = self._open.get(ino)
                if of is not None:
                    if req.mtime_ns is not None:
                        of.mtime_ns = inode.mtime_ns
                    of.ctime_ns = inode.ctime_ns
        with self._lock:
            return self._attr(inode)

    def _truncate_data(self, ino: int, size: int) -> None:
        path = self._data_path(ino)
        with self._lock:
            of = self._open.get(ino)
        if of is not None:
            os.ftruncate(of.fd, size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)

    def readlink(self, ino: int) -> bytes:
        with self.meta.read() as txn:
            inode = self._need_inode(txn, ino)
        if not inode.is_symlink:
            raise FsError(errno.EINVAL)
        return inode.target

    # -- creating names ------------------------------------------------------------------

    def _create_node(self, parent: int, name: bytes, mode: int, caller: Caller, *,
                     target: bytes = b"", rdev: int = 0) -> Inode:
        _check_name(name)
        now = self.clock()
        is_dir = stat.S_ISDIR(mode)

        def create(txn: Txn) -> Inode:
            parent_inode = self._need_dir(txn, parent)
            if parent_inode.nlink == 0:
                raise FsError(errno.ENOENT, "parent directory was removed")
            if txn.lookup(parent, name) is not None:
                raise FsError(errno.EEXIST)
            self._check_key(txn, parent, name, is_dir=is_dir)
            inode = self._new_inode(txn, parent_inode, mode, caller, now)
            inode.target = target
            inode.rdev = rdev
            if is_dir:
                inode.nlink = 2
                parent_inode.nlink += 1
            if stat.S_ISLNK(mode):
                inode.size = len(target)
            txn.put_inode(inode)
            txn.add_entry(parent, name, inode.ino)
            if is_dir:
                # An empty directory is a marker object; its parent no longer needs one.
                durability.mark_moved(txn, inode.ino, now)
            else:
                durability.mark_created(txn, inode, now)
            self._touch_dir(txn, parent_inode, now)
            return inode

        inode = self.meta.write(create)
        self._count_lookup(inode.ino)
        return inode

    def mkdir(self, parent: int, name: bytes, mode: int, caller: Caller) -> Attr:
        inode = self._create_node(parent, name, stat.S_IFDIR | (stat.S_IMODE(mode) & ~caller.umask), caller)
        with self._lock:
            return self._attr(inode)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, caller: Caller) -> Attr:
        if not stat.S_ISREG(mode):
            # A bucket can hold files, directories and symlinks, nothing else.
            raise FsError(errno.EPERM, "only regular files, directories and symlinks can be stored")
        inode = self._create_node(parent, name, stat.S_IFREG | (stat.S_IMODE(mode) & ~caller.umask), caller)
        with self._lock:
            return self._attr(inode)

    def symlink(self, parent: int, name: bytes, target: bytes, caller: Caller) -> Attr:
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        inode = self._create_node(parent, name, stat.S_IFLNK | 0o777, caller, target=target)
        with self._lock:
            return self._attr(inode)

    def create(self, parent: int, name: bytes, mode: int, flags: int, caller: Caller) -> tuple[int, Attr]:
        """O_CREAT open of a name that the kernel found missing (O_EXCL is implied)."""
        inode = self._create_node(parent, name, stat.S_IFREG | (stat.S_IMODE(mode) & ~caller.umask), caller)
        # A power cut can lose the commit that handed out this inode number while its
        # cache file survived: a new file must never show such leftover bytes.
        self._remove_data(inode.ino)
        fh = self._open_handle(inode, flags)
        with self._lock:
            return fh, self._attr(inode)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        _check_name(new_name)
        now = self.clock()

        def link(txn: Txn) -> Inode:
            inode = self._need_inode(txn, ino)
            if inode.is_dir:
                raise FsError(errno.EPERM, "hard links to directories are not allowed")
            if inode.nlink == 0:
                raise FsError(errno.ENOENT)
            parent_inode = self._need_dir(txn, new_parent)
            if parent_inode.nlink == 0:
                raise FsError(errno.ENOENT)
            if txn.lookup(new_parent, new_name) is not None:
                raise FsError(errno.EEXIST)
            self._check_key(txn, new_parent, new_name, is_dir=False)
            inode.nlink += 1
            inode.ctime_ns = now
            txn.put_inode(inode)
            txn.add_entry(new_parent, new_name, ino)
            durability.mark_moved(txn, ino, now)
            self._touch_dir(txn, parent_inode, now)
            return inode

        inode = self.meta.write(link)
        self._count_lookup(ino)
        with self._lock:
            return self._attr(inode)

    # -- removing names -----------------------------------------------------------------

    def _rel_key(self, txn: Txn, parent: int, name: bytes) -> str:
        base = txn.path_of(parent) or b""
        return (base + b"/" + name if base else name).decode("utf-8", "surrogateescape")

    def _drop_link(self, txn: Txn, inode: Inode, now: int) -> None:
        """One name of ``inode`` is gone; if it was the last, the inode becomes an orphan."""
        inode.nlink -= 1
        inode.ctime_ns = now
        if inode.nlink == 0:
            txn.forget_remote_object(inode.ino)
            txn.add_orphan(inode.ino)
        txn.put_inode(inode)

    def unlink(self, parent: int, name: bytes) -> None:
        now = self.clock()

        def unlink(txn: Txn) -> int:
            parent_inode = self._need_dir(txn, parent)
            ino = txn.lookup(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT)
            inode = self._need_inode(txn, ino)
            if inode.is_dir:
                raise FsError(errno.EISDIR)
            key = self._rel_key(txn, parent, name)
            txn.remove_entry(parent, name)
            # Whatever object sits at this name must go (the drain skips it if the
            # name is live again by then).
            txn.add_tombstone(key, now_ns=now)
            if inode.nlink > 1:
                durability.mark_moved(txn, ino, now)
            self._drop_link(txn, inode, now)
            self._touch_dir(txn, parent_inode, now)
            if parent_inode.ino != ROOT_INO and txn.dir_is_empty(parent):
                durability.mark_moved(txn, parent, now)  # now needs its marker object
            return ino

        ino = self.meta.write(unlink)
        self._maybe_purge(ino)

    def rmdir(self, parent: int, name: bytes) -> None:
        now = self.clock()

        def rmdir(txn: Txn) -> int:
            parent_inode = self._need_dir(txn, parent)
            ino = txn.lookup(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT)
            inode = self._need_inode(txn, ino)
            if not inode.is_dir:
                raise FsError(errno.ENOTDIR)
            if not txn.dir_is_empty(ino):
                raise FsError(errno.ENOTEMPTY)
            key = self._rel_key(txn, parent, name)
            txn.remove_entry(parent, name)
            txn.add_tombstone(key + "/", now_ns=now)
            txn.delete_remote(ino)  # its marker protects nothing any more
            inode.nlink = 0
            inode.ctime_ns = now
            txn.clear_pending(ino)
            txn.add_orphan(ino)
            txn.put_inode(inode)
            parent_inode.nlink -= 1
            self._touch_dir(txn, parent_inode, now)
            if parent_inode.ino != ROOT_INO and txn.dir_is_empty(parent):
                durability.mark_moved(txn, parent, now)
            return ino

        ino = self.meta.write(rmdir)
        self._maybe_purge(ino)

    def _maybe_purge(self, ino: int) -> None:
        with self._lock:
            if self._lookups.get(ino) or ino in self._open:
                return
        self._purge_if_unlinked(ino)

    # -- rename ------------------------------------------------------------------------

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int = 0) -> None:
        _check_name(new_name)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or (
            flags & RENAME_NOREPLACE and flags & RENAME_EXCHANGE
        ):
            raise FsError(errno.EINVAL, "unsupported rename flags")
        now = self.clock()
        victim_box: list[int] = []

        def rename(txn: Txn) -> None:
            old_dir = self._need_dir(txn, old_parent)
            # One object per directory inode, so nlink changes are not lost.
            new_dir = old_dir if new_parent == old_parent else self._need_dir(txn, new_parent)
            ino = txn.lookup(old_parent, old_name)
            if ino is None:
                raise FsError(errno.ENOENT)
            inode = self._need_inode(txn, ino)
            target_ino = txn.lookup(new_parent, new_name)
            target = txn.get_inode(target_ino) if target_ino is not None else None

            if flags & RENAME_EXCHANGE:
                if target is None:
                    raise FsError(errno.ENOENT)
                self._exchange(txn, old_dir, old_name, inode, new_dir, new_name, target, now)
                return
            if target is not None and flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if target_ino == ino:
                return  # both names are links to the same inode: POSIX says do nothing
            if inode.is_dir:
                if txn.is_ancestor(ino, new_parent):
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                if target is not None:
                    if not target.is_dir:
                        raise FsError(errno.ENOTDIR)
                    if not txn.dir_is_empty(target.ino):
                        raise FsError(errno.ENOTEMPTY)
            elif target is not None and target.is_dir:
                raise FsError(errno.EISDIR)
            if target is not None and target.is_dir and txn.is_ancestor(target.ino, old_parent):
                raise FsError(errno.ENOTEMPTY)
            extra = self._longest_below(txn, ino) if inode.is_dir else 0
            self._check_key(txn, new_parent, new_name, is_dir=inode.is_dir, subtree_extra=extra)

            old_key = self._rel_key(txn, old_parent, old_name)
            if target is not None:
                txn.remove_entry(new_parent, new_name)
                if target.is_dir:
                    txn.add_tombstone(self._rel_key(txn, new_parent, new_name) + "/", now_ns=now)
                    txn.delete_remote(target.ino)
                    target.nlink = 0
                    target.ctime_ns = now
                    txn.clear_pending(target.ino)
                    txn.add_orphan(target.ino)
                    txn.put_inode(target)
                    new_dir.nlink -= 1
                else:
                    self._drop_link(txn, target, now)
                victim_box.append(target.ino)
            txn.remove_entry(old_parent, old_name)
            txn.add_entry(new_parent, new_name, ino)
            if inode.is_dir:
                txn.add_tombstone(old_key + "/", now_ns=now)
                if old_parent != new_parent:
                    old_dir.nlink -= 1
                    new_dir.nlink += 1
                inode.parent = new_parent
            else:
                remote = txn.get_remote(ino)
                if remote is None or remote.key != old_key:
                    # The old name may hold an object nobody owns; the drain moves
                    # the owned one (copy, then delete) itself.
                    txn.add_tombstone(old_key, now_ns=now)
            inode.ctime_ns = now
            txn.put_inode(inode)
            durability.mark_moved(txn, ino, now)
            self._touch_dir(txn, old_dir, now)
            if new_dir is not old_dir:
                self._touch_dir(txn, new_dir, now)
            if old_dir.ino != ROOT_INO and txn.dir_is_empty(old_dir.ino):
                durability.mark_moved(txn, old_dir.ino, now)

        self.meta.write(rename)
        for victim in victim_box:
            self._maybe_purge(victim)

    def _exchange(self, txn: Txn, old_dir: Inode, old_name: bytes, a: Inode,
                  new_dir: Inode, new_name: bytes, b: Inode, now: int) -> None:
        if a.ino == b.ino:
            return
        if a.is_dir and txn.is_ancestor(a.ino, new_dir.ino):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        if b.is_dir and txn.is_ancestor(b.ino, old_dir.ino):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        extra_a = self._longest_below(txn, a.ino) if a.is_dir else 0
        extra_b = self._longest_below(txn, b.ino) if b.is_dir else 0
        self._check_key(txn, new_dir.ino, new_name, is_dir=a.is_dir, subtree_extra=extra_a)
        self._check_key(txn, old_dir.ino, old_name, is_dir=b.is_dir, subtree_extra=extra_b)
        txn.remove_entry(old_dir.ino, old_name)
        txn.remove_entry(new_dir.ino, new_name)
        txn.add_entry(new_dir.ino, new_name, a.ino)
        txn.add_entry(old_dir.ino, old_name, b.ino)
        if old_dir.ino != new_dir.ino:
            if a.is_dir:
                a.parent = new_dir.ino
                old_dir.nlink -= 1
                new_dir.nlink += 1
            if b.is_dir:
                b.parent = old_dir.ino
                new_dir.nlink -= 1
                old_dir.nlink += 1
        for inode in (a, b):
            inode.ctime_ns = now
            txn.put_inode(inode)
            durability.mark_moved(txn, inode.ino, now)
        self._touch_dir(txn, old_dir, now)
        if new_dir.ino != old_dir.ino:
            self._touch_dir(txn, new_dir, now)

    # -- open files ----------------------------------------------------------------------

    def _open_handle(self, inode: Inode, flags: int) -> int:
        accmode = flags & os.O_ACCMODE
        writable = accmode in (os.O_WRONLY, os.O_RDWR)
        with self._lock:
            of = self._open.get(inode.ino)
            if of is None:
                path = self._data_path(inode.ino)
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                    created = False
                except FileNotFoundError:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    created = True
                of = OpenFile(inode.ino, fd, inode.size, inode.mtime_ns, inode.ctime_ns)
                of.new_cache_file = created
                self._open[inode.ino] = of
            of.refs += 1
            if writable:
                of.writers += 1
            fh = next(self._next_fh)
            self._handles[fh] = Handle(fh, inode.ino, writable, of)
        if writable:
            try:
                self.meta.write(lambda txn: txn.add_writer(inode.ino, 1))
            except BaseException:
                self.release(fh)
                raise
        return fh

    def open(self, ino: int, flags: int) -> int:
        with self.meta.read() as txn:
            inode = self._need_inode(txn, ino)
        if inode.is_dir:
            raise FsError(errno.EISDIR)
        if not inode.is_reg:
            raise FsError(errno.EINVAL)
        fh = self._open_handle(inode, flags)
        # libfuse negotiates atomic_o_trunc: O_TRUNC arrives here instead of as a setattr,
        # and the kernel has already set its size to 0. Linux truncates with O_RDONLY too
        # (the kernel checked write permission), so must we, or old bytes come back.
        if flags & os.O_TRUNC:
            try:
                self.setattr(ino, SetattrRequest(size=0), fh)
            except BaseException:
                self.release(fh)
                raise
        return fh

    def _handle(self, fh: int) -> Handle:
        with self._lock:
            h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def handle_inode(self, fh: int) -> int:
        return self._handle(fh).ino

    def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self._handle(fh)
        of = h.open_file
        with self._lock:
            end = min(offset + size, of.size)
        if end <= offset:
            return b""
        data = os.pread(of.fd, end - offset, offset)
        if len(data) < end - offset:
            # The cache file is shorter than the file (sparse tail after truncate-up).
            data += bytes(end - offset - len(data))
        return data

    def _bump(self, of: OpenFile) -> None:
        """Record in fsmeta, before the bytes change, that the content changes."""
        now = self.clock()

        def bump(txn: Txn) -> None:
            inode = self._need_inode(txn, of.ino)
            durability.mark_dirty(txn, inode, now)
            txn.put_inode(inode)

        self.meta.write(bump)
        of.needs_bump = False

    def write(self, fh: int, offset: int, data) -> int:
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        of = h.open_file
        with of.io_lock:
            if of.needs_bump:
                self._bump(of)
            written = os.pwrite(of.fd, data, offset)
            due = of.write_behind.note(offset, written)
            now = self.clock()
            with self._lock:
                if offset + written > of.size:
                    of.size = offset + written
                of.mtime_ns = of.ctime_ns = now
                of.attrs_dirty = True
        if due is not None:
            # Outside the I/O lock: starting writeback can block on a full device
            # queue, and waiting for old ranges is meant to hold back only this thread.
            # The fd stays open: the kernel releases the file only after its writes.
            of.write_behind.run(of.fd, due)
        return written

    def _persist(self, of: OpenFile) -> None:
        """Write an open file's in-memory size/mtime to fsmeta."""
        with of.io_lock:
            with self._lock:
                if not of.attrs_dirty:
                    of.needs_bump = True
                    return
                size, mtime, ctime = of.size, of.mtime_ns, of.ctime_ns
                of.attrs_dirty = False

            def persist(txn: Txn) -> None:
                inode = txn.get_inode(of.ino)
                if inode is None:
                    return
                inode.size, inode.mtime_ns, inode.ctime_ns = size, mtime, ctime
                if inode.nlink > 0:
                    durability.mark_written(txn, of.ino, self.clock())
                txn.put_inode(inode)

            self.meta.write(persist)
            of.needs_bump = True

    def flush(self, fh: int) -> None:
        h = self._handle(fh)
        if h.open_file is not None and h.writable:
            self._persist(h.open_file)

    def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handle(fh)
        of = h.open_file
        (os.fdatasync if datasync else os.fsync)(of.fd)
        if of.new_cache_file:
            # The cache file's own name must survive a power cut too.
            dir_fd = os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            of.new_cache_file = False
        self._persist(of)
        self.meta.sync()

    def release(self, fh: int) -> None:
        with self._lock:
            h = self._handles.pop(fh, None)
        if h is None:
            raise FsError(errno.EBADF)
        of = h.open_file
        if h.writable:
            self._persist(of)
            self.meta.write(lambda txn: txn.add_writer(of.ino, -1))
        with self._lock:
            of.refs -= 1
            if h.writable:
                of.writers -= 1
            last = of.refs == 0
            if last:
                del self._open[of.ino]
        if last:
            os.close(of.fd)
            self._maybe_purge(of.ino)

    # -- directories ---------------------------------------------------------------------

    def opendir(self, ino: int) -> int:
        with self.meta.read() as txn:
            self._need_dir(txn, ino)
        with self._lock:
            fh = next(self._next_fh)
            self._handles[fh] = Handle(fh, ino, False)
        return fh

    def readdir(self, fh: int, start: int) -> list[tuple[bytes, Attr, int]]:
        """Entries from position ``start``; each with the position after it.

        The listing is a snapshot taken when reading starts at position 0, so
        entries added or removed meanwhile never make others repeat or vanish.
        """
        h = self._handle(fh)
        if start == 0 or h.dir_snapshot is None:
            with self.meta.read() as txn:
                self._need_dir(txn, h.ino)
                snapshot = []
                for name, child in txn.iter_dir(h.ino):
                    inode = txn.get_inode(child)
                    if inode is not None:
                        snapshot.append((name, inode))
            h.dir_snapshot = snapshot
        out = []
        with self._lock:
            for index in range(start, len(h.dir_snapshot)):
                name, inode = h.dir_snapshot[index]
                out.append((name, self._attr(inode), index + 1))
        return out

    def releasedir(self, fh: int) -> None:
        with self._lock:
            self._handles.pop(fh, None)

    def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.meta.sync()

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.cache_dir)

    # -- extended attributes ----------------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        with self.meta.read() as txn:
            inode = self._need_inode(txn, ino)
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
        now = self.clock()

        def setx(txn: Txn) -> None:
            inode = self._need_inode(txn, ino)
            exists = txn.get_xattr(ino, name) is not None
            if flags & XATTR_CREATE and exists:
                raise FsError(errno.EEXIST)
            if flags & XATTR_REPLACE and not exists:
                raise FsError(errno.ENODATA)
            txn.set_xattr(ino, name, value)
            inode.ctime_ns = now
            txn.put_inode(inode)

        self.meta.write(setx)

    def listxattr(self, ino: int) -> list[bytes]:
        with self.meta.read() as txn:
            self._need_inode(txn, ino)
            return txn.list_xattrs(ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        if name.startswith(b"user.ckptfs."):
            raise FsError(errno.EPERM, "user.ckptfs.* attributes are read-only")
        now = self.clock()

        def remove(txn: Txn) -> None:
            inode = self._need_inode(txn, ino)
            if not txn.remove_xattr(ino, name):
                raise FsError(errno.ENODATA)
            inode.ctime_ns = now
            txn.put_inode(inode)

        self.meta.write(remove)

"""Namespace transactions: creating, linking, removing, renaming and exchanging names.

Each operation is one fsmeta transaction that also records what the drain must do
to the bucket (``durability.mark_*``, tombstones for keys that must go).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptfs.fsmeta import ROOT_INO, FileState, Inode, Txn, durability

from .errors import FsError
from .lookups import LookupCounts
from .names import BucketKeys, check_name, longest_below, rel_key
from .state import CoreState, need_dir, need_inode

if TYPE_CHECKING:
    from .core import Caller

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class ListDirectoriesFirst(Exception):
    """A rename names a directory: its bucket listing must be merged before the transaction
    (``RemoteNames.refresh_children``), which then runs again."""


class Namespace:
    def __init__(self, state: CoreState, keys: BucketKeys, lookups: LookupCounts):
        self._state = state
        self._keys = keys
        self._lookups = lookups
        # The directories the calling thread's last change touched, as it left them.
        self._touched = threading.local()

    def touched_dirs(self) -> list[Inode]:
        """The directories the calling thread's last namespace change (create, mkdir, link,
        unlink, rmdir, rename, ...) touched, as that change left them: what the FUSE layer
        hands the front end, without reading them again."""
        return list(getattr(self._touched, "dirs", {}).values())

    def _begin_change(self) -> None:
        self._touched.dirs = {}

    def _new_inode(self, txn: Txn, parent: Inode, mode: int, caller: Caller, now: int,
                   ino: int | None = None) -> Inode:
        """``ino``: a number reserved for it (a spare cache file's, gateway/spares.py)."""
        gid = caller.gid
        if parent.mode & stat.S_ISGID:
            gid = parent.gid  # BSD group semantics of setgid directories
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return Inode(
            txn.alloc_ino() if ino is None else ino,
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
        """The directory's entries changed; it is stored as it now is (the change's last word
        on it: callers change its link count first)."""
        inode.mtime_ns = inode.ctime_ns = now
        txn.put_inode(inode)
        self._touched.dirs[inode.ino] = inode  # (a re-run of the transaction replaces it)

    def _create_node(self, parent: int, name: bytes, mode: int, caller: Caller, *,
                     target: bytes = b"", rdev: int = 0, then: Callable[[Txn, Inode], None] | None = None,
                     ino: int | None = None) -> Inode:
        """``then``: more to do with the new inode in the same transaction; ``ino``: a number
        reserved for it."""
        check_name(name)
        now = self._state.clock()
        is_dir = stat.S_ISDIR(mode)

        def create(txn: Txn) -> Inode:
            parent_inode = need_dir(txn, parent)
            if parent_inode.nlink == 0:
                raise FsError(errno.ENOENT, "parent directory was removed")
            if txn.lookup(parent, name) is not None:
                raise FsError(errno.EEXIST)
            self._keys.check(txn, parent, name, is_dir=is_dir)
            inode = self._new_inode(txn, parent_inode, mode, caller, now, ino)
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
            if then is not None:
                then(txn, inode)
            return inode

        self._begin_change()
        inode = self._state.meta.write(create)
        self._lookups.count(inode.ino)
        return inode

    def mkdir(self, parent: int, name: bytes, mode: int, caller: Caller) -> Inode:
        return self._create_node(parent, name, stat.S_IFDIR | (stat.S_IMODE(mode) & ~caller.umask), caller)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, caller: Caller) -> Inode:
        kind = stat.S_IFMT(mode)
        if kind == stat.S_IFREG:
            inode = self.create_file(parent, name, mode, caller)
            try:
                os.close(self._state.create_cache_file(inode.ino))  # the drain uploads from it
            except BaseException:
                self.abandon_create(parent, name, inode.ino)
                raise
            return inode
        if kind not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise FsError(errno.EINVAL, f"mknod cannot make file type {kind:o}")
        is_device = kind in (stat.S_IFCHR, stat.S_IFBLK)
        if is_device and caller.uid != 0:
            raise FsError(errno.EPERM, "only root may make device nodes")  # CAP_MKNOD, as the kernel checks
        # No cache file: the bucket holds an empty object with the mode (and rdev) as metadata.
        return self._create_node(parent, name, kind | (stat.S_IMODE(mode) & ~caller.umask), caller,
                                 rdev=rdev if is_device else 0)

    def symlink(self, parent: int, name: bytes, target: bytes, caller: Caller) -> Inode:
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self._create_node(parent, name, stat.S_IFLNK | 0o777, caller, target=target)

    def create_file(self, parent: int, name: bytes, mode: int, caller: Caller, *,
                    then: Callable[[Txn, Inode], None] | None = None, ino: int | None = None) -> Inode:
        """The name of an O_CREAT open that the kernel found missing; the caller opens it,
        making its cache file with ``CoreState.create_cache_file``. ``then``: what the open
        records in fsmeta, done in the same transaction (one nested transaction, not three).
        ``ino``: the number of the spare cache file the create took (gateway/spares.py)."""
        return self._create_node(parent, name, stat.S_IFREG | (stat.S_IMODE(mode) & ~caller.umask), caller,
                                 then=then, ino=ino)

    def abandon_create(self, parent: int, name: bytes, ino: int, *, writer: bool = False) -> None:
        """Undo :meth:`create_file` whose cache file or handle could not be made: the kernel
        gets an error, so it sees no name and holds no reference. Left behind, the name would
        make a retried O_EXCL open fail (EEXIST) and be uploaded empty. ``writer``: the create
        counted one (drop it). A name renamed or replaced meanwhile is left as it is."""
        self._lookups.drop([(ino, 1)])  # the kernel never got the create's reference

        def abandon(txn: Txn) -> None:
            if writer:
                txn.add_writer(ino, -1)
            if txn.lookup(parent, name) != ino:
                return
            inode = need_inode(txn, ino)
            # No tombstone: nothing was uploaded under this name (the writer count or the
            # missing cache file held the drain back). The purge below drops the rest.
            txn.remove_entry(parent, name)
            self._drop_link(txn, inode, self._state.clock())

        self._state.meta.write(abandon)
        self._lookups.maybe_purge(ino)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        check_name(new_name)
        now = self._state.clock()

        def link(txn: Txn) -> Inode:
            inode = need_inode(txn, ino)
            if inode.is_dir:
                raise FsError(errno.EPERM, "hard links to directories are not allowed")
            if inode.nlink == 0:
                raise FsError(errno.ENOENT)
            parent_inode = need_dir(txn, new_parent)
            if parent_inode.nlink == 0:
                raise FsError(errno.ENOENT)
            if txn.lookup(new_parent, new_name) is not None:
                raise FsError(errno.EEXIST)
            self._keys.check(txn, new_parent, new_name, is_dir=False)
            inode.nlink += 1
            inode.ctime_ns = now
            txn.put_inode(inode)
            txn.add_entry(new_parent, new_name, ino)
            durability.mark_moved(txn, ino, now)
            self._touch_dir(txn, parent_inode, now)
            return inode

        self._begin_change()
        inode = self._state.meta.write(link)
        self._lookups.count(ino)
        return inode

    # -- removing names -----------------------------------------------------------------

    def _drop_link(self, txn: Txn, inode: Inode, now: int) -> None:
        """One name of ``inode`` is gone; if it was the last, the inode becomes an orphan."""
        inode.nlink -= 1
        inode.ctime_ns = now
        if inode.nlink == 0:
            if inode.state == FileState.REMOTE and self._is_open(inode.ino):
                # Its handles still read (and fetch) the bucket's object: that goes when the
                # inode is purged after the last close (Txn.delete_inode), not while it is read.
                txn.clear_pending(inode.ino)
            else:
                txn.forget_remote_object(inode.ino)
            txn.add_orphan(inode.ino)
        txn.put_inode(inode)

    def _is_open(self, ino: int) -> bool:
        with self._state.lock:
            return ino in self._state.open_files

    def unlink(self, parent: int, name: bytes) -> None:
        now = self._state.clock()

        def unlink(txn: Txn) -> int:
            parent_inode = need_dir(txn, parent)
            ino = txn.lookup(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT)
            inode = need_inode(txn, ino)
            if inode.is_dir:
                raise FsError(errno.EISDIR)
            key = rel_key(txn, parent, name)
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

        self._begin_change()
        ino = self._state.meta.write(unlink)
        self._lookups.maybe_purge(ino)

    def rmdir(self, parent: int, name: bytes) -> None:
        now = self._state.clock()

        def rmdir(txn: Txn) -> int:
            parent_inode = need_dir(txn, parent)
            ino = txn.lookup(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT)
            inode = need_inode(txn, ino)
            if not inode.is_dir:
                raise FsError(errno.ENOTDIR)
            if not txn.dir_is_empty(ino):
                raise FsError(errno.ENOTEMPTY)
            marker = rel_key(txn, parent, name) + "/"
            txn.remove_entry(parent, name)
            durability.drop_dir_markers(txn, ino, marker, now)
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

        self._begin_change()
        ino = self._state.meta.write(rmdir)
        self._lookups.maybe_purge(ino)

    # -- rename ------------------------------------------------------------------------

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int = 0,
               *, dirs_listed: bool = True) -> bool:
        """True if a directory was one of the two inodes (moved, exchanged or replaced).
        ``dirs_listed=False``: raise :class:`ListDirectoriesFirst`, having changed nothing, if
        either name is a directory."""
        check_name(new_name)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or (
            flags & RENAME_NOREPLACE and flags & RENAME_EXCHANGE
        ):
            raise FsError(errno.EINVAL, "unsupported rename flags")
        now = self._state.clock()
        victim_box: list[int] = []
        dirs_box: list[bool] = [False]

        def rename(txn: Txn) -> None:
            old_dir = need_dir(txn, old_parent)
            # One object per directory inode, so nlink changes are not lost.
            new_dir = old_dir if new_parent == old_parent else need_dir(txn, new_parent)
            ino = txn.lookup(old_parent, old_name)
            if ino is None:
                raise FsError(errno.ENOENT)
            inode = need_inode(txn, ino)
            target_ino = txn.lookup(new_parent, new_name)
            target = txn.get_inode(target_ino) if target_ino is not None else None
            dirs_box[0] = inode.is_dir or (target is not None and target.is_dir)
            if dirs_box[0] and not dirs_listed:
                raise ListDirectoriesFirst

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
            extra = longest_below(txn, ino) if inode.is_dir else 0
            old_base = txn.path_of(old_parent)
            new_base = old_base if new_parent == old_parent else txn.path_of(new_parent)
            self._keys.check(txn, new_parent, new_name, is_dir=inode.is_dir, subtree_extra=extra, base=new_base)

            old_key = rel_key(txn, old_parent, old_name, base=old_base)
            if target is not None:
                txn.remove_entry(new_parent, new_name)
                if target.is_dir:
                    durability.drop_dir_markers(txn, target.ino, rel_key(txn, new_parent, new_name, base=new_base) + "/", now)
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
                self._forget_old_dir_name(txn, ino, old_key, now)
                if old_parent != new_parent:
                    old_dir.nlink -= 1
                    new_dir.nlink += 1
                inode.parent = new_parent
            else:
                self._forget_old_name(txn, ino, old_key, now)
            inode.ctime_ns = now
            txn.put_inode(inode)
            durability.mark_moved(txn, ino, now)
            self._touch_dir(txn, old_dir, now)
            if new_dir is not old_dir:
                self._touch_dir(txn, new_dir, now)
            # (a name left it: empty now? Not if the name stayed in it)
            if old_dir is not new_dir and old_dir.ino != ROOT_INO and txn.dir_is_empty(old_dir.ino):
                durability.mark_moved(txn, old_dir.ino, now)

        self._begin_change()
        self._state.meta.write(rename)
        for victim in victim_box:
            self._lookups.maybe_purge(victim)
        return dirs_box[0]

    @staticmethod
    def _forget_old_name(txn: Txn, ino: int, old_key: str, now: int) -> None:
        """A file leaves the name ``old_key``. The drain moves its recorded object (copy, then
        delete) itself; any other object there (a second link's copy, an object nobody owns)
        must go, unless the name is live again by then (the drain checks)."""
        remote = txn.get_remote(ino)
        if remote is None or remote.key != old_key:
            txn.add_tombstone(old_key, now_ns=now)

    @staticmethod
    def _forget_old_dir_name(txn: Txn, ino: int, old_key: str, now: int) -> None:
        """A directory leaves the name ``old_key``: a marker object there goes (unless the name
        is a directory again by then, or the marker is this directory's own, which the drain
        moves), and so do its files' old names that no record covers."""
        txn.add_tombstone(old_key + "/", now_ns=now)
        durability.mark_names_below_moved(txn, ino, old_key, now)

    def _exchange(self, txn: Txn, old_dir: Inode, old_name: bytes, a: Inode,
                  new_dir: Inode, new_name: bytes, b: Inode, now: int) -> None:
        if a.ino == b.ino:
            return
        if a.is_dir and txn.is_ancestor(a.ino, new_dir.ino):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        if b.is_dir and txn.is_ancestor(b.ino, old_dir.ino):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        extra_a = longest_below(txn, a.ino) if a.is_dir else 0
        extra_b = longest_below(txn, b.ino) if b.is_dir else 0
        self._keys.check(txn, new_dir.ino, new_name, is_dir=a.is_dir, subtree_extra=extra_a)
        self._keys.check(txn, old_dir.ino, old_name, is_dir=b.is_dir, subtree_extra=extra_b)
        old_keys = {a.ino: rel_key(txn, old_dir.ino, old_name), b.ino: rel_key(txn, new_dir.ino, new_name)}
        for inode in (a, b):
            if inode.is_dir:
                self._forget_old_dir_name(txn, inode.ino, old_keys[inode.ino], now)
            else:
                self._forget_old_name(txn, inode.ino, old_keys[inode.ino], now)
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


"""The filesystem core: POSIX semantics over fsmeta and the cache directory.

Synchronous and thread-safe: the FUSE handlers call every method from the front end's
threads (``gateway/fuse_ops.py``); tests call it directly, without FUSE.

Data of a regular file lives in the sparse cache file ``CACHE/data/<ino hex>``;
attributes, names and durability state live in fsmeta. :class:`FsCore` is the
one object the FUSE layer and tests use; each concern is a part of its own,
sharing a :class:`~ckptfs.gateway.state.CoreState`:

- ``names``: the bucket-key policy (which names can be stored as S3 keys);
- ``lookups``: kernel lookup counts, and purging unlinked inodes;
- ``namespace``: create/link/unlink/rmdir/rename transactions;
- ``files``: open files and handles, the write path (see its docstring);
- ``xattrs``: extended attributes; ``recovery``: start-up after a crash.

Lookup, attributes (incl. truncate by setattr), open and directory listing
stay here: they are the glue between the parts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import time
from dataclasses import dataclass

from ckptfs.fsmeta import FileState, Inode, MetaStore, Txn, durability
from ckptfs.fsmeta.layout import CacheDir

from . import datapath, recovery
from .bucket import BucketClient
from .errors import FsError
from .fetch import Fetcher, ReadSettings
from .files import Handle, OpenFile, OpenFiles
from .listing import DEFAULT_REMOTE_TTL, RemoteNames
from .lookups import LookupCounts
from .names import NAME_MAX, S3_KEY_MAX, BucketKeys  # noqa: F401  (importable from here)
from .namespace import RENAME_EXCHANGE, RENAME_NOREPLACE, ListDirectoriesFirst, Namespace  # noqa: F401
from .spares import RECYCLED_MAX, SPARES_TARGET, Spares
from .space import CacheSpace, SpaceLimits
from .state import CoreState, EvictedMeanwhile, need_dir, need_inode
from .xattrs import (  # noqa: F401
    BLAKE3_XATTR,
    EVICT_XATTR,
    PREFETCH_XATTR,
    STATE_XATTR,
    XATTR_CREATE,
    XATTR_NAME_MAX,
    XATTR_REPLACE,
    XATTR_SIZE_MAX,
    Xattrs,
)

log = logging.getLogger("ckptfs.gateway")

#: The shortest time the kernel may keep an answer about a name (a dentry, positive or
#: negative): what SEMANTICS.md promises on top of ``[mount] remote_ttl``.
ENTRY_TIMEOUT_MIN = 1.0


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
class SetattrRequest:
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None  # UTIME_NOW is resolved by the caller
    mtime_ns: int | None = None
    ctime_ns: int | None = None


class FsCore:
    def __init__(self, cache_dir: str, meta: MetaStore, *, key_prefix: str = "", clock=time.time_ns,
                 bucket: BucketClient | None = None, read: ReadSettings | None = None,
                 remote_ttl: float = DEFAULT_REMOTE_TTL):
        self.cache_dir = cache_dir
        self.cache = CacheDir(cache_dir)
        self.data_dir = self.cache.data_dir
        self.cache.make_dirs()
        self.meta = meta
        self._state = CoreState(self.cache, meta, clock, bucket=bucket)
        if bucket is not None:
            self._state.fetcher = Fetcher(self._state, bucket, read)
        self._open = self._state.open_files  # by inode; read by tests
        self._keys = BucketKeys(key_prefix.strip("/"))
        self._lookups = LookupCounts(self._state)
        self._files = OpenFiles(self._state, self._lookups)
        self._namespace = Namespace(self._state, self._keys, self._lookups)
        self._xattrs = Xattrs(self._state)
        # The bucket's listing as the namespace (none without a bucket: tests of the core alone).
        self.remote = RemoteNames(self._state, self._lookups, remote_ttl)

    @property
    def key_prefix(self) -> str:
        return self._keys.key_prefix

    @property
    def clock(self):
        return self._state.clock

    @clock.setter
    def clock(self, clock) -> None:
        self._state.clock = clock  # tests pin the time after construction

    def recover(self) -> dict:
        return recovery.recover(self._state)

    # -- data path -------------------------------------------------------------------

    @property
    def passthrough(self) -> bool:
        return self._state.backing is not None

    def enable_passthrough(self, open_id, close_id) -> None:
        """Passthrough mode (before any file is open): reads and writes of open files go from
        the kernel to their cache files; ``open_id(fd)``/``close_id(id)`` register them
        (``gateway/passthrough.py``). See gateway/datapath.py."""
        with self._state.lock:
            assert not self._state.open_files, "switching the data path with files open"
            self._state.backing = datapath.Backing(open_id, close_id)

    def disable_passthrough(self) -> None:
        """Back to the gateway serving reads and writes (the kernel did not grant passthrough)."""
        with self._state.lock:
            assert not self._state.open_files, "switching the data path with files open"
            self._state.backing = None

    def enable_space(self, limits: SpaceLimits, *, markers=()) -> CacheSpace:
        """Cap the cache (gateway/space.py): the caller runs ``space.tick()`` periodically."""
        self._state.space = CacheSpace(self._state, limits, markers=markers)
        self._state.space.scan()
        return self._state.space

    @property
    def space(self) -> CacheSpace | None:
        return self._state.space

    def enable_spares(self, target: int = SPARES_TARGET, recycled_max: int = RECYCLED_MAX, *,
                      make_new: bool = True) -> Spares:
        """Make empty cache files ahead of creates (gateway/spares.py); after :meth:`recover`.
        :meth:`close_spares` stops it."""
        meta = self._state.meta

        def reserve(n: int, oldest: int | None) -> int:
            return meta.write(lambda txn: txn.reserve_inos(n, oldest))

        self._state.spares = Spares(self._state.cache.spare_dir, self._state.data_path, reserve, target,
                                    recycled_max, sync_removals=meta.sync, make_new=make_new).start()
        return self._state.spares

    def close_spares(self) -> None:
        spares, self._state.spares = self._state.spares, None
        if spares is not None:
            spares.close()

    def release_all(self) -> int:
        """Release the file handles still open once the session has ended; returns how many.
        An unmount ends the requests the kernel still had queued, RELEASEs among them: a file
        closed just before it would keep its writer count, and a passthrough handle (whose
        close(2) sends no FLUSH) the size its writes gave it, in memory only."""
        if self._state.backing is not None:
            self._state.backing.session_ended()
        with self._state.lock:
            handles = [h.fh for h in self._state.handles.values() if h.open_file is not None]
        released = 0
        for fh in handles:
            try:
                self._files.release(fh)
                released += 1
            except Exception:  # the others still get theirs
                log.exception("releasing handle %d at the end of the session failed", fh)
        return released

    def backing_id(self, fh: int) -> int:
        """The backing id for an open/create reply (0: none, the daemon serves the data)."""
        return self._files.backing_id(fh)

    def sweep_mapped(self) -> int:
        """Passthrough: files released after writing whose cache file changed since (a shared
        mapping outliving close) get a new generation and their current size and mtime.
        Returns how many."""
        backing = self._state.backing
        if backing is None:
            return 0
        n = 0
        for ino, _ in backing.changed():
            # Claimed, and stat'ed again: a writer may have opened, written and closed the file
            # (storing its size) since that stat, or would do so before ours is stored.
            with self._files.pinned_or_claimed(ino) as of:
                if of is not None:
                    continue  # the open file takes it at its next flush/release
                try:
                    st = os.stat(self._data_path(ino))
                except FileNotFoundError:
                    continue
                if backing.rebase(ino, st):
                    self._files.cache_changed(ino, st)
                    n += 1
        return n

    # -- helpers ---------------------------------------------------------------------

    def _data_path(self, ino: int) -> str:
        return self._state.data_path(ino)

    def _attr(self, inode: Inode, *, just_opened: bool = False) -> Attr:
        """Attributes as the kernel must see them: an open file's size/times are in memory.
        ``just_opened``: the open file's cache file was just measured, and no handle of it
        has reached the kernel yet (a create's reply): no ``fstat`` again."""
        with self._state.lock:
            return self._attr_locked(inode, just_opened=just_opened)

    def _attr_locked(self, inode: Inode, *, just_opened: bool = False) -> Attr:
        """:meth:`_attr` with ``CoreState.lock`` held."""
        of = self._open.get(inode.ino)
        size, mtime, ctime = inode.size, inode.mtime_ns, inode.ctime_ns
        if of is not None:
            if self._state.backing is not None and of.remote is None and not just_opened:
                datapath.refresh(of)  # writes went straight to the cache file
            size, mtime, ctime = of.size, of.mtime_ns, of.ctime_ns
        if inode.is_symlink:
            size = len(inode.target)
        return Attr(inode.ino, inode.mode, inode.nlink, inode.uid, inode.gid, size,
                    inode.atime_ns, mtime, ctime, inode.rdev)

    def entry_timeout(self, parent: int) -> float:
        """Seconds the kernel may keep what a reply says about a name in ``parent`` (that it
        exists, or that it does not): as long as the directory's bucket listing stays fresh,
        since until then this gateway would answer the same, and at least ENTRY_TIMEOUT_MIN."""
        if not self.remote.enabled:
            return ENTRY_TIMEOUT_MIN
        return max(ENTRY_TIMEOUT_MIN, self.remote.fresh_for_seconds(parent))

    # -- lookup, attributes ------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Attr:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        listed_now = False
        if name not in (b".", b"..") and self.remote.enabled and not self.remote.is_fresh(parent):
            with self.meta.read() as txn:
                need_dir(txn, parent)
            listed_now = self.remote.refresh(parent)
        while True:
            seen_claims = self._state.claim_seq
            with self.meta.read() as txn:
                ino = self._lookup_ino(txn, parent, name, listed_now)
                inode = need_inode(txn, ino)
            with self._state.lock:
                if not self._fresh(inode, seen_claims):
                    continue
                attr = self._attr_locked(inode)
                self._lookups.count(ino)
            return attr

    def _lookup_ino(self, txn: Txn, parent: int, name: bytes, listed_now: bool) -> int:
        parent_inode = need_dir(txn, parent)
        if name == b".":
            return parent
        if name == b"..":
            return parent_inode.parent
        ino = txn.lookup(parent, name)
        if ino is None:
            if self.remote.enabled and not listed_now:
                self.remote.count_negative_hit()  # the listing younger than the TTL says: none
            raise FsError(errno.ENOENT)
        return ino

    def count_lookups(self, inos: list[int]) -> None:
        """The FUSE layer handed the kernel a new reference to each (readdirplus)."""
        with self._state.lock:
            for ino in inos:
                self._lookups.count(ino)

    def forget(self, items: list[tuple[int, int]]) -> None:
        self._lookups.forget(items)

    def getattr(self, ino: int) -> Attr:
        while True:
            seen_claims = self._state.claim_seq
            with self.meta.read() as txn:
                inode = need_inode(txn, ino)
            with self._state.lock:
                if self._fresh(inode, seen_claims):
                    return self._attr_locked(inode)

    def _fresh(self, inode: Inode, seen_claims: int) -> bool:
        """Whether ``inode``, read from fsmeta after ``claim_seq`` was ``seen_claims``, can
        answer for its attributes (with the state lock held). Not if a last close stored the
        file's size and times since, and took its open file, whose own were newer, away: the
        answer would give the size from before the close's writes (a GETATTR racing the
        RELEASE that a close(2) sends without waiting)."""
        return inode.ino in self._open or self._state.claim_seq == seen_claims

    def setattr(self, ino: int, req: SetattrRequest, fh: int | None = None) -> Attr:
        while True:
            # Another worker thread may release the last handle (a truncate by path uses the
            # open file's fd), or open the file first (reading the old size, writing between
            # the change and its cache file's): the open file is pinned, or the inode claimed.
            try:
                with (self._remote_prefix_kept(ino, req.size) as prefix_fetched,
                      self._files.pinned_or_claimed(ino) as of):
                    if prefix_fetched and self._state.fetcher is not None:
                        # Its cache file is the file's own from here on (no reader may register
                        # fetch state, which cuts it, until the truncate is stored).
                        self._state.fetcher.detach(ino)
                    return self._setattr(ino, req, of, prefix_fetched)
            except EvictedMeanwhile:
                continue

    def _setattr(self, ino: int, req: SetattrRequest, of: OpenFile | None, prefix_fetched: bool) -> Attr:
        """``of``: the inode's open file, pinned, or None with the inode claimed."""
        now = self.clock()
        with self._state.lock:
            times_only = (of is not None and of.attrs_dirty and self._state.backing is None and req.mtime_ns is not None
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
            self._files.persist(of)

        def apply(txn: Txn) -> Inode:
            inode = need_inode(txn, ino)
            if req.size is not None:
                if inode.is_dir:
                    raise FsError(errno.EISDIR)
                if not inode.is_reg:
                    raise FsError(errno.EINVAL)
                if inode.state == FileState.REMOTE and req.size != 0 and not prefix_fetched:
                    raise EvictedMeanwhile  # evicted since it was looked at: fetch what stays
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
            if not inode.is_symlink and (req.mode is not None or req.uid is not None or req.gid is not None
                                         or req.mtime_ns is not None) and req.size is None:
                # Object metadata (mode/uid/gid/mtime) of a file, FIFO, socket, device or
                # directory marker must follow.
                durability.mark_meta_changed(txn, inode, now)
            txn.put_inode(inode)
            return inode

        # Under the open file's I/O lock: no write lands between the truncate and the new size,
        # and a flush's persist (which stores the times it took before) is not in between.
        with of.io_lock if of is not None else contextlib.nullcontext():
            inode = self.meta.write(apply)
            if req.size is not None:
                self._state.publish_before_bytes_change(ino)
                self._files.truncate_data(ino, req.size, of)
            if of is not None:
                with self._state.lock:
                    if self._state.backing is not None and of.remote is None:
                        # Passthrough writes since the file was last looked at: take them in
                        # first, or the align below makes them its baseline unseen, and the
                        # reply gives the size before them (an O_APPEND then writes there).
                        datapath.refresh(of)
                    if req.size is not None:
                        of.size = req.size
                        of.needs_bump = True
                    if req.size is not None or req.mtime_ns is not None:
                        of.mtime_ns = inode.mtime_ns
                        if self._state.backing is not None:
                            datapath.align(of, inode.atime_ns, inode.mtime_ns)
                    of.ctime_ns = inode.ctime_ns
        with self._state.lock:
            return self._attr(inode)

    @contextlib.contextmanager
    def _remote_prefix_kept(self, ino: int, size: int | None):
        """Before a REMOTE file is truncated (or opened with O_TRUNC): fetch what stays, and hold
        its fetch state (nobody drops it, which would cut the cache file) until the block
        ends. Yields False if there is no truncate or the file was not REMOTE."""
        if size is None:
            yield False
            return
        with self.meta.read() as txn:
            inode = need_inode(txn, ino)
        if inode.state != FileState.REMOTE:
            yield False
            return
        fetcher = self._state.fetcher
        if fetcher is None:
            if size:
                raise FsError(errno.EIO, f"inode {ino} is in the bucket only, and no bucket is open")
            yield True
            return
        rf = fetcher.acquire(inode) if size else None
        try:
            if rf is not None:
                fetcher.fetch_range(rf, size)
            yield True
        finally:
            if rf is not None:
                fetcher.release(rf)

    def fetch(self, ino: int) -> int:
        """Have the whole content of a REMOTE file in the cache, checked and cached-clean
        (``ckptfs prefetch``, open for writing). Returns the bytes fetched from the bucket."""
        while True:
            with self.meta.read() as txn:
                inode = need_inode(txn, ino)
            if not inode.is_reg or inode.state != FileState.REMOTE:
                return 0
            fetcher = self._state.fetcher
            if fetcher is None:
                raise FsError(errno.EIO, f"inode {ino} is in the bucket only, and no bucket is open")
            try:
                rf = fetcher.acquire(inode)
            except EvictedMeanwhile:
                continue  # truncated or rewritten meanwhile: look again
            try:
                return fetcher.fetch_all(rf)
            finally:
                fetcher.release(rf)

    def readlink(self, ino: int) -> bytes:
        with self.meta.read() as txn:
            inode = need_inode(txn, ino)
        if not inode.is_symlink:
            raise FsError(errno.EINVAL)
        return inode.target

    # -- names -----------------------------------------------------------------------

    def mkdir(self, parent: int, name: bytes, mode: int, caller: Caller) -> Attr:
        return self._attr(self._namespace.mkdir(parent, name, mode, caller))

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, caller: Caller) -> Attr:
        return self._attr(self._namespace.mknod(parent, name, mode, rdev, caller))

    def symlink(self, parent: int, name: bytes, target: bytes, caller: Caller) -> Attr:
        return self._attr(self._namespace.symlink(parent, name, target, caller))

    def create(self, parent: int, name: bytes, mode: int, flags: int, caller: Caller) -> tuple[int, Attr]:
        """O_CREAT open of a name that the kernel found missing (O_EXCL is implied)."""
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        seen_claims = self._state.claim_seq
        spares = self._state.spares
        spare = spares.take() if spares is not None else None  # its file is data/<its ino> already
        try:
            inode = self._namespace.create_file(parent, name, mode, caller,
                                                ino=spare.ino if spare is not None else None,
                                                then=OpenFiles.register_created_writer if writable else None)
        except BaseException:
            if spare is not None:
                spares.give_back(spare)
            raise
        try:
            while True:
                try:
                    fh = self._files.open_handle(inode, flags, created=True, seen_claims=seen_claims,
                                                 spare=spare)
                    break
                except EvictedMeanwhile:
                    # A setattr of the new name came first (a core caller: FUSE holds the
                    # directory until CREATE answers): open the inode as it made it.
                    seen_claims = self._state.claim_seq
                    with self.meta.read() as txn:
                        inode = need_inode(txn, inode.ino)
        except BaseException:
            # No name, reference or writer (the drain would wait for it forever) is left
            self._namespace.abandon_create(parent, name, inode.ino, writer=writable)
            raise
        finally:
            if spare is not None:
                spare.discard()  # (unless the open file took its descriptor)
        return fh, self._attr(inode, just_opened=True)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        return self._attr(self._namespace.link(ino, new_parent, new_name))

    def unlink(self, parent: int, name: bytes) -> None:
        self._namespace.unlink(parent, name)

    def changed_dirs(self) -> list[Attr]:
        """The attributes of the directories the calling thread's last namespace change
        touched, as it left them."""
        return [self._attr(inode) for inode in self._namespace.touched_dirs()]

    def rmdir(self, parent: int, name: bytes) -> None:
        self.remote.refresh_child(parent, name)  # a directory with unlisted objects is not empty
        self._namespace.rmdir(parent, name)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int = 0) -> bool:
        """True if a directory was moved, exchanged or replaced."""
        # The drain moves what fsmeta knows below a renamed directory: list all of it first. A
        # file (the usual case) needs nothing listed, which the rename's transaction finds out.
        try:
            return self._namespace.rename(old_parent, old_name, new_parent, new_name, flags,
                                          dirs_listed=not self.remote.enabled)
        except ListDirectoriesFirst:
            self.remote.refresh_children([(old_parent, old_name, True),
                                          (new_parent, new_name, bool(flags & RENAME_EXCHANGE))])
            return self._namespace.rename(old_parent, old_name, new_parent, new_name, flags)

    # -- open files ----------------------------------------------------------------------

    def open(self, ino: int, flags: int) -> int:
        while True:
            seen_claims = self._state.claim_seq
            with self.meta.read() as txn:
                inode = need_inode(txn, ino)
            if inode.is_dir:
                raise FsError(errno.EISDIR)
            if not inode.is_reg:
                raise FsError(errno.EINVAL)
            writable = flags & os.O_ACCMODE != os.O_RDONLY
            if inode.state == FileState.REMOTE and (flags & os.O_TRUNC
                                                     or (writable and self._state.backing is not None)):
                # Written locally from now on: O_TRUNC needs none of the old content; a
                # passthrough open for writing gets all of it first, since its writes bypass
                # the gateway (an ordinary local file after that). Then read the inode again:
                # the evictor may have taken it back meanwhile. On the writeback data path
                # O_TRUNC comes after the open, as a SETATTR (gateway/fuse_ops.py), so an open
                # for writing fetches nothing yet: :meth:`write` fetches before the first write.
                if flags & os.O_TRUNC:
                    self.setattr(ino, SetattrRequest(size=0))
                else:
                    self.fetch(ino)
                continue
            try:
                fh = self._files.open_handle(inode, flags, seen_claims=seen_claims)
            except EvictedMeanwhile:
                continue
            break
        # Passthrough mode negotiates atomic O_TRUNC: O_TRUNC arrives here instead of as a
        # setattr, and the kernel has already set its size to 0. Linux truncates with O_RDONLY
        # too (the kernel checked write permission), so must we, or old bytes come back.
        if flags & os.O_TRUNC:
            try:
                self.setattr(ino, SetattrRequest(size=0), fh)
            except BaseException:
                self.release(fh)
                raise
        return fh

    def handle_inode(self, fh: int) -> int:
        return self._files.handle(fh).ino

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return self._files.read(fh, offset, size)

    def read_range(self, fh: int, offset: int, size: int) -> bytes | tuple[int, int, int]:
        """:meth:`read`, or the ``(fd, offset, length)`` of the cache file that holds it."""
        return self._files.read_range(fh, offset, size)

    def write(self, fh: int, offset: int, data) -> int:
        remote = self._files.handle(fh).open_file.remote
        if remote is not None and not remote.local:
            self._fetch_before_writing(remote)
        return self._files.write(fh, offset, data)

    def _fetch_before_writing(self, remote) -> None:
        """The first write to a file opened while REMOTE (writeback data path, see :meth:`open`):
        fetch and check all of it, as an open for writing in passthrough mode does. Its cache
        file is the file's own from then on: reads stop going through the fetcher (the handle's
        fetch state too, should the fetcher have replaced it meanwhile)."""
        self.fetch(remote.ino)
        self._state.fetcher.detach(remote.ino)
        with remote.cond:
            remote.local = True
            remote.cond.notify_all()

    def flush(self, fh: int) -> None:
        self._files.flush(fh)

    def fsync(self, fh: int, datasync: bool) -> None:
        self._files.fsync(fh, datasync)

    def release(self, fh: int) -> None:
        self._files.release(fh)

    # -- directories ---------------------------------------------------------------------

    def opendir(self, ino: int) -> int:
        with self.meta.read() as txn:
            need_dir(txn, ino)
        with self._state.lock:
            fh = next(self._state.next_fh)
            self._state.handles[fh] = Handle(fh, ino, False)
        return fh

    def readdir(self, fh: int, start: int) -> list[tuple[bytes, Attr, int]]:
        """Entries from position ``start``; each with the position after it.

        The listing is a snapshot taken when reading starts at position 0, so
        entries added or removed meanwhile never make others repeat or vanish.
        """
        h = self._files.handle(fh)
        if start == 0 or h.dir_snapshot is None:
            self.remote.refresh(h.ino)
            with self.meta.read() as txn:
                need_dir(txn, h.ino)
                snapshot = []
                for name, child in txn.iter_dir(h.ino):
                    inode = txn.get_inode(child)
                    if inode is not None:
                        snapshot.append((name, inode))
            h.dir_snapshot = snapshot
        out = []
        with self._state.lock:
            for index in range(start, len(h.dir_snapshot)):
                name, inode = h.dir_snapshot[index]
                out.append((name, self._attr(inode), index + 1))
        return out

    def releasedir(self, fh: int) -> None:
        with self._state.lock:
            self._state.handles.pop(fh, None)

    def fsyncdir(self, fh: int, datasync: bool) -> None:
        self._files.persist_writers()  # closes whose RELEASE has not come yet (passthrough)
        self.meta.sync()

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.cache_dir)

    # -- extended attributes ----------------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if name == PREFETCH_XATTR:
            fetched = self.fetch(ino)
            size = self.getattr(ino).size
            return json.dumps({"bytes": size, "fetched": fetched}, separators=(",", ":")).encode()
        if name == EVICT_XATTR:
            evicted = self.evict(ino)
            size = self.getattr(ino).size
            return json.dumps({"bytes": size, "evicted": evicted}, separators=(",", ":")).encode()
        return self._xattrs.getxattr(ino, name)

    def evict(self, ino: int) -> bool:
        """Drop the file's cache file now if it may go (clean, not open, not a commit marker):
        ``user.ckptfs.evict``. True if the file is in the bucket only now."""
        with self.meta.read() as txn:
            inode = need_inode(txn, ino)
        if not inode.is_reg or self._state.space is None:
            return False
        files, _ = self._state.space.evict_now([ino])
        return files == 1 or inode.state == FileState.REMOTE

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        self._xattrs.setxattr(ino, name, value, flags)

    def listxattr(self, ino: int) -> list[bytes]:
        return self._xattrs.listxattr(ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        self._xattrs.removexattr(ino, name)

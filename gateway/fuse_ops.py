"""The FUSE handlers: decode, call the core, map the error, count.

The front end is ``ckptfs_fuse`` (``native/``): a pool of C threads reads
``/dev/fuse``, and each request calls one method of :class:`CkptOperations` in the thread
that read it, holding the GIL only while Python runs. The core is synchronous and
thread-safe, so a handler calls it directly: there is no event loop and no hop to another
thread on the path of a request (docs/DESIGN.md, "Metadata operation performance").

A handler answers by returning (the shapes are listed at each method) or by raising
``FuseError(errno)``. Every handler goes through :func:`_answer`, which counts and times the
request and turns anything else it raises into an errno: a core ``FsError`` keeps its errno,
an ``OSError`` of the cache device keeps its errno (ENOSPC, EIO), and an unexpected exception
becomes EIO, a log line and a counter. The C side never sees another exception; if one got
through anyway, it calls :meth:`CkptOperations.unexpected` and answers EIO.
"""

from __future__ import annotations

import errno
import functools
import logging
import os

from ckptfs_fuse import (OPEN_DIRECT_IO, OPEN_KEEP_CACHE, OPEN_NOFLUSH, ROOT_INODE, FuseError, forget_dir_attrs,
                         remember_dir_attrs)

from . import metrics, mountpoint
from .core import ENTRY_TIMEOUT_MIN, Attr, Caller, FsCore, SetattrRequest
from .errors import FsError

log = logging.getLogger("ckptfs.fuse")

ATTR_TIMEOUT = 1.0
BLKSIZE = 1 << 20  # st_blksize: Python's buffered files read and write this much at a time
CACHE_DIR_XATTR = os.fsencode(mountpoint.CACHE_DIR_XATTR)


def _entry(attr: Attr, entry_timeout: float = 0.0) -> tuple:
    """An entry for a reply (the tuple native/pycall.c reads); ``entry_timeout`` only
    matters in replies about a name (lookup, create, mkdir, ..., readdirplus): how long the
    kernel may keep the name without asking. Inode numbers are never reused (generation 0)."""
    return (attr.ino, entry_timeout, ATTR_TIMEOUT, attr.mode, attr.nlink, attr.uid, attr.gid, attr.rdev,
            attr.size, BLKSIZE, attr.blocks, attr.atime_ns, attr.mtime_ns, attr.ctime_ns)


def _negative_entry(entry_timeout: float) -> tuple:
    """A lookup's answer "no such name" that the kernel keeps for ``entry_timeout`` seconds
    (a negative dentry), instead of asking again at the next lookup of the name."""
    return (0, entry_timeout)


def _errname(code: int) -> str:
    return errno.errorcode.get(code, str(code))


def _failure(op: str, exc: BaseException) -> FuseError:
    """The errno FUSE answers for what a handler raised, counted (and logged if unexpected)."""
    if isinstance(exc, FuseError):
        metrics.FUSE_ERRORS.labels(op, _errname(exc.errno)).inc()
        return exc
    if isinstance(exc, FsError):
        metrics.FUSE_ERRORS.labels(op, _errname(exc.errno)).inc()
        return FuseError(exc.errno)
    if isinstance(exc, OSError):
        # Cache-device errors (ENOSPC, EIO) are passed through as they are.
        code = exc.errno or errno.EIO
        metrics.FUSE_ERRORS.labels(op, _errname(code)).inc()
        log.warning("%s: cache I/O error: %s", op, exc)
        return FuseError(code)
    metrics.FUSE_UNEXPECTED.labels(op).inc()
    metrics.FUSE_ERRORS.labels(op, "EIO").inc()
    log.error("%s failed unexpectedly; answered EIO", op, exc_info=exc)
    return FuseError(errno.EIO)


def _answer(op: str):
    """Turn whatever a handler of ``op`` raises into a FuseError (counted; the front end counts
    and times the requests themselves)."""

    def wrap(handler):
        @functools.wraps(handler)
        def answered(self, *args):
            try:
                return handler(self, *args)
            except Exception as exc:
                raise _failure(op, exc) from None
        return answered
    return wrap


class CkptOperations:
    """The ops object of a ``ckptfs_fuse.Session``; every method runs in a front-end thread."""

    # With the writeback cache, O_TRUNC must come as a SETATTR the kernel applies under the
    # inode lock: atomic O_TRUNC truncates the kernel's side in a second, silent step, and a
    # truncate or write by another process in between is undone in the kernel only (the
    # kernel's size then differs from the cache file's for good). Passthrough keeps it, so that
    # O_TRUNC of a file only in the bucket fetches nothing (a writable open without it must
    # fetch first: its writes bypass the gateway); there the kernel may show the truncation's
    # size until its attributes time out, then asks again (docs/SEMANTICS.md).
    atomic_o_trunc_with_writeback_cache = False

    def __init__(self, core: FsCore, *, fsync_hook=None, on_init=None, on_init_replied=None):
        self.core = core
        self.fsync_hook = fsync_hook  # --fsync=remote: waits for the drain after a local fsync
        # Called while the kernel's INIT is handled (passthrough granted or not is known then),
        # and once its reply is in.
        self.on_init = on_init
        self.on_init_replied = on_init_replied
        # Passthrough mode: opens the gateway serves use direct I/O. Set at INIT (on_init), once
        # the kernel granted FUSE_DIRECT_IO_ALLOW_MMAP, without which they could not be mapped.
        self.direct_served_io = False

    def init(self) -> None:
        if self.on_init is not None:
            self.on_init()

    def init_replied(self) -> None:
        if self.on_init_replied is not None:
            self.on_init_replied()

    def unexpected(self, op: str, exc: BaseException) -> None:
        """An exception the handlers did not turn into a FuseError (a bug): the request was
        answered EIO."""
        _failure(op, exc)

    def _entry_timeout(self, parent: int) -> float:
        """:meth:`FsCore.entry_timeout` of ``parent``. Never raises: the reply it is for must
        still go out."""
        try:
            return self.core.entry_timeout(parent)
        except Exception:
            log.exception("entry timeout of directory %s failed; using %g s", parent, ENTRY_TIMEOUT_MIN)
            return ENTRY_TIMEOUT_MIN

    def _changed(self) -> None:
        """After a namespace change: hand the front end the attributes of the directories it
        touched, as the change left them (``FsCore.changed_dirs``, not read again). The kernel
        drops what it holds of a changed directory's attributes and asks again at its next
        permission check there (``default_permissions``); the front end answers that GETATTR
        itself (native/README.md, "Directory attributes after a change"). Never raises: the
        change is done, and without the attributes the GETATTR comes here as before."""
        try:
            for attr in self.core.changed_dirs():
                remember_dir_attrs(_entry(attr))
        except Exception:
            log.warning("attributes of a changed directory not kept", exc_info=True)

    # -- names and attributes: replies are entries ------------------------------------------

    @_answer("lookup")
    def lookup(self, parent: int, name: bytes) -> tuple:
        try:
            attr = self.core.lookup(parent, name)
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # Kept by the kernel as long as a positive answer would be (see FsCore.entry_timeout).
            return _negative_entry(self._entry_timeout(parent))
        return _entry(attr, self._entry_timeout(parent))

    @_answer("forget")
    def forget(self, items: list[tuple[int, int]]) -> None:
        self.core.forget(items)

    @_answer("getattr")
    def getattr(self, ino: int) -> tuple:
        return _entry(self.core.getattr(ino))

    @_answer("setattr")
    def setattr(self, ino: int, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, fh) -> tuple:
        # Each is None unless the request sets it; UTIME_NOW comes resolved.
        req = SetattrRequest(mode=mode, uid=uid, gid=gid, size=size, atime_ns=atime_ns,
                             mtime_ns=mtime_ns, ctime_ns=ctime_ns)
        return _entry(self.core.setattr(ino, req, fh))

    @_answer("readlink")
    def readlink(self, ino: int) -> bytes:
        return self.core.readlink(ino)

    @_answer("mknod")
    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int, umask: int, pid: int) -> tuple:
        attr = self.core.mknod(parent, name, mode, rdev, Caller(uid, gid, umask, pid))
        self._changed()
        return _entry(attr, self._entry_timeout(parent))

    @_answer("mkdir")
    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int, umask: int, pid: int) -> tuple:
        attr = self.core.mkdir(parent, name, mode, Caller(uid, gid, umask, pid))
        self._changed()
        return _entry(attr, self._entry_timeout(parent))

    @_answer("unlink")
    def unlink(self, parent: int, name: bytes) -> None:
        self.core.unlink(parent, name)
        self._changed()

    @_answer("rmdir")
    def rmdir(self, parent: int, name: bytes) -> None:
        self.core.rmdir(parent, name)

    @_answer("symlink")
    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int, umask: int, pid: int) -> tuple:
        attr = self.core.symlink(parent, name, target, Caller(uid, gid, umask, pid))
        self._changed()
        return _entry(attr, self._entry_timeout(parent))

    @_answer("rename")
    def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int) -> None:
        if self.core.rename(parent, name, new_parent, new_name, flags):
            forget_dir_attrs()  # a directory moved or went: what is kept of it is stale
        else:
            self._changed()

    @_answer("link")
    def link(self, ino: int, new_parent: int, new_name: bytes) -> tuple:
        attr = self.core.link(ino, new_parent, new_name)
        self._changed()
        return _entry(attr, self._entry_timeout(new_parent))

    # -- files: open replies are (fh, backing_id, OPEN_* flags) --------------------------------

    def _opened(self, fh: int) -> tuple:
        # Passthrough: the kernel reads and writes the cache file itself (no keep_cache then).
        # Opens the gateway serves in a passthrough mount (REMOTE files being fetched, writers
        # under cache pressure) fill the FUSE inode's page cache, which passthrough writes to the
        # cache file never update: keeping it across opens could serve stale pages.
        if self.core.passthrough:
            bid = self.core.backing_id(fh)
            if bid:
                # No FLUSH at close(2): for a passthrough handle it would only store the size
                # and times, which RELEASE stores too, and it is a synchronous round trip of
                # every create+write+close. RELEASE comes after close(2) has returned: a stat
                # meanwhile reads the cache file (FsCore._attr), a directory fsync stores the
                # sizes first (OpenFiles.persist_writers), and the RELEASEs an unmount ends
                # unread are done at the end of the session (FsCore.release_all).
                return (fh, bid, OPEN_NOFLUSH)
            # Served by the gateway (a file being fetched, or a writer under cache-space
            # pressure, gateway/space.py): pages the kernel cached at an earlier such open may be
            # stale after passthrough writes since. With direct I/O (where the kernel allows
            # shared mappings of such files) it caches none: no second copy of a cold read next
            # to the cache file's pages, which later passthrough opens read (docs/DESIGN.md).
            return (fh, 0, OPEN_DIRECT_IO if self.direct_served_io else 0)
        return (fh, 0, OPEN_KEEP_CACHE)

    @_answer("open")
    def open(self, ino: int, flags: int) -> tuple:
        return self._opened(self.core.open(ino, flags))

    @_answer("create")
    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int, umask: int,
               pid: int) -> tuple:
        fh, attr = self.core.create(parent, name, mode, flags, Caller(uid, gid, umask, pid))
        self._changed()
        return (*self._opened(fh), _entry(attr, self._entry_timeout(parent)))  # (fh, bid, flags, entry)

    @_answer("read")
    def read(self, fh: int, offset: int, size: int) -> bytes | tuple[int, int, int]:
        # The bytes, or (fd, offset, length) of the cache file holding them: the front end
        # sends that range without the GIL (spliced, where INIT granted it).
        data = self.core.read_range(fh, offset, size)
        metrics.READ_BYTES.inc(data[2] if isinstance(data, tuple) else len(data))
        return data

    @_answer("write")
    def write(self, fh: int, offset: int, data: memoryview) -> int:
        # ``data`` is a view of the front end's buffer, valid during this call only.
        written = self.core.write(fh, offset, data)
        metrics.WRITE_BYTES.inc(written)
        return written

    @_answer("flush")
    def flush(self, fh: int) -> None:
        self.core.flush(fh)

    @_answer("release")
    def release(self, fh: int) -> None:
        self.core.release(fh)

    @_answer("fsync")
    def fsync(self, fh: int, datasync: bool) -> None:
        self.core.fsync(fh, datasync)
        if self.fsync_hook is not None:
            self.fsync_hook(self.core, fh)

    # -- directories -------------------------------------------------------------------------

    @_answer("opendir")
    def opendir(self, ino: int) -> int:
        return self.core.opendir(ino)

    @_answer("readdir")
    def readdir(self, fh: int, start_id: int) -> list[tuple[bytes, tuple, int]]:
        """Entries from ``start_id``: (name, entry, position after it). The front end replies
        with as many as fit and then calls :meth:`readdir_taken` with those."""
        entries = self.core.readdir(fh, start_id)
        if not entries:
            return []
        timeout = self._entry_timeout(self.core.handle_inode(fh))
        return [(name, _entry(attr, timeout), next_id) for name, attr, next_id in entries]

    def readdir_taken(self, fh: int, inos: list[int]) -> None:
        # The kernel takes a reference to each entry of a readdirplus reply; counted before the
        # reply goes out, so no FORGET of them can come first. (Part of the readdir request.)
        try:
            self.core.count_lookups(inos)
        except Exception as exc:
            raise _failure("readdir", exc) from None

    @_answer("releasedir")
    def releasedir(self, fh: int) -> None:
        self.core.releasedir(fh)

    @_answer("fsyncdir")
    def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.core.fsyncdir(fh, datasync)

    @_answer("statfs")
    def statfs(self) -> tuple:
        st = self.core.statfs()
        return (st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree,
                st.f_favail, 255)

    # -- extended attributes -------------------------------------------------------------------

    @_answer("setxattr")
    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int) -> None:
        # XATTR_CREATE / XATTR_REPLACE are checked in the transaction that sets the value
        self.core.setxattr(ino, name, value, flags)

    @_answer("getxattr")
    def getxattr(self, ino: int, name: bytes) -> bytes:
        if ino == ROOT_INODE and name == CACHE_DIR_XATTR:
            return os.fsencode(self.core.cache_dir)
        if not name.startswith(b"user."):  # (the front end answers these itself: user_xattrs_only)
            raise FuseError(errno.ENODATA)
        return self.core.getxattr(ino, name)

    @_answer("listxattr")
    def listxattr(self, ino: int) -> bytes:
        return b"".join(name + b"\0" for name in self.core.listxattr(ino))

    @_answer("removexattr")
    def removexattr(self, ino: int, name: bytes) -> None:
        self.core.removexattr(ino, name)

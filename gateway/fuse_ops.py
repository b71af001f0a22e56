"""The pyfuse3 ``Operations``: decode, call the core in a worker thread, map the error, count.

pyfuse3 ends its main loop on any exception that is not ``FUSEError``, so every
handler goes through :meth:`CkptOperations._call`, which turns an unexpected
exception into EIO, a log line and a counter.

Requests that only read fsmeta (lookup, getattr, forget's bookkeeping) are first tried on
the trio loop itself (the core's ``*_nowait`` methods: an LMDB read of mapped pages, no
lock that another thread may hold while doing I/O); only when that would wait do they take
the worker-thread hop (``gateway/workers.py``), which costs about as much as the request
itself (docs/DESIGN.md).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time

import pyfuse3

from ckptfs.fsmeta import WouldBlock

from . import metrics, mountpoint
from .core import ENTRY_TIMEOUT_MIN, Attr, Caller, FsCore, SetattrRequest
from .errors import FsError
from .workers import Workers

log = logging.getLogger("ckptfs.fuse")

ATTR_TIMEOUT = 1.0
CACHE_DIR_XATTR = os.fsencode(mountpoint.CACHE_DIR_XATTR)


def _caller(ctx) -> Caller:
    return Caller(uid=ctx.uid, gid=ctx.gid, umask=ctx.umask, pid=ctx.pid)


def _entry(attr: Attr, entry_timeout: float = 0.0) -> pyfuse3.EntryAttributes:
    """Attributes for a reply; ``entry_timeout`` only matters in replies about a name (lookup,
    create, mkdir, ..., readdirplus): how long the kernel may keep the name without asking."""
    entry = pyfuse3.EntryAttributes()
    entry.st_ino = attr.ino
    entry.generation = 0  # inode numbers are never reused
    entry.entry_timeout = entry_timeout
    entry.attr_timeout = ATTR_TIMEOUT
    entry.st_mode = attr.mode
    entry.st_nlink = attr.nlink
    entry.st_uid = attr.uid
    entry.st_gid = attr.gid
    entry.st_rdev = attr.rdev
    entry.st_size = attr.size
    entry.st_blksize = 1 << 20
    entry.st_blocks = attr.blocks
    entry.st_atime_ns = attr.atime_ns
    entry.st_mtime_ns = attr.mtime_ns
    entry.st_ctime_ns = attr.ctime_ns
    return entry


def _negative_entry(entry_timeout: float) -> pyfuse3.EntryAttributes:
    """A lookup's answer "no such name" that the kernel keeps for ``entry_timeout`` seconds
    (a negative dentry), instead of asking again at the next lookup of the name."""
    entry = pyfuse3.EntryAttributes()
    entry.st_ino = 0
    entry.entry_timeout = entry_timeout
    return entry


def _errname(code: int) -> str:
    return errno.errorcode.get(code, str(code))


class CkptOperations(pyfuse3.Operations):
    # Measured: the kernel writeback cache lets writes arrive as 1 MiB requests and
    # return to the writer at page-cache speed (docs/DESIGN.md).
    enable_writeback_cache = True
    # With the writeback cache, O_TRUNC must come as a SETATTR the kernel applies under the
    # inode lock: atomic O_TRUNC truncates the kernel's side in a second, silent step, and a
    # truncate or write by another process in between is undone in the kernel only (the
    # kernel's size then differs from the cache file's for good). Passthrough keeps it: there
    # the cache file is what the kernel reads, so nothing diverges. See native/*.patch.
    atomic_o_trunc_with_writeback_cache = False
    supports_dot_lookup = True

    def __init__(self, core: FsCore, *, fsync_hook=None, on_init=None):
        super().__init__()
        self.core = core
        self.fsync_hook = fsync_hook  # --fsync=remote: awaited after a local fsync
        # Called once the kernel's INIT was handled (passthrough granted or not is known then).
        # A gateway in passthrough mode sets ``enable_passthrough = True`` on the instance
        # before pyfuse3.init(); if the kernel does not grant it, the patched pyfuse3 still
        # negotiates the writeback cache (enable_writeback_cache stays True).
        self.on_init = on_init
        self._metric_children: dict[str, tuple] = {}
        self._workers = Workers()  # the hop to a worker thread, cheaper than trio.to_thread
        # Passthrough mode: opens the gateway serves use direct I/O. Set at INIT (on_init), once
        # the kernel granted FUSE_DIRECT_IO_ALLOW_MMAP, without which they could not be mapped.
        self.direct_served_io = False

    def init(self):
        if self.on_init is not None:
            self.on_init()

    def _metrics_of(self, op: str):
        """The request counter and duration histogram of ``op`` (``labels()`` is a dict lookup
        under a lock; done once per op, not per request)."""
        children = self._metric_children.get(op)
        if children is None:
            children = self._metric_children[op] = (metrics.FUSE_REQUESTS.labels(op), metrics.FUSE_SECONDS.labels(op))
        return children

    @staticmethod
    def _failure(op: str, exc: BaseException) -> pyfuse3.FUSEError:
        """The errno FUSE answers for what a handler raised, counted (and logged if unexpected)."""
        if isinstance(exc, pyfuse3.FUSEError):
            metrics.FUSE_ERRORS.labels(op, _errname(exc.errno)).inc()
            return exc
        if isinstance(exc, FsError):
            metrics.FUSE_ERRORS.labels(op, _errname(exc.errno)).inc()
            return pyfuse3.FUSEError(exc.errno)
        if isinstance(exc, OSError):
            # Cache-device errors (ENOSPC, EIO) are passed through as they are.
            code = exc.errno or errno.EIO
            metrics.FUSE_ERRORS.labels(op, _errname(code)).inc()
            log.warning("%s: cache I/O error: %s", op, exc)
            return pyfuse3.FUSEError(code)
        metrics.FUSE_UNEXPECTED.labels(op).inc()
        metrics.FUSE_ERRORS.labels(op, "EIO").inc()
        log.error("%s failed unexpectedly; answered EIO", op, exc_info=exc)
        return pyfuse3.FUSEError(errno.EIO)

    @contextlib.asynccontextmanager
    async def _answering(self, op: str):
        """Count and time one request, and turn whatever it raises into the errno FUSE answers.

        pyfuse3 handles only FUSEError: anything else would end its main loop.
        """
        requests, seconds = self._metrics_of(op)
        requests.inc()
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            failure = self._failure(op, exc)
            if failure is exc:
                raise
            raise failure from None
        finally:
            seconds.observe(time.perf_counter() - start)

    async def _call(self, op: str, fn, *args, nowait=None):
        """Answer ``op`` with ``fn(*args)`` in a worker thread; with ``nowait``, first try
        ``nowait(*args)`` on the loop (it raises WouldBlock, changing nothing, when it cannot
        answer without waiting). Like :meth:`_answering`, without its per-request generator."""
        requests, seconds = self._metrics_of(op)
        requests.inc()
        start = time.perf_counter()
        try:
            if nowait is not None:
                try:
                    return nowait(*args)
                except WouldBlock:
                    pass
            return await self._workers.run(fn, *args)
        except Exception as exc:
            failure = self._failure(op, exc)
            if failure is exc:
                raise
            raise failure from None
        finally:
            seconds.observe(time.perf_counter() - start)

    def _entry_timeout(self, parent: int, *, dir_fh: int | None = None) -> float:
        """:meth:`FsCore.entry_timeout` of ``parent`` (or of the directory open as ``dir_fh``).
        Never raises: the reply it is for must still go out, and pyfuse3 would end its loop."""
        try:
            if dir_fh is not None:
                parent = self.core.handle_inode(dir_fh)
            return self.core.entry_timeout(parent)
        except Exception:
            log.exception("entry timeout of directory %s failed; using %g s", parent, ENTRY_TIMEOUT_MIN)
            return ENTRY_TIMEOUT_MIN

    # -- names and attributes ---------------------------------------------------------

    async def lookup(self, parent_inode, name, ctx=None):
        try:
            attr = await self._call("lookup", self.core.lookup, parent_inode, name, nowait=self.core.lookup_nowait)
        except pyfuse3.FUSEError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # Kept by the kernel as long as a positive answer would be (see FsCore.entry_timeout).
            return _negative_entry(self._entry_timeout(parent_inode))
        return _entry(attr, self._entry_timeout(parent_inode))

    async def forget(self, inode_list):
        # forget has no reply: errors are logged and counted, never raised to pyfuse3
        items = list(inode_list)
        try:
            purge = await self._call("forget", self.core.forget, items, nowait=self.core.forget_nowait)
        except pyfuse3.FUSEError:
            return
        if purge:  # answered on the loop; dropping unlinked inodes is an fsmeta write
            try:
                await self._workers.run(self.core.purge_unreferenced, purge)
            except Exception as exc:  # noqa: BLE001 - no reply to carry it: logged and counted
                self._failure("forget", exc)

    async def getattr(self, inode, ctx=None):
        return _entry(await self._call("getattr", self.core.getattr, inode, nowait=self.core.getattr_nowait))

    async def setattr(self, inode, attr, fields, fh, ctx):
        req = SetattrRequest(
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            ctime_ns=attr.st_ctime_ns if fields.update_ctime else None,
        )
        return _entry(await self._call("setattr", self.core.setattr, inode, req, fh))

    async def readlink(self, inode, ctx):
        return await self._call("readlink", self.core.readlink, inode)

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        attr = await self._call("mknod", self.core.mknod, parent_inode, name, mode, rdev, _caller(ctx))
        return _entry(attr, self._entry_timeout(parent_inode))

    async def mkdir(self, parent_inode, name, mode, ctx):
        attr = await self._call("mkdir", self.core.mkdir, parent_inode, name, mode, _caller(ctx))
        return _entry(attr, self._entry_timeout(parent_inode))

    async def unlink(self, parent_inode, name, ctx):
        await self._call("unlink", self.core.unlink, parent_inode, name)

    async def rmdir(self, parent_inode, name, ctx):
        await self._call("rmdir", self.core.rmdir, parent_inode, name)

    async def symlink(self, parent_inode, name, target, ctx):
        attr = await self._call("symlink", self.core.symlink, parent_inode, name, target, _caller(ctx))
        return _entry(attr, self._entry_timeout(parent_inode))

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self._call("rename", self.core.rename, parent_inode_old, name_old, parent_inode_new, name_new, flags)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        attr = await self._call("link", self.core.link, inode, new_parent_inode, new_name)
        return _entry(attr, self._entry_timeout(new_parent_inode))

    # -- files ---------------------------------------------------------------------------

    def _file_info(self, fh: int) -> pyfuse3.FileInfo:
        # Passthrough: the kernel reads and writes the cache file itself (no keep_cache then).
        # Opens the gateway serves in a passthrough mount (REMOTE files being fetched, writers
        # under cache pressure) fill the FUSE inode's page cache, which passthrough writes to the
        # cache file never update: keeping it across opens could serve stale pages.
        if self.core.passthrough:
            bid = self.core.backing_id(fh)
            if bid:
                return pyfuse3.FileInfo(fh=fh, backing_id=bid)
            # Served by the gateway (a file being fetched, or a writer under cache-space
            # pressure, gateway/space.py): pages the kernel cached at an earlier such open may be
            # stale after passthrough writes since. With direct I/O (where the kernel allows
            # shared mappings of such files) it caches none: no second copy of a cold read next
            # to the cache file's pages, which later passthrough opens read (docs/DESIGN.md).
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=self.direct_served_io)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    # The reply's FileInfo is made in the worker thread: the backing id is read under
    # CoreState.lock, which the loop must not wait for (its holders may do I/O).
    def _opened(self, inode: int, flags: int) -> pyfuse3.FileInfo:
        return self._file_info(self.core.open(inode, flags))

    def _created(self, parent_inode: int, name: bytes, mode: int, flags: int, caller) -> tuple:
        fh, attr = self.core.create(parent_inode, name, mode, flags, caller)
        return self._file_info(fh), attr

    async def open(self, inode, flags, ctx):
        return await self._call("open", self._opened, inode, flags)

    async def create(self, parent_inode, name, mode, flags, ctx):
        info, attr = await self._call("create", self._created, parent_inode, name, mode, flags, _caller(ctx))
        return info, _entry(attr, self._entry_timeout(parent_inode))

    async def read(self, fh, off, size):
        data = await self._call("read", self.core.read, fh, off, size)
        metrics.READ_BYTES.inc(len(data))
        return data

    async def write(self, fh, off, buf):
        written = await self._call("write", self.core.write, fh, off, buf)
        metrics.WRITE_BYTES.inc(written)
        return written

    async def flush(self, fh):
        await self._call("flush", self.core.flush, fh)

    async def release(self, fh):
        await self._call("release", self.core.release, fh)

    async def fsync(self, fh, datasync):
        async with self._answering("fsync"):
            await self._workers.run(self.core.fsync, fh, datasync)
            if self.fsync_hook is not None:
                await self.fsync_hook(self.core, fh)

    # -- directories -----------------------------------------------------------------------

    async def opendir(self, inode, ctx):
        return await self._call("opendir", self.core.opendir, inode)

    def _listed(self, fh: int, start_id: int) -> tuple[list, float]:
        """In the worker thread: the entries, and their entry timeout (which needs the
        directory handle's inode, read under CoreState.lock)."""
        entries = self.core.readdir(fh, start_id)
        return entries, self._entry_timeout(0, dir_fh=fh) if entries else 0.0

    async def readdir(self, fh, start_id, token):
        async with self._answering("readdir"):
            entries, timeout = await self._workers.run(self._listed, fh, start_id)
            replied = []
            for name, attr, next_id in entries:
                if not pyfuse3.readdir_reply(token, name, _entry(attr, timeout), next_id):
                    break
                replied.append(attr.ino)
            if replied:
                # The kernel takes a reference to each entry it took (readdirplus). Counted
                # before this reply goes out, so no FORGET of them can come first; in a
                # worker thread if the state lock is busy.
                try:
                    self.core.count_lookups_nowait(replied)
                except WouldBlock:
                    await self._workers.run(self.core.count_lookups, replied)

    async def releasedir(self, fh):
        await self._call("releasedir", self.core.releasedir, fh)

    async def fsyncdir(self, fh, datasync):
        await self._call("fsyncdir", self.core.fsyncdir, fh, datasync)

    async def statfs(self, ctx):
        st = await self._call("statfs", self.core.statfs)
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.f_bsize
        out.f_frsize = st.f_frsize
        out.f_blocks = st.f_blocks
        out.f_bfree = st.f_bfree
        out.f_bavail = st.f_bavail
        out.f_files = st.f_files
        out.f_ffree = st.f_ffree
        out.f_favail = st.f_favail
        out.f_namemax = 255
        return out

    # -- extended attributes ---------------------------------------------------------------

    async def setxattr(self, inode, name, value, ctx):
        await self._call("setxattr", self.core.setxattr, inode, name, value)

    async def getxattr(self, inode, name, ctx):
        if inode == pyfuse3.ROOT_INODE and name == CACHE_DIR_XATTR:
            return os.fsencode(self.core.cache_dir)
        if not name.startswith(b"user."):
            # FUSE clears SB_NOSEC, so the kernel asks for security.capability before
            # every write(2). Only user.* attributes exist here: answer at once, without a
            # worker-thread hop and an LMDB transaction per write(2).
            self._metrics_of("getxattr")[0].inc()
            raise pyfuse3.FUSEError(errno.ENODATA)
        return await self._call("getxattr", self.core.getxattr, inode, name)

    async def listxattr(self, inode, ctx):
        return await self._call("listxattr", self.core.listxattr, inode)

    async def removexattr(self, inode, name, ctx):
        await self._call("removexattr", self.core.removexattr, inode, name)

"""Open files and handles: read, write, flush, fsync, release, truncate of cache data.

While a file is open, its size and mtime are kept in memory (:class:`OpenFile`)
and written to fsmeta on flush, fsync and release, so a 1 MiB write costs one
``pwrite`` and no LMDB transaction. The first write after each of those points
bumps the generation in fsmeta *before* the bytes change, so the drain never
commits an upload of content that was modified under it. In passthrough mode the
gateway sees no writes: see gateway/datapath.py for what replaces the above.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptfs.fsmeta import FileState, Inode, Txn, durability

from . import datapath
from .errors import FsError
from .fetch import ReadAhead, RemoteFile
from .lookups import LookupCounts
from .spares import Spare
from .state import CoreState, EvictedMeanwhile, need_inode
from .writeback import WriteBehind


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
    write_behind: WriteBehind = field(default_factory=WriteBehind)  # see gateway/writeback.py
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    # passthrough mode (gateway/datapath.py):
    backing_id: int = 0  # shared by every handle of the inode
    cache_stat: tuple | None = None  # the cache file's stat_id when last taken into size/mtime
    last_fstat: os.stat_result | None = None  # the fstat behind it (a release reuses it)
    # The cache file changed since the last persist (datapath.refresh saw it, maybe in a
    # GETATTR): persist must know even when its own refresh finds nothing new.
    cache_moved: bool = False
    opened_for_write: bool = False
    # The first write refused for want of cache space (gateway/space.py): the file is cut
    # there at the next persist, so it never holds a hole, and later writes fail too.
    space_failed_at: int | None = None
    # read path (gateway/fetch.py): opened while REMOTE, so the gateway serves its reads and
    # fills the cache file on demand (no backing id, whatever the data path)
    remote: RemoteFile | None = None


@dataclass
class Handle:
    fh: int
    ino: int
    writable: bool
    open_file: OpenFile | None = None  # None for directories
    dir_snapshot: list | None = None
    readahead: ReadAhead | None = None  # files opened while REMOTE


class OpenFiles:
    def __init__(self, state: CoreState, lookups: LookupCounts):
        self._state = state
        self._lookups = lookups

    def open_handle(self, inode: Inode, flags: int, *, seen_claims: int | None = None,
                    created: bool = False, spare: Spare | None = None) -> int:
        """A handle on ``inode``. ``seen_claims``: ``CoreState.claim_seq`` before the caller
        read ``inode``; if a claim (an eviction, a truncate without a handle) was taken or
        ended since, or a last close stored a size, :class:`EvictedMeanwhile` asks the caller
        to read it again (its cache file may be gone, its size changed).

        ``created``: ``inode`` was just made by this open (O_CREAT): its cache file is new,
        and, for an open for writing, the transaction that made it also counted the writer
        (:meth:`register_created_writer`), so no generation bump is due before its first
        bytes (nobody saw the inode without a writer). ``spare``: the spare cache file the
        create took (its descriptor is taken here)."""
        s = self._state
        accmode = flags & os.O_ACCMODE
        writable = accmode in (os.O_WRONLY, os.O_RDWR)
        if s.backing is not None:
            self._check_watched(inode)
        # Passthrough writes never reach the gateway: under space pressure a file opened for
        # writing now is served by the gateway, so that its writes can wait for room.
        served_by_gateway = (writable and s.backing is not None and s.space is not None
                             and inode.ino not in s.open_files and s.space.under_pressure())
        remote = None
        if inode.state == FileState.REMOTE:
            if s.fetcher is None:
                raise FsError(errno.EIO, f"inode {inode.ino} is in the bucket only, and no bucket is open")
            remote = s.fetcher.acquire(inode)
        with s.lock:
            of = s.open_files.get(inode.ino)
            if of is None and (s.wait_unclaimed(inode.ino) or (seen_claims is not None
                                                               and seen_claims != s.claim_seq)):
                if remote is not None:
                    s.fetcher.release(remote)
                raise EvictedMeanwhile
            if of is None or (remote is not None and of.remote is None):
                if of is not None:  # open natively: a mode cannot change while a handle is open
                    s.fetcher.release(remote)
                    raise FsError(errno.EIO, f"inode {inode.ino} is open on the native data path")
                fd = s.create_cache_file(inode.ino, spare) if created else s.open_cache_file(inode.ino)
                # Only a create for writing counted its writer with the inode (a read-only
                # create did not: a later writer's first bytes must bump).
                of = OpenFile(inode.ino, fd, inode.size, inode.mtime_ns, inode.ctime_ns, remote=remote,
                              needs_bump=not (created and writable))
                s.open_files[inode.ino] = of
                remote = None  # the open file holds it now
                if s.backing is not None and of.remote is None:
                    try:
                        self._adopt(of, inode, attach=not served_by_gateway, created=created)
                    except BaseException:
                        del s.open_files[inode.ino]
                        os.close(fd)
                        raise
            of.refs += 1
            if writable:
                of.writers += 1
                of.opened_for_write = True
            fh = next(s.next_fh)
            s.handles[fh] = Handle(fh, inode.ino, writable, of,
                                   readahead=ReadAhead() if of.remote is not None else None)
        if remote is not None:  # the open file already holds the inode's fetch state
            s.fetcher.release(remote)
        if s.space is not None:
            s.space.touch(inode.ino)
        if writable and not created:
            try:
                s.meta.write(lambda txn: txn.add_writer(inode.ino, 1))
                if s.backing is not None:
                    self._bump(of)  # no WRITE will tell us: the bytes may change from now on
            except BaseException:
                self.release(fh)
                raise
        return fh

    @staticmethod
    def register_created_writer(txn: Txn, inode: Inode) -> None:
        """In the transaction that creates ``inode`` for an open for writing: the writer
        count that :meth:`open_handle` adds for other opens. The drain never sees the new
        inode without it, so it does not start the file before it is closed, and the
        generation the inode is born with needs no bump before its first bytes."""
        txn.set_first_writer(inode.ino)

    def _adopt(self, of: OpenFile, inode: Inode, *, attach: bool = True, created: bool = False) -> None:
        """Passthrough: first open of an inode. Its cache file gets fsmeta's size (a crash can
        leave it longer or shorter: bytes past the size were never acknowledged, a missing
        tail reads as zeros) and times (the kernel shows the cache file's after each read or
        write), and a backing id that every handle of the inode shares.

        ``created``: the inode and its cache file (empty, with older times) are new. Its
        times are left as they are: what the cache file shows now is only the baseline that
        its first write moves away from (the size at least changes), and until then the
        open file's own times, the inode's, are what the gateway answers. One system call
        fewer per create; a later open of a file never written aligns them then."""
        st = os.fstat(of.fd)
        if st.st_size != inode.size:
            os.ftruncate(of.fd, inode.size)
        if st.st_size != inode.size or (st.st_mtime_ns != inode.mtime_ns and not created):
            datapath.align(of, inode.atime_ns, inode.mtime_ns)
        else:
            of.cache_stat = datapath.stat_id(st)
        if attach:
            self._state.backing.attach(of)

    def _check_watched(self, inode: Inode) -> None:
        """Passthrough: a file released after writing may have changed since (a shared mapping)."""
        prev = self._state.backing.unwatch(inode.ino)
        if prev is None:
            return
        try:
            st = os.stat(self._state.data_path(inode.ino))
        except FileNotFoundError:
            return
        if datapath.stat_id(st) != prev:
            self.cache_changed(inode.ino, st)
            inode.size, inode.mtime_ns = st.st_size, st.st_mtime_ns

    def cache_changed(self, ino: int, st: os.stat_result) -> None:
        """A closed file's cache file changed behind the gateway (a shared mapping outliving
        close): new generation, and its size and mtime as they are now."""
        now = self._state.clock()

        def changed(txn: Txn) -> None:
            inode = txn.get_inode(ino)
            if inode is None or not inode.is_reg or inode.nlink == 0:
                return  # gone, or unlinked: nothing to upload
            durability.mark_dirty(txn, inode, now)
            inode.size, inode.mtime_ns = st.st_size, st.st_mtime_ns
            inode.ctime_ns = max(inode.ctime_ns, st.st_ctime_ns)
            durability.mark_written(txn, ino, now)
            txn.put_inode(inode)

        self._state.meta.write(changed)

    def backing_id(self, fh: int) -> int:
        h = self.handle(fh)
        return h.open_file.backing_id if h.open_file is not None else 0

    def handle(self, fh: int) -> Handle:
        with self._state.lock:
            h = self._state.handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def read(self, fh: int, offset: int, size: int) -> bytes:
        data = self.read_range(fh, offset, size)
        if isinstance(data, tuple):
            fd, offset, length = data
            return os.pread(fd, length, offset)
        return data

    def read_range(self, fh: int, offset: int, size: int) -> bytes | tuple[int, int, int]:
        """:meth:`read`, or ``(fd, offset, length)``: where the cache file holds every byte of
        the answer (a file opened while REMOTE, once fetched that far: its cache file has the
        object's size), the range to send from it, for the FUSE front end to send without a
        copy in Python. The fd stays open while the kernel waits for the READ."""
        h = self.handle(fh)
        of = h.open_file
        if of.remote is not None:
            self._state.fetcher.read_through(of.remote, h.readahead, offset, size)
        with self._state.lock:
            end = min(offset + size, of.size)
        if end <= offset:
            return b""
        if of.remote is not None and not of.remote.local:
            return (of.fd, offset, end - offset)
        data = os.pread(of.fd, end - offset, offset)
        if len(data) < end - offset:
            # The cache file is shorter than the file (sparse tail after truncate-up).
            data += bytes(end - offset - len(data))
        return data

    def _bump(self, of: OpenFile) -> None:
        """Record in fsmeta, before the bytes change, that the content changes."""
        now = self._state.clock()

        def bump(txn: Txn) -> None:
            inode = need_inode(txn, of.ino)
            durability.mark_dirty(txn, inode, now)
            txn.put_inode(inode)

        self._state.meta.write(bump)
        self._state.publish_before_bytes_change(of.ino)
        of.needs_bump = False

    def write(self, fh: int, offset: int, data) -> int:
        h = self.handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        of = h.open_file
        self._admit(of, offset, len(data))
        with of.io_lock:
            if of.space_failed_at is not None:
                raise FsError(errno.ENOSPC)
            if of.needs_bump:
                self._bump(of)
            written = os.pwrite(of.fd, data, offset)
            due = of.write_behind.note(offset, written)
            now = self._state.clock()
            with self._state.lock:
                if written and offset + written > of.size:  # (a write of no bytes extends nothing)
                    of.size = offset + written
                of.mtime_ns = of.ctime_ns = now
                of.attrs_dirty = True
        if due is not None:
            # Outside the I/O lock: starting writeback can block on a full device
            # queue, and waiting for old ranges is meant to hold back only this thread.
            # The fd stays open: the kernel releases the file only after its writes.
            of.write_behind.run(of.fd, due)
        return written

    def _admit(self, of: OpenFile, offset: int, length: int) -> None:
        """Wait for cache space for the bytes a write adds (gateway/space.py). After the
        backpressure timeout: ENOSPC, and the file keeps only what precedes this write."""
        space = self._state.space
        with self._state.lock:
            if of.space_failed_at is not None:
                raise FsError(errno.ENOSPC)
            size = of.size
        if space is None or offset + length <= size:
            return  # an overwrite takes no new space (a hole filled is counted at the next scan)
        try:
            space.admit(offset + length - size)
        except FsError:
            with of.io_lock, self._state.lock:
                if of.space_failed_at is None:
                    of.space_failed_at = min(offset, of.size)
            raise

    def _cut_at_failure(self, of: OpenFile) -> None:
        """After a write refused for space: drop what landed past it (never acknowledged: the
        handle's flush and fsync fail), so the file is a whole prefix, never one with a hole.
        Call with ``of.io_lock`` held."""
        with self._state.lock:
            cut = of.space_failed_at
            if cut is None or of.size <= cut:
                return
        os.ftruncate(of.fd, cut)
        with self._state.lock:
            of.size = cut
            of.attrs_dirty = True

    def persist(self, of: OpenFile, then: Callable[[Txn], None] | None = None) -> bool:
        """Write an open file's in-memory size/mtime to fsmeta. ``then``: more to do in the
        same transaction (the release's writer count), done only if there was something to
        store; returns whether it was."""
        s = self._state
        with of.io_lock:
            self._cut_at_failure(of)
            with s.lock:
                # Passthrough: writes went straight to the cache file, unseen.
                if s.backing is not None and of.remote is None:
                    datapath.refresh(of)
                moved, of.cache_moved = of.cache_moved, False
                if not of.attrs_dirty:
                    of.needs_bump = True
                    return False
                size, mtime, ctime = of.size, of.mtime_ns, of.ctime_ns
                of.attrs_dirty = False

            def persist(txn: Txn) -> None:
                if then is not None:
                    then(txn)
                inode = txn.get_inode(of.ino)
                if inode is None:
                    return
                inode.size, inode.mtime_ns, inode.ctime_ns = size, mtime, ctime
                if inode.nlink > 0:
                    if moved and inode.durable_generation == inode.generation:
                        # The bucket got this generation (e.g. fsync=remote) while the handle
                        # stayed open, and passthrough writes since then bumped nothing.
                        durability.mark_dirty(txn, inode, s.clock())
                    else:
                        durability.mark_written(txn, of.ino, s.clock())
                txn.put_inode(inode)

            try:
                s.meta.write(persist)
            except BaseException:
                with s.lock:
                    of.attrs_dirty = True  # not stored: the next flush or fsync tries again
                    of.cache_moved = of.cache_moved or moved
                raise
            of.needs_bump = True
            return True

    def _release_backing(self, of: OpenFile, st: os.stat_result | None) -> None:
        """Passthrough: the inode's last handle is gone (``st``: its cache file's ``fstat``,
        taken as the last reference went)."""
        s = self._state
        s.backing.detach(of)
        if of.opened_for_write:
            with s.lock:
                # A store through a shared mapping after ``st`` was taken moves the file
                # away from the baseline kept here: the watch below finds it.
                moved = datapath.refresh(of, st) or of.attrs_dirty
            if moved:  # changed with no writable handle open: through a shared mapping
                self._bump(of)
                self.persist(of)
            # A shared mapping can outlive this release: keep comparing for a while.
            s.backing.watch(of.ino, s.data_path(of.ino), of.cache_stat)

    def persist_writers(self) -> int:
        """Passthrough: store the size and times of every file open for writing (before a
        directory fsync). A passthrough close(2) sends no FLUSH, and its RELEASE, which stores
        them, may still be on its way when the fsync comes. Returns how many files."""
        s = self._state
        if s.backing is None:
            return 0
        with s.lock:
            pinned = [of for of in s.open_files.values() if of.writers > 0]
            for of in pinned:
                of.refs += 1  # (a RELEASE in another thread would close its fd)
        try:
            for of in pinned:
                self.persist(of)
        finally:
            for of in pinned:
                self._unref(of, writable=False)
        return len(pinned)

    @contextlib.contextmanager
    def pinned_or_claimed(self, ino: int):
        """The inode's open file, or None, for a change made outside the state lock
        (setattr). The open file is pinned: its last handle's release, in another thread,
        would close its fd (and the number could name another cache file by then). With no
        open file the inode is claimed (``CoreState.claim``): no first open reads it, or
        writes, until the block ends, and an evictor leaves it alone."""
        s = self._state
        with s.lock:
            of = s.claim_if_closed(ino)
            if of is not None:
                of.refs += 1
        try:
            yield of
        finally:
            if of is not None:
                self._unref(of, writable=False)
            else:
                s.end_claims([ino])

    def truncate_data(self, ino: int, size: int, of: OpenFile | None) -> None:
        """Cut the cache file; ``of`` as :meth:`pinned_or_claimed` gave it (held until done)."""
        if of is not None:
            os.ftruncate(of.fd, size)
            return
        fd = self._state.open_cache_file(ino)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def flush(self, fh: int) -> None:
        h = self.handle(fh)
        if h.open_file is not None and h.writable:
            self.persist(h.open_file)
            self._raise_space_failure(h.open_file)
        if h.open_file is not None and h.open_file.remote is not None:
            self._state.fetcher.wait_checked(h.open_file.remote)  # close reports a failed blake3 check

    @staticmethod
    def _raise_space_failure(of: OpenFile) -> None:
        """A write of this file was refused for space: close and fsync say so too (with the
        kernel's writeback cache the write(2) itself may have returned long before)."""
        if of.space_failed_at is not None:
            raise FsError(errno.ENOSPC, "a write was refused: no cache space")

    def fsync(self, fh: int, datasync: bool) -> None:
        h = self.handle(fh)
        of = h.open_file
        (os.fdatasync if datasync else os.fsync)(of.fd)
        # The cache file's own name must survive a power cut too, whichever handle
        # (or truncate) created it.
        self._state.sync_cache_names(of.ino)
        self.persist(of)
        self._state.meta.sync()
        self._raise_space_failure(of)

    def release(self, fh: int) -> None:
        """Drop the handle. Whatever fails on the way, the writer count in fsmeta and the
        open-file reference go too (else the file never drains); the error is reported after."""
        s = self._state
        with s.lock:
            h = s.handles.pop(fh, None)
        if h is None:
            raise FsError(errno.EBADF)
        of = h.open_file
        of.last_fstat = None
        try:
            if h.writable:
                def drop_writer(txn: Txn) -> None:
                    txn.add_writer(of.ino, -1)

                stored = False
                try:
                    # one transaction for both (one fewer per create+write+close)
                    stored = self.persist(of, then=drop_writer)
                finally:
                    if not stored:
                        s.meta.write(drop_writer)
        finally:
            # Passthrough: the fstat the persist just took serves the last handle's space
            # count and baseline too (one fstat per close, not two).
            self._unref(of, h.writable, st=of.last_fstat)

    def _unref(self, of: OpenFile, writable: bool, st: os.stat_result | None = None) -> None:
        """Drop a handle's (or a pin's) reference; the last one closes the open file. ``st``:
        the cache file's ``fstat``, if the caller took one just now."""
        s = self._state
        with s.lock:
            of.refs -= 1
            if writable:
                of.writers -= 1
            last = of.refs == 0
            if last:
                if st is None and (s.space is not None or s.backing is not None):
                    st = os.fstat(of.fd)  # (one fstat for the space count and the baseline)
                if s.space is not None:
                    # Before it leaves the table: once out, the evictor may remove it (and its
                    # allocation), which this must not put back.
                    s.space.note_closed(of.ino, st.st_blocks * 512)
                del s.open_files[of.ino]
                # Its release stored the size: an open that read the inode before must read it
                # again, or, finding no open file, it would take that old size for the cache
                # file's (with no FLUSH at a passthrough close(2), the very next open can).
                s.claim_seq += 1
        if last:
            if s.backing is not None:
                self._release_backing(of, st)
            if of.remote is not None:
                # The next open takes the native path if the fetch completed: wait for the
                # cached-clean commit (close(2) does not wait for RELEASE).
                with contextlib.suppress(FsError):  # reported to the reader already
                    s.fetcher.wait_checked(of.remote, commit=True)
                s.fetcher.release(of.remote)
            os.close(of.fd)
            self._lookups.maybe_purge(of.ino)
            s.bound_unsynced_names()

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
from .spares import rename_recycled

if TYPE_CHECKING:
    from .bucket import BucketClient
    from .datapath import Backing
    from .fetch import Fetcher
    from .files import Handle, OpenFile
    from .space import CacheSpace
    from .spares import Spare, Spares

# Files created and closed without fsync pile up in CoreState.unsynced_cache_names;
# past this many, closing a file syncs data/ once for all of them.
UNSYNCED_NAMES_MAX = 4096


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
    # Inodes whose cache file was created since data/ was last fsynced: an fsync of
    # the file must also make its name in data/ durable.
    unsynced_cache_names: set[int] = field(default_factory=set)
    backing: Backing | None = None  # passthrough mode (gateway/datapath.py); None: writeback
    bucket: BucketClient | None = None  # the read path's way to the bucket (gateway/bucket.py)
    fetcher: Fetcher | None = None  # fetches REMOTE files into the cache (gateway/fetch.py); needs bucket
    space: CacheSpace | None = None  # the cache cap, eviction, backpressure (gateway/space.py)
    spares: Spares | None = None  # empty cache files made ahead of creates (gateway/spares.py)
    # Inodes with no open file whose cache file and attributes a thread is changing: the
    # evictor removing it, a setattr (truncate) without a handle. Their first open (and
    # another claim) waits on ``claims_done``, then reads the inode again.
    claimed: set[int] = field(default_factory=set)
    # Moves when a claim is taken and when it ends, and at the last close of an open file
    # (under ``lock``): an open that read the inode before any of these reads it again
    # (``OpenFiles.open_handle``).
    claim_seq: int = 0

    def __post_init__(self) -> None:
        self.claims_done = threading.Condition(self.lock)

    def wait_unclaimed(self, ino: int) -> bool:
        """Block while another thread holds ``ino`` claimed; True if it had to wait.
        Call with ``lock`` held."""
        waited = False
        while ino in self.claimed:
            waited = True
            self.claims_done.wait()
        return waited

    def claim_if_closed(self, ino: int) -> OpenFile | None:
        """Claim ``ino`` (after any other claim of it ends) if it has no open file; else its
        open file, unclaimed. Call with ``lock`` held; end a claim with :meth:`end_claims`."""
        while True:
            of = self.open_files.get(ino)
            if of is not None:
                return of
            if not self.wait_unclaimed(ino):  # (an open may have come meanwhile: look again)
                self.claim(ino)
                return None

    def claim(self, ino: int) -> None:
        """Claim an inode that has no open file and no claim. Call with ``lock`` held; end it
        with :meth:`end_claims`."""
        self.claimed.add(ino)
        self.claim_seq += 1

    def end_claims(self, inos) -> None:
        with self.lock:
            self.claimed.difference_update(inos)
            self.claim_seq += 1  # an open that read the inode during the claim must read it again
            self.claims_done.notify_all()

    def data_path(self, ino: int) -> str:
        return self.cache.data_path(ino)

    def open_cache_file(self, ino: int, *, create: bool = True) -> int:
        """An O_RDWR fd on the inode's cache file, created if missing (and ``create``).

        O_NOFOLLOW: a symlink planted in data/ must not redirect a user's bytes elsewhere.
        """
        path = self.data_path(ino)
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            if not create:
                raise
        fd = os.open(path, flags | os.O_CREAT, 0o600)
        with self.lock:
            self.unsynced_cache_names.add(ino)
        return fd

    def create_cache_file(self, ino: int, spare: Spare | None = None) -> int:
        """An O_RDWR fd on a new, empty cache file for a new inode: the spare file the create
        took for it (gateway/spares.py), or else one made now.

        A power cut can lose the commit that handed out this inode number while its cache
        file survived: a new file must never show such leftover bytes, so a file already
        there is removed first (O_EXCL: one syscall when there is none, the usual case).
        """
        fd = -1
        if spare is not None and spare.ino == ino and spare.fd >= 0:
            fd = spare.take_fd()
        elif spare is not None and spare.path is not None:  # recycled, not named yet
            recycled, spare.path = spare.path, None
            fd = rename_recycled(recycled, self.data_path(ino))
        if fd < 0:
            path = self.data_path(ino)
            flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL
            try:
                fd = os.open(path, flags, 0o600)
            except FileExistsError:
                self.remove_data(ino)
                fd = os.open(path, flags, 0o600)
        with self.lock:
            self.unsynced_cache_names.add(ino)
        return fd

    def sync_cache_names(self, ino: int) -> None:
        """fsync data/ if the inode's cache file may have a name not yet on the device."""
        with self.lock:
            if ino not in self.unsynced_cache_names:
                return
        self._sync_unsynced_names()

    def bound_unsynced_names(self) -> None:
        """Keep the set of unsynced names small: sync data/ once it holds too many."""
        with self.lock:
            if len(self.unsynced_cache_names) < UNSYNCED_NAMES_MAX:
                return
        self._sync_unsynced_names()

    def _sync_unsynced_names(self) -> None:
        with self.lock:
            covered = set(self.unsynced_cache_names)
        self.sync_data_dir()
        with self.lock:
            self.unsynced_cache_names -= covered  # every name created before the fsync

    def sync_data_dir(self) -> None:
        dir_fd = os.open(self.cache.data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def publish_before_bytes_change(self, ino: int) -> None:
        """Commit now if the drain can see the inode: a generation bump (in the batch of
        deferred commits) must reach the drain before the bytes change. An inode created
        in the batch needs nothing: the drain sees it only together with the bump."""
        if not self.meta.deferring:
            return
        with self.meta.read_committed() as txn:
            visible = txn.get_inode(ino) is not None
        if visible:
            self.meta.commit()

    def remove_data_after_commit(self, ino: int) -> None:
        """Remove the cache file once the removal of its inode is committed: a crash before
        that commit brings the inode back, and it must come back with its bytes."""
        self.meta.after_commit(lambda: self.remove_data(ino))

    def remove_data(self, ino: int) -> None:
        if self.fetcher is not None:
            self.fetcher.discard(ino)
        with self.lock:
            self.unsynced_cache_names.discard(ino)
        path = self.data_path(ino)
        if self.spares is not None and self.spares.recycle(path):
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def in_use(self, ino: int) -> bool:
        """The kernel still references the inode, or a handle keeps it open."""
        with self.lock:
            return bool(self.lookups.get(ino)) or ino in self.open_files


class EvictedMeanwhile(Exception):
    """The inode was (maybe) evicted between reading it and opening it: read it again."""


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

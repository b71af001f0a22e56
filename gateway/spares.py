"""Empty cache files made ahead of time, so that a create allocates no inode while the caller waits.

Allocating an inode can be the dearest part of a create: on this machine's ext4 (no journal)
it skips every inode freed in the last half minute by reading their inode-table blocks, about
600 µs of system time per create after a run of deletes (docs/DESIGN.md, "Metadata operation
performance"). A background thread keeps up to ``target`` empty files in ``CACHE/spare/``,
each with an open O_RDWR descriptor; a create renames one into ``data/<ino>`` (a rename
allocates nothing) and uses its descriptor. The allocation still happens, but on the other
core, between requests. The thread is woken only once fewer than half of ``target`` are left,
and then tops the pool up in one go.

The cache files of removed inodes are recycled instead of being unlinked, up to
:data:`RECYCLED_MAX` of them: after a checkpoint's files are deleted, the next checkpoint's
creates reuse their inodes, and neither side allocates or frees one (freeing is not free
either: each freed inode is one more that the next allocations skip). In two steps:

1. :meth:`Spares.recycle` (whoever removes the cache file) renames it into ``spare/``, bytes
   and all, exactly where it would have unlinked it: for a crash, a name gone from ``data/``.
2. The thread empties it later, once fsmeta's removal of its inode is on the device (one
   ``MetaStore.sync`` for a batch of them, at most every :data:`EMPTY_EVERY_SECONDS`), so a
   power cut can never bring back an inode whose cache file is already empty.

Both steps, and a create taking a recycled file, first take a write lease, which the kernel
grants only while no other descriptor has the file open: a reader of the removed file (the
drain uploading it, ``ckptfs verify`` hashing it) keeps its bytes, and such a file is unlinked
instead. An open that comes while a lease is held waits for it, and then holds a file that is
removed from the pool at the next step.

A spare is nobody's file until it is renamed into ``data/``: a crash leaves spares behind (a
power cut even perhaps a spare also named in ``data/``), so the gateway removes every leftover
in ``spare/`` at start, before the thread makes new ones.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

log = logging.getLogger("ckptfs.gateway")

SPARES_TARGET = 64  # kept ready: a burst of creates longer than this allocates as it goes
RECYCLED_MAX = 4096  # cache files of removed inodes kept for creates (names, no descriptor)
EMPTY_EVERY_SECONDS = 0.5  # recycled files are emptied in batches, one fsmeta sync each
# Only small files are recycled: what matters is the inode, and until it is emptied a recycled
# file still holds its blocks, which an unlink (the evictor's above all) frees at once.
RECYCLE_MAX_BYTES = 1 << 20  # allocated bytes of a file recycled (bigger ones are unlinked)
WAITING_MAX_BYTES = 64 << 20  # allocated bytes of all the recycled files not emptied yet
RETRY_SECONDS = 5.0  # after a failed create of a spare (ENOSPC, EMFILE): wait, then try again

_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL


class Spares:
    def __init__(self, spare_dir: str, target: int = SPARES_TARGET, recycled_max: int = RECYCLED_MAX,
                 sync_removals: Callable[[], None] | None = None):
        self._dir = spare_dir
        self._target = target
        self._low_water = max(1, target // 2)  # a take that leaves fewer wakes the thread
        self._recycled_max = recycled_max
        # makes every removal committed so far durable (MetaStore.sync); None: no recycling
        self._sync_removals = sync_removals
        # (fd, path); fd -1: a recycled file, opened by whoever takes it
        self._pool: collections.deque[tuple[int, str]] = collections.deque()
        self._to_empty: list[str] = []  # recycled, bytes still there (step 2 to come)
        self._to_empty_bytes = 0
        self._emptied_at = 0.0
        self._cond = threading.Condition()
        self._stopping = False
        self._names = itertools.count()
        self._thread: threading.Thread | None = None
        self.made = 0  # spares made so far (tests, logs)
        self.taken = 0
        self.recycled = 0  # cache files of removed inodes taken in (step 1)
        self.emptied = 0  # ... and offered to creates (step 2)

    def start(self) -> "Spares":
        """Remove what an earlier run left in ``spare/`` and start making spares."""
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        removed = 0
        with os.scandir(self._dir) as entries:
            for entry in entries:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        if removed:
            log.info("cache directory: removed %d spare file(s) of an earlier run", removed)
        self._thread = threading.Thread(target=self._fill, name="ckptfs-spares", daemon=True)
        self._thread.start()
        return self

    def take(self) -> tuple[int, str] | None:
        """An empty spare ``(fd, path)`` for the caller to rename and keep (fd -1: the caller
        opens it after the rename), or None (none ready: the caller creates its file itself)."""
        with self._cond:
            if not self._pool:
                self._cond.notify()
                return None
            spare = self._pool.popleft()
            self.taken += 1
            if len(self._pool) < self._low_water:
                # Woken only here, the thread tops the pool up in one go. Waking it at every
                # take would cost each create a thread switch on the other CPU, and the GIL
                # for the thread's own turn (docs/DESIGN.md, "Round 9").
                self._cond.notify()
            return spare

    def recycle(self, path: str) -> bool:
        """Take the cache file at ``path`` (of an inode whose removal is committed) for a later
        create instead of unlinking it. False: the pool is full or stopping, or someone else
        has the file open (the caller unlinks it as before)."""
        if self._sync_removals is None:
            return False
        with self._cond:
            if self._stopping or len(self._pool) + len(self._to_empty) >= self._recycled_max:
                return False
        spare_path = os.path.join(self._dir, f"r{next(self._names):x}")
        try:
            # O_NOFOLLOW, and a regular file only: whatever else sits in data/ is unlinked
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            allocated = st.st_blocks * 512
            if not stat.S_ISREG(st.st_mode) or allocated > RECYCLE_MAX_BYTES:
                return False
            with self._cond:
                if self._to_empty_bytes + allocated > WAITING_MAX_BYTES:
                    return False
            # held over the rename: an open that comes meanwhile waits, then finds it intact
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # EAGAIN: someone else has it open
            os.rename(path, spare_path)
        except OSError:
            return False
        finally:
            os.close(fd)  # (and with it the lease)
        with self._cond:
            if not self._stopping:
                self._to_empty_bytes += allocated
                self._to_empty.append(spare_path)
                self.recycled += 1
                if len(self._to_empty) == 1:
                    # the thread's next wake-up does not depend on how many more there are:
                    # waking it for each would cost a thread switch per removed file
                    self._cond.notify()
                return True
        os.unlink(spare_path)  # closed meanwhile: nobody would take it
        return True

    @staticmethod
    def opened_by_nobody_else(fd: int) -> bool:
        """No other descriptor has the file open (a write lease is granted, and given back).
        A recycled spare is checked again when taken: a reader whose open waited for the
        recycling's lease holds the emptied file, and must not see the next file's bytes."""
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            return False
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True

    def _fill(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    wait = self._empty_due()
                    if wait == 0.0 or len(self._pool) < self._target:
                        break
                    self._cond.wait(wait)
            if wait == 0.0:
                self._empty_recycled()
            else:
                self._make_one()

    def _empty_due(self) -> float | None:
        """Seconds until recycled files are due to be emptied (0: now), None if there are none.
        Call with ``_cond``."""
        if not self._to_empty:
            return None
        return max(0.0, self._emptied_at + EMPTY_EVERY_SECONDS - time.monotonic())

    def _empty_recycled(self) -> None:
        """Step 2: once their inodes' removal is on the device, empty the recycled files and
        offer them to creates."""
        with self._cond:
            batch, self._to_empty = self._to_empty, []
            self._to_empty_bytes = 0
            self._emptied_at = time.monotonic()
        try:
            self._sync_removals()
        except Exception:  # noqa: BLE001 - fsmeta's own error; the files are only not reused
            log.exception("cache directory: cannot sync fsmeta; recycled cache files are removed instead")
            for path in batch:
                _unlink_quietly(path)
            return
        ready = []
        for path in batch:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if self.opened_by_nobody_else(fd):
                    os.ftruncate(fd, 0)
                    ready.append(path)
                    continue
            except OSError:
                pass
            finally:
                os.close(fd)
            _unlink_quietly(path)  # still read by someone (or could not be emptied)
        with self._cond:
            if self._stopping:
                leftover = ready
            else:
                self._pool.extend((-1, path) for path in ready)
                self.emptied += len(ready)
                leftover = []
        for path in leftover:
            _unlink_quietly(path)

    def _make_one(self) -> None:
        path = os.path.join(self._dir, f"{next(self._names):x}")
        try:
            fd = os.open(path, _FLAGS, 0o600)
        except OSError as exc:
            log.warning("cache directory: cannot make a spare file (%s); creates make their own", exc)
            with self._cond:
                self._cond.wait(RETRY_SECONDS)
            return
        with self._cond:
            if not self._stopping:
                self._pool.append((fd, path))
                self.made += 1
                return
        os.close(fd)
        os.unlink(path)

    def close(self) -> None:
        """Stop making spares and remove the ones left."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(10)
        with self._cond:
            pool, self._pool = list(self._pool), collections.deque()
            pool += [(-1, path) for path in self._to_empty]
            self._to_empty = []
        for fd, path in pool:
            if fd >= 0:
                os.close(fd)
            _unlink_quietly(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

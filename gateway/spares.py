"""Empty cache files made ahead of time, already at the name of the inode a create will give them.

Allocating an inode can be the dearest part of a create: on this machine's ext4 (no journal)
it skips every inode freed in the last half minute by reading their inode-table blocks, about
600 µs of system time per create after a run of deletes (docs/DESIGN.md, "Metadata operation
performance"). A background thread keeps up to ``target`` empty files ready for creates,
each with an open O_RDWR descriptor, and each already named ``data/<ino>`` for an inode
number it reserved in fsmeta (``reserve``: one transaction for a run of numbers). A create
takes one and makes its inode with that number: it does no system call on the cache
directory while its caller waits. The allocation, the rename and the checks all happen on
the other core, between requests. The thread is woken only once fewer than half of
``target`` are left, and then tops the pool up in one go.

A reserved number is used once or never: an inode number is never handed out twice, and a
spare nobody took is removed at close. A crash leaves the unused ones as empty
``data/<ino>`` files no inode owns, which the next start removes as stray cache files
(gateway/recovery.py) before any spare is made. While a gateway runs, fsmeta's
``spare_inos`` says which numbers its spares may hold, so that ``ckptfs fsck`` does not
take them for orphans.

The cache files of removed inodes are recycled instead of being unlinked, up to
:data:`RECYCLED_MAX` of them: after a checkpoint's files are deleted, the next checkpoint's
creates reuse their inodes, and neither side allocates or frees one (freeing is not free
either: each freed inode is one more that the next allocations skip). In three steps:

1. :meth:`Spares.recycle` (whoever removes the cache file) renames it into ``spare/``, bytes
   and all, exactly where it would have unlinked it: for a crash, a name gone from ``data/``.
2. The thread empties it later, once fsmeta's removal of its inode is on the device (one
   ``MetaStore.sync`` for a batch of them, at most every :data:`EMPTY_EVERY_SECONDS`), so a
   power cut can never bring back an inode whose cache file is already empty.
3. The thread renames it to the ``data/<ino>`` of a reserved number and opens it there, as
   it does with a new spare.

Steps 1 and 2, and the open in step 3, first take a write lease, which the kernel grants
only while no other descriptor has the file open: a reader of the removed file (the drain
uploading it, ``ckptfs verify`` hashing it) keeps its bytes, and such a file is unlinked
instead. An open that comes while a lease is held waits for it, and then holds a file that
is removed from the pool at the next step. The kernel announces such an open to the lease
holder with SIGIO, which would end the process: the pool ignores SIGIO (process-wide, set
from the main thread at :meth:`Spares.start`), or else recycles nothing.

A spare in ``spare/`` is nobody's file: a crash leaves spares behind (a power cut even
perhaps a spare also named in ``data/``), so the gateway removes every leftover in
``spare/`` at start, before the thread makes new ones.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import logging
import os
import signal
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
PLACE_BATCH = 256  # spares named per reservation of inode numbers (one fsmeta write)
RETRY_SECONDS = 5.0  # after a failed create of a spare (ENOSPC, EMFILE): wait, then try again

_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL


class Spare:
    """A spare a create took: the inode number it is named for and its descriptor; or, when
    none was named yet, a recycled file in ``spare/`` (``path``) for the create to rename to
    its inode's name itself (:meth:`CoreState.create_cache_file`)."""

    __slots__ = ("ino", "fd", "path")

    def __init__(self, ino: int | None, fd: int, path: str | None = None):
        self.ino = ino
        self.fd = fd
        self.path = path

    def take_fd(self) -> int:
        """The descriptor, now the caller's to close."""
        fd, self.fd = self.fd, -1
        return fd

    def discard(self) -> None:
        """Close the descriptor unless it was taken (the file stays: its inode's now)."""
        if self.fd >= 0:
            os.close(self.take_fd())
        if self.path is not None:
            _unlink_quietly(self.path)  # a recycled file nobody took (unlinked, not renamed)
            self.path = None


class Spares:
    def __init__(self, spare_dir: str, data_path: Callable[[int], str],
                 reserve: Callable[[int, int | None], int], target: int = SPARES_TARGET,
                 recycled_max: int = RECYCLED_MAX, sync_removals: Callable[[], None] | None = None,
                 make_new: bool = True):
        """``reserve(n, oldest)``: reserve ``n`` inode numbers in fsmeta and return the first;
        ``oldest`` is the lowest number a spare still holds (None: none), for ``spare_inos``.
        ``make_new``: make new files when no recycled one is ready (False: recycle only)."""
        self._dir = spare_dir
        self._data_path = data_path
        self._reserve = reserve
        self._target = target
        self._low_water = max(1, target // 2)  # a take that leaves fewer wakes the thread
        self._recycled_max = recycled_max
        self._make_new = make_new
        # makes every removal committed so far durable (MetaStore.sync); None: no recycling
        self._sync_removals = sync_removals
        self._placed: collections.deque[tuple[int, int]] = collections.deque()  # (ino, fd) at data/<ino>
        self._ready: collections.deque[str] = collections.deque()  # recycled and emptied, in spare/
        self._to_empty: list[str] = []  # recycled, bytes still there (step 2 to come)
        self._to_empty_bytes = 0
        self._emptied_at = 0.0
        self._cond = threading.Condition()
        self._stopping = False
        self._names = itertools.count()
        self._thread: threading.Thread | None = None
        self.made = 0  # new files made so far (tests, logs)
        self.placed = 0  # spares named for a reserved inode, new or recycled
        self.taken = 0
        self.recycled = 0  # cache files of removed inodes taken in (step 1)
        self.emptied = 0  # ... and emptied (step 2)

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
        if self._sync_removals is not None and not _lease_breaks_ignored():
            log.warning("cache directory: lease breaks cannot be ignored outside the main thread; "
                        "cache files of removed inodes are unlinked, not recycled")
            self._sync_removals = None
        self._thread = threading.Thread(target=self._fill, name="ckptfs-spares", daemon=True)
        self._thread.start()
        return self

    def take(self) -> Spare | None:
        """A spare for a create to make its inode with, or None (none ready: the create makes
        its file itself). Give it back with :meth:`give_back` if no inode was made."""
        with self._cond:
            if self._placed:
                ino, fd = self._placed.popleft()
                spare = Spare(ino, fd)
            elif self._ready:  # the thread has not named it yet: the create renames it
                spare = Spare(None, -1, self._ready.popleft())
            else:
                self._cond.notify()
                return None
            self.taken += 1
            if len(self._placed) < self._low_water:
                # Woken only here, the thread tops the pool up in one go. Waking it at every
                # take would cost each create a thread switch on the other CPU, and the GIL
                # for the thread's own turn (docs/DESIGN.md, "Round 9").
                self._cond.notify()
            return spare

    def give_back(self, spare: Spare) -> None:
        """A spare whose create failed before its inode was made: the next create takes it."""
        with self._cond:
            if not self._stopping:
                if spare.path is not None:
                    self._ready.appendleft(spare.path)
                    spare.path = None
                elif spare.fd >= 0:
                    self._placed.appendleft((spare.ino, spare.take_fd()))
                self.taken -= 1
                return
        if spare.ino is not None and spare.fd >= 0:
            _unlink_quietly(self._data_path(spare.ino))
        spare.discard()

    def recycle(self, path: str) -> bool:
        """Take the cache file at ``path`` (of an inode whose removal is committed) for a later
        create instead of unlinking it. False: the pool is full or stopping, or someone else
        has the file open (the caller unlinks it as before)."""
        if self._sync_removals is None:
            return False
        with self._cond:
            kept = len(self._placed) + len(self._ready) + len(self._to_empty)
            if self._stopping or kept >= self._recycled_max:
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

    def _fill(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    wait = self._empty_due()
                    wanted = self._wanted()
                    if wait == 0.0 or wanted:
                        break
                    self._cond.wait(wait)
                oldest = self._placed[0][0] if self._placed else None
            if wait == 0.0:
                self._empty_recycled()
            else:
                self._place(wanted, oldest)

    def _wanted(self) -> int:
        """How many spares to name now: every recycled file ready (so that a burst of creates
        after a burst of removals finds them all named), and new ones up to ``target``. Call
        with ``_cond``."""
        if self._target <= 0:
            return 0
        new = max(0, self._target - len(self._placed) - len(self._ready)) if self._make_new else 0
        return min(PLACE_BATCH, len(self._ready) + new)

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
                if opened_by_nobody_else(fd):
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
                self._ready.extend(ready)
                self.emptied += len(ready)
                leftover = []
        for path in leftover:
            _unlink_quietly(path)

    def _place(self, n: int, oldest: int | None) -> None:
        """Step 3, and new spares: reserve ``n`` inode numbers and name a spare for each."""
        try:
            first = self._reserve(n, oldest)
        except Exception as exc:  # noqa: BLE001 - fsmeta's own error; creates make their files
            log.warning("cache directory: cannot reserve inode numbers for spare files (%s)", exc)
            with self._cond:
                self._cond.wait(RETRY_SECONDS)
            return
        for ino in range(first, first + n):
            fd = self._named_for(ino)
            if fd is None:
                return  # (the numbers left are never used: no number is handed out twice)
            with self._cond:
                if not self._stopping:
                    self._placed.append((ino, fd))
                    self.placed += 1
                    continue
            os.close(fd)
            _unlink_quietly(self._data_path(ino))
            return

    def _named_for(self, ino: int) -> int | None:
        """An empty file at ``data/<ino>`` and its O_RDWR descriptor: a recycled one if one is
        ready, else a new one (if ``make_new``); None if neither could be had."""
        path = self._data_path(ino)
        while True:
            with self._cond:
                recycled = self._ready.popleft() if self._ready else None
            if recycled is None:
                break
            fd = rename_recycled(recycled, path)
            if fd >= 0:
                return fd
        if not self._make_new:
            return None
        for _ in range(2):
            try:
                fd = os.open(path, _FLAGS, 0o600)
            except FileExistsError:
                # A power cut lost the reservation of this number while its file survived
                # (a new file must never show a leftover's bytes).
                _unlink_quietly(path)
                continue
            except OSError as exc:
                log.warning("cache directory: cannot make a spare file (%s); creates make their own", exc)
                with self._cond:
                    self._cond.wait(RETRY_SECONDS)
                return None
            with self._cond:
                self.made += 1
            return fd
        return None

    def close(self) -> None:
        """Stop making spares and remove the ones left."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(10)
        with self._cond:
            placed, self._placed = list(self._placed), collections.deque()
            paths = list(self._ready) + self._to_empty
            self._ready, self._to_empty = collections.deque(), []
        for ino, fd in placed:
            os.close(fd)
            _unlink_quietly(self._data_path(ino))
        for path in paths:
            _unlink_quietly(path)


def _lease_breaks_ignored() -> bool:
    """Make sure a lease break cannot end the process; False if that cannot be done here.

    When another process opens a file this one holds a lease on, the kernel tells the holder
    with a signal, SIGIO unless F_SETSIG chose another, and SIGIO's default action ends the
    process without a trace: no log line, no kernel message, the mount gone. The drain opens
    cache files to upload them, so now and then it opens one while a lease is held (the
    churn hunt's silent gateway deaths, docs/DESIGN.md). Nothing here waits for the signal:
    the lease is given back within microseconds, and the opener's open(2) waits until then.
    Ignoring it is process-wide (the drain the gateway starts inherits it, and uses no SIGIO);
    only the main thread may change it."""
    if signal.getsignal(signal.SIGIO) == signal.SIG_IGN:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGIO, signal.SIG_IGN)
    return True


def rename_recycled(recycled: str, path: str) -> int:
    """Step 3 for one file: the emptied recycled file renamed to ``path`` (which replaces a
    leftover there, as a new file must) and opened O_RDWR, if no other descriptor has it
    open; -1 if it cannot be used (it is unlinked then)."""
    try:
        os.rename(recycled, path)
    except OSError:
        _unlink_quietly(recycled)
        return -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        _unlink_quietly(path)
        return -1
    if opened_by_nobody_else(fd):
        return fd
    os.close(fd)
    _unlink_quietly(path)
    return -1


def opened_by_nobody_else(fd: int) -> bool:
    """No other descriptor has the file open (a write lease is granted, and given back).
    A recycled file is checked again when it is named for an inode: a reader whose open
    waited for the recycling's lease holds the emptied file, and must not see the next
    file's bytes."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

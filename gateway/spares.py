"""Empty cache files made ahead of time, so that a create allocates no inode while the caller waits.

Allocating an inode can be the dearest part of a create: on this machine's ext4 (no journal)
it skips every inode freed in the last half minute by reading their inode-table blocks, about
600 µs of system time per create after a run of deletes (docs/DESIGN.md, "Metadata operation
performance"). A background thread keeps up to ``target`` empty files in ``CACHE/spare/``,
each with an open O_RDWR descriptor; a create renames one into ``data/<ino>`` (a rename
allocates nothing) and uses its descriptor. The allocation still happens, but on the other
core, between requests.

A spare is nobody's file until it is renamed: a crash leaves spares behind (a power cut even
perhaps a spare also named in ``data/``), so the gateway removes every leftover in
``spare/`` at start, before the thread makes new ones.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading

log = logging.getLogger("ckptfs.gateway")

SPARES_TARGET = 64  # kept ready: a burst of creates longer than this allocates as it goes
RETRY_SECONDS = 5.0  # after a failed create of a spare (ENOSPC, EMFILE): wait, then try again

_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL


class Spares:
    def __init__(self, spare_dir: str, target: int = SPARES_TARGET):
        self._dir = spare_dir
        self._target = target
        self._pool: collections.deque[tuple[int, str]] = collections.deque()  # (fd, path)
        self._cond = threading.Condition()
        self._stopping = False
        self._names = itertools.count()
        self._thread: threading.Thread | None = None
        self.made = 0  # spares made so far (tests, logs)
        self.taken = 0

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
        """An empty spare ``(fd, path)`` for the caller to rename and keep, or None (none
        ready: the caller creates its file itself)."""
        with self._cond:
            if not self._pool:
                self._cond.notify()
                return None
            spare = self._pool.popleft()
            self.taken += 1
            self._cond.notify()  # the thread tops the pool up
            return spare

    def _fill(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and len(self._pool) >= self._target:
                    self._cond.wait()
                if self._stopping:
                    return
            path = os.path.join(self._dir, f"{next(self._names):x}")
            try:
                fd = os.open(path, _FLAGS, 0o600)
            except OSError as exc:
                log.warning("cache directory: cannot make a spare file (%s); creates make their own", exc)
                with self._cond:
                    self._cond.wait(RETRY_SECONDS)
                continue
            with self._cond:
                if self._stopping:
                    os.close(fd)
                    os.unlink(path)
                    return
                self._pool.append((fd, path))
                self.made += 1

    def close(self) -> None:
        """Stop making spares and remove the ones left."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            pool, self._pool = list(self._pool), collections.deque()
        if self._thread is not None:
            self._thread.join(10)
        for fd, path in pool:
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

"""Process locks of a cache directory: who owns it right now.

The gateway lock is held by the one gateway serving the cache directory, the
drain lock by the one drain working on it (their paths: :mod:`ckptfs.fsmeta.layout`).
Both are ``flock`` locks, so they vanish with the process, whatever killed it;
the file holds the pid for messages.
"""

from __future__ import annotations

import fcntl
import os


class LockHeld(Exception):
    def __init__(self, path: str, holder: str):
        super().__init__(f"{path} is held by pid {holder}")
        self.holder = holder


def acquire(path: str, *, wait: bool = False) -> int:
    """Take the lock file at ``path``; return its fd (keep it open). Raises LockHeld unless ``wait``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LockHeld(path, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def holder(path: str) -> int | None:
    """Pid holding the lock file at ``path`` (-1 if unreadable), or None if nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)

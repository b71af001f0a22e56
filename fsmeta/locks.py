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
    """Pid holding the lock file at ``path``, or None if nobody holds it.

    Read from ``/proc/locks`` rather than by trying the lock: a probe that takes
    the lock, however briefly, makes a concurrent :func:`acquire` fail and name
    a pid that may be long dead (a remount right after a crash).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as locks:
        for line in locks:
            # "7: FLOCK  ADVISORY  WRITE 30988 fe:00:2171365 0 EOF"; waiters read "7: -> FLOCK ..."
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == ident:
                return int(fields[4])
    return None

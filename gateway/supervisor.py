"""The gateway's side of the drain: start and watch the drain process, ``--fsync=remote``.

The drain runs as its own process on the same fsmeta environment (both cores
busy; a FUSE crash does not stop uploads of fsynced data). It is started in
the gateway's process group, so ``kill -9`` of the group is a crash of both,
and restarted with a back-off if it dies on its own.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import time

import trio

from ckptfs.drain.upload import Backoff
from ckptfs.fsmeta import durability
from ckptfs.fsmeta.settings import Settings

from .errors import FsError

log = logging.getLogger("ckptfs.supervisor")

# 1 s, 2 s, 4 s ... a minute: a drain that keeps crashing does not spin.
RESTART_BACKOFF = Backoff(1.0, 60.0)


class DrainSupervisor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self._stopping = False
        self.restarts = 0

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptfs", "drain", "--cache-dir", self.settings.cache_dir, "--supervised"],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        log.info("drain started (pid %d)", self.proc.pid)

    def start(self) -> None:
        self._spawn()

    async def watch(self) -> None:
        """Restart the drain if it exits while the mount is up."""
        while not self._stopping:
            await trio.sleep(1.0)
            if self.proc is not None and self.proc.poll() is not None and not self._stopping:
                delay = RESTART_BACKOFF.delay(self.restarts + 1)
                log.error("drain exited with status %s; restarting in %.0fs", self.proc.returncode, delay)
                await trio.sleep(delay)
                self.restarts += 1
                self._spawn()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the drain to stop (it finishes the request in flight; the rest resumes later)."""
        self._stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def remote_fsync_hook(self, meta):
        """For ``--fsync=remote``: after the local fsync, wait until the drain made it durable."""

        def request_and_check(ino: int, first: bool) -> str | None:
            def mark(txn):
                durability.request_urgent(txn, ino)
                return durability.remote_fsync_state(txn, ino)

            if first:
                state = meta.write(mark)
                meta.commit()  # the drain must see the request now
                return state
            with meta.read() as txn:
                return durability.remote_fsync_state(txn, ino)

        def hook(core, fh: int) -> None:
            # In the front-end thread of the fsync request, which it holds until then.
            ino = core.handle_inode(fh)
            first = True
            while True:
                state = request_and_check(ino, first)
                first = False
                if state == "durable":
                    return
                if state:  # a permanent upload error: fsync=remote cannot succeed
                    log.error("fsync=remote of inode %d failed: %s", ino, state)
                    raise FsError(errno.EIO, f"fsync=remote: {state}")
                time.sleep(0.05)

        return hook

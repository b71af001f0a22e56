"""The gateway's side of the drain: start and watch the drain process, ``--fsync=remote``.

The drain runs as its own process on the same fsmeta environment (both cores
busy; a FUSE crash does not stop uploads of fsynced data). It is started in
the gateway's process group, so ``kill -9`` of the group is a crash of both,
and restarted with a back-off if it dies on its own.

Its stderr comes through a pipe: the gateway copies every line to its own
stderr (the log) and keeps the last ones, so that when the drain exits the
gateway can say why. Several exits in a short time are a crash loop
(:class:`RestartTracker`); the supervisor publishes the drain's health in
``meta/gateway_status`` for ``ckptfs status`` and in the metrics.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ckptfs.drain.upload import Backoff
from ckptfs.fsmeta import durability
from ckptfs.fsmeta.settings import Settings

from . import metrics
from .errors import FsError

log = logging.getLogger("ckptfs.supervisor")

# 1 s, 2 s, 4 s ... a minute: a drain that keeps crashing does not spin.
RESTART_BACKOFF = Backoff(1.0, 60.0)

# How often the supervisor looks at the drain process.
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class CrashLoopPolicy:
    """``exits`` exits within ``window_seconds`` are a crash loop; a drain that then stays up
    ``stable_seconds`` ends it (and starts the back-off again from its first step)."""

    exits: int = 3
    window_seconds: float = 60.0
    stable_seconds: float = 60.0


class RestartTracker:
    """The drain's exits: how long to wait before the next start, and whether they are a crash loop."""

    def __init__(self, policy: CrashLoopPolicy = CrashLoopPolicy(), backoff: Backoff = RESTART_BACKOFF):
        self.policy = policy
        self.backoff = backoff
        self.restarts = 0  # exits the gateway restarted the drain after, since the mount
        self.looping_since_ns: int | None = None  # wall time of the first exit of the loop
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic, wall ns)
        self._short_runs = 0  # consecutive exits without a stable run in between: the back-off step

    @property
    def crash_looping(self) -> bool:
        return self.looping_since_ns is not None

    def exited(self, *, now: float, now_ns: int, ran_seconds: float) -> float:
        """Record an exit after ``ran_seconds`` up; return the seconds to wait before restarting."""
        if ran_seconds >= self.policy.stable_seconds:
            self._short_runs = 0
        self._short_runs += 1
        self.restarts += 1
        self._recent.append((now, now_ns))
        while now - self._recent[0][0] > self.policy.window_seconds:
            self._recent.popleft()
        if not self.crash_looping and len(self._recent) >= self.policy.exits:
            self.looping_since_ns = self._recent[0][1]
        return self.backoff.delay(self._short_runs)

    def running(self, *, ran_seconds: float) -> bool:
        """The drain has been up ``ran_seconds``; True if that just ended a crash loop."""
        if ran_seconds < self.policy.stable_seconds:
            return False
        self._short_runs = 0
        self._recent.clear()
        ended = self.crash_looping
        self.looping_since_ns = None
        return ended

    def recent_exits(self, now: float) -> int:
        return sum(1 for t, _ in self._recent if now - t <= self.policy.window_seconds)


# -- the drain's last words ------------------------------------------------------------------

# Lines that say why a process stopped: the last line of a traceback, the one-line message of
# a command (``ckptfs: ...``), a logged error, a fault in native code.
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Group)\b"
                         r"|ckptfs: |Fatal Python error"
                         r"|\S.* (?:ERROR|CRITICAL) )")
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)\b((?:aws_)?(?:secret_access_key|session_token|secret[_-]?key|password|token)|x-amz-signature|x-amz-credential"
    r"|authorization|signature|credential)(\W{1,3})([^\s,;&\"']+)")
# How an exception group's traceback indents the tracebacks of its members.
_GROUP_MEMBER_PREFIX = re.compile(r"^\s*(?:\|\s*)+")
_URL_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s@]+@", re.I)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECURITY_TOKEN")
MAX_ERROR_CHARS = 500


def redact(line: str, environ=os.environ) -> str:
    """``line`` without credentials: the values of the AWS credential variables, anything
    assigned to a secret-looking name, and the user:password of URLs."""
    for name in _SECRET_ENV:
        value = environ.get(name)
        if value and len(value) >= 4:
            line = line.replace(value, "***")
    line = _SECRET_ASSIGNMENT.sub(lambda m: f"{m[1]}{m[2]}***", line)
    return _URL_USERINFO.sub(r"\1***@", line)


def last_error_line(lines: list[str]) -> str | None:
    """The line of a process's last output that says why it stopped (credentials redacted), or None."""
    for line in reversed(lines):
        line = _GROUP_MEMBER_PREFIX.sub("", line.rstrip())
        if line and _ERROR_LINE.match(line):
            line = redact(line)
            return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 1] + "…"
    return None


class OutputRelay:
    """Copies a child's stderr pipe, line by line, to our stderr (the log) and keeps its last lines."""

    def __init__(self, pipe, sink_fd: int = 2, keep: int = 50):
        self._pipe = pipe
        self._sink_fd = sink_fd
        self._lines: collections.deque[bytes] = collections.deque(maxlen=keep)
        self._thread = threading.Thread(target=self._copy, name="drain-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with self._pipe:
            for line in iter(self._pipe.readline, b""):
                self._lines.append(line)
                try:
                    os.write(self._sink_fd, line)
                except OSError:
                    pass  # a log we cannot write to must not stop the relay (nor the drain)

    def wait_closed(self, timeout: float) -> None:
        """Wait until the child's end of the pipe is closed (it exited) and every line is read."""
        self._thread.join(timeout)

    def last_error(self) -> str | None:
        return last_error_line([line.decode(errors="replace") for line in list(self._lines)])


def describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


# -- the supervisor ---------------------------------------------------------------------------


class DrainSupervisor:
    """Starts the drain, restarts it with a back-off when it exits, and publishes its health
    (``publish(dict)``, called from a worker thread: it writes fsmeta)."""

    def __init__(self, settings: Settings, *, publish: Callable[[dict], None] = lambda health: None,
                 command: list[str] | None = None, tracker: RestartTracker | None = None,
                 poll_seconds: float = POLL_SECONDS):
        self.settings = settings
        self.command = command or [sys.executable, "-m", "ckptfs", "drain", "--cache-dir", settings.cache_dir,
                                   "--supervised"]
        self.proc: subprocess.Popen | None = None
        self.tracker = tracker or RestartTracker()
        self._publish = publish
        self._poll_seconds = poll_seconds
        self._relay: OutputRelay | None = None
        self._stopping = False
        self._started = 0.0  # monotonic time of the last start
        self._health: dict = {"state": "starting", "pid": None, "restarts": 0, "last_exit": None,
                              "last_exit_ns": None, "last_error": None, "restart_at_ns": None,
                              "crash_looping_since_ns": None, "started_ns": None,
                              "loop_exits": self.tracker.policy.exits,
                              "loop_window_seconds": self.tracker.policy.window_seconds}

    def health(self) -> dict:
        return dict(self._health)

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True)
        self._relay = OutputRelay(self.proc.stderr)
        self._started = time.monotonic()
        state = "crash-looping" if self.tracker.crash_looping else "running"
        self._health.update(state=state, pid=self.proc.pid, started_ns=time.time_ns(), restart_at_ns=None)
        log.info("drain started (pid %d)", self.proc.pid)

    def start(self) -> None:
        self._spawn()
        self._publish(self.health())

    async def watch(self) -> None:
        """Restart the drain whenever it exits while the mount is up."""
        while not self._stopping:
            await trio.sleep(self._poll_seconds)
            if self.proc is None or self._stopping:
                continue
            try:
                if self.proc.poll() is None:
                    if self.tracker.running(ran_seconds=time.monotonic() - self._started):
                        log.info("drain up for %.0fs again: the crash loop is over", time.monotonic() - self._started)
                        await self._changed(state="running", crash_looping_since_ns=None)
                    continue
                await self._restart_after_exit(self.proc)
            except Exception:
                # (a failed fork, a status write that failed): the mount goes on serving, and
                # the next poll tries again; the supervisor must never take the mount down.
                log.exception("watching the drain failed; trying again")

    async def _restart_after_exit(self, proc: subprocess.Popen) -> None:
        now = time.monotonic()
        was_looping = self.tracker.crash_looping
        delay = self.tracker.exited(now=now, now_ns=time.time_ns(), ran_seconds=now - self._started)
        relay = self._relay
        if relay is not None:
            await trio.to_thread.run_sync(relay.wait_closed, 2.0)
        how = describe_exit(proc.returncode)
        error = relay.last_error() if relay is not None else self._health["last_error"]
        metrics.DRAIN_RESTARTS.inc()
        if self.tracker.crash_looping and not was_looping:
            log.error("the drain is crash-looping: %d exits within %.0fs (ckptfs status shows the last error)",
                      self.tracker.recent_exits(now), self.tracker.policy.window_seconds)
        log.error("drain (pid %d) %s; restarting in %.0fs%s", proc.pid, how, delay, f": {error}" if error else "")
        await self._changed(state="crash-looping" if self.tracker.crash_looping else "down", pid=None,
                            restarts=self.tracker.restarts, last_exit=how, last_exit_ns=time.time_ns(),
                            last_error=error, restart_at_ns=time.time_ns() + int(delay * 1e9),
                            crash_looping_since_ns=self.tracker.looping_since_ns)
        await trio.sleep(delay)
        if self._stopping:
            return
        try:
            await trio.to_thread.run_sync(self._spawn)
        except OSError as exc:
            # Counted as one more exit at the next look (proc is still the exited one).
            log.error("cannot start the drain: %s", exc)
            self._health["last_error"] = f"cannot start the drain: {exc}"
            self._relay = None
            self._started = time.monotonic()
            return
        await self._changed()

    async def _changed(self, **fields) -> None:
        self._health.update(fields)
        metrics.DRAIN_CRASH_LOOPING.set(1 if self.tracker.crash_looping else 0)
        await trio.to_thread.run_sync(self._publish, self.health())

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
        if self._relay is not None:
            self._relay.wait_closed(2.0)  # its last lines reach the log before ours

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

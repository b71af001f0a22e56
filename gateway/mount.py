"""Starting and stopping a mount: checks, cache-directory lock, recovery, the FUSE front end
and the trio loop of the background tasks.

``ckptfs mount`` without ``--foreground`` re-executes itself in the foreground
in a new session and waits on a pipe until the child has mounted (or says
why it could not), so the exit status and the one-line error reach the user
while no LMDB environment is ever carried across a ``fork``.
"""

from __future__ import annotations

import errno
import faulthandler
import functools
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import ckptfs_fuse
import lmdb
import trio

from ckptfs.drain.factory import open_store_for
from ckptfs.drain.store import StoreError
from ckptfs.fsmeta import locks
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.fsmeta.settings import ConfigError, Settings, parse_bucket_url

from . import datapath, metrics, passthrough, space
from .bucket import BucketClient
from .records import Records
from .core import FsCore
from .fetch import ReadSettings
from .fuse_ops import CkptOperations
from .supervisor import DrainSupervisor

# Longest time an acknowledged namespace change waits before other processes (the drain)
# see it; also what a gateway crash can lose of operations not covered by an fsync. Each
# commit stalls every request for its fdatasync, and the drain's writes take LMDB's writer
# lock in between (a stall for the next batch's writers): 30 ms rather than 10 gave 7-10%
# more renames and unlinks per second with the drain live (docs/DESIGN.md, "Round 7").
COMMIT_INTERVAL_SECONDS = 0.03

log = logging.getLogger("ckptfs.mount")

#: the mount's kernel read-ahead (KiB); the kernel's default for FUSE is 128, which makes a
#: cold sequential read cost a READ request per 128 KiB (DESIGN.md, "Read path performance")
READ_AHEAD_KB = 4096

#: threads of the FUSE front end: requests may wait long (a fetch, room in the cache), and a
#: request that finds no idle thread starts another, up to this many
FUSE_THREADS = 64
RECORD_RETRY_SECONDS = 2.0  # how often in-flight records still to put are tried again


_MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, \ as \ooo


def mount_device(mountpoint: str) -> str | None:
    """``MAJ:MIN`` of the filesystem mounted at ``mountpoint``, from /proc/self/mountinfo.

    Not from ``stat(mountpoint)``: on our own mount that is a FUSE request this process must
    answer, and at unmount it would wait for a main loop that has already stopped."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    device = None
    for line in lines:
        fields = line.split()
        # mount ID, parent ID, MAJ:MIN, root, mount point (octal escapes for spaces etc.)
        if len(fields) > 4 and _MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[4]) == mountpoint:
            device = fields[2]  # the last one listed is the one on top
    return device


def raise_read_ahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> None:
    """Set the mount's read-ahead (``/sys/class/bdi/MAJ:MIN/read_ahead_kb``). Only after INIT:
    the kernel caps it there at what it had offered. Best effort (it needs root)."""
    device = mount_device(mountpoint)
    if device is None:
        log.warning("read-ahead of %s stays at the kernel's default: not in /proc/self/mountinfo", mountpoint)
        return
    try:
        with open(f"/sys/class/bdi/{device}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError as exc:
        log.warning("read-ahead of %s stays at the kernel's default: %s", mountpoint, exc)


class MountError(Exception):
    """A reason the mount cannot start; printed as one line."""


# -- checks -------------------------------------------------------------------------------


def prepare_cache_dir(path: str) -> None:
    """Create the cache directory private (0700), or accept an existing one only if it is
    ours and nobody else can write to it: every user's data passes through it, and a
    shared directory (``--cache-dir /var/tmp``) must neither be used nor have its mode changed."""
    try:
        st = os.stat(path)
    except OSError:
        st = None  # missing (or below a non-directory): creating it says why not
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise MountError(f"cache directory {path}: not a directory")
        if st.st_uid != os.geteuid():
            raise MountError(f"cache directory {path}: owned by uid {st.st_uid}, not by this user "
                             f"(uid {os.geteuid()}); use a directory of your own")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise MountError(f"cache directory {path}: writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                             "use a private directory, e.g. a new one below it")
    cache = CacheDir(path)
    try:
        cache.make_dirs()
        os.chmod(cache.data_dir, 0o700)  # the data itself stays private whatever the parent's mode
    except OSError as exc:
        raise MountError(f"cache directory {path}: cannot create it: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise MountError(f"cache directory {path}: not writable")


# What requests to a FUSE mount whose daemon died fail with: ENOTCONN, or ECONNABORTED where
# the daemon took its requests through io_uring (the kernel tears its queues down as aborted).
DEAD_MOUNT_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


def clear_dead_mount(mountpoint: str) -> bool:
    """Lazily unmount a FUSE mount whose daemon died; True if one was cleared."""
    try:
        # statfs, not stat: the kernel answers stat of a dead mount from its attribute
        # cache for up to the attr timeout, but always sends STATFS (which fails at once).
        os.statvfs(mountpoint)
        return False
    except OSError as exc:
        if exc.errno not in DEAD_MOUNT_ERRNOS:
            return False
    log.warning("%s: clearing the dead mount of a crashed gateway", mountpoint)
    subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return True


def check_mountpoint(mountpoint: str) -> None:
    clear_dead_mount(mountpoint)
    if not os.path.exists(mountpoint):
        raise MountError(f"mountpoint {mountpoint}: does not exist")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mountpoint {mountpoint}: not a directory")
    if os.path.ismount(mountpoint):
        raise MountError(f"mountpoint {mountpoint}: something is already mounted there")
    try:
        if os.listdir(mountpoint):
            raise MountError(f"mountpoint {mountpoint}: not empty")
    except PermissionError:
        raise MountError(f"mountpoint {mountpoint}: permission denied") from None


def lock_cache_dir(path: str) -> int:
    """Take the cache directory's gateway lock; refuse if another gateway holds it."""
    try:
        return locks.acquire(CacheDir(path).gateway_lock)
    except locks.LockHeld as exc:
        raise MountError(f"cache directory {path}: in use by another gateway (pid {exc.holder})") from None


def open_meta_for(settings: Settings):
    """Open fsmeta of a cache directory and bind it to the bucket (refusing another)."""
    meta_dir = CacheDir(settings.cache_dir).meta_dir
    try:
        meta = CacheDir(settings.cache_dir).open_meta(create=True)
    except (lmdb.Error, OSError, RuntimeError) as exc:
        # A corrupt or foreign meta/ directory, or a schema from another version: one line.
        raise MountError(f"cache directory {settings.cache_dir}: cannot open fsmeta in {meta_dir}: {exc}") from None
    stored = meta.get_settings()
    if stored and stored.get("bucket_url") and stored["bucket_url"] != settings.bucket_url:
        meta.close()
        raise MountError(
            f"cache directory {settings.cache_dir}: belongs to {stored['bucket_url']}, not "
            f"{settings.bucket_url}; drain it (ckptfs drain --cache-dir) or use another directory"
        )
    meta.put_settings(settings.to_json())
    return meta


def check_bucket(settings: Settings) -> None:
    """Refuse a bucket or credentials that cannot work, before mounting."""
    scheme, root, _ = parse_bucket_url(settings.bucket_url)
    if scheme == "file":
        try:
            os.makedirs(root, exist_ok=True)  # the embedded bucket is just a directory
        except OSError as exc:
            raise MountError(f"bucket {settings.bucket_url}: cannot create {root}: {exc.strerror}") from None

    async def check() -> None:
        async with open_store_for(settings) as store:
            with trio.fail_after(60):
                await store.check_access(write=True)

    try:
        trio.run(check)
    except StoreError as exc:
        raise MountError(f"bucket {settings.bucket_url}: {exc.code}: {exc.message}") from None
    except trio.TooSlowError:
        where = settings.endpoint_url or "the S3 endpoint"
        raise MountError(f"bucket {settings.bucket_url}: no answer from {where} within 60s") from None


def choose_data_path(requested: str) -> tuple[str, str]:
    """``(mode, why)``: ``passthrough`` or ``writeback`` for ``[mount] data_path`` (auto,
    passthrough, writeback).

    ``passthrough`` refuses, with the reason, where :func:`passthrough.probe` says it cannot
    work; ``auto`` then falls back to the writeback cache. The kernel has the last word at
    INIT (see ``on_init`` in :func:`run_foreground`)."""
    if requested == "writeback":
        return "writeback", "as configured"
    ok, reason = passthrough.probe()
    if ok:
        return "passthrough", reason
    if requested == "passthrough":
        raise MountError(f"data_path passthrough: not available here: {reason}")
    return "writeback", f"passthrough not available: {reason}"


ENABLE_URING_PARAM = "/sys/module/fuse/parameters/enable_uring"


def fuse_io_uring_offered() -> bool | None:
    """Whether the kernel lets FUSE daemons take requests through io_uring (the fuse module's
    ``enable_uring``); None where the kernel has no such parameter."""
    try:
        with open(ENABLE_URING_PARAM) as fh:
            return fh.read().strip() in ("Y", "1")
    except OSError:
        return None


def choose_fuse_transport(requested: str) -> tuple[bool, str]:
    """``(want_io_uring, why)`` for ``[mount] fuse_io_uring`` (auto, on, off).

    The kernel lets a FUSE daemon take requests through io_uring only where the fuse module's
    ``enable_uring`` parameter is on (Linux 6.14+ with CONFIG_FUSE_IO_URING; off by default).
    ``on`` refuses to mount, with the reason, where it is not; ``auto`` then uses /dev/fuse
    alone. Setting the rings up can still fail after INIT; the front end then stays on /dev/fuse
    (``on_init_replied`` in :func:`run_foreground` logs it)."""
    if requested == "off":
        return False, "as configured"
    enabled = fuse_io_uring_offered()
    if enabled:
        return True, "the kernel offers it"
    reason = ("this kernel has no FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING)" if enabled is None
              else f"the fuse module's enable_uring parameter is off (as root: echo Y > {ENABLE_URING_PARAM})")
    if requested == "on":
        raise MountError(f"fuse_io_uring on: not available here: {reason}")
    return False, reason


# -- running --------------------------------------------------------------------------------


class GatewayStatus:
    """``meta/gateway_status``: what this gateway tells ``ckptfs status`` (pid, mountpoint, data
    path and FUSE transport, its metrics endpoint, its drain's health). Several threads update
    parts of it; each update writes the whole record, in the order of the updates."""

    def __init__(self, meta, **fields):
        self._meta = meta
        self._fields = dict(fields)
        self._lock = threading.Lock()

    def update(self, **fields) -> None:
        with self._lock:
            self._fields.update(fields)
            record = dict(self._fields)
            self._meta.write(lambda txn: txn.put_gateway_status(record))


def run_foreground(settings: Settings, mountpoint: str, ready_fd: int | None = None) -> int:
    """Mount and serve until unmounted or signalled. Returns the exit status."""
    def fail(message: str) -> int:
        if ready_fd is not None:
            os.write(ready_fd, f"ERR {message}\n".encode())
            os.close(ready_fd)
        print(f"ckptfs: {message}", file=sys.stderr)
        return 1

    # A fault in native code (the front end, libfuse, LMDB) would end the gateway with no
    # trace: print every thread's Python stack to the log (fd 2) first.
    if sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__)
    mountpoint = os.path.abspath(mountpoint)
    try:
        data_path, data_path_why = choose_data_path(settings.data_path)
        want_io_uring, io_uring_why = choose_fuse_transport(settings.fuse_io_uring)
    except MountError as exc:
        return fail(str(exc))
    try:
        prepare_cache_dir(settings.cache_dir)
        lock_fd = lock_cache_dir(settings.cache_dir)
        check_mountpoint(mountpoint)
        meta = open_meta_for(settings)
    except (MountError, ConfigError) as exc:
        return fail(str(exc))

    try:
        check_bucket(settings)
    except MountError as exc:
        meta.close()
        return fail(str(exc))

    try:
        bucket = BucketClient(lambda: open_store_for(settings)).start()
    except Exception as exc:
        meta.close()
        return fail(f"bucket {settings.bucket_url}: cannot open it for reading: {exc}")
    core = FsCore(settings.cache_dir, meta, key_prefix=settings.key_prefix, bucket=bucket,
                  read=ReadSettings.from_settings(settings), remote_ttl=float(settings.remote_ttl))
    recovered = core.recover()
    if any(recovered.values()):
        log.info("recovered cache: %s", recovered)
    # Namespace operations join a batch committed every few milliseconds instead of one
    # synced commit each; fsync/fsyncdir commit and sync at once (docs/DESIGN.md).
    meta.defer_commits(COMMIT_INTERVAL_SECONDS)
    # Cluster commit: this node's in-flight records go into the bucket from the write path.
    records = Records(meta, bucket, markers=settings.markers, publish_timeout=float(settings.publish_timeout))
    try:
        records.sweep_orphans()
    except Exception as exc:  # the next start tries again; the mount does not depend on it
        log.warning("could not look for in-flight records an earlier run left: %s", exc)
    records.install()
    limits = space.SpaceLimits.from_settings(settings, settings.cache_dir)
    core.enable_space(limits, markers=settings.markers)
    core.enable_spares()
    log.info("cache cap %d bytes (evict from %d down to %d; writers wait up to %gs for room)",
             limits.cap, limits.high, limits.low, limits.timeout)
    gateway_status = GatewayStatus(meta, pid=os.getpid(), mountpoint=mountpoint, started_ns=time.time_ns(),
                                   metrics={"addr": settings.metrics_addr, "serving": None, "error": None})
    supervisor = DrainSupervisor(settings, publish=lambda health: gateway_status.update(drain=health))
    fsync_hook = supervisor.remote_fsync_hook(meta) if settings.fsync == "remote" else None
    session: ckptfs_fuse.Session | None = None

    running = {"data_path": data_path, "fuse_transport": "dev_fuse"}  # until INIT says

    def record_modes(**modes: str) -> None:
        running.update(modes)
        gateway_status.update(**running)
        metrics.set_data_path(running["data_path"])
        metrics.set_fuse_transport(running["fuse_transport"])

    def on_init() -> None:
        # The kernel's INIT: only now is it known whether passthrough was granted. If not, the
        # front end negotiated the writeback cache instead, and the gateway serves reads and
        # writes as in writeback mode.
        mode = data_path
        if mode == "passthrough" and not session.passthrough_granted:
            log.error("data path: the kernel did not grant FUSE passthrough at INIT; "
                      "serving reads and writes through the writeback cache instead")
            core.disable_passthrough()
            mode = "writeback"
        log.info("data path: %s (%s)", mode, data_path_why if mode == data_path else "not granted at INIT")
        if mode == "passthrough":
            # Opens the gateway serves (files being fetched, writers under cache pressure) skip
            # the mount's page cache, if they can still be mapped that way.
            ops.direct_served_io = session.direct_io_mmap_granted
            log.info("files being fetched are opened with %s", "direct I/O" if ops.direct_served_io else
                     "the page cache (the kernel did not grant FUSE_DIRECT_IO_ALLOW_MMAP)")
        record_modes(data_path=mode)

    def on_init_replied() -> None:
        # The front end has set up its io_uring queues (if asked to) before calling this.
        if session.io_uring_active:
            record_modes(fuse_transport="io_uring")
            log.info("FUSE requests: io_uring, a queue per CPU (%s)", io_uring_why)
            if session.io_uring_error:
                log.warning("FUSE requests: some io_uring threads could not be set up (%s); their CPUs' "
                            "queues have fewer threads", os.strerror(session.io_uring_error))
        elif want_io_uring:
            log.error("FUSE requests: /dev/fuse; setting up the io_uring queues failed: %s",
                      os.strerror(session.io_uring_error or errno.EIO))
        else:
            log.info("FUSE requests: /dev/fuse (io_uring: %s)", io_uring_why)
        raise_read_ahead(mountpoint)  # the kernel caps it at what INIT's reply said

    ops = CkptOperations(core, fsync_hook=fsync_hook, on_init=on_init, on_init_replied=on_init_replied)
    allow_other = settings.allow_other if settings.allow_other is not None else os.geteuid() == 0
    options = ["fsname=ckptfs", "subtype=ckptfs", "default_permissions"]
    if allow_other:
        options.append("allow_other")
    try:
        session = ckptfs_fuse.Session(
            ops, mountpoint, options,
            passthrough=data_path == "passthrough",
            writeback_cache=True,  # where passthrough is not granted
            atomic_o_trunc=ops.atomic_o_trunc_with_writeback_cache,
            direct_io_mmap=data_path == "passthrough",
            max_threads=FUSE_THREADS,
            user_xattrs_only=True,  # only user.* attributes exist (gateway/xattrs.py)
            io_uring=want_io_uring,
            splice_write=True)  # READs of fetched ranges: cache file -> /dev/fuse, no copy in between
    except RuntimeError as exc:
        core.close_spares()
        meta.close()
        return fail(f"mountpoint {mountpoint}: mount failed: {exc}")
    if session.splice_max_read:
        log.info("READ requests capped at %d bytes (max_read), so that each reply fits one pipe and is "
                 "spliced: pipes cannot grow past /proc/sys/fs/pipe-max-size here (no CAP_SYS_RESOURCE)",
                 session.splice_max_read)
    if data_path == "passthrough":
        core.enable_passthrough(functools.partial(passthrough.open_backing, fuse_fd=session.fd),
                                functools.partial(passthrough.close_backing, fuse_fd=session.fd))
    record_modes()  # until INIT confirms them (on_init, on_init_replied)
    metrics.watch_fuse(session, ckptfs_fuse.BUCKET_BOUNDS)
    metrics.watch_cache(settings.cache_dir, meta)
    # A busy address (another mount on this host) leaves this mount without metrics, not
    # without a file system: ckptfs status says so.
    metrics_error = metrics.serve(settings.metrics_addr)
    gateway_status.update(metrics={"addr": settings.metrics_addr, "serving": metrics_error is None,
                                   "error": metrics_error})
    supervisor.start()
    log.info("mounted %s on %s (cache %s)", settings.bucket_url, mountpoint, settings.cache_dir)
    if ready_fd is not None:
        os.write(ready_fd, b"OK\n")
        os.close(ready_fd)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                    async for signum in signals:
                        log.info("signal %d: unmounting", signum)
                        session.exit()
                        return

            nursery.start_soon(on_signal)
            nursery.start_soon(supervisor.watch)
            nursery.start_soon(sweep_mapped)
            nursery.start_soon(manage_space)
            nursery.start_soon(publish_records)
            # The front end's threads serve requests until the file system is unmounted or a
            # signal ends them. If this task is cancelled, they are told to end; the session is
            # destroyed only once they have (Session.destroy waits for them).
            try:
                await trio.to_thread.run_sync(session.run, abandon_on_cancel=True)
            finally:
                session.exit()
            nursery.cancel_scope.cancel()

    async def sweep_mapped() -> None:
        # Passthrough: cache files changed through a shared mapping after their last release.
        while True:
            await trio.sleep(datapath.SWEEP_SECONDS)
            if core.passthrough:
                try:
                    n = await trio.to_thread.run_sync(core.sweep_mapped)
                except Exception:
                    log.exception("sweep of mapped files failed")
                    continue
                if n:
                    log.info("%d closed file(s) changed through a shared mapping: new generation", n)

    published_state: dict = {"unpublished": 0, "failed_puts": 0}

    async def publish_records() -> None:
        # In-flight records whose put ran out of time in a request, or a crashed run's.
        while True:
            await trio.sleep(RECORD_RETRY_SECONDS)
            try:
                left = await trio.to_thread.run_sync(records.retry_unpublished)
                shown = {"unpublished": left, "failed_puts": records.failed}
                if shown != published_state:
                    published_state.update(shown)
                    await trio.to_thread.run_sync(lambda: gateway_status.update(records=dict(shown)))
            except Exception:
                log.exception("putting in-flight records failed")

    async def manage_space() -> None:
        # The cache cap: measure, evict clean files, wake writers waiting for room, publish.
        published = 0.0
        while True:
            await trio.sleep(space.TICK_SECONDS)
            try:
                await trio.to_thread.run_sync(core.space.tick)
                if time.monotonic() - published >= space.PUBLISH_SECONDS:
                    await trio.to_thread.run_sync(core.space.publish)
                    published = time.monotonic()
            except Exception:
                log.exception("cache space task failed")

    status = 0
    try:
        trio.run(serve)
    except BaseException:
        log.exception("gateway main loop ended with an error")
        status = 1
    finally:
        try:
            session.destroy()  # unmounts, if fusermount3 -u has not
        except Exception:
            log.exception("closing the FUSE session failed")
        released = core.release_all()
        if released:
            log.info("released %d handle(s) whose RELEASE the unmount ended", released)
        supervisor.stop()
        core.close_spares()
        bucket.close()
        meta.sync()
        meta.close()
        os.close(lock_fd)
    log.info("unmounted %s", mountpoint)
    return status


def run_daemon(argv: list[str], settings: Settings, timeout: float = 60.0) -> int:
    """Start ``ckptfs mount … --foreground`` detached and wait until it has mounted."""
    try:
        prepare_cache_dir(settings.cache_dir)
    except MountError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return 1
    read_fd, write_fd = os.pipe()
    log_path = CacheDir(settings.cache_dir).gateway_log
    # 0600: the log names files of every user of the mount.
    with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600), "ab") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-m", "ckptfs", *argv, "--foreground", "--ready-fd", str(write_fd)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            pass_fds=(write_fd,),
            start_new_session=True,
            close_fds=True,
        )
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    buf = b""
    with os.fdopen(read_fd, "rb") as reader:
        while b"\n" not in buf and time.monotonic() < deadline:
            chunk = reader.readline()
            if not chunk:
                break
            buf += chunk
    line = buf.decode(errors="replace").strip()
    if line == "OK":
        return 0
    if line.startswith("ERR "):
        print(f"ckptfs: {line[4:]}", file=sys.stderr)
        return 1
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
    print(f"ckptfs: the gateway did not start; see {log_path}", file=sys.stderr)
    return 1

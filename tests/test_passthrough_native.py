"""The FUSE front end (native/, built by scripts/build-fuse.sh) and FUSE
passthrough, on a tiny mount.

A standalone file system on the front end (``PtFS`` below, no gateway code) serves a flat
directory whose files are backed by files in a backing directory. Run as
``python tests/test_passthrough_native.py serve MNT BACKDIR passthrough|plain`` it mounts
MNT in that process (the tests start it as a child, so a stuck daemon cannot hang pytest).
In ``passthrough`` mode every open/create registers the backing file with
``gateway/passthrough.py``'s ``open_backing`` (one backing id per inode, closed with its
last handle) and replies with that backing id; READ and WRITE requests that do
reach the daemon are counted and served from the backing file anyway. The counters are read
through the root's ``user.ptstats`` xattr (a GETXATTR, which is neither READ nor WRITE).

``mode`` may carry options after ``+``: ``1thread`` (one /dev/fuse thread, so that every request
reuses one buffer), ``uring`` (the io_uring queues), ``exit-before-run`` (SIGTERM before
``run()``). The child prints ``REFS {name: lookup references}`` when it ends: what the kernel
still holds by the handlers' count.

Passthrough must work where set-up ran (root, kernel >= 6.9, the front end on
libfuse >= 3.17): if it does not, these tests fail, with the reason, instead of skipping.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import mmap
import os
import stat
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STATS_XATTR = "user.ptstats"
MiB = 1 << 20


def load_passthrough():
    """gateway/passthrough.py by file path (it is self-contained; no package import)."""
    spec = importlib.util.spec_from_file_location(
        "ckptfs_passthrough_under_test", REPO / "gateway" / "passthrough.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- the file system (runs in the child process) ----------------------------------------------


CTL = ".ctl-"  # files of the backing directory that steer the test file system (never listed)


def serve(mnt: str, backdir: str, mode: str) -> None:
    import ckptfs_fuse
    from ckptfs_fuse import ROOT_INODE, FuseError

    mode, *opts = mode.split("+")

    pt = load_passthrough()

    class PtFS:
        """The ops object of a ckptfs_fuse.Session: synchronous methods, called from the
        front end's threads (one lock here: this file system is not about concurrency)."""

        def __init__(self, backdir: str):
            self.session = None  # set once the session exists (INIT comes after)
            self.lock = threading.Lock()
            self.backdir = backdir
            self.ino_of: dict[bytes, int] = {}
            self.name_of: dict[int, bytes] = {}
            self.next_ino = 2
            self.handles: dict[int, tuple[int, int | None]] = {}  # fh -> (ino, fd | None)
            self.next_fh = 1
            self.backing: dict[int, list[int]] = {}  # ino -> [backing id, open handles]
            self.counts = {k: 0 for k in (
                "open", "create", "read", "write", "flush", "fsync", "release", "setattr",
                "backing_open", "backing_close", "backing_reuse")}
            self.refs: dict[int, int] = {}  # ino -> lookup references the kernel holds
            self.keep_views = False  # WRITE: keep views derived from the data past the request
            self.kept: list = []
            self.block_next = None  # the next request of this op waits for CTL + "go"

        def _ref(self, ino: int, n: int = 1) -> None:
            self.refs[ino] = self.refs.get(ino, 0) + n

        def _maybe_block(self, op: str) -> None:
            """Hold this request (outside the lock) until the test creates CTL + "go"."""
            with self.lock:
                if self.block_next != op:
                    return
                self.block_next = None
            open(os.path.join(self.backdir, CTL + "blocked"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(self.backdir, CTL + "go")) and time.monotonic() < deadline:
                time.sleep(0.01)

        def refs_by_name(self) -> dict:
            with self.lock:
                return {os.fsdecode(self.name_of.get(ino, b"?")): n for ino, n in self.refs.items()}

        # helpers
        def _path(self, ino: int) -> str:
            if ino == ROOT_INODE:
                return self.backdir
            try:
                return os.path.join(self.backdir, os.fsdecode(self.name_of[ino]))
            except KeyError:
                raise FuseError(errno.ENOENT) from None

        def _ino(self, name: bytes) -> int:
            ino = self.ino_of.get(name)
            if ino is None:
                ino = self.ino_of[name] = self.next_ino
                self.name_of[ino] = name
                self.next_ino += 1
            return ino

        def _entry(self, ino: int) -> tuple:
            try:
                st = os.lstat(self._path(ino))
            except OSError as e:
                raise FuseError(e.errno) from None
            return (ino, 1.0, 1.0, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_rdev, st.st_size,
                    st.st_blksize, st.st_blocks, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)

        def _handle(self, ino: int, fd: int) -> tuple:
            fh = self.next_fh
            self.next_fh += 1
            if not self.session.passthrough_granted:
                self.handles[fh] = (ino, fd)
                return (fh, 0, 0)  # (fh, backing id, OPEN_* flags)
            try:
                ent = self.backing.get(ino)
                if ent is None:  # first open of the inode: register its backing file
                    ent = self.backing[ino] = [pt.open_backing(fd, fuse_fd=self.session.fd), 0]
                    self.counts["backing_open"] += 1
                else:  # every further open of the inode reuses the same backing id
                    self.counts["backing_reuse"] += 1
                ent[1] += 1
            except OSError as e:
                raise FuseError(e.errno) from None
            finally:
                os.close(fd)  # the kernel holds its own reference to the backing file
            self.handles[fh] = (ino, None)
            return (fh, ent[0], 0)

        # namespace
        def lookup(self, parent, name):
            with self.lock:
                if name in (b".", b".."):
                    return self._entry(ROOT_INODE)
                if parent != ROOT_INODE or not os.path.lexists(os.path.join(self.backdir, os.fsdecode(name))):
                    return (0, 0.0)
                entry = self._entry(self._ino(name))
                self._ref(entry[0])
                return entry

        def forget(self, items):
            with self.lock:
                for ino, n in items:
                    self._ref(ino, -n)

        def getattr(self, ino):
            with self.lock:
                return self._entry(ino)

        def setattr(self, ino, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, fh):
            with self.lock:
                self.counts["setattr"] += 1
                path = self._path(ino)
                try:
                    if size is not None:
                        os.truncate(path, size)
                    if mode is not None:
                        os.chmod(path, stat.S_IMODE(mode))
                    if atime_ns is not None or mtime_ns is not None:
                        st = os.lstat(path)
                        os.utime(path, ns=(st.st_atime_ns if atime_ns is None else atime_ns,
                                           st.st_mtime_ns if mtime_ns is None else mtime_ns))
                except OSError as e:
                    raise FuseError(e.errno) from None
                return self._entry(ino)

        def unlink(self, parent, name):
            with self.lock:
                try:
                    os.unlink(os.path.join(self.backdir, os.fsdecode(name)))
                except OSError as e:
                    raise FuseError(e.errno) from None
                ino = self.ino_of.pop(name, None)
                if ino is not None:
                    self.name_of.pop(ino, None)

        def opendir(self, ino):
            if ino != ROOT_INODE:
                raise FuseError(errno.ENOTDIR)
            return ino

        def readdir(self, fh, start_id):
            if start_id == 0:
                self._maybe_block("readdir")
            with self.lock:
                names = sorted(n for n in os.listdir(self.backdir) if not n.startswith(CTL))
                return [(os.fsencode(n), self._entry(self._ino(os.fsencode(n))), i + 1)
                        for i, n in enumerate(names[start_id:], start_id)]

        def readdir_taken(self, fh, inos):
            with self.lock:
                for ino in inos:
                    self._ref(ino)

        def statfs(self):
            sv = os.statvfs(self.backdir)
            return (sv.f_bsize, sv.f_frsize, sv.f_blocks, sv.f_bfree, sv.f_bavail, sv.f_files, sv.f_ffree,
                    sv.f_favail, sv.f_namemax)

        def getxattr(self, ino, name):
            if ino == ROOT_INODE and name == STATS_XATTR.encode():
                with self.lock:
                    return json.dumps({
                        "passthrough_enabled": self.session.passthrough_granted,
                        "active_backing": len(self.backing),
                        "open_handles": len(self.handles),
                        "threads": self.session.threads,
                        "io_uring_active": self.session.io_uring_active,
                        "io_uring_requests": self.session.io_uring_requests,
                        "splice_max_read": self.session.splice_max_read,
                        "requests": {op: v[0] for op, v in self.session.request_stats().items()},
                        **self.counts,
                    }).encode()
            if ino == ROOT_INODE and name == b"user.bad_reply":
                return "not bytes"  # a handler bug: the front end must answer EIO and go on
            if ino == ROOT_INODE and name == b"user.block":
                BLOCKED.wait(30)  # holds a front-end thread until user.unblock is read
                BLOCKED.clear()
                return b"unblocked"
            if ino == ROOT_INODE and name == b"user.unblock":
                BLOCKED.set()
                return b"ok"
            if ino == ROOT_INODE and name == b"user.kept":
                with self.lock:
                    return b"".join(bytes(v) for v in self.kept)
            raise FuseError(errno.ENODATA)

        def setxattr(self, ino, name, value, flags):
            if ino != ROOT_INODE:
                raise FuseError(errno.ENOTSUP)
            with self.lock:
                if name == b"user.keep_views":
                    self.keep_views = value == b"1"
                elif name == b"user.block_next":
                    self.block_next = value.decode()
                elif name == b"user.break_rings":
                    # A fault for the tests: every io_uring of this process stops working (each
                    # ring's fd now refers to /dev/null), as if its ring thread failed.
                    null = os.open(os.devnull, os.O_RDWR)
                    for fd in os.listdir("/proc/self/fd"):
                        with contextlib.suppress(OSError):
                            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]":
                                os.dup2(null, int(fd))
                    os.close(null)
                else:
                    raise FuseError(errno.ENOTSUP)

        def unexpected(self, op, exc):
            self.counts.setdefault("unexpected", 0)
            self.counts["unexpected"] += 1

        # files: the backing file is always opened O_RDWR, because the one backing id of an
        # inode serves every later open of it, whatever its access mode.
        def create(self, parent, name, mode, flags, uid, gid, umask, pid):
            self._maybe_block("create")
            with self.lock:
                self.counts["create"] += 1
                if parent != ROOT_INODE:
                    raise FuseError(errno.ENOENT)
                try:
                    fd = os.open(os.path.join(self.backdir, os.fsdecode(name)),
                                 os.O_RDWR | os.O_CREAT | (flags & (os.O_EXCL | os.O_TRUNC)),
                                 stat.S_IMODE(mode))
                except OSError as e:
                    raise FuseError(e.errno) from None
                ino = self._ino(name)
                entry = self._entry(ino)
                reply = (*self._handle(ino, fd), entry)
                self._ref(ino)
                return reply

        def open(self, ino, flags):
            with self.lock:
                self.counts["open"] += 1
                try:
                    fd = os.open(self._path(ino), os.O_RDWR | (flags & os.O_TRUNC))
                except OSError as e:
                    raise FuseError(e.errno) from None
                return self._handle(ino, fd)

        def read(self, fh, off, size):
            with self.lock:
                self.counts["read"] += 1
                fd = self._fd(fh)
                if off < MiB:  # the first MiB as bytes, the rest as the range of the file holding it
                    return os.pread(fd, size, off)
                return (fd, off, max(0, min(size, os.fstat(fd).st_size - off)))

        def write(self, fh, off, buf):
            with self.lock:
                self.counts["write"] += 1
                if self.keep_views:  # a handler bug the front end must make harmless
                    self.kept += [buf[0:3], memoryview(buf), buf[-2:]]
                return os.pwrite(self._fd(fh), buf, off)

        def _fd(self, fh: int) -> int:
            ino, fd = self.handles[fh]
            if fd is None:  # a READ/WRITE on a passthrough handle: serve it, it gets counted
                fd = os.open(self._path(ino), os.O_RDWR)
                self.handles[fh] = (ino, fd)
            return fd

        def flush(self, fh):
            with self.lock:
                self.counts["flush"] += 1

        def fsync(self, fh, datasync):
            with self.lock:
                self.counts["fsync"] += 1
                ino, fd = self.handles[fh]
            own = fd is None
            fd = os.open(self._path(ino), os.O_RDONLY) if own else fd
            try:
                (os.fdatasync if datasync else os.fsync)(fd)
            finally:
                if own:
                    os.close(fd)

        def release(self, fh):
            with self.lock:
                self.counts["release"] += 1
                ino, fd = self.handles.pop(fh)
                if fd is not None:
                    os.close(fd)
                ent = self.backing.get(ino)
                if ent is not None:
                    ent[1] -= 1
                    if ent[1] == 0:  # last handle of the inode: now the backing id may go
                        del self.backing[ino]
                        pt.close_backing(ent[0], fuse_fd=self.session.fd)
                        self.counts["backing_close"] += 1

    BLOCKED = threading.Event()
    fs = PtFS(backdir)
    fs.session = ckptfs_fuse.Session(fs, mnt, ["default_permissions", "fsname=ckptfs-passthrough-test"],
                                     passthrough=(mode == "passthrough"), writeback_cache=False,
                                     max_threads=1 if "1thread" in opts else 8, splice_write=True,
                                     io_uring="uring" in opts, ring_threads_per_cpu=2)
    signal.signal(signal.SIGTERM, lambda *_: fs.session.exit())
    if "exit-before-run" in opts:
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before run()
    try:
        fs.session.run()
    finally:
        fs.session.destroy()
        print("REFS " + json.dumps(fs.refs_by_name()), flush=True)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "serve":
    serve(sys.argv[2], sys.argv[3], sys.argv[4])
    sys.exit(0)


# -- the tests ---------------------------------------------------------------------------------

import pytest  # noqa: E402

from conftest import in_mount_table, lazy_unmount  # noqa: E402

pytestmark = pytest.mark.mounted


def require_passthrough():
    """Fail (not skip) with the reason when passthrough is not usable here."""
    pt = load_passthrough()
    ok, reason = pt.probe()
    if not ok:
        pytest.fail(f"FUSE passthrough unavailable: {reason}. scripts/setup.sh builds it; "
                    "it needs root on Linux >= 6.9.", pytrace=False)
    return pt


def stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, STATS_XATTR))


def wait_stats(mnt: Path, pred, timeout=10.0) -> dict:
    """RELEASE is asynchronous: poll until pred(stats) holds."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(mnt)
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


@contextlib.contextmanager
def mounted(base: Path, mode: str):
    mnt, back = base / f"mnt-{mode}", base / f"back-{mode}"
    mnt.mkdir()
    back.mkdir()
    log = open(base / f"daemon-{mode}.log", "w+")
    proc = subprocess.Popen([sys.executable, __file__, "serve", str(mnt), str(back), mode],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"{mode} test mount did not come up (daemon exit {proc.poll()}):\n"
                            f"{log.read()[-3000:]}", pytrace=False)
            time.sleep(0.02)
        yield mnt, back
    finally:
        if in_mount_table(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lazy_unmount(mnt)  # a dead daemon's mount (os.path.ismount says False for it)
        log.close()


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


def test_probe_and_ioctl_numbers():
    pt = require_passthrough()
    # _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t), as in <linux/fuse.h>
    assert pt.FUSE_DEV_IOC_BACKING_OPEN == 0x4010E501
    assert pt.FUSE_DEV_IOC_BACKING_CLOSE == 0x4004E502
    ver = pt.libfuse_version()
    assert ver is not None and tuple(map(int, ver.split(".")[:2])) >= (3, 17), ver
    import ckptfs_fuse

    assert ckptfs_fuse.HAVE_PASSTHROUGH
    with pytest.raises(OSError) as ei:
        pt.open_backing(0, fuse_fd=0)  # not a FUSE device
    assert ei.value.errno in (errno.ENOTTY, errno.EINVAL, errno.EBADF, errno.EPERM)


def test_64mib_write_and_read_back_bypass_the_daemon(tmp_path):
    require_passthrough()
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(64 * MiB))
    want = sha256_file(src)
    with mounted(tmp_path, "passthrough") as (mnt, back):
        s0 = stats(mnt)
        assert s0["passthrough_enabled"], f"the kernel did not grant passthrough at INIT: {s0}"

        subprocess.run(["dd", f"if={src}", f"of={mnt / 'ckpt.bin'}", "bs=1M", "status=none"],
                       check=True)
        got = subprocess.run(["dd", f"if={mnt / 'ckpt.bin'}", "bs=1M", "status=none"],
                             check=True, stdout=subprocess.PIPE).stdout
        assert len(got) == 64 * MiB and hashlib.sha256(got).hexdigest() == want
        assert sha256_file(back / "ckpt.bin") == want, "the bytes did not land in the backing file"
        assert os.stat(mnt / "ckpt.bin").st_size == 64 * MiB

        s = wait_stats(mnt, lambda s: s["backing_close"] == s["backing_open"])
        print(f"\ndaemon saw: {s}")
        assert s["write"] == 0 and s["read"] == 0, f"READ/WRITE reached the daemon: {s}"
        assert s["create"] + s["open"] >= 2 and s["backing_open"] >= 1, s
        assert s["backing_close"] == s["backing_open"] and s["active_backing"] == 0, \
            f"backing ids not closed with the last handle: {s}"

        # Two handles of one inode share one backing id; it is closed with the last of them.
        before = stats(mnt)
        fd_w = os.open(mnt / "ckpt.bin", os.O_RDWR)
        fd_r = os.open(mnt / "ckpt.bin", os.O_RDONLY)
        try:
            os.pwrite(fd_w, b"passthrough!", 5 * MiB)
            assert os.pread(fd_r, 12, 5 * MiB) == b"passthrough!"
            mid = stats(mnt)
            assert mid["backing_open"] == before["backing_open"] + 1, mid
            assert mid["backing_reuse"] == before["backing_reuse"] + 1, mid
            assert mid["active_backing"] == 1, mid
        finally:
            os.close(fd_w)
            os.close(fd_r)
        with open(back / "ckpt.bin", "rb") as f:
            f.seek(5 * MiB)
            assert f.read(12) == b"passthrough!"
        s = wait_stats(mnt, lambda s: s["active_backing"] == 0)
        assert s["active_backing"] == 0 and s["backing_close"] == s["backing_open"], s
        assert s["write"] == 0 and s["read"] == 0, s

        # fsync and truncate still go to the daemon (and work)
        with open(mnt / "ckpt.bin", "r+b") as f:
            f.truncate(MiB)
            os.fsync(f.fileno())
        assert os.stat(back / "ckpt.bin").st_size == MiB
        s = wait_stats(mnt, lambda s: s["active_backing"] == 0)
        assert s["fsync"] >= 1 and s["setattr"] >= 1 and s["write"] == 0, s


def _dd_rate(src: str, dst: str, size_mib: int, runs: int = 3) -> float:
    """Best of *runs* dd bs=1M copies (into the page cache, no fsync), in GB/s."""
    best = 0.0
    for _ in range(runs):
        if dst != "/dev/null" and os.path.exists(dst):
            os.unlink(dst)  # a new file each run: no truncation of the last one in the timing
        t = time.perf_counter()
        subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=1M", f"count={size_mib}",
                        "status=none"], check=True)
        best = max(best, size_mib * MiB / (time.perf_counter() - t) / 1e9)
    return best


def test_throughput_report(tmp_path):
    """Prints dd throughput: passthrough vs the backing directory vs a daemon-served mount."""
    require_passthrough()
    size = 256
    rates = {}
    with mounted(tmp_path, "passthrough") as (mnt, back):
        assert stats(mnt)["passthrough_enabled"]
        rates["passthrough write"] = _dd_rate("/dev/zero", str(mnt / "f"), size)
        rates["passthrough read"] = _dd_rate(str(mnt / "f"), "/dev/null", size)
        assert stats(mnt)["read"] == 0
        assert stats(mnt)["write"] == 0
        rates["backing dir write"] = _dd_rate("/dev/zero", str(back / "g"), size)
        rates["backing dir read"] = _dd_rate(str(back / "g"), "/dev/null", size)
    with mounted(tmp_path, "plain") as (mnt, back):
        assert not stats(mnt)["passthrough_enabled"]
        rates["daemon (no passthrough) write"] = _dd_rate("/dev/zero", str(mnt / "f"), size)
        rates["daemon (no passthrough) read"] = _dd_rate(str(mnt / "f"), "/dev/null", size)
        assert stats(mnt)["write"] > 0
    print(f"\ndd bs=1M, {size} MiB, page cache, best of 3:")
    for k, v in rates.items():
        print(f"  {k:32s} {v:5.2f} GB/s")


# -- the front end itself ----------------------------------------------------------------------


def test_a_handler_bug_is_eio_and_the_mount_keeps_serving(tmp_path):
    with mounted(tmp_path, "plain") as (mnt, back):
        with pytest.raises(OSError) as ei:
            os.getxattr(mnt, "user.bad_reply")  # the handler returns str, not bytes
        assert ei.value.errno == errno.EIO
        (mnt / "f").write_bytes(b"still here")
        assert (mnt / "f").read_bytes() == b"still here"
        assert stats(mnt)["unexpected"] == 1


def test_reads_answered_with_bytes_or_with_a_range_of_a_file(tmp_path):
    """A READ handler returns the bytes, or (fd, offset, length) of a file holding them, which
    the front end sends without a copy in Python (spliced where INIT granted it)."""
    with mounted(tmp_path, "plain") as (mnt, back):
        data = os.urandom(3 * MiB + 12345)
        (back / "f").write_bytes(data)
        fd = os.open(mnt / "f", os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 2 * MiB)  # O_DIRECT wants an aligned buffer: every read is a READ
            for off in (0, 512 * 1024, MiB, 3 * MiB):  # bytes, both, a range, the range at the end
                n = os.preadv(fd, [buf], off)
                assert n == min(2 * MiB, len(data) - off)
                assert buf[:n] == data[off:off + n]
        finally:
            os.close(fd)
        assert (mnt / "f").read_bytes() == data
        assert stats(mnt)["read"] >= 4


def pipe_can_hold(nbytes: int) -> bool:
    r, w = os.pipe()
    try:
        return fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, nbytes) >= nbytes
    except PermissionError:  # past /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE
        return False
    finally:
        os.close(r)
        os.close(w)


def test_read_replies_fit_one_pipe_so_libfuse_can_splice_them(tmp_path):
    """libfuse splices a READ reply only through a pipe that holds all of it (the reply plus
    three pages); where a pipe cannot grow to 1 MiB plus that, every 1 MiB reply would be
    copied twice instead. The front end then caps READs with the max_read mount option."""
    page = os.sysconf("SC_PAGESIZE")
    with mounted(tmp_path, "plain") as (mnt, back):
        max_read = stats(mnt)["splice_max_read"]
        options = next(line.split()[3] for line in open("/proc/mounts") if line.split()[1] == str(mnt))
        if pipe_can_hold(MiB + 4 * page):
            assert max_read == 0 and "max_read=" not in options
        else:
            assert 0 < max_read < MiB and max_read % page == 0
            assert f"max_read={max_read}" in options.split(",")
            assert pipe_can_hold(max_read + 3 * page + 16)  # what libfuse asks for a full reply
        data = os.urandom(4 * MiB + 4321)
        (back / "f").write_bytes(data)
        fd = os.open(mnt / "f", os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 4 * MiB)  # one read(2), several READs of at most max_read
            reads = stats(mnt)["read"]
            assert os.preadv(fd, [buf], 0) == 4 * MiB and buf[:] == data[:4 * MiB]
            assert stats(mnt)["read"] - reads == -(-4 * MiB // (max_read or MiB))
        finally:
            os.close(fd)


def test_requests_that_wait_do_not_hold_up_the_others(tmp_path):
    """A request may wait long (a fetch, room in the cache): others are served meanwhile, by
    threads the front end starts as it needs them."""
    with mounted(tmp_path, "plain") as (mnt, back):
        results = []
        waiters = [threading.Thread(target=lambda: results.append(os.getxattr(mnt, "user.block")))
                   for _ in range(2)]
        for t in waiters:
            t.start()
        deadline = time.monotonic() + 10
        while stats(mnt)["requests"].get("getxattr", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # (the stats read is a getxattr too)
        (mnt / "g").write_bytes(b"served while two requests wait")
        assert (mnt / "g").read_bytes() == b"served while two requests wait"
        assert results == []  # both still waiting
        assert stats(mnt)["threads"] >= 3
        os.getxattr(mnt, "user.unblock")
        os.getxattr(mnt, "user.unblock")
        for t in waiters:
            t.join(10)
        assert results == [b"unblocked", b"unblocked"]
        assert stats(mnt)["requests"]["lookup"] >= 1


def test_exit_ends_the_loop_and_unmounts(tmp_path):
    """Session.exit() (on SIGTERM here, as the gateway does) wakes the idle threads blocked
    reading /dev/fuse; run() returns and destroy() unmounts."""
    mnt, back = tmp_path / "mnt", tmp_path / "back"
    mnt.mkdir()
    back.mkdir()
    proc = subprocess.Popen([sys.executable, __file__, "serve", str(mnt), str(back), "plain"])
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, "the test mount did not come up"
            time.sleep(0.02)
        threads = []
        for i in range(6):  # several threads busy at once, so that several are idle afterwards
            t = threading.Thread(target=lambda i=i: (mnt / f"f{i}").write_bytes(b"x" * 100000))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        started = stats(mnt)["threads"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not in_mount_table(mnt)
        print(f"\nthreads started: {started}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lazy_unmount(mnt)

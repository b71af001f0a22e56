"""FUSE passthrough with the patched pyfuse3 (native/, scripts/build-fuse.sh) on a tiny mount.

A standalone pyfuse3 file system (``PtFS`` below, no project code) serves a flat directory
whose files are backed by files in a backing directory. Run as
``python tests/test_passthrough_native.py serve MNT BACKDIR passthrough|plain`` it mounts
MNT in that process (the tests start it as a child, so a stuck daemon cannot hang pytest).
In ``passthrough`` mode every open/create registers the backing file with
``gateway/passthrough.py``'s ``open_backing`` (one backing id per inode, closed with its
last handle) and replies with ``FileInfo(backing_id=...)``; READ and WRITE requests that do
reach the daemon are counted and served from the backing file anyway. The counters are read
through the root's ``user.ptstats`` xattr (a GETXATTR, which is neither READ nor WRITE).

Passthrough must work where set-up ran (root, kernel >= 6.9, patched pyfuse3 on
libfuse >= 3.17): if it does not, these tests fail, with the reason, instead of skipping.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
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


def serve(mnt: str, backdir: str, mode: str) -> None:
    import pyfuse3
    import trio

    pt = load_passthrough()
    FUSEError = pyfuse3.FUSEError

    class PtFS(pyfuse3.Operations):
        def __init__(self, backdir: str, passthrough: bool):
            super().__init__()
            self.enable_passthrough = passthrough  # read by the patched pyfuse3 at INIT
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

        # helpers
        def _path(self, ino: int) -> str:
            if ino == pyfuse3.ROOT_INODE:
                return self.backdir
            try:
                return os.path.join(self.backdir, os.fsdecode(self.name_of[ino]))
            except KeyError:
                raise FUSEError(errno.ENOENT) from None

        def _ino(self, name: bytes) -> int:
            ino = self.ino_of.get(name)
            if ino is None:
                ino = self.ino_of[name] = self.next_ino
                self.name_of[ino] = name
                self.next_ino += 1
            return ino

        def _attrs(self, ino: int) -> "pyfuse3.EntryAttributes":
            try:
                st = os.lstat(self._path(ino))
            except OSError as e:
                raise FUSEError(e.errno) from None
            a = pyfuse3.EntryAttributes()
            a.st_ino = ino
            a.generation = 0
            a.entry_timeout = 1
            a.attr_timeout = 1
            for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                      "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
                setattr(a, k, getattr(st, k))
            return a

        def _handle(self, ino: int, fd: int) -> "pyfuse3.FileInfo":
            fh = self.next_fh
            self.next_fh += 1
            if not pyfuse3.passthrough_enabled():
                self.handles[fh] = (ino, fd)
                return pyfuse3.FileInfo(fh=fh)
            try:
                ent = self.backing.get(ino)
                if ent is None:  # first open of the inode: register its backing file
                    ent = self.backing[ino] = [pt.open_backing(fd), 0]
                    self.counts["backing_open"] += 1
                else:  # every further open of the inode reuses the same backing id
                    self.counts["backing_reuse"] += 1
                ent[1] += 1
            except OSError as e:
                raise FUSEError(e.errno) from None
            finally:
                os.close(fd)  # the kernel holds its own reference to the backing file
            self.handles[fh] = (ino, None)
            return pyfuse3.FileInfo(fh=fh, backing_id=ent[0])

        # namespace
        async def lookup(self, parent, name, ctx=None):
            if name in (b".", b".."):
                return self._attrs(pyfuse3.ROOT_INODE)
            if parent != pyfuse3.ROOT_INODE or not os.path.lexists(
                    os.path.join(self.backdir, os.fsdecode(name))):
                raise FUSEError(errno.ENOENT)
            return self._attrs(self._ino(name))

        async def getattr(self, inode, ctx=None):
            return self._attrs(inode)

        async def setattr(self, inode, attr, fields, fh, ctx):
            self.counts["setattr"] += 1
            path = self._path(inode)
            try:
                if fields.update_size:
                    os.truncate(path, attr.st_size)
                if fields.update_mode:
                    os.chmod(path, stat.S_IMODE(attr.st_mode))
                if fields.update_atime or fields.update_mtime:
                    st = os.lstat(path)
                    os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                       attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
            except OSError as e:
                raise FUSEError(e.errno) from None
            return self._attrs(inode)

        async def unlink(self, parent, name, ctx):
            try:
                os.unlink(os.path.join(self.backdir, os.fsdecode(name)))
            except OSError as e:
                raise FUSEError(e.errno) from None
            ino = self.ino_of.pop(name, None)
            if ino is not None:
                self.name_of.pop(ino, None)

        async def forget(self, inode_list):
            pass

        async def opendir(self, inode, ctx):
            if inode != pyfuse3.ROOT_INODE:
                raise FUSEError(errno.ENOTDIR)
            return inode

        async def readdir(self, fh, start_id, token):
            names = sorted(os.listdir(self.backdir))
            for i, name in enumerate(names[start_id:], start_id):
                b = os.fsencode(name)
                if not pyfuse3.readdir_reply(token, b, self._attrs(self._ino(b)), i + 1):
                    break

        async def releasedir(self, fh):
            pass

        async def statfs(self, ctx):
            sv = os.statvfs(self.backdir)
            out = pyfuse3.StatvfsData()
            for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                      "f_ffree", "f_favail", "f_namemax"):
                setattr(out, k, getattr(sv, k))
            return out

        async def getxattr(self, inode, name, ctx):
            if inode == pyfuse3.ROOT_INODE and name == STATS_XATTR.encode():
                return json.dumps({
                    "passthrough_enabled": pyfuse3.passthrough_enabled(),
                    "active_backing": len(self.backing),
                    "open_handles": len(self.handles),
                    **self.counts,
                }).encode()
            raise FUSEError(errno.ENODATA)

        # files: the backing file is always opened O_RDWR, because the one backing id of an
        # inode serves every later open of it, whatever its access mode.
        async def create(self, parent, name, mode, flags, ctx):
            self.counts["create"] += 1
            if parent != pyfuse3.ROOT_INODE:
                raise FUSEError(errno.ENOENT)
            try:
                fd = os.open(os.path.join(self.backdir, os.fsdecode(name)),
                             os.O_RDWR | os.O_CREAT | (flags & (os.O_EXCL | os.O_TRUNC)),
                             stat.S_IMODE(mode))
            except OSError as e:
                raise FUSEError(e.errno) from None
            ino = self._ino(name)
            return self._handle(ino, fd), self._attrs(ino)

        async def open(self, inode, flags, ctx):
            self.counts["open"] += 1
            try:
                fd = os.open(self._path(inode), os.O_RDWR | (flags & os.O_TRUNC))
            except OSError as e:
                raise FUSEError(e.errno) from None
            return self._handle(inode, fd)

        async def read(self, fh, off, size):
            self.counts["read"] += 1
            return os.pread(self._fd(fh), size, off)

        async def write(self, fh, off, buf):
            self.counts["write"] += 1
            return os.pwrite(self._fd(fh), buf, off)

        def _fd(self, fh: int) -> int:
            ino, fd = self.handles[fh]
            if fd is None:  # a READ/WRITE on a passthrough handle: serve it, it gets counted
                fd = os.open(self._path(ino), os.O_RDWR)
                self.handles[fh] = (ino, fd)
            return fd

        async def flush(self, fh):
            self.counts["flush"] += 1

        async def fsync(self, fh, datasync):
            self.counts["fsync"] += 1
            ino, fd = self.handles[fh]
            own = fd is None
            fd = os.open(self._path(ino), os.O_RDONLY) if own else fd
            try:
                (os.fdatasync if datasync else os.fsync)(fd)
            finally:
                if own:
                    os.close(fd)

        async def release(self, fh):
            self.counts["release"] += 1
            ino, fd = self.handles.pop(fh)
            if fd is not None:
                os.close(fd)
            ent = self.backing.get(ino)
            if ent is not None:
                ent[1] -= 1
                if ent[1] == 0:  # last handle of the inode: now the backing id may go
                    del self.backing[ino]
                    pt.close_backing(ent[0])
                    self.counts["backing_close"] += 1

    fs = PtFS(backdir, passthrough=(mode == "passthrough"))
    opts = set(pyfuse3.default_options)
    opts.add("fsname=ckptfs-passthrough-test")
    pyfuse3.init(fs, mnt, opts)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "serve":
    serve(sys.argv[2], sys.argv[3], sys.argv[4])
    sys.exit(0)


# -- the tests ---------------------------------------------------------------------------------

import pytest  # noqa: E402

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
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.path.ismount(mnt):  # a dead daemon's mount: lazy unmount
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
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
    import pyfuse3

    assert pyfuse3.HAVE_PASSTHROUGH is True
    assert pyfuse3.Operations.enable_passthrough is False  # opt-in
    assert pyfuse3.FileInfo(fh=1, backing_id=7).backing_id == 7
    assert pyfuse3.passthrough_enabled() is False  # no session in this process
    with pytest.raises(OSError) as ei:
        pt.open_backing(0)  # no session in this process
    assert ei.value.errno == errno.ENOTCONN


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

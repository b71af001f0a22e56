"""POSIX behaviour through a real FUSE mount, as a checkpoint writer or a shell sees it.

All tests share one mount (module scope) and work in their own directory.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    DATA_PATHS,
    both_data_paths,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    check_cache_dir,
    errno_of,
    needs_fuse,
    raw_readdir,
    renameat2,
)

# Every test here runs on both data paths (one mount per path: see conftest.DATA_PATHS).
data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

pytestmark = [needs_fuse, pytest.mark.mounted]

GiB = 1 << 30


def cache_file(gw, path: Path) -> Path:
    return gw.cache / "data" / f"{os.stat(path).st_ino:x}"


# -- open flags and access modes --------------------------------------------------------------


def test_open_creat_excl_trunc(mnt):
    p = mnt / "f"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, b"first version")
    os.close(fd)
    assert errno_of(os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644) == errno.EEXIST
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)  # no O_EXCL: opens the existing file
    assert os.read(fd, 100) == b"first version"
    os.close(fd)
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    assert os.fstat(fd).st_size == 0
    os.write(fd, b"2nd")
    os.close(fd)
    assert p.read_bytes() == b"2nd"
    fd = os.open(p, os.O_RDONLY | os.O_TRUNC)  # Linux truncates here too
    assert os.fstat(fd).st_size == 0 and os.read(fd, 10) == b""
    os.close(fd)
    assert errno_of(os.open, mnt / "missing", os.O_RDONLY) == errno.ENOENT


def test_o_append_appends_from_every_handle(mnt):
    p = mnt / "log"
    p.write_bytes(b"start\n")
    a = os.open(p, os.O_WRONLY | os.O_APPEND)
    b = os.open(p, os.O_WRONLY | os.O_APPEND)
    for i in range(5):
        os.write(a, b"a%d\n" % i)
        os.write(b, b"b%d\n" % i)
    os.close(a)
    os.close(b)
    assert p.read_bytes() == b"start\n" + b"".join(b"a%d\nb%d\n" % (i, i) for i in range(5))


def test_access_mode_is_honoured_per_handle(mnt):
    p = mnt / "f"
    p.write_bytes(b"data")
    wo = os.open(p, os.O_WRONLY)
    ro = os.open(p, os.O_RDONLY)
    assert errno_of(os.read, wo, 10) == errno.EBADF
    assert errno_of(os.write, ro, b"x") == errno.EBADF
    os.write(wo, b"D")
    os.fsync(wo)
    assert os.pread(ro, 10, 0) == b"Data"
    os.close(wo)
    os.close(ro)


# -- data ---------------------------------------------------------------------------------------------


def test_sparse_writes_and_offsets_past_4_gib(mnt, shared_gateway):
    p = mnt / "big"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"head", 0)
    os.pwrite(fd, b"beyond-4G", 4 * GiB + (1 << 20) + 7)
    os.pwrite(fd, b"edge", 4 * GiB - 2)
    os.fsync(fd)
    assert os.fstat(fd).st_size == 4 * GiB + (1 << 20) + 16
    assert os.pread(fd, 9, 4 * GiB + (1 << 20) + 7) == b"beyond-4G"
    assert os.pread(fd, 8, 4 * GiB - 4) == b"\0\0edge\0\0"
    assert os.pread(fd, 4096, 1 << 20) == bytes(4096)  # the hole reads as zeros
    os.close(fd)
    assert os.stat(p).st_size == 4 * GiB + (1 << 20) + 16
    cf = cache_file(shared_gateway, p)
    assert cf.stat().st_blocks * 512 < (1 << 24)  # the cache file is sparse too
    # st_blocks is derived from the size, not the allocation: du counts sparse files in full.
    assert os.stat(p).st_blocks == (4 * GiB + (1 << 20) + 16 + 511) // 512


def test_truncate_and_ftruncate(mnt):
    p = mnt / "t"
    p.write_bytes(b"0123456789")
    os.truncate(p, 4)
    assert p.read_bytes() == b"0123"
    os.truncate(p, 8)
    assert p.read_bytes() == b"0123\0\0\0\0"
    fd = os.open(p, os.O_RDWR)
    os.ftruncate(fd, 2)
    assert os.fstat(fd).st_size == 2
    os.pwrite(fd, b"Z", 5)
    os.close(fd)
    assert p.read_bytes() == b"01\0\0\0Z"
    assert errno_of(os.truncate, mnt, 0) == errno.EISDIR


def test_fsync_puts_data_and_size_on_the_cache_device(mnt, shared_gateway):
    p = mnt / "synced"
    payload = os.urandom(3 << 20)
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, payload)
    os.fsync(fd)
    # Without closing: the cache file holds the bytes and fsmeta the size.
    assert cache_file(shared_gateway, p).read_bytes() == payload
    from ckptfs.fsmeta import MetaStore

    meta = MetaStore(str(shared_gateway.cache / "meta"), create=False)
    try:
        with meta.read() as txn:
            assert txn.get_inode(os.stat(p).st_ino).size == len(payload)
    finally:
        meta.close()
    os.write(fd, b"more")
    os.fdatasync(fd)
    os.close(fd)
    assert p.read_bytes() == payload + b"more"


def _counter(gw, series: str) -> float:
    """The value of one series of the gateway's metrics (its name and labels), 0 if absent."""
    for line in gw.metrics().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def _ops(gw, op: str) -> float:
    return _counter(gw, f'ckptfs_fuse_requests_total{{op="{op}"}}')


def test_small_writes_reach_the_gateway_in_large_requests(mnt, shared_gateway):
    if shared_gateway.data_path == "passthrough":
        pytest.skip("writeback cache only: with passthrough, writes never reach the gateway")
    before = _ops(shared_gateway, "write")
    fd = os.open(mnt / "chunks", os.O_CREAT | os.O_WRONLY, 0o644)
    for _ in range(1024):
        os.write(fd, b"w" * 4096)  # returns once in the mount's page cache (writeback cache)
    os.close(fd)
    requests = _ops(shared_gateway, "write") - before
    assert 1 <= requests <= 16, requests  # 4 MiB in 1 MiB requests, not 1024 round trips
    assert (mnt / "chunks").read_bytes() == b"w" * (4 << 20)


def test_fsync_of_directories(mnt):
    d = mnt / "d"
    d.mkdir()
    (d / "f").write_bytes(b"x")
    for path in (d, mnt):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.fdatasync(fd)
        os.close(fd)


def test_shared_writable_mmap(mnt):
    p = mnt / "mapped"
    p.write_bytes(bytes(3 * 4096))
    fd = os.open(p, os.O_RDWR)
    m = mmap.mmap(fd, 3 * 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[0:5] = b"hello"
    m[8190:8194] = b"span"
    m.flush()
    m.close()
    os.fsync(fd)
    os.close(fd)
    data = p.read_bytes()
    assert data[:5] == b"hello" and data[8190:8194] == b"span" and len(data) == 3 * 4096


def test_o_direct_reads_and_writes(mnt):
    p = mnt / "direct"
    fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    buf = mmap.mmap(-1, 8192)  # page-aligned buffer
    buf.write(b"D" * 8192)
    assert os.pwritev(fd, [buf], 0) == 8192
    back = mmap.mmap(-1, 4096)
    assert os.preadv(fd, [back], 4096) == 4096
    assert bytes(back) == b"D" * 4096
    os.close(fd)
    assert p.read_bytes() == b"D" * 8192


# -- directories -------------------------------------------------------------------------------------


def test_o_tmpfile_is_not_supported(mnt):
    assert errno_of(os.open, mnt, os.O_TMPFILE | os.O_RDWR, 0o600) == errno.EOPNOTSUPP
    assert os.listdir(mnt) == []


def test_mkdir_rmdir_enotempty(mnt):
    d = mnt / "d"
    d.mkdir(mode=0o750)
    assert stat.S_IMODE(d.stat().st_mode) == 0o750 & ~0o022
    (d / "sub").mkdir()
    (d / "sub" / "f").write_bytes(b"")
    assert errno_of(os.rmdir, d) == errno.ENOTEMPTY
    assert errno_of(os.rmdir, d / "sub" / "f") == errno.ENOTDIR
    assert errno_of(os.unlink, d / "sub") == errno.EISDIR
    assert errno_of(os.mkdir, d) == errno.EEXIST
    assert d.stat().st_nlink == 3
    assert d.stat().st_size == 0  # not a block count as on ext4: nothing relies on it
    os.unlink(d / "sub" / "f")
    os.rmdir(d / "sub")
    os.rmdir(d)
    assert not d.exists()


def test_readdir_returns_no_dot_entries(mnt):
    (mnt / "a").write_bytes(b"")
    (mnt / "b").mkdir()
    assert sorted(raw_readdir(str(mnt))) == [b"a", b"b"]
    assert raw_readdir(str(mnt / "b")) == []


def test_readdir_stays_correct_while_the_directory_changes(mnt):
    d = mnt / "many"
    d.mkdir()
    n = 300  # a FUSE readdir request carries ~25 entries: many requests per listing
    for i in range(n):
        os.mknod(d / f"f{i:04d}")
    seen = []
    removed = set()
    with os.scandir(d) as it:
        for k, entry in enumerate(it):
            seen.append(entry.name)
            if k % 3 == 0:
                victim = f"f{(k * 7) % n:04d}"
                if victim not in removed and victim not in seen:
                    os.unlink(d / victim)
                    removed.add(victim)
                os.mknod(d / f"new{k:04d}")
    assert len(seen) == len(set(seen)), "an entry was returned twice"
    originals = {f"f{i:04d}" for i in range(n)}
    # Every entry that existed throughout is returned, exactly once.
    assert originals - removed <= set(seen)
    assert set(os.listdir(d)) == (originals - removed) | {n for n in os.listdir(d) if n.startswith("new")}


# -- names ---------------------------------------------------------------------------------------------


def test_unlink_of_an_open_file(mnt, shared_gateway):
    p = mnt / "open"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, b"still here")
    os.unlink(p)
    assert not p.exists()
    assert os.fstat(fd).st_nlink == 0
    os.pwrite(fd, b"STILL", 0)
    os.fsync(fd)
    assert os.pread(fd, 100, 0) == b"STILL here"
    ino = os.fstat(fd).st_ino
    os.close(fd)
    p.write_bytes(b"new file, same name")
    assert p.read_bytes() == b"new file, same name"
    assert os.stat(p).st_ino != ino


def test_unlinked_file_is_purged_once_closed_and_forgotten(mnt, shared_gateway):
    from ckptfs.fsmeta import MetaStore

    p = mnt / "gone"
    p.write_bytes(b"x" * 100000)
    ino = os.stat(p).st_ino
    data = shared_gateway.cache / "data" / f"{ino:x}"
    fd = os.open(p, os.O_RDONLY)
    os.unlink(p)
    time.sleep(0.3)
    assert data.exists()  # still open
    os.close(fd)
    deadline = time.monotonic() + 10
    while data.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel sends FORGET when it evicts the inode
    assert not data.exists()
    meta = MetaStore(str(shared_gateway.cache / "meta"), create=False)
    try:
        with meta.read() as txn:
            assert txn.get_inode(ino) is None and ino not in txn.iter_orphans()
    finally:
        meta.close()


def test_names_found_missing_or_moved_away_are_never_shown_stale(mnt):
    """A lookup miss is kept by the kernel (a negative entry): a name created, renamed or
    linked here right after is there at once, and a name renamed or unlinked here is gone
    at once, whatever the kernel cached about it."""
    a, b = mnt / "a", mnt / "b"
    for _ in range(2):
        assert not a.exists() and not b.exists()  # cached as missing from here on
    a.write_bytes(b"1")  # O_CREAT without O_EXCL over a cached "missing"
    assert a.read_bytes() == b"1"
    os.rename(a, b)
    assert not a.exists() and b.read_bytes() == b"1"
    os.mkdir(a)
    assert a.is_dir()
    os.rmdir(a)
    assert not a.exists()
    os.link(b, a)
    assert a.read_bytes() == b"1"
    os.unlink(b)
    assert not b.exists()
    os.symlink("a", b)
    assert os.readlink(b) == "a" and b.read_bytes() == b"1"
    fd = os.open(b, os.O_RDONLY)
    os.close(fd)
    os.rename(a, mnt / "c")
    assert not a.exists() and not b.exists()  # b dangles now
    assert sorted(os.listdir(mnt)) == ["b", "c"]


def test_rename_over_an_existing_file(mnt):
    (mnt / "tmp").write_bytes(b"new")
    (mnt / "final").write_bytes(b"old")
    reader = os.open(mnt / "final", os.O_RDONLY)
    os.rename(mnt / "tmp", mnt / "final")
    assert sorted(os.listdir(mnt)) == ["final"]
    assert (mnt / "final").read_bytes() == b"new"
    assert os.read(reader, 10) == b"old"  # the replaced file stays readable while open
    os.close(reader)


def test_rename_of_a_whole_directory(mnt):
    src = mnt / "step_100.tmp"
    (src / "shards").mkdir(parents=True)
    for i in range(5):
        (src / "shards" / f"{i}.distcp").write_bytes(bytes([i]) * 1000)
    (src / ".metadata").write_bytes(b"meta")
    os.rename(src, mnt / "step_100")
    assert not src.exists()
    dst = mnt / "step_100"
    assert sorted(os.listdir(dst)) == [".metadata", "shards"]
    for i in range(5):
        assert (dst / "shards" / f"{i}.distcp").read_bytes() == bytes([i]) * 1000
    (mnt / "empty").mkdir()
    os.rename(dst, mnt / "empty")  # over an empty directory
    assert (mnt / "empty" / ".metadata").read_bytes() == b"meta"
    (mnt / "full").mkdir()
    (mnt / "full" / "x").write_bytes(b"")
    assert errno_of(os.rename, mnt / "empty", mnt / "full") == errno.ENOTEMPTY


def test_rename_noreplace_and_exchange(mnt):
    a, b = mnt / "a", mnt / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    assert errno_of(renameat2, a, b, RENAME_NOREPLACE) == errno.EEXIST
    renameat2(a, b, RENAME_EXCHANGE)
    assert (a.read_bytes(), b.read_bytes()) == (b"B", b"A")
    d = mnt / "d"
    d.mkdir()
    (d / "inside").write_bytes(b"I")
    renameat2(a, d, RENAME_EXCHANGE)  # a file and a directory swap places
    assert (mnt / "a" / "inside").read_bytes() == b"I"
    assert (mnt / "d").read_bytes() == b"B"
    renameat2(b, mnt / "c", RENAME_NOREPLACE)
    assert sorted(os.listdir(mnt)) == ["a", "c", "d"]
    assert errno_of(renameat2, mnt / "c", mnt / "nothing", RENAME_EXCHANGE) == errno.ENOENT


def test_directory_renamed_into_its_own_subtree_is_einval(mnt):
    (mnt / "a" / "b" / "c").mkdir(parents=True)
    assert errno_of(os.rename, mnt / "a", mnt / "a" / "b" / "c" / "a") == errno.EINVAL
    assert errno_of(os.rename, mnt / "a", mnt / "a" / "x") == errno.EINVAL
    assert errno_of(renameat2, mnt / "a", mnt / "a" / "b", RENAME_EXCHANGE) == errno.EINVAL
    assert (mnt / "a" / "b" / "c").is_dir()


def test_hard_links(mnt):
    (mnt / "a").write_bytes(b"shared")
    os.link(mnt / "a", mnt / "b")
    assert os.stat(mnt / "a").st_nlink == 2
    assert os.stat(mnt / "a").st_ino == os.stat(mnt / "b").st_ino
    with open(mnt / "b", "r+b") as f:
        f.write(b"S")
    assert (mnt / "a").read_bytes() == b"Shared"
    os.unlink(mnt / "a")
    assert os.stat(mnt / "b").st_nlink == 1
    assert errno_of(os.link, mnt, mnt / "dirlink") == errno.EPERM
    assert errno_of(os.link, mnt / "b", mnt / "b") == errno.EEXIST


def test_symlink_and_readlink(mnt):
    (mnt / "target").write_bytes(b"pointed to")
    os.symlink("target", mnt / "link")
    os.symlink("/nonexistent/abs", mnt / "dangling")
    assert os.readlink(mnt / "link") == "target"
    assert os.readlink(mnt / "dangling") == "/nonexistent/abs"
    assert (mnt / "link").read_bytes() == b"pointed to"
    assert stat.S_ISLNK(os.lstat(mnt / "link").st_mode)
    assert os.lstat(mnt / "link").st_size == len("target")
    assert errno_of(os.readlink, mnt / "target") == errno.EINVAL


def test_chmod_chown_and_nanosecond_utimens(mnt):
    p = mnt / "f"
    p.write_bytes(b"")
    os.chmod(p, 0o4750)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o4750
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    ns = (1_600_000_000_123_456_789, 1_700_000_000_987_654_321)
    os.utime(p, ns=ns)
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == ns
    os.utime(mnt, ns=ns)
    assert os.stat(mnt).st_mtime_ns == ns[1]
    before = time.time_ns()
    os.utime(p)  # UTIME_NOW
    assert os.stat(p).st_mtime_ns >= before - 10**9


def test_write_updates_mtime_reads_leave_atime(mnt):
    p = mnt / "times"
    p.write_bytes(b"a")
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    with open(p, "ab") as f:
        f.write(b"b")
    st = os.stat(p)
    assert st.st_mtime_ns > 1_000_000_000 and st.st_ctime_ns >= st.st_mtime_ns - 10**9
    p.read_bytes()
    assert os.stat(p).st_atime_ns == 1_000_000_000


def test_stat_after_utime_then_append_shows_the_append_every_time(mnt):
    # Each step races the RELEASE of the close before it, which close(2) does not wait
    # for: before their fixes, one run in twenty showed the size before the append, and
    # one in 400 lost the first byte (tests/regressions/test_found_bugs.py).
    for i in range(100):
        p = mnt / f"append{i}"
        p.write_bytes(b"a")
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))
        with open(p, "ab") as f:
            f.write(b"b")
        st = os.stat(p)
        assert (st.st_size, st.st_mtime_ns > 1_000_000_000) == (2, True), i
        assert p.read_bytes() == b"ab", i


def test_flock_and_fcntl_locks_work_within_the_node(mnt):
    import fcntl

    p = mnt / "lock"
    p.write_bytes(b"")
    a = os.open(p, os.O_RDWR)
    b = os.open(p, os.O_RDWR)
    fcntl.flock(a, fcntl.LOCK_EX)
    assert errno_of(fcntl.flock, b, fcntl.LOCK_EX | fcntl.LOCK_NB) == errno.EWOULDBLOCK
    fcntl.flock(a, fcntl.LOCK_UN)
    fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.lockf(a, fcntl.LOCK_EX | fcntl.LOCK_NB)  # POSIX record locks are per process
    r = subprocess.run([sys.executable, "-c", f"import fcntl; fcntl.lockf(open({str(p)!r}, 'r+'), fcntl.LOCK_EX | fcntl.LOCK_NB)"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Resource temporarily unavailable" in r.stderr
    os.close(a)
    os.close(b)


def test_posix_fallocate_extends_the_file(mnt):
    p = mnt / "prealloc"
    p.write_bytes(b"abc")
    fd = os.open(p, os.O_RDWR)
    os.posix_fallocate(fd, 0, 1 << 20)  # emulated by writing: FUSE has no fallocate here
    assert os.fstat(fd).st_size == 1 << 20
    assert os.pread(fd, 5, 0) == b"abc\0\0"
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
    assert libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, 0, 4096) == -1
    assert ctypes.get_errno() == errno.EOPNOTSUPP  # no native fallocate: hole punching is refused
    assert os.pread(fd, 3, 0) == b"abc"
    os.close(fd)


def test_statfs_reports_the_cache_device(mnt, shared_gateway):
    st = os.statvfs(mnt)
    ref = os.statvfs(shared_gateway.cache)
    assert (st.f_bsize, st.f_frsize, st.f_blocks, st.f_files) == (ref.f_bsize, ref.f_frsize, ref.f_blocks, ref.f_files)
    assert abs(st.f_bavail - ref.f_bavail) * ref.f_frsize < 1 << 30
    assert st.f_namemax == 255


def test_user_xattrs(mnt):
    p = mnt / "f"
    p.write_bytes(b"")
    os.setxattr(p, "user.step", b"100")
    os.setxattr(mnt, "user.run", b"abc")
    assert os.getxattr(p, "user.step") == b"100"
    assert os.getxattr(mnt, "user.run") == b"abc"
    assert os.listxattr(p) == ["user.step"]
    assert errno_of(os.setxattr, p, "user.step", b"1", os.XATTR_CREATE) == errno.EEXIST
    assert errno_of(os.setxattr, p, "user.nope", b"1", os.XATTR_REPLACE) == errno.ENODATA
    os.setxattr(p, "user.step", b"200", os.XATTR_REPLACE)
    assert os.getxattr(p, "user.step") == b"200"
    os.removexattr(p, "user.step")
    assert errno_of(os.getxattr, p, "user.step") == errno.ENODATA
    assert errno_of(os.setxattr, p, "trusted.x", b"1") == errno.ENOTSUP
    assert os.getxattr(p, "user.ckptfs.state") == b"dirty"
    assert errno_of(os.setxattr, p, "user.ckptfs.state", b"durable") == errno.EPERM


def test_mknod_makes_fifos_sockets_devices_and_files(mnt):
    os.mkfifo(mnt / "fifo", 0o640)
    st = os.stat(mnt / "fifo")
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_size == 0
    os.mknod(mnt / "null", stat.S_IFCHR | 0o644, os.makedev(1, 3))
    st = os.stat(mnt / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    # A UNIX socket bound in a directory on the mount (relative path: sun_path is short).
    subprocess.run([sys.executable, "-c", "import socket; socket.socket(socket.AF_UNIX).bind('sock')"],
                   cwd=mnt, check=True)
    assert stat.S_ISSOCK(os.stat(mnt / "sock").st_mode)
    os.mknod(mnt / "COMPLETE", stat.S_IFREG | 0o600)
    st = os.stat(mnt / "COMPLETE")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0
    assert (mnt / "COMPLETE").read_bytes() == b""
    assert sorted(os.listdir(mnt)) == ["COMPLETE", "fifo", "null", "sock"]


def test_names_reserved_by_the_file_bucket_are_einval(mnt):
    assert errno_of(os.open, mnt / ".ckptfs-m.x", os.O_CREAT | os.O_WRONLY) == errno.EINVAL
    assert errno_of(os.mkdir, mnt / ".ckptfs-multipart") == errno.EINVAL
    (mnt / "f").write_bytes(b"x")
    assert errno_of(os.rename, mnt / "f", mnt / ".ckptfs-tmp.1") == errno.EINVAL
    assert errno_of(os.link, mnt / "f", mnt / ".ckptfs-x") == errno.EINVAL
    assert errno_of(os.symlink, "f", mnt / ".ckptfs-x") == errno.EINVAL
    assert os.listdir(mnt) == ["f"]


def test_name_rules(mnt):
    assert errno_of(os.open, mnt / ("n" * 256), os.O_CREAT | os.O_WRONLY) == errno.ENAMETOOLONG
    (mnt / ("n" * 255)).write_bytes(b"ok")
    assert errno_of(os.mkdir, os.fsencode(mnt) + b"/bad\xff") == errno.EILSEQ
    (mnt / "ünïcödé ✓").write_bytes(b"")
    assert "ünïcödé ✓" in os.listdir(mnt)


def test_bucket_key_length_limit_on_deep_paths(mnt):
    # file:// bucket, no prefix: the key is the path below the mountpoint.
    base_len = len(mnt.name) + 1
    d = mnt
    for c in "abcd":
        d = d / (c * 200)
        d.mkdir()
    room = 1024 - base_len - 4 * 201
    assert errno_of(os.open, d / ("x" * (room + 1)), os.O_CREAT | os.O_WRONLY) == errno.ENAMETOOLONG
    assert errno_of(os.mkdir, d / ("y" * room)) == errno.ENAMETOOLONG  # plus its "/"
    (d / ("x" * room)).write_bytes(b"exactly 1024")
    (mnt / "short").write_bytes(b"")
    assert errno_of(os.rename, mnt / "short", d / ("z" * (room + 1))) == errno.ENAMETOOLONG
    assert (mnt / "short").exists()
    assert errno_of(os.rename, mnt / ("a" * 200), mnt / ("a" * 201)) == errno.ENAMETOOLONG


def test_namespace_is_consistent_after_all_of_it(mnt, shared_gateway):
    # Runs last in this module: everything above left fsmeta consistent.
    subprocess.run(["sync"], check=False)
    assert check_cache_dir(shared_gateway.cache) == []


# -- a directory's attributes right after a change (the front end answers that GETATTR) --------

def test_a_changed_directory_shows_what_each_change_left_at_once(mnt):
    a, b = mnt / "a", mnt / "b"
    a.mkdir()
    b.mkdir()

    def changes(change, *expect):
        """Run ``change``; then each (dir, nlink) of ``expect`` shows that link count and a
        newer mtime and ctime, right away."""
        before = {d: os.stat(d) for d, _ in expect}
        change()
        for d, nlink in expect:
            st = os.stat(d)
            assert st.st_nlink == nlink, (change, d)
            assert st.st_mtime_ns > before[d].st_mtime_ns and st.st_ctime_ns > before[d].st_ctime_ns, (change, d)

    changes(lambda: (a / "f").write_bytes(b"x"), (a, 2))
    changes(lambda: (a / "sub").mkdir(), (a, 3))
    changes(lambda: os.symlink("f", a / "l"), (a, 3))
    changes(lambda: os.link(a / "f", a / "g"), (a, 3))
    changes(lambda: os.mkfifo(a / "p"), (a, 3))
    changes(lambda: os.rename(a / "f", a / "h"), (a, 3))
    changes(lambda: os.rename(a / "h", b / "h"), (a, 3), (b, 2))
    changes(lambda: os.rename(a / "sub", b / "sub"), (a, 2), (b, 3))
    changes(lambda: os.rmdir(b / "sub"), (b, 2))
    changes(lambda: os.unlink(b / "h"), (b, 2))
    # Changes of the directory itself, right after a change in it.
    (a / "q").write_bytes(b"")
    a.chmod(0o700)
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o700
    (a / "r").write_bytes(b"")
    before = os.stat(a).st_ctime_ns
    os.setxattr(a, "user.note", b"1")
    assert os.stat(a).st_ctime_ns > before


def test_a_directory_removed_or_replaced_right_after_a_change_in_it_shows_no_links(mnt):
    for how in ("rmdir", "rename over it"):
        d, other = mnt / "gone", mnt / "other"
        d.mkdir()
        other.mkdir()
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            (d / "f").write_bytes(b"x")  # a change in it: the front end keeps its attributes
            os.unlink(d / "f")
            assert os.fstat(fd).st_nlink == 2
            if how == "rmdir":
                os.rmdir(d)
            else:
                os.rename(other, d)
            assert os.fstat(fd).st_nlink == 0, how
        finally:
            os.close(fd)
        os.rmdir(d if how != "rmdir" else other)


def test_concurrent_changes_of_one_directory_leave_it_showing_the_last_state(mnt):
    """Four threads changing one directory (the kernel runs the changes one at a time, with
    their lookups and GETATTRs in between): what stat shows right after them is what the
    gateway shows once every cached attribute has timed out (the kernel's and the front end's
    keep a reply for at most 1 s)."""
    import threading

    d = mnt / "busy"
    d.mkdir()

    def churn(t: int) -> None:
        for i in range(60):
            (d / f"{t}-{i}").write_bytes(b"x")
            (d / f"s{t}-{i}").mkdir()
            os.rename(d / f"{t}-{i}", d / f"{t}-{i}.done")
            if i % 2:
                os.rmdir(d / f"s{t}-{i}")

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    right_after = os.stat(d)
    time.sleep(1.5)
    settled = os.stat(d)
    assert (right_after.st_nlink, right_after.st_mtime_ns, right_after.st_ctime_ns) == \
        (settled.st_nlink, settled.st_mtime_ns, settled.st_ctime_ns)
    assert settled.st_nlink == 2 + 4 * 30


def test_the_getattr_after_each_create_is_answered_by_the_front_end(mnt, shared_gateway):
    answered_before = _counter(shared_gateway, "ckptfs_fuse_dir_attrs_answered_total")
    asked_before = _ops(shared_gateway, "getattr")
    for i in range(200):
        (mnt / f"f{i}").write_bytes(b"x")
    answered = _counter(shared_gateway, "ckptfs_fuse_dir_attrs_answered_total") - answered_before
    asked = _ops(shared_gateway, "getattr") - asked_before
    if asked < 100:
        pytest.skip(f"this kernel asked for attributes {asked:.0f} times in 200 creates (6.18: once each)")
    # The directory's, once per create (the kernel's permission check before the next one); a
    # reply kept for 1 s could only be missed after a stall of over a second.
    assert answered >= 100, (answered, asked)

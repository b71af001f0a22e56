"""kill -9 of the gateway, then a new mount on the same cache directory.

What fsync acknowledged is there byte for byte; the namespace is one that existed
(no half-applied rename, no lost entry); un-fsynced data may be lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time

import pytest

from ckptfs.gateway.mount import DEAD_MOUNT_ERRNOS
from conftest import DATA_PATHS, both_data_paths, check_cache_dir, needs_fuse, tree

# Every test here runs on both data paths (one mount per path: see conftest.DATA_PATHS).
data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

pytestmark = [needs_fuse, pytest.mark.mounted]


def crash_and_remount(gw):
    gw.kill9()
    # The kernel still has the mount, but nobody serves it.
    with pytest.raises(OSError) as exc:
        os.statvfs(gw.mnt)
    assert exc.value.errno in DEAD_MOUNT_ERRNOS  # ECONNABORTED where the gateway used io_uring
    # `ckptfs mount` itself clears the dead mountpoint (lazy unmount) and mounts again,
    # right away (a supervisor restarting the gateway does not wait).
    gw.start()
    assert "clearing the dead mount" in gw.log()


def test_fsynced_files_survive_kill9_byte_for_byte(gateway):
    m = gateway.mnt
    rnd = os.urandom
    (m / "run" / "step_1").mkdir(parents=True)
    files = {
        "run/step_1/model.pt": rnd(3 << 20),
        "run/step_1/optim.pt": rnd(123457),
        "run/step_1/empty": b"",
        "run/notes.txt": b"hello\n",
    }
    for rel, data in files.items():
        fd = os.open(m / rel, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
    # Sparse file with data past 4 GiB (outside the compared tree: reading 4 GiB is slow).
    (m / "big").mkdir()
    fd = os.open(m / "big" / "sparse.bin", os.O_CREAT | os.O_WRONLY, 0o600)
    os.pwrite(fd, b"far", (4 << 30) + (1 << 20) + 1)
    os.pwrite(fd, b"near", 10)
    os.fdatasync(fd)
    os.close(fd)
    # The atomic-save pattern: write a temp file, fsync, rename over the old one, fsync the dir.
    (m / "run" / "latest").write_bytes(b"step_0")
    fd = os.open(m / "run" / "latest.tmp", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"step_1")
    os.fsync(fd)
    os.close(fd)
    os.rename(m / "run" / "latest.tmp", m / "run" / "latest")
    # A whole checkpoint directory renamed into place.
    os.rename(m / "run" / "step_1", m / "run" / "step_1.done")
    os.link(m / "run" / "notes.txt", m / "run" / "notes.link")
    os.symlink("step_1.done", m / "run" / "current")
    os.chmod(m / "run" / "notes.txt", 0o600)
    os.setxattr(m / "run" / "latest", "user.step", b"1")
    dfd = os.open(m / "run", os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    # A file still open for writing at the crash, its fsynced part must be there.
    live = os.open(m / "run" / "live.log", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(live, b"acknowledged\n")
    os.fsync(live)
    expected = tree(m / "run")
    expected_sparse_size = os.stat(m / "big" / "sparse.bin").st_size
    ino_notes = os.stat(m / "run" / "notes.txt").st_ino
    os.write(live, b"never acknowledged\n")  # neither fsynced nor closed: cut at recovery

    crash_and_remount(gateway)
    with contextlib.suppress(OSError):
        os.close(live)  # the old handle belongs to the dead connection (ENOTCONN)

    assert tree(m / "run") == expected
    assert os.stat(m / "big" / "sparse.bin").st_size == expected_sparse_size
    with open(m / "big" / "sparse.bin", "rb") as f:
        assert os.pread(f.fileno(), 8, 8) == b"\0\0near\0\0"
        assert os.pread(f.fileno(), 10, (4 << 30) + (1 << 20) - 2) == b"\0\0\0far"
    assert os.stat(m / "run" / "notes.link").st_ino == os.stat(m / "run" / "notes.txt").st_ino == ino_notes
    assert os.stat(m / "run" / "notes.txt").st_nlink == 2
    assert os.stat(m / "run" / "notes.txt").st_mode & 0o777 == 0o600
    assert os.getxattr(m / "run" / "latest", "user.step") == b"1"
    gateway.stop()
    assert check_cache_dir(gateway.cache) == []


SAVER = r'''
import os, sys, hashlib
root = sys.argv[1]
i = 0
while True:
    data = hashlib.sha256(b"%d" % i).digest() * (1 + i % 700)
    try:
        tmp = os.path.join(root, "ckpt_%d.tmp" % i)
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, data)
        if i % 2 == 0:
            os.fsync(fd)
        os.close(fd)
        os.rename(tmp, os.path.join(root, "ckpt_%d" % i))
        d = os.path.join(root, "step_%d.tmp" % i)
        os.mkdir(d)
        for k in range(3):
            fd = os.open(os.path.join(d, "shard%d" % k), os.O_CREAT | os.O_WRONLY, 0o644)
            os.write(fd, data[:1000 + k])
            os.fsync(fd)
            os.close(fd)
        os.rename(d, os.path.join(root, "step_%d" % i))
        if i > 3:
            os.unlink(os.path.join(root, "ckpt_%d" % (i - 4)))
    except OSError as e:
        print("error", i, e.errno, flush=True)
        break
    print("done", i, flush=True)
    i += 1
'''

SWAPPER = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = (os.fsencode(os.path.join(sys.argv[1], n)) for n in ("A", "B"))
while libc.renameat2(-100, a, -100, b, 2) == 0:
    pass
'''


def expected_data(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest() * (1 + i % 700)


def test_crash_during_saves_leaves_no_torn_namespace(gateway):
    m = gateway.mnt
    (m / "A").write_bytes(b"content of A")
    (m / "B").write_bytes(b"content of B")
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(m)], stdout=subprocess.PIPE, text=True)
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(m)])
    done = -1
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        line = saver.stdout.readline()
        if line.startswith("done"):
            done = int(line.split()[1])
    assert done >= 3, "the saver made no progress"
    gateway.kill9()
    for line in saver.stdout:  # what finished between our last read and the kill
        if line.startswith("done"):
            done = int(line.split()[1])
    saver.wait(30)
    swapper.wait(30)

    gateway.start()
    names = set(os.listdir(m))
    # Every rename that an fsync followed is there (step i+1 fsyncs its shards, which syncs
    # fsmeta), and none is half-applied. Step `done` and the one in flight may be lost,
    # each only from some point on (the namespace is a prefix of the operations).
    for i in range(done):
        assert f"ckpt_{i}.tmp" not in names
        assert f"step_{i}.tmp" not in names
        if i not in (done - 4, done - 3):  # unlinked by steps `done` and `done + 1`, or not
            assert (f"ckpt_{i}" in names) == (i > done - 4), i
        assert sorted(os.listdir(m / f"step_{i}")) == ["shard0", "shard1", "shard2"]
        for k in range(3):  # fsynced before the rename
            assert (m / f"step_{i}" / f"shard{k}").read_bytes() == expected_data(i)[:1000 + k]
        if f"ckpt_{i}" in names:
            # Fsynced (even i) or only closed (odd i): a gateway crash keeps what close() had
            # handed to the cache file (the kernel's page cache survives; a power cut might not).
            assert (m / f"ckpt_{i}").read_bytes() == expected_data(i)
    # The steps that an fsync may not cover: one name or the other, never both, and a later
    # operation of the step only with the earlier ones.
    for i in (done, done + 1):
        assert not (f"ckpt_{i}.tmp" in names and f"ckpt_{i}" in names)
        assert not (f"step_{i}.tmp" in names and f"step_{i}" in names)
        if f"step_{i}" in names:
            assert f"ckpt_{i}" in names and sorted(os.listdir(m / f"step_{i}")) == ["shard0", "shard1", "shard2"]
    for n in names - {"A", "B"}:
        assert n.split(".")[0].rsplit("_", 1)[1].isdigit() and int(n.split(".")[0].rsplit("_", 1)[1]) <= done + 1
    # Un-fsynced data may be lost, but what a file shows is within its recorded size.
    for n in names:
        if n.startswith("ckpt_") and not n.endswith(".tmp"):
            data = (m / n).read_bytes()
            assert len(data) == os.stat(m / n).st_size
    # Thousands of RENAME_EXCHANGEs were cut by the crash: both names, both contents, swapped or not.
    assert {(m / "A").read_bytes(), (m / "B").read_bytes()} == {b"content of A", b"content of B"}
    gateway.stop()
    assert check_cache_dir(gateway.cache) == []


CREATOR = r'''
import os, sys
root = sys.argv[1]
i = 0
while True:
    fd = os.open(os.path.join(root, "f%06d" % i), os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"%d\n" % i * 100)
    os.close(fd)
    if i % 100 == 99:
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        print("synced", i, flush=True)
    i += 1
'''


def test_unsynced_operations_lost_in_a_crash_are_a_prefix_and_fsynced_ones_survive(gateway):
    """Namespace changes are committed in batches and made durable by fsync/fsyncdir: a kill -9
    may lose the latest creates that no fsync covered, but what survives is the files up to
    some point, each (but maybe the last) with its bytes, and all that the last fsyncdir covered."""
    m = gateway.mnt
    (m / "d").mkdir()
    creator = subprocess.Popen([sys.executable, "-c", CREATOR, str(m / "d")], stdout=subprocess.PIPE, text=True)
    synced = -1
    try:
        while synced < 499:
            line = creator.stdout.readline()
            assert line, "the creator died"
            synced = int(line.split()[1])
        gateway.kill9()
    finally:
        creator.kill()
        creator.wait(30)
    gateway.start()
    found = sorted(int(n[1:]) for n in os.listdir(m / "d"))
    assert found == list(range(len(found))), "a file survived without one created before it"
    assert len(found) > synced
    for i in found[:-1]:  # closed before the next create, which survived
        assert (m / "d" / f"f{i:06d}").read_bytes() == b"%d\n" % i * 100
    assert (m / "d" / f"f{found[-1]:06d}").read_bytes() in (b"", b"%d\n" % found[-1] * 100)
    gateway.stop()
    assert check_cache_dir(gateway.cache) == []


def test_unlinked_open_file_is_purged_after_a_crash(gateway):
    m = gateway.mnt
    fd = os.open(m / "scratch", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, b"x" * 100000)
    os.fsync(fd)
    ino = os.fstat(fd).st_ino
    os.unlink(m / "scratch")
    (m / "keep").write_bytes(b"kept")
    dfd = os.open(m, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)  # the unlink and the create are durable from here (before, a crash may lose them)
    os.close(dfd)
    data_file = gateway.cache / "data" / f"{ino:x}"
    assert data_file.exists()
    crash_and_remount(gateway)
    with contextlib.suppress(OSError):
        os.close(fd)
    assert os.listdir(m) == ["keep"]
    assert not data_file.exists()
    gateway.stop()
    from ckptfs.fsmeta import MetaStore

    meta = MetaStore(str(gateway.cache / "meta"), create=False)
    try:
        with meta.read() as txn:
            assert txn.get_inode(ino) is None and txn.iter_orphans() == []
    finally:
        meta.close()


def test_dead_mountpoint_is_cleared_by_the_next_mount_only(gateway_factory):
    gw = gateway_factory()
    gw.kill9()
    with pytest.raises(OSError) as exc:
        os.statvfs(gw.mnt)
    assert exc.value.errno in DEAD_MOUNT_ERRNOS
    gw.start()  # immediately: stat of the dead mount may still be served from the attr cache
    assert os.path.ismount(gw.mnt) and os.listdir(gw.mnt) == []
    # A live mount is never "cleared": a second gateway is refused (and the first keeps serving).
    r = subprocess.run(gw.argv(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert gw.alive and os.listdir(gw.mnt) == []


def test_umount_clears_the_mount_of_a_dead_gateway(gateway_factory):
    gw = gateway_factory()
    gw.kill9()
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ckptfs"), "umount", gw.mnt],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "died" in r.stderr
    assert not os.path.ismount(gw.mnt)
    os.statvfs(gw.mnt)  # a plain directory again, no ENOTCONN

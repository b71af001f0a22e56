"""Hostile workloads and handler bugs must leave the mount alive and its namespace consistent."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import DATA_PATHS, both_data_paths, check_cache_dir, needs_fuse, tree

# Every test here runs on both data paths (one mount per path: see conftest.DATA_PATHS).
data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

pytestmark = [needs_fuse, pytest.mark.mounted]

WORKER = r'''
import errno, json, mmap, os, random, sys, time
root, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = random.Random(seed)
NAMES = ["a", "b", "c", "d", "e"]
def path():
    parts = [rng.choice(NAMES) for _ in range(rng.randint(1, 3))]
    return os.path.join(root, *parts)
errs = {}
where = {}  # error name -> the operations (op numbers) that got it
ops = 0
aligned = mmap.mmap(-1, 8192)
aligned.write(bytes([seed % 256]) * 8192)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    op = rng.randrange(12)
    p, q = path(), path()
    ops += 1
    try:
        if op == 0:
            fd = os.open(p, os.O_CREAT | os.O_WRONLY | rng.choice([0, os.O_TRUNC, os.O_APPEND]), 0o644)
            try:
                os.pwrite(fd, os.urandom(rng.randint(0, 70000)), rng.randint(0, 1 << 20))
                if rng.random() < 0.3:
                    os.fsync(fd)
            finally:
                os.close(fd)
        elif op == 1:
            os.rename(p, q)
        elif op == 2:
            os.truncate(p, rng.randint(0, 200000))
        elif op == 3:
            os.unlink(p)
        elif op == 4:
            os.mkdir(p)
        elif op == 5:
            os.rmdir(p)
        elif op == 6:
            fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
            try:
                os.pwritev(fd, [aligned], 4096 * rng.randint(0, 16))
                buf = mmap.mmap(-1, 4096)
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
        elif op == 7:
            with open(p, "rb") as f:
                f.read()
        elif op == 8:
            os.listdir(p)
        elif op == 9:
            os.link(p, q)
        elif op == 10:
            fd = os.open(p, os.O_RDWR)
            try:
                os.unlink(p)
                os.pwrite(fd, b"after unlink", 0)
                os.ftruncate(fd, rng.randint(0, 100))
            finally:
                os.close(fd)
        else:
            os.setxattr(p, "user.k", os.urandom(8))
    except OSError as e:
        name = errno.errorcode.get(e.errno, str(e.errno))
        errs[name] = errs.get(name, 0) + 1
        where.setdefault(name, set()).add(op)
print(json.dumps({"ops": ops, "errors": errs, "where": {k: sorted(v) for k, v in where.items()}}))
'''

# Errors the random operations may legitimately get on a local filesystem.
EXPECTED = {"ENOENT", "EEXIST", "ENOTEMPTY", "ENOTDIR", "EISDIR", "EINVAL", "EPERM", "EBUSY"}


def test_hostile_concurrent_workload_leaves_mount_alive_and_consistent(gateway):
    work = gateway.mnt / "work"
    work.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(work), str(seed), "6"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed in range(8)
    ]
    results = []
    for p in procs:
        out, errout = p.communicate(timeout=120)
        assert p.returncode == 0, errout
        results.append(json.loads(out))
    total = sum(r["ops"] for r in results)
    seen = {}
    for r in results:
        for name, n in r["errors"].items():
            seen[name] = seen.get(name, 0) + n
    print(f"{total} operations, errors: {seen}")
    assert total > 200, results
    where = {name: sorted({op for r in results for op in r["where"].get(name, [])}) for name in set(seen) - EXPECTED}
    assert set(seen) <= EXPECTED, f"unexpected errors from the mount: {seen}; got by op numbers {where}"
    assert gateway.alive
    # The mount still works, and what it shows is stable across a clean remount.
    (gateway.mnt / "after").write_bytes(b"alive")
    before = tree(gateway.mnt)
    assert gateway.stop() == 0
    assert check_cache_dir(gateway.cache) == []
    gateway.start()
    assert tree(gateway.mnt) == before


def test_unexpected_handler_exception_is_eio_logged_counted_and_survived(gateway):
    from ckptfs.fsmeta import MetaStore, schema

    gateway.expect_unexpected = True  # the log lines are the point of this test
    p = gateway.mnt / "victim"
    p.write_bytes(b"data")
    ino = os.stat(p).st_ino
    meta = MetaStore(str(gateway.cache / "meta"), create=False)
    try:
        # A record the code cannot parse stands in for "a bug in a handler".
        def corrupt(txn):
            txn.raw.put(schema.ino_key(ino), b'{"not": "a remote record"}', db=txn.dbs["remote"])

        meta.write(corrupt)
        with pytest.raises(OSError) as exc:
            os.getxattr(p, "user.ckptfs.blake3")
        assert exc.value.errno == errno.EIO
        with pytest.raises(OSError) as exc:
            os.unlink(p)  # fails inside its transaction ...
        assert exc.value.errno == errno.EIO
        assert p.read_bytes() == b"data"  # ... which changed nothing
        assert gateway.alive
        (gateway.mnt / "other").write_bytes(b"still serving")
        assert (gateway.mnt / "other").read_bytes() == b"still serving"

        def repair(txn):
            txn.raw.delete(schema.ino_key(ino), db=txn.dbs["remote"])

        meta.write(repair)
        os.unlink(p)
        assert not p.exists()
    finally:
        meta.close()
    deadline = time.monotonic() + 5
    while "failed unexpectedly" not in gateway.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in gateway.log().splitlines() if "failed unexpectedly" in line]
    assert any("getxattr" in line for line in lines) and any("unlink" in line for line in lines)
    metrics = gateway.metrics()
    assert 'ckptfs_fuse_unexpected_errors_total{op="getxattr"} 1.0' in metrics
    assert 'ckptfs_fuse_unexpected_errors_total{op="unlink"} 1.0' in metrics


def test_a_fault_in_native_code_leaves_every_threads_stack_in_the_log(gateway_factory):
    """A fault in the front end, libfuse or LMDB kills the process from native code:
    faulthandler writes the Python stack of every thread to the log (stderr) first. (Added
    while the churn hunt's silent deaths were not explained; they were SIGIO, next test.)"""
    gw = gateway_factory()
    (gw.mnt / "f").write_bytes(b"x")
    os.kill(gw.proc.pid, signal.SIGSEGV)  # what a fault in native code raises
    assert gw.proc.wait(30) == -signal.SIGSEGV
    log = gw.log()
    assert "Fatal Python error: Segmentation fault" in log
    assert log.count("Thread 0x") >= 2, log[-3000:]  # the FUSE threads too, not only the main one
    gw.clear_dead_mount()


def test_the_signal_of_a_lease_break_does_not_end_the_gateway(gateway_factory):
    """The churn hunt's silent gateway deaths (exit status -SIGIO): when another process (the
    drain) opens a cache file while the gateway holds a lease on it to recycle it, the kernel
    sends the gateway SIGIO, whose default action ends a process without a trace
    (tests/regressions/test_churn_found.py makes that lease break happen)."""
    gw = gateway_factory()
    (gw.mnt / "f").write_bytes(b"x")
    os.kill(gw.proc.pid, signal.SIGIO)  # what a lease break sends
    time.sleep(0.2)
    assert gw.alive, f"exit status {gw.proc.returncode}"
    assert (gw.mnt / "f").read_bytes() == b"x"
    assert gw.stop() == 0

"""Creates on a mount, many at once: the one-transaction create (FsCore.create) behind the
FUSE front end's threads (native/), past their limit of 64 at once."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time

import pytest
from conftest import DATA_PATHS, both_data_paths, ckptfs_cmd, needs_fuse

# Every test here runs on both data paths (one mount per path: see conftest.DATA_PATHS).
data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

pytestmark = [needs_fuse, pytest.mark.mounted]

THREADS = 96  # more than the 40 worker threads: jobs wait in the queue


def test_many_concurrent_creates_each_get_their_file_and_bytes(gateway):
    """Every thread creates, writes, closes and renames its own files at the same moment;
    each file ends with its own bytes, none fails, and the gateway logs no unexpected error
    (the ``gateway`` fixture checks its log)."""
    top = gateway.mnt / "many"
    top.mkdir()
    start = threading.Barrier(THREADS)
    failures: list[BaseException] = []

    def body(n: int) -> bytes:
        return f"file {n}\n".encode() * (n + 1)

    def work(t: int) -> None:
        try:
            start.wait(30)
            for k in range(5):
                n = t * 5 + k
                path = top / f"f{n}"
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                try:
                    os.write(fd, body(n))
                    if k == 0:
                        os.fsync(fd)
                    if k == 1:  # renamed and written again while still open
                        os.rename(path, top / f"r{n}")
                        path = top / f"r{n}"
                        os.write(fd, body(n))
                finally:
                    os.close(fd)
                if k == 2:  # unlinked at once
                    os.unlink(path)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a create never returned"
    assert failures == []
    expected = {}
    for t in range(THREADS):
        for k in (0, 1, 3, 4):
            n = t * 5 + k
            expected[f"r{n}" if k == 1 else f"f{n}"] = body(n) * (2 if k == 1 else 1)
    assert sorted(os.listdir(top)) == sorted(expected)
    for name, data in expected.items():
        assert (top / name).read_bytes() == data, name


def test_a_file_created_read_only_or_by_mknod_takes_bytes_from_a_later_writer(gateway):
    """Neither an O_CREAT|O_RDONLY open nor a mknod counts a writer with the new inode: a
    later open for writing must still work on the file the create made (its cache file),
    and a remount shows the bytes."""
    ro, made = gateway.mnt / "ro", gateway.mnt / "made"
    fd = os.open(ro, os.O_CREAT | os.O_RDONLY, 0o644)
    os.mknod(made, 0o100600)
    for path in (ro, made):
        with open(path, "r+b") as f:
            f.write(b"later bytes " + path.name.encode())
    os.close(fd)
    assert gateway.stop() == 0
    gateway.start()
    assert ro.read_bytes() == b"later bytes ro"
    assert made.read_bytes() == b"later bytes made"


def test_a_file_created_and_written_then_a_crash_before_close_uploads_as_the_mount_shows_it(gateway_factory, tmp_path):
    """A create is committed with its writer: the drain (settling nothing) does not start
    the file while it is open, so a crash (kill -9) before its close never leaves a
    half-written upload as the file's object; after the restart the object is the file as
    the mount shows it (writes never flushed may be lost: docs/CONCURRENCY.md)."""
    config = tmp_path / "ckptfs.toml"
    config.write_text("[drain]\nsettle_seconds = 0\n")
    gw = gateway_factory(extra_args=("--config", str(config)))
    fd = os.open(gw.mnt / "shard", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"x" * (1 << 20))
    dfd = os.open(gw.mnt, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)  # the create, and its writer, are committed: the drain sees both
    os.close(dfd)
    time.sleep(1.5)  # several drain polls
    assert not (gw.bucket / "shard").exists(), "the drain started a file that is open for writing"
    gw.kill9()
    with contextlib.suppress(OSError):  # the mount is dead
        os.close(fd)
    gw.start()
    result = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "60"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (gw.bucket / "shard").read_bytes() == (gw.mnt / "shard").read_bytes()

"""The passthrough data path on a real mount: really in use, visible, and what it changes.

Every POSIX behaviour is checked on both data paths by the mounted suites (conftest.DATA_PATHS);
here: WRITE/READ requests no longer reach the gateway while the data still reaches the cache
file and the bucket, the mode shows in status and metrics, ``--data-path passthrough`` is
refused where it cannot work, a shared mapping that outlives close() is noticed, and a file
being fetched from the bucket is read with direct I/O.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import subprocess
import time

import pytest

from conftest import ckptfs_cmd, needs_fuse
from test_mount_readpath import reads, remote_files, settled_state

pytestmark = [needs_fuse, pytest.mark.mounted]

MiB = 1 << 20


def _ops(gw, op: str) -> float:
    for line in gw.metrics().splitlines():
        if line.startswith(f'ckptfs_fuse_requests_total{{op="{op}"}}'):
            return float(line.split()[-1])
    return 0.0


def _gauge(gw, name: str) -> float | None:
    for line in gw.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def _drain_config(tmp_path):
    config = tmp_path / "drain.toml"
    config.write_text("[drain]\nsettle_seconds = 0.2\n")
    return config


def _cache_file(gw, path) -> "os.PathLike":
    return gw.cache / "data" / f"{os.stat(path).st_ino:x}"


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def test_writes_bypass_the_gateway_and_reach_cache_and_bucket(gateway_factory, tmp_path):
    gw = gateway_factory(data_path="passthrough", extra_args=("--config", str(_drain_config(tmp_path))))
    assert _gauge(gw, 'ckptfs_data_path{mode="passthrough"}') == 1.0
    assert _gauge(gw, 'ckptfs_data_path{mode="writeback"}') == 0.0
    assert "data path: passthrough" in gw.log()
    status = subprocess.run([*ckptfs_cmd(), "status", str(gw.mnt), "--json"], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["data_path"] == "passthrough"

    writes, reads, fsyncs = _ops(gw, "write"), _ops(gw, "read"), _ops(gw, "fsync")
    (gw.mnt / "run").mkdir()
    path = gw.mnt / "run" / "big.bin"
    digest = hashlib.sha256()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    for i in range(64):
        chunk = bytes([i]) * MiB
        digest.update(chunk)
        os.write(fd, chunk)
    os.fsync(fd)
    # fsync still reaches the gateway (fsmeta sync). It is counted once its reply is sent, so
    # the caller can be a moment ahead of the count.
    _wait_for(lambda: _ops(gw, "fsync") >= fsyncs + 1, 10, "the fsync to be counted")
    assert _ops(gw, "fsync") == fsyncs + 1
    os.close(fd)
    assert os.stat(path).st_size == 64 * MiB
    assert hashlib.sha256(path.read_bytes()).digest() == digest.digest()
    assert _ops(gw, "write") == writes, "WRITE requests reached the gateway"
    assert _ops(gw, "read") == reads, "READ requests reached the gateway"
    assert hashlib.sha256(_cache_file(gw, path).read_bytes()).digest() == digest.digest()

    result = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "60"],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert hashlib.sha256((gw.bucket / "run" / "big.bin").read_bytes()).digest() == digest.digest()


def test_close_sends_no_flush_and_an_unmount_right_after_loses_no_size(gateway_factory):
    """A passthrough close(2) is one round trip less (no FLUSH); its RELEASE stores the size
    after close(2) returned. A stat in between sees the size all the same, and an unmount right
    after many closes keeps every file's bytes. (An unmount ends the RELEASEs still queued; the
    end of the session releasing what they would have is checked without that race in
    tests/test_core_passthrough.py.)"""
    gw = gateway_factory(data_path="passthrough")
    (gw.mnt / "d").mkdir()
    expected = {}

    def write_files(first: int, n: int) -> None:
        for i in range(first, first + n):
            path = gw.mnt / "d" / f"f{i}"
            data = os.urandom(1000 + i)
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)
            expected[path.name] = data

    flushes = _ops(gw, "flush")
    write_files(0, 10)
    for i in range(10):
        assert os.stat(gw.mnt / "d" / f"f{i}").st_size == 1000 + i
    assert _ops(gw, "flush") == flushes, "close(2) of a passthrough handle sent FLUSH"
    write_files(10, 400)
    assert gw.stop() == 0  # at once: the last RELEASEs may still be queued
    gw.start()
    assert {p.name: p.read_bytes() for p in (gw.mnt / "d").iterdir()} == expected


def test_required_passthrough_is_refused_with_the_reason_where_unavailable(tmp_path, monkeypatch, capsys):
    from ckptfs.fsmeta.settings import Settings
    from ckptfs.gateway import mount, passthrough

    monkeypatch.setattr(passthrough, "probe", lambda: (False, "no CAP_SYS_ADMIN (uid 1000)"))
    (tmp_path / "mnt").mkdir()
    settings = Settings(bucket_url=f"file://{tmp_path}/bucket", cache_dir=str(tmp_path / "cache"),
                        data_path="passthrough").validate()
    assert mount.run_foreground(settings, str(tmp_path / "mnt")) == 1
    err = capsys.readouterr().err
    assert err == "ckptfs: data_path passthrough: not available here: no CAP_SYS_ADMIN (uid 1000)\n"
    assert not os.path.ismount(tmp_path / "mnt")
    # auto falls back to the writeback cache; writeback never asks
    assert mount.choose_data_path("auto")[0] == "writeback"
    monkeypatch.setattr(passthrough, "probe", lambda: (True, "ok"))
    assert mount.choose_data_path("auto") == ("passthrough", "ok")
    assert mount.choose_data_path("writeback")[0] == "writeback"


def test_a_shared_mapping_written_after_close_is_noticed(gateway_factory, tmp_path):
    gw = gateway_factory(data_path="passthrough", extra_args=("--config", str(_drain_config(tmp_path))))
    path = gw.mnt / "mapped.bin"
    path.write_bytes(b"a" * 8192)
    result = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "60"],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (gw.bucket / "mapped.bin").read_bytes() == b"a" * 8192

    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)  # the mapping outlives the handle: the gateway's RELEASE comes now
    time.sleep(0.5)
    m[0:4] = b"MMAP"  # no handle open: the gateway sees nothing of this
    m.flush()
    m.close()
    expected = b"MMAP" + b"a" * 8188
    assert path.read_bytes() == expected
    # The gateway's sweep notices the cache file moved, bumps the generation, the drain re-uploads.
    _wait_for(lambda: (gw.bucket / "mapped.bin").read_bytes() == expected, 30,
              "the bucket to get the bytes written through the mapping")


def test_fsync_remote_then_an_overwrite_seen_by_stat_still_reaches_the_bucket(gateway_factory, tmp_path):
    """fsync=remote makes the file durable while its handle stays open; an in-place overwrite
    (same size) that a stat sees before close must still be uploaded."""
    gw = gateway_factory(data_path="passthrough",
                         extra_args=("--config", str(_drain_config(tmp_path)), "--fsync", "remote"))
    path = gw.mnt / "shard.pt"
    with open(path, "w+b") as f:
        f.write(b"a" * MiB)
        f.flush()
        os.fsync(f.fileno())  # in the bucket now
        f.seek(4096)
        f.write(b"b" * 4096)
        f.flush()
        os.stat(path)  # a GETATTR sees the change before the flush at close
    want = b"a" * 4096 + b"b" * 4096 + b"a" * (MiB - 8192)
    result = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "60"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert (gw.bucket / "shard.pt").read_bytes() == want


def test_a_file_being_fetched_is_read_past_the_page_cache_in_passthrough_mode(gateway_factory):
    """A cold read does not keep a second copy of the file in the mount's page cache (the cache
    file's pages already hold it, and they are what later passthrough opens read): every read of
    a file being fetched reaches the gateway, the same range read twice too."""
    gw = gateway_factory(data_path="passthrough")
    data = os.urandom(8 * MiB)
    remote_files(gw, {"big.bin": data})
    with open(gw.mnt / "big.bin", "rb", buffering=0) as f:
        assert f.read(MiB) == data[:MiB]
        before = reads(gw)
        assert os.pread(f.fileno(), MiB, 0) == data[:MiB]
        # Not served from the mount's page cache. (A request is counted once its reply is sent,
        # so the reader can get its bytes just before the count moves: wait for it.)
        _wait_for(lambda: reads(gw) - before >= 1, 10, "a READ to reach the gateway")
        assert f.read() == data[MiB:]
    assert settled_state(gw.mnt / "big.bin", b"durable") == b"durable"

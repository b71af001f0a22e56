"""The read path on a real mount, in both data paths: a file in the bucket only is read
through the mount, becomes cached-clean and reopens from the cache (natively in passthrough);
``ckptfs prefetch``, ``ckptfs evict`` and ``ckptfs verify``."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import subprocess
import time

import pytest
from conftest import DATA_PATHS, REPO, both_data_paths, ckptfs_cmd, needs_fuse
from readpath_helpers import make_remote

from ckptfs.fsmeta import MetaStore
from ckptfs.fsmeta.layout import CacheDir

data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

pytestmark = [needs_fuse, pytest.mark.mounted]

MiB = 1 << 20


def remote_files(gw, files: dict[str, bytes], **kw) -> None:
    """With the gateway stopped, make ``files`` (path -> content; parents must exist) live in
    the bucket only, then start it again."""
    gw.stop()
    meta = MetaStore(str(gw.cache / "meta"))
    try:
        for path, data in files.items():
            parent, _, name = path.rpartition("/")
            make_remote(meta, CacheDir(str(gw.cache)), str(gw.bucket), name.encode(), data,
                        parent=parent.encode(), **kw)
    finally:
        meta.close()
    gw.start()


def settled_state(path, want: bytes, timeout: float = 10.0) -> bytes:
    """``user.ckptfs.state`` once it reads ``want`` (or the last value after ``timeout``): a file
    read whole becomes cached-clean after its last close, once its cache file is on the device
    (RELEASE is asynchronous to close(2))."""
    deadline = time.monotonic() + timeout
    while (state := os.getxattr(path, "user.ckptfs.state")) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return state


def metric(gw, name: str) -> float:
    for line in gw.metrics().splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[-1])
    return 0.0


def reads(gw) -> float:
    return sum(float(line.split()[-1]) for line in gw.metrics().splitlines()
               if line.startswith('ckptfs_fuse_requests_total{op="read"}'))


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*ckptfs_cmd(), *args], capture_output=True, text=True, timeout=120, cwd=str(REPO), check=False)


def test_a_remote_file_reads_through_then_reopens_from_the_cache(gateway_factory, data_path):
    gw = gateway_factory()
    data = os.urandom(9 * MiB + 5)
    remote_files(gw, {"ckpt.pt": data})
    path = gw.mnt / "ckpt.pt"
    assert os.getxattr(path, "user.ckptfs.state") == b"remote"
    assert path.read_bytes() == data
    assert settled_state(path, b"durable") == b"durable"
    fetched = metric(gw, "ckptfs_bucket_get_bytes_total")
    assert fetched == len(data)
    gateway_reads = reads(gw)
    # Past the kernel's page cache of the mount, so the reads go to the data path again.
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert f.read() == data
    assert metric(gw, "ckptfs_bucket_get_bytes_total") == fetched
    if data_path == "passthrough":
        assert reads(gw) == gateway_reads  # the native data path: no READ reaches the gateway


def test_a_cold_sequential_read_reaches_the_gateway_in_large_reads(gateway_factory):
    """The mount's read-ahead is raised past the kernel's 128 KiB default (gateway/mount.py),
    so a cold sequential read costs the gateway a few large READs, not one per 128 KiB."""
    gw = gateway_factory()
    data = os.urandom(32 * MiB)
    remote_files(gw, {"big.bin": data})
    before = reads(gw)
    with open(gw.mnt / "big.bin", "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(8 * MiB), b""))
    assert got == data
    assert reads(gw) - before <= len(data) // (512 * 1024)


def test_a_remote_file_can_be_mapped_while_it_is_fetched(gateway_factory, data_path):
    """``torch.load(mmap=True)`` and safetensors map a checkpoint: a file in the bucket only maps
    shared and private, and the mapping reads its content. (In passthrough mode such a file is
    opened with direct I/O, whose shared mappings need the kernel's FUSE_DIRECT_IO_ALLOW_MMAP:
    without it mmap fails with ENODEV.)"""
    gw = gateway_factory()
    data = os.urandom(5 * MiB + 3)
    remote_files(gw, {"shared.pt": data, "private.pt": data})
    with open(gw.mnt / "shared.pt", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[MiB:MiB + 4096] == data[MiB:MiB + 4096]  # a random read first
        assert m[:] == data
    with open(gw.mnt / "private.pt", "rb") as f, \
            mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
        assert m[:] == data
    for name in ("shared.pt", "private.pt"):
        assert settled_state(gw.mnt / name, b"durable") == b"durable"
        assert (gw.mnt / name).read_bytes() == data


def test_a_corrupt_object_fails_the_read_with_eio(gateway_factory):
    gw = gateway_factory()
    remote_files(gw, {"bad.pt": os.urandom(2 * MiB)}, blake3_hex="0" * 64)
    path = gw.mnt / "bad.pt"
    with pytest.raises(OSError) as exc:
        path.read_bytes()
    assert exc.value.errno == errno.EIO
    assert os.getxattr(path, "user.ckptfs.state") == b"error: RemoteHashMismatch"
    assert metric(gw, "ckptfs_integrity_failures_total") == 1


def test_writing_a_remote_file_fetches_it_first(gateway_factory):
    gw = gateway_factory()
    data = os.urandom(3 * MiB)
    remote_files(gw, {"w.pt": data})
    path = gw.mnt / "w.pt"
    with open(path, "r+b") as f:
        f.seek(MiB)
        f.write(b"patch")
    assert path.read_bytes() == data[:MiB] + b"patch" + data[MiB + 5:]
    assert os.getxattr(path, "user.ckptfs.state") == b"dirty"


def test_a_remote_file_rewritten_with_o_trunc_holds_only_the_new_bytes(gateway_factory):
    gw = gateway_factory()
    data = os.urandom(3 * MiB)
    remote_files(gw, {"latest.pt": data})
    path = gw.mnt / "latest.pt"
    with open(path, "wb") as f:  # torch.save over the last checkpoint
        f.write(b"new checkpoint")
    assert path.read_bytes() == b"new checkpoint"
    assert os.getxattr(path, "user.ckptfs.state") == b"dirty"
    # None of the old content is fetched: in passthrough mode O_TRUNC comes with the open; on
    # the writeback data path it comes as a SETATTR after an open that fetched nothing yet.
    assert metric(gw, "ckptfs_bucket_get_bytes_total") == 0
    gw.stop()
    gw.start()
    assert path.read_bytes() == b"new checkpoint"


def test_prefetch_warms_a_checkpoint_directory(gateway_factory):
    gw = gateway_factory()
    (gw.mnt / "step_100").mkdir()
    shards = {f"step_100/shard_{i}.distcp": os.urandom(2 * MiB + i) for i in range(6)}
    remote_files(gw, shards)
    result = cli("prefetch", str(gw.mnt / "step_100"), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    total = sum(len(d) for d in shards.values())
    assert (summary["files"], summary["bytes"], summary["fetched"], summary["errors"]) == (6, total, total, {})
    assert summary["seconds"] > 0 and summary["gbps"] > 0
    for rel, data in shards.items():
        assert os.getxattr(gw.mnt / rel, "user.ckptfs.state") == b"durable"
    fetched = metric(gw, "ckptfs_bucket_get_bytes_total")
    for rel, data in shards.items():
        assert (gw.mnt / rel).read_bytes() == data
    assert metric(gw, "ckptfs_bucket_get_bytes_total") == fetched  # the load itself ran from the cache
    again = json.loads(cli("prefetch", str(gw.mnt / "step_100"), "--json").stdout)
    assert again["fetched"] == 0
    human = cli("prefetch", str(gw.mnt / "step_100"))
    assert human.returncode == 0 and "6 files" in human.stdout and "GB/s" in human.stdout


def test_evict_frees_a_checkpoint_directory_and_keeps_open_files(gateway_factory):
    """``ckptfs evict DIR``: the cache copies of clean files go now; a file still open stays
    cached; evicted files stay visible and read back the same from the bucket."""
    gw = gateway_factory()
    (gw.mnt / "step_200").mkdir()
    shards = {f"step_200/shard_{i}.distcp": os.urandom(MiB + i) for i in range(4)}
    remote_files(gw, shards)
    assert cli("prefetch", str(gw.mnt / "step_200")).returncode == 0
    held = gw.mnt / "step_200/shard_0.distcp"
    with open(held, "rb") as f:
        result = cli("evict", str(gw.mnt / "step_200"), "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["kept"] == [str(held)]
        assert (summary["files"], summary["evicted"], summary["errors"]) == (4, 3, {})
        assert summary["evicted_bytes"] == sum(len(d) for rel, d in shards.items() if rel != "step_200/shard_0.distcp")
        assert f.read() == shards["step_200/shard_0.distcp"]
    states = {rel: os.getxattr(gw.mnt / rel, "user.ckptfs.state") for rel in shards}
    assert states == {rel: b"durable" if rel.endswith("_0.distcp") else b"remote" for rel in shards}
    fetched = metric(gw, "ckptfs_bucket_get_bytes_total")
    for rel, data in shards.items():
        assert (gw.mnt / rel).read_bytes() == data
    assert metric(gw, "ckptfs_bucket_get_bytes_total") > fetched  # read back from the bucket
    human = cli("evict", str(gw.mnt / "step_200"))
    assert human.returncode == 0 and "4 files" in human.stdout


def test_prefetch_reports_a_file_that_fails_its_check(gateway_factory):
    gw = gateway_factory()
    remote_files(gw, {"bad.pt": os.urandom(MiB)}, blake3_hex="0" * 64)
    result = cli("prefetch", str(gw.mnt), "--json")
    assert result.returncode == 1
    assert list(json.loads(result.stdout)["errors"]) == [str(gw.mnt / "bad.pt")]


def test_verify_lists_mismatched_and_missing_objects(gateway_factory):
    gw = gateway_factory()
    (gw.mnt / "ck").mkdir()
    files = {f"ck/{n}": os.urandom(MiB + i) for i, n in enumerate(("a", "b", "c", "d"))}
    remote_files(gw, files)
    assert subprocess.run(["cat", str(gw.mnt / "ck/d")], capture_output=True, check=False).returncode == 0  # cached copy
    ok = cli("verify", str(gw.mnt / "ck"), "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert {c["key"]: c["status"] for c in json.loads(ok.stdout)["checked"]} == dict.fromkeys(files, "ok")
    # Damage the bucket behind fsmeta's back: one object's bytes, one object gone.
    with open(gw.bucket / "ck" / "b", "r+b") as f:
        f.write(b"rot")
    os.unlink(gw.bucket / "ck" / "c")
    bad = cli("verify", str(gw.mnt / "ck"), "--json")
    assert bad.returncode == 1
    statuses = {c["key"]: c["status"] for c in json.loads(bad.stdout)["checked"]}
    assert statuses == {"ck/a": "ok", "ck/b": "mismatch", "ck/c": "missing", "ck/d": "ok"}
    human = cli("verify", str(gw.mnt / "ck"))
    assert human.returncode == 1 and "mismatch: ck/b" in human.stdout and "missing: ck/c" in human.stdout


def test_prefetch_evict_and_verify_refuse_a_path_off_the_mount(tmp_path):
    for command in ("prefetch", "evict", "verify"):
        result = cli(command, str(tmp_path))
        assert result.returncode == 2 and "not on a ckptfs mount" in result.stderr


def test_kill_9_during_a_fetch_never_leaves_a_partial_file_taken_for_complete(gateway_factory):
    gw = gateway_factory()
    data = os.urandom(8 * MiB)
    remote_files(gw, {"big.pt": data})
    path = gw.mnt / "big.pt"
    ino = os.stat(path).st_ino
    fd = os.open(path, os.O_RDONLY)
    for off in (5 * MiB, MiB):  # random reads: part of the object is in the cache file
        assert os.pread(fd, 4096, off) == data[off:off + 4096]
    cache_file = gw.cache / "data" / f"{ino:x}"
    assert cache_file.exists()
    gw.kill9()  # with the file open and its fetch unfinished
    with contextlib.suppress(OSError):
        os.close(fd)  # ENOTCONN: the gateway is gone
    gw.clear_dead_mount()
    gw.start()
    assert os.getxattr(path, "user.ckptfs.state") == b"remote"
    assert not cache_file.exists()  # the partial fetch was discarded at start
    assert path.read_bytes() == data
    assert settled_state(path, b"durable") == b"durable"

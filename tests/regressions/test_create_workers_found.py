"""Bugs found by the hunt on the one-transaction create and the FUSE worker threads (the
thread hand-off those tests covered, gateway/workers.py, went with pyfuse3: the front end
serves each request in the thread that read it).

Keep every one of these: each failed before its fix (named in the docstring).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading

import pytest

from conftest import RENAME_EXCHANGE, ROOT, ROOT_CALLER, ckptfs_cmd, needs_fuse, renameat2
from ckptfs.gateway.errors import FsError


@pytest.mark.parametrize("how", ["create", "mknod"])
def test_a_create_whose_cache_file_cannot_be_made_leaves_no_name(core, monkeypatch, how):
    """gateway/core.py FsCore.create (and Namespace.mknod) made the name in one fsmeta
    transaction and the cache file after it; when the cache file could not be made (ENOSPC,
    EMFILE) the caller got the error but the name stayed, empty and queued for upload: a
    retried O_EXCL open of the checkpoint's shard got EEXIST, and the kernel, which got no
    entry, never sent the forget that would drop it."""
    failed = []
    real = core._state.create_cache_file

    def full_device(ino, spare=None):
        failed.append(ino)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core._state, "create_cache_file", full_device)
    with pytest.raises(OSError) as exc:
        if how == "create":
            core.create(ROOT, b"shard", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, ROOT_CALLER)
        else:
            core.mknod(ROOT, b"shard", stat.S_IFREG | 0o644, 0, ROOT_CALLER)
    assert exc.value.errno == errno.ENOSPC
    with pytest.raises(FsError) as missing:
        core.lookup(ROOT, b"shard")
    assert missing.value.errno == errno.ENOENT
    core.meta.commit()
    with core.meta.read_committed() as txn:
        assert txn.get_inode(failed[0]) is None  # nothing left to upload or purge
        assert txn.writer_count(failed[0]) == 0
    monkeypatch.setattr(core._state, "create_cache_file", real)
    fh, _ = core.create(ROOT, b"shard", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, ROOT_CALLER)
    core.release(fh)


@needs_fuse
@pytest.mark.mounted
def test_an_exchange_of_a_file_and_a_directory_drains_to_a_file_bucket(gateway_factory, tmp_path):
    """Found by the evictions model's hunt (random, seed 7), where a --fsync=remote fsync then
    waited forever. After ``rename --exchange`` of ``a`` (a directory holding an empty
    directory) and ``b`` (a file), the file's object must move to ``a`` while ``a/`` is a
    directory in a file:// bucket, and the marker ``a/a/`` to ``b/a/`` while ``b`` is a file:
    neither copy could go first, and both stayed pending forever. The drain now moves one of
    them aside first (the shape-cycle break in drain/worker.py, found again by the drain
    model's seed 11)."""
    config = tmp_path / "ckptfs.toml"
    config.write_text("[drain]\nsettle_seconds = 0\n")
    gw = gateway_factory(extra_args=("--config", str(config)))
    root = gw.mnt / "r"
    (root / "a" / "a").mkdir(parents=True)
    (root / "b").write_bytes(b"shard")

    def wait_durable(seconds: int) -> subprocess.CompletedProcess:
        return subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", str(seconds)],
                              capture_output=True, text=True, timeout=seconds + 60)

    assert wait_durable(60).returncode == 0
    renameat2(str(root / "a"), str(root / "b"), RENAME_EXCHANGE)
    result = wait_durable(60)
    assert result.returncode == 0, result.stderr
    assert (gw.bucket / "r" / "a").read_bytes() == b"shard"


def test_a_remote_fsync_of_an_unlinked_open_file_returns(gateway_factory, tmp_path):
    """Found by the evictions model's hunt (random, seed 10 x 100, writeback data path): with
    --fsync=remote, fdatasync of a file unlinked while open waited forever. The unlink queued
    the file (its name is to be deleted from the bucket), the fsync asked for it urgently, and
    the drain never uploads a file without a name, so the wait for its pending entry to clear
    never ended. A file with no name has nothing to put in the bucket: the local fsync is the
    whole answer, as on a local filesystem."""
    config = tmp_path / "ckptfs.toml"
    config.write_text("[drain]\nsettle_seconds = 0\n")
    gw = gateway_factory(extra_args=("--config", str(config), "--fsync", "remote"))
    path = gw.mnt / "tmp.pt"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 4096)
        os.fsync(fd)  # named: returns once the file is in the bucket
        assert (gw.bucket / "tmp.pt").read_bytes() == b"x" * 4096
        os.unlink(path)
        os.write(fd, b"y")
        done = threading.Event()
        outcome: list = []

        def sync():
            try:
                os.fdatasync(fd)
                outcome.append("ok")
            except OSError as exc:
                outcome.append(exc)
            done.set()

        threading.Thread(target=sync, daemon=True).start()
        assert done.wait(30), "fdatasync of an unlinked file still waits after 30 s"
        assert outcome == ["ok"]
    finally:
        os.close(fd)
    assert gw.alive

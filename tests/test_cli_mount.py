"""`ckptfs mount` / `ckptfs umount` from the command line: refusals are one clear line."""

from __future__ import annotations

import contextlib
import os
import stat
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ckptfs_cmd, lazy_unmount, make_public_dir, needs_fuse

pytestmark = [needs_fuse, pytest.mark.mounted]


@pytest.fixture
def dirs():
    base = make_public_dir("ckptfs-cli-")
    (base / "mnt").mkdir()
    (base / "bucket").mkdir()
    yield base
    for mnt in (base / "mnt", base / "mnt2"):
        lazy_unmount(mnt)
    # A daemonized gateway that a failed test left behind.
    from ckptfs.fsmeta.layout import CacheDir

    for cache in base.glob("cache*"):
        pid = CacheDir(cache).gateway_pid()
        if pid and pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
    subprocess.run(["rm", "-rf", str(base)], check=False)


def mount_cmd(base: Path, *extra, url=None, mnt=None, cache=None, foreground=True) -> list[str]:
    argv = [*ckptfs_cmd(), "mount", url or f"file://{base / 'bucket'}", str(mnt or base / "mnt"),
            "--cache-dir", str(cache or base / "cache"), "--metrics-addr", "127.0.0.1:0", *extra]
    if foreground:
        argv.append("--foreground")
    return argv


def refused(argv, *, as_uid: int | None = None, timeout: float = 60) -> str:
    """Run a mount that must fail; return its one line of complaint."""
    if as_uid is not None:
        argv = ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups", *argv]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd="/")
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # it mounted instead of refusing: take it all down
        p.communicate()
        pytest.fail(f"{argv} did not refuse to start")
    assert p.returncode != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptfs: ")
    return lines[0]


@pytest.mark.parametrize("url, words", [
    ("s3://Not_A_Bucket/x", ["bucket_url", "valid S3 bucket"]),
    ("http://example.com/b", ["bucket_url", "s3://bucket"]),
    ("file://relative/dir", ["bucket_url", "file:///absolute/dir"]),
    ("bucket-without-scheme", ["bucket_url"]),
])
def test_bad_bucket_url(dirs, url, words):
    line = refused(mount_cmd(dirs, url=url))
    assert all(w in line for w in words), line
    assert not (dirs / "cache").exists()  # refused before touching anything


def test_cache_dir_that_cannot_be_created(dirs):
    (dirs / "plain_file").write_text("x")
    line = refused(mount_cmd(dirs, cache=dirs / "plain_file" / "cache"))
    assert "cache directory" in line and "plain_file/cache" in line and "cannot create" in line


def test_shared_or_foreign_cache_dir_is_refused_and_left_as_it_was(dirs):
    shared = dirs / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /var/tmp
    line = refused(mount_cmd(dirs, cache=shared))
    assert "cache directory" in line and "writable by others" in line
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and list(shared.iterdir()) == []

    foreign = dirs / "foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, 4242, 4242)
    line = refused(mount_cmd(dirs, cache=foreign))
    assert "cache directory" in line and "owned by uid 4242" in line
    assert list(foreign.iterdir()) == []


def test_new_cache_dir_is_private(dirs):
    cache = dirs / "new" / "cache"
    result = subprocess.run(mount_cmd(dirs, cache=cache, foreground=False), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    try:
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
        assert stat.S_IMODE((cache / "data").stat().st_mode) == 0o700
        assert stat.S_IMODE((cache / "gateway.log").stat().st_mode) == 0o600
    finally:
        subprocess.run([*ckptfs_cmd(), "umount", str(dirs / "mnt")], capture_output=True, timeout=60)


def test_cache_dir_with_unusable_fsmeta(dirs):
    (dirs / "cache" / "meta").mkdir(parents=True)
    (dirs / "cache" / "meta" / "data.mdb").write_bytes(os.urandom(65536))
    line = refused(mount_cmd(dirs))
    assert "cache directory" in line and "fsmeta" in line and "not an LMDB file" in line


def test_file_bucket_that_cannot_be_created(dirs):
    (dirs / "plain_file").write_text("x")
    line = refused(mount_cmd(dirs, url=f"file://{dirs / 'plain_file' / 'bucket'}"))
    assert line.startswith(f"ckptfs: bucket file://{dirs / 'plain_file' / 'bucket'}: cannot create")


def test_missing_mountpoint(dirs):
    line = refused(mount_cmd(dirs, mnt=dirs / "nope"))
    assert line == f"ckptfs: mountpoint {dirs / 'nope'}: does not exist"


def test_mountpoint_not_empty_or_not_a_directory(dirs):
    (dirs / "mnt" / "something").write_text("x")
    assert refused(mount_cmd(dirs)) == f"ckptfs: mountpoint {dirs / 'mnt'}: not empty"
    (dirs / "afile").write_text("x")
    assert refused(mount_cmd(dirs, mnt=dirs / "afile")) == f"ckptfs: mountpoint {dirs / 'afile'}: not a directory"


@pytest.mark.parametrize("content, words", [
    ("bucket_url = [", ["invalid TOML"]),
    ("[drain]\npart_size = \"1MiB\"\n", ["drain.part_size"]),
    ("[cache]\nmax_sz = \"10GiB\"\n", ["cache.max_sz", "unknown setting"]),
    ("[mount]\nfsync = \"sometimes\"\n", ["fsync", "sometimes"]),
    ("[drain]\nconcurrency = \"eight\"\n", ["drain.concurrency"]),
    ("[cache]\nmax_size = \"150%\"\n", ["cache.max_size", "150%"]),
])
def test_invalid_config_file_names_the_setting(dirs, content, words):
    cfg = dirs / "ckptfs.toml"
    cfg.write_text(content)
    line = refused(mount_cmd(dirs, "--config", str(cfg)))
    assert all(w in line for w in words), line


def test_bad_cache_cap_flag_names_the_setting(dirs):
    line = refused(mount_cmd(dirs, "--cache-max-size", "huge"))
    assert line.startswith("ckptfs: cache.max_size: ") and "huge" in line


def test_missing_and_unreadable_config_file(dirs):
    line = refused(mount_cmd(dirs, "--config", str(dirs / "missing.toml")))
    assert line == f"ckptfs: config: {dirs / 'missing.toml'}: no such file"
    cfg = dirs / "secret.toml"
    cfg.write_text("[mount]\nfsync = \"local\"\n")
    cfg.chmod(0o600)  # root's file: unreadable for uid 1000
    argv = [sys.executable, "-m", "ckptfs", *mount_cmd(dirs, "--config", str(cfg))[len(ckptfs_cmd()):]]
    line = refused(argv, as_uid=1000)
    assert line == f"ckptfs: config: {cfg}: permission denied"


def test_cache_dir_in_use_by_another_gateway(dirs, gateway_factory):
    gw = gateway_factory(cache=dirs / "cache")
    (dirs / "mnt2").mkdir()
    line = refused(mount_cmd(dirs, mnt=dirs / "mnt2"))
    assert "in use by another gateway" in line and str(dirs / "cache") in line
    assert str(gw.proc.pid) in line
    assert gw.alive and not os.path.ismount(dirs / "mnt2")


def test_cache_dir_of_another_bucket_is_refused(dirs):
    (dirs / "other").mkdir()
    p = subprocess.Popen(mount_cmd(dirs), stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(dirs / "mnt") and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        subprocess.run(["fusermount3", "-u", str(dirs / "mnt")], capture_output=True)
        p.wait(30)
    line = refused(mount_cmd(dirs, url=f"file://{dirs / 'other'}"))
    assert "belongs to" in line and str(dirs / "bucket") in line


def test_daemon_mode_returns_once_mounted_and_umount_unmounts(dirs):
    from ckptfs.fsmeta.layout import CacheDir

    r = subprocess.run(mount_cmd(dirs, foreground=False), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert os.path.ismount(dirs / "mnt")  # no waiting: mounted when the command returned
    pid = CacheDir(dirs / "cache").gateway_pid()
    assert pid and pid > 0
    (dirs / "mnt" / "f").write_bytes(b"daemon")
    assert (dirs / "mnt" / "f").read_bytes() == b"daemon"
    r = subprocess.run([*ckptfs_cmd(), "umount", str(dirs / "mnt")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not os.path.ismount(dirs / "mnt")
    assert CacheDir(dirs / "cache").gateway_pid() is None  # the gateway has finished and let go
    # Data is still in the cache: a new mount shows it.
    r = subprocess.run(mount_cmd(dirs, foreground=False), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (dirs / "mnt" / "f").read_bytes() == b"daemon"
    # fusermount3 -u also stops the gateway cleanly.
    subprocess.run(["fusermount3", "-u", str(dirs / "mnt")], check=True)
    deadline = time.monotonic() + 30
    while CacheDir(dirs / "cache").gateway_pid() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert CacheDir(dirs / "cache").gateway_pid() is None
    assert "unmounted" in (dirs / "cache" / "gateway.log").read_text()


def test_daemon_mode_failure_is_one_line(dirs):
    line = refused(mount_cmd(dirs, mnt=dirs / "nope", foreground=False))
    assert line == f"ckptfs: mountpoint {dirs / 'nope'}: does not exist"


def test_umount_of_something_else(dirs):
    r = subprocess.run([*ckptfs_cmd(), "umount", str(dirs / "mnt")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip() == f"ckptfs: {dirs / 'mnt'}: not a ckptfs mount"


def test_foreground_gateway_exits_zero_on_fusermount_u(gateway):
    (gateway.mnt / "x").write_bytes(b"1")
    assert gateway.stop() == 0
    assert not os.path.ismount(gateway.mnt)
    assert "unmounted" in gateway.log()


def test_foreground_gateway_unmounts_on_sigterm(gateway):
    os.kill(gateway.proc.pid, signal.SIGTERM)
    assert gateway.proc.wait(30) == 0
    assert not os.path.ismount(gateway.mnt)

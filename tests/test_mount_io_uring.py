"""FUSE requests through io_uring queues (``--fuse-io-uring``), on real mounts.

The whole mounted suite runs through the queues with ``CKPTFS_TEST_FUSE_IO_URING=on``
(tests/conftest.py); in the default run, this module checks that the queues really take the
requests on both data paths, that the mode shows in the log, status and metrics, that the
setting refuses where the kernel does not offer them, that an unmount or a crash ends a gateway
that uses them, and that FORGETs (which the kernel still sends through /dev/fuse, and which the
front end hands to Python late) still let unlinked files go.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from ckptfs.fsmeta.settings import ConfigError, Settings
from ckptfs.gateway import mount
from conftest import DATA_PATHS, ckptfs_cmd, needs_fuse
from test_mount_passthrough import _wait_for

MiB = 1 << 20
PARAM = mount.ENABLE_URING_PARAM


@pytest.fixture(scope="module")
def io_uring_enabled():
    """The fuse module's enable_uring parameter on for this module (restored after)."""
    if not os.path.exists(PARAM):
        pytest.skip("this kernel has no FUSE over io_uring (Linux 6.14+, CONFIG_FUSE_IO_URING)")
    with open(PARAM) as fh:
        before = fh.read().strip()
    try:
        with open(PARAM, "w") as fh:
            fh.write("Y")
    except OSError as exc:
        pytest.skip(f"cannot turn on {PARAM}: {exc}")
    yield
    with open(PARAM, "w") as fh:
        fh.write(before)


@pytest.fixture(scope="module", params=DATA_PATHS)
def data_path(request) -> str:
    return request.param


def _metric(gw, name: str) -> float:
    for line in gw.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _cache_files(gw) -> set[str]:
    return set(os.listdir(gw.cache / "data"))


@needs_fuse
@pytest.mark.mounted
def test_requests_come_through_the_io_uring_queues(io_uring_enabled, gateway_factory, data_path):
    gw = gateway_factory(extra_args=("--fuse-io-uring", "on"))
    # (set up once INIT is answered, which may be after the mount shows)
    _wait_for(lambda: "FUSE requests: io_uring" in gw.log(), 10, "the queues to be set up")
    assert _metric(gw, 'ckptfs_fuse_transport{transport="io_uring"}') == 1.0
    assert _metric(gw, 'ckptfs_fuse_transport{transport="dev_fuse"}') == 0.0
    status = subprocess.run([*ckptfs_cmd(), "status", str(gw.mnt), "--json"], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["fuse_transport"] == "io_uring"

    ringed = _metric(gw, "ckptfs_fuse_io_uring_requests_total")
    run = gw.mnt / "run"
    run.mkdir()
    data = os.urandom(3 * MiB + 123)
    with open(run / "model.pt.tmp", "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(run / "model.pt.tmp", run / "model.pt")
    with open(run / "model.pt", "rb") as fh:
        assert hashlib.sha256(fh.read()).digest() == hashlib.sha256(data).digest()
    os.setxattr(run / "model.pt", "user.note", b"step 7")
    assert os.getxattr(run / "model.pt", "user.note") == b"step 7"
    os.symlink("model.pt", run / "latest")
    assert os.readlink(run / "latest") == "model.pt"
    os.truncate(run / "model.pt", MiB)
    assert os.stat(run / "model.pt").st_size == MiB
    for i in range(200):
        (run / f"shard-{i}").write_bytes(b"x" * 100)
    assert len(os.listdir(run)) == 202
    for i in range(200):
        os.unlink(run / f"shard-{i}")
    assert sorted(os.listdir(run)) == ["latest", "model.pt"]
    # Each create alone is a LOOKUP and a CREATE; all of them came through the queues.
    assert _metric(gw, "ckptfs_fuse_io_uring_requests_total") - ringed >= 2 * 200 + 200
    assert gw.stop() == 0
    assert not gw.unexpected(), gw.log()[-8000:]


@needs_fuse
@pytest.mark.mounted
@pytest.mark.parametrize("transport", ["off", "on"])
def test_unlinked_files_leave_the_cache_with_no_request_after_their_forget(io_uring_enabled, gateway_factory,
                                                                         transport):
    # The FORGETs that follow the unlinks are handed to Python by the next request, or by the
    # front end's own loop within 0.2 s when none comes: here none comes.
    gw = gateway_factory(extra_args=("--fuse-io-uring", transport))
    for i in range(20):
        (gw.mnt / f"f{i}").write_bytes(b"y" * 1000)
    # (st_ino is the gateway's inode number, which names the cache file)
    made = {f"{os.stat(gw.mnt / f'f{i}').st_ino:x}" for i in range(20)}
    assert made <= _cache_files(gw)
    for i in range(20):
        os.unlink(gw.mnt / f"f{i}")
    _wait_for(lambda: not (made & _cache_files(gw)), 10, "the unlinked files' cache files to go")
    assert gw.stop() == 0
    assert not gw.unexpected(), gw.log()[-8000:]


@needs_fuse
@pytest.mark.mounted
@pytest.mark.parametrize("transport", ["off", "on"])
def test_a_crashed_gateway_comes_back_with_what_was_fsynced(io_uring_enabled, gateway_factory,
                                                                              transport):
    gw = gateway_factory(extra_args=("--fuse-io-uring", transport))
    with open(gw.mnt / "kept", "wb") as fh:
        fh.write(b"k" * 5000)
        fh.flush()
        os.fsync(fh.fileno())
    gw.kill9()
    gw.start()  # `ckptfs mount` clears the dead mount itself
    assert "clearing the dead mount" in gw.log()
    assert (gw.mnt / "kept").read_bytes() == b"k" * 5000
    expected = "FUSE requests: io_uring" if transport == "on" else "FUSE requests: /dev/fuse"
    _wait_for(lambda: expected in gw.log().rsplit("--- start #", 1)[-1], 10, expected)
    assert gw.stop() == 0


def test_the_setting_follows_what_the_kernel_offers(tmp_path, monkeypatch):
    param = tmp_path / "enable_uring"
    monkeypatch.setattr(mount, "ENABLE_URING_PARAM", str(param))
    assert mount.choose_fuse_transport("off") == (False, "as configured")

    param.write_text("Y\n")
    assert mount.choose_fuse_transport("auto")[0] is True
    assert mount.choose_fuse_transport("on")[0] is True

    param.write_text("N\n")
    want, why = mount.choose_fuse_transport("auto")
    assert want is False and "enable_uring" in why
    with pytest.raises(mount.MountError, match="fuse_io_uring on: not available here: .*enable_uring"):
        mount.choose_fuse_transport("on")

    param.unlink()
    want, why = mount.choose_fuse_transport("auto")
    assert want is False and "CONFIG_FUSE_IO_URING" in why
    with pytest.raises(mount.MountError, match="fuse_io_uring on"):
        mount.choose_fuse_transport("on")


def test_a_bad_value_names_the_setting():
    with pytest.raises(ConfigError, match="mount.fuse_io_uring: must be one of auto, on, off"):
        Settings(bucket_url="file:///tmp/b", fuse_io_uring="yes").validate()

"""Empty cache files made ahead of creates (gateway/spares.py)."""

from __future__ import annotations

import os
import time

from conftest import ROOT, ROOT_CALLER
from ckptfs.gateway.spares import Spares


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_create_takes_a_spare_and_the_pool_is_topped_up(core):
    spares = core.enable_spares(target=4)
    try:
        wait_until(lambda: spares.made == 4)
        fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
        assert spares.taken == 1
        core.write(fh, 0, b"hello")
        core.release(fh)
        data_file = core._state.data_path(attr.ino)
        with open(data_file, "rb") as f:
            assert f.read() == b"hello"
        assert oct(os.stat(data_file).st_mode & 0o777) == oct(0o600)
        wait_until(lambda: spares.made == 5)  # topped up again
        assert len(os.listdir(core.cache_dir + "/spare")) == 4
    finally:
        core.close_spares()
    assert os.listdir(core.cache_dir + "/spare") == []


def test_a_spare_replaces_a_leftover_at_the_new_inodes_name(core):
    """A power cut can lose the commit that handed out an inode number while its cache file
    survived: the new file must not show the leftover's bytes (as with O_EXCL and unlink)."""
    spares = core.enable_spares(target=2)
    try:
        wait_until(lambda: spares.made == 2)
        with core.meta.read() as txn:
            next_ino = txn.raw.get(b"next_ino", db=txn.dbs["meta"])
        leftover = core._state.data_path(int.from_bytes(bytes(next_ino), "big"))
        with open(leftover, "wb") as f:
            f.write(b"stale bytes of a lost inode")
        fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
        assert core._state.data_path(attr.ino) == leftover
        assert core.read(fh, 0, 100) == b""
        core.release(fh)
        assert os.path.getsize(leftover) == 0
    finally:
        core.close_spares()


def test_spares_of_an_earlier_run_are_removed_at_start(tmp_path):
    spare_dir = tmp_path / "spare"
    spare_dir.mkdir()
    (spare_dir / "7").write_bytes(b"left by a crash")
    data = tmp_path / "data"
    data.mkdir()
    os.link(spare_dir / "7", data / "2a")  # a power cut after the rename reached data/ only half
    spares = Spares(str(spare_dir), target=1).start()
    try:
        wait_until(lambda: spares.made == 1)
        assert [p.name for p in spare_dir.iterdir()] != ["7"]
        assert (data / "2a").read_bytes() == b"left by a crash"  # its other name is untouched
    finally:
        spares.close()


def test_without_spares_ready_a_create_makes_its_own_file(core):
    spares = core.enable_spares(target=0)  # never makes any
    try:
        fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
        core.release(fh)
        assert spares.taken == 0 and os.path.exists(core._state.data_path(attr.ino))
    finally:
        core.close_spares()

"""Bugs found by tests/test_mount_stress.py, each reduced to the smallest workload that shows it.

Keep every one of these: each failed before its fix (named in the docstring).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import DATA_PATHS, both_data_paths, needs_fuse
from ckptfs.fsmeta import MetaStore

data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

pytestmark = [needs_fuse, pytest.mark.mounted]


def test_an_o_trunc_open_racing_a_truncate_leaves_the_mount_and_the_gateway_at_one_size(gateway):
    """test_mount_stress (writeback data path, about 1 run in 10, once in CI): after a clean
    remount one file's content differed from what the mount had shown. With atomic O_TRUNC
    (libfuse's default) the kernel truncates in two steps: the OPEN, where the gateway
    truncates the cache file, then, under a new hold of the inode lock, a local truncate of
    its own size and page cache that sends nothing. A truncate(2) or a write by another
    process in between reached the gateway but was undone in the kernel only, whose size
    is the one that counts under the writeback cache. Racing a truncate(2) with an
    open(O_TRUNC) left them apart in 307 of 500 rounds before the fix
    (``CkptOperations.atomic_o_trunc_with_writeback_cache = False``, which the front end turns
    into FUSE_CAP_ATOMIC_O_TRUNC off: O_TRUNC then comes as a SETATTR under the inode lock)."""
    p = gateway.mnt / "f"
    p.write_bytes(b"0123456789")
    ino = os.stat(p).st_ino
    meta = MetaStore(str(gateway.cache / "meta"), create=False)
    apart = []
    try:
        for round_ in range(200):
            os.truncate(p, 10)
            start = threading.Barrier(2)

            def reopen_truncated():
                start.wait()
                os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))

            def truncate_up():
                start.wait()
                os.truncate(p, 65536)

            racers = [threading.Thread(target=reopen_truncated), threading.Thread(target=truncate_up)]
            for t in racers:
                t.start()
            for t in racers:
                t.join()
            # Both calls returned, so each has reached the gateway and been stored (the close's
            # FLUSH stores the open file's size): fsmeta holds what a remount will show, once the
            # gateway's batch of deferred commits is committed (this process sees committed
            # writes only). In passthrough mode the kernel's atomic O_TRUNC can also leave the
            # truncation's size in its attributes for a moment after a SETATTR that came in
            # between, until it asks again: what must never happen is two sizes for good.
            deadline = time.monotonic() + 3
            while True:
                shown = os.stat(p).st_size
                with meta.read() as txn:
                    stored = txn.get_inode(ino).size
                if shown == stored or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            if shown != stored:
                apart.append((round_, shown, stored))
                if len(apart) == 3:
                    break  # (each such round waited 3 s)
    finally:
        meta.close()
    assert not apart, f"(round, size the mount showed, size the gateway stored): {apart[:5]}, {len(apart)} in all"
    shown = os.stat(p).st_size
    assert gateway.stop() == 0
    gateway.start()
    assert os.stat(p).st_size == shown

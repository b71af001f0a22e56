"""Bugs the churn hunt found (tests/test_mount_two_nodes.py, ``CKPTFS_CHURN_ROUNDS``), each
reduced to plain code. Keep every one of these: each failed before its fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import trio  # noqa: E402

from ckptfs.fsmeta import durability  # noqa: E402
from test_drain_support import denv  # noqa: E402,F401


def classify(denv, key: str) -> str:  # noqa: F811
    """What the drain's tombstone task decides for ``key``: delete, drop or wait."""
    drain = denv.make_drain(None)
    with denv.meta.read() as txn:
        items = [(key, txn.get_tombstone(key))]
        delete, drop = drain._classify_tombstones(txn, items)
    return "delete" if delete else "drop" if drop else "wait"


def test_an_old_marker_at_a_new_directorys_name_is_deleted_though_the_directory_is_empty(denv):  # noqa: F811
    """The churn hunt left an empty directory's marker ``e/b/e/`` in the bucket that nobody
    owned or tombstoned, under what had become a file: a fresh node showed a directory there,
    and on ``file://`` the file could never be written (KeyConflict, for ever). A directory
    moved away left its marker's tombstone; a new directory took the name, and while it was
    still empty the tombstone was dropped, as if the new directory would put its own marker
    over it. It got a file first, so it put none; once its parent moved, nothing named the old
    marker any more. The tombstone of a name that is live again but not written yet (pending)
    now deletes the old object."""
    denv.mkdir("p")
    denv.mkdir("p/e")
    denv.drain()
    assert "p/e/" in denv.listing()
    denv.rename("p/e", "x")
    denv.drain()  # the old directory's marker moved to x/, p/e/ deleted
    denv.mkdir("p/e")  # a new directory at the name: pending until its marker is put
    denv.meta.write(lambda txn: txn.add_tombstone("p/e/"))  # e.g. a marker left by another move
    assert classify(denv, "p/e/") == "delete"


def test_an_old_object_at_a_new_files_name_is_deleted_before_its_upload(denv):  # noqa: F811
    """The same for a file: a file written at a name whose old object is still queued for
    deletion, then moved with its directory before its upload, left the old object behind
    in the hunt. Here one drain run ends right either way: the decision is what failed."""
    denv.mkdir("p")
    denv.write_file("p/f", b"old")
    denv.drain()
    denv.unlink("p/f")
    denv.write_file("p/f", b"new, not uploaded yet")
    assert classify(denv, "p/f") == "delete"
    denv.rename("p", "q")
    denv.drain()
    assert sorted(denv.listing()) == ["q/f"]
    assert denv.object_bytes("q/f") == b"new, not uploaded yet"


def test_a_settled_directorys_marker_is_kept_by_its_tombstone_of_a_live_name(denv):  # noqa: F811
    """What stays as it was: a name that is live and settled keeps its object (the tombstone
    is dropped), e.g. a directory this node knows from the bucket's listing."""
    denv.mkdir("p")
    denv.mkdir("p/e")
    denv.drain()
    ino = denv.ino("p/e")
    with denv.meta.read() as txn:
        assert txn.get_pending(ino) is None
    denv.meta.write(lambda txn: (txn.delete_remote(ino), txn.add_tombstone("p/e/")))
    assert classify(denv, "p/e/") == "drop"


def test_a_file_taking_the_old_name_of_a_directory_moved_with_its_parent_leaves_it_a_marker(denv):  # noqa: F811
    """The churn hunt's sixth defect: node A held an empty directory that no other node ever
    saw; fsmeta had it neither queued nor recorded in the bucket. An empty directory
    ``a/b`` has its marker ``a/b/``; its parent is renamed (``a`` -> ``x``), which queues the
    parent, not the directory; a new file then takes the name ``a/b``. Its upload deletes
    the old marker in the way and dropped the directory's record of it, "its pending round
    puts its new marker". But only the parent was queued, and the parent's round queues
    the children whose record names an old key: with no record left, none. ``x/b`` never got
    a marker. Here the file's upload goes first, as it did under churn."""
    denv.mkdir("a")
    denv.mkdir("a/b")
    denv.drain()
    assert "a/b/" in denv.listing()
    denv.rename("a", "x")
    denv.mkdir("a")
    denv.write_file("a/b", b"a file where the directory was")
    moved_parent, new_file = denv.ino("x"), denv.ino("a/b")

    def file_first(drain):
        file_done = trio.Event()
        reconcile_dir, reconcile_file = drain._reconcile_dir, drain._reconcile_file

        async def dir_after_the_file(cand):
            if cand.ino == moved_parent:
                with trio.move_on_after(5):
                    await file_done.wait()
            await reconcile_dir(cand)

        async def file_then_signal(cand):
            try:
                await reconcile_file(cand)
            finally:
                if cand.ino == new_file:
                    file_done.set()

        drain._reconcile_dir = dir_after_the_file
        drain._reconcile_file = file_then_signal

    denv.drain(setup=file_first)
    listing = denv.listing()
    assert "a/b" in listing and "a/b/" not in listing
    assert "x/b/" in listing  # the empty directory shows on other nodes at its new name
    with denv.meta.read() as txn:
        assert durability.is_durable(txn, denv.ino("x/b"))


LEASE_BREAK_SCRIPT = r"""
import os, subprocess, sys, time
from ckptfs.fsmeta.store import MetaStore
from ckptfs.gateway.core import Caller, FsCore
from ckptfs.gateway import spares as spares_module

cache = sys.argv[1]
meta = MetaStore(os.path.join(cache, "meta"))
core = FsCore(cache, meta)
core.recover()
core.enable_spares(target=0)  # recycling only, as the gateway does it
root = Caller(uid=0, gid=0, umask=0o022)
fh, attr = core.create(1, b"f", 0o644, os.O_RDWR, root)
core.write(fh, 0, b"the removed file's bytes")
core.release(fh)
cache_file = core._state.data_path(attr.ino)
real_rename = os.rename
openers = []

def rename_while_someone_opens(src, dst):
    # Another process (the drain uploading it, `ckptfs verify`) opens the file while the
    # recycling holds its lease: the kernel breaks the lease by signalling this process.
    if src == cache_file and not openers:
        openers.append(subprocess.Popen([sys.executable, "-c", f"import os; os.open({src!r}, os.O_RDONLY)"]))
        time.sleep(0.5)  # the opener is blocked in open(2) on the lease by now
    real_rename(src, dst)

spares_module.os.rename = rename_while_someone_opens
core.unlink(1, b"f")
core.forget([(attr.ino, 1)])
meta.commit()  # the removal's after-commit action recycles the cache file
assert openers, "the recycling never renamed the cache file"
assert openers[0].wait(30) == 0
core.close_spares()
meta.close()
print("the gateway survived the lease break")
"""


def test_a_process_opening_a_cache_file_the_gateway_recycles_does_not_kill_the_gateway(tmp_path):
    """The churn hunt's silent gateway deaths: no log line, no kernel message, the mount gone
    (ENOTCONN) in the first seconds of a round. Recycling a removed file's cache file takes a
    write lease on it (gateway/spares.py); when another process opens the file meanwhile, the
    kernel breaks the lease by sending the holder SIGIO, whose default action ends the process
    without a trace. The drain opens cache files to upload them, so under churn it sometimes
    opened one at that very moment. Run in a process of its own: before the fix it died of SIGIO."""
    cache = tmp_path / "cache"
    cache.mkdir()
    result = subprocess.run([sys.executable, "-c", LEASE_BREAK_SCRIPT, str(cache)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, (f"exit status {result.returncode} (killed by SIGIO: -{int(signal.SIGIO)})\n"
                                    f"{result.stdout}{result.stderr}")
    assert "survived" in result.stdout

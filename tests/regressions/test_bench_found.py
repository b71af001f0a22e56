"""Bugs the benchmarks found, each reduced to plain code that replays the interleaving.

Keep every one of these: each failed before its fix (named in the docstring).
"""

from __future__ import annotations

import os
import sys
import threading

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from test_drain_support import RecStore, denv  # noqa: E402,F401

from ckptfs.drain import worker  # noqa: E402
from ckptfs.fsmeta import durability  # noqa: E402


def test_a_directory_made_again_at_once_keeps_its_marker_when_the_old_ones_delete_overlaps(denv, monkeypatch):  # noqa: F811
    """``bench_write --meta-cached-files 60000``, two mounts side by side (2 runs in 4): the
    ``rmdir`` of the bench's working directory failed with ENOENT. Each round makes ``meta``,
    fills and empties it, and removes it; the next round makes it again at once.

    The drain checked that no delete of ``meta/`` was running, then read fsmeta (an
    ``await``) and only then reserved the key. The old directory's tombstone task started in
    that window, saw the new directory already holding a file and no owner of ``meta/``, and
    deleted the key after the new directory's marker had landed. The new directory recorded
    the marker as its own, so once emptied it put none: the bucket had no ``meta/``, and the
    bucket listing took the settled empty directory away from the mount. The key is now
    reserved in the same step as the check, and held until the commit."""
    denv.mkdir("d")
    denv.write_file("junk", b"j")
    denv.drain()
    denv.unlink("junk")

    marker_checked = threading.Event()  # the new d's marker write is between check and reservation
    tombstone_task_ran = threading.Event()
    marker_landed = trio.Event()
    shape = durability.key_shape_in_flux

    def key_shape_in_flux(txn, key):
        if key == "d/" and not marker_checked.is_set():
            # (in a worker thread: the user fills the new directory meanwhile)
            denv.write_file("d/f", b"in the new d")
            marker_checked.set()
            tombstone_task_ran.wait(10)
        return shape(txn, key)

    classify = worker.Drain._classify_tombstones

    def classify_tombstones(self, txn, items):
        if marker_checked.is_set():
            tombstone_task_ran.set()
        return classify(self, txn, items)

    monkeypatch.setattr(durability, "key_shape_in_flux", key_shape_in_flux)
    monkeypatch.setattr(worker.Drain, "_classify_tombstones", classify_tombstones)

    rec = RecStore(None)

    async def slow_deletes(keys, extra):
        if "junk" in keys:
            # The tombstone task of ``junk`` runs; ``d`` is removed and made again meanwhile,
            # so its tombstone waits for the next task while the new ``d`` starts its marker.
            await trio.to_thread.run_sync(lambda: (denv.rmdir("d"), denv.mkdir("d")))
            await trio.to_thread.run_sync(marker_checked.wait, 10)
        if "d/" in keys:
            with trio.move_on_after(10):
                await marker_landed.wait()  # a delete decided before the marker's PUT lands after it

    async def put_done(key, extra, result):
        if key == "d/":
            marker_landed.set()

    rec.hooks["delete_many"] = slow_deletes
    rec.after_hooks["put_object"] = put_done
    denv.drain(rec=rec, timeout=60)
    assert marker_checked.is_set() and tombstone_task_ran.is_set()  # the interleaving happened

    denv.unlink("d/f")
    denv.drain()
    assert "d/" in denv.listing(), "the empty directory has no marker: other nodes cannot see it"
    assert denv.pending() == {} and denv.tombstones() == {}

"""Drain order in practice: commit markers land last, are deleted first; open writers hold files back."""

from __future__ import annotations

import os

import trio

from ckptfs.fsmeta import durability, locks
from ckptfs.fsmeta.layout import CacheDir

from test_drain_support import MiB, RecStore, denv, wait_for  # noqa: F401

SHARDS = [f"ckpt/step_100/__{i}_0.distcp" for i in range(4)] + ["ckpt/step_100/sub/extra.pt"]
MARKER = "ckpt/step_100/.metadata"


def slow_store(delay: float = 0.15) -> RecStore:
    rec = RecStore(None)

    async def slow(key, extra):
        await trio.sleep(delay)

    rec.hooks["put_object"] = slow
    rec.hooks["upload_part"] = slow
    rec.hooks["complete_multipart"] = slow
    return rec


def landed(rec: RecStore, key: str) -> int:
    """Index of the event that made ``key`` visible (end of its PUT or CompleteMultipartUpload)."""
    idx = rec.index("put_object", key, "end") + rec.index("complete_multipart", key, "end")
    assert idx, f"{key} was never written"
    return max(idx)


def started(rec: RecStore, key: str) -> int:
    idx = rec.index("put_object", key, "start") + rec.index("create_multipart", key, "start")
    assert idx, f"{key} was never written"
    return min(idx)


def test_commit_marker_is_written_after_every_shard(denv):
    # The marker is the oldest dirty file: only the marker rule keeps it back.
    denv.write_file(MARKER, b'{"state_dict_metadata": {}}')
    for i, shard in enumerate(SHARDS):
        denv.write_file(shard, os.urandom(200_000 + i))
    denv.write_file("ckpt/step_100/big.distcp", os.urandom(6 * MiB))  # multipart
    denv.write_file("ckpt/latest", b"step_100")  # a marker one level up waits for the deeper one
    denv.write_file("elsewhere/file", b"unrelated")
    rec = denv.drain(rec=slow_store(), concurrency=8, part_size=5 * MiB)

    marker_start = started(rec, MARKER)
    for shard in SHARDS + ["ckpt/step_100/big.distcp"]:
        assert landed(rec, shard) < marker_start, f"{MARKER} was sent before {shard} landed"
    assert landed(rec, MARKER) < started(rec, "ckpt/latest")
    assert len(denv.listing()) == len(SHARDS) + 4
    assert denv.pending() == {}


def test_marker_in_a_tree_of_directories_waits_for_deep_shards_only_under_it(denv):
    denv.write_file("a/.metadata", b"m")
    denv.write_file("a/x/y/z/deep.pt", os.urandom(100_000))
    denv.write_file("b/.metadata", b"m")  # nothing under b: may go at once
    rec = RecStore(None)

    async def hold_deep_shard(key, extra):
        if key == "a/x/y/z/deep.pt":
            # Held until b/.metadata is in: b's marker must not wait for a's shards (else: timeout).
            with trio.fail_after(10):
                while not rec.index("put_object", "b/.metadata", "end"):
                    await trio.sleep(0.01)

    rec.hooks["put_object"] = hold_deep_shard
    denv.drain(rec=rec, concurrency=8)
    assert landed(rec, "a/x/y/z/deep.pt") < started(rec, "a/.metadata")
    assert landed(rec, "b/.metadata") < landed(rec, "a/x/y/z/deep.pt")


def test_deleting_a_checkpoint_removes_its_marker_first(denv):
    for shard in SHARDS:
        denv.write_file(shard, b"s")
    denv.write_file(MARKER, b"m")
    denv.write_file("ckpt/step_100/COMPLETE", b"")
    denv.drain()
    assert len(denv.listing()) == len(SHARDS) + 2

    for path in sorted([*SHARDS, MARKER, "ckpt/step_100/COMPLETE"]):
        denv.unlink(path)
    denv.rmdir("ckpt/step_100/sub")
    denv.rmdir("ckpt/step_100")
    rec = RecStore(None)

    async def slow_delete(keys, extra):
        await trio.sleep(0.1)

    rec.hooks["delete_many"] = slow_delete
    denv.drain(rec=rec)
    batches = rec.calls("delete_many")
    deleted = [k for batch in batches for k in batch]
    assert set(deleted) >= set(SHARDS) | {MARKER, "ckpt/step_100/COMPLETE"}
    markers_done = max(rec.index("delete_many", b, "end")[0] for b in batches
                       if MARKER in b or "ckpt/step_100/COMPLETE" in b)
    first_shard = min(rec.index("delete_many", b, "start")[0] for b in batches
                      if any(s in b for s in SHARDS))
    assert markers_done < first_shard, "a shard was deleted while the checkpoint still looked complete"
    assert denv.listing() == ["ckpt/"]  # ckpt itself is now an empty directory
    assert denv.tombstones() == {}


def test_open_writer_holds_a_file_back_until_release(denv):
    lock_fd = locks.acquire(CacheDir(denv.cache).gateway_lock)  # a live gateway: writers count
    try:
        fh, ino = denv.create("open.bin")
        denv.core.write(fh, 0, b"partial")
        denv.core.flush(fh)
        denv.write_file("closed.bin", b"done")

        async def main():
            async with denv.store() as inner:
                d = denv.make_drain(RecStore(inner))
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: d.run(stop=stop))
                    await wait_for(lambda: denv.state("closed.bin") == "durable")
                    await trio.sleep(0.3)
                    assert await trio.to_thread.run_sync(denv.head, "open.bin") is None, "open file uploaded"
                    assert denv.state("open.bin") == "dirty"
                    await trio.to_thread.run_sync(denv.core.write, fh, 7, b" and the rest")
                    await trio.to_thread.run_sync(denv.core.release, fh)
                    await wait_for(lambda: denv.state("open.bin") == "durable")
                    stop.set()

        trio.run(main)
        assert denv.object_bytes("open.bin") == b"partial and the rest"
    finally:
        os.close(lock_fd)


def test_a_writer_that_opens_between_the_scan_and_the_upload_holds_the_file_back(denv):
    """The scan saw a closed, settled file; before its job was loaded a writer reopened it with
    O_TRUNC and wrote (the size in fsmeta stays 0 until close). The drain must not upload that
    generation as empty: the object ends as the rewrite."""
    lock_fd = locks.acquire(CacheDir(denv.cache).gateway_lock)  # a live gateway: writers count
    try:
        ino = denv.write_file("f.bin", b"first version")
        handles = []

        def setup(d):
            reconcile = d._reconcile_file

            async def reopened_after_the_scan(cand):
                if cand.ino != ino or handles:
                    return await reconcile(cand)

                def rewrite():
                    fh = denv.core.open(ino, os.O_WRONLY | os.O_TRUNC)
                    denv.core.write(fh, 0, b"second version")
                    return fh

                handles.append(await trio.to_thread.run_sync(rewrite))
                await reconcile(cand)
                await trio.to_thread.run_sync(denv.core.release, handles[0])

            d._reconcile_file = reopened_after_the_scan

        denv.drain(setup=setup)
        assert handles
        assert denv.object_bytes("f.bin") == b"second version"
    finally:
        os.close(lock_fd)


def test_fsync_remote_urgent_flag_lets_an_open_file_through(denv):
    lock_fd = locks.acquire(CacheDir(denv.cache).gateway_lock)
    try:
        fh, ino = denv.create("urgent.bin")
        denv.core.write(fh, 0, b"fsynced bytes")
        denv.core.fsync(fh, False)
        denv.meta.write(lambda txn: durability.request_urgent(txn, ino))  # what fsync=remote does

        async def main():
            async with denv.store() as inner:
                d = denv.make_drain(RecStore(inner), settle_seconds=3600)  # urgent skips the settle window too
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: d.run(stop=stop))
                    await wait_for(lambda: denv.state("urgent.bin") == "durable")
                    stop.set()

        trio.run(main)
        assert denv.object_bytes("urgent.bin") == b"fsynced bytes"
        denv.core.release(fh)
    finally:
        os.close(lock_fd)


def test_stale_writer_counts_of_a_dead_gateway_do_not_block(denv):
    fh, ino = denv.create("left-open.bin")
    denv.core.write(fh, 0, b"fsynced before the crash")
    denv.core.fsync(fh, False)
    # No gateway.lock holder: the writers table is leftover from a crashed gateway.
    denv.drain()
    assert denv.object_bytes("left-open.bin") == b"fsynced before the crash"
    denv.core.release(fh)


def test_a_long_queue_is_scanned_less_often_and_still_drains_markers_last(denv, monkeypatch):
    # Scans read every pending inode, so with a long queue the drain scans at most a share of
    # its time; between scans, freed slots take the files the last scan found ready. Here
    # scans come every 0.5 s (as after a 50 ms scan), so most files must start between scans,
    # and the marker, judged only at a scan, must still wait for every shard.
    from ckptfs.drain import worker

    monkeypatch.setattr(worker.Drain, "_scan_interval", staticmethod(lambda scan_cpu: 0.5), raising=False)
    shards = [f"ckpt/step_7/shard_{i:02d}" for i in range(24)]
    for shard in shards:
        denv.write_file(shard, os.urandom(1000))
    denv.write_file(MARKER.replace("step_100", "step_7"), b"{}")
    scans = []

    def count_scans(drain):
        scan = drain._scan
        drain._scan = lambda txn: scans.append(1) or scan(txn)

    rec = denv.drain(rec=slow_store(0.05), concurrency=2, setup=count_scans, timeout=30)

    marker = MARKER.replace("step_100", "step_7")
    for shard in shards:
        assert landed(rec, shard) < started(rec, marker), f"{marker} was sent before {shard} landed"
    assert sorted(denv.listing()) == sorted([*shards, marker])
    assert denv.pending() == {}
    assert len(scans) < len(shards) / 2, f"{len(scans)} scans for {len(shards)} files: every start waited for a scan"


def test_a_freed_slot_takes_the_next_ready_file_at_once(denv, monkeypatch):
    # Small files drain as fast as slots free up, not a slot's worth per poll: with one slot
    # and polls 10 s apart, the files the first scan found ready start one after another as
    # each upload ends. (Waiting for the poll, the second file would start 10 s later.)
    from ckptfs.drain import worker

    monkeypatch.setattr(worker, "POLL_SECONDS", 10.0)
    names = [f"run/f{i}" for i in range(4)]
    for name in names:
        denv.write_file(name, b"x" * 100)

    async def run():
        async with denv.store() as store:
            drain = denv.make_drain(store, concurrency=1, settle_seconds=0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain.run)
                await wait_for(lambda: all((denv.bucket / name).exists() for name in names), timeout=8.0)
                nursery.cancel_scope.cancel()

    trio.run(run)
    assert sorted(denv.listing()) == names

"""Drain reliability: markers after renamed directories and re-saves, tombstones of replaced
files, cache files whose length disagrees with fsmeta, back-off on requeue, leaks."""

from __future__ import annotations

import logging
import os

import trio

from ckptfs.drain import schedule
from ckptfs.fsmeta.layout import CacheDir

from test_drain_support import MiB, RecStore, denv, wait_for  # noqa: F401

MARKERS = [".metadata", "latest*", "commit_success.txt", "*COMPLETE*"]


def landed(rec: RecStore, key: str) -> int:
    idx = (rec.index("put_object", key, "end") + rec.index("complete_multipart", key, "end")
           + rec.index("copy", key, "end"))
    assert idx, f"{key} was never written"
    return max(idx)


def started(rec: RecStore, key: str) -> int:
    idx = (rec.index("put_object", key, "start") + rec.index("create_multipart", key, "start")
           + rec.index("copy", key, "start"))
    assert idx, f"{key} was never written"
    return min(idx)


# -- item 2: a renamed directory holds back the markers above it ---------------------------



async def run_for(drain, seconds: float) -> None:
    """Run a drain for a while, then stop it (as a signal would)."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: drain.run(stop=stop))
        await trio.sleep(seconds)
        stop.set()

def test_pending_directory_below_a_marker_blocks_it():
    cands = [
        schedule.Candidate(2, "run/checkpoint-100", 1, 1, True, 0, False),
        schedule.Candidate(3, "run/latest", 2, 2, False, 0, False),
        schedule.Candidate(4, "other/latest", 3, 3, False, 0, False),
    ]
    ready = schedule.eligible(cands, now_ns=10, settle_ns=0, markers=MARKERS, busy=set())
    assert [c.ino for c in ready] == [2, 4]


def test_pending_ancestor_directory_blocks_a_marker():
    # `mv old new` with new/ckpt/.metadata written at once: the siblings of the
    # marker are still at their old keys until `new` is expanded.
    cands = [
        schedule.Candidate(2, "new", 1, 1, True, 0, False),
        schedule.Candidate(3, "new/ckpt/.metadata", 2, 2, False, 0, False),
    ]
    ready = schedule.eligible(cands, now_ns=10, settle_ns=0, markers=MARKERS, busy=set())
    assert [c.ino for c in ready] == [2]


def test_marker_written_after_a_directory_rename_lands_after_the_renamed_shards(denv):
    shards = [f"run/tmp-checkpoint-100/shard-{i}.pt" for i in range(4)]
    for s in shards:
        denv.write_file(s, os.urandom(50_000))
    denv.drain()
    denv.rename("run/tmp-checkpoint-100", "run/checkpoint-100")
    denv.write_file("run/latest", b"checkpoint-100")
    rec = denv.drain(concurrency=8)
    latest = started(rec, "run/latest")
    for s in shards:
        new = s.replace("tmp-checkpoint-100", "checkpoint-100")
        assert landed(rec, new) < latest, f"run/latest was sent before {new} existed"
    assert sorted(denv.listing()) == sorted(
        [s.replace("tmp-", "") for s in shards] + ["run/latest"])


# -- item 5: a file replaced by a directory of the same name ------------------------------


def test_file_replaced_by_a_directory_is_deleted_from_the_bucket(denv):
    denv.write_file("x", b"a file")
    denv.drain()
    denv.unlink("x")
    denv.mkdir("x")
    denv.write_file("x/y", b"below")
    denv.drain(timeout=15)
    assert denv.listing() == ["x/y"]
    assert denv.object_bytes("x/y") == b"below"
    assert denv.tombstones() == {}


# -- item 1: cache files whose length disagrees with fsmeta --------------------------------


def cache_path(denv, path: str):
    return denv.cache / "data" / f"{denv.ino(path):x}"


def test_drain_cuts_a_too_long_cache_file_and_uploads_the_recorded_size(denv):
    # kill -9 after writes that extended the file without a flush: the cache file is
    # longer than fsmeta's size, and no gateway is there to cut it.
    data = os.urandom(300_000)
    denv.write_file("run/f.bin", data)
    with open(cache_path(denv, "run/f.bin"), "ab") as f:
        f.write(b"never flushed" * 1000)
    denv.drain(timeout=10)
    assert denv.object_bytes("run/f.bin") == data
    assert denv.state("run/f.bin") == "durable"
    assert os.path.getsize(cache_path(denv, "run/f.bin")) == len(data)


def test_too_short_or_missing_cache_file_is_a_permanent_visible_error(denv):
    denv.write_file("ckpt/short.bin", os.urandom(200_000))
    denv.write_file("ckpt/missing.bin", os.urandom(1000))
    denv.write_file("ckpt/.metadata", b"{}")
    denv.write_file("other/ok.bin", b"fine")
    os.truncate(cache_path(denv, "ckpt/short.bin"), 100_000)  # power cut after close
    os.unlink(cache_path(denv, "ckpt/missing.bin"))
    drains = []
    denv.drain(timeout=10, setup=drains.append)  # exits instead of hanging
    assert drains[0].lost == {"ckpt/short.bin": "CacheFileShort", "ckpt/missing.bin": "CacheFileMissing"}
    assert drains[0].stats.errors_by_code["CacheFileShort"] == 1
    assert denv.state("ckpt/short.bin") == "error: CacheFileShort"
    assert denv.state("ckpt/missing.bin") == "error: CacheFileMissing"
    # never wrong content; and the marker of their directory waits for them
    assert denv.listing() == ["other/ok.bin"]
    assert drains[0].held == ["ckpt/.metadata"]
    # writing the file again clears the error and uploads it
    denv.write_file("ckpt/short.bin", b"new content")
    denv.write_file("ckpt/missing.bin", b"new too")
    denv.drain(timeout=10)
    assert sorted(denv.listing()) == ["ckpt/.metadata", "ckpt/missing.bin", "ckpt/short.bin", "other/ok.bin"]
    assert denv.state("ckpt/short.bin") == "durable"


def test_gateway_recovery_marks_a_short_cache_file_lost(denv):
    denv.write_file("f.bin", os.urandom(50_000))
    os.truncate(cache_path(denv, "f.bin"), 10)
    result = denv.core.recover()
    assert result["lost_files"] == {"f.bin": "CacheFileShort"}
    assert denv.state("f.bin") == "error: CacheFileShort"


def test_empty_file_without_a_cache_file_uploads_as_empty(denv):
    # mknod(S_IFREG) creates no cache file; an empty COMPLETE sentinel made that way uploads.
    import stat
    denv.mkdir("ckpt")
    denv.core.mknod(denv.ino("ckpt"), b"COMPLETE", stat.S_IFREG | 0o644, 0, __import__("test_drain_support").USER)
    if cache_path(denv, "ckpt/COMPLETE").exists():
        os.unlink(cache_path(denv, "ckpt/COMPLETE"))
    denv.drain(timeout=10)
    assert denv.listing() == ["ckpt/COMPLETE"]
    assert denv.object_bytes("ckpt/COMPLETE") == b""


def test_drain_cli_until_empty_exits_nonzero_naming_lost_files(denv):
    from test_cli_drain import run_cli
    denv.write_file("a/short.bin", os.urandom(100_000))
    denv.write_file("b/ok.bin", b"ok")
    os.truncate(cache_path(denv, "a/short.bin"), 5)
    denv.meta.sync()
    result = run_cli("drain", "--cache-dir", str(denv.cache), "--until-empty", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "CacheFileShort: a/short.bin" in result.stderr
    assert denv.listing() == ["b/ok.bin"]


def test_a_file_that_keeps_changing_under_its_upload_is_retried_with_back_off(denv, monkeypatch):
    # With a gateway alive the drain does not touch the cache file: it must back off.
    from ckptfs.drain import worker
    denv.write_file("f.bin", os.urandom(100_000))
    with open(cache_path(denv, "f.bin"), "ab") as f:
        f.write(b"x" * 1000)
    attempts = []
    real = worker.upload_file

    async def counting(*a, **kw):
        attempts.append(1)
        return await real(*a, **kw)

    monkeypatch.setattr(worker, "upload_file", counting)
    monkeypatch.setattr(CacheDir, "gateway_pid", lambda self: 1)

    async def run():
        async with denv.store() as inner:
            d = denv.make_drain(inner)
            await run_for(d, 2.0)

    trio.run(run)
    # 0.5 s, 1 s, 2 s ... between attempts (without back-off: one every poll, ~100+)
    assert 1 <= len(attempts) <= 4


def test_a_file_unlinked_as_its_upload_starts_is_not_reported_as_an_error(denv, monkeypatch, caplog):
    # The gateway removes (or recycles) the cache file of a closed file at its unlink: the
    # drain, about to read it, finds no file. That is no failure to show an operator.
    from ckptfs.drain import worker
    ino = denv.write_file("d/f.bin", os.urandom(100_000))
    real = worker.upload_file

    async def unlinked_first(*a, **kw):
        denv.unlink("d/f.bin")
        denv.core.forget([(ino, 1)])  # the kernel's FORGET: the inode and its cache file go
        return await real(*a, **kw)

    monkeypatch.setattr(worker, "upload_file", unlinked_first)
    caplog.set_level(logging.INFO, logger="ckptfs.drain")
    denv.drain()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("d/f.bin was removed as its upload started" in r.getMessage() for r in caplog.records)
    assert denv.pending() == {} and "d/f.bin" not in denv.listing()


def test_a_cache_file_missing_for_a_linked_file_is_still_an_error(denv, monkeypatch, caplog):
    denv.write_file("g.bin", os.urandom(1000))
    monkeypatch.setattr(CacheDir, "gateway_pid", lambda self: 1)  # (else it is settled as a crash's)
    os.unlink(cache_path(denv, "g.bin"))
    caplog.set_level(logging.INFO, logger="ckptfs.drain")

    async def run():
        async with denv.store() as inner:
            await run_for(denv.make_drain(inner), 0.5)

    trio.run(run)
    assert any(r.levelno == logging.ERROR and "reading the cache for g.bin failed" in r.getMessage()
               for r in caplog.records)


# -- item 10: leaks --------------------------------------------------------------------------


def test_upload_of_a_file_unlinked_before_its_id_is_recorded_is_aborted(denv):
    denv.write_file("big.bin", os.urandom(11 * MiB))
    rec = RecStore(None)

    async def unlink_during_create(key, extra, result):
        denv.unlink("big.bin")

    async def slow_part(key, extra):
        await trio.sleep(0.5)  # the drain notices the unlink while parts are in flight

    rec.after_hooks["create_multipart"] = unlink_during_create
    rec.hooks["upload_part"] = slow_part
    denv.drain(rec=rec, timeout=15)
    assert denv.open_uploads() == []
    assert denv.listing() == []


def test_upload_abandoned_because_the_file_changed_is_aborted(denv):
    denv.write_file("big.bin", os.urandom(11 * MiB))
    rec = RecStore(None)
    shrunk = []

    async def shrink_after_first_part(key, extra, result):
        if not shrunk:
            shrunk.append(1)
            os.truncate(cache_path(denv, "big.bin"), 6 * MiB)  # a part read now comes up short

    rec.after_hooks["upload_part"] = shrink_after_first_part
    denv.drain(rec=rec, timeout=10)
    assert rec.calls("create_multipart", "end")
    assert denv.open_uploads() == []
    # no gateway: the short file is recognised as lost, never uploaded
    assert denv.state("big.bin") == "error: CacheFileShort"
    assert denv.listing() == []


def test_errors_leave_the_status_once_the_file_succeeds(denv):
    from ckptfs.drain.store import StoreError
    denv.write_file("f.bin", b"data")
    rec = RecStore(None)
    failed = []

    async def fail_once(key, extra):
        if not failed:
            failed.append(1)
            raise StoreError("denied", code="AccessDenied", op="PutObject", key=key, retryable=False)

    rec.hooks["put_object"] = fail_once
    drains = []

    def setup(d):
        drains.append(d)

    from ckptfs.drain import worker
    old = worker.PERMANENT_RETRY_FIRST
    try:
        worker.PERMANENT_RETRY_FIRST = 0.05
        denv.drain(rec=rec, timeout=15, setup=setup)
    finally:
        worker.PERMANENT_RETRY_FIRST = old
    assert failed and denv.listing() == ["f.bin"]
    assert drains[0].stats.errors == {}


def test_stale_uploads_are_swept_periodically(denv, monkeypatch):
    from ckptfs.drain import worker
    monkeypatch.setattr(worker, "STALE_SWEEP_SECONDS", 0.1)
    sweeps = []

    async def run():
        async with denv.store() as inner:
            d = denv.make_drain(inner)

            async def sweep():
                sweeps.append(1)

            d._abort_stale_uploads = sweep
            await run_for(d, 0.6)

    trio.run(run)
    assert len(sweeps) >= 3


import pytest  # noqa: E402


def test_drain_cli_after_a_gateway_kill9_with_unflushed_extension_exits(denv):
    # The reported livelock: writes extended the file past its recorded size, no flush,
    # the gateway died holding the handle (a stale writer count), then
    # `ckptfs drain --until-empty`.
    from test_cli_drain import run_cli
    data = os.urandom(200_000)
    fh, _ = denv.create("run/f.bin")
    denv.core.write(fh, 0, data)
    denv.core.flush(fh)
    denv.core.write(fh, len(data), b"unflushed" * 10_000)
    denv.meta.sync()
    result = run_cli("drain", "--cache-dir", str(denv.cache), "--until-empty", timeout=60)
    assert result.returncode == 0, result.stderr
    assert denv.object_bytes("run/f.bin") == data


# -- item 3: re-saving into an existing checkpoint directory --------------------------------


def test_resave_into_a_checkpoint_directory_hides_its_marker_until_the_shards_are_back(denv):
    shards = [f"ckpt/step_100/shard-{i}.pt" for i in range(3)]
    for s in shards:
        denv.write_file(s, os.urandom(40_000))
    denv.write_file("ckpt/step_100/.metadata", b"v1")
    denv.write_file("ckpt/latest", b"step_100")
    denv.drain()
    new = {s: os.urandom(40_000) for s in shards[:2]}
    for s, data in new.items():
        denv.write_file(s, data)  # re-save in place (O_TRUNC)
    denv.write_file("ckpt/step_100/.metadata", b"v2")
    rec = RecStore(None)

    async def slow(key, extra):
        await trio.sleep(0.05)

    rec.hooks["put_object"] = slow
    denv.drain(rec=rec, concurrency=8)
    gone = rec.index("delete", "ckpt/step_100/.metadata", "end")
    assert gone, "the old marker stayed visible while its shards were replaced"
    for s in new:
        assert gone[0] < started(rec, s)
        assert landed(rec, s) < started(rec, "ckpt/step_100/.metadata")
    assert denv.object_bytes("ckpt/step_100/.metadata") == b"v2"
    assert denv.object_bytes("ckpt/latest") == b"step_100"
    for s, data in new.items():
        assert denv.object_bytes(s) == data
    assert denv.pending() == {}


def test_new_checkpoint_directory_leaves_the_markers_above_alone(denv):
    denv.write_file("ckpt/step_100/shard.pt", b"a")
    denv.write_file("ckpt/latest", b"step_100")
    denv.drain()
    denv.write_file("ckpt/step_200/shard.pt", b"b")
    rec = denv.drain()
    assert rec.calls("delete") == [] and rec.calls("delete_many") == []

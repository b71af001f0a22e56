"""The drain under faults: content moving under an upload, crashes (resume), store errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import blake3
import pytest
import trio

from ckptfs.drain import upload
from ckptfs.drain import worker
from ckptfs.drain.store import StoreError
from ckptfs.fsmeta import FileState, UploadPhase

from test_drain_support import REPO_ROOT, Crash, MiB, RecStore, denv, leaves, wait_for  # noqa: F401


def assert_object(env, key: str, data: bytes) -> None:
    assert env.object_bytes(key) == data
    assert env.head(key).metadata["blake3"] == blake3.blake3(data).hexdigest()
    assert env.state(key) == "durable"


@pytest.fixture
def fast_retries(monkeypatch):
    """Backoff of retryable errors in milliseconds, permanent errors retried after 0.3 s."""
    monkeypatch.setattr(upload, "backoff_delay", lambda attempt, *a, **k: 0.01)
    monkeypatch.setattr(worker, "PERMANENT_RETRY_SECONDS", 0.3)


# -- the file changes while it is being uploaded ----------------------------------------------


def test_write_during_multipart_upload_abandons_it_and_uploads_again(denv):
    data = os.urandom(20 * MiB)
    denv.write_file("big", data)
    patch = os.urandom(1 * MiB)
    rec = RecStore(None)
    state = {"changed": False}

    async def slow_part(key, part_number):
        if len(rec.calls("create_multipart")) > 1:
            return  # the second upload runs at full speed
        if not state["changed"]:
            state["changed"] = True
            # Another thread (the gateway) writes to the file while this part is in flight.
            await trio.to_thread.run_sync(denv.overwrite, "big", 7 * MiB, patch)
        await trio.sleep(0.5)

    rec.hooks["upload_part"] = slow_part
    denv.drain(rec=rec, concurrency=2, part_size=5 * MiB)

    final = data[:7 * MiB] + patch + data[8 * MiB:]
    assert denv.cache_bytes("big") == final
    assert_object(denv, "big", final)
    assert len(rec.calls("create_multipart")) == 2, "the first upload must be abandoned and redone"
    assert len(rec.calls("abort_multipart")) >= 1
    assert len(rec.calls("complete_multipart")) == 1
    assert denv.open_uploads() == []
    assert denv.upload_record("big") is None and denv.pending() == {}


def test_write_during_small_put_is_not_committed_as_durable(denv):
    denv.write_file("small", b"v1" * 1000)
    rec = RecStore(None)
    state = {"changed": False}

    async def change_then_put(key, extra):
        if not state["changed"]:
            state["changed"] = True
            await trio.to_thread.run_sync(denv.overwrite, "small", 0, b"V2")

    rec.hooks["put_object"] = change_then_put
    denv.drain(rec=rec)
    final = b"V2" + b"v1" * 999
    assert_object(denv, "small", final)
    assert rec.calls("put_object").count("small") == 2


# -- crash and resume ---------------------------------------------------------------------------


def test_crash_mid_upload_resumes_with_only_the_missing_parts(denv):
    data = os.urandom(20 * MiB + 123)  # 5 parts of 5 MiB (the last one short)
    denv.write_file("ckpt/model.pt", data)
    first = RecStore(None)

    async def crash_on_third(key, part_number):
        if len(first.calls("upload_part")) == 3:
            raise Crash("kill -9")

    first.hooks["upload_part"] = crash_on_third
    with pytest.raises(BaseException) as info:
        denv.drain(rec=first, concurrency=1, part_size=5 * MiB)
    assert any(isinstance(e, Crash) for e in leaves(info.value))

    record = denv.upload_record("ckpt/model.pt")
    assert record is not None and record.phase == int(UploadPhase.STARTED)
    assert sorted(p["number"] for p in record.parts) == [1, 2]
    assert record.key == "ckpt/model.pt" and record.size == len(data)
    assert denv.listing() == []
    assert [u.upload_id for u in denv.open_uploads()] == [record.upload_id]
    assert denv.state("ckpt/model.pt") == "uploading"

    second = denv.drain(concurrency=1, part_size=5 * MiB)
    assert sorted(second.parts_sent()) == [3, 4, 5]
    assert second.calls("create_multipart") == []
    assert_object(denv, "ckpt/model.pt", data)
    assert denv.open_uploads() == [] and denv.upload_record("ckpt/model.pt") is None


def test_killed_drain_process_resumes(denv, tmp_path):
    """A real drain process (parts slowed down) is SIGKILLed mid-upload; the next drain resumes it."""
    data = os.urandom(20 * MiB)
    denv.write_file("shard.bin", data)
    denv.meta.sync()
    script = (
        "import sys, time, trio\n"
        "from ckptfs.cli import main\n"
        "from ckptfs.drain import filestore\n"
        "orig = filestore.FileStore.upload_part\n"
        "async def slow(self, key, upload_id, number, *a, **kw):\n"
        "    await trio.sleep(0.2 if number <= 2 else 60)  # parts 3+ are in flight when killed\n"
        "    return await orig(self, key, upload_id, number, *a, **kw)\n"
        "filestore.FileStore.upload_part = slow\n"
        f"sys.exit(main(['drain', '--cache-dir', {str(denv.cache)!r}, '--until-empty']))\n"
    )
    denv.meta.put_settings({**denv.settings.to_json(), "concurrency": 2, "part_size": 5 * MiB})
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            record = denv.upload_record("shard.bin")
            if record is not None and len(record.parts) >= 2:
                break
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the drain never got two parts up"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    record = denv.upload_record("shard.bin")
    done = {p["number"] for p in record.parts}
    assert done == {1, 2}
    assert denv.listing() == []
    rec = denv.drain(concurrency=2, part_size=5 * MiB)
    assert sorted(rec.parts_sent()) == sorted(set(range(1, 5)) - done)
    assert rec.calls("create_multipart") == []
    assert_object(denv, "shard.bin", data)
    assert denv.open_uploads() == []


def crash_before_the_first_file_commit(drain) -> None:
    """A drain ``setup``: the drain dies as it would commit its first uploaded file."""
    original = drain._commit_file

    def commit_then_crash(txn, job, record):
        if not getattr(drain, "crashed", False):
            drain.crashed = True
            raise Crash("killed before the fsmeta commit")
        return original(txn, job, record)

    drain._commit_file = commit_then_crash


def test_crash_between_complete_and_commit_is_recognised(denv):
    data = os.urandom(11 * MiB)
    denv.write_file("w.bin", data)
    with pytest.raises(BaseException) as info:
        denv.drain(setup=crash_before_the_first_file_commit, part_size=5 * MiB)
    assert any(isinstance(e, Crash) for e in leaves(info.value))
    assert denv.listing() == ["w.bin"]  # the object is complete in the bucket
    record = denv.upload_record("w.bin")
    assert record is not None and record.phase == int(UploadPhase.COMPLETING)
    assert denv.state("w.bin") != "durable"

    rec = denv.drain(part_size=5 * MiB)
    assert rec.written_keys() == [] and rec.calls("complete_multipart") == []
    assert "w.bin" in rec.calls("head")
    assert_object(denv, "w.bin", data)
    assert denv.upload_record("w.bin") is None and denv.pending() == {}


@pytest.mark.parametrize("when", [2, 3], ids=["before-the-check", "between-check-and-copy"])
def test_metadata_changed_after_a_crash_is_not_stamped_on_another_nodes_object(denv, when):
    """After a crash between CompleteMultipartUpload and the fsmeta commit, a chmod made
    since the upload was created is copied onto the object in place. If another node
    overwrote the object meanwhile, that copy would put this file's blake3 and mode on the
    other node's bytes: every later read of it would fail its integrity check."""
    from ckptfs.gateway.core import SetattrRequest

    data, theirs = os.urandom(11 * MiB), os.urandom(3 * MiB)
    denv.write_file("w.bin", data, mode=0o644)
    with pytest.raises(BaseException):
        denv.drain(setup=crash_before_the_first_file_commit, part_size=5 * MiB)
    assert denv.upload_record("w.bin").phase == int(UploadPhase.COMPLETING)
    denv.core.setattr(denv.ino("w.bin"), SetattrRequest(mode=0o600))

    rec = RecStore(None)
    their_meta = {"blake3": blake3.blake3(theirs).hexdigest(), "mode": "0100640"}

    async def another_node_overwrites(key, extra):
        # after the HEAD that finds our completed upload: before the HEAD that compares
        # the metadata, or before the copy's own HEAD (the copy then needs If-Match)
        if key == "w.bin" and len(rec.calls("head")) == when:
            await rec._inner.put_object("w.bin", theirs, their_meta)

    rec.hooks["head"] = another_node_overwrites
    denv.drain(rec=rec, part_size=5 * MiB)
    assert denv.object_bytes("w.bin") == theirs
    assert denv.head("w.bin").metadata["blake3"] == their_meta["blake3"], \
        "this file's metadata was copied onto the other node's object"


def test_a_second_link_is_never_copied_from_another_nodes_object(denv):
    """A file with two names is uploaded to its first key and copied to the second. If
    another node overwrites the first key in between, the copy must not take its bytes under
    this file's blake3: the file is uploaded again from the cache (local content wins)."""
    from ckptfs.fsmeta import ROOT_INO

    data, theirs = os.urandom(3 * MiB), os.urandom(MiB)
    ino = denv.write_file("a.bin", data)
    denv.core.link(ino, ROOT_INO, b"b.bin")
    rec = RecStore(None)

    async def another_node_overwrites(key, extra):
        if len(rec.calls("copy")) == 1:
            await rec._inner.put_object("a.bin", theirs, {"blake3": blake3.blake3(theirs).hexdigest()})

    rec.hooks["copy"] = another_node_overwrites
    denv.drain(rec=rec)
    for key in ("a.bin", "b.bin"):
        assert_object(denv, key, data)


def test_crash_after_the_intent_commit_before_any_bucket_write_uploads_again(denv):
    # _begin_writes commits the keys' intents and the state UPLOADING together; a drain killed
    # right after that commit (here: as its first PUT or CreateMultipartUpload starts) has
    # written nothing, and the next one uploads both files and leaves no intent behind.
    small, big = os.urandom(1000), os.urandom(11 * MiB)
    denv.write_file("run/small.json", small)
    denv.write_file("run/big.bin", big)
    rec = RecStore(None)

    async def crash(key, extra):
        raise Crash("kill -9 after the intent commit")

    rec.hooks["put_object"] = crash
    rec.hooks["create_multipart"] = crash
    with pytest.raises(BaseException) as info:
        denv.drain(rec=rec, part_size=5 * MiB, concurrency=1)
    assert any(isinstance(e, Crash) for e in leaves(info.value))
    assert denv.listing() == [] and denv.open_uploads() == []
    with denv.meta.read() as txn:
        inode = txn.get_inode(txn.resolve(rec.events[0][1].encode()))
        assert inode.state == FileState.UPLOADING  # committed with the intent, before the write
    assert rec.events[0][1] in denv.tombstones()

    denv.drain(part_size=5 * MiB)
    assert_object(denv, "run/small.json", small)
    assert_object(denv, "run/big.bin", big)
    assert denv.pending() == {} and denv.tombstones() == {} and denv.open_uploads() == []


def test_crash_right_after_complete_returns(denv):
    data = os.urandom(11 * MiB)
    denv.write_file("w.bin", data)
    rec = RecStore(None)

    async def crash(key, upload_id, result):
        raise Crash("the response was lost with the process")

    rec.after_hooks["complete_multipart"] = crash
    with pytest.raises(BaseException):
        denv.drain(rec=rec, part_size=5 * MiB)
    again = denv.drain(part_size=5 * MiB)
    assert again.written_keys() == []
    assert_object(denv, "w.bin", data)


def test_changed_file_after_crash_is_not_taken_for_the_old_upload(denv):
    """The resumable upload belongs to an older generation: it is aborted, the new content uploaded."""
    data = os.urandom(11 * MiB)
    denv.write_file("f", data)
    first = RecStore(None)

    async def crash_on_second(key, part_number):
        if len(first.calls("upload_part")) == 2:
            raise Crash()

    first.hooks["upload_part"] = crash_on_second
    with pytest.raises(BaseException):
        denv.drain(rec=first, concurrency=1, part_size=5 * MiB)
    old_id = denv.upload_record("f").upload_id
    denv.overwrite("f", 0, b"NEW")
    rec = denv.drain(concurrency=1, part_size=5 * MiB)
    assert (("f", old_id) in rec.extras("abort_multipart"))
    assert_object(denv, "f", b"NEW" + data[3:])
    assert denv.open_uploads() == []


# -- store errors -------------------------------------------------------------------------------


def test_permanent_error_keeps_data_dirty_and_visible_then_recovers(denv, fast_retries):
    small, big = os.urandom(1000), os.urandom(11 * MiB)
    denv.write_file("run/small", small)
    denv.write_file("run/big", big)
    rec = RecStore(None)
    denied = {"on": True}

    async def deny(key, extra):
        if denied["on"]:
            raise StoreError(f"access denied to {key}", code="AccessDenied", retryable=False, status=403)

    rec.hooks["put_object"] = deny
    rec.hooks["upload_part"] = deny

    async def main():
        async with denv.store() as inner:
            rec._inner = inner
            d = denv.make_drain(rec, part_size=5 * MiB)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: d.run(until_empty=True))
                await wait_for(lambda: denv.state("run/small") == "error: AccessDenied"
                               and denv.state("run/big") == "error: AccessDenied")
                # Nothing dropped: the data is in the cache, still queued, not in the bucket.
                assert denv.cache_bytes("run/small") == small and denv.cache_bytes("run/big") == big
                assert {denv.ino("run/small"), denv.ino("run/big")} <= set(denv.pending())
                assert await trio.to_thread.run_sync(denv.listing) == []
                assert d.stats.errors.get("run/small") == "AccessDenied"
                await trio.sleep(0.5)  # retried (PERMANENT_RETRY_SECONDS), still failing, still kept
                assert denv.state("run/small") == "error: AccessDenied"
                denied["on"] = False
                with trio.fail_after(15):
                    await wait_for(lambda: not denv.pending(), timeout=15)

    trio.run(main)
    assert_object(denv, "run/small", small)
    assert_object(denv, "run/big", big)
    assert denv.open_uploads() == []
    assert len([k for k in rec.calls("put_object", "error") if k == "run/small"]) >= 2


@pytest.mark.parametrize("error", [
    StoreError("slow down", code="SlowDown", status=503),
    StoreError("bad gateway", code="Weird", status=503),
])
def test_retryable_errors_are_retried_until_done(denv, fast_retries, error):
    small, big = os.urandom(5000), os.urandom(6 * MiB)
    denv.write_file("a/small", small)
    denv.write_file("a/big", big)
    denv.write_file("moved", b"m")
    denv.drain()
    denv.rename("moved", "a/moved")
    denv.unlink("a/small")
    denv.write_file("a/small2", small)
    rec = RecStore(None)
    failures = {"put_object": 2, "upload_part": 2, "copy": 2, "delete_many": 2, "create_multipart": 1,
                "complete_multipart": 1}
    denv.overwrite("a/big", 0, b"again")

    def failing(op):
        async def hook(key, extra):
            if failures[op] > 0:
                failures[op] -= 1
                raise error

        return hook

    for op in failures:
        rec.hooks[op] = failing(op)
    captured = []
    denv.drain(rec=rec, setup=captured.append, part_size=5 * MiB)
    assert all(v == 0 for v in failures.values()), failures
    assert captured[0].stats.retries >= sum([2, 2, 2, 2, 1, 1])
    assert sorted(denv.listing()) == ["a/big", "a/moved", "a/small2"]
    assert_object(denv, "a/small2", small)
    assert_object(denv, "a/big", b"again" + big[5:])
    assert_object(denv, "a/moved", b"m")
    assert denv.open_uploads() == []

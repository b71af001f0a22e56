"""In-flight records of cluster commit, without FUSE: fsmeta's transitions (fsmeta/cluster.py),
the gateway's write guard that puts them (gateway/records.py) and the drain that holds
markers for them and deletes them (drain/cluster.py)."""

from __future__ import annotations

import os
import time

import pytest
import trio

from ckptfs.drain.factory import open_store
from ckptfs.fsmeta import cluster
from ckptfs.fsmeta.records import RecordState
from ckptfs.gateway.bucket import BucketClient
from ckptfs.gateway.records import Records

from test_drain_isolation import run_drain_until
from test_drain_support import denv  # noqa: F401


@pytest.fixture
def records(denv):
    bucket = BucketClient(lambda: open_store(denv.settings.bucket_url)).start()
    recs = Records(denv.meta, bucket, markers=list(denv.settings.markers), publish_timeout=5.0).install()
    yield recs
    denv.meta.write_guard = None
    bucket.close()


def bucket_records(denv, directory: str = "ck") -> list[str]:
    """The records of ``directory`` in the bucket (None: all of them)."""
    root = denv.bucket / ".ckptfs-inflight"
    found = sorted(str(p.relative_to(denv.bucket)) for p in root.rglob(".ckptfs-node-*")
                   if not p.name.endswith("-heartbeat")) if root.exists() else []
    if directory is None:
        return found
    return [k for k in found if k.rpartition("/")[0] == f".ckptfs-inflight/{directory}"]


def inflight(denv) -> dict:
    with denv.meta.read() as txn:
        return {ino: rec for ino, rec in txn.iter_inflight()}


def test_the_first_file_of_a_directory_puts_one_record_before_its_create_returns(denv, records):
    fh, _ = denv.create("ck/s0")
    (key,) = bucket_records(denv)
    assert key.startswith(f".ckptfs-inflight/ck/.ckptfs-node-{records.node}-{records.run}-")
    denv.core.release(fh)
    for i in range(1, 5):
        denv.write_file(f"ck/s{i}", b"data")
    assert bucket_records(denv) == [key]  # one per directory, not per file
    assert {rec.state for rec in inflight(denv).values()} == {RecordState.PUBLISHED}


def test_a_marker_puts_no_record(denv, records):
    denv.mkdir("ck")
    denv.write_file("ck/.metadata", b"m")
    assert bucket_records(denv) == []


def test_the_drain_deletes_a_record_once_its_directory_drained(denv, records):
    denv.write_file("ck/s0", b"0")
    denv.write_file("other/s1", b"1")
    (first,) = bucket_records(denv)
    assert len(bucket_records(denv, "other")) == 1
    denv.drain()
    assert bucket_records(denv, None) == []
    assert inflight(denv) == {}
    # A new file there later puts a new record (a new number: a delete in flight never removes it).
    denv.write_file("ck/s2", b"2")
    (key,) = bucket_records(denv)
    assert key != first


def test_a_marker_is_held_while_another_node_has_a_record_in_its_directory(denv, records):
    denv.write_file("ck/s0", b"mine")
    denv.write_file("ck/.metadata", b"m")
    other = denv.bucket / ".ckptfs-inflight" / "ck" / ".ckptfs-node-00000000000000ff-abcd0123-1"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(b"{}")

    drain = run_drain_until(denv, lambda d: "ck/.metadata" in d.cluster.held, hooks={})
    assert drain.cluster.held["ck/.metadata"].nodes == ["00000000000000ff"]
    assert denv.object_bytes("ck/s0") == b"mine"
    assert not (denv.bucket / "ck" / ".metadata").exists()
    other.unlink()
    denv.drain()
    assert denv.object_bytes("ck/.metadata") == b"m"


def test_records_of_an_earlier_run_that_fsmeta_never_recorded_are_swept(denv, records):
    mine_lost = denv.bucket / ".ckptfs-inflight" / "ck" / f".ckptfs-node-{records.node}-deadbeef-7"
    theirs = denv.bucket / ".ckptfs-inflight" / "ck" / ".ckptfs-node-00000000000000ff-deadbeef-7"
    for p in (mine_lost, theirs):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"{}")
    denv.write_file("ck/s0", b"0")  # a record of this run: kept
    assert records.sweep_orphans() == 1
    assert not mine_lost.exists() and theirs.exists()
    assert any(f"-{records.run}-" in r for r in bucket_records(denv))


def test_a_record_that_cannot_be_put_in_time_is_reported_and_put_later(denv, records, monkeypatch):
    records.publish_timeout = 0.3
    real_call = records.bucket.call
    calls = []

    def unreachable(fn):
        calls.append(fn)
        raise OSError("unreachable")

    monkeypatch.setattr(records.bucket, "call", unreachable)
    fh, _ = denv.create("ck/s0")  # acknowledged after the timeout, never failed
    denv.core.release(fh)
    assert records.failed == 2  # the root's (for the new directory ck) and ck's
    tried = len(calls)
    for i in range(1, 4):  # later files of the directory do not wait for its record again
        denv.write_file(f"ck/s{i}", b"x")
    assert len(calls) == tried
    assert {r.state for r in inflight(denv).values()} == {RecordState.PUBLISHING}
    assert bucket_records(denv, None) == []
    monkeypatch.setattr(records.bucket, "call", real_call)
    assert records.retry_unpublished() == 0
    assert len(bucket_records(denv)) == 1
    assert {r.state for r in inflight(denv).values()} == {RecordState.PUBLISHED}


def test_record_keys_fit_and_name_their_directory():
    key = cluster.record_key("run/step_1", "ab" * 8, "cd" * 4, 12)
    assert cluster.parse_record_key(key) == ("run/step_1", "ab" * 8, "cd" * 4, 12)
    deep = "/".join(["d" * 200] * 5)  # 1,004 bytes: its own record would not fit
    key = cluster.record_key(deep, "ab" * 8, "cd" * 4, 1)
    assert len(key.encode()) <= 1024
    directory = cluster.parse_record_key(key)[0]
    assert deep.startswith(directory + "/")
    # A marker in the deep directory lists the same ancestor's records: it still sees it.
    assert key.startswith(cluster.records_prefix(deep))
    assert cluster.records_prefix("") == cluster.INFLIGHT_PREFIX
    assert cluster.parse_record_key("run/step_1/model.pt") is None


def test_a_node_silent_for_node_timeout_shows_as_lost_and_still_holds_the_marker(denv, records):
    denv.write_file("ck/.metadata", b"m")
    other = denv.bucket / ".ckptfs-inflight" / "ck" / ".ckptfs-node-00000000000000ee-abcd0123-1"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(b"{}")
    an_hour_ago = time.time() - 3600
    os.utime(other, (an_hour_ago, an_hour_ago))

    def lost_shown(drain) -> bool:
        held = drain.cluster.held.get("ck/.metadata")
        return held is not None and "00000000000000ee" in held.lost

    drain = run_drain_until(denv, lost_shown, hooks={})
    assert not (denv.bucket / "ck" / ".metadata").exists()
    assert "00000000000000ee" in drain.cluster.status()["ck/.metadata"]["lost"]
    # A fresh heartbeat: the node is alive again (held still, not lost).
    beat = denv.bucket / ".ckptfs-inflight" / ".ckptfs-node-00000000000000ee-heartbeat"
    beat.write_bytes(b"{}")
    drain = run_drain_until(denv, lambda d: "ck/.metadata" in d.cluster.held and not lost_shown(d), hooks={})
    assert not (denv.bucket / "ck" / ".metadata").exists()


def test_a_drain_that_holds_records_puts_its_heartbeat(denv, records):
    fh, _ = denv.create("ck/s0")  # a record of this node

    async def beat():
        async with denv.store() as store:
            drain = denv.make_drain(store, node_timeout=4)
            await drain.cluster.start()
            # The record's own LastModified is the first sign of life: a beat is due a quarter
            # of node_timeout later.
            assert await drain.cluster.beat() is False
            with trio.fail_after(10):
                while not await drain.cluster.beat():
                    await trio.sleep(0.1)
            return True

    assert trio.run(beat) is True
    assert (denv.bucket / ".ckptfs-inflight" / f".ckptfs-node-{records.node}-heartbeat").exists()
    denv.core.release(fh)

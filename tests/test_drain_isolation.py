"""One file's failure stays with that file: the drain goes on with every other one.

An exception nobody foresaw (a defect, an error of a library) raised while the drain works on
one file, key or record is injected here through the recording store's hooks or by breaking
one fsmeta record; the drain (in-process, file:// bucket) must keep draining the rest, show
the failure and try the item again.
"""

from __future__ import annotations

import os

import trio

from ckptfs.drain import isolation
from ckptfs.drain.upload import Backoff
from ckptfs.fsmeta import schema

from test_drain_support import RecStore, denv, wait_for  # noqa: F401


class Defect(RuntimeError):
    """Stands in for a bug tied to one file's upload path."""


def run_drain_until(env, done, *, hooks: dict, timeout: float = 60.0):
    """Run a drain (no until_empty: a file in error never empties the queue) until
    ``done(drain)`` holds; returns the drain."""
    async def main():
        async with env.store() as inner:
            rec = RecStore(inner)
            rec.hooks.update(hooks)
            drain = env.make_drain(rec)
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: drain.run(stop=stop))
                await wait_for(lambda: done(drain), timeout=timeout, interval=0.05)
                stop.set()
            return drain

    return trio.run(main)


def test_an_unexpected_exception_in_one_upload_leaves_that_file_in_error_and_the_others_drain(denv):
    before = {f"before/f{i:03d}": os.urandom(100 + i) for i in range(50)}
    for path, data in before.items():
        denv.write_file(path, data)
    denv.write_file("bad/shard.pt", b"bad bytes")
    denv.write_file("bad/.metadata", b"marker")
    after = {f"after/f{i:03d}": os.urandom(100 + i) for i in range(50)}
    for path, data in after.items():
        denv.write_file(path, data)
    attempts = []

    async def defect_for_one_key(key, extra):
        if key == "bad/shard.pt":
            attempts.append(key)
            raise Defect("a bug in this file's upload path")

    def done(drain) -> bool:
        with denv.meta.read() as txn:
            pending = {ino for ino, _ in txn.iter_pending()}
        return (len(pending) == 2 and attempts
                and drain.stats.errors.get("bad/shard.pt") == "UnexpectedDefect")

    drain = run_drain_until(denv, done, hooks={"put_object": defect_for_one_key})
    for path, data in {**before, **after}.items():
        assert denv.object_bytes(path) == data
        assert denv.state(path) == "durable"
    assert denv.state("bad/shard.pt") == "error: UnexpectedDefect"
    # Its marker is held back: the checkpoint it is in is not complete.
    assert "bad/.metadata" not in denv.listing("bad/")
    assert drain.stats.unexpected_errors >= 1
    assert drain.stats.errors_by_code["UnexpectedDefect"] >= 1

    # Once the fault is gone, the file and then its marker drain.
    denv.drain()
    assert denv.object_bytes("bad/shard.pt") == b"bad bytes"
    assert denv.object_bytes("bad/.metadata") == b"marker"
    assert denv.state("bad/shard.pt") == "durable"


def test_a_delete_that_fails_unexpectedly_waits_alone_and_the_other_deletes_go_on(denv):
    names = [f"d/f{i:02d}" for i in range(20)]
    for path in names:
        denv.write_file(path, path.encode())
    denv.drain()
    for path in names:
        denv.unlink(path)

    async def defect_for_one_batch_member(keys, extra):
        if "d/f07" in keys:
            raise Defect("a bug tied to one key")

    def done(drain) -> bool:
        # (d/ is the directory's marker: it is empty in the namespace)
        return (set(denv.listing("d/")) == {"d/", "d/f07"} and set(denv.tombstones()) == {"d/f07"}
                and drain.stats.errors.get("delete d/f07") == "UnexpectedDefect")

    drain = run_drain_until(denv, done, hooks={"delete_many": defect_for_one_batch_member})
    assert drain.tombstone_quarantine.failures["d/f07"] >= 1
    denv.drain()
    assert denv.listing("d/") == ["d/"]
    assert denv.tombstones() == {}


def test_a_pending_record_that_does_not_decode_is_skipped_and_holds_its_marker(denv):
    denv.write_file("ck/shard.pt", b"shard")
    denv.write_file("ck/.metadata", b"marker")
    denv.write_file("other/file", b"other")
    broken = denv.ino("ck/shard.pt")
    denv.meta.write(lambda txn: txn.raw.put(schema.ino_key(broken), b"\x07garbage", db=txn.dbs["pending"]))

    def done(drain) -> bool:
        return "other/file" in denv.listing("other/") and "ck/shard.pt" in drain.stats.errors

    drain = run_drain_until(denv, done, hooks={})
    assert drain.stats.errors["ck/shard.pt"] == "UnreadableRecord"
    assert denv.listing("ck/") == []  # the marker waits for the shard it cannot read


def test_a_failed_batch_is_tried_one_key_at_a_time_in_bounded_rounds():
    now = [0.0]
    q = isolation.KeyQuarantine(Backoff(5.0, 60.0), clock=lambda: now[0])
    items = [(f"k{i}", {}) for i in range(isolation.ONE_BY_ONE_ROUND + 10)]
    assert q.batches(items) == [items]
    q.failed([k for k, _ in items])
    rounds = q.batches(items)
    assert [len(b) for b in rounds] == [1] * isolation.ONE_BY_ONE_ROUND
    for batch in rounds:
        q.failed([batch[0][0]]) if batch[0][0] == "k3" else q.succeeded([batch[0][0]])
    # The keys past the round come next, alone; the failed one waits out its back-off.
    later = q.batches([i for i in items if i[0] not in {b[0][0] for b in rounds} or i[0] == "k3"])
    assert [b[0][0] for b in later] == [k for k, _ in items[isolation.ONE_BY_ONE_ROUND:]]
    assert q.batches([("k3", {})]) == []
    now[0] += 5.0
    assert q.batches([("k3", {})]) == [[("k3", {})]]

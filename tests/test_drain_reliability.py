"""Drain reliability: markers after renamed directories and re-saves, tombstones of replaced
files, cache files whose length disagrees with fsmeta, back-off on requeue, leaks."""

from __future__ import annotations

import os

import trio

from ckptfs.drain import schedule

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

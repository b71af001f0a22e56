"""Read-path defects (remote objects, renames, evictions), each as plain code.

Found by (or written while extending) tests/test_model_drain.py's read-path rules.
"""

from __future__ import annotations

import json
import os
import stat
import threading

import blake3
import pytest
import trio
from conftest import RENAME_EXCHANGE
from regressions.test_drain_model_found import marker_checker, recording
from test_core_remote_names import Node, bucket, fast_drain, node  # noqa: F401 - its fixtures
from test_drain_support import Crash, DrainEnv, MiB, RecStore, leaves

from ckptfs.drain.filestore import FileStore
from ckptfs.drain.store import MOVING_PREFIX, PutResult
from ckptfs.drain.worker import object_metadata
from ckptfs.fsmeta import durability, schema
from ckptfs.gateway.space import SpaceLimits


class S3CopyStore(FileStore):
    """A ``file://`` bucket whose server-side copies behave as S3's CopyObject does: the copy
    of an object uploaded in parts is a new single-part object with a new ETag (the file
    store keeps the source's)."""

    async def copy(self, src_key, dst_key, metadata=None, *, storage_class=None, if_match=None):
        result = await super().copy(src_key, dst_key, metadata, storage_class=storage_class, if_match=if_match)
        if "-" not in result.etag:
            return result  # a single-part object keeps its ETag (the MD5 of its content)
        info = await self.head(dst_key)
        content = await self.get_range(dst_key, 0, info.size)
        put = await self.put_object(dst_key, content, info.metadata)
        assert put.etag != result.etag
        return PutResult(put.etag)


def put_multipart(bucket_root, key: str, data: bytes, scratch) -> None:
    """``key`` uploaded in parts (5 MiB and the rest), with the metadata our drain writes."""
    async def upload():
        async with FileStore(str(bucket_root)) as store:
            up = await store.create_multipart(key, object_metadata(
                stat.S_IFREG | 0o644, 0, 0, 1_700_000_000 * 10**9, blake3=blake3.blake3(data).hexdigest()))
            scratch.write_bytes(data)
            parts = [await store.upload_part(key, up, 1, str(scratch), 0, 5 * MiB),
                     await store.upload_part(key, up, 2, str(scratch), 5 * MiB, len(data) - 5 * MiB)]
            await store.complete_multipart(key, up, parts)

    trio.run(upload)


def read_all(reader: Node, path: str) -> bytes:
    attr = reader.walk(path)
    fh = reader.core.open(attr.ino, os.O_RDONLY)
    try:
        return reader.core.read(fh, 0, attr.size + 1)
    finally:
        reader.core.release(fh)


def test_a_renamed_remote_file_reads_after_its_copy_got_a_new_etag(node, bucket, tmp_path):  # noqa: F811
    """A remote file (uploaded in parts by another node) renamed here is moved by a
    server-side copy, which S3 answers with a new ETag; the file must read back at once,
    not fail with ESTALE because fsmeta kept the old object's ETag."""
    data = os.urandom(5 * MiB + 4096)
    put_multipart(bucket, "ckpt/big", data, tmp_path / "src")
    parent = node.walk("ckpt").ino
    node.walk("ckpt/big")
    node.core.rename(parent, b"big", parent, b"moved")
    node.drain(S3CopyStore)
    assert [o.key for o in node.bucket.list("ckpt/").objects] == ["ckpt/moved"]
    assert read_all(node, "ckpt/moved") == data  # within the TTL: no listing corrects it
    assert node.problems() == []


def test_a_partly_read_remote_file_reads_on_after_its_rename_is_drained(node, bucket, tmp_path):  # noqa: F811
    """A range read leaves the file partly fetched (the fetcher keeps it); after a rename the
    drain copies the object to the new key (new ETag) and deletes the old one: the rest of
    the file must come from the new object."""
    data = os.urandom(5 * MiB + 4096)
    put_multipart(bucket, "ckpt/big", data, tmp_path / "src")
    ino = node.walk("ckpt/big").ino
    fh = node.core.open(ino, os.O_RDONLY)
    assert node.core.read(fh, 5 * MiB, 100) == data[5 * MiB:5 * MiB + 100]
    node.core.release(fh)
    parent = node.walk("ckpt").ino
    node.core.rename(parent, b"big", parent, b"moved")
    node.drain(S3CopyStore)
    assert [o.key for o in node.bucket.list("ckpt/").objects] == ["ckpt/moved"]
    assert read_all(node, "ckpt/moved") == data
    assert node.problems() == []


def test_an_open_reader_reads_on_after_its_files_rename_is_drained(node, bucket, tmp_path):  # noqa: F811
    """A remote file open for reading is renamed here and the drain moves its object (copy to
    the new key, new ETag on S3, delete of the old key): the reader goes on reading its
    file, as on any filesystem, instead of failing with EIO (the object it fetched from is
    gone)."""
    data = os.urandom(5 * MiB + 4096)
    put_multipart(bucket, "ckpt/big", data, tmp_path / "src")
    fh = node.core.open(node.walk("ckpt/big").ino, os.O_RDONLY)
    assert node.core.read(fh, 0, 100) == data[:100]
    parent = node.walk("ckpt").ino
    node.core.rename(parent, b"big", parent, b"moved")
    node.drain(S3CopyStore)
    assert [o.key for o in node.bucket.list("ckpt/").objects] == ["ckpt/moved"]
    assert node.core.read(fh, 5 * MiB, 4096) == data[5 * MiB:]  # not fetched before the move
    node.core.release(fh)
    assert read_all(node, "ckpt/moved") == data
    assert node.problems() == []


def test_closing_an_empty_remote_file_opened_without_a_read_returns(node):  # noqa: F811
    """An empty object is whole before any GET; a handle closed without reading (``touch``,
    ``cat`` of nothing, an evicted empty file opened and closed) used to wait for a hash
    check nobody started: close hung for ever, holding a gateway worker thread."""
    node.put("ckpt/empty", b"", {"blake3": blake3.blake3(b"").hexdigest()})
    fh = node.core.open(node.walk("ckpt/empty").ino, os.O_RDONLY)
    closing = threading.Thread(target=node.core.flush, args=(fh,), daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "close of an empty remote file hangs"
    node.core.release(fh)
    assert node.core.getxattr(node.walk("ckpt/empty").ino, b"user.ckptfs.state") == b"durable"  # checked


def drained(tmp_path, files: dict[str, bytes]) -> DrainEnv:
    """``files`` uploaded, on a cache that evicts when told to (and evicts markers too)."""
    env = DrainEnv(tmp_path, settle_seconds=0)
    env.core.enable_space(SpaceLimits(cap=1 << 40, high=1 << 39, low=1 << 38, timeout=600.0, device_reserve=0))
    for path, data in files.items():
        env.write_file(path, data)
    env.drain()
    return env


def evicted_pair(tmp_path) -> DrainEnv:
    """``a`` (b"aaa") and ``b`` (b"bbb") uploaded, then evicted: the cache no longer holds them."""
    env = drained(tmp_path, {"a": b"aaa", "b": b"bbb"})
    assert env.core.evict(env.ino("a")) and env.core.evict(env.ino("b"))
    return env


def parked_objects(env: DrainEnv) -> list[str]:
    return env.listing(MOVING_PREFIX)


def bucket_contents(env: DrainEnv) -> dict[str, bytes]:
    return {k: env.object_bytes(k) for k in env.listing()}


def test_two_evicted_files_exchanged_reach_the_bucket(tmp_path):
    """Found by test_model_drain (evict, then RENAME_EXCHANGE of checkpoint directories).
    Each object is needed at the other's key and the cache holds neither: the drain used to
    wait for ever, leaving both names' old content in the bucket. It parks one object aside."""
    env = evicted_pair(tmp_path)
    try:
        env.rename("a", "b", RENAME_EXCHANGE)
        env.drain(timeout=5)
        assert (env.bucket / "a").read_bytes() == b"bbb" and (env.bucket / "b").read_bytes() == b"aaa"
        assert env.listing() == ["a", "b"] and parked_objects(env) == []  # the parked copy is gone
        assert env.pending() == {} and env.tombstones() == {}
    finally:
        env.close()


def test_three_evicted_files_moved_round_reach_the_bucket(tmp_path):
    """``mv a t; mv b a; mv c b; mv t c`` before the drain ran, none of them in the cache."""
    env = evicted_pair(tmp_path)
    try:
        env.write_file("c", b"ccc")
        env.drain()
        assert env.core.evict(env.ino("c"))
        for old, new in [("a", "t"), ("b", "a"), ("c", "b"), ("t", "c")]:
            env.rename(old, new)
        env.drain(timeout=5)
        assert {k: (env.bucket / k).read_bytes() for k in "abc"} == {"a": b"bbb", "b": b"ccc", "c": b"aaa"}
        assert env.listing() == ["a", "b", "c"] and parked_objects(env) == []
    finally:
        env.close()


@pytest.mark.parametrize("crash_after", ["the parked copy", "recording it"])
def test_a_crash_while_breaking_a_cycle_leaves_no_parked_object(tmp_path, monkeypatch, crash_after):
    """A drain killed after copying an object aside, before or after fsmeta records it: the
    next drain ends the cycle all the same and no parked object is left in the bucket."""
    env = evicted_pair(tmp_path)
    try:
        env.rename("a", "b", RENAME_EXCHANGE)
        rec = RecStore(None)
        if crash_after == "the parked copy":
            async def crash_after_parking(key, extra, result):
                if key.startswith(MOVING_PREFIX):
                    raise Crash()

            rec.after_hooks["copy"] = crash_after_parking
        else:
            recorded = []

            def record(txn, *args, moved_aside=durability.moved_aside):
                recorded.append(moved_aside(txn, *args))
                return recorded[-1]

            async def crash_once_recorded(key, extra):
                if recorded:
                    raise Crash()

            monkeypatch.setattr(durability, "moved_aside", record)
            rec.hooks["head"] = rec.hooks["copy"] = crash_once_recorded
        with pytest.raises(BaseException) as crashed:
            env.drain(rec=rec, timeout=5)
        assert any(isinstance(e, Crash) for e in leaves(crashed.value))
        assert len(parked_objects(env)) == 1
        monkeypatch.undo()
        env.drain(timeout=5)
        assert (env.bucket / "a").read_bytes() == b"bbb" and (env.bucket / "b").read_bytes() == b"aaa"
        assert env.listing() == ["a", "b"] and parked_objects(env) == []
        assert env.pending() == {} and env.tombstones() == {}
    finally:
        env.close()


def assert_new_metadata_on_the_same_content_shows(other: Node) -> None:
    """Another node re-puts ``ckpt/x`` with the same bytes and new mode/owner; the TTL passes."""
    other.put("ckpt/x", b"same", object_metadata(stat.S_IFREG | 0o600, 1234, 5678, 10**18,
                                              blake3=blake3.blake3(b"same").hexdigest()))
    other.advance()
    attr = other.walk("ckpt/x")
    assert (attr.mode, attr.uid, attr.gid) == (stat.S_IFREG | 0o600, 1234, 5678)


def test_new_metadata_on_the_same_content_shows_after_a_restart(tmp_path, bucket):  # noqa: F811
    """Found by test_model_drain: another node rewrites an object with the same content (the
    same ETag) and new metadata (mode, owner) after this node's gateway restarted; the change
    is seen only through LastModified, which the node used to remember in memory only, so it
    never showed. The remote record keeps it now."""
    first = Node(tmp_path / "cache", bucket)
    first.put("ckpt/x", b"same")  # another tool: no metadata
    assert first.walk("ckpt/x").mode == stat.S_IFREG | 0o644
    first.close()
    second = Node(tmp_path / "cache", bucket)  # the gateway restarted
    try:
        second.now = first.now + 10**9  # (the listing's TTL passes)
        assert_new_metadata_on_the_same_content_shows(second)
    finally:
        second.close()


def test_a_remote_record_written_before_it_kept_last_modified_loads_and_learns_it(tmp_path, bucket):  # noqa: F811
    """A cache from before remote records kept the listed LastModified: its records load, the
    next listing records it, and a later same-content rewrite with new metadata shows."""
    first = Node(tmp_path / "cache", bucket)
    first.put("ckpt/x", b"same")
    ino = first.walk("ckpt/x").ino

    def as_old_record(txn):
        old = json.loads(bytes(txn._get("remote", schema.ino_key(ino))))
        assert old.pop("listed_modified_ns")
        txn._put("remote", schema.ino_key(ino), json.dumps(old).encode())

    first.meta.write(as_old_record)
    first.close()
    second = Node(tmp_path / "cache", bucket)
    try:
        second.now = first.now + 10**9
        assert second.walk("ckpt/x").mode == stat.S_IFREG | 0o644  # loads; the listing records it
        assert_new_metadata_on_the_same_content_shows(second)
    finally:
        second.close()


@pytest.mark.parametrize("evicted", ["nothing", "the shard", "both"])
def test_a_marker_exchanged_with_a_shard_of_its_checkpoint_reaches_the_bucket(tmp_path, evicted):
    """Found by test_model_drain (evict two files, RENAME_EXCHANGE them: a checkpoint's marker
    and one of its shards). The shard needs the key that holds the marker's object; the marker
    drains only after every shard below its directory: the drain used to wait for ever. The
    marker's object leaves the shard's key first (parked aside, or, if the cache holds the
    marker, uploaded again from there); the old marker leaves before the shard is replaced."""
    env = drained(tmp_path, {"ck/s0": b"shard", "ck/.metadata": b"save 1"})
    try:
        if evicted != "nothing":
            assert env.core.evict(env.ino("ck/s0"))
        if evicted == "both":  # (a mount never evicts a marker: here, as another node's marker)
            assert env.core.evict(env.ino("ck/.metadata"))
        env.rename("ck/s0", "ck/.metadata", RENAME_EXCHANGE)
        seen, check = marker_checker(env, "ck", {b"save 1": {"s0": b"shard"}, b"shard": {}})
        env.drain(rec=recording(env, check), timeout=5)
        assert env.object_bytes("ck/s0") == b"save 1" and env.object_bytes("ck/.metadata") == b"shard"
        assert env.listing() == ["ck/.metadata", "ck/s0"] and parked_objects(env) == []
        assert env.pending() == {} and env.tombstones() == {}
        if evicted != "both":  # (a marker the cache does not hold cannot leave: it could not come back)
            assert seen == [], "the old marker showed over a replaced shard"
    finally:
        env.close()


def test_a_shard_promoted_to_marker_then_written_again_reaches_the_bucket(tmp_path):
    """``mv ck/s0 ck/.metadata``, then a new ``ck/s0``: the new shard needs the key that
    holds the marker's object, and the marker waits for the new shard."""
    env = drained(tmp_path, {"ck/s0": b"shard", "ck/.metadata": b"save 1"})
    try:
        env.rename("ck/s0", "ck/.metadata")
        env.write_file("ck/s0", b"new shard")
        seen, check = marker_checker(env, "ck", {b"save 1": {"s0": b"shard"}, b"shard": {}})
        env.drain(rec=recording(env, check), timeout=5)
        assert seen == [], "the old marker showed over the new shard"
        assert env.object_bytes("ck/s0") == b"new shard" and env.object_bytes("ck/.metadata") == b"shard"
        assert env.listing() == ["ck/.metadata", "ck/s0"] and parked_objects(env) == []
        assert env.pending() == {} and env.tombstones() == {}
    finally:
        env.close()


@pytest.mark.parametrize("evicted", [False, True])
def test_a_marker_holding_the_key_of_a_move_its_shard_waits_for_reaches_the_bucket(tmp_path, evicted):
    """Found by test_model_drain (checkpoints exchanged, evicted files exchanged): a cycle
    through another checkpoint. The new ``ck2/s0`` waits for the object at its key to move
    to ``ck1/s0``, that move waits for the object at ``ck1/s0`` (the marker ``ck2/.metadata``'s
    content now) to leave, and the marker waits for the new ``ck2/s0``: the drain used to
    wait for ever."""
    env = drained(tmp_path, {"ck1/s0": b"marker", "ck2/s0": b"moved shard", "ck2/.metadata": b"save 1"})
    try:
        if evicted:
            assert env.core.evict(env.ino("ck1/s0"))
        env.rename("ck1/s0", "ck2/.metadata")
        env.rename("ck2/s0", "ck1/s0")
        env.write_file("ck2/s0", b"new shard")
        env.drain(timeout=5)
        assert bucket_contents(env) == {
            "ck1/s0": b"moved shard", "ck2/.metadata": b"marker", "ck2/s0": b"new shard"}
        assert env.pending() == {} and env.tombstones() == {}
    finally:
        env.close()


def test_a_shard_resaved_after_a_marker_exchange_keeps_the_exchanged_shards_object(tmp_path):
    """Found by a hunt of test_model_drain: a marker exchanged with a shard is uploaded again
    from the cache, keeping the record of its old object (at the shard's key) until then. The
    other file's copy took that key meanwhile; a re-saved shard below the marker then took the
    stale record for the marker's object and deleted the key: the copied shard was lost from
    the bucket while fsmeta called it durable."""
    env = drained(tmp_path, {"ck/s0": b"shard 0", "ck/s1": b"shard 1", "ck/.metadata": b"save 1"})
    try:
        env.rename("ck/s0", "ck/.metadata", RENAME_EXCHANGE)
        rec = RecStore(None)

        async def crash_before_the_marker(key, extra):
            if key == "ck/.metadata":
                raise Crash()

        rec.hooks["put_object"] = crash_before_the_marker
        with pytest.raises(BaseException) as crashed:  # once ck/s0 holds the exchanged shard
            env.drain(rec=rec, timeout=5)
        assert any(isinstance(e, Crash) for e in leaves(crashed.value))
        assert env.object_bytes("ck/s0") == b"save 1"
        env.write_file("ck/s1", b"shard 1, saved again")
        env.drain(timeout=5)
        assert bucket_contents(env) == {
            "ck/.metadata": b"shard 0", "ck/s0": b"save 1", "ck/s1": b"shard 1, saved again"}
        assert env.pending() == {} and env.tombstones() == {}
    finally:
        env.close()


def test_a_file_moved_to_another_directory_waits_for_that_directorys_rename(tmp_path):
    """Found by a hunt of test_model_drain (files exchanged across checkpoints, then a
    checkpoint renamed): a file's ``parent`` field kept the directory it was created in, so a
    rename of the directory it was moved to was not seen as pending above it: ``ckptfs
    wait-durable``/``status`` called the file done before the drain moved its object, and the
    drain could take its object's key for another file before copying it."""
    env = drained(tmp_path, {"d1/f": b"content", "d2/g": b"other"})
    try:
        env.rename("d1/f", "d2/f")
        env.drain(timeout=5)
        env.rename("d2", "d3")
        with env.meta.read() as txn:
            assert durability.pending_ancestor(txn, env.ino("d3/f"))
            assert [p for p, *_ in durability.pending_under(txn, "d3/f").files] == ["d3/f"]
        env.drain(timeout=5)
        assert env.listing() == ["d1/", "d3/f", "d3/g"] and env.object_bytes("d3/f") == b"content"
    finally:
        env.close()

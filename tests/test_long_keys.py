"""Bucket keys up to S3's 1,024 bytes, past LMDB's 511-byte key limit.

fsmeta keys tombstones and the ``remote_keys`` index by bucket key; a key past LMDB's limit
is stored hashed, with the full key in the value (fsmeta/schema.py). These tests drive the
records directly, then the core and the drain (no FUSE) through every namespace operation
with keys of 511, 512, 600 and 1,024 bytes.
"""

from __future__ import annotations

import errno
import os

import pytest

from ckptfs.fsmeta import MetaStore, schema
from ckptfs.fsmeta.records import RemoteRecord
from ckptfs.gateway.core import FsError

from test_drain_support import MiB, USER, denv  # noqa: F401

KEY_LENGTHS = (511, 512, 600, 1024)


def key_of_length(n: int, stem: str = "run") -> str:
    """A key of exactly ``n`` UTF-8 bytes, in directories of at most 200-byte names (the
    issue's shape: a run name, an experiment name, a config hash, ...), with multi-byte
    characters so that byte and character counts differ."""
    parts, used = [], 0
    while n - used > 201:  # a component plus its slash, leaving room for the last one
        parts.append(stem[0] * 150 + "é" * 25)  # 200 bytes
        used += 201
    last = n - used
    name = "ü" * ((last - 5) // 2)  # ends with at least one "x": one byte shorter is name[:-1]
    name += "x" * (last - len(name.encode()))
    parts.append(name)
    key = "/".join(parts)
    assert len(key.encode()) == n, len(key.encode())
    return key


@pytest.fixture
def meta(tmp_path):
    store = MetaStore(str(tmp_path / "meta"))
    yield store
    store.close()


@pytest.mark.parametrize("length", KEY_LENGTHS)
def test_tombstones_and_the_remote_index_take_every_key_s3_takes(meta, length):
    key = key_of_length(length)
    sibling = key[:-1] + "z"  # same head, another key: a hashed one must not answer for it
    meta.write(lambda txn: txn.add_tombstone(key, writer=7, multipart=True))
    meta.write(lambda txn: txn.put_remote(9, RemoteRecord(key=key, size=1, blake3="ab", generation=1, etag="e")))
    with meta.read() as txn:
        assert txn.get_tombstone(key)["writer"] == 7
        assert txn.get_tombstone(sibling) is None
        assert [k for k, _ in txn.iter_tombstones()] == [key]
        assert txn.owner_of_remote_key(key) == 9
        assert txn.owner_of_remote_key(sibling) is None
        head, _, name = key.rpartition("/")
        for prefix in ("", head + "/", key, key[:-3]):
            assert [k for k, _ in txn.tombstones_below(prefix)] == [key]
            assert list(txn.remote_keys_below(prefix)) == [(key, 9)]
        assert list(txn.tombstones_below(sibling)) == []
        assert list(txn.remote_keys_below(sibling)) == []
    # A second tombstone over the first keeps what it said about uploads.
    meta.write(lambda txn: txn.add_tombstone(key, after=3))
    with meta.read() as txn:
        assert txn.get_tombstone(key) == {**txn.get_tombstone(key), "multipart": True, "after": 3}
        assert "key" not in txn.get_tombstone(key)
    meta.write(lambda txn: txn.remove_tombstone(sibling))
    meta.write(lambda txn: txn.delete_remote(9))
    with meta.read() as txn:
        assert txn.get_tombstone(key) is not None
        assert txn.owner_of_remote_key(key) is None
    meta.write(lambda txn: txn.remove_tombstone(key))
    with meta.read() as txn:
        assert list(txn.iter_tombstones()) == []
        assert list(txn.remote_keys_below("")) == []


def test_long_keys_below_one_directory_are_all_found_and_only_they(meta):
    base = key_of_length(600).rpartition("/")[0]
    keys = [f"{base}/{'k' * 200}{i}" for i in range(5)] + [f"{base}x/other"]
    for i, key in enumerate(keys):
        meta.write(lambda txn, key=key, i=i: (txn.add_tombstone(key),
                                              txn.put_remote(i + 1, RemoteRecord(key=key, size=0, blake3="",
                                                                                 generation=1, etag=""))))
    with meta.read() as txn:
        assert sorted(k for k, _ in txn.tombstones_below(base + "/")) == sorted(keys[:5])
        assert sorted(txn.remote_keys_below(base + "/")) == sorted((k, i + 1) for i, k in enumerate(keys[:5]))
        assert sorted(k for k, _ in txn.iter_tombstones()) == sorted(keys)


def test_a_cache_written_before_the_encoding_reads_the_same(tmp_path):
    """Keys up to 511 bytes are stored as they always were: an older cache's records read
    unchanged (written here as the code before the encoding wrote them)."""
    key = key_of_length(511)
    store = MetaStore(str(tmp_path / "meta"))
    store.write(lambda txn: (txn.raw.put(key.encode(), b'{"since_ns": 5}', db=txn.dbs["tombstones"]),
                             txn.raw.put(key.encode(), schema.pack_u64(4), db=txn.dbs["remote_keys"])))
    store.close()
    store = MetaStore(str(tmp_path / "meta"))
    try:
        with store.read() as txn:
            assert txn.get_tombstone(key) == {"since_ns": 5}
            assert list(txn.iter_tombstones()) == [(key, {"since_ns": 5})]
            assert txn.owner_of_remote_key(key) == 4
    finally:
        store.close()


@pytest.mark.parametrize("length", KEY_LENGTHS)
def test_every_namespace_operation_drains_with_a_long_key(denv, length):
    """create, write, rename (file and directory), hard link, unlink, rmdir and a marker, with
    keys of each length, reach the bucket as the namespace says."""
    key = key_of_length(length)
    head, _, leaf = key.rpartition("/")
    data = os.urandom(6 * MiB + 3)  # multipart at the test's 5 MiB parts
    denv.write_file(key, data)
    marker = f"{head}/.metadata"
    denv.write_file(marker, b"marker")
    denv.drain()
    assert denv.object_bytes(key) == data
    assert denv.state(key) == "durable"

    # Rename the file within its directory, link it, and rename the directory above it.
    renamed = f"{head}/{'r' * len(leaf.encode())}"
    denv.rename(key, renamed)
    linked = f"{head}/{'l' * len(leaf.encode())}"
    denv.core.link(denv.ino(renamed), *denv.parent_and_name(linked))
    top, _, rest = head.partition("/")
    moved_top = "m" * len(top.encode()) if rest else None
    denv.drain()
    assert sorted(denv.listing(head + "/")) == sorted([renamed, linked, marker])
    if moved_top:
        denv.rename(top, moved_top)
        denv.drain()
        moved = lambda k: moved_top + k[len(top):]  # noqa: E731
        assert sorted(denv.listing()) == sorted(moved(k) for k in (renamed, linked, marker))
        assert denv.object_bytes(moved(linked)) == data
        head, renamed, linked, marker = (moved(k) for k in (head, renamed, linked, marker))

    # Unlink everything, then remove the directories: the bucket empties.
    for path in (renamed, linked, marker):
        denv.unlink(path)
    parts = head.split("/")
    for depth in range(len(parts), 0, -1):
        denv.rmdir("/".join(parts[:depth]))
    denv.drain()
    assert denv.listing() == []
    assert denv.tombstones() == {}


def test_a_key_over_1024_bytes_is_refused_at_create_time(denv):
    key = key_of_length(1025)
    head, _, name = key.rpartition("/")
    denv.mkdir(head)
    parent = denv.ino(head)
    with pytest.raises(FsError) as err:
        denv.core.create(parent, name.encode(), 0o644, os.O_WRONLY, USER)
    assert err.value.errno == errno.ENAMETOOLONG
    fh, _ = denv.core.create(parent, name[:-1].encode(), 0o644, os.O_WRONLY, USER)  # 1,024 bytes
    denv.core.release(fh)

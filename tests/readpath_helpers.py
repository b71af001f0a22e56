"""Shared by the read-path tests: REMOTE inodes made by putting an object into a ``file://``
bucket and recording the inode as remote, and a store that records its ranged GETs."""

from __future__ import annotations

import os

import blake3
import trio

from ckptfs.drain.filestore import FileStore
from ckptfs.fsmeta import ROOT_INO, Inode, MetaStore, RemoteRecord, durability
from ckptfs.fsmeta.layout import CacheDir


class RecordingStore(FileStore):
    """A FileStore that remembers every ranged GET: (key, offset, length, if_match)."""

    def __init__(self, root: str):
        super().__init__(root)
        self.gets: list[tuple[str, int, int | None, str | None]] = []

    async def get_to_file(self, key, dest, offset=0, length=None, *, file_offset=None, if_match=None):
        self.gets.append((key, offset, length, if_match))
        return await super().get_to_file(key, dest, offset, length, file_offset=file_offset, if_match=if_match)

    def fetched_bytes(self) -> int:
        return sum(length for _, _, length, _ in self.gets)


def put_object(bucket_root: str, key: str, data: bytes, *, blake3_hex: str | None = None) -> str:
    """Put ``data`` at ``key`` with ``x-amz-meta-blake3`` (its real hash unless given; "" for
    none, as another tool writes it). Returns the object's etag."""
    digest = blake3.blake3(data).hexdigest() if blake3_hex is None else blake3_hex
    metadata = {"blake3": digest} if digest else {}

    async def put():
        async with FileStore(bucket_root) as store:
            await store.put_object(key, data, metadata)
            return (await store.head(key)).etag

    return trio.run(put)


def make_remote(meta: MetaStore, cache: CacheDir, bucket_root: str, name: bytes, data: bytes, *,
                blake3_hex: str | None = None, record_blake3: bool = True, parent: bytes = b"") -> int:
    """A file ``parent/name`` (``parent``: an existing directory, "" for the root) whose
    content is in the bucket only (state REMOTE, no cache file), as a bucket listing or an
    eviction leaves it. Returns its inode number."""
    key = (parent + b"/" + name if parent else name).decode()
    etag = put_object(bucket_root, key, data, blake3_hex=blake3_hex)
    digest = blake3.blake3(data).hexdigest() if blake3_hex is None else blake3_hex

    def add(txn):
        dir_ino = txn.resolve(parent) if parent else ROOT_INO
        ino = txn.alloc_ino()
        inode = Inode(ino, 0o100644, 0, 0, nlink=1, size=len(data), mtime_ns=1, ctime_ns=1,
                      generation=1, parent=dir_ino)
        txn.put_inode(inode)
        txn.add_entry(dir_ino, name, ino)
        durability.mark_remote(txn, inode, RemoteRecord(key, len(data), digest if record_blake3 else "", 1, etag))
        return ino

    ino = meta.write(add)
    try:
        os.unlink(cache.data_path(ino))
    except FileNotFoundError:
        pass
    return ino

"""Re-read what the bucket holds under a path and check it, for ``ckptfs verify``.

Every object under the path is read whole and its blake3 compared with its own
``x-amz-meta-blake3``; where fsmeta knows the file, also with the hash fsmeta recorded, and,
where the cache holds the file's content (DURABLE or CACHED_CLEAN with a cache file of the
right size), with the cached copy. A file fsmeta says is in the bucket whose object is not
there is reported missing. An object with no blake3 (written by another tool) has nothing to
be checked against: it is reported ``unchecked``, which is not a failure.

Reads fsmeta in one short transaction, never across a store request; hashing and cache-file
reads run in worker threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import blake3
import trio

from ckptfs.fsmeta import ROOT_INO, FileState, MetaStore
from ckptfs.fsmeta.layout import CacheDir

from .store import ObjectStore
from .upload import hash_file_sync

OK = "ok"
UNCHECKED = "unchecked"  # the object has no blake3 to check against
MISMATCH = "mismatch"  # the object's content does not match its x-amz-meta-blake3
OTHER_OBJECT = "other-object"  # the object's blake3 is not the one fsmeta recorded
CACHE_MISMATCH = "cache-mismatch"  # the cached copy differs from the object
MISSING = "missing"  # fsmeta says it is in the bucket; it is not
PROBLEMS = frozenset({MISMATCH, OTHER_OBJECT, CACHE_MISMATCH, MISSING})

CHUNK = 8 << 20


@dataclass
class Checked:
    key: str
    size: int
    status: str
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class _Known:
    ino: int
    size: int
    blake3: str
    cached: bool  # the cache file holds the content (DURABLE or CACHED_CLEAN)


def _known_under(meta: MetaStore, rel: str) -> dict[str, _Known]:
    """Files fsmeta says the bucket holds (not pending), at or below ``rel``, by key."""
    out: dict[str, _Known] = {}
    with meta.read() as txn:
        ino = txn.resolve(rel.encode("utf-8", "surrogateescape")) if rel else ROOT_INO
        if ino is None:
            return out
        inode = txn.get_inode(ino)
        inos = [ino] + ([child for _, child in txn.iter_subtree(ino)] if inode is not None and inode.is_dir else [])
        for child in inos:
            node = txn.get_inode(child)
            remote = txn.get_remote(child)
            if node is None or not node.is_reg or remote is None or not remote.key or txn.get_pending(child):
                continue
            out[remote.key] = _Known(child, node.size, remote.blake3,
                                     node.state in (FileState.DURABLE, FileState.CACHED_CLEAN))
    return out


def _under(key: str, rel: str) -> bool:
    return not rel or key == rel or key.startswith(rel.rstrip("/") + "/")


async def _object_blake3(store: ObjectStore, key: str, size: int) -> str:
    hasher = blake3.blake3()
    for start in range(0, size, CHUNK):
        chunk = await store.get_range(key, start, min(size, start + CHUNK))
        await trio.to_thread.run_sync(hasher.update, chunk)
    return hasher.hexdigest()


def _cached_copy_blake3(path: str, size: int) -> str | None:
    """The blake3 of the cache file at ``path`` if it holds ``size`` bytes and stayed the same
    file while it was hashed, else None (gone, another size, or evicted, refetched or reused
    meanwhile: nothing to judge, not a mismatch)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        before = os.fstat(fd)
        if before.st_size != size:
            return None
        digest, _ = hash_file_sync(fd, size)
        after = os.fstat(fd)
        try:
            named = os.stat(path)
        except FileNotFoundError:
            return None
    finally:
        os.close(fd)
    same = (before.st_ctime_ns, before.st_size) == (after.st_ctime_ns, after.st_size) \
        and (named.st_dev, named.st_ino) == (after.st_dev, after.st_ino)
    return digest if same else None


async def verify_tree(cache: CacheDir, meta: MetaStore, store: ObjectStore, rel: str, *, concurrency: int = 8,
                      on_checked: Callable[[Checked], None] | None = None) -> list[Checked]:
    """Check every object at or below ``rel`` (a path relative to the mount root)."""
    known = await trio.to_thread.run_sync(_known_under, meta, rel)
    listing = await store.list(rel.rstrip("/") if rel else "")
    objects = {o.key: o.size for o in listing.objects if _under(o.key, rel) and not o.is_dir_marker}
    results: list[Checked] = []
    limiter = trio.CapacityLimiter(concurrency)

    def done(item: Checked) -> None:
        results.append(item)
        if on_checked is not None:
            on_checked(item)

    async def check(key: str) -> None:
        async with limiter:
            info = await store.head(key)
            entry = known.get(key)
            if info is None:
                done(Checked(key, entry.size if entry else 0, MISSING, "fsmeta says it is in the bucket"))
                return
            declared = info.metadata.get("blake3", "")
            digest = await _object_blake3(store, key, info.size)
            if declared and digest != declared:
                done(Checked(key, info.size, MISMATCH, f"content blake3 {digest} != x-amz-meta-blake3 {declared}"))
                return
            if entry is not None and entry.blake3 and digest != entry.blake3:
                done(Checked(key, info.size, OTHER_OBJECT, f"content blake3 {digest} != recorded {entry.blake3}"))
                return
            if entry is not None and entry.cached:
                cached = await trio.to_thread.run_sync(_cached_copy_blake3, cache.data_path(entry.ino), info.size)
                if cached is not None and cached != digest:
                    done(Checked(key, info.size, CACHE_MISMATCH, f"cached copy blake3 {cached} != object {digest}"))
                    return
            done(Checked(key, info.size, OK if declared or (entry and entry.blake3) else UNCHECKED))

    async with trio.open_nursery() as nursery:
        for key in sorted(set(objects) | set(known)):
            nursery.start_soon(check, key)
    return sorted(results, key=lambda c: c.key)

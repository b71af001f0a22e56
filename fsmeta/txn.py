"""Typed access to one fsmeta transaction (the state machine on top: :mod:`.durability`).

Everything here runs inside a single LMDB transaction, so each public
mutation (and any sequence of them inside one :meth:`MetaStore.write`) is
atomic, across a crash too.
"""

from __future__ import annotations

import json
import stat
import time
from typing import Callable, Iterator

import lmdb

from . import schema
from .records import FileState, InflightRecord, Inode, PendingRecord, RemoteRecord, UploadRecord


Unreadable = Callable[[object, Exception], None]  # (its key: ino or bucket key, exception) of a record that does not decode


class UnreadableRecord(ValueError):
    """An fsmeta record that does not decode (a defect, or a damaged database)."""

    error_code = "UnreadableRecord"  # as shown in ckptfs status


class Txn:
    # Every removal of a name in this process counts here. A directory's path changes only
    # when a name of it or of an ancestor is removed (a rename removes, then adds), so a path
    # read while this held a value is right as long as it holds that value, in the process
    # that makes every name change (the gateway: gateway/names.py keeps such paths).
    names_removed = 0

    def __init__(self, raw: lmdb.Transaction, dbs: dict, write: bool):
        self.raw = raw
        self.dbs = dbs
        self.writable = write
        self.removed_names = False  # by this transaction: what it reads may yet be aborted
        self.queued: list[int] = []  # inodes this transaction put on the drain's queue (fsmeta/cluster.py)

    # -- generic -------------------------------------------------------------------

    def _get(self, db: str, key: bytes) -> bytes | None:
        return self.raw.get(key, db=self.dbs[db])

    def _put(self, db: str, key: bytes, value: bytes) -> None:
        self.raw.put(key, value, db=self.dbs[db])

    def _delete(self, db: str, key: bytes) -> bool:
        return self.raw.delete(key, db=self.dbs[db])

    def _iter_prefix(self, db: str, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        cursor = self.raw.cursor(db=self.dbs[db])
        if not cursor.set_range(start if start is not None else prefix):
            return
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            yield key, value

    # -- settings, counters --------------------------------------------------------

    def get_settings(self) -> dict | None:
        raw = self._get("meta", b"settings")
        return json.loads(bytes(raw)) if raw is not None else None

    def put_settings(self, settings: dict) -> None:
        self._put("meta", b"settings", json.dumps(settings, sort_keys=True).encode())

    def get_node_id(self) -> str | None:
        raw = self._get("meta", b"node_id")
        return bytes(raw).decode() if raw is not None else None

    def put_node_id(self, node: str) -> None:
        self._put("meta", b"node_id", node.encode())

    def next_inflight_seq(self) -> int:
        raw = self._get("meta", b"inflight_seq")
        seq = (schema.unpack_u64(raw) if raw is not None else 0) + 1
        self._put("meta", b"inflight_seq", schema.pack_u64(seq))
        return seq

    def get_inflight(self, dir_ino: int) -> InflightRecord | None:
        raw = self._get("inflight", schema.ino_key(dir_ino))
        return InflightRecord.from_bytes(raw) if raw is not None else None

    def put_inflight(self, dir_ino: int, rec: InflightRecord) -> None:
        self._put("inflight", schema.ino_key(dir_ino), rec.to_bytes())

    def delete_inflight(self, dir_ino: int) -> None:
        self._delete("inflight", schema.ino_key(dir_ino))

    def iter_inflight(self) -> Iterator[tuple[int, InflightRecord]]:
        cursor = self.raw.cursor(db=self.dbs["inflight"])
        for key, value in cursor:
            yield schema.key_ino(key), InflightRecord.from_bytes(value)

    def get_drain_status(self) -> dict | None:
        raw = self._get("meta", b"drain_status")
        return json.loads(bytes(raw)) if raw is not None else None

    def put_drain_status(self, status: dict) -> None:
        self._put("meta", b"drain_status", json.dumps(status).encode())

    def get_gateway_status(self) -> dict | None:
        raw = self._get("meta", b"gateway_status")
        return json.loads(bytes(raw)) if raw is not None else None

    def put_gateway_status(self, status: dict) -> None:
        self._put("meta", b"gateway_status", json.dumps(status).encode())

    def get_space_status(self) -> dict | None:
        raw = self._get("meta", b"space_status")
        return json.loads(bytes(raw)) if raw is not None else None

    def put_space_status(self, status: dict) -> None:
        self._put("meta", b"space_status", json.dumps(status).encode())

    def alloc_ino(self) -> int:
        return self._take_inos(1)

    def _take_inos(self, n: int) -> int:
        """The next ``n`` inode numbers, never handed out again; returns the first."""
        first = schema.unpack_u64(self._get("meta", b"next_ino"))
        self._put("meta", b"next_ino", schema.pack_u64(first + n))
        return first

    def reserve_inos(self, n: int, oldest: int | None = None) -> int:
        """Hand out ``n`` inode numbers at once, for the gateway's spare cache files
        (gateway/spares.py); returns the first. ``spare_inos`` becomes the numbers its spares
        may hold: from ``oldest`` (the lowest one a spare still holds), or else from the first."""
        first = self._take_inos(n)
        low = first if oldest is None else min(oldest, first)
        self._put("meta", b"spare_inos", schema.pack_u64(low) + schema.pack_u64(first + n))
        return first

    def spare_inos(self) -> range:
        """The inode numbers the live gateway's spare cache files may hold (see reserve_inos)."""
        raw = self._get("meta", b"spare_inos")
        if raw is None:
            return range(0)
        raw = bytes(raw)
        return range(schema.unpack_u64(raw[:8]), schema.unpack_u64(raw[8:16]))

    def init_root(self) -> None:
        now = time.time_ns()
        root = Inode(
            schema.ROOT_INO,
            stat.S_IFDIR | 0o755,
            0,
            0,
            nlink=2,
            atime_ns=now,
            mtime_ns=now,
            ctime_ns=now,
            state=FileState.DURABLE,
            parent=schema.ROOT_INO,
        )
        self.put_inode(root)

    # -- inodes --------------------------------------------------------------------

    def get_inode(self, ino: int) -> Inode | None:
        raw = self._get("inodes", schema.ino_key(ino))
        return Inode.unpack(ino, raw) if raw is not None else None

    def put_inode(self, inode: Inode) -> None:
        self._put("inodes", schema.ino_key(inode.ino), inode.pack())

    def delete_inode(self, ino: int) -> None:
        """Remove every record of an inode (its data file is the caller's). An object or upload
        still recorded for it is tombstoned, or nothing would ever delete it: a file unlinked
        while open keeps its object for its handles until this purge (gateway/namespace.py)."""
        key = schema.ino_key(ino)
        self.forget_remote_object(ino)
        for db in ("inodes", "pending", "writers", "uploads", "orphans", "errors"):
            self._delete(db, key)
        for k, _ in list(self._iter_prefix("xattrs", key)):
            self._delete("xattrs", bytes(k))

    def iter_inodes(self) -> Iterator[Inode]:
        cursor = self.raw.cursor(db=self.dbs["inodes"])
        for key, value in cursor:
            yield Inode.unpack(schema.key_ino(key), value)

    # -- directory entries ---------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> int | None:
        raw = self._get("dirents", schema.dirent_key(parent, name))
        return schema.unpack_u64(raw) if raw is not None else None

    def add_entry(self, parent: int, name: bytes, ino: int) -> None:
        self._put("dirents", schema.dirent_key(parent, name), schema.pack_u64(ino))
        self._put("links", schema.link_key(ino, parent, name), b"")

    def remove_entry(self, parent: int, name: bytes) -> int | None:
        key = schema.dirent_key(parent, name)
        raw = self._get("dirents", key)
        if raw is None:
            return None
        ino = schema.unpack_u64(raw)
        Txn.names_removed += 1
        self.removed_names = True
        self._delete("dirents", key)
        self._delete("links", schema.link_key(ino, parent, name))
        return ino

    def iter_dir(self, parent: int, after: bytes | None = None) -> Iterator[tuple[bytes, int]]:
        """Entries of a directory in name order, starting strictly after ``after``."""
        prefix = schema.ino_key(parent)
        start = schema.dirent_key(parent, after) + b"\x00" if after is not None else None
        for key, value in self._iter_prefix("dirents", prefix, start):
            yield bytes(key[8:]), schema.unpack_u64(value)

    def dir_is_empty(self, ino: int) -> bool:
        return next(self.iter_dir(ino), None) is None

    def links_of(self, ino: int) -> list[tuple[int, bytes]]:
        """Every (parent, name) naming ``ino``."""
        out = []
        for key, _ in self._iter_prefix("links", schema.ino_key(ino)):
            _, parent, name = schema.split_link_key(key)
            out.append((parent, name))
        return out

    def path_of(self, ino: int) -> bytes | None:
        """Path of ``ino`` relative to the root (``b""`` for the root); None if unlinked."""
        parts = []
        cur = ino
        for _ in range(4096):
            if cur == schema.ROOT_INO:
                return b"/".join(reversed(parts))
            links = self.links_of(cur)
            if not links:
                return None
            parent, name = links[0]
            parts.append(name)
            cur = parent
        raise RuntimeError(f"fsmeta: directory loop above inode {ino}")

    def paths_of(self, ino: int) -> list[bytes]:
        """Every path naming ``ino`` (more than one for hard links)."""
        out = []
        for parent, name in self.links_of(ino):
            base = self.path_of(parent)
            if base is not None:
                out.append(base + b"/" + name if base else name)
        return out

    def resolve(self, path: bytes) -> int | None:
        """The inode named by a relative path (``b""`` is the root), or None."""
        ino = schema.ROOT_INO
        for part in path.strip(b"/").split(b"/"):
            if not part:
                continue
            ino = self.lookup(ino, part)
            if ino is None:
                return None
        return ino

    def is_ancestor(self, maybe_ancestor: int, ino: int) -> bool:
        """True if directory ``maybe_ancestor`` is ``ino`` or above it."""
        cur = ino
        for _ in range(4096):
            if cur == maybe_ancestor:
                return True
            if cur == schema.ROOT_INO:
                return False
            inode = self.get_inode(cur)
            if inode is None:
                return False
            cur = inode.parent
        raise RuntimeError(f"fsmeta: directory loop above inode {ino}")

    def iter_subtree(self, ino: int) -> Iterator[tuple[bytes, int]]:
        """(relative path, ino) of everything below directory ``ino``, depth first."""
        for rel, child, _ in self.iter_subtree_inodes(ino):
            yield rel, child

    def iter_subtree_inodes(self, ino: int) -> Iterator[tuple[bytes, int, Inode | None]]:
        """(relative path, ino, inode) of everything below directory ``ino``, depth first."""
        stack = [(b"", ino)]
        while stack:
            base, dir_ino = stack.pop()
            for name, child in self.iter_dir(dir_ino):
                rel = base + b"/" + name if base else name
                inode = self.get_inode(child)
                yield rel, child, inode
                if inode is not None and inode.is_dir:
                    stack.append((rel, child))

    # -- xattrs --------------------------------------------------------------------

    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        raw = self._get("xattrs", schema.xattr_key(ino, name))
        return bytes(raw) if raw is not None else None

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        self._put("xattrs", schema.xattr_key(ino, name), value)

    def remove_xattr(self, ino: int, name: bytes) -> bool:
        return self._delete("xattrs", schema.xattr_key(ino, name))

    def list_xattrs(self, ino: int) -> list[bytes]:
        return [bytes(k[8:]) for k, _ in self._iter_prefix("xattrs", schema.ino_key(ino))]

    # -- drain queue and bucket records (transitions: ckptfs.fsmeta.durability) ----------

    def get_pending(self, ino: int) -> PendingRecord | None:
        raw = self._get("pending", schema.ino_key(ino))
        return PendingRecord.from_bytes(raw) if raw is not None else None

    def put_pending(self, ino: int, rec: PendingRecord) -> None:
        self._put("pending", schema.ino_key(ino), rec.to_bytes())
        self.queued.append(ino)

    def clear_pending(self, ino: int) -> None:
        self._delete("pending", schema.ino_key(ino))

    def is_pending(self, ino: int) -> bool:
        """Whether ``ino`` is pending, without reading its record."""
        return self._get("pending", schema.ino_key(ino)) is not None

    def pending_inos(self) -> Iterator[int]:
        """The pending inodes, without reading their records."""
        cursor = self.raw.cursor(db=self.dbs["pending"])
        for key in cursor.iternext(keys=True, values=False):
            yield schema.key_ino(key)

    def iter_pending(self, on_unreadable: Unreadable | None = None) -> Iterator[tuple[int, PendingRecord]]:
        """Every pending inode. ``on_unreadable(name, exc)``: a record that does not decode is
        passed to it and skipped (the drain's scan: one bad record must not stop the others);
        without it, the error is raised."""
        cursor = self.raw.cursor(db=self.dbs["pending"])
        for key, value in cursor:
            try:
                item = schema.key_ino(key), PendingRecord.from_bytes(value)
            except Exception as exc:
                if on_unreadable is None:
                    raise
                on_unreadable(schema.key_ino(key), UnreadableRecord(f"pending record: {exc!r}"))
                continue
            yield item

    def get_remote(self, ino: int) -> RemoteRecord | None:
        raw = self._get("remote", schema.ino_key(ino))
        return RemoteRecord.from_bytes(raw) if raw is not None else None

    def _remote_key_owner(self, key: str) -> int | None:
        raw = self._get("remote_keys", schema.bucket_key(key))
        if raw is None or (len(raw) > 8 and bytes(raw[8:]).decode() != key):
            return None
        return schema.unpack_u64(raw[:8])

    def _drop_remote_key(self, key: str, ino: int) -> None:
        """Remove ``key`` from the reverse index if it still names ``ino`` (another inode
        may have taken the key over, e.g. a directory re-created under a removed one's name)."""
        if self._remote_key_owner(key) == ino:
            self._delete("remote_keys", schema.bucket_key(key))

    def put_remote(self, ino: int, rec: RemoteRecord) -> None:
        old = self.get_remote(ino)
        if old is not None:
            self._drop_remote_key(old.key, ino)
        self._put("remote", schema.ino_key(ino), rec.to_bytes())
        full = rec.key.encode() if schema.is_long_bucket_key(rec.key) else b""
        self._put("remote_keys", schema.bucket_key(rec.key), schema.pack_u64(ino) + full)

    def delete_remote(self, ino: int) -> None:
        old = self.get_remote(ino)
        if old is not None:
            self._drop_remote_key(old.key, ino)
            self._delete("remote", schema.ino_key(ino))

    def owner_of_remote_key(self, key: str) -> int | None:
        """The inode whose durable content is the object at ``key`` (a copy source)."""
        return self._remote_key_owner(key)

    def get_upload(self, ino: int) -> UploadRecord | None:
        raw = self._get("uploads", schema.ino_key(ino))
        return UploadRecord.from_bytes(raw) if raw is not None else None

    def put_upload(self, ino: int, rec: UploadRecord) -> None:
        self._put("uploads", schema.ino_key(ino), rec.to_bytes())

    def delete_upload(self, ino: int) -> None:
        self._delete("uploads", schema.ino_key(ino))

    def iter_uploads(self) -> Iterator[tuple[int, UploadRecord]]:
        cursor = self.raw.cursor(db=self.dbs["uploads"])
        for key, value in cursor:
            yield schema.key_ino(key), UploadRecord.from_bytes(value)

    def add_tombstone(self, key: str, *, upload_id: str | None = None, now_ns: int | None = None,
                      writer: int | None = None, multipart: bool = False, after: int | None = None) -> None:
        """Queue ``key`` for deletion from the bucket.

        ``writer``: the drain is about to write ``key`` for that inode (an intent: if a crash
        loses the commit, the object it wrote is still accounted for); the drain keeps such a
        tombstone while the inode is pending under that name, and removes it when it commits.
        ``multipart``: a CreateMultipartUpload of ``key`` may have been sent whose id is not
        recorded. ``after``: an old name of that inode, deleted only once its new names are in
        the bucket (:func:`ckptfs.fsmeta.durability.held_for_new_names`). A tombstone added over
        another keeps what the older one said about multipart uploads (``upload_id``,
        ``multipart``); ``writer`` and ``after`` are replaced.
        """
        old = self.get_tombstone(key) or {}
        rec: dict = {"since_ns": now_ns or time.time_ns()}
        upload_id = upload_id or old.get("upload_id")
        if upload_id:
            rec["upload_id"] = upload_id
        if multipart or old.get("multipart"):
            rec["multipart"] = True
        if writer is not None:
            rec["writer"] = writer
        if after is not None:
            rec["after"] = after
        self._put("tombstones", schema.bucket_key(key), self._tombstone_value(key, rec))

    @staticmethod
    def _tombstone_value(key: str, rec: dict) -> bytes:
        return json.dumps({**rec, "key": key} if schema.is_long_bucket_key(key) else rec).encode()

    @staticmethod
    def _tombstone_item(stored: bytes, value: bytes) -> tuple[str, dict]:
        rec = json.loads(bytes(value))
        return rec.pop("key", None) or bytes(stored).decode(), rec

    def get_tombstone(self, key: str) -> dict | None:
        raw = self._get("tombstones", schema.bucket_key(key))
        if raw is None:
            return None
        full, rec = self._tombstone_item(b"", raw)
        return rec if not full or full == key else None

    def remove_tombstone(self, key: str) -> None:
        if self.get_tombstone(key) is not None:
            self._delete("tombstones", schema.bucket_key(key))

    def iter_tombstones(self, on_unreadable: Unreadable | None = None) -> Iterator[tuple[str, dict]]:
        """Every tombstone; ``on_unreadable`` as for :meth:`iter_pending`."""
        cursor = self.raw.cursor(db=self.dbs["tombstones"])
        for key, value in cursor:
            try:
                item = self._tombstone_item(key, value)
            except Exception as exc:
                if on_unreadable is None:
                    raise
                on_unreadable(bytes(key).decode("utf-8", "replace"), UnreadableRecord(f"tombstone: {exc!r}"))
                continue
            yield item

    def tombstones_below(self, prefix: str) -> Iterator[tuple[str, dict]]:
        for stored, value in self._iter_prefix("tombstones", schema.bucket_key_scan_prefix(prefix)):
            key, rec = self._tombstone_item(stored, value)
            if key.startswith(prefix):
                yield key, rec

    def remote_keys_below(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, owner) of the recorded bucket objects whose key starts with ``prefix``."""
        for stored, value in self._iter_prefix("remote_keys", schema.bucket_key_scan_prefix(prefix)):
            key = bytes(value[8:] if len(value) > 8 else stored).decode()
            if key.startswith(prefix):
                yield key, schema.unpack_u64(value[:8])

    def forget_remote_object(self, ino: int) -> None:
        """The inode's bucket object (and any in-flight upload) must go: tombstone them."""
        remote = self.get_remote(ino)
        if remote is not None:
            self.add_tombstone(remote.key)
            self.delete_remote(ino)
        upload = self.get_upload(ino)
        if upload is not None:
            self.add_tombstone(upload.key, upload_id=upload.upload_id)
            self.delete_upload(ino)
        self.clear_pending(ino)

    # -- writers, orphans, errors --------------------------------------------------

    def add_writer(self, ino: int, delta: int) -> int:
        key = schema.ino_key(ino)
        raw = self._get("writers", key)
        count = (schema.unpack_u32(raw) if raw is not None else 0) + delta
        if count > 0:
            self._put("writers", key, schema.pack_u32(count))
        else:
            self._delete("writers", key)
            count = 0
        return count

    def set_first_writer(self, ino: int) -> None:
        """The writer count of a new inode, which has none yet: 1."""
        self._put("writers", schema.ino_key(ino), schema.pack_u32(1))

    def writer_count(self, ino: int) -> int:
        raw = self._get("writers", schema.ino_key(ino))
        return schema.unpack_u32(raw) if raw is not None else 0

    def clear_writers(self) -> None:
        self.raw.drop(self.dbs["writers"], delete=False)

    def add_orphan(self, ino: int) -> None:
        self._put("orphans", schema.ino_key(ino), b"")

    def remove_orphan(self, ino: int) -> None:
        self._delete("orphans", schema.ino_key(ino))

    def iter_orphans(self) -> list[int]:
        cursor = self.raw.cursor(db=self.dbs["orphans"])
        return [schema.key_ino(k) for k, _ in cursor]

    def set_error(self, ino: int, message: str) -> None:
        self._put("errors", schema.ino_key(ino), message.encode())

    def get_error(self, ino: int) -> str | None:
        raw = self._get("errors", schema.ino_key(ino))
        return bytes(raw).decode() if raw is not None else None

    def count_errors(self) -> int:
        return self.raw.stat(self.dbs["errors"])["entries"]

    def clear_error(self, ino: int) -> None:
        self._delete("errors", schema.ino_key(ino))

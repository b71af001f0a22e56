"""The LMDB key schema of fsmeta: every key ckptfs stores, in one place.

The environment lives at ``CACHE/meta/`` (``data.mdb`` + ``lock.mdb``) and holds
these named databases. Integers in keys are big-endian so that LMDB's byte order
is numeric order; ``ino`` is a u64.

============  ==============================  ============================================
database      key                             value
============  ==============================  ============================================
``meta``      ``b"schema"``                   schema version, ascii int (``SCHEMA_VERSION``)
              ``b"next_ino"``                 u64: the next inode number to hand out
              ``b"spare_inos"``               u64 first + u64 end: the numbers the gateway
                                              reserved whose spare cache files
                                              (``data/<ino>``, no inode yet) may exist
                                              while it runs (gateway/spares.py)
              ``b"node_id"``                  ascii hex: this cache's node id (made once;
                                              names its in-flight records, cluster.py)
              ``b"inflight_seq"``             u64: the last in-flight record number
              ``b"settings"``                 JSON: bucket URL and settings the cache
                                              belongs to (so ``ckptfs drain --cache-dir``
                                              needs nothing else)
              ``b"drain_status"``             JSON: the drain's live view (pid, in-flight
                                              uploads with bytes done, retries, totals),
                                              refreshed every second, read by status/wait
              ``b"gateway_status"``           JSON: the gateway's pid, mountpoint and data
                                              path (passthrough|writeback), set at mount;
                                              ``metrics`` (address, served or why not) and
                                              ``drain`` (its supervisor's view: state,
                                              pid, restarts, last exit and error line,
                                              crash loop since), updated as they change
              ``b"space_status"``             JSON: the gateway's cache-space view (cap,
                                              watermarks, bytes used and by state,
                                              evictions, writers waiting for room),
                                              refreshed every second (gateway/space.py)
``inodes``    ino                             packed :class:`ckptfs.fsmeta.records.Inode`
                                              (attributes, generation, durability state,
                                              symlink target)
``dirents``   parent ino + name bytes         child ino (u64)
``links``     ino + parent ino + name bytes   empty: reverse index of ``dirents``, so
                                              an inode's path(s) are found without a scan
``xattrs``    ino + name bytes                value bytes (user.* only)
``remote``    ino                             JSON :class:`ckptfs.fsmeta.records.RemoteRecord`:
                                              where this inode's content is in the bucket
                                              (key, size, blake3, generation, etag,
                                              ``listed_modified_ns``: the LastModified a
                                              listing saw, 0 if none yet; records without
                                              it load as 0; ``link_etags``: key -> ETag of
                                              the copies at its other names, empty if
                                              unknown); the
                                              key is a name of the inode, an old one (a
                                              rename not drained yet), or
                                              ``.ckptfs-moving/<ino>-<hex>`` (parked by the
                                              drain to break a rename cycle)
``remote_keys`` bucket key (see below)         ino (u64), then, for a long key, the full
                                              key's bytes: reverse index of ``remote``
                                              (an object that is some inode's content is
                                              never deleted by a tombstone)
``pending``   ino                             :class:`ckptfs.fsmeta.records.PendingRecord`
                                              (19 bytes, struct; JSON from earlier versions
                                              is read too): the bucket does not match this
                                              inode yet
                                              (new/changed data, renamed, dir marker);
                                              the drain's work queue
``writers``   ino                             u32: handles the gateway holds open for
                                              writing (the drain waits for 0; cleared at
                                              gateway start, see ``gateway.lock``)
``uploads``   ino                             JSON :class:`ckptfs.fsmeta.records.UploadRecord`:
                                              an in-flight multipart upload (id, key,
                                              part size, generation, finished parts)
``tombstones`` bucket key (see below)         JSON: an object to delete from the bucket
                                              (old name of a renamed durable file,
                                              unlinked file, removed dir marker):
                                              ``since_ns``, ``upload_id`` (a dead upload
                                              to abort), ``multipart`` (abort the key's
                                              uploads fsmeta does not know), ``writer``
                                              (ino: the drain is writing this key for it;
                                              no delete while it is pending under it),
                                              ``after`` (ino: an old name of that file
                                              below a renamed directory, e.g. a second
                                              hard link's; no delete while the file or a
                                              directory above it is pending; a record
                                              without it is deleted at once); ``key``:
                                              the full key, for a long key only
``orphans``   ino                             empty: inode unlinked while open; its data
                                              is purged on ``forget`` or at next start
``inflight``  directory ino                   JSON :class:`ckptfs.fsmeta.records.InflightRecord`
                                              (seq, bucket key, state): this node's
                                              in-flight record of the directory in the
                                              bucket (fsmeta/cluster.py)
``errors``    ino                             utf-8: the last permanent upload error, or a
                                              read-path error of a REMOTE file
                                              (``RemoteHashMismatch``; ``user.ckptfs.state``
                                              shows it)
============  ==============================  ============================================

**Bucket keys as LMDB keys.** ``remote_keys`` and ``tombstones`` are keyed by a bucket
key relative to the prefix: S3 takes up to 1,024 bytes of UTF-8, LMDB at most
``LMDB_KEY_MAX`` (511) bytes. A key that fits is stored as its UTF-8 bytes, as before this
encoding existed, so older caches read unchanged. A longer one is stored as its first
``LONG_KEY_HEAD`` bytes, a NUL, and the SHA-256 of the whole key (:func:`bucket_key`: 511
bytes), and the record's value carries the full key. A bucket key never holds a NUL (it is
made of POSIX names), so the two forms never meet; and every key that starts with a prefix of
at most ``LONG_KEY_HEAD`` bytes is still stored under that prefix, so a range scan of "keys
below a directory" scans the head of the directory's key and filters on the full keys
(:meth:`ckptfs.fsmeta.txn.Txn.tombstones_below`). Range order of long keys is not the full
keys' order; no caller relies on it.

Invariants kept by every write transaction:

* A directory inode has exactly one dirent pointing to it (except the root, which
  has none) and ``Inode.parent`` names that dirent's parent.
* ``nlink`` of a file equals the number of dirents pointing to it; a file with
  ``nlink == 0`` is in ``orphans`` until purged.
* An inode is in ``pending`` whenever its bucket object is not known to match
  its current name and generation; "durable" (``wait-durable``, ``user.ckptfs.state``)
  means "not in ``pending``".
* ``Inode.state`` is about content, not names: a linked file is ``DURABLE`` only when
  the bucket holds its current generation (``durable_generation == generation`` and
  its ``remote`` record is of that generation). It stays ``DURABLE`` while it is in
  ``pending`` for a new name (reason ``rename``: the drain copies the object), never
  with reason ``data``.
"""

import hashlib
import struct

SCHEMA_VERSION = 1

DB_NAMES = (
    b"meta",
    b"inodes",
    b"dirents",
    b"links",
    b"xattrs",
    b"remote",
    b"remote_keys",
    b"pending",
    b"writers",
    b"uploads",
    b"tombstones",
    b"orphans",
    b"errors",
    b"inflight",
)

ROOT_INO = 1

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")


LMDB_KEY_MAX = 511  # MDB_MAXKEYSIZE of the default build py-lmdb ships
_DIGEST = 32
LONG_KEY_HEAD = LMDB_KEY_MAX - 1 - _DIGEST


def bucket_key(key: str) -> bytes:
    """The LMDB key of a record keyed by the bucket key ``key`` (see the docstring)."""
    raw = key.encode()
    if len(raw) <= LMDB_KEY_MAX:
        return raw
    return raw[:LONG_KEY_HEAD] + b"\0" + hashlib.sha256(raw).digest()


def is_long_bucket_key(key: str) -> bool:
    """Whether ``key`` is stored in the hashed form, its full bytes in the value."""
    return len(key.encode()) > LMDB_KEY_MAX


def bucket_key_scan_prefix(prefix: str) -> bytes:
    """The LMDB prefix under which every record whose bucket key starts with ``prefix`` is
    stored (the caller filters on the full keys when ``prefix`` is longer than the head)."""
    return prefix.encode()[:LONG_KEY_HEAD]


def ino_key(ino: int) -> bytes:
    return _U64.pack(ino)


def key_ino(key: bytes) -> int:
    return _U64.unpack_from(key)[0]


def dirent_key(parent: int, name: bytes) -> bytes:
    return _U64.pack(parent) + name


def split_dirent_key(key: bytes) -> tuple[int, bytes]:
    return _U64.unpack_from(key)[0], bytes(key[8:])


def link_key(ino: int, parent: int, name: bytes) -> bytes:
    return _U64.pack(ino) + _U64.pack(parent) + name


def split_link_key(key: bytes) -> tuple[int, int, bytes]:
    return _U64.unpack_from(key)[0], _U64.unpack_from(key, 8)[0], bytes(key[16:])


def xattr_key(ino: int, name: bytes) -> bytes:
    return _U64.pack(ino) + name


def pack_u64(n: int) -> bytes:
    return _U64.pack(n)


def unpack_u64(b: bytes) -> int:
    return _U64.unpack(b)[0]


def pack_u32(n: int) -> bytes:
    return _U32.pack(n)


def unpack_u32(b: bytes) -> int:
    return _U32.unpack(b)[0]

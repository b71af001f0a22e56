"""Records stored in fsmeta and their encodings (see :mod:`ckptfs.fsmeta.schema`)."""

from __future__ import annotations

import enum
import json
import stat
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field


class FileState(enum.IntEnum):
    """Durability state of an inode's content (the architecture's state machine)."""

    DIRTY = 1  # written locally, bucket does not have this generation
    UPLOADING = 2  # the drain is uploading the current generation
    DURABLE = 3  # bucket object at the current key holds the current generation
    REMOTE = 4  # known from the bucket, content not in the cache
    CACHED_CLEAN = 5  # content in the cache and equal to the bucket's (evictable)

    @property
    def label(self) -> str:
        """The word ``user.ckptfs.state`` shows."""
        return {
            FileState.DIRTY: "dirty",
            FileState.UPLOADING: "uploading",
            FileState.DURABLE: "durable",
            FileState.REMOTE: "remote",
            FileState.CACHED_CLEAN: "durable",
        }[self]


class UploadPhase(enum.IntEnum):
    """Where an in-flight upload is; stored in :class:`UploadRecord`."""

    STARTED = 1  # multipart created, parts being sent
    COMPLETING = 2  # CompleteMultipartUpload sent, fsmeta commit not yet done


_STATES = {state.value: state for state in FileState}

# mode, uid, gid, nlink, size, atime, mtime, ctime, generation, state, parent,
# durable_generation, rdev; symlink target follows as the tail.
_INODE = struct.Struct(">IIIIQqqqQBQQI")


@dataclass
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int = 1
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    generation: int = 0
    state: FileState = FileState.DIRTY
    parent: int = 0  # directories: the parent directory; files: parent of the first link
    durable_generation: int = 0  # generation the bucket holds (0: none)
    rdev: int = 0
    target: bytes = b""  # symlink target

    def pack(self) -> bytes:
        return (
            _INODE.pack(
                self.mode,
                self.uid,
                self.gid,
                self.nlink,
                self.size,
                self.atime_ns,
                self.mtime_ns,
                self.ctime_ns,
                self.generation,
                int(self.state),
                self.parent,
                self.durable_generation,
                self.rdev,
            )
            + self.target
        )

    @classmethod
    def unpack(cls, ino: int, raw: bytes) -> "Inode":
        fields = _INODE.unpack_from(raw)
        return cls(
            ino,
            *fields[:9],
            _STATES[fields[9]],  # (FileState(n) costs a microsecond; every lookup unpacks)
            fields[10],
            fields[11],
            fields[12],
            bytes(raw[_INODE.size :]),
        )

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)


class _JsonRecord:
    def to_bytes(self) -> bytes:
        # The fields are JSON values (str, int, bool, a dict of str): no deep copy needed, as
        # dataclasses.asdict would make (a third of a pending record's cost).
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes):
        return cls(**json.loads(bytes(raw)))


@dataclass
class RemoteRecord(_JsonRecord):
    """Where an inode's content lives in the bucket."""

    key: str
    size: int
    blake3: str
    generation: int
    etag: str = ""
    # The LastModified a bucket listing showed for the object at ``key`` (ns; 0: not seen yet,
    # e.g. just written by the drain): a same-content copy with new metadata (a chmod on
    # another node) keeps the etag, and only this tells it, across gateway restarts.
    listed_modified_ns: int = 0
    # The ETags of the copies at the file's other names (hard links), as this node's drain
    # wrote them: a listing that shows another ETag there saw another node replace that name.
    link_etags: dict[str, str] = field(default_factory=dict)


#: Why an inode is pending, as a byte in :class:`PendingRecord`'s encoding (the index).
PENDING_REASONS = ("data", "rename", "meta")
_PENDING_REASON_CODES = {reason: code for code, reason in enumerate(PENDING_REASONS)}
_PENDING_V1 = 1
_PENDING = struct.Struct("<BqqBB")  # format 1, since_ns, changed_ns, reason, urgent


@dataclass(slots=True)
class PendingRecord:
    """Why the bucket does not match an inode yet. ``since_ns`` orders the queue.

    Stored as 19 bytes (``_PENDING``): most namespace operations read and rewrite one, and
    JSON cost them about 10% of a create's CPU. A record that starts with ``{`` is the JSON
    an earlier version wrote, and is read as such."""

    since_ns: int  # when it became pending (first change); oldest first
    changed_ns: int  # last change (write close, rename); settle window counts from here
    reason: str = "data"  # data | rename | meta
    urgent: bool = False  # fsync=remote is waiting: upload even with a writer open

    def to_bytes(self) -> bytes:
        return _PENDING.pack(_PENDING_V1, self.since_ns, self.changed_ns,
                             _PENDING_REASON_CODES[self.reason], self.urgent)

    @classmethod
    def from_bytes(cls, raw) -> "PendingRecord":
        raw = bytes(raw)
        if raw[:1] == b"{":
            return cls(**json.loads(raw))
        fmt, since_ns, changed_ns, reason, urgent = _PENDING.unpack(raw)
        if fmt != _PENDING_V1:
            raise ValueError(f"pending record of unknown format {fmt}")
        return cls(since_ns, changed_ns, PENDING_REASONS[reason], bool(urgent))


@dataclass(frozen=True, slots=True)
class PartRecord:
    """One uploaded part of a multipart upload (the store returns it, fsmeta keeps it).

    ``checksum`` is the base64 value of the store's checksum algorithm (e.g.
    CRC32C) or None when the store uses md5/none.
    """

    number: int
    etag: str  #: without quotes
    size: int
    checksum: str | None = None

    def to_dict(self) -> dict:
        return {"number": self.number, "etag": self.etag, "size": self.size, "checksum": self.checksum}

    @classmethod
    def from_dict(cls, d: Mapping) -> "PartRecord":
        return cls(number=int(d["number"]), etag=str(d["etag"]), size=int(d["size"]), checksum=d.get("checksum"))


#: ``UploadRecord.checksum_algorithm`` of a record read back from JSON: fsmeta does not
#: store it, so a resume accepts whatever the store uses now.
UNKNOWN_CHECKSUM = "?"


@dataclass
class UploadRecord:
    """An in-flight multipart upload, enough for a restarted drain to resume it.

    The uploader fills in what the bucket needs; the drain adds ``generation`` and
    ``phase`` and stores it in fsmeta. The stored JSON is ``to_dict()``: the fields
    the drain has always written, so records of earlier versions resume.
    """

    key: str
    upload_id: str
    generation: int
    part_size: int
    size: int
    phase: int = int(UploadPhase.STARTED)
    blake3: str = ""
    parts: list[dict] = field(default_factory=list)  # PartRecord.to_dict() of each part sent
    # the store's checksum algorithm when the parts were sent; not persisted
    checksum_algorithm: str | None = UNKNOWN_CHECKSUM

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["checksum_algorithm"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "UploadRecord":
        return cls(**{"checksum_algorithm": UNKNOWN_CHECKSUM, **d})

    def part_map(self) -> dict[int, PartRecord]:
        """Part number -> part, for the parts recorded so far."""
        return {int(p["number"]): PartRecord.from_dict(p) for p in self.parts}

    def add_part(self, part: PartRecord) -> None:
        """Record ``part`` (replacing an earlier record of the same number)."""
        self.parts = [p for p in self.parts if p["number"] != part.number] + [part.to_dict()]

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "UploadRecord":
        return cls.from_dict(json.loads(bytes(raw)))


class RecordState(enum.IntEnum):
    PUBLISHING = 1  # the record is being put (or a put failed and is retried): not known in the bucket
    PUBLISHED = 2  # in the bucket
    REMOVING = 3  # the drain is deleting it


@dataclass
class InflightRecord:
    seq: int
    key: str
    state: RecordState

    def to_bytes(self) -> bytes:
        return json.dumps({**asdict(self), "state": int(self.state)}).encode()

    @classmethod
    def from_bytes(cls, raw) -> "InflightRecord":
        d = json.loads(bytes(raw))
        return cls(d["seq"], d["key"], RecordState(d["state"]))

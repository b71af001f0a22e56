"""Object-store interface used by the drain (uploads), the read path (ranged
reads) and the lifecycle engine (listing, tags, copies, bucket rules).

Everything here is async and meant to run under **trio**.  Implementations never
do disk I/O or hashing on the event loop thread: they use
``trio.to_thread.run_sync`` for that.

Keys are always *relative* to the store's prefix: ``open_store("s3://b/ckpt")``
followed by ``store.head("run1/step10/model.pt")`` looks at
``s3://b/ckpt/run1/step10/model.pt``.  A key ending in ``/`` is a directory
marker (zero-byte object).

Two implementations:

* ``s3://bucket[/prefix]`` -> :class:`ckptfs.drain.s3store.S3Store` (aiobotocore + httpx)
* ``file:///abs/dir``      -> :class:`ckptfs.drain.filestore.FileStore`

(:func:`drain.factory.open_store` picks one from a URL.)  What differs between
them is declared, not emulated: each sets :attr:`ObjectStore.limits`, a
:class:`StoreLimits` with its part/PUT size limits and which optional features
(tags, storage classes, bucket lifecycle, conditional copy) it has.  Methods
with one implementation for every store (``list``, ``delete``, the
not-supported bucket-lifecycle calls) live in :class:`ObjectStore`.

Errors: every failure is a :class:`StoreError` (or subclass) carrying the S3
error ``code`` (``"AccessDenied"``, ``"NoSuchBucket"``, ``"SlowDown"`` ...) and a
``retryable`` flag computed by :func:`is_retryable`.  Programming errors (bad
arguments) raise ``ValueError``/``TypeError`` instead; a well-formed key that a
store cannot hold raises :class:`InvalidObjectNameError` (a permanent
StoreError that is also a ValueError).
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as _dt
import os
import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import NamedTuple

from ckptfs.fsmeta.records import PartRecord  # fsmeta persists the parts the store returns

__all__ = [
    "MiB",
    "GiB",
    "StoreError",
    "NotFoundError",
    "NoSuchUploadError",
    "NotSupportedError",
    "PreconditionFailedError",
    "InvalidObjectNameError",
    "is_retryable",
    "ObjectSummary",
    "ObjectInfo",
    "ListResult",
    "PartRecord",
    "PutResult",
    "UploadInfo",
    "StoreLimits",
    "S3_LIMITS",
    "ObjectStore",
    "MOVING_PREFIX",
    "validate_key",
    "validate_metadata",
    "validate_tags",
    "collapse_exception_group",
    "exception_leaves",
]

MiB = 1 << 20
GiB = 1 << 30

#: S3 limits (AWS values; radosgw uses the same defaults).
S3_MIN_PART_SIZE = 5 * MiB
S3_MAX_PART_SIZE = 5 * GiB
S3_MAX_PARTS = 10_000
S3_MAX_PUT_SIZE = 5 * GiB



# --------------------------------------------------------------------------
# errors


# Codes we retry forever (with backoff).  Anything not listed is permanent
# unless its HTTP status is 5xx / 429 (see is_retryable).
RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeTooSkewed",  # operator fixes the clock -> progress resumes
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "BadDigest",  # data corrupted in flight; we re-read the part
        "IncompleteBody",
        "XAmzContentSHA256Mismatch",
        "ExpiredToken",  # botocore refreshes IRSA/STS credentials on next attempt
        "TokenRefreshRequired",
        "OperationAborted",  # conflicting concurrent operation
        "ConnectionError",  # synthesised: reset/refused/closed/DNS
        "Timeout",  # synthesised: connect/read timeout
        "ProtocolError",  # synthesised: malformed/truncated response
    }
)

# Codes that are permanent even though some servers send them with a 5xx.
PERMANENT_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "NoSuchBucket",
        "NoSuchKey",
        "NoSuchUpload",
        "NotImplemented",
        "NoCredentials",
        "InvalidBucketName",
        "PermanentRedirect",
        "AuthorizationHeaderMalformed",
        "InvalidArgument",
        "InvalidRequest",
        "InvalidPart",
        "InvalidPartOrder",
        "EntityTooSmall",
        "EntityTooLarge",
        "PreconditionFailed",
        "InvalidRange",
        "NotSupported",
        "KeyConflict",
        "InvalidObjectState",
        "InvalidObjectName",
    }
)


def is_retryable(code: str | None, status: int | None = None) -> bool:
    """Classify an S3 error: True for transient errors (throttling, 5xx,
    timeouts, connection resets), False for permanent ones (403, 404,
    bad credentials, bad requests)."""
    if code in PERMANENT_CODES:
        return False
    if code in RETRYABLE_CODES:
        return True
    if status is not None and (status >= 500 or status == 429):
        return True
    return False


class StoreError(Exception):
    """Any object-store failure.

    ``code``: S3 error code string (``"NoSuchBucket"``, ``"SlowDown"``...), or a
    synthesised one (``"ConnectionError"``, ``"Timeout"``, ``"NoCredentials"``,
    ``"NotSupported"``, ``"KeyConflict"``).
    ``retryable``: whether retrying the same request later may succeed.
    ``status``: HTTP status when there was an HTTP response.
    ``op`` / ``key``: operation name and (relative) key, for messages.
    Messages never contain credentials.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "InternalError",
        retryable: bool | None = None,
        status: int | None = None,
        op: str | None = None,
        key: str | None = None,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        #: the server's own error message, if any
        self.detail = detail
        self.code = code
        self.status = status
        self.op = op
        self.key = key
        self.retryable = is_retryable(code, status) if retryable is None else retryable

    def __str__(self) -> str:
        parts = [self.message]
        extra = [f"code={self.code}"]
        if self.status is not None:
            extra.append(f"status={self.status}")
        if self.op:
            extra.append(f"op={self.op}")
        if self.key is not None:
            extra.append(f"key={self.key!r}")
        extra.append("retryable" if self.retryable else "permanent")
        parts.append("(" + ", ".join(extra) + ")")
        return " ".join(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}, retryable={self.retryable})"


class NotFoundError(StoreError):
    """Object (code NoSuchKey) or bucket (NoSuchBucket) does not exist."""


class NoSuchUploadError(StoreError):
    """Multipart upload id unknown (completed, aborted, or expired)."""


class NotSupportedError(StoreError):
    """Operation not supported by this backend (e.g. lifecycle on file://)."""

    def __init__(self, message: str, **kw):
        kw.setdefault("code", "NotSupported")
        kw.setdefault("retryable", False)
        super().__init__(message, **kw)


class PreconditionFailedError(StoreError):
    """If-Match / CopySourceIfMatch failed: the object changed underneath us."""


class InvalidObjectNameError(StoreError, ValueError):
    """A key this store cannot hold (file://: a ``.``/``..``/empty path
    component, or a component starting with the reserved ``.ckptfs-``).
    Permanent; also a ValueError, since retrying the same key cannot help."""

    def __init__(self, message: str, **kw):
        kw.setdefault("code", "InvalidObjectName")
        kw.setdefault("retryable", False)
        super().__init__(message, **kw)


_ERROR_CLASSES: dict[str, type[StoreError]] = {
    "NoSuchKey": NotFoundError,
    "NoSuchBucket": NotFoundError,
    "NoSuchUpload": NoSuchUploadError,
    "NotSupported": NotSupportedError,
    "NotImplemented": NotSupportedError,
    "PreconditionFailed": PreconditionFailedError,
    "InvalidObjectName": InvalidObjectNameError,
}


def make_error(message: str, *, code: str, **kw) -> StoreError:
    """Build the right StoreError subclass for ``code``."""
    cls = _ERROR_CLASSES.get(code, StoreError)
    return cls(message, code=code, **kw)


def exception_leaves(exc: BaseException) -> list[BaseException]:
    """Flatten (nested) exception groups into their leaf exceptions."""
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for e in exc.exceptions:
            out.extend(exception_leaves(e))
        return out
    return [exc]


def collapse_exception_group(exc: BaseException) -> BaseException:
    """trio nurseries raise ExceptionGroups; pick the most meaningful leaf so
    callers can ``except StoreError``: non-StoreError exceptions (bugs,
    callback errors, OSError) first, then permanent StoreErrors, then
    retryable ones, then anything else (e.g. Cancelled)."""
    leaves = exception_leaves(exc)
    if not leaves:
        return exc

    def rank(e: BaseException) -> int:
        if isinstance(e, StoreError):
            return 2 if e.retryable else 1
        if isinstance(e, Exception):
            return 0
        return 3

    return min(leaves, key=rank)


# --------------------------------------------------------------------------
# records


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectSummary:
    """One entry of a listing (S3 ListObjectsV2 gives no user metadata)."""

    key: str  #: relative to the store prefix
    size: int
    etag: str  #: without surrounding quotes; ``"<hex>-<n>"`` for multipart objects
    last_modified: _dt.datetime  #: timezone-aware UTC
    storage_class: str | None = None

    @property
    def is_dir_marker(self) -> bool:
        return self.key.endswith("/")


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo(ObjectSummary):
    """Result of :meth:`ObjectStore.head`: a listing entry plus what only a
    HEAD returns."""

    #: user metadata (``x-amz-meta-*``), keys lower-case, e.g. blake3/mode/uid/gid/mtime
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    content_type: str | None = None
    #: ``{"CRC32C": "<base64>"}`` when the server reports a flexible checksum
    checksums: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Glacier/deep-archive restore status header, if any (``x-amz-restore``)
    restore: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ListResult:
    objects: list[ObjectSummary]
    #: common prefixes (only with a delimiter), relative, each ending with the delimiter
    prefixes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class PutResult:
    etag: str  #: without quotes
    version_id: str | None = None
    checksum: str | None = None  #: base64 flexible checksum of the object, if any


class UploadInfo(NamedTuple):
    """An in-progress multipart upload: ``(key, upload_id, initiated)``."""

    key: str
    upload_id: str
    initiated: _dt.datetime  #: timezone-aware UTC


#: Where the drain parks an object to break a rename cycle among files the cache does not
#: hold (``.ckptfs-moving/<ino>-<random>``; DESIGN.md "Namespace → bucket"). Never a name the
#: filesystem shows; each such object is an inode's remote record or an intent tombstone.
MOVING_PREFIX = ".ckptfs-moving/"


# --------------------------------------------------------------------------
# validation helpers (shared by implementations)

_META_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def validate_key(key: str, *, allow_empty: bool = False) -> str:
    """Reject keys that would be ambiguous or dangerous in either backend."""
    if not isinstance(key, str):
        raise TypeError(f"object key must be str, not {type(key).__name__}")
    if not key:
        if allow_empty:
            return key
        raise ValueError("object key must not be empty")
    if key.startswith("/"):
        raise ValueError(f"object key must be relative (no leading '/'): {key!r}")
    if "\x00" in key:
        raise ValueError(f"object key contains NUL: {key!r}")
    if len(key.encode("utf-8", "surrogatepass")) > 1024:
        raise ValueError(f"object key longer than 1024 bytes: {key[:64]!r}...")
    return key


def validate_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """User metadata must be HTTP-header safe: lower-case ASCII keys
    ``[a-z0-9][a-z0-9_.-]*`` and printable-ASCII values; total <= 2 KiB (S3 limit).
    Callers percent-encode anything else."""
    if not metadata:
        return {}
    out: dict[str, str] = {}
    total = 0
    for k, v in metadata.items():
        if not isinstance(k, str) or not _META_KEY_RE.match(k):
            raise ValueError(f"metadata key {k!r} must match [a-z0-9][a-z0-9_.-]* (lower-case)")
        if not isinstance(v, str):
            v = str(v)
        if not all(0x20 <= ord(c) < 0x7F for c in v):
            raise ValueError(f"metadata value for {k!r} must be printable ASCII (percent-encode it)")
        total += len(k) + len(v)
        out[k] = v
    if total > 2048:
        raise ValueError(f"user metadata is {total} bytes; S3 allows at most 2048")
    return out


def validate_tags(tags: Mapping[str, str]) -> dict[str, str]:
    if len(tags) > 10:
        raise ValueError("S3 allows at most 10 tags per object")
    out = {}
    for k, v in tags.items():
        if not isinstance(k, str) or not k or len(k) > 128:
            raise ValueError(f"tag key {k!r} must be 1..128 chars")
        if not isinstance(v, str) or len(v) > 256:
            raise ValueError(f"tag value for {k!r} must be a str of <= 256 chars")
        out[k] = v
    return out


def normalize_etag(etag: str | None) -> str:
    if not etag:
        return ""
    etag = etag.strip()
    if etag.startswith("W/"):
        etag = etag[2:]
    if len(etag) >= 2 and etag[0] == '"' and etag[-1] == '"':
        etag = etag[1:-1]
    return etag


# --------------------------------------------------------------------------
# capabilities


@dataclasses.dataclass(frozen=True, slots=True)
class StoreLimits:
    """What a store can do, declared rather than emulated (cf. JuiceFS'
    object ``Limits``).  Callers size uploads from the part limits and check
    the flags before relying on a feature."""

    #: smallest allowed part (except the last)
    min_part_size: int
    max_part_size: int
    max_parts: int
    #: largest single PUT
    max_put_size: int
    #: per-object tags (get_tags/put_tags)
    tags: bool = True
    #: storage classes are recorded on put/copy and reported by head/list
    storage_classes: bool = True
    #: bucket lifecycle rules (get/put_bucket_lifecycle)
    bucket_lifecycle: bool = False
    #: ``copy(..., if_match=etag)`` fails with PreconditionFailedError if the source changed
    conditional_copy: bool = True


#: AWS values; radosgw uses the same defaults.
S3_LIMITS = StoreLimits(
    min_part_size=S3_MIN_PART_SIZE,
    max_part_size=S3_MAX_PART_SIZE,
    max_parts=S3_MAX_PARTS,
    max_put_size=S3_MAX_PUT_SIZE,
    bucket_lifecycle=True,
)


# --------------------------------------------------------------------------
# interface


class ObjectStore(abc.ABC):
    """Async (trio) object store.  Use as ``async with open_store(url) as store:``
    (or call :meth:`aclose` yourself).  One store instance may be used by many
    trio tasks concurrently.
    """

    #: ``s3://bucket/prefix`` or ``file:///dir`` (never contains credentials)
    url: str
    #: name of the per-part flexible checksum (``"CRC32C"``, ``"CRC32"``,
    #: ``"CRC64NVME"``, ``"SHA256"``) or None (md5/none modes).  PartRecords of
    #: an upload made with a different algorithm cannot be resumed.
    checksum_algorithm: str | None = None
    #: part/PUT size limits and optional features
    limits: StoreLimits

    async def __aenter__(self):
        await self.open()
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Acquire resources (HTTP client).  Called by ``__aenter__``; methods
        also open lazily."""

    def release_buffers(self) -> None:  # noqa: B027 - optional hook
        """Drop idle I/O buffers (called when the drain goes idle, to give memory back)."""

    async def aclose(self) -> None:  # noqa: B027
        """Release resources."""

    # -- access / metadata -------------------------------------------------

    @abc.abstractmethod
    async def check_access(self, *, write: bool = False) -> None:
        """Verify that the bucket (dir) exists and credentials work, by listing
        one key under the prefix; with ``write=True`` also PUT+DELETE a probe
        object ``.ckptfs-probe/<random>`` (file://: create and remove a temp file).  Raises :class:`StoreError` whose
        message names the bucket and endpoint and whose ``code`` is the S3
        error code (``NoSuchBucket``, ``AccessDenied``, ``InvalidAccessKeyId``,
        ``SignatureDoesNotMatch``, ``NoCredentials``, ``ConnectionError``)."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo | None:
        """Object info incl. user metadata, or None if there is no such key."""

    async def list(
        self,
        prefix: str = "",
        delimiter: str | None = None,
        *,
        start_after: str | None = None,
        limit: int | None = None,
    ) -> ListResult:
        """All objects (and common prefixes when ``delimiter`` is given) whose
        key starts with ``prefix``, in key order.  Collects every page; use
        :meth:`list_pages` for huge listings.  ``limit`` caps the number of
        objects+prefixes returned."""
        objs: list[ObjectSummary] = []
        prefixes: list[str] = []
        async for page in self.list_pages(prefix, delimiter, start_after=start_after):
            objs.extend(page.objects)
            prefixes.extend(page.prefixes)
            if limit is not None and len(objs) + len(prefixes) >= limit:
                break
        if limit is not None:
            merged = sorted(
                [(o.key, o) for o in objs] + [(p, p) for p in prefixes], key=lambda t: t[0]
            )[:limit]
            objs = [v for _, v in merged if isinstance(v, ObjectSummary)]
            prefixes = [v for _, v in merged if isinstance(v, str)]
        return ListResult(objs, prefixes)

    async def holds_any(self, prefix: str) -> bool:
        """Anything at or below ``prefix``: for ``d/``, the directory's own marker or any object
        below it (one LIST of at most one entry)."""
        listed = await self.list(prefix, limit=1)
        return bool(listed.objects or listed.prefixes)

    @abc.abstractmethod
    def list_pages(
        self, prefix: str = "", delimiter: str | None = None, *, start_after: str | None = None
    ) -> AsyncIterator[ListResult]:
        """Async iterator of listing pages (up to 1000 entries each)."""

    # -- writes ----------------------------------------------------------

    @abc.abstractmethod
    async def put_object(
        self,
        key: str,
        data: bytes | bytearray | memoryview | str | os.PathLike,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        content_type: str | None = None,
        digest=None,
    ) -> PutResult:
        """Single PUT of ``data`` (bytes, or the whole content of the file at
        a path, with ``digest`` as for :meth:`upload_part`) with the store's checksum.  Atomic: readers see the old or the
        new object.  Size must be <= ``limits.max_put_size``; meant for small
        files (< part size)."""

    @abc.abstractmethod
    async def create_multipart(
        self,
        key: str,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        content_type: str | None = None,
    ) -> str:
        """Start a multipart upload; returns the upload id."""

    @abc.abstractmethod
    async def upload_part(
        self,
        key: str,
        upload_id: str,
        part_number: int,
        path: str | os.PathLike,
        offset: int,
        length: int,
        *,
        digest=None,
    ) -> PartRecord:
        """Upload ``length`` bytes of the file at ``path`` starting at ``offset``
        as part ``part_number`` (1..10000), read off the event loop.  ``digest``:
        the part's finished :class:`~ckptfs.drain.localio.PartDigest` (from
        :meth:`new_part_digest`, fed by the caller's hashing pass), so the part
        streams from the file instead of being read once more to checksum it."""

    def new_part_digest(self):
        """A :class:`~ckptfs.drain.localio.PartDigest` for the hashes an
        :meth:`upload_part` request needs before its body, or None: none."""

    @abc.abstractmethod
    async def complete_multipart(self, key: str, upload_id: str, parts: Sequence[PartRecord]) -> PutResult:
        """Assemble the parts (any order given; sorted by number) into the object."""

    @abc.abstractmethod
    async def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort (idempotent: an unknown upload id is not an error)."""

    @abc.abstractmethod
    async def list_multipart_uploads(self, prefix: str = "") -> list[UploadInfo]:
        """In-progress multipart uploads under ``prefix`` (relative keys)."""

    @abc.abstractmethod
    async def list_parts(self, key: str, upload_id: str) -> list[PartRecord]:
        """Parts the server has for an upload, sorted by number.  Raises
        :class:`NoSuchUploadError` if the upload is gone."""

    @abc.abstractmethod
    async def copy(
        self,
        src_key: str,
        dst_key: str,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        if_match: str | None = None,
    ) -> PutResult:
        """Server-side copy.  ``metadata=None`` keeps the source's metadata,
        otherwise it is replaced (tags are kept either way).  As with S3
        CopyObject, ``storage_class=None`` means the default (STANDARD), not
        the source's class.  S3 copies large objects with a multipart
        UploadPartCopy.  ``if_match``: source etag
        precondition (:class:`PreconditionFailedError` if it changed).  Copying
        a key onto itself with new metadata/storage class is allowed."""

    async def delete(self, key: str) -> None:
        """Delete (idempotent)."""
        failed = await self.delete_many([key])
        if failed:
            raise failed[key]

    @abc.abstractmethod
    async def delete_many(self, keys: Iterable[str]) -> dict[str, StoreError]:
        """Delete many keys (batched).  Returns ``{key: error}`` for the keys
        that could not be deleted (empty dict on full success)."""

    # -- reads -------------------------------------------------------------

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int, *, if_match: str | None = None) -> bytes:
        """Bytes ``[start, end)`` (end exclusive, clipped to the object size).
        ``if_match``: etag precondition -> :class:`PreconditionFailedError`."""

    @abc.abstractmethod
    async def get_to_file(
        self,
        key: str,
        dest: str | os.PathLike | int,
        offset: int = 0,
        length: int | None = None,
        *,
        file_offset: int | None = None,
        if_match: str | None = None,
    ) -> int:
        """Stream object bytes ``[offset, offset+length)`` (``length=None``: to
        the end) into ``dest`` (path or open fd) at ``file_offset`` (default:
        ``offset``, i.e. the cache file mirrors the object).  Writes happen in
        worker threads in large gathered ``pwritev`` batches, no full-range
        buffering.  Does not fsync.  Returns the number of bytes written."""

    # -- tags / lifecycle ----------------------------------------------------

    @abc.abstractmethod
    async def get_tags(self, key: str) -> dict[str, str]: ...

    @abc.abstractmethod
    async def put_tags(self, key: str, tags: Mapping[str, str]) -> None:
        """Replace the object's tag set."""

    async def get_bucket_lifecycle(self) -> list[dict]:
        """Lifecycle rules in boto3 shape (``[]`` if none).
        :class:`NotSupportedError` unless ``limits.bucket_lifecycle``."""
        raise NotSupportedError(f"bucket lifecycle is not supported by {self.url}", op="GetBucketLifecycleConfiguration")

    async def put_bucket_lifecycle(self, rules: Sequence[Mapping]) -> None:
        """Replace the bucket lifecycle (boto3 ``Rules`` shape; an empty list
        deletes it).  :class:`NotSupportedError` unless ``limits.bucket_lifecycle``."""
        raise NotSupportedError(f"bucket lifecycle is not supported by {self.url}", op="PutBucketLifecycleConfiguration")

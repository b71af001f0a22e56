"""S3 implementation of :class:`ckptfs.drain.store.ObjectStore` (aiobotocore + httpx, trio).

Data path for ``upload_part`` / ``put_object`` of a file (bounded memory):

1. the part's checksum (and the SHA-256 when ``sign_payload``) comes from the
   caller's hashing pass as a :class:`~ckptfs.drain.localio.PartDigest` (or,
   without one, from a read of the range here first): the header has to precede
   the body, and radosgw 16 rejects aws-chunked trailers;
2. an UploadPart body over plain http goes from the cache file to the socket
   with ``sendfile`` (:class:`_SendfileSender`: a ``before-send`` handler, a
   worker thread, kept-alive ``http.client`` connections; zero-copy, not
   re-read here: the server verifies the checksum header, and the uploader
   compares the file's stat before it completes the upload). Otherwise (TLS,
   a proxy, PutObject, ``sendfile_parts = False``) the body,
   :class:`_FileRangeBody`, reads the range ``BODY_CHUNK`` at a time (``pread``
   into ``bytes``, in a worker thread), recomputes the checksum on it and
   yields it to httpx; it withholds the last chunk if the bytes differ from the
   digest (the file changed since it was hashed);
3. the request is signed by :class:`CkptfsS3SigV4Auth`, which takes the
   payload hash from the body (``UNSIGNED-PAYLOAD`` or the precomputed
   SHA-256 hex) instead of letting botocore hash the body on the event loop
   (botocore always SHA-256-hashes bodies over plain http, even when a
   flexible checksum is present).

Integrity is carried by the flexible checksum header
(``x-amz-checksum-crc32c`` by default) or ``Content-MD5`` (``checksum="md5"``),
verified by the server.  botocore's own checksum logic is set to
``when_required`` so it adds nothing to data requests.  botocore retries are
disabled (``total_max_attempts=1``): :func:`ckptfs.drain.upload.retry_forever` does
retries with visible state.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import http.client
import logging
import os
import re
import secrets
import select
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from xml.etree import ElementTree

# httpx imports its command-line client (rich, click, pygments: ~40 ms of CPU at every start)
# unless that import fails, which it handles (the client is an optional extra); we never run it.
sys.modules.setdefault("httpx._main", None)

import botocore.auth
import botocore.exceptions
import trio
import urllib3
from aiobotocore.awsrequest import AioAWSResponse
from aiobotocore.config import AioConfig
from aiobotocore.httpxsession import HttpxSession
from aiobotocore.session import AioSession
from botocore import xform_name
from botocore.auth import S3SigV4Auth
from botocore.httpsession import ProxyConfiguration, get_cert_path

from . import localio
from .credentials import ThreadedCredentialResolver
from .store import (
    S3_LIMITS,
    ListResult,
    MiB,
    ObjectInfo,
    ObjectStore,
    ObjectSummary,
    PartRecord,
    PutResult,
    StoreError,
    UploadInfo,
    collapse_exception_group,
    make_error,
    normalize_etag,
    validate_key,
    validate_metadata,
    validate_tags,
)

log = logging.getLogger(__name__)

__all__ = ["S3Store", "CkptfsS3SigV4Auth"]

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
BODY_CHUNK = 1 * MiB
_SIGNER_NAME = "ckptfs-s3v4"
#: read size of a GetObject body (and so of each pwrite into the destination). Small enough
#: that the buffer a recv just filled is still in the core's cache when pwrite copies it into
#: the page cache: with 1 MiB, that copy took 37% of a prefetch's CPU (docs/DESIGN.md)
GET_CHUNK = 256 * 1024
#: lifetime of the presigned URL of one GetObject (it is used at once)
PRESIGN_SECONDS = 900


class CkptfsS3SigV4Auth(S3SigV4Auth):
    """S3 SigV4 signer that takes the payload hash from the request body
    object (``body.payload_sha256``) when present: either ``UNSIGNED-PAYLOAD``
    or a SHA-256 hex digest computed in a worker thread.  Everything else
    (canonical request, headers, signature) is botocore's.  Only selected for
    PutObject/UploadPart issued by :class:`S3Store`."""

    def payload(self, request):
        h = getattr(request.body, "payload_sha256", None)
        if h is not None:
            return h
        return super().payload(request)


# Registered under a private name: does not change botocore's behaviour for any
# other client in the process.
botocore.auth.AUTH_TYPE_MAPS.setdefault(_SIGNER_NAME, CkptfsS3SigV4Auth)


def _choose_signer(signature_version=None, **kwargs):
    if signature_version in ("v4", "s3v4"):
        return _SIGNER_NAME
    return None


class _Body:
    """Request body over an in-memory buffer.

    * ``__len__`` -> botocore sets Content-Length (httpx then does not chunk);
    * ``__aiter__`` -> httpx streams ``memoryview`` slices (no copy on our side;
      h11 makes one copy per chunk when framing, unavoidable with httpx);
    * ``read``/``seek``/``tell`` only to satisfy botocore's file-like checks;
    * ``payload_sha256`` -> :class:`CkptfsS3SigV4Auth`.
    """

    def __init__(self, data, payload_sha256: str = UNSIGNED_PAYLOAD, chunk: int = BODY_CHUNK):
        self._mv = memoryview(data).cast("B")
        self.payload_sha256 = payload_sha256
        self._chunk = chunk
        self._pos = 0

    def __len__(self) -> int:
        return len(self._mv)

    def __bool__(self) -> bool:  # empty bodies are still bodies
        return True

    def read(self, n: int = -1) -> bytes:
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = bytes(self._mv[self._pos : end])
        self._pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            self._pos = pos
        elif whence == 1:
            self._pos += pos
        else:
            self._pos = len(self._mv) + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    async def __aiter__(self):
        mv, step = self._mv, self._chunk
        for i in range(0, len(mv), step):
            yield mv[i : i + step]


class _FileRangeBody:
    """Request body streamed from a file range: each ``BODY_CHUNK`` is read (``pread``, in
    a worker thread) into a fresh ``bytes``, checksummed and handed to httpx, which
    writes it out before asking for the next. A ``bytes`` chunk, not a view of a reused
    buffer: h11 joins each chunk into ``bytes`` before writing it, which copies anything
    else, but hands a lone ``bytes`` on as it is (one copy per byte less).

    Peak memory per part in flight is about one chunk, not the part. The bytes sent must
    have ``digest.checksum`` (even where the server would check it: after a change it
    would answer BadDigest to every retry); if not, the last chunk is withheld and
    :class:`~ckptfs.drain.localio.SourceChangedError` raised (kept in ``error``), so
    the server never gets a complete part that differs from what was hashed.
    """

    #: sent by :class:`_SendfileSender` (zero-copy, no re-check here) where the store allows it
    sendfile = False

    def __init__(self, fd: int, offset: int, length: int, digest):
        self._fd, self._offset, self._length = fd, offset, length
        self._digest = digest
        self._verify = digest.checksum is not None
        self.payload_sha256 = digest.payload_sha256 or UNSIGNED_PAYLOAD
        self.error: BaseException | None = None
        self._pos = 0

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return True

    # botocore's file-like checks (it never reads the body: the signer takes payload_sha256)
    def read(self, n: int = -1) -> bytes:
        end = self._length if n is None or n < 0 else min(self._length, self._pos + n)
        out = os.pread(self._fd, end - self._pos, self._offset + self._pos)
        self._pos += len(out)
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._length + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    async def __aiter__(self):
        ck = localio.Checksummer(self._digest.algorithm) if self._verify else None
        hashers = [ck] if ck is not None else []
        for pos in range(0, self._length, BODY_CHUNK):
            n = min(BODY_CHUNK, self._length - pos)
            try:
                chunk = await trio.to_thread.run_sync(localio.read_bytes, self._fd, self._offset + pos, n, hashers)
                if ck is not None and pos + n == self._length and ck.b64() != self._digest.checksum:
                    raise localio.SourceChangedError(
                        f"bytes {self._offset}..{self._offset + self._length} changed since they were hashed")
            except Exception as e:
                self.error = e
                raise
            yield chunk


def _utc(d) -> _dt.datetime:
    if d is None:
        return _dt.datetime.fromtimestamp(0, _dt.timezone.utc)
    if d.tzinfo is None:
        return d.replace(tzinfo=_dt.timezone.utc)
    return d.astimezone(_dt.timezone.utc)


_FLEX_FIELDS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")

_STATUS_CODES = {
    301: "PermanentRedirect",
    304: "NotModified",
    400: "BadRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    405: "MethodNotAllowed",
    409: "Conflict",
    412: "PreconditionFailed",
    416: "InvalidRange",
    429: "TooManyRequests",
    500: "InternalError",
    501: "NotImplemented",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


class S3Store(ObjectStore):
    limits = S3_LIMITS
    #: keys per ListObjectsV2 page (S3 maximum: 1000)
    list_page_size = 1000
    #: the GetObject path (:class:`_BlockingGets`), made on the first GET
    _gets: _BlockingGets | None = None
    #: UploadPart bodies from the file with ``sendfile`` over plain http (:class:`_SendfileSender`);
    #: False: every part streams through httpx and is re-checked against its digest
    sendfile_parts = True
    _sender: _SendfileSender | None = None

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        checksum: str = "auto",
        concurrency: int = 8,
        max_pool_connections: int | None = None,
        profile: str | None = None,
        addressing_style: str | None = None,
        sign_payload: bool = False,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        verify_tls: bool | str = True,
        multipart_copy_threshold: int | None = None,
        copy_part_size: int = 512 * MiB,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
    ):
        """Options (usually given through :func:`drain.factory.open_store`):

        * ``endpoint_url``: e.g. ``http://127.0.0.1:7480`` for radosgw; default AWS.
        * ``region``: default ``$AWS_REGION`` / ``$AWS_DEFAULT_REGION`` / profile / ``us-east-1``.
        * ``checksum``: one of :data:`ckptfs.fsmeta.settings.CHECKSUMS`.
        * ``concurrency``: expected parallel requests; sizes the HTTP connection
          pool (``concurrency + 4`` connections unless ``max_pool_connections``
          is given) and the part-buffer pool.
        * ``profile``: AWS shared-config profile (else the default chain).
        * ``addressing_style``: ``path``/``virtual``/``auto``; default ``path`` when
          ``endpoint_url`` is given, else ``auto``.
        * ``sign_payload``: SigV4-sign part/PUT bodies with their SHA-256
          (computed off the loop).  Default False: bodies are sent as
          ``UNSIGNED-PAYLOAD`` and integrity is carried by ``checksum``.
        * ``multipart_copy_threshold``: copy() uses UploadPartCopy above this
          size (default ``limits.max_put_size``, the CopyObject limit);
          ``copy_part_size`` per copied part.
        * ``aws_*``: explicit credentials (else the default chain).
        """
        self.bucket = bucket
        self.prefix = prefix  # "" or "a/b/"
        self.endpoint_url = endpoint_url
        self.url = f"s3://{bucket}/{prefix}"
        self.checksum_mode = localio.resolve_checksum_mode(checksum)
        self.checksum_algorithm, self._new_checksum = localio.checksum_factory(self.checksum_mode)
        self.sign_payload = sign_payload
        self.concurrency = concurrency
        self.max_pool_connections = max_pool_connections or concurrency + 4
        self._profile = profile
        self._region = region
        self._addressing_style = addressing_style or ("path" if endpoint_url else "auto")
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._verify = verify_tls
        self.multipart_copy_threshold = multipart_copy_threshold or self.limits.max_put_size
        if not (self.limits.min_part_size <= copy_part_size <= self.limits.max_part_size):
            raise ValueError("copy_part_size must be within 5 MiB..5 GiB")
        self.copy_part_size = copy_part_size
        self._explicit_creds = (aws_access_key_id, aws_secret_access_key, aws_session_token)
        self._client = None
        self._client_ctx = None
        self._open_lock = trio.Lock()
        self._chunk_pool = localio.BufferPool(max_idle=2 * concurrency)
        self.region = region or "?"

    # ------------------------------------------------------------------
    # lifecycle

    def _make_session(self) -> AioSession:
        # Runs in a worker thread: reads ~/.aws/config, credentials files.
        session = AioSession(profile=self._profile)
        session.get_scoped_config()
        return session

    def release_buffers(self) -> None:
        self._chunk_pool.clear()

    async def open(self) -> None:
        async with self._open_lock:
            if self._client is not None:
                return
            try:
                session = await trio.to_thread.run_sync(self._make_session)
            except botocore.exceptions.ProfileNotFound as e:
                raise make_error(
                    f"AWS profile {self._profile!r} not found in the shared config files",
                    code="NoCredentials",
                    retryable=False,
                ) from e
            region = (
                self._region
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or session.get_config_variable("region")
                or "us-east-1"
            )
            self.region = region
            config = AioConfig(
                http_session_cls=HttpxSession,
                warm_up_loader_caches=True,  # load service JSON models in a thread
                region_name=region,
                signature_version="s3v4",
                retries={"total_max_attempts": 1, "mode": "standard"},
                max_pool_connections=self.max_pool_connections,
                connect_timeout=self._connect_timeout,
                read_timeout=self._read_timeout,
                connector_args={
                    "keepalive_timeout": 30,
                    "write_timeout": self._read_timeout,
                    "pool_timeout": None,  # callers bound concurrency; waiting for a slot is fine
                },
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                s3={"addressing_style": self._addressing_style},
            )
            ak, sk, tok = self._explicit_creds
            # botocore's credential chain, resolved and refreshed in worker threads (credentials.py)
            session.register_component(
                "credential_provider", ThreadedCredentialResolver(profile=self._profile, region=region))
            ctx = session.create_client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=region,
                config=config,
                verify=self._verify,
                aws_access_key_id=ak,
                aws_secret_access_key=sk,
                aws_session_token=tok,
            )
            try:
                client = await ctx.__aenter__()
            except Exception as e:  # noqa: BLE001 - translated (credentials: the chain's errors)
                raise self._translate(e, "CreateClient", None) from e
            ev = client.meta.events
            for op in ("PutObject", "UploadPart"):
                ev.register_first(f"choose-signer.s3.{op}", _choose_signer, unique_id=f"ckptfs-signer-{op}")
            if self.sendfile_parts:
                self._sender = _SendfileSender(self)
                ev.register_first("before-send.s3.UploadPart", self._sender.before_send, unique_id="ckptfs-sendfile")
            if self.checksum_mode == "md5":
                # botocore adds a CRC32 header to checksum-required ops; servers
                # without flexible checksums (radosgw < 18) need Content-MD5.
                for op in ("DeleteObjects", "PutObjectTagging", "PutBucketLifecycleConfiguration"):
                    ev.register(f"before-call.s3.{op}", _add_content_md5, unique_id=f"ckptfs-md5-{op}")
            self._client_ctx, self._client = ctx, client

    async def aclose(self) -> None:
        ctx, self._client_ctx, self._client = self._client_ctx, None, None
        self._chunk_pool.clear()
        if self._sender is not None:
            self._sender.close()
        gets, self._gets = self._gets, None
        if gets is not None:
            gets.close()
        if ctx is not None:
            await ctx.__aexit__(None, None, None)

    async def _c(self):
        if self._client is None:
            await self.open()
        return self._client

    # ------------------------------------------------------------------
    # helpers

    def _k(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) :] if self.prefix and full.startswith(self.prefix) else full

    def _where(self) -> str:
        ep = self.endpoint_url or "AWS default endpoint"
        return f"bucket {self.bucket!r} at {ep} (region {self.region})"

    def _translate(self, e: BaseException, op: str, key: str | None, *, head: bool = False) -> StoreError:
        exc = botocore.exceptions
        if isinstance(e, exc.ClientError):
            err = e.response.get("Error", {}) or {}
            meta = e.response.get("ResponseMetadata", {}) or {}
            status = meta.get("HTTPStatusCode")
            code = str(err.get("Code") or "")
            msg = err.get("Message") or ""
            if not code or code.isdigit():
                st = status or (int(code) if code.isdigit() else None)
                code = _STATUS_CODES.get(st, f"HTTP{st}")
                if st == 404 and op in ("HeadBucket", "ListObjectsV2", "ListMultipartUploads"):
                    code = "NoSuchBucket"
            message = f"{op} on {self._where()} failed: {code}" + (f": {msg}" if msg else "")
            return make_error(message, code=code, status=status, op=op, key=key, detail=msg or None)
        if isinstance(e, (exc.NoCredentialsError, exc.PartialCredentialsError)):
            return make_error(
                f"{op} on {self._where()}: no usable AWS credentials found (looked in: env "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and the shared config/credentials "
                "files, credential_process, web identity AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, the "
                "container endpoint AWS_CONTAINER_CREDENTIALS_FULL_URI/_RELATIVE_URI, EC2 instance metadata)",
                code="NoCredentials",
                retryable=False,
                op=op,
                key=key,
            )
        if isinstance(e, exc.CredentialRetrievalError):
            return make_error(
                f"{op} on {self._where()}: could not fetch credentials: {_without_query(e)[:500]}",
                code="CredentialRetrievalError",
                retryable=True,
                op=op,
                key=key,
            )
        if isinstance(e, (exc.ReadTimeoutError, exc.ConnectTimeoutError)) or type(e).__name__ in (
            "ReadTimeout",
            "WriteTimeout",
            "ConnectTimeout",
            "PoolTimeout",
            "TooSlowError",
        ):
            return make_error(f"{op} on {self._where()}: timeout ({e})", code="Timeout", retryable=True, op=op, key=key)
        if isinstance(e, exc.SSLError):
            permanent = "CERTIFICATE_VERIFY_FAILED" in str(e) or "certificate" in str(e).lower()
            return make_error(
                f"{op} on {self._where()}: TLS error ({e})", code="TLSError", retryable=not permanent, op=op, key=key
            )
        if isinstance(
            e,
            (
                exc.EndpointConnectionError,
                exc.ConnectionClosedError,
                exc.ProxyConnectionError,
                exc.HTTPClientError,
                exc.ResponseStreamingError,
                exc.IncompleteReadError,
                ConnectionError,
                trio.BrokenResourceError,
            ),
        ) or type(e).__name__ in ("ReadError", "WriteError", "ConnectError", "RemoteProtocolError", "CloseError"):
            return make_error(
                f"{op} on {self._where()}: connection error ({type(e).__name__}: {e})",
                code="ConnectionError",
                retryable=True,
                op=op,
                key=key,
            )
        if isinstance(e, exc.ParamValidationError):
            raise ValueError(str(e)) from e
        return make_error(
            f"{op} on {self._where()}: unexpected {type(e).__name__}: {e}",
            code="InternalError",
            retryable=False,
            op=op,
            key=key,
        )

    async def _call(self, op: str, key: str | None = None, **params):
        client = await self._c()
        method = getattr(client, xform_name(op))
        try:
            return await method(**params)
        except localio.SourceChangedError:
            raise
        except Exception as e:  # noqa: BLE001 - translated
            raise self._translate(e, op, key) from e

    async def _bytes_body(self, data) -> tuple[_Body, dict]:
        """Body and checksum params for an in-memory PUT (hashed in a worker thread if big)."""
        digest = self.new_part_digest()

        def work():
            digest.update(data)
            return digest.finish()

        if memoryview(data).nbytes <= 256 * 1024:
            work()
        else:
            await trio.to_thread.run_sync(work)
        return _Body(data, digest.payload_sha256 or UNSIGNED_PAYLOAD), self._checksum_params(digest)

    # ------------------------------------------------------------------
    # access / metadata

    async def check_access(self, *, write: bool = False) -> None:
        try:
            await self._call("ListObjectsV2", None, Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
            if write:
                probe = f".ckptfs-probe/{secrets.token_hex(8)}"
                await self._call("PutObject", probe, Bucket=self.bucket, Key=self._k(probe), Body=b"")
                await self._call("DeleteObject", probe, Bucket=self.bucket, Key=self._k(probe))
        except StoreError as e:
            hint = _ACCESS_HINTS.get(e.code, "")
            creds = await self._credential_source()
            raise make_error(
                f"cannot use {self._where()}{' with prefix ' + repr(self.prefix) if self.prefix else ''}: "
                f"{e.code}{' (' + hint + ')' if hint else ''}; credentials {creds}"
                + (f"; server said: {e.detail}" if e.detail else f"; {e.message}"),
                code=e.code,
                status=e.status,
                retryable=e.retryable,
                op=e.op,
            ) from e

    async def _credential_source(self) -> str:
        """Where credentials came from (never the credentials themselves)."""
        try:
            client = await self._c()
            creds = client._request_signer._credentials  # noqa: SLF001 - introspection only
            if creds is None:
                return "none found"
            return f"from {getattr(creds, 'method', 'unknown source')}"
        except Exception:  # noqa: BLE001
            return "unknown"

    async def head(self, key: str) -> ObjectInfo | None:
        try:
            # (no ChecksumMode=ENABLED: it needs kms:Decrypt on SSE-KMS buckets)
            r = await self._call("HeadObject", key, Bucket=self.bucket, Key=self._k(key))
        except StoreError as e:
            if e.status == 404 or e.code in ("NoSuchKey", "NotFound"):
                return None
            raise
        return ObjectInfo(
            key=key,
            size=int(r.get("ContentLength", 0)),
            etag=normalize_etag(r.get("ETag")),
            last_modified=_utc(r.get("LastModified")),
            storage_class=r.get("StorageClass") or "STANDARD",
            metadata=dict(r.get("Metadata") or {}),
            content_type=r.get("ContentType"),
            checksums={f[len("Checksum") :]: r[f] for f in _FLEX_FIELDS if r.get(f)},
            restore=r.get("Restore"),
        )

    async def list_pages(
        self, prefix: str = "", delimiter: str | None = None, *, start_after: str | None = None
    ) -> AsyncIterator[ListResult]:
        validate_key(prefix, allow_empty=True)
        params = {"Bucket": self.bucket, "Prefix": self.prefix + prefix, "MaxKeys": self.list_page_size}
        if delimiter:
            params["Delimiter"] = delimiter
        if start_after:
            params["StartAfter"] = self.prefix + start_after
        while True:
            r = await self._call("ListObjectsV2", prefix, **params)
            objs = [
                ObjectSummary(
                    key=self._rel(o["Key"]),
                    size=int(o.get("Size", 0)),
                    etag=normalize_etag(o.get("ETag")),
                    last_modified=_utc(o.get("LastModified")),
                    storage_class=o.get("StorageClass") or "STANDARD",
                )
                for o in r.get("Contents", [])
            ]
            prefixes = [self._rel(p["Prefix"]) for p in r.get("CommonPrefixes", [])]
            if objs or prefixes:
                yield ListResult(objs, prefixes)
            if not r.get("IsTruncated"):
                return
            params["ContinuationToken"] = r["NextContinuationToken"]
            params.pop("StartAfter", None)

    # ------------------------------------------------------------------
    # writes

    async def put_object(
        self,
        key: str,
        data,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        content_type: str | None = None,
        digest: localio.PartDigest | None = None,
    ) -> PutResult:
        """A file (a path) streams as :meth:`upload_part` does, ``digest`` likewise."""
        params = dict(Bucket=self.bucket, Key=self._k(key), Metadata=validate_metadata(metadata))
        if storage_class:
            params["StorageClass"] = storage_class
        if content_type:
            params["ContentType"] = content_type
        if isinstance(data, (bytes, bytearray, memoryview)):
            self._check_put_size(memoryview(data).nbytes)
            body, ck = await self._bytes_body(data)
            r = await self._call("PutObject", key, Body=body, **ck, **params)
        else:
            fd = await trio.to_thread.run_sync(os.open, os.fspath(data), os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = (await trio.to_thread.run_sync(os.fstat, fd)).st_size
                self._check_put_size(size)
                if digest is None:
                    digest = self.new_part_digest()
                    await trio.to_thread.run_sync(self._digest_range, fd, 0, size, digest)
                ck = self._checksum_params(digest)
                r = await self._call_streaming(
                    "PutObject", key, _FileRangeBody(fd, 0, size, digest), **ck, **params)
            finally:
                await trio.to_thread.run_sync(os.close, fd)
        return PutResult(
            etag=normalize_etag(r.get("ETag")),
            version_id=r.get("VersionId"),
            checksum=next((ck[f] for f in ck if f.startswith("Checksum")), None),
        )

    def _check_put_size(self, size: int) -> None:
        if size > self.limits.max_put_size:
            raise ValueError(f"put_object of {size} bytes exceeds the single-PUT limit; use multipart")

    async def create_multipart(
        self,
        key: str,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        content_type: str | None = None,
        _checksum: bool = True,
    ) -> str:
        params = dict(Bucket=self.bucket, Key=self._k(key), Metadata=validate_metadata(metadata))
        if storage_class:
            params["StorageClass"] = storage_class
        if content_type:
            params["ContentType"] = content_type
        if _checksum and self.checksum_algorithm:
            params["ChecksumAlgorithm"] = self.checksum_algorithm
        r = await self._call("CreateMultipartUpload", key, **params)
        return r["UploadId"]

    def new_part_digest(self) -> localio.PartDigest:
        """The hashes an UploadPart's headers need (checksum, signed payload), for the
        uploader's hashing pass.  With ``checksum="none"`` a CRC is still computed, for
        the streamed body's own check only."""
        if self._new_checksum is None:
            alg = "CRC32C" if localio.crc32c_available() else "CRC32"
            return localio.PartDigest(lambda: localio.Checksummer(alg), self.sign_payload, header=False)
        return localio.PartDigest(self._new_checksum, self.sign_payload)

    async def upload_part(
        self, key, upload_id, part_number, path, offset, length, *, digest: localio.PartDigest | None = None
    ) -> PartRecord:
        """Sends the file range: with ``sendfile`` over plain http (:class:`_SendfileSender`),
        else streamed ``BODY_CHUNK`` at a time through httpx (one read of each byte here).

        ``digest``: the part's finished :class:`~ckptfs.drain.localio.PartDigest` from the
        caller's hashing pass; without it the range is read once more first to compute it.
        A streamed body recomputes the checksum on the bytes it sends and fails the request
        before its last byte if they differ from ``digest`` (the file changed since it was
        hashed): :class:`~ckptfs.drain.localio.SourceChangedError`. A part sent with
        sendfile is not re-read: a server that verifies the checksum refuses it
        (BadDigest, raised as SourceChangedError), and the uploader's stat check before
        CompleteMultipartUpload catches a change on servers that do not."""
        if not 1 <= part_number <= self.limits.max_parts:
            raise ValueError(f"part number {part_number} out of range 1..{self.limits.max_parts}")
        if length > self.limits.max_part_size:
            raise ValueError(f"part of {length} bytes exceeds {self.limits.max_part_size}")
        full = self._k(key)
        src = os.fspath(path)
        fd = await trio.to_thread.run_sync(os.open, src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if digest is None:
                digest = self.new_part_digest()
                await trio.to_thread.run_sync(self._digest_range, fd, offset, length, digest)
            ck = self._checksum_params(digest)
            body = _FileRangeBody(fd, offset, length, digest)
            body.sendfile = self.sendfile_parts
            r = await self._call_streaming(
                "UploadPart", key, body,
                Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=part_number, **ck,
            )
        finally:
            await trio.to_thread.run_sync(os.close, fd)
        checksum = ck.get(f"Checksum{self.checksum_algorithm}") if self.checksum_algorithm else None
        return PartRecord(number=part_number, etag=normalize_etag(r.get("ETag")), size=length, checksum=checksum)

    def _checksum_params(self, digest: localio.PartDigest) -> dict:
        if not digest.header or digest.checksum is None:
            return {}
        if self.checksum_algorithm:
            return {f"Checksum{self.checksum_algorithm}": digest.checksum}
        return {"ContentMD5": digest.checksum}

    async def _call_streaming(self, op: str, key: str, body: _FileRangeBody, **params):
        try:
            return await self._call(op, key, Body=body, **params)
        except StoreError:
            if body.error is not None:  # the body's own failure, whatever botocore made of it
                raise body.error from None
            raise

    def _digest_range(self, fd: int, offset: int, length: int, digest: localio.PartDigest) -> None:
        buf = self._chunk_pool.get(BODY_CHUNK)
        try:
            mv = memoryview(buf)[:BODY_CHUNK]
            for pos in range(0, length, BODY_CHUNK):
                n = min(BODY_CHUNK, length - pos)
                localio.read_range(fd, offset + pos, n, mv, [digest])
        finally:
            self._chunk_pool.put(buf)
        digest.finish()

    async def complete_multipart(self, key, upload_id, parts: Sequence[PartRecord]) -> PutResult:
        if not parts:
            raise ValueError("complete_multipart needs at least one part")
        plist = []
        for p in sorted(parts, key=lambda p: p.number):
            d = {"PartNumber": p.number, "ETag": f'"{p.etag}"'}
            if self.checksum_algorithm and p.checksum:
                d[f"Checksum{self.checksum_algorithm}"] = p.checksum
            plist.append(d)
        r = await self._call(
            "CompleteMultipartUpload",
            key,
            Bucket=self.bucket,
            Key=self._k(key),
            UploadId=upload_id,
            MultipartUpload={"Parts": plist},
        )
        return PutResult(
            etag=normalize_etag(r.get("ETag")),
            version_id=r.get("VersionId"),
            checksum=next((r[f] for f in _FLEX_FIELDS if r.get(f)), None),
        )

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            await self._call("AbortMultipartUpload", key, Bucket=self.bucket, Key=self._k(key), UploadId=upload_id)
        except StoreError as e:
            if e.code == "NoSuchUpload" or e.status == 404:
                return
            raise

    async def list_multipart_uploads(self, prefix: str = "") -> list[UploadInfo]:
        validate_key(prefix, allow_empty=True)
        params = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        out: list[UploadInfo] = []
        while True:
            r = await self._call("ListMultipartUploads", prefix, **params)
            for u in r.get("Uploads", []):
                out.append(UploadInfo(self._rel(u["Key"]), u["UploadId"], _utc(u.get("Initiated"))))
            if not r.get("IsTruncated"):
                return out
            params["KeyMarker"] = r.get("NextKeyMarker", "")
            params["UploadIdMarker"] = r.get("NextUploadIdMarker", "")
            if not params["KeyMarker"] and not params["UploadIdMarker"]:
                return out

    async def list_parts(self, key: str, upload_id: str) -> list[PartRecord]:
        params = {"Bucket": self.bucket, "Key": self._k(key), "UploadId": upload_id}
        out: list[PartRecord] = []
        field = f"Checksum{self.checksum_algorithm}" if self.checksum_algorithm else None
        while True:
            try:
                r = await self._call("ListParts", key, **params)
            except StoreError as e:
                if e.status == 404 and e.code != "NoSuchUpload":
                    raise make_error(e.message, code="NoSuchUpload", status=404, op="ListParts", key=key) from e
                raise
            for p in r.get("Parts", []):
                out.append(
                    PartRecord(
                        number=int(p["PartNumber"]),
                        etag=normalize_etag(p.get("ETag")),
                        size=int(p.get("Size", 0)),
                        checksum=p.get(field) if field else None,
                    )
                )
            if not r.get("IsTruncated"):
                break
            params["PartNumberMarker"] = r.get("NextPartNumberMarker")
        out.sort(key=lambda p: p.number)
        return out

    async def copy(
        self,
        src_key: str,
        dst_key: str,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        if_match: str | None = None,
    ) -> PutResult:
        src_full, dst_full = self._k(src_key), self._k(dst_key)
        info = await self.head(src_key)
        if info is None:
            raise make_error(f"copy source {src_key!r} does not exist in {self._where()}", code="NoSuchKey", op="CopyObject", key=src_key)
        if if_match is not None and normalize_etag(if_match) != info.etag:
            raise make_error(
                f"copy source {src_key!r} changed (etag {info.etag} != {if_match})",
                code="PreconditionFailed",
                op="CopyObject",
                key=src_key,
            )
        source = {"Bucket": self.bucket, "Key": src_full}
        if info.size <= self.multipart_copy_threshold:
            params = dict(Bucket=self.bucket, Key=dst_full, CopySource=source, CopySourceIfMatch=f'"{info.etag}"')
            if metadata is not None:
                params["MetadataDirective"] = "REPLACE"
                params["Metadata"] = validate_metadata(metadata)
                if info.content_type:
                    params["ContentType"] = info.content_type
            if storage_class:
                params["StorageClass"] = storage_class
            r = await self._call("CopyObject", dst_key, **params)
            res = r.get("CopyObjectResult", {})
            return PutResult(etag=normalize_etag(res.get("ETag")), version_id=r.get("VersionId"))
        return await self._multipart_copy(info, source, dst_key, metadata, storage_class)

    async def _multipart_copy(self, info: ObjectInfo, source, dst_key, metadata, storage_class) -> PutResult:
        meta = dict(info.metadata) if metadata is None else metadata
        upload_id = await self.create_multipart(
            dst_key, meta, storage_class=storage_class, content_type=info.content_type, _checksum=False
        )
        ps = self.copy_part_size
        ranges = [(i + 1, off, min(ps, info.size - off)) for i, off in enumerate(range(0, info.size, ps))]
        if len(ranges) > self.limits.max_parts:
            ps = -(-info.size // self.limits.max_parts)
            ranges = [(i + 1, off, min(ps, info.size - off)) for i, off in enumerate(range(0, info.size, ps))]
        parts: list[PartRecord] = []
        limiter = trio.Semaphore(self.concurrency)

        async def one(num, off, ln):
            async with limiter:
                r = await self._call(
                    "UploadPartCopy",
                    dst_key,
                    Bucket=self.bucket,
                    Key=self._k(dst_key),
                    UploadId=upload_id,
                    PartNumber=num,
                    CopySource=source,
                    CopySourceRange=f"bytes={off}-{off + ln - 1}",
                    CopySourceIfMatch=f'"{info.etag}"',
                )
                parts.append(PartRecord(num, normalize_etag(r["CopyPartResult"]["ETag"]), ln))

        try:
            try:
                async with trio.open_nursery() as n:
                    for num, off, ln in ranges:
                        n.start_soon(one, num, off, ln)
            except BaseExceptionGroup as eg:
                raise collapse_exception_group(eg) from None
            res = await self.complete_multipart(dst_key, upload_id, parts)
        except BaseException:
            with trio.CancelScope(shield=True):
                try:
                    await self.abort_multipart(dst_key, upload_id)
                except Exception:  # noqa: BLE001
                    log.warning("could not abort multipart copy %s of %s", upload_id, dst_key)
            raise
        # UploadPartCopy does not carry tags (CopyObject does): copy them.
        try:
            tags = await self.get_tags(info.key)
            if tags:
                await self.put_tags(dst_key, tags)
        except StoreError as e:
            if e.code not in ("AccessDenied", "NotImplemented", "NotSupported"):
                raise
        return res

    async def delete_many(self, keys: Iterable[str]) -> dict[str, StoreError]:
        keys = list(keys)
        failed: dict[str, StoreError] = {}
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            r = await self._call(
                "DeleteObjects",
                None,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self._k(k)} for k in batch], "Quiet": True},
            )
            for e in r.get("Errors", []):
                code = e.get("Code") or "InternalError"
                if code == "NoSuchKey":
                    continue
                k = self._rel(e.get("Key", ""))
                failed[k] = make_error(f"DeleteObjects: {code}: {e.get('Message', '')}", code=code, op="DeleteObjects", key=k)
        return failed

    # ------------------------------------------------------------------
    # reads

    async def _get(self, key: str, rng: str | None, if_match: str | None):
        params = {"Bucket": self.bucket, "Key": self._k(key)}
        if rng:
            params["Range"] = rng
        if if_match:
            params["IfMatch"] = f'"{normalize_etag(if_match)}"'
        return await self._call("GetObject", key, **params)

    async def get_range(self, key: str, start: int, end: int, *, if_match: str | None = None) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")
        if end == start:
            return b""
        try:
            r = await self._get(key, f"bytes={start}-{end - 1}", if_match)
        except StoreError as e:
            if e.code == "InvalidRange":
                return b""
            raise
        body = r["Body"]
        try:
            async with body:
                return await body.read()
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, "GetObject", key) from e

    async def get_to_file(
        self,
        key: str,
        dest,
        offset: int = 0,
        length: int | None = None,
        *,
        file_offset: int | None = None,
        if_match: str | None = None,
    ) -> int:
        """GetObject streamed into ``dest`` by a worker thread (:class:`_BlockingGets`):
        the request is a presigned URL from the client, Range and If-Match ordinary headers."""
        if offset < 0 or (length is not None and length < 0):
            raise ValueError("bad range")
        if length == 0:
            return 0
        headers = {}
        if length is not None:
            headers["Range"] = f"bytes={offset}-{offset + length - 1}"
        elif offset:
            headers["Range"] = f"bytes={offset}-"
        if if_match:
            headers["If-Match"] = f'"{normalize_etag(if_match)}"'
        client = await self._c()
        try:
            url = await client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self._k(key)}, ExpiresIn=PRESIGN_SECONDS
            )
        except Exception as e:  # translated (credentials)
            raise self._translate(e, "GetObject", key) from e
        if self._gets is None:
            self._gets = _BlockingGets(self)
        pos = offset if file_offset is None else file_offset
        try:
            written, expected = await trio.to_thread.run_sync(self._gets.get_to_file, url, headers, dest, pos)
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            raise self._translate(self._urllib3_error(e), "GetObject", key) from None
        except Exception as e:  # error responses, local I/O errors
            err = self._translate(e, "GetObject", key)
            if err.code == "InvalidRange":
                return 0
            raise err from e
        if expected is not None and written != expected:
            raise make_error(
                f"GetObject {key!r}: got {written} of {expected} bytes", code="IncompleteBody", op="GetObject", key=key
            )
        return written

    def _urllib3_error(self, e: BaseException) -> Exception:
        """A connection-level error of :class:`_BlockingGets` as botocore's exception (for
        :meth:`_translate`), its text without the presigned URL's query string."""
        where, text = self.endpoint_url or "", _without_query(e)
        exc = botocore.exceptions
        if isinstance(e, urllib3.exceptions.SSLError):
            return exc.SSLError(endpoint_url=where, error=text)
        if isinstance(e, urllib3.exceptions.NewConnectionError):  # a ConnectTimeoutError subclass
            return exc.EndpointConnectionError(endpoint_url=where, error=text)
        if isinstance(e, urllib3.exceptions.ConnectTimeoutError):
            return exc.ConnectTimeoutError(endpoint_url=where, error=text)
        if isinstance(e, (urllib3.exceptions.TimeoutError, TimeoutError)):  # the builtin: the body's reads
            return exc.ReadTimeoutError(endpoint_url=where, error=text)
        return exc.ConnectionClosedError(endpoint_url=f"{where} ({type(e).__name__}: {text})")

    # ------------------------------------------------------------------
    # tags / lifecycle

    async def get_tags(self, key: str) -> dict[str, str]:
        r = await self._call("GetObjectTagging", key, Bucket=self.bucket, Key=self._k(key))
        return {t["Key"]: t["Value"] for t in r.get("TagSet", [])}

    async def put_tags(self, key: str, tags: Mapping[str, str]) -> None:
        tags = validate_tags(tags)
        await self._call(
            "PutObjectTagging",
            key,
            Bucket=self.bucket,
            Key=self._k(key),
            Tagging={"TagSet": [{"Key": k, "Value": v} for k, v in tags.items()]},
        )

    async def get_bucket_lifecycle(self) -> list[dict]:
        try:
            r = await self._call("GetBucketLifecycleConfiguration", None, Bucket=self.bucket)
        except StoreError as e:
            if e.code == "NoSuchLifecycleConfiguration":
                return []
            raise
        return list(r.get("Rules", []))

    async def put_bucket_lifecycle(self, rules: Sequence[Mapping]) -> None:
        if not rules:
            await self._call("DeleteBucketLifecycle", None, Bucket=self.bucket)
            return
        await self._call(
            "PutBucketLifecycleConfiguration",
            None,
            Bucket=self.bucket,
            LifecycleConfiguration={"Rules": [dict(r) for r in rules]},
        )


_ACCESS_HINTS = {
    "NoSuchBucket": "the bucket does not exist at this endpoint",
    "AccessDenied": "the credentials are valid but not allowed to list/write this bucket and prefix",
    "AllAccessDisabled": "all access to this bucket has been disabled",
    "InvalidAccessKeyId": "the access key id is not known to this endpoint",
    "SignatureDoesNotMatch": "wrong secret key (or a proxy rewrote the request)",
    "NoCredentials": "no credentials from any provider of the standard chain",
    "ConnectionError": "cannot connect to the endpoint",
    "Timeout": "the endpoint did not answer in time",
    "PermanentRedirect": "the bucket is in another region; set the region",
    "AuthorizationHeaderMalformed": "wrong region for this bucket; set the region",
    "RequestTimeTooSkewed": "the local clock is off; fix NTP",
    "TLSError": "TLS handshake/certificate problem",
}


def _add_content_md5(params, **kwargs):
    body = params.get("body")
    headers = params.setdefault("headers", {})
    if isinstance(body, (bytes, bytearray)) and "Content-MD5" not in headers:
        headers["Content-MD5"] = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()


def _without_query(e: BaseException) -> str:
    """An error's text without URL query strings (a presigned URL's carry the access key id)."""
    return re.sub(r"\?[^\s'\"]*", "?...", str(e))


def _error_response(status: int, body: bytes) -> botocore.exceptions.ClientError:
    """An S3 error response (status and XML body) as botocore would raise it."""
    code = message = ""
    try:
        root = ElementTree.fromstring(body) if body else None
    except ElementTree.ParseError:
        root = None
    if root is not None:
        code = root.findtext("Code") or ""
        message = root.findtext("Message") or ""
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


class _BlockingGets:
    """GetObject bodies read with blocking sockets (urllib3), in a worker thread, and
    pwritten straight to the destination: one thread hop per GET instead of one trip
    through trio, httpcore and h11 per 64 KiB read. Measured with
    ``integration/bench_get.py`` (DESIGN.md, "Read path performance"): about 0.9 CPU s/GiB
    against 5 through aiobotocore/httpx and 2 for boto3's transfer manager.

    The body is read with ``readinto`` on the response's ``http.client`` object (below
    urllib3's read layers) into one reused :data:`GET_CHUNK` buffer per worker thread, and
    each fill is pwritten from that buffer: the socket's bytes are copied once into user
    space, with no new ``bytes`` per MiB (the upload side's counterpart is
    :class:`_SendfileSender`). The body is not content-decoded: the object's bytes land as
    stored.

    Same TLS verification (botocore's CA bundle, or ``verify_tls``), timeouts and
    environment proxies as the aiobotocore client; no retries (the callers retry)."""

    def __init__(self, store: S3Store):
        kw = {
            "maxsize": store.max_pool_connections,
            "block": False,
            "retries": False,
            "timeout": urllib3.Timeout(connect=store._connect_timeout, read=store._read_timeout),
        }
        if store._verify:
            kw.update(cert_reqs="CERT_REQUIRED", ca_certs=get_cert_path(store._verify))
        else:
            kw.update(cert_reqs="CERT_NONE")
        self._kw = kw
        self._direct = urllib3.PoolManager(**kw)
        self._proxied: dict[str, urllib3.ProxyManager] = {}
        self._lock = threading.Lock()
        self._thread = threading.local()  # .buffer: this worker thread's GET_CHUNK buffer

    def _pool_for(self, url: str) -> urllib3.PoolManager:
        proxy = ProxyConfiguration().proxy_url_for(url)
        if not proxy:
            return self._direct
        with self._lock:
            pool = self._proxied.get(proxy)
            if pool is None:
                pool = self._proxied[proxy] = urllib3.ProxyManager(proxy, **self._kw)
            return pool

    def close(self) -> None:
        """Close the pooled connections (a GET still running closes its own when it ends)."""
        with self._lock:
            pools, self._proxied = [self._direct, *self._proxied.values()], {}
        for pool in pools:
            pool.clear()

    def get_to_file(self, url: str, headers: dict, dest, pos: int) -> tuple[int, int | None]:
        """GET ``url`` into ``dest`` (a path or an fd) from ``pos``; the bytes written and
        the response's Content-Length. Raises ClientError for an error response, urllib3/OS
        errors for the connection (a body shorter than its Content-Length as urllib3's
        IncompleteRead, a read timeout as the builtin TimeoutError)."""
        r = self._pool_for(url).request("GET", url, headers=headers, preload_content=False, redirect=False,
                                        decode_content=False)
        done = False
        try:
            if r.status >= 300:
                raise _error_response(r.status, r.read(64 * 1024))
            length = r.headers.get("Content-Length")
            expected = int(length) if length is not None else None
            own = not isinstance(dest, int)
            fd = os.open(os.fspath(dest), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600) if own else dest
            try:
                written = self._receive(r, fd, pos)
            finally:
                if own:
                    os.close(fd)
            if expected is not None and written < expected:
                # what urllib3 raises for it (a connection error): the connection closed early
                raise urllib3.exceptions.IncompleteRead(written, expected - written)
            done = expected is None or written == expected
            return written, expected
        finally:
            if not done:
                r.close()  # the connection is in an unknown state: not back into the pool
            r.release_conn()

    def _receive(self, r: urllib3.HTTPResponse, fd: int, pos: int) -> int:
        """The body of ``r`` into ``fd`` from ``pos``, through this thread's buffer; the
        bytes written. Checks for cancellation between fills."""
        buffer = getattr(self._thread, "buffer", None)
        if buffer is None:
            buffer = self._thread.buffer = memoryview(bytearray(GET_CHUNK))
        # http.client's readinto stops at the Content-Length (or the last chunk) and fills
        # the buffer with recv_into straight from the socket; urllib3's own readinto would
        # read into a new bytes and copy it
        raw = r._fp if isinstance(getattr(r, "_fp", None), http.client.HTTPResponse) else r
        written = 0
        while n := raw.readinto(buffer):
            written += localio.pwritev_all(fd, [buffer[:n]], pos + written)
            trio.from_thread.check_cancelled()
        return written


#: bytes per ``sendfile`` call of a part body (a cancelled upload stops after at most this)
SENDFILE_BLOCK = 8 * MiB
#: how long a request with ``Expect: 100-continue`` waits for the server's go-ahead before
#: sending its body anyway (what urllib3/boto3 do)
CONTINUE_WAIT = 1.0
#: an idle kept-alive connection older than this is closed, not reused (S3 closes idle
#: connections after about 20 s)
IDLE_REUSE_SECONDS = 15.0
#: error codes that mean the body the server received does not match the checksum header:
#: for a part sent with sendfile, the file changed after it was hashed
_DIGEST_MISMATCH = frozenset({"BadDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch"})


class _Response:
    """A finished response's body for :class:`AioAWSResponse` (botocore parses it)."""

    def __init__(self, content: bytes):
        self._content = content

    async def read(self) -> bytes:
        return self._content


class _SendfileSender:
    """UploadPart bodies written with ``socket.sendfile`` from the cache file (zero-copy,
    in a worker thread, on kept-alive blocking ``http.client`` connections) instead of
    through httpx one chunk per trio thread hop.

    It is a ``before-send`` handler of the aiobotocore client: botocore still serialises,
    signs (:class:`CkptfsS3SigV4Auth`, ``UNSIGNED-PAYLOAD`` or the precomputed SHA-256)
    and parses the response, errors included, so :meth:`S3Store._translate` and the
    retries see what they always saw. Only plain-http endpoints without a proxy:
    ``sendfile`` cannot write into a TLS socket, and those requests take the httpx path.

    The bytes go from the page cache to the socket without being read by Python, so the
    body is not re-checked against the hashing pass here: the part checksum header is
    verified by the server (a mismatch -> :class:`~ckptfs.drain.localio.SourceChangedError`)
    and the uploader compares the file's stat before and after the upload before it
    completes it (DESIGN.md, "Uploads")."""

    def __init__(self, store: S3Store):
        self._connect_timeout = store._connect_timeout
        self._timeout = store._read_timeout
        self._idle: dict[tuple[str, int], list[tuple[float, http.client.HTTPConnection]]] = {}
        self._lock = threading.Lock()
        self.parts_sent = 0  #: requests whose body went out with sendfile

    @staticmethod
    def usable_for(url: str) -> bool:
        return url.startswith("http://") and not ProxyConfiguration().proxy_url_for(url)

    async def before_send(self, request, **kwargs):
        body = request.body
        if not (isinstance(body, _FileRangeBody) and body.sendfile and self.usable_for(request.url)):
            return None  # any other request: aiobotocore sends it
        status, headers, content = await trio.to_thread.run_sync(
            self.send, request.method, request.url, list(request.headers.items()), body)
        if status >= 300 and _error_code(content) in _DIGEST_MISMATCH:
            body.error = localio.SourceChangedError(
                f"the server got bytes {body._offset}..{body._offset + body._length} unlike those hashed")
        return AioAWSResponse(request.url, status, headers, _Response(content))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, conn in conns:
                conn.close()

    def _take(self, host: str, port: int) -> http.client.HTTPConnection | None:
        now = time.monotonic()
        with self._lock:
            conns = self._idle.get((host, port), [])
            while conns:
                since, conn = conns.pop()
                if now - since < IDLE_REUSE_SECONDS:
                    return conn
                conn.close()
        return None

    def _give_back(self, host: str, port: int, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.setdefault((host, port), []).append((time.monotonic(), conn))

    def send(self, method: str, url: str, headers: list, body: _FileRangeBody) -> tuple[int, list, bytes]:
        """One request (blocking; worker thread): status, headers and body of the response.
        A kept-alive connection that turns out closed is replaced once; other connection
        failures are raised as botocore's exceptions, a short source file as
        SourceChangedError (also in ``body.error``)."""
        u = urllib.parse.urlsplit(url)
        host, port = u.hostname, u.port or 80
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        while True:
            conn = self._take(host, port)
            reused = conn is not None
            if conn is None:
                conn = http.client.HTTPConnection(host, port, timeout=self._connect_timeout)
                try:
                    conn.connect()
                except OSError as e:
                    raise botocore.exceptions.EndpointConnectionError(endpoint_url=f"{u.scheme}://{u.netloc}", error=e) from None
                conn.sock.settimeout(self._timeout)
            try:
                status, rheaders, content, keep = self._exchange(conn, method, target, headers, body)
            except BaseException as e:  # noqa: BLE001 - the connection is closed, the error re-raised
                conn.close()
                if reused and isinstance(e, (ConnectionError, http.client.BadStatusLine)):
                    # the server had closed the idle connection: once more on a new one (an
                    # UploadPart may be repeated; the part is the file range either way)
                    continue
                raise self._as_botocore(e, u) from None
            self.parts_sent += 1
            if keep:
                self._give_back(host, port, conn)
            else:
                conn.close()
            return status, rheaders, content

    def _exchange(self, conn: http.client.HTTPConnection, method, target, headers, body: _FileRangeBody):
        conn.putrequest(method, target, skip_accept_encoding=True)
        expect = False
        for k, v in headers:
            if k.lower() == "expect":
                expect = True
            conn.putheader(k, v)
        conn.endheaders()
        if expect and body._length and not self._may_send_body(conn.sock):
            resp = conn.getresponse()  # refused before the body: the connection is done
            return resp.status, resp.getheaders(), resp.read(), False
        sent = 0
        if body._length:
            with open(body._fd, "rb", buffering=0, closefd=False) as src:
                while sent < body._length:
                    n = conn.sock.sendfile(src, body._offset + sent, min(SENDFILE_BLOCK, body._length - sent))
                    if n == 0:
                        body.error = localio.SourceChangedError(
                            f"file ended at {body._offset + sent} while sending "
                            f"[{body._offset}, {body._offset + body._length})")
                        raise body.error
                    sent += n
                    trio.from_thread.check_cancelled()
        resp = conn.getresponse()
        content = resp.read()
        return resp.status, resp.getheaders(), content, not resp.will_close

    @staticmethod
    def _may_send_body(sock) -> bool:
        """After the headers of an ``Expect: 100-continue`` request: False if the server
        answered with a final response (an error) instead of ``100 Continue`` (consumed
        here); True if it said continue or said nothing for ``CONTINUE_WAIT`` seconds."""
        readable, _, _ = select.select([sock], [], [], CONTINUE_WAIT)
        if not readable:
            return True
        head = sock.recv(4096, socket.MSG_PEEK)
        if not head:
            raise http.client.RemoteDisconnected("connection closed before the response")
        if not re.match(rb"HTTP/1\.[01] 100\b", head):
            return False
        end = head.find(b"\r\n\r\n")
        if end < 0:  # an interim response split over packets (never seen): read it byte-wise
            tail = b""
            while not tail.endswith(b"\r\n\r\n"):
                c = sock.recv(1)
                if not c:
                    raise http.client.RemoteDisconnected("connection closed in 100 Continue")
                tail += c
            return True
        sock.recv(end + 4)
        return True

    def _as_botocore(self, e: BaseException, u) -> BaseException:
        """A connection-level failure as the exception botocore would raise (for
        :meth:`S3Store._translate`); the body's own errors and cancellation as they are."""
        where = f"{u.scheme}://{u.netloc}"
        if isinstance(e, TimeoutError):
            return botocore.exceptions.ReadTimeoutError(endpoint_url=where, error=e)
        if isinstance(e, (ConnectionError, http.client.HTTPException)):
            return botocore.exceptions.ConnectionClosedError(endpoint_url=f"{where} ({type(e).__name__}: {e})")
        return e


def _error_code(body: bytes) -> str:
    try:
        return (ElementTree.fromstring(body).findtext("Code") or "") if body else ""
    except ElementTree.ParseError:
        return ""

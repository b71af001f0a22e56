"""Opening an object store: ``s3://`` (aiobotocore) or ``file://`` (a directory) from a URL."""

from __future__ import annotations

from ckptfs.fsmeta.settings import CHECKSUMS, Settings, parse_store_url

from .filestore import FileStore
from .s3store import S3Store
from .store import MiB, ObjectStore


def open_store(
    bucket_url: str,
    *,
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
) -> ObjectStore:
    """Create (but do not connect) a store for ``bucket_url``.

    S3 options (ignored for file://):

    * ``endpoint_url``: e.g. ``http://127.0.0.1:7480`` for radosgw; default AWS.
    * ``region``: default ``$AWS_REGION`` / ``$AWS_DEFAULT_REGION`` / profile / ``us-east-1``.
    * ``checksum``: one of :data:`ckptfs.fsmeta.settings.CHECKSUMS`.  ``md5`` (Content-MD5) works on
      every S3 server, use it for radosgw < 18 (no flexible checksums).
    * ``concurrency``: expected parallel requests; sizes the HTTP connection pool
      (``concurrency + 4`` connections unless ``max_pool_connections`` is given)
      and the part-buffer pool.
    * ``profile``: AWS shared-config profile (else the default chain).
    * ``addressing_style``: ``path``/``virtual``/``auto``; default ``path`` when
      ``endpoint_url`` is given, else ``auto``.
    * ``sign_payload``: SigV4-sign part/PUT bodies with their SHA-256 (computed off
      the loop).  Default False: bodies are sent as ``UNSIGNED-PAYLOAD`` and
      integrity is carried by ``checksum``.
    * ``multipart_copy_threshold``: copy() uses UploadPartCopy above this size
      (default 5 GiB, the CopyObject limit); ``copy_part_size`` per copied part.

    file:// stores use only ``checksum`` (for part checksums).
    """
    u = parse_store_url(bucket_url)
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {', '.join(CHECKSUMS)}; got {checksum!r}")
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if u.scheme == "s3":
        return S3Store(
            bucket=u.bucket,
            prefix=u.prefix,
            endpoint_url=endpoint_url,
            region=region,
            checksum=checksum,
            concurrency=concurrency,
            max_pool_connections=max_pool_connections,
            profile=profile,
            addressing_style=addressing_style,
            sign_payload=sign_payload,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            verify_tls=verify_tls,
            multipart_copy_threshold=multipart_copy_threshold,
            copy_part_size=copy_part_size,
        )
    return FileStore(u.path, checksum=checksum)


def open_store_for(settings: Settings) -> ObjectStore:
    """The store a cache directory's settings name, sized for its drain."""
    return open_store(
        settings.bucket_url,
        endpoint_url=settings.endpoint_url,
        region=settings.region,
        checksum=settings.checksum,
        sign_payload=bool(getattr(settings, "sign_payload", False)),
        max_pool_connections=max(16, int(settings.concurrency) * 2),
    )

"""Opening an object store: ``s3://`` (aiobotocore) or ``file://`` (a directory) from a URL."""

from __future__ import annotations

from ckptfs.fsmeta.settings import CHECKSUMS, Settings, parse_store_url

from .store import ObjectStore


def open_store(bucket_url: str, *, checksum: str = "auto", concurrency: int = 8, **s3_options) -> ObjectStore:
    """Create (but do not connect) a store for ``bucket_url``.

    * ``checksum``: one of :data:`ckptfs.fsmeta.settings.CHECKSUMS` (part and
      PUT checksums, for both stores).  ``md5`` (Content-MD5) works on every S3
      server, use it for radosgw < 18 (no flexible checksums).
    * ``concurrency``: expected parallel requests (S3: sizes the HTTP
      connection pool and the part-buffer pool).
    * ``s3_options``: the keyword options of :class:`~drain.s3store.S3Store`
      (``endpoint_url``, ``region``, ``profile``, ``sign_payload``, timeouts,
      ...); ignored for ``file://``.
    """
    u = parse_store_url(bucket_url)
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {', '.join(CHECKSUMS)}; got {checksum!r}")
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    # Each store's module is imported only when a URL needs it: aiobotocore (and the aiohttp
    # it imports) is most of a drain's start-up, and a file:// bucket needs none of it.
    if u.scheme == "s3":
        from .s3store import S3Store

        return S3Store(bucket=u.bucket, prefix=u.prefix, checksum=checksum, concurrency=concurrency, **s3_options)
    from .filestore import FileStore

    return FileStore(u.path, checksum=checksum)


def open_store_for(settings: Settings) -> ObjectStore:
    """The store a cache directory's settings name, sized for its drain and the gateway's reads."""
    return open_store(
        settings.bucket_url,
        endpoint_url=settings.endpoint_url,
        region=settings.region,
        checksum=settings.checksum,
        sign_payload=bool(getattr(settings, "sign_payload", False)),
        max_pool_connections=max(16, int(settings.concurrency) * 2, int(settings.read_concurrency) + 4),
    )

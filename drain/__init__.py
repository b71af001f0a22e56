"""The object stores (S3 and ``file://``), the uploader and the drain process that makes the
bucket match fsmeta."""

if __name__ != "ckptfs.drain":  # e.g. a source tree on sys.path: one module under two names breaks state
    raise ImportError("ckptfs's drain package is ckptfs.drain; import that instead of drain")

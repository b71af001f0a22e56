"""The FUSE filesystem: the core (POSIX semantics over fsmeta and the cache files, testable
without FUSE), the thin FUSE handlers over the ckptfs_fuse front end, starting a mount, and its
metrics."""

if __name__ != "ckptfs.gateway":  # e.g. a source tree on sys.path: one module under two names breaks state
    raise ImportError("ckptfs's gateway package is ckptfs.gateway; import that instead of gateway")

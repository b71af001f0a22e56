"""ckptfs: a POSIX mount for ML training checkpoints that writes at local-disk speed and drains to S3.

The import package's layers, bottom to top (``docs/ARCHITECTURE.md``; import-linter checks them):

* :mod:`ckptfs.fsmeta`: the cache directory (LMDB store, file layout, remembered settings,
  the durability state machine);
* :mod:`ckptfs.drain`: the object stores and the uploader, and the drain process;
* :mod:`ckptfs.gateway` (the FUSE filesystem) and :mod:`ckptfs.lifecycle` (retention and
  tiering), which do not import each other;
* :mod:`ckptfs.cli`: the ``ckptfs`` command, the only layer that imports all of them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ckptfs")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

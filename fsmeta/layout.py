"""The cache directory: the one place that says where each thing in it lives.

::

    CACHE/                  0700: every user's data passes through here
      meta/                 the fsmeta LMDB environment (data.mdb, lock.mdb); key schema
                            in :mod:`ckptfs.fsmeta.schema`
      data/<ino in hex>     sparse cache file holding a regular file's content
      spare/<n>             empty files the gateway makes ahead of creates (removed at start)
      gateway.lock          flock held by the gateway serving this cache (holds its pid)
      drain.lock            flock held by the drain working on it (holds its pid)
      gateway.log           log of a daemonized gateway (``ckptfs mount`` without -f)

Every other module asks a :class:`CacheDir` for these paths instead of joining them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import locks
from .store import MetaStore


class NoCacheHere(FileNotFoundError):
    """The directory holds no fsmeta database (never mounted, or not a cache directory)."""


@dataclass(frozen=True)
class CacheDir:
    root: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", os.path.abspath(self.root))
        # data_path is called several times per create + close: no os.path.join there.
        object.__setattr__(self, "_data_prefix", os.path.join(self.root, "data", ""))

    @property
    def meta_dir(self) -> str:
        return os.path.join(self.root, "meta")

    @property
    def data_dir(self) -> str:
        return os.path.join(self.root, "data")

    def data_path(self, ino: int) -> str:
        return f"{self._data_prefix}{ino:x}"

    @property
    def spare_dir(self) -> str:
        return os.path.join(self.root, "spare")

    @property
    def gateway_lock(self) -> str:
        return os.path.join(self.root, "gateway.lock")

    @property
    def drain_lock(self) -> str:
        return os.path.join(self.root, "drain.lock")

    @property
    def gateway_log(self) -> str:
        return os.path.join(self.root, "gateway.log")

    def used_bytes(self) -> int:
        """Disk space the cache files take (allocated blocks: sparse files count what they hold)."""
        used = 0
        try:
            with os.scandir(self.data_dir) as entries:
                for entry in entries:
                    try:
                        used += entry.stat(follow_symlinks=False).st_blocks * 512
                    except FileNotFoundError:
                        pass  # removed meanwhile
        except FileNotFoundError:
            pass
        return used

    def has_meta(self) -> bool:
        return os.path.exists(os.path.join(self.meta_dir, "data.mdb"))

    def open_meta(self, *, create: bool = False) -> MetaStore:
        """Open this cache's fsmeta; without ``create``, :class:`NoCacheHere` if there is none."""
        if not create and not self.has_meta():
            raise NoCacheHere(f"cache directory {self.root}: no ckptfs cache here (never mounted?)")
        return MetaStore(self.meta_dir, create=create)

    def make_dirs(self) -> None:
        """Create the directory and ``data/``, private to their owner."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)

    def gateway_pid(self) -> int | None:
        """Pid of the gateway serving this cache, or None."""
        return locks.holder(self.gateway_lock)

    def drain_pid(self) -> int | None:
        """Pid of the drain working on this cache, or None."""
        return locks.holder(self.drain_lock)

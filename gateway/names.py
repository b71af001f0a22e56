"""The bucket-key policy: which names the filesystem accepts, so that every file
can be stored as an S3 object under its path."""

from __future__ import annotations

import errno

from ckptfs.drain.filestore import RESERVED
from ckptfs.fsmeta import Txn

from .errors import FsError

NAME_MAX = 255
S3_KEY_MAX = 1024
RESERVED_PREFIX = RESERVED.encode()  # a file:// bucket keeps its own records under such names


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name is {len(name)} bytes, the limit is {NAME_MAX}")
    if not name or b"/" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL, "invalid name")
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        raise FsError(errno.EILSEQ, "names must be valid UTF-8 to be stored as S3 keys") from None
    if name.startswith(RESERVED_PREFIX):
        # Refused for every bucket: a checkpoint must stay copyable between S3 and file://.
        raise FsError(errno.EINVAL, f"names starting with {RESERVED!r} are reserved by the file:// bucket")


def rel_key(txn: Txn, parent: int, name: bytes, *, base: bytes | None = None) -> str:
    """The bucket key of a name, relative to the key prefix (``base``: the parent's
    ``path_of``, if the caller has it)."""
    if base is None:
        base = txn.path_of(parent)
    base = base or b""
    return (base + b"/" + name if base else name).decode("utf-8", "surrogateescape")


def longest_below(txn: Txn, dir_ino: int) -> int:
    """Bytes the longest key below a directory adds after ``dir/``."""
    longest = 0
    for rel, child in txn.iter_subtree(dir_ino):
        inode = txn.get_inode(child)
        extra = 1 if inode is not None and inode.is_dir else 0
        longest = max(longest, 1 + len(rel) + extra)
    return longest


class BucketKeys:
    """S3's 1024-byte key limit, counted with the mount's key prefix."""

    PATHS_KEPT = 4096

    def __init__(self, key_prefix: str):
        self.key_prefix = key_prefix
        # Directory paths for check(): walking up from the parent to the root, a read per
        # level, was a tenth of a create's time. Valid while ``Txn.names_removed`` holds.
        self._paths: dict[int, bytes] = {}
        self._paths_at = Txn.names_removed

    def key_length(self, rel_path: bytes) -> int:
        return len(self.key_prefix.encode()) + (1 if self.key_prefix else 0) + len(rel_path)

    def check(self, txn: Txn, parent: int, name: bytes, *, is_dir: bool, subtree_extra: int = 0,
              base: bytes | None = None) -> None:
        """Refuse a name whose bucket key would exceed S3's 1024-byte limit (``base``: the
        parent's ``path_of``, if the caller has it)."""
        if base is None:
            base = self._dir_path(txn, parent)
        if base is None:
            raise FsError(errno.ENOENT, "parent directory was removed")
        rel = base + b"/" + name if base else name
        # The directory's own marker key adds "/"; a key below it adds "/" + its path.
        length = self.key_length(rel) + max(1 if is_dir else 0, subtree_extra)
        if length > S3_KEY_MAX:
            raise FsError(
                errno.ENAMETOOLONG,
                f"bucket key would be {length} bytes, S3 allows {S3_KEY_MAX}",
            )

    def _dir_path(self, txn: Txn, dir_ino: int) -> bytes | None:
        """``txn.path_of(dir_ino)``, kept while no name is removed. Called from several
        threads, each holding fsmeta's batch (one writer at a time)."""
        if self._paths_at != Txn.names_removed:
            self._paths = {}
            self._paths_at = Txn.names_removed
        paths = self._paths
        path = paths.get(dir_ino)
        if path is None:
            path = txn.path_of(dir_ino)
            # Not what a transaction read after removing names itself: it may be aborted.
            if path is not None and not txn.removed_names and len(paths) < self.PATHS_KEPT:
                paths[dir_ino] = path
        return path

"""Finding the ckptfs mount a path is on, from outside the gateway.

Kept free of the FUSE front end, trio and the S3 client so that CLI commands which only talk to a
mount (``prefetch``, ``status``) start fast.
"""

from __future__ import annotations

import os

CACHE_DIR_XATTR = "user.ckptfs.cache_dir"


class NotOnMount(Exception):
    """A path the user named is not on a ckptfs mount."""


def mount_cache_dir(mountpoint: str) -> str | None:
    """The cache directory of a ckptfs mount (asked from the mount itself), or None."""
    try:
        return os.fsdecode(os.getxattr(mountpoint, CACHE_DIR_XATTR))
    except OSError:
        return None


def find_mount(path: str) -> tuple[str, str, str]:
    """(mount root, cache dir, path relative to the root) of a path on a ckptfs mount."""
    path = os.path.abspath(path)
    root = path
    while not os.path.ismount(root):
        parent = os.path.dirname(root)
        if parent == root:
            break
        root = parent
    cache_dir = mount_cache_dir(root)
    if cache_dir is None:
        raise NotOnMount(f"{path}: not on a ckptfs mount")
    rel = os.path.relpath(path, root)
    return root, cache_dir, "" if rel == "." else rel

"""What is not durable yet under a path, and waiting for it (``ckptfs wait-durable``)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from fsmeta import MetaStore, ROOT_INO
from fsmeta.txn import Txn


class NotOnMount(Exception):
    pass


@dataclass
class Backlog:
    files: list = field(default_factory=list)  # (path, bytes, state)
    deletes: list = field(default_factory=list)  # bucket keys still to delete
    bytes: int = 0
    errors: dict = field(default_factory=dict)  # path -> error

    @property
    def empty(self) -> bool:
        return not self.files and not self.deletes


def mount_cache_dir(mountpoint: str) -> str | None:
    """The cache directory of a ckptfs mount (asked from the mount itself), or None."""
    try:
        return os.fsdecode(os.getxattr(mountpoint, "user.ckptfs.cache_dir"))
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


def backlog_under(txn: Txn, rel: str) -> Backlog:
    """Pending uploads, moves and deletes at or below ``rel`` (relative path, "" = all)."""
    out = Backlog()
    raw = os.fsencode(rel)
    prefix = rel + "/" if rel else ""
    in_flight = {}
    status = txn.get_drain_status() or {}
    for ino, progress in (status.get("in_flight") or {}).items():
        in_flight[int(ino)] = progress.get("done", 0)
    ino = txn.resolve(raw) if rel else ROOT_INO
    # A pending ancestor (directory rename not yet expanded) makes everything below pending.
    ancestors_pending = False
    if ino is not None and rel:
        cur = txn.get_inode(ino)
        while cur is not None and cur.ino != ROOT_INO:
            parent = txn.get_inode(cur.parent)
            if parent is None:
                break
            if parent.ino != ROOT_INO and txn.get_pending(parent.ino) is not None:
                ancestors_pending = True
                break
            cur = parent
    if ino is not None:
        inode = txn.get_inode(ino)
        items = [(rel, ino)]
        if inode is not None and inode.is_dir:
            items += [((rel + "/" if rel else "") + p.decode("utf-8", "surrogateescape"), c)
                      for p, c in txn.iter_subtree(ino)]
        for path, child in items:
            child_inode = txn.get_inode(child)
            if child_inode is None:
                continue
            pending = txn.get_pending(child)
            if pending is None and not ancestors_pending:
                continue
            size = child_inode.size if child_inode.is_reg else 0
            if pending is not None and pending.reason != "data" and child_inode.durable_generation == child_inode.generation:
                size = 0  # a move: copied in the bucket, not uploaded
            size = max(0, size - in_flight.get(child, 0))
            error = txn.get_error(child)
            state = f"error: {error}" if error else ("uploading" if txn.get_upload(child) else "dirty")
            if error:
                out.errors[path or "/"] = error
            out.files.append((path or "/", size, state))
            out.bytes += size
    for key, _ in txn.iter_tombstones():
        if not rel or key == rel or key.startswith(prefix) or key == prefix:
            out.deletes.append(key)
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def wait_durable(path: str, *, timeout: float | None = None, show_progress: bool = False,
                 out=sys.stderr, interval: float = 0.2) -> bool:
    """Block until everything at or under ``path`` is durable; False on timeout (pending printed)."""
    root, cache_dir, rel = find_mount(path)
    meta = MetaStore(os.path.join(cache_dir, "meta"), create=False)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        start_bytes = None
        warned = set()
        while True:
            with meta.read() as txn:
                backlog = backlog_under(txn, rel)
            if backlog.empty:
                if show_progress and start_bytes:
                    out.write("\r" + " " * 78 + "\r")
                return True
            for p, error in backlog.errors.items():
                if p not in warned:
                    warned.add(p)
                    out.write(f"ckptfs: {p}: upload failing: {error} (data kept in the cache; retrying)\n")
            if show_progress:
                start_bytes = max(start_bytes or 0, backlog.bytes)
                done = start_bytes - backlog.bytes
                frac = done / start_bytes if start_bytes else 0.0
                bar = "#" * int(frac * 30)
                out.write(f"\r[{bar:<30}] {_human(backlog.bytes)} left, {len(backlog.files)} files, "
                          f"{len(backlog.deletes)} deletes   ")
                out.flush()
            if deadline is not None and time.monotonic() >= deadline:
                if show_progress:
                    out.write("\n")
                out.write(f"ckptfs: timed out; still pending under {path}:\n")
                for p, size, state in backlog.files[:50]:
                    out.write(f"  {state:10} {_human(size):>10}  {p}\n")
                for key in backlog.deletes[:50]:
                    out.write(f"  {'delete':10} {'':>10}  {key}\n")
                more = len(backlog.files) + len(backlog.deletes) - 100
                if more > 0:
                    out.write(f"  … and {more} more\n")
                return False
            time.sleep(interval)
    finally:
        meta.close()

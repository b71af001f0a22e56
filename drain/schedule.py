"""Which pending inodes the drain may start now, in which order (pure functions).

Rules (docs/ARCHITECTURE.md, "Drain order"):

* A file is eligible once no handle has it open for writing (unless an
  ``fsync=remote`` caller asked for it: ``urgent``) and the settle window has
  passed since its last change.
* A file whose cache lost data (``lost``) never starts, but holds back the markers
  above it: a checkpoint with a lost shard must not look complete.
* Oldest first (by when it became pending), so no file starves.
* Commit markers drain last: a marker (name matching a marker pattern) waits
  until no other pending file below its directory is left, except markers in
  the same directory (they would wait for each other forever). Markers in
  deeper directories do count, so ``run/latest`` waits for
  ``run/step_9/.metadata``. A pending directory at, below or above the
  marker's directory blocks it too: after ``mv tmp-ckpt ckpt`` the files below
  ``ckpt`` are queued only when the drain expands that directory, and until then
  they are still at their old keys.
* Deletions go the other way: markers first (see :func:`order_tombstones`), so
  a half-deleted checkpoint never looks complete. An object below a marker that is
  still in the bucket under its old name (a renamed checkpoint whose marker has not
  moved yet) is not deleted until that marker has moved (:func:`below_marker`).
"""

from __future__ import annotations

import functools
import posixpath
from dataclasses import dataclass

from ckptfs.fsmeta.settings import is_marker_name


@dataclass(frozen=True)
class Candidate:
    ino: int
    path: str  # relative path (no leading slash); "" for the root
    since_ns: int
    changed_ns: int
    is_dir: bool
    writers: int
    urgent: bool
    lost: bool = False  # its cache lost data (CacheFileShort/Missing): never started, still blocks markers


def is_marker(path: str, patterns: list[str]) -> bool:
    return _is_marker(path, tuple(patterns))


@functools.lru_cache(maxsize=1 << 16)
def _is_marker(path: str, patterns: tuple[str, ...]) -> bool:
    # Asked of every pending path at every scan of the drain: the answers are remembered.
    return is_marker_name(posixpath.basename(path), patterns)


def _below(path: str, directory: str) -> bool:
    return directory == "" or path.startswith(directory + "/")


def eligible(candidates: list[Candidate], *, now_ns: int, settle_ns: int, markers: list[str],
             busy: set[int]) -> list[Candidate]:
    """The candidates that may start now, oldest first."""
    pending_files = [c for c in candidates if not c.is_dir]
    pending_dirs = [c for c in candidates if c.is_dir and c.path]  # the root is never renamed
    out = []
    for cand in sorted(candidates, key=lambda c: (c.since_ns, c.ino)):
        if cand.ino in busy or cand.lost:
            continue
        if cand.writers > 0 and not cand.urgent:
            continue
        if not cand.urgent and now_ns - cand.changed_ns < settle_ns:
            continue
        if not cand.is_dir and is_marker(cand.path, markers):
            directory = posixpath.dirname(cand.path)
            blocked = any(other.ino != cand.ino and marker_waits_for(cand.path, other.path, markers)
                          for other in pending_files)
            for other in pending_dirs:
                if (other.path == directory or _below(other.path, directory)
                        or _below(directory, other.path)):
                    blocked = True
                    break
            if blocked:
                continue
        out.append(cand)
    return out


def marker_waits_for(marker: str, other: str, markers: list[str]) -> bool:
    """The marker at ``marker`` drains only after a pending file at ``other``: one below its
    directory, unless another marker of that same directory."""
    if not is_marker(marker, markers):
        return False
    directory = posixpath.dirname(marker)
    if not _below(other, directory):
        return False
    return not (posixpath.dirname(other) == directory and is_marker(other, markers))


def held_by_lost(cand: Candidate, candidates: list[Candidate], markers: list[str]) -> bool:
    """A marker that waits for a file below its directory whose cache lost data: it will
    not upload until that file is written again or removed."""
    if cand.is_dir or not is_marker(cand.path, markers):
        return False
    directory = posixpath.dirname(cand.path)
    return any(o.lost and _below(o.path, directory) for o in candidates)


def below_marker(key: str, marker_keys: list[str], markers: list[str]) -> bool:
    """``key`` (not a marker itself) is at or below the directory of one of ``marker_keys``:
    while such a marker is in the bucket, it vouches for the object at ``key``."""
    if is_marker(key.rstrip("/"), markers) and not key.endswith("/"):
        return False
    return any(_below(key, posixpath.dirname(m)) for m in marker_keys)


def order_tombstones(keys: list[str], markers: list[str]) -> list[list[str]]:
    """Batches of keys to delete, in order: markers first, then everything else."""
    first = [k for k in keys if not k.endswith("/") and is_marker(k, markers)]
    rest = [k for k in keys if k not in set(first)]
    return [batch for batch in (sorted(first), sorted(rest)) if batch]

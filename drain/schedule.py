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
* Every name counts: a hard-linked file holds back the markers above each of its
  names, and a marker named twice waits below both directories. Markers that wait
  for each other only through such links (a cycle) do not, or none would go.
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
    # A hard-linked file's names other than ``path``: a marker waits for a pending file
    # named below its directory by any of them (``ln ck0/s ck1/s`` then a rewrite).
    other_paths: tuple[str, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path, *self.other_paths)


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
    waits = _marker_waits(candidates, markers)
    out = []
    for cand in sorted(candidates, key=lambda c: (c.since_ns, c.ino)):
        if cand.ino in busy or cand.lost:
            continue
        if cand.writers > 0 and not cand.urgent:
            continue
        if not cand.urgent and now_ns - cand.changed_ns < settle_ns:
            continue
        if any(not _reaches(waits, other, cand.ino) for other in waits.get(cand.ino, ())):
            continue
        out.append(cand)
    return out


def _marker_waits(candidates: list[Candidate], markers: list[str]) -> dict[int, set[int]]:
    """For each pending marker (a file that is a marker under any of its names), the pending
    inodes it waits for: files named below its directory, and directories at, below or
    above it. (Indexed by directory: a scan of a deep backlog stays linear in its size.)"""
    marker_names: dict[int, list[str]] = {}
    for c in candidates:
        if c.is_dir:
            continue
        if c.other_paths:
            names = [p for p in c.paths if is_marker(p, markers)]
        else:  # (most files: no list to build)
            names = [c.path] if is_marker(c.path, markers) else None
        if names:
            marker_names[c.ino] = names
    if not marker_names:
        return {}
    files = {c.ino: c for c in candidates if not c.is_dir}
    files_below: dict[str, set[int]] = {}  # directory -> pending files named below it
    dirs_at_or_below: dict[str, set[int]] = {}  # directory -> pending directories at or below it
    dir_inos: dict[str, int] = {}
    for c in candidates:
        if c.is_dir:
            if c.path:  # the root is never renamed
                dir_inos[c.path] = c.ino
                for d in (c.path, *_ancestors(c.path)):
                    dirs_at_or_below.setdefault(d, set()).add(c.ino)
        else:
            for p in c.paths:
                for d in _ancestors(p):
                    files_below.setdefault(d, set()).add(c.ino)
    waits: dict[int, set[int]] = {}
    for ino, names in marker_names.items():
        waited = waits.setdefault(ino, set())
        for marker in names:
            directory = posixpath.dirname(marker)
            waited.update(o for o in files_below.get(directory, ()) if o != ino
                          and any(marker_waits_for(marker, p, markers) for p in files[o].paths))
            waited.update(dirs_at_or_below.get(directory, ()))
            waited.update(dir_inos[d] for d in _ancestors(directory) if d in dir_inos)
    return waits


def _ancestors(path: str) -> list[str]:
    """The directories above ``path``, nearest first, ending with the root ``""``."""
    out = []
    while path:
        path = posixpath.dirname(path)
        out.append(path)
    return out


def _reaches(waits: dict[int, set[int]], start: int, target: int) -> bool:
    """``start`` waits, directly or through other markers, for ``target``. Only hard links
    make such a cycle (``ck0/.metadata`` also named ``ck1/x``, ``ck1/.metadata`` also named
    ``ck0/y``); the markers in it do not wait for each other, or none would ever go."""
    seen, stack = {start}, [start]
    while stack:
        for nxt in waits.get(stack.pop(), ()):
            if nxt == target:
                return True
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


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
    if cand.is_dir:
        return False
    directories = [posixpath.dirname(p) for p in cand.paths if is_marker(p, markers)]
    return any(o.lost and _below(p, d) for o in candidates for p in o.paths for d in directories)


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

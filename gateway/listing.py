"""The bucket is the namespace: directory listings become fsmeta inodes.

A second node (or the same node after its cache was lost) mounts a bucket that already
holds checkpoints. Each directory is listed, with one LIST with delimiter ``/`` of its
prefix, the first time a lookup, readdir, rmdir or rename needs it, and again once that
listing is older than the TTL (``[mount] remote_ttl``). Within the TTL fsmeta answers
alone: a name it does not hold does not exist, so a DCP load or a Python import that
misses many names costs one LIST per directory and TTL, not one request per miss (the
negative cache is "this directory was listed at T", kept in memory).

A listing is merged into fsmeta in one write transaction:

* an object ``dir/name`` that fsmeta lacks becomes a regular file in state REMOTE
  (``durability.mark_remote``), a common prefix ``dir/name/`` a directory. Its attributes
  come from one HEAD per new object (user metadata is not in listings): mode, uid, gid,
  mtime under the names the drain writes (s3fs/rclone); objects written by other tools
  get 0644 (directories 0755), the mounting user's uid/gid and LastModified. HEADs run
  concurrently in the bucket client's loop, before the write transaction;
* local names that are not durable yet shadow remote ones: a pending inode is never
  touched; an object whose key is queued for deletion (tombstone) or is still the
  content of another inode (the old name of a rename the drain has not copied yet) is
  not added back;
* a settled file whose object changed (etag, or the LastModified the last listing saw,
  kept in its remote record across restarts) becomes a new inode at its name, unless it is
  open here (the old one goes once the kernel forgets it): with the writeback cache the
  kernel never takes a new size for an inode it caches. The same content with new
  metadata keeps the inode and its cache file, with the new attributes;
* a local name missing from the listing goes only if it is settled (not pending, nothing
  pending below a directory, no ancestor pending), not open here, and a HEAD (a LIST of
  the prefix for a directory) confirms that the object is gone: a listing that raced
  with the drain's upload must not remove the file just uploaded.
* a local name the listing shows with the other type (another node replaced a file by a
  directory or back) goes on the same terms, its old shape's key confirmed gone, and the
  listed entry takes its place in the same transaction, as a new one would.

Bucket errors never fail a lookup: the node keeps answering from fsmeta (logged,
counted) and tries again after the TTL.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

import trio

from ckptfs.drain.store import ListResult, ObjectInfo, ObjectStore
from ckptfs.fsmeta import FileState, Inode, RemoteRecord, Txn, durability

from . import metrics
from .errors import FsError
from .lookups import LookupCounts
from .names import check_name
from .state import CoreState

log = logging.getLogger("ckptfs.listing")

DEFAULT_REMOTE_TTL = 3.0  # seconds ([mount] remote_ttl)
HEAD_CONCURRENCY = 32  # HEADs of one listing in flight at once
FILE_MODE = stat.S_IFREG | 0o644  # objects without metadata
DIR_MODE = stat.S_IFDIR | 0o755
SYMLINK_MAX = 4095
_VALID_TYPES = {stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK}


@dataclass
class NamespaceStats:
    """Bucket requests of the namespace (also exported as Prometheus metrics)."""

    lists: int = 0
    heads: int = 0
    gets: int = 0  # symlink targets
    negative_hits: int = 0  # lookups of missing names answered without a request
    errors: int = 0

    @property
    def requests(self) -> int:
        return self.lists + self.heads + self.gets


@dataclass(frozen=True)
class Listed:
    """One entry of a directory's listing."""

    name: bytes
    key: str  # relative to the prefix; ``dir/name/`` for a directory
    is_dir: bool
    etag: str = ""
    modified: _dt.datetime | None = None


@dataclass
class Fetched:
    """What a HEAD (and, for a symlink, a GET) said about an object."""

    info: ObjectInfo | None
    target: bytes = b""


@dataclass
class Plan:
    """What a merge must ask the bucket before its write transaction."""

    new: list[Listed] = field(default_factory=list)
    changed: list[tuple[int, Listed]] = field(default_factory=list)
    first_seen: list[tuple[int, str]] = field(default_factory=list)  # files whose LastModified to record
    gone: list[tuple[bytes, int, str]] = field(default_factory=list)  # name, ino, key to confirm
    # A hard link's name whose object another node replaced: (ino, entry, the key of another
    # name of the file, whose object the file keeps as its content if that name was its record's).
    split: list[tuple[int, Listed, str | None]] = field(default_factory=list)
    # A name another node turned from a file into a directory or back: (name, ino, the local
    # shape's key to confirm gone, the listed entry that takes the name once it is).
    retyped: list[tuple[bytes, int, str, Listed]] = field(default_factory=list)

    def heads(self) -> list[str]:
        keys = [e.key for e in self.new] + [e.key for _, e in self.changed]
        keys += [e.key for _, e, _ in self.split] + [k for _, _, k in self.split if k is not None]
        keys += [e.key for _, _, _, e in self.retyped]
        return keys + [key for key in self._confirm_gone() if not key.endswith("/")]

    def probes(self) -> list[str]:
        return [key for key in self._confirm_gone() if key.endswith("/")]

    def _confirm_gone(self) -> list[str]:
        return [key for _, _, key in self.gone] + [key for _, _, key, _ in self.retyped]


def parse_mode(value: str | None, default: int) -> int:
    """``mode`` metadata: decimal (s3fs, ckptfs) or octal (rclone); ``default`` if neither fits."""
    if not value:
        return default
    for base in (10, 8):
        try:
            mode = int(value.strip(), base)
        except ValueError:
            continue
        if mode <= 0o177777 and stat.S_IFMT(mode) in _VALID_TYPES | {0}:
            return mode if stat.S_IFMT(mode) else stat.S_IFMT(default) | mode
    return default


def parse_mtime_ns(value: str | None) -> int | None:
    """``mtime`` metadata: seconds, integer (s3fs) or fractional (rclone, ckptfs)."""
    if not value:
        return None
    try:
        return int(Decimal(value.strip()) * 1_000_000_000)
    except (InvalidOperation, ValueError):
        return None


def _int_or(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _ns(when: _dt.datetime | None) -> int:
    return int(when.timestamp() * 1e9) if when is not None else time.time_ns()


class RemoteNames:
    """Listings -> fsmeta, the per-directory TTL and the negative cache."""

    def __init__(self, state: CoreState, lookups: LookupCounts, ttl_seconds: float = DEFAULT_REMOTE_TTL):
        self._state = state
        self._lookups = lookups
        self.ttl_ns = int(float(ttl_seconds) * 1e9)
        self.stats = NamespaceStats()
        self.uid, self.gid = os.getuid(), os.getgid()  # owner of objects without metadata
        self._lock = threading.Lock()
        self._listed_at: dict[int, int] = {}  # dir ino -> clock() when its last listing started
        self._dir_locks: dict[int, threading.Lock] = {}

    @property
    def enabled(self) -> bool:
        return self._state.bucket is not None

    # -- freshness ---------------------------------------------------------------------

    def is_fresh(self, dir_ino: int) -> bool:
        with self._lock:
            at = self._listed_at.get(dir_ino)
        return at is not None and self._state.clock() - at < self.ttl_ns

    def fresh_for_seconds(self, dir_ino: int) -> float:
        """How much longer the directory's last listing counts as fresh (0: not listed or stale)."""
        with self._lock:
            at = self._listed_at.get(dir_ino)
        if at is None:
            return 0.0
        return max(0.0, (at + self.ttl_ns - self._state.clock()) / 1e9)

    def mark_listed(self, dir_ino: int, at_ns: int | None = None) -> None:
        with self._lock:
            self._listed_at[dir_ino] = self._state.clock() if at_ns is None else at_ns

    def count_negative_hit(self) -> None:
        self.stats.negative_hits += 1
        metrics.NAMESPACE_NEGATIVE_HITS.inc()

    def _dir_lock(self, dir_ino: int) -> threading.Lock:
        with self._lock:
            lock = self._dir_locks.get(dir_ino)
            if lock is None:
                lock = self._dir_locks[dir_ino] = threading.Lock()
            return lock

    # -- refreshing ----------------------------------------------------------------------

    def refresh(self, dir_ino: int) -> bool:
        """List ``dir_ino`` unless its listing is younger than the TTL. True if it listed now
        (concurrent callers wait for one listing instead of sending their own)."""
        if not self.enabled or self.is_fresh(dir_ino):
            return False
        with self._dir_lock(dir_ino):
            if self.is_fresh(dir_ino):
                return False
            self._list_and_merge(dir_ino)
            return True

    def refresh_child(self, parent: int, name: bytes, *, subtree: bool = False) -> None:
        """List the directory ``parent/name`` (and, with ``subtree``, every directory below it)
        before an operation that must see all of it (rmdir: empty? rename: every object moves)."""
        self.refresh_children([(parent, name, subtree)])

    def refresh_children(self, names: list[tuple[int, bytes, bool]]) -> None:
        """:meth:`refresh_child` of each ``(parent, name, subtree)``, the names read in one
        transaction (a rename names two; most are files, which need nothing listed)."""
        if not self.enabled:
            return
        found = []
        with self._state.meta.read() as txn:
            for parent, name, subtree in names:
                ino = txn.lookup(parent, name)
                inode = txn.get_inode(ino) if ino is not None else None
                if inode is not None and inode.is_dir:
                    found.append((ino, subtree))
        for ino, subtree in found:
            self._refresh_dir(ino, subtree)

    def _refresh_dir(self, ino: int, subtree: bool) -> None:
        todo = [ino]
        while todo:
            dir_ino = todo.pop()
            self.refresh(dir_ino)
            if subtree:
                with self._state.meta.read() as txn:
                    for _, child in txn.iter_dir(dir_ino):
                        child_inode = txn.get_inode(child)
                        if child_inode is not None and child_inode.is_dir:
                            todo.append(child)

    def _timed(self, op: str, fn: Callable[[], object]):
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self._observe(op, time.perf_counter() - start)

    def _observe(self, op: str, seconds: float) -> None:
        if op == "list":
            self.stats.lists += 1
        elif op == "head":
            self.stats.heads += 1
        else:
            self.stats.gets += 1
        metrics.NAMESPACE_REQUESTS.labels(op).inc()
        metrics.NAMESPACE_REQUEST_SECONDS.labels(op).observe(seconds)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.errors += 1
        metrics.NAMESPACE_ERRORS.inc()
        log.warning("bucket namespace: %s failed (answering from the cache until the TTL ends): %s", what, exc)

    def _list_and_merge(self, dir_ino: int) -> None:
        started = self._state.clock()
        meta = self._state.meta
        with meta.read() as txn:
            inode = txn.get_inode(dir_ino)
            path = txn.path_of(dir_ino)
            if inode is None or not inode.is_dir or inode.nlink == 0 or path is None:
                return
            prefix = path.decode("utf-8", "surrogateescape") + "/" if path else ""
            names_before = {name for name, _ in txn.iter_dir(dir_ino)}
            tombstones_before = {key for key, _ in txn.tombstones_below(prefix)}
        bucket = self._state.bucket
        try:
            listing: ListResult = self._timed("list", lambda: bucket.list(prefix, "/"))
        except Exception as exc:  # noqa: BLE001 - any store or connection error: serve what fsmeta holds
            self._failed(f"LIST {prefix or '/'}", exc)
            self.mark_listed(dir_ino, started)
            return
        entries = self._entries(prefix, listing)
        with meta.read() as txn:
            if txn.path_of(dir_ino) != path:
                return  # renamed meanwhile: listed again under its new name next time
            plan = self._plan(txn, dir_ino, entries, names_before, tombstones_before)
        fetched, present = ({}, {})
        if plan.heads() or plan.probes():
            try:
                fetched, present = bucket.call(lambda store: self._fetch(store, plan.heads(), plan.probes()))
            except Exception as exc:  # noqa: BLE001 - as for the LIST
                self._failed(f"HEAD below {prefix or '/'}", exc)
                self.mark_listed(dir_ino, started)
                return
        listed_modified = {e.key: e.modified for e in entries.values()}
        purge, stale, _ = meta.write(lambda txn: self._apply(txn, dir_ino, path, plan, fetched, present,
                                                             listed_modified))
        for ino in purge:
            self._lookups.maybe_purge(ino)
        for ino, _ in stale:
            # A new or replaced object: no cached byte is current. Claimed, so that a first open
            # that read the inode before this listing's transaction reads it again.
            with self._state.lock:
                if self._state.claim_if_closed(ino) is not None:
                    continue  # open: read as it was opened (a REMOTE file's cache file is never trusted)
            try:
                self._state.remove_data(ino)
            finally:
                self._state.end_claims([ino])
        self.mark_listed(dir_ino, started)

    def _entries(self, prefix: str, listing: ListResult) -> dict[bytes, Listed]:
        out: dict[bytes, Listed] = {}
        for obj in listing.objects:
            rel = obj.key[len(prefix):]
            if obj.key == prefix or not obj.key.startswith(prefix) or "/" in rel:
                continue  # the directory's own marker
            name = self._valid_name(rel)
            if name is not None:
                out[name] = Listed(name, obj.key, False, obj.etag, obj.last_modified)
        for common in listing.prefixes:
            name = self._valid_name(common[len(prefix):].rstrip("/"))
            if name is not None and common.startswith(prefix):
                out[name] = Listed(name, common, True)  # a directory wins over a file of the same name
        return out

    @staticmethod
    def _valid_name(rel: str) -> bytes | None:
        name = rel.encode("utf-8", "surrogateescape")
        try:
            check_name(name)
        except FsError:
            return None  # not a name this filesystem can show (e.g. ".ckptfs-probe/", "a//b")
        return name

    def _shadowed(self, txn: Txn, entry: Listed, tombstones_before: set[str]) -> bool:
        """The object is the remains of a local removal or rename that the drain has not
        finished in the bucket: it must not come back."""
        if entry.is_dir:
            under = entry.key
            return (any(k.startswith(under) for k in tombstones_before)
                    or next(txn.tombstones_below(under), None) is not None
                    or next(txn.remote_keys_below(under), None) is not None)
        return (entry.key in tombstones_before or txn.get_tombstone(entry.key) is not None
                or txn.owner_of_remote_key(entry.key) is not None)

    def _settled(self, txn: Txn, ino: int, inode: Inode) -> bool:
        """Nothing of ``ino`` (or below it) waits for the drain, and nothing of it is open here."""
        with self._state.lock:
            open_files = set(self._state.open_files)
        if txn.get_pending(ino) is not None or ino in open_files:
            return False
        if inode.is_dir:
            return all(txn.get_pending(child) is None and child not in open_files
                       for _, child in txn.iter_subtree(ino))
        return True

    def _plan(self, txn: Txn, dir_ino: int, entries: dict[bytes, Listed], names_before: set[bytes],
              tombstones_before: set[str]) -> Plan:
        plan = Plan()
        # Renamed, its objects not moved yet: the listing is not the truth about what is gone.
        listing_is_truth = not durability.pending_at_or_above(txn, dir_ino)
        for name, entry in entries.items():
            local = txn.lookup(dir_ino, name)
            if local is None:
                if name not in names_before and not self._shadowed(txn, entry, tombstones_before):
                    plan.new.append(entry)
                continue
            inode = txn.get_inode(local)
            if inode is not None and inode.is_dir != entry.is_dir:
                # Another node replaced a file by a directory or the other way round: the
                # local name goes as if gone from the listing, and the entry comes as a new one.
                if (listing_is_truth and self._settled(txn, local, inode)
                        and not self._shadowed(txn, entry, tombstones_before)):
                    key = entries_key(txn, dir_ino, name, inode.is_dir)
                    plan.retyped.append((name, local, key, entry))
                continue
            if entry.is_dir:
                continue
            record = txn.get_remote(local)
            if (record is None and inode is not None and not inode.is_dir
                    and txn.get_error(local) == durability.REMOTE_OBJECT_GONE
                    and self._settled(txn, local, inode) and entries_key(txn, dir_ino, name, False) == entry.key):
                # Its content is nowhere (another node deleted its object before this node's
                # move of it was in the bucket): the object another node put at its name since
                # is its content now, as for any object replaced elsewhere.
                plan.changed.append((local, entry))
                continue
            if (inode is None or inode.is_dir or record is None
                    or not self._settled(txn, local, inode)):
                continue  # a local directory, or a file not durable yet: the local one wins
            if record.key != entry.key:
                # Another name of a hard-linked file: its copy, unless another node replaced it.
                copied = record.link_etags.get(entry.key)
                if copied and entry.etag and copied != entry.etag:
                    plan.split.append((local, entry, None))
                continue
            seen = record.listed_modified_ns or None
            if (record.etag and entry.etag and record.etag != entry.etag) or (
                    seen is not None and entry.modified is not None and seen != _ns(entry.modified)):
                others = sorted({p.decode("utf-8", "surrogateescape") for p in txn.paths_of(local)}
                                - {entry.key}) if inode.nlink > 1 else []
                if others:
                    plan.split.append((local, entry, others[0]))
                else:
                    plan.changed.append((local, entry))
            elif seen is None and entry.modified is not None:
                plan.first_seen.append((local, entry.key))
        if not listing_is_truth:
            return plan
        for name, child in txn.iter_dir(dir_ino):
            if name in entries:
                continue
            inode = txn.get_inode(child)
            if inode is None or not self._settled(txn, child, inode):
                continue
            key = entries_key(txn, dir_ino, name, inode.is_dir)
            plan.gone.append((name, child, key))
        return plan

    async def _fetch(self, store: ObjectStore, heads: list[str], probes: list[str]
                     ) -> tuple[dict[str, Fetched], dict[str, bool]]:
        """HEAD ``heads`` (GET symlink targets) and probe ``probes`` for any object, concurrently."""
        fetched: dict[str, Fetched] = {}
        present: dict[str, bool] = {}
        limiter = trio.CapacityLimiter(HEAD_CONCURRENCY)

        async def timed(op, coro):
            start = time.perf_counter()
            try:
                return await coro
            finally:
                self._observe(op, time.perf_counter() - start)

        async def head(key: str) -> None:
            async with limiter:
                try:
                    info = await timed("head", store.head(key))
                    target = b""
                    if (info is not None and not key.endswith("/") and 0 < info.size <= SYMLINK_MAX
                            and stat.S_ISLNK(parse_mode(info.metadata.get("mode"), FILE_MODE))):
                        target = await timed("get", store.get_range(key, 0, info.size))
                    fetched[key] = Fetched(info, target)
                except Exception as exc:  # noqa: BLE001 - this entry only: left out until the next listing
                    self._failed(f"HEAD {key}", exc)

        async def probe(prefix: str) -> None:
            async with limiter:
                try:
                    present[prefix] = await timed("list", store.holds_any(prefix))
                except Exception as exc:  # noqa: BLE001 - not confirmed gone: kept
                    self._failed(f"LIST {prefix}", exc)

        async with trio.open_nursery() as nursery:
            for key in heads:
                nursery.start_soon(head, key)
            for prefix in probes:
                nursery.start_soon(probe, prefix)
        return fetched, present

    # -- the write transaction ------------------------------------------------------------

    def _apply(self, txn: Txn, dir_ino: int, path: bytes, plan: Plan, fetched: dict[str, Fetched],
               present: dict[str, bool], listed_modified: dict[str, _dt.datetime | None]
               ) -> tuple[list[int], list[tuple[int, str]], list[tuple[int, str]]]:
        """Merge one listing: returns the inodes to purge, the (inode, key) of files made or with
        new content (no cache file of theirs is current), and of files only re-attributed."""
        purge, stale, seen = self._merge(txn, dir_ino, path, plan, fetched, present)
        for ino, key in stale + seen + plan.first_seen:
            record = txn.get_remote(ino)
            modified = listed_modified.get(key)
            if record is not None and record.key == key and modified is not None:
                # The listing's own value (a HEAD's may be rounded to the second on S3).
                record.listed_modified_ns = _ns(modified)
                txn.put_remote(ino, record)
        return purge, stale, seen

    def _merge(self, txn: Txn, dir_ino: int, path: bytes, plan: Plan, fetched: dict[str, Fetched],
               present: dict[str, bool]) -> tuple[list[int], list[tuple[int, str]], list[tuple[int, str]]]:
        purge: list[int] = []
        stale: list[tuple[int, str]] = []  # new or with new content: no cache file is current
        seen: list[tuple[int, str]] = []  # attributes refreshed, content unchanged
        if txn.path_of(dir_ino) != path:
            return purge, stale, seen
        parent = txn.get_inode(dir_ino)
        if parent is None or parent.nlink == 0:
            return purge, stale, seen
        with self._state.lock:
            open_files = set(self._state.open_files)
        for entry in plan.new:
            stale.append((self._add_listed(txn, parent, entry, fetched), entry.key))
        for name, ino, key, entry in plan.retyped:
            removed = self._remove_if_gone(txn, parent, name, ino, key, fetched, present)
            if removed is not None:
                purge += removed
                stale.append((self._add_listed(txn, parent, entry, fetched), entry.key))
        changed = list(plan.changed)
        for ino, entry, other_key in plan.split:
            new_ino = self._split_link(txn, parent, ino, entry, fetched, other_key, open_files)
            if new_ino is not None:
                stale.append((new_ino, entry.key))
            elif other_key is not None:
                # The same content at its record's key (a copy with new metadata), or its content
                # not known to be at its other name: handled as for a file of one name.
                changed.append((ino, entry))
        for ino, entry in changed:
            got = fetched.get(entry.key)
            inode = txn.get_inode(ino)
            if (got is None or got.info is None or inode is None or txn.lookup(dir_ino, entry.name) != ino
                    or txn.get_pending(ino) is not None or ino in open_files):
                continue
            record = txn.get_remote(ino)
            same_content = (record is not None and record.blake3 and got.info.size == record.size
                            and got.info.metadata.get("blake3") == record.blake3)
            if same_content:
                self._set_attrs(inode, got.info, got.target)
                # A copy (a rename's, a chmod's on another node) may carry a new etag: the
                # content, and with it the cache file and the generation, stay.
                record.etag = got.info.etag
                txn.put_remote(ino, record)
                txn.put_inode(inode)
                seen.append((ino, entry.key))
                continue
            if inode.nlink > 1:
                # A hard link whose other names' copies are not known to differ: all its names
                # take the new content, as before (the old inode keeps its record's key).
                self._set_attrs(inode, got.info, got.target)
                durability.mark_remote_changed(txn, inode, self._record(entry.key, got.info))
                stale.append((ino, entry.key))
                continue
            # New content: to this node a new file at the name (a new inode number), as after
            # a rename over it. With the writeback cache the kernel keeps a cached regular
            # file's size and pages whatever GETATTR says; only a new inode is asked afresh.
            txn.remove_entry(dir_ino, entry.name)
            purge.append(self._drop_name(txn, inode))
            stale.append((self._add(txn, parent, entry, got.info, got.target), entry.key))
        for name, ino, key in plan.gone:
            purge += self._remove_if_gone(txn, parent, name, ino, key, fetched, present) or []
        txn.put_inode(parent)
        return purge, [(ino, key) for ino, key in stale if ino is not None], seen

    def _add_listed(self, txn: Txn, parent: Inode, entry: Listed, fetched: dict[str, Fetched]) -> int | None:
        """A listed entry becomes an inode under ``parent`` (nlink counted in ``parent``, which
        the caller puts); returns it, or None if it is not added."""
        got = fetched.get(entry.key)
        if entry.is_dir:
            info = got.info if got is not None else None
        elif got is None or got.info is None:
            return None  # deleted since the LIST, or its HEAD failed
        else:
            info = got.info
        if txn.lookup(parent.ino, entry.name) is not None or self._shadowed(txn, entry, set()):
            return None  # created or removed here meanwhile: the local change wins
        ino = self._add(txn, parent, entry, info, got.target if got is not None else b"")
        if entry.is_dir:
            parent.nlink += 1
        return ino

    def _remove_if_gone(self, txn: Txn, parent: Inode, name: bytes, ino: int, key: str,
                        fetched: dict[str, Fetched], present: dict[str, bool]) -> list[int] | None:
        """Drop the name ``parent/name`` of ``ino`` (a directory with its subtree) if the bucket
        confirmed ``key`` gone and it is still settled; returns the inodes to purge, or None
        if it stays (a listing that raced the drain's upload must not remove the upload)."""
        gone = not present.get(key, True) if key.endswith("/") else (
            key in fetched and fetched[key].info is None)
        inode = txn.get_inode(ino)
        if (not gone or inode is None or txn.lookup(parent.ino, name) != ino
                or not self._settled(txn, ino, inode)):
            return None
        purge = []
        if inode.is_dir:
            purge += self._remove_tree(txn, ino)
            parent.nlink -= 1
        txn.remove_entry(parent.ino, name)
        purge.append(self._drop_name(txn, inode))
        return purge

    def _split_link(self, txn: Txn, parent: Inode, ino: int, entry: Listed, fetched: dict[str, Fetched],
                    other_key: str | None, open_files: set[int]) -> int | None:
        """Another node replaced the object at one name of a hard-linked file: that name becomes
        a file of its own with the new object, and the local file keeps its other names (in
        the bucket, hard links are independent copies). ``other_key``: the name was the file's
        record, which moves to ``other_key`` if that object holds the file's content. Returns the
        new inode, or None if nothing was split."""
        got = fetched.get(entry.key)
        inode = txn.get_inode(ino)
        record = txn.get_remote(ino)
        if (got is None or got.info is None or inode is None or record is None
                or txn.lookup(parent.ino, entry.name) != ino or txn.get_pending(ino) is not None
                or ino in open_files):
            return None
        if record.blake3 and got.info.size == record.size and got.info.metadata.get("blake3") == record.blake3:
            # The same content (a copy with new metadata): nothing to split. At the record's key
            # the caller takes the new attributes and ETag; at another name, its ETag is ours.
            if other_key is None:
                record.link_etags[entry.key] = got.info.etag
                txn.put_remote(ino, record)
            return None
        if other_key is not None:
            held = fetched.get(other_key)
            if (held is None or held.info is None or not record.blake3 or held.info.size != record.size
                    or held.info.metadata.get("blake3") != record.blake3):
                return None
            record.link_etags.pop(other_key, None)
            record.key, record.etag, record.listed_modified_ns = other_key, held.info.etag, 0
        record.link_etags.pop(entry.key, None)
        txn.put_remote(ino, record)
        txn.remove_entry(parent.ino, entry.name)
        inode.nlink -= 1
        txn.put_inode(inode)
        return self._add(txn, parent, entry, got.info, got.target)

    def _drop_name(self, txn: Txn, inode: Inode) -> int:
        """One name of ``inode`` vanished from the bucket (not deleted here: no tombstone)."""
        if inode.is_dir:
            inode.nlink = 0
        else:
            inode.nlink -= 1
        if inode.nlink == 0:
            txn.delete_remote(inode.ino)
            txn.add_orphan(inode.ino)
        txn.put_inode(inode)
        return inode.ino

    def _remove_tree(self, txn: Txn, dir_ino: int) -> list[int]:
        removed = []
        for name, child in list(txn.iter_dir(dir_ino)):
            inode = txn.get_inode(child)
            if inode is None:
                continue
            if inode.is_dir:
                removed += self._remove_tree(txn, child)
            txn.remove_entry(dir_ino, name)
            removed.append(self._drop_name(txn, inode))
        return removed

    def _add(self, txn: Txn, parent: Inode, entry: Listed, info: ObjectInfo | None, target: bytes) -> int:
        inode = Inode(txn.alloc_ino(), DIR_MODE if entry.is_dir else FILE_MODE, self.uid, self.gid,
                      nlink=2 if entry.is_dir else 1, generation=1, parent=parent.ino,
                      state=FileState.DURABLE)
        inode.atime_ns = inode.mtime_ns = inode.ctime_ns = _ns(entry.modified if info is None else info.last_modified)
        if info is not None:
            self._set_attrs(inode, info, target)
        txn.put_inode(inode)
        txn.add_entry(parent.ino, entry.name, inode.ino)
        if not entry.is_dir:
            durability.mark_remote(txn, inode, self._record(entry.key, info))
        return inode.ino

    def _set_attrs(self, inode: Inode, info: ObjectInfo, target: bytes) -> None:
        """Attributes from the object's metadata (s3fs/rclone names), defaults where absent."""
        md = info.metadata
        default = DIR_MODE if inode.is_dir else FILE_MODE
        mode = parse_mode(md.get("mode"), default)
        if stat.S_ISDIR(mode) != inode.is_dir or (stat.S_ISLNK(mode) and not target):
            mode = stat.S_IFMT(default) | stat.S_IMODE(mode)  # the key decides file or directory
        inode.mode = mode
        inode.uid = _int_or(md.get("uid"), self.uid)
        inode.gid = _int_or(md.get("gid"), self.gid)
        mtime = parse_mtime_ns(md.get("mtime"))
        inode.mtime_ns = mtime if mtime is not None else _ns(info.last_modified)
        inode.atime_ns = inode.ctime_ns = inode.mtime_ns
        inode.rdev = _int_or(md.get("rdev"), 0) if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else 0
        if stat.S_ISLNK(mode):
            inode.target = target
            inode.size = len(target)
        elif stat.S_ISREG(mode):
            inode.size = info.size
        else:
            inode.size = 0

    @staticmethod
    def _record(key: str, info: ObjectInfo) -> RemoteRecord:
        return RemoteRecord(key, info.size, info.metadata.get("blake3", ""), 1, info.etag)


def entries_key(txn: Txn, dir_ino: int, name: bytes, is_dir: bool) -> str:
    base = txn.path_of(dir_ino) or b""
    rel = (base + b"/" + name if base else name).decode("utf-8", "surrogateescape")
    return rel + "/" if is_dir else rel


def hidden_objects(keys: Iterable[str]) -> list[tuple[str, str]]:
    """(key, why) of each object that no mount of the bucket shows, by the rules a listing
    follows (:meth:`RemoteNames._entries`): a component of its key that is not a name this
    filesystem takes (``a//b``, a name over 255 bytes, ``.ckptfs-x``), or a file whose name a
    directory of the same name takes (the keys ``a`` and ``a/b``: the directory wins). Other
    tools can write such keys; ckptfs never does. Keys relative to the mount's key prefix."""
    keys = list(keys)
    dirs = set()
    for key in keys:
        cut = key.find("/")
        while cut != -1:
            dirs.add(key[:cut + 1])
            cut = key.find("/", cut + 1)
    out = []
    for key in keys:
        is_marker = key.endswith("/")
        names = key[:-1].split("/") if is_marker else key.split("/")
        for name in names:
            raw = name.encode("utf-8", "surrogateescape")
            try:
                check_name(raw)
            except FsError as exc:
                shown = repr(name) if len(name) <= 40 else f"{name[:37]!r}... ({len(raw)} bytes)"
                out.append((key, f"its component {shown} is not a name the mount can show ({exc})"))
                break
        else:
            if not is_marker and key + "/" in dirs:
                out.append((key, f"a directory {key.rsplit('/', 1)[-1]!r} of the same name hides it "
                                 f"(keys below {key}/)"))
    return out

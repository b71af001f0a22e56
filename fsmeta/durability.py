"""The durability state machine of a file, and the questions asked of it.

Every change of a file's :class:`~ckptfs.fsmeta.records.FileState` is one of the named
transitions below, each run inside the caller's write transaction; the gateway and the
drain both call them, and nothing else assigns ``Inode.state``::

     create/write/truncate                     drain starts the upload      multipart complete,
  (new) ──mark_dirty──> DIRTY ────────────────mark_uploading────> UPLOADING ──mark_durable──> DURABLE
                          ^  ^                                      │ upload_superseded           │
                          │  └──────────────────────────────────────┘ (generation moved)          │
                          └──── mark_dirty / mark_needs_upload / mark_meta_changed ───────────────┘
                                    / mark_reupload_keeping_object (a rename cycle)
  REMOTE ──mark_cached_clean──> CACHED_CLEAN ──mark_evicted──> REMOTE      (the read path)
  (listing) ──mark_remote──> REMOTE;  REMOTE|CACHED_CLEAN|DURABLE ──mark_remote_changed──> REMOTE
                                      (the drain too, for a REMOTE file whose copy source was replaced)
  REMOTE ──mark_remote_lost──> (same, error RemoteObjectGone: its object vanished before a move)
  REMOTE + RemoteObjectGone ──mark_remote_changed──> REMOTE (a listing found an object at its name)
  any state ──mark_error──> (same state, plus a visible permanent error until the next success)
  REMOTE ──mark_remote_corrupt──> (same, error RemoteHashMismatch: fetched content failed its blake3)
  DIRTY ──mark_cache_lost──> (same, error CacheFileShort/CacheFileMissing: never uploaded until rewritten)

Alongside the state, an inode sits in the ``pending`` table whenever the bucket does
not match it yet (new data, a new name, new metadata): that table is the drain's work
queue, and "durable" means "not pending". ``generation`` moves before any byte changes,
so an upload commits only if the generation it read is still current.

The queries (:func:`state_label`, :func:`pending_under`, :func:`pending_keys`, ...) are
the one place that derives "is this durable / what is still pending under this path"
for ``user.ckptfs.state``, ``wait-durable``, ``status``, ``--fsync=remote`` and the
lifecycle engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import schema
from .records import FileState, Inode, PendingRecord, RemoteRecord
from .txn import Txn

# Why an inode is pending (PendingRecord.reason).
DATA = "data"  # its content is not in the bucket
RENAME = "rename"  # its content is, under another name (or a directory needs its marker)
META = "meta"  # its object's metadata (mode, uid, gid, mtime) must follow


def _queue(txn: Txn, ino: int, now_ns: int, reason: str) -> None:
    """Put ``ino`` on the drain's queue (or refresh its settle time if already there)."""
    rec = txn.get_pending(ino)
    if rec is None:
        rec = PendingRecord(since_ns=now_ns, changed_ns=now_ns, reason=reason)
    else:
        rec.changed_ns = now_ns
        # DATA > META > RENAME: a move that must also carry new metadata rewrites every key.
        if reason == DATA or (reason == META and rec.reason == RENAME):
            rec.reason = reason
    txn.put_pending(ino, rec)


# -- transitions -------------------------------------------------------------------------


def mark_dirty(txn: Txn, inode: Inode, now_ns: int) -> None:
    """Its content is about to change (first write of an epoch, truncate): new generation,
    DIRTY, queued. The caller stores ``inode`` afterwards."""
    inode.generation += 1
    inode.state = FileState.DIRTY
    txn.clear_error(inode.ino)
    _queue(txn, inode.ino, now_ns, DATA)


def mark_created(txn: Txn, inode: Inode, now_ns: int) -> None:
    """A new file or symlink (state DIRTY from birth): queue its first upload. (A new inode
    number has no record yet: no read of one, a read a create would always miss.)"""
    inode.state = FileState.DIRTY
    txn.put_pending(inode.ino, PendingRecord(since_ns=now_ns, changed_ns=now_ns, reason=DATA))


def mark_written(txn: Txn, ino: int, now_ns: int) -> None:
    """Its size and mtime were persisted (flush, fsync, close): restart the settle window."""
    _queue(txn, ino, now_ns, DATA)


def mark_moved(txn: Txn, ino: int, now_ns: int) -> None:
    """A new name (rename, link, unlink of another name) or a directory that needs its marker.

    The content state is unchanged: the drain copies a durable object to its new key
    instead of uploading it again.
    """
    _queue(txn, ino, now_ns, RENAME)


def mark_meta_changed(txn: Txn, inode: Inode, now_ns: int) -> None:
    """chmod, chown or utimes of a file, or of a directory that has a ``dir/`` marker object:
    the object's metadata must follow."""
    if inode.is_dir:
        if txn.get_remote(inode.ino) is not None:
            _queue(txn, inode.ino, now_ns, META)
        return
    _queue(txn, inode.ino, now_ns, META)
    if inode.state in (FileState.DURABLE, FileState.CACHED_CLEAN):
        inode.state = FileState.DIRTY


def request_urgent(txn: Txn, ino: int) -> None:
    """``--fsync=remote``: the drain should not wait for the file to be closed."""
    rec = txn.get_pending(ino)
    if rec is not None:
        rec.urgent = True
        txn.put_pending(ino, rec)


def mark_uploading(txn: Txn, ino: int, generation: int) -> None:
    """The drain starts uploading ``generation`` (only if that is still the current one)."""
    inode = txn.get_inode(ino)
    if inode is not None and inode.generation == generation and inode.state == FileState.DIRTY:
        inode.state = FileState.UPLOADING
        txn.put_inode(inode)


def upload_superseded(txn: Txn, inode: Inode) -> None:
    """An upload finished, but the content moved on meanwhile: back to DIRTY (still queued)."""
    if inode.state == FileState.UPLOADING:
        inode.state = FileState.DIRTY
        txn.put_inode(inode)


def mark_durable(txn: Txn, inode: Inode, generation: int, record: RemoteRecord) -> None:
    """The bucket holds ``generation`` at ``record.key``. Leaves the queue to the caller,
    which clears it only if nothing else (a rename, new metadata) is waiting.

    A REMOTE or CACHED_CLEAN file whose content did not change (a rename or new metadata,
    copied in the bucket) keeps its state: DURABLE would claim the cache holds it whole."""
    txn.put_remote(inode.ino, record)
    moved_only = inode.state in (FileState.REMOTE, FileState.CACHED_CLEAN) and inode.durable_generation == generation
    inode.durable_generation = generation
    if not moved_only:
        inode.state = FileState.DURABLE
    txn.put_inode(inode)
    txn.clear_error(inode.ino)


def mark_needs_upload(txn: Txn, inode: Inode, now_ns: int) -> None:
    """The bucket no longer has (or may no longer be used for) this content: upload it again."""
    txn.delete_remote(inode.ino)
    mark_reupload_keeping_object(txn, inode, now_ns)


def mark_reupload_keeping_object(txn: Txn, inode: Inode, now_ns: int) -> None:
    """A rename cycle: upload it again from the cache instead of copying its object. The
    object stays on record (``remote``, the owner of its key) until the new upload commits:
    it is still in the bucket, and a marker that vouches for it must leave before another
    inode's content replaces it."""
    inode.durable_generation = 0
    inode.state = FileState.DIRTY
    txn.put_inode(inode)
    _queue(txn, inode.ino, now_ns, DATA)


def mark_settled(txn: Txn, ino: int) -> None:
    """The bucket matches the inode: off the queue."""
    txn.clear_pending(ino)


def mark_error(txn: Txn, ino: int, code: str) -> None:
    """A permanent upload error: shown in ``user.ckptfs.state`` and ``status``; the data stays
    queued and is tried again later."""
    if txn.get_inode(ino) is not None:
        txn.set_error(ino, code)


# Permanent errors: the cache lost bytes fsmeta still counts (see fsmeta/recovery.py).
CACHE_FILE_SHORT = "CacheFileShort"
CACHE_FILE_MISSING = "CacheFileMissing"
CACHE_LOST_CODES = frozenset({CACHE_FILE_SHORT, CACHE_FILE_MISSING})


def mark_cache_lost(txn: Txn, ino: int, code: str) -> None:
    """Its cache file is shorter than (or missing for) the size fsmeta recorded: the content
    cannot be uploaded. A permanent, visible error; the drain skips the file until it is
    written again (``mark_dirty`` clears the error) or removed."""
    assert code in CACHE_LOST_CODES
    mark_error(txn, ino, code)


def is_cache_lost(txn: Txn, ino: int) -> bool:
    return txn.get_error(ino) in CACHE_LOST_CODES


def mark_remote(txn: Txn, inode: Inode, record: RemoteRecord) -> None:
    """Known from the bucket, content not in the cache (the read path)."""
    txn.put_remote(inode.ino, record)
    inode.durable_generation = inode.generation
    inode.state = FileState.REMOTE
    txn.put_inode(inode)


REMOTE_OBJECT_GONE = "RemoteObjectGone"


def mark_remote_lost(txn: Txn, inode: Inode) -> None:
    """A REMOTE file's object vanished from the bucket before the drain could copy it to a new
    name (deleted outside ckptfs): its content is nowhere. Off the queue, with a visible
    permanent error (uploading it from the cache is impossible: the cache never held it).
    Queued again later (renamed, chmod'ed): the drain takes it off again (:func:`is_remote_lost`)."""
    txn.delete_remote(inode.ino)
    txn.clear_pending(inode.ino)
    txn.set_error(inode.ino, REMOTE_OBJECT_GONE)


def is_remote_lost(txn: Txn, inode: Inode) -> bool:
    """A regular file whose content is nowhere: REMOTE (the cache holds none of it) with no
    object recorded (:func:`mark_remote_lost`). Nothing can be moved or uploaded for it until
    it is written again, removed, or a listing finds an object at its name."""
    return inode.is_reg and inode.state == FileState.REMOTE and txn.get_remote(inode.ino) is None


def mark_remote_changed(txn: Txn, inode: Inode, record: RemoteRecord) -> None:
    """Another node replaced the object of a settled file (REMOTE, CACHED_CLEAN or DURABLE), or
    of a REMOTE file whose rename or chmod the drain was about to copy (the cache holds nothing
    of the old content; its pending record stays), or put an object at the name of a file whose
    content was lost (RemoteObjectGone: cleared): a new generation, REMOTE again (the caller
    drops any cache file)."""
    if txn.get_error(inode.ino) == REMOTE_OBJECT_GONE:
        txn.clear_error(inode.ino)
    inode.generation += 1
    record.generation = inode.generation
    mark_remote(txn, inode, record)


def mark_cached_clean(txn: Txn, inode: Inode) -> None:
    """The whole content of a REMOTE file is now in the cache, equal to the bucket's (its
    blake3 checked where the object has one); clears an earlier read error."""
    if inode.state == FileState.REMOTE:
        inode.state = FileState.CACHED_CLEAN
        txn.put_inode(inode)
        txn.clear_error(inode.ino)


# Permanent error of the read path: the object's content does not match its x-amz-meta-blake3.
REMOTE_HASH_MISMATCH = "RemoteHashMismatch"


def mark_remote_corrupt(txn: Txn, inode: Inode) -> None:
    """A REMOTE file was fetched whole and its content does not match the object's blake3:
    it stays REMOTE (never cached-clean) with a visible error until a later fetch verifies."""
    if inode.state == FileState.REMOTE:
        mark_error(txn, inode.ino, REMOTE_HASH_MISMATCH)


def is_evictable(txn: Txn, inode: Inode) -> bool:
    """Its content is whole in the bucket and nothing local is waiting to go there: clean
    (CACHED_CLEAN, or DURABLE), not pending, no upload in flight, a bucket record to fetch
    it back from. (Open files are the gateway's to exclude: fsmeta does not know them.)"""
    return (inode.is_reg and inode.nlink > 0
            and inode.state in (FileState.CACHED_CLEAN, FileState.DURABLE)
            and txn.get_pending(inode.ino) is None and txn.get_upload(inode.ino) is None
            and txn.get_remote(inode.ino) is not None)


def mark_evicted(txn: Txn, inode: Inode) -> bool:
    """Its cache file is about to be dropped to free space; the bucket still has it.

    Returns whether the file was evictable: only then may the caller remove the cache file,
    after this transaction commits (a crash in between leaves a REMOTE file whose cache file
    is still there: never trusted as complete, removed by the next eviction or fetched over)."""
    if not is_evictable(txn, inode):
        return False
    inode.state = FileState.REMOTE
    txn.put_inode(inode)
    return True


# -- what the drain writes to the bucket ------------------------------------------------


def begin_bucket_writes(txn: Txn, ino: int, keys: list[str], *, multipart_key: str | None = None) -> None:
    """The drain is about to write ``keys`` for ``ino`` (PUT, multipart upload, copy).

    Each key gets a tombstone naming its writer, kept while ``ino`` is pending under that
    name (:func:`awaits_its_writer`) and cleared by :func:`end_bucket_writes`. If a crash
    loses the commit, the object (or a multipart upload of ``multipart_key`` whose id was
    never recorded) is still accounted for: once the name is gone, it is deleted (aborted).
    """
    for key in keys:
        txn.add_tombstone(key, writer=ino, multipart=key == multipart_key)


def end_bucket_writes(txn: Txn, ino: int, keys: list[str], live_keys: list[str], *,
                      keep_multipart: bool = False) -> None:
    """The writes of ``keys`` are committed (the bucket holds ``ino``'s content there): the
    intents of keys that are still its names go; a key renamed meanwhile becomes a plain
    tombstone (deleted unless it is live or a copy source again), and so does one whose
    unrecorded multipart uploads are still to abort (``keep_multipart``, or a recorded dead
    upload in it)."""
    for key in keys:
        rec = txn.get_tombstone(key)
        if rec is None or rec.get("writer") != ino:
            continue  # not ours (any more): e.g. the gateway's tombstone of an unlinked name
        if key in live_keys and not rec.get("upload_id") and not (keep_multipart and rec.get("multipart")):
            txn.remove_tombstone(key)
        else:
            txn.add_tombstone(key)  # (a recorded dead upload in it still gets aborted)


def moved_aside(txn: Txn, ino: int, old_key: str, record: RemoteRecord) -> bool:
    """The drain copied the file's object from ``old_key`` to ``record.key`` (a key outside
    the namespace, written under :func:`begin_bucket_writes`) to break a rename cycle: the
    file's content is now there, and ``old_key`` is free for the inode that needs it.

    False if the file changed meanwhile (another record, generation or no name): the copy
    is not recorded and its intent becomes a plain tombstone (deleted)."""
    inode = txn.get_inode(ino)
    remote = txn.get_remote(ino)
    if (inode is None or inode.nlink == 0 or remote is None or remote.key != old_key
            or remote.generation != record.generation or inode.durable_generation != record.generation):
        txn.add_tombstone(record.key)
        return False
    txn.put_remote(ino, record)
    txn.remove_tombstone(record.key)
    if txn.get_tombstone(old_key) is None:
        txn.add_tombstone(old_key)  # nobody's content now: overwritten if it is a name, else deleted
    return True


def drop_superseded_object(txn: Txn, inode: Inode) -> bool:
    """The file's recorded object holds content its cache has since replaced (it will be
    uploaded from the cache), and that object stands in the way of other inodes' moves that
    its own upload waits for (a file exchanged with a directory that holds files, both
    rewritten since): tombstone it now, not at the upload's commit, so it leaves first.
    The caller checked that the cache holds the file whole. False if nothing was dropped."""
    remote = txn.get_remote(inode.ino)
    if remote is None or inode.durable_generation == inode.generation or inode.state == FileState.REMOTE:
        return False
    txn.delete_remote(inode.ino)
    txn.add_tombstone(remote.key)
    return True


def awaits_its_writer(txn: Txn, key: str, rec: dict) -> bool:
    """A tombstone that is the intent of a write (:func:`begin_bucket_writes`) whose inode is
    still pending under ``key``: not a delete (yet); the inode's upload decides."""
    ino = rec.get("writer")
    if ino is None or txn.get_pending(ino) is None:
        return False
    inode = txn.get_inode(ino)
    if inode is None or inode.nlink == 0:
        return False
    if inode.is_dir:
        path = txn.path_of(ino)
        return path is not None and _decode(path) + "/" == key
    return any(_decode(p) == key for p in txn.paths_of(ino))


def mark_names_below_moved(txn: Txn, dir_ino: int, old_dir_key: str, now_ns: int) -> None:
    """The directory ``dir_ino`` leaves the name ``old_dir_key`` (rename, ``RENAME_EXCHANGE``).

    The drain moves each file's recorded object (``remote.key``) itself: it copies it to the
    new names, then tombstones that key. But a file's other names hold copies no record
    names (a second hard link, ``ln b c/x; mv c a``): each file below whose record is at
    another key gets a tombstone for its old path here, held until the file's new names are
    in the bucket (:func:`held_for_new_names`), so a reader never finds neither name.

    Not for a settled file with one name: when it settled, its one name was its record's
    key, and since then only renames of directories above it (which the bucket has not
    seen) changed its path, so nothing is at the old one. (A directory renamed twice before
    the drain moved it adds no tombstone per file.)"""
    for rel, child, inode in txn.iter_subtree_inodes(dir_ino):
        if inode is None or inode.is_dir:
            continue  # a directory's marker is its record: the drain moves it
        if inode.nlink == 1 and txn.get_pending(child) is None:
            continue
        remote = txn.get_remote(child)
        if remote is None:
            continue  # never in the bucket: nothing at its old path (an intent covers a write in flight)
        old_key = old_dir_key + "/" + _decode(rel)
        if remote.key != old_key:
            txn.add_tombstone(old_key, now_ns=now_ns, after=child)


def held_for_new_names(txn: Txn, rec: dict) -> bool:
    """A tombstone of an old name (:func:`mark_names_below_moved`) whose file still has names
    to write (it, or a renamed directory above it, is pending): not deleted yet."""
    ino = rec.get("after")
    if ino is None:
        return False
    inode = txn.get_inode(ino)
    return inode is not None and inode.nlink > 0 and pending_at_or_above(txn, ino)


def release_held_in_the_way(txn: Txn, keys: list[str]) -> None:
    """Writing ``keys`` waits for objects of their other shape to leave
    (:func:`key_shape_in_flux`): an old name held for its file's new names
    (:func:`held_for_new_names`) is deleted now instead, since that file's own move may wait
    for the very write that waits for it (``RENAME_EXCHANGE`` of a file and a directory
    holding a second link)."""
    for key in keys:
        for other in list(_other_shape_tombstones(txn, key)):
            rec = txn.get_tombstone(other)
            if rec is not None and rec.get("after") is not None:
                txn.add_tombstone(other, now_ns=rec.get("since_ns"))


def key_shape_in_flux(txn: Txn, key: str) -> bool:
    """The bucket still holds ``key``'s other shape, on its way out: objects below ``key/``
    (``mv b c; mv f b``: ``b/x`` until it has moved) or a file object at a directory above
    ``key`` (``mv a c; mv d a``: ``a`` until it has moved). A ``file://`` bucket cannot hold
    both shapes; an S3 reader would see a file and a directory of one name. The writer of
    ``key`` waits until they are gone (deleted, or moved to their inode's name)."""
    return next(_other_shape_leaving(txn, key), False) is not False


def shape_blockers(txn: Txn, key: str) -> set[int]:
    """The inodes whose objects make :func:`key_shape_in_flux` true for ``key`` (objects that
    will move; a tombstoned object has no owner)."""
    return {owner for owner in _other_shape_leaving(txn, key) if owner is not None}


def _other_shape_leaving(txn: Txn, key: str) -> Iterator[int | None]:
    """The owner (None: a tombstone) of each object of ``key``'s other shape on its way out."""
    base = key.rstrip("/")

    def leaving(k: str, owner: int) -> bool:
        return all(_decode(p) != k for p in txn.paths_of(owner))

    yield from (None for _ in _other_shape_tombstones(txn, key))
    if not key.endswith("/"):  # (a directory's marker ``d/`` and the objects below it coexist)
        yield from (owner for k, owner in txn.remote_keys_below(base + "/") if leaving(k, owner))
    else:  # a directory's marker ``d/``: a file object ``d`` on its way out (RENAME_EXCHANGE)
        owner = txn.owner_of_remote_key(base)
        if owner is not None and leaving(base, owner):
            yield owner
    for above in _keys_above(base):
        owner = txn.owner_of_remote_key(above)
        if owner is not None and leaving(above, owner):
            yield owner


def _other_shape_tombstones(txn: Txn, key: str) -> Iterator[str]:
    """The tombstoned keys of ``key``'s other shape: below ``key/`` (for a file's key), the
    file object ``d`` (for a marker ``d/``), and any file object at a directory above."""
    base = key.rstrip("/")
    if not key.endswith("/"):
        yield from (k for k, _ in txn.tombstones_below(base + "/"))
    elif txn.get_tombstone(base) is not None:
        yield base
    yield from (above for above in _keys_above(base) if txn.get_tombstone(above) is not None)


def _keys_above(base: str) -> Iterator[str]:
    parts = base.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


# -- queries -----------------------------------------------------------------------------


def is_durable(txn: Txn, ino: int) -> bool:
    """The bucket matches this inode (and, for a directory, everything below it)."""
    if txn.get_pending(ino) is not None:
        return False
    return all(txn.get_pending(child) is None for _, child in txn.iter_subtree(ino))


def state_label(txn: Txn, inode: Inode) -> str:
    """What ``user.ckptfs.state`` shows: ``dirty|uploading|durable|remote|error: CODE``."""
    if inode.is_dir:
        return "durable" if is_durable(txn, inode.ino) else "dirty"
    error = txn.get_error(inode.ino)
    if error:
        return f"error: {error}"
    if txn.get_pending(inode.ino) is not None:
        return "uploading" if txn.get_upload(inode.ino) is not None else "dirty"
    return inode.state.label


def remote_fsync_state(txn: Txn, ino: int) -> str | None:
    """For ``--fsync=remote``: "durable", a permanent error code, or None (keep waiting).
    A file unlinked while open has no name to put in the bucket (the drain never uploads
    it): the local fsync was the whole answer."""
    inode = txn.get_inode(ino)
    if txn.get_pending(ino) is None or inode is None or inode.nlink == 0:
        return "durable"
    return txn.get_error(ino)


@dataclass
class Backlog:
    files: list = field(default_factory=list)  # (path, bytes, state)
    deletes: list = field(default_factory=list)  # bucket keys still to delete
    bytes: int = 0
    errors: dict = field(default_factory=dict)  # path -> error
    oldest_since_ns: int | None = None  # when the longest-waiting entry became pending

    @property
    def empty(self) -> bool:
        return not self.files and not self.deletes


@dataclass(frozen=True)
class BacklogSummary:
    files: int
    bytes: int
    oldest_since_ns: int | None

    def oldest_age_seconds(self, now_ns: int | None = None) -> float | None:
        if self.oldest_since_ns is None:
            return None
        return max(0.0, ((now_ns or time.time_ns()) - self.oldest_since_ns) / 1e9)


def _skip(key: object, exc: Exception) -> None:
    pass


def backlog_summary(txn: Txn) -> BacklogSummary:
    """Pending entries, bytes to upload and the oldest pending time of the whole cache, from
    the queue alone (cheap enough for every metrics scrape)."""
    files = size = 0
    oldest = None
    # (a record that does not decode is the drain's to report: ckptfs status shows its error)
    for ino, rec in txn.iter_pending(on_unreadable=_skip):
        inode = txn.get_inode(ino)
        if inode is None:
            continue
        files += 1
        if inode.is_reg and not (rec.reason != DATA and inode.durable_generation == inode.generation):
            size += inode.size
        if oldest is None or rec.since_ns < oldest:
            oldest = rec.since_ns
    return BacklogSummary(files, size, oldest)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def pending_at_or_above(txn: Txn, ino: int) -> bool:
    """``ino`` or a directory above it is pending (e.g. renamed, its objects not moved yet)."""
    return txn.get_pending(ino) is not None or pending_ancestor(txn, ino)


def pending_ancestor(txn: Txn, ino: int) -> bool:
    """A directory above ``ino`` is pending (renamed, not yet expanded by the drain)."""
    inode = txn.get_inode(ino)
    if inode is None or inode.is_dir:
        return _pending_dir_above(txn, inode)
    # A file's ``parent`` is its first link's parent when it was made: renames do not keep
    # it (the schema promises it only for directories). Its links say where it is now.
    return any(_pending_dir_above(txn, txn.get_inode(parent), itself=True) for parent, _ in txn.links_of(ino))


def _pending_dir_above(txn: Txn, cur, *, itself: bool = False) -> bool:
    """A directory above ``cur`` (and, with ``itself``, ``cur``) is pending."""
    if itself and cur is not None and cur.ino != schema.ROOT_INO and txn.get_pending(cur.ino) is not None:
        return True
    while cur is not None and cur.ino != schema.ROOT_INO:
        parent = txn.get_inode(cur.parent)
        if parent is None:
            return False
        if parent.ino != schema.ROOT_INO and txn.get_pending(parent.ino) is not None:
            return True
        cur = parent
    return False


def pending_under(txn: Txn, rel: str) -> Backlog:
    """Pending uploads, moves and deletes at or below ``rel`` (relative path, "" = all)."""
    out = Backlog()
    prefix = rel + "/" if rel else ""
    in_flight = {}
    status = txn.get_drain_status() or {}
    for ino, progress in (status.get("in_flight") or {}).items():
        in_flight[int(ino)] = progress.get("done", 0)
    ino = txn.resolve(rel.encode("utf-8", "surrogateescape")) if rel else schema.ROOT_INO
    if ino is not None:
        ancestors_pending = bool(rel) and pending_ancestor(txn, ino)
        inode = txn.get_inode(ino)
        items = [(rel, ino)]
        if inode is not None and inode.is_dir:
            items += [(prefix + _decode(p), c) for p, c in txn.iter_subtree(ino)]
        for path, child in items:
            child_inode = txn.get_inode(child)
            if child_inode is None:
                continue
            pending = txn.get_pending(child)
            if pending is None and not ancestors_pending:
                continue
            if pending is not None and (out.oldest_since_ns is None or pending.since_ns < out.oldest_since_ns):
                out.oldest_since_ns = pending.since_ns
            size = child_inode.size if child_inode.is_reg else 0
            if (pending is not None and pending.reason != DATA
                    and child_inode.durable_generation == child_inode.generation):
                size = 0  # a move: copied in the bucket, not uploaded
            size = max(0, size - in_flight.get(child, 0))
            error = txn.get_error(child)
            state = f"error: {error}" if error else ("uploading" if txn.get_upload(child) else "dirty")
            if error:
                out.errors[path or "/"] = error
            out.files.append((path or "/", size, state))
            out.bytes += size
    for key, rec in txn.iter_tombstones():
        if awaits_its_writer(txn, key, rec):
            continue  # the key of a pending file's write in flight: that file is listed
        if not rel or key == rel or key.startswith(prefix):
            out.deletes.append(key)
            since = rec.get("since_ns")
            if since is not None and (out.oldest_since_ns is None or since < out.oldest_since_ns):
                out.oldest_since_ns = since
    return out


@dataclass(frozen=True)
class FileStatus:
    """Where one file stands, for ``status --by-checkpoint``."""

    path: str
    size: int
    mtime_ns: int
    state: str  # dirty | uploading | durable | remote | error
    error: str | None
    pending_since_ns: int | None  # when it became pending; None when settled
    bytes_to_upload: int  # 0 for a file that only moves in the bucket


def file_states(txn: Txn) -> list[FileStatus]:
    """Every regular file and symlink of the namespace with its state (one read transaction).

    A file below a pending directory (a rename not yet expanded by the drain) is pending
    too: its object still sits under the old name.
    """
    out: list[FileStatus] = []
    stack: list[tuple[int, str, int | None]] = [(schema.ROOT_INO, "", None)]
    while stack:
        dir_ino, base, inherited_since = stack.pop()
        for name, child in txn.iter_dir(dir_ino):
            inode = txn.get_inode(child)
            if inode is None:
                continue
            path = base + _decode(name)
            pending = txn.get_pending(child)
            since = pending.since_ns if pending is not None else inherited_since
            if inode.is_dir:
                stack.append((child, path + "/", since))
                continue
            error = txn.get_error(child)
            if error:
                state = "error"
            elif since is None:
                state = inode.state.label
            else:
                state = "uploading" if txn.get_upload(child) is not None else "dirty"
            moving = pending is None or (pending.reason != DATA
                                         and inode.durable_generation == inode.generation)
            to_upload = 0 if since is None or moving or not inode.is_reg else inode.size
            out.append(FileStatus(path, inode.size, inode.mtime_ns, state, error, since, to_upload))
    return out


def pending_keys(txn: Txn) -> set[str]:
    """Every bucket key (relative to the prefix) the local cache has not settled yet.

    Pending files (every hard-link name) and directories (``path/``, which covers
    everything below), the objects pending inodes still have their content at (sources
    of renames not yet copied, also below a pending directory), in-flight multipart
    uploads and queued deletes. The lifecycle engine never touches these.
    """
    keys: set[str] = set()

    def add_remote(ino: int) -> None:
        remote = txn.get_remote(ino)
        if remote is not None and remote.key:
            keys.add(remote.key)

    for ino in txn.pending_inos():
        inode = txn.get_inode(ino)
        if inode is None:
            continue
        add_remote(ino)
        if inode.is_dir:
            path = txn.path_of(ino)
            if path is not None:
                keys.add(_decode(path) + "/")
            # A renamed directory is expanded by the drain later: until then its
            # subtree's objects are copy sources under their old keys.
            for _, child in txn.iter_subtree(ino):
                add_remote(child)
        else:
            keys.update(_decode(p) for p in txn.paths_of(ino))
    for _, upload in txn.iter_uploads():
        keys.add(upload.key)
    for key, _ in txn.iter_tombstones():
        keys.add(key)
    return keys


def drop_dir_markers(txn: Txn, ino: int, marker: str, now_ns: int) -> None:
    """A directory is removed (rmdir, or a rename over it): its marker object at its current
    name (``marker``, ``dir/``) goes, and so does the one its record names when that is an old
    key (it, or a directory above it, was renamed and the drain has not moved the marker yet),
    or nothing would ever delete that object and listings would show the removed directory
    again under its old name. The record goes too: the marker protects nothing any more."""
    txn.add_tombstone(marker, now_ns=now_ns)
    remote = txn.get_remote(ino)
    if remote is not None:
        if remote.key != marker:
            txn.add_tombstone(remote.key, now_ns=now_ns)
        txn.delete_remote(ino)

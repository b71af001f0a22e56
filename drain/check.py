"""The bucket against fsmeta, for ``ckptfs fsck --bucket`` (the local checks: :mod:`ckptfs.fsmeta.check`).

What fsmeta says is durable must be in the bucket with the content hash it recorded, and an
empty directory it holds as settled must show there (its ``dir/`` marker); what it
tombstoned should be gone (the drain deletes it, so that is only reported); a multipart upload
that neither an upload record nor a tombstone names will never be completed or aborted by
anyone (it costs storage until a bucket lifecycle rule expires it). Objects under keys that
no mount shows (:data:`HIDDEN_OBJECT`) are found by the CLI, which knows the mount's naming
rules (``ckptfs.gateway.listing.hidden_objects``).

Reads fsmeta in short transactions and never holds one across a store request.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import blake3

from ckptfs.fsmeta import ROOT_INO, FileState, MetaStore, durability
from ckptfs.fsmeta.check import Finding
from ckptfs.fsmeta.layout import CacheDir

from .store import MOVING_PREFIX, ObjectStore

MISSING_OBJECT = "missing-object"  # durable per fsmeta, not in the bucket
MISSING_MARKER = "missing-marker"  # a settled empty directory with no ``dir/`` marker: other nodes miss it
DIFFERENT_OBJECT = "different-object"  # in the bucket with another blake3 than fsmeta recorded
TOMBSTONED_OBJECT = "tombstoned-object"  # queued for deletion, still there (informational)
UNRECORDED_UPLOAD = "unrecorded-upload"  # an open multipart upload nobody records
STRAY_PARKED_OBJECT = "stray-parked-object"  # below MOVING_PREFIX, neither a file's content nor queued for deletion
HIDDEN_OBJECT = "hidden-object"  # under a key no mount shows (written by another tool; informational)

#: Kinds that are reported only: the drain resolves them on its own (tombstoned), or they are
#: no fault of the cache and nothing ckptfs does changes them (hidden).
INFORMATIONAL = frozenset({TOMBSTONED_OBJECT, HIDDEN_OBJECT})


@dataclass
class _Durable:
    ino: int
    path: str | None
    key: str
    blake3: str
    size: int
    generation: int
    in_cache: bool  # state says the cache holds the content (DURABLE/CACHED_CLEAN)


def _durable_files(meta: MetaStore) -> list[_Durable]:
    out = []
    with meta.read() as txn:
        for inode in txn.iter_inodes():
            if not inode.is_reg or txn.get_pending(inode.ino) is not None:
                continue
            remote = txn.get_remote(inode.ino)
            if remote is None:
                continue
            paths = txn.paths_of(inode.ino)
            out.append(_Durable(inode.ino, paths[0].decode("utf-8", "surrogateescape") if paths else None,
                                remote.key, remote.blake3, inode.size, inode.generation,
                                inode.state in (FileState.DURABLE, FileState.CACHED_CLEAN)))
    return out


def _settled_empty_dirs(meta: MetaStore) -> list[tuple[int, str]]:
    """(inode, ``path/``) of each empty directory below the root that nothing of the drain's
    queue concerns (not pending, no pending directory above it): the bucket shows it only by
    its marker."""
    out = []
    with meta.read() as txn:
        for inode in txn.iter_inodes():
            if (not inode.is_dir or inode.ino == ROOT_INO or inode.nlink == 0
                    or not txn.dir_is_empty(inode.ino) or durability.pending_at_or_above(txn, inode.ino)):
                continue
            path = txn.path_of(inode.ino)
            if path:
                out.append((inode.ino, path.decode("utf-8", "surrogateescape") + "/"))
    return out


def _cache_holds(cache: CacheDir, item: _Durable) -> bool:
    """The cache file has exactly the content fsmeta recorded as durable."""
    if not item.in_cache:
        return False
    path = cache.data_path(item.ino)
    try:
        if os.stat(path).st_size != item.size:
            return False
        if not item.blake3:
            return True
        hasher = blake3.blake3()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                hasher.update(block)
        return hasher.hexdigest() == item.blake3
    except FileNotFoundError:
        return False


async def bucket_findings(cache: CacheDir, meta: MetaStore, store: ObjectStore) -> list[Finding]:
    """Compare the bucket with fsmeta. ``Finding.repairable`` marks what :func:`repair` can fix."""
    findings: list[Finding] = []
    for item in _durable_files(meta):
        info = await store.head(item.key)
        if info is None:
            kind, detail = MISSING_OBJECT, "durable in fsmeta, missing from the bucket"
        elif item.blake3 and info.metadata.get("blake3") not in (None, item.blake3):
            kind, detail = DIFFERENT_OBJECT, (f"bucket blake3 {info.metadata.get('blake3')} != "
                                              f"recorded {item.blake3}")
        else:
            continue
        repairable = _cache_holds(cache, item)
        if not repairable:
            detail += "; the cache does not hold the content either (re-upload impossible)"
        findings.append(Finding(kind, detail, path=item.path, key=item.key, ino=item.ino, repairable=repairable))
    for ino, key in _settled_empty_dirs(meta):
        # Anything at or below ``key/`` shows the directory (objects that fsmeta has not
        # listed yet count too).
        if not await store.holds_any(key):
            findings.append(Finding(MISSING_MARKER, "an empty directory, settled in fsmeta, has no marker "
                                    "in the bucket: other nodes do not see it", path=key[:-1], key=key,
                                    ino=ino, repairable=True))
    with meta.read() as txn:
        # (a key the drain is writing for a file still pending under it is not a delete)
        all_tombstones = list(txn.iter_tombstones())
        tombstones = {key: rec for key, rec in all_tombstones if not durability.awaits_its_writer(txn, key, rec)}
        recorded = {rec.upload_id for _, rec in txn.iter_uploads()}
    recorded |= {rec["upload_id"] for _, rec in all_tombstones if rec.get("upload_id")}
    for key in sorted(tombstones):
        if key.endswith("/") or tombstones[key].get("upload_id"):
            continue  # markers: cheap, and the drain deletes them; uploads: below
        if await store.head(key) is not None:
            findings.append(Finding(TOMBSTONED_OBJECT, "queued for deletion; the drain deletes it", key=key))
    for upload in await store.list_multipart_uploads(""):
        if upload.upload_id not in recorded:
            findings.append(_upload_finding(upload))
    parked = [obj.key for obj in (await store.list(MOVING_PREFIX)).objects]
    with meta.read() as txn:
        # (the drain writes the intent tombstone before the copy, the record before dropping it)
        stray = [k for k in parked if txn.owner_of_remote_key(k) is None and txn.get_tombstone(k) is None]
    findings.extend(Finding(STRAY_PARKED_OBJECT, "parked by the drain to break a rename cycle; no file records it "
                            "(a copy nobody needs)", key=key, repairable=True) for key in stray)
    return findings


def _upload_finding(upload) -> Finding:
    return Finding(UNRECORDED_UPLOAD,
                   f"multipart upload started {upload.initiated:%Y-%m-%d %H:%M:%S} UTC; "
                   "no upload record or tombstone names it", key=upload.key, upload_id=upload.upload_id,
                   repairable=True)


async def repair(finding: Finding, meta: MetaStore, store: ObjectStore) -> bool:
    """Fix one repairable bucket finding; True when done."""
    if finding.kind == UNRECORDED_UPLOAD:
        await store.abort_multipart(finding.key, finding.upload_id)
        return True
    if finding.kind == STRAY_PARKED_OBJECT:
        await store.delete(finding.key)
        return True
    if finding.kind in (MISSING_OBJECT, DIFFERENT_OBJECT) and finding.ino is not None:
        def requeue(txn) -> bool:
            inode = txn.get_inode(finding.ino)
            if inode is None or txn.get_pending(inode.ino) is not None:
                return False  # changed meanwhile: the drain has it
            durability.mark_needs_upload(txn, inode, time.time_ns())
            return True

        return meta.write(requeue)
    if finding.kind == MISSING_MARKER and finding.ino is not None:
        def requeue_dir(txn) -> bool:
            inode = txn.get_inode(finding.ino)
            if inode is None or inode.nlink == 0 or txn.get_pending(inode.ino) is not None:
                return False  # changed meanwhile: the drain has it
            if txn.get_remote(inode.ino) is not None:
                durability.mark_meta_changed(txn, inode, time.time_ns())  # puts the recorded marker again
            else:
                durability.mark_moved(txn, inode.ino, time.time_ns())  # needs its marker
            return True

        return meta.write(requeue_dir)
    return False

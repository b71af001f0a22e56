"""Cluster commit: which directories this node holds files of that the bucket lacks.

A checkpoint written from many nodes is complete in the bucket only when every node's part
is. Each node says, in the bucket, which directories it holds pending files of: an
*in-flight record*, a small object at

    .ckptfs-inflight/<directory path>/.ckptfs-node-<node>-<run>-<seq>

put before the request that made the first such file pending in that directory returns,
and deleted by the drain once no file of that directory is pending on this node. A commit
marker's drain lists the records under its directory and waits while another node's
exists (``drain/worker.py``). S3's read-after-write consistency orders a record before any
marker closed after the framework's barrier.

This module holds the records' state in fsmeta (the ``inflight`` table, one entry per
directory inode) and every transition of it:

    (none) --needs_records--> PUBLISHING --published--> PUBLISHED
    PUBLISHED --removing (no file of the directory pending)--> REMOVING --removed--> (none)
    REMOVING --needs_records (a file pending there again)--> PUBLISHING (next seq)

Each publication has its own key (``seq``), so a delete in flight never removes a newer
record of the same directory. Markers themselves publish no record: two markers of one
directory never wait for each other (the one-node rule), here across nodes.

The node is its cache: ``node_id`` is made once per cache directory. While it holds records,
its drain puts ``.ckptfs-inflight/.ckptfs-node-<node>-heartbeat`` every ``node_timeout / 4``;
a node whose records hold a marker and whose heartbeat is older than ``node_timeout`` shows
as lost (its records still hold the marker: its part of the checkpoint is nowhere else). ``run`` names one
gateway run, so that a record a crashed run put but never committed (the put happens
before the batch that recorded it commits) is found and deleted at the next start.
"""

from __future__ import annotations

import posixpath
import secrets
from dataclasses import dataclass

from .records import InflightRecord, RecordState
from .settings import is_marker_name
from .txn import Txn

INFLIGHT_PREFIX = ".ckptfs-inflight/"
RECORD_LEAF_PREFIX = ".ckptfs-node-"
KEY_MAX = 1024


@dataclass(frozen=True)
class Publication:
    """A record the gateway must put before the request that needed it returns."""

    dir_ino: int
    seq: int
    key: str


def ensure_node_id(txn: Txn) -> str:
    """This cache's node id, made at its first use."""
    node = txn.get_node_id()
    if node is None:
        node = secrets.token_hex(8)
        txn.put_node_id(node)
    return node


def record_key(dir_path: str, node: str, run: str, seq: int) -> str:
    """The key of a record of ``dir_path``; a directory too deep for the key to fit takes the
    deepest ancestor whose key does (a marker below it then waits for it too: conservative)."""
    leaf = f"{RECORD_LEAF_PREFIX}{node}-{run}-{seq}"
    path = dir_path
    while True:
        key = INFLIGHT_PREFIX + (path + "/" if path else "") + leaf
        if len(key.encode()) <= KEY_MAX or not path:
            return key
        path = posixpath.dirname(path)


def heartbeat_key(node: str) -> str:
    """Where a node that holds records says it is alive (its LastModified is the beat)."""
    return f"{INFLIGHT_PREFIX}{RECORD_LEAF_PREFIX}{node}-heartbeat"


def parse_record_key(key: str) -> tuple[str, str, str, int] | None:
    """(directory path, node, run, seq) of a record key, or None if it is not one."""
    if not key.startswith(INFLIGHT_PREFIX):
        return None
    directory, _, leaf = key[len(INFLIGHT_PREFIX):].rpartition("/")
    if not leaf.startswith(RECORD_LEAF_PREFIX):
        return None
    parts = leaf[len(RECORD_LEAF_PREFIX):].split("-")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return directory, parts[0], parts[1], int(parts[2])


def records_prefix(dir_path: str) -> str:
    """The listing prefix of every record at or below ``dir_path`` (the deepest fitting
    ancestor's, for a directory too deep: see :func:`record_key`)."""
    key = record_key(dir_path, "0" * 16, "0" * 8, 0)
    return key.rpartition("/")[0] + "/" if "/" in key[len(INFLIGHT_PREFIX):] else INFLIGHT_PREFIX


def needs_records(txn: Txn, node: str, run: str, markers: tuple[str, ...]) -> list[Publication]:
    """In the write transaction that queued ``txn.queued`` for the drain: the directories of
    those files that have no record in the bucket yet, each moved to PUBLISHING here (the
    caller puts them before its request returns). A directory already PUBLISHING is returned
    too: a record another request is putting, or whose put failed, is not known to be there."""
    dirs: set[int] = set()
    for ino in set(txn.queued):
        if not txn.is_pending(ino):
            continue
        for parent, name in txn.links_of(ino):
            inode = None
            if is_marker_name(name.decode("utf-8", "surrogateescape"), markers):
                inode = txn.get_inode(ino)
                if inode is not None and not inode.is_dir:
                    continue  # a marker waits for the others; it holds nobody
            dirs.add(parent)
    out = []
    for dir_ino in sorted(dirs):
        rec = txn.get_inflight(dir_ino)
        if rec is not None and rec.state == RecordState.PUBLISHED:
            continue
        if rec is None or rec.state == RecordState.REMOVING:
            path = txn.path_of(dir_ino)
            if path is None:
                continue
            seq = txn.next_inflight_seq()
            rec = InflightRecord(seq, record_key(path.decode("utf-8", "surrogateescape"), node, run, seq),
                                 RecordState.PUBLISHING)
            txn.put_inflight(dir_ino, rec)
        out.append(Publication(dir_ino, rec.seq, rec.key))
    return out


def published(txn: Txn, pub: Publication) -> None:
    rec = txn.get_inflight(pub.dir_ino)
    if rec is not None and rec.seq == pub.seq and rec.state == RecordState.PUBLISHING:
        rec.state = RecordState.PUBLISHED
        txn.put_inflight(pub.dir_ino, rec)


def unpublished(txn: Txn) -> list[Publication]:
    """Records still to put (a put that failed, or a run that crashed before putting)."""
    return [Publication(d, r.seq, r.key) for d, r in txn.iter_inflight() if r.state == RecordState.PUBLISHING]


def dirs_with_pending_files(txn: Txn) -> set[int]:
    """The directories that hold (by any name) a pending inode."""
    out = set()
    for ino in txn.pending_inos():
        out.update(parent for parent, _ in txn.links_of(ino))
    return out


def removable(txn: Txn) -> list[Publication]:
    """PUBLISHED records of directories with nothing pending on this node any more."""
    busy = dirs_with_pending_files(txn)
    return [Publication(d, r.seq, r.key) for d, r in txn.iter_inflight()
            if r.state == RecordState.PUBLISHED and d not in busy]


def removing(txn: Txn, pub: Publication) -> bool:
    """Move a record to REMOVING if it is still that record and its directory still has
    nothing pending (checked in this transaction): True if the caller may delete it."""
    rec = txn.get_inflight(pub.dir_ino)
    if rec is None or rec.seq != pub.seq or rec.state != RecordState.PUBLISHED:
        return False
    if any(txn.is_pending(child) for _, child in txn.iter_dir(pub.dir_ino)):
        return False
    rec.state = RecordState.REMOVING
    txn.put_inflight(pub.dir_ino, rec)
    return True


def removed(txn: Txn, pub: Publication) -> None:
    rec = txn.get_inflight(pub.dir_ino)
    if rec is not None and rec.seq == pub.seq and rec.state == RecordState.REMOVING:
        txn.delete_inflight(pub.dir_ino)


def removal_in_flight(txn: Txn) -> list[Publication]:
    """REMOVING records (a drain that stopped between marking and deleting one)."""
    return [Publication(d, r.seq, r.key) for d, r in txn.iter_inflight() if r.state == RecordState.REMOVING]


def known_keys(txn: Txn) -> set[str]:
    return {r.key for _, r in txn.iter_inflight()}


__all__ = [
    "INFLIGHT_PREFIX", "InflightRecord", "Publication", "RecordState", "ensure_node_id", "needs_records",
    "parse_record_key", "published", "record_key", "records_prefix", "removable", "removal_in_flight",
    "removed", "removing", "unpublished", "known_keys", "dirs_with_pending_files",
]

"""The drain's side of cluster commit (fsmeta/cluster.py says what a record is).

Two jobs:

* :meth:`ClusterCommit.holders` — before a commit marker goes out, the other nodes whose
  in-flight records lie at or below the marker's directory: while there is one, the marker
  waits (a checkpoint written from many nodes is complete in the bucket before its marker is);
* :meth:`ClusterCommit.remove_done` — delete this node's records of directories where nothing
  is pending any more, so that other nodes' markers may go.

Every fsmeta access runs in a worker thread; no transaction spans an ``await``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import posixpath
import socket
import time
from dataclasses import dataclass, field

from ckptfs.fsmeta import cluster

from .store import ObjectStore, StoreError

log = logging.getLogger("ckptfs.drain")


@dataclass
class HeldMarker:
    nodes: list[str]
    since_ns: int = field(default_factory=time.time_ns)
    lost: dict[str, float] = field(default_factory=dict)  # node -> UTC seconds of its last sign of life


async def other_nodes_under(store: ObjectStore, rel: str, node: str | None) -> list[str]:
    """The nodes other than ``node`` with in-flight records at or below the directory ``rel``."""
    return sorted(await _records_by_node(store, rel, node))


async def _records_by_node(store: ObjectStore, rel: str, node: str | None) -> dict[str, float]:
    """Other nodes with records at or below ``rel`` -> the newest LastModified (UTC seconds)."""
    nodes: dict[str, float] = {}
    for obj in (await store.list(cluster.records_prefix(rel))).objects:
        parsed = cluster.parse_record_key(obj.key)
        if parsed is not None and parsed[1] != node:
            nodes[parsed[1]] = max(nodes.get(parsed[1], 0.0), obj.last_modified.timestamp())
    return nodes


def _holds_records(txn) -> bool:
    return next(txn.iter_inflight(), None) is not None


class ClusterCommit:
    """``read(fn, *args)``/``write(fn, *args)``: the drain's fsmeta access (worker threads)."""

    def __init__(self, store: ObjectStore, *, read, write, node_timeout: float, clock=time.time):
        self.store = store
        self._read = read
        self._write = write
        self.node_timeout = node_timeout
        self.clock = clock
        self.node: str | None = None
        self.held: dict[str, HeldMarker] = {}  # marker path -> the nodes it waits for
        self.next_beat = 0.0
        # This run put a heartbeat that is still in the bucket. (One a crashed run left stays
        # until this node holds records again: old, it tells nobody anything.)
        self.beating = False

    async def start(self) -> None:
        self.node = await self._write(cluster.ensure_node_id)
        # A drain stopped between marking a record REMOVING and deleting it: delete it now.
        for pub in await self._read(cluster.removal_in_flight):
            await self._delete(pub)

    # -- markers ---------------------------------------------------------------------------

    async def holders(self, marker_keys: list[str]) -> dict[str, float]:
        """The other nodes whose records hold back a marker at any of ``marker_keys`` -> the
        newest of their records' LastModified."""
        nodes: dict[str, float] = {}
        for directory in {posixpath.dirname(k) for k in marker_keys}:
            for node, seen in (await _records_by_node(self.store, directory, self.node)).items():
                nodes[node] = max(nodes.get(node, 0.0), seen)
        return nodes

    async def lost(self, holders: dict[str, float]) -> dict[str, float]:
        """Those of ``holders`` with no sign of life (heartbeat, or a record put) for
        ``node_timeout`` -> when they were last seen (UTC seconds)."""
        out = {}
        for node, record_seen in holders.items():
            beat = await self.store.head(cluster.heartbeat_key(node))
            seen = max(record_seen, beat.last_modified.timestamp() if beat is not None else 0.0)
            if self.clock() - seen > self.node_timeout:
                out[node] = seen
        return out

    def note_held(self, path: str, nodes: list[str], lost: dict[str, float]) -> None:
        held = self.held.get(path)
        if held is None:
            log.info("%s: held back while node(s) %s hold files of its checkpoint", path, ", ".join(nodes))
            held = self.held[path] = HeldMarker(nodes)
        held.nodes = nodes
        for node in set(lost) - set(held.lost):
            log.warning("%s: node %s holds it back and has not been heard of for over %.0f s (lost?)",
                        path, node, self.node_timeout)
        held.lost = lost

    def note_released(self, path: str) -> None:
        if self.held.pop(path, None) is not None:
            log.info("%s: the other nodes' files are in the bucket; the marker goes", path)

    def status(self) -> dict:
        return {path: {"nodes": h.nodes, "since_ns": h.since_ns,
                       "lost": {n: _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat()
                                for n, t in h.lost.items()}}
                for path, h in self.held.items()}

    async def beat(self) -> bool:
        """Put this node's heartbeat if it holds records and the last one is a quarter of
        ``node_timeout`` old; True if it put one."""
        if self.node is None or time.monotonic() < self.next_beat:
            return False
        if not await self._read(_holds_records):
            self.next_beat = 0.0
            return False
        if self.next_beat == 0.0:
            # The records just put are the first sign of life (their LastModified counts): the
            # first heartbeat is due a quarter of node_timeout later, not now.
            self.next_beat = time.monotonic() + self.node_timeout / 4
            return False
        body = json.dumps({"node": self.node, "host": socket.gethostname(), "updated_ns": time.time_ns()})
        try:
            await self.store.put_object(cluster.heartbeat_key(self.node), body.encode())
        except StoreError as exc:
            log.warning("heartbeat: put failed (%s); retried", exc)
            return False
        self.next_beat = time.monotonic() + self.node_timeout / 4
        self.beating = True
        return True

    # -- this node's records ---------------------------------------------------------------

    async def remove_done(self) -> int:
        """Delete the records of directories with nothing pending here; returns how many."""
        done = 0
        for pub in await self._read(cluster.removal_in_flight):  # (a delete that failed before)
            done += await self._delete(pub)
        for pub in await self._read(cluster.removable):
            if await self._write(cluster.removing, pub):
                done += await self._delete(pub)
        if self.beating and self.node is not None and not await self._read(_holds_records):
            # Nothing held any more: an idle node leaves nothing of its own in the bucket.
            try:
                await self.store.delete(cluster.heartbeat_key(self.node))
            except StoreError as exc:
                log.warning("heartbeat: delete failed (%s); retried", exc)
            else:
                self.beating = False
                self.next_beat = 0.0
        return done

    async def pending_removals(self) -> bool:
        """Whether a record, or the heartbeat of a node that holds none, is still to delete
        (``ckptfs drain --until-empty`` waits for it)."""
        if await self._read(cluster.removable) or await self._read(cluster.removal_in_flight):
            return True
        return self.beating and not await self._read(_holds_records)

    async def _delete(self, pub: cluster.Publication) -> int:
        try:
            await self.store.delete(pub.key)
        except StoreError as exc:
            log.warning("in-flight record %s: delete failed (%s); retried", pub.key, exc)
            return 0
        await self._write(cluster.removed, pub)
        return 1

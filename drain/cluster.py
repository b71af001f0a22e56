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

import logging
import posixpath
import time
from dataclasses import dataclass, field

from ckptfs.fsmeta import cluster

from .store import ObjectStore, StoreError

log = logging.getLogger("ckptfs.drain")


@dataclass
class HeldMarker:
    nodes: list[str]
    since_ns: int = field(default_factory=time.time_ns)


async def other_nodes_under(store: ObjectStore, rel: str, node: str | None) -> list[str]:
    """The nodes other than ``node`` with in-flight records at or below the directory ``rel``."""
    nodes: set[str] = set()
    for obj in (await store.list(cluster.records_prefix(rel))).objects:
        parsed = cluster.parse_record_key(obj.key)
        if parsed is not None and parsed[1] != node:
            nodes.add(parsed[1])
    return sorted(nodes)


class ClusterCommit:
    """``read(fn, *args)``/``write(fn, *args)``: the drain's fsmeta access (worker threads)."""

    def __init__(self, store: ObjectStore, *, read, write):
        self.store = store
        self._read = read
        self._write = write
        self.node: str | None = None
        self.held: dict[str, HeldMarker] = {}  # marker path -> the nodes it waits for

    async def start(self) -> None:
        self.node = await self._write(cluster.ensure_node_id)
        # A drain stopped between marking a record REMOVING and deleting it: delete it now.
        for pub in await self._read(cluster.removal_in_flight):
            await self._delete(pub)

    # -- markers ---------------------------------------------------------------------------

    async def holders(self, marker_keys: list[str]) -> list[str]:
        """The other nodes whose records hold back a marker at any of ``marker_keys``."""
        nodes: set[str] = set()
        for directory in {posixpath.dirname(k) for k in marker_keys}:
            nodes.update(await other_nodes_under(self.store, directory, self.node))
        return sorted(nodes)

    def note_held(self, path: str, nodes: list[str]) -> None:
        held = self.held.get(path)
        if held is None:
            log.info("%s: held back while node(s) %s hold files of its checkpoint", path, ", ".join(nodes))
            self.held[path] = HeldMarker(nodes)
        else:
            held.nodes = nodes

    def note_released(self, path: str) -> None:
        if self.held.pop(path, None) is not None:
            log.info("%s: the other nodes' files are in the bucket; the marker goes", path)

    def status(self) -> dict:
        return {path: {"nodes": h.nodes, "since_ns": h.since_ns} for path, h in self.held.items()}

    # -- this node's records ---------------------------------------------------------------

    async def remove_done(self) -> int:
        """Delete the records of directories with nothing pending here; returns how many."""
        done = 0
        for pub in await self._read(cluster.removal_in_flight):  # (a delete that failed before)
            done += await self._delete(pub)
        for pub in await self._read(cluster.removable):
            if await self._write(cluster.removing, pub):
                done += await self._delete(pub)
        return done

    async def pending_removals(self) -> bool:
        """Whether a record is still to delete (``ckptfs drain --until-empty`` waits for it)."""
        return bool(await self._read(cluster.removable)) or bool(await self._read(cluster.removal_in_flight))

    async def _delete(self, pub: cluster.Publication) -> int:
        try:
            await self.store.delete(pub.key)
        except StoreError as exc:
            log.warning("in-flight record %s: delete failed (%s); retried", pub.key, exc)
            return 0
        await self._write(cluster.removed, pub)
        return 1

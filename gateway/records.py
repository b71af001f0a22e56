"""The gateway's side of cluster commit: put this node's in-flight records in the bucket.

fsmeta/cluster.py says what a record is. The gateway is the write path: every request that
makes a file pending in a directory with no record of this node there yet puts one before
it returns (a :class:`~ckptfs.fsmeta.store.WriteGuard` of fsmeta's writes sees which), so a
marker closed on another node after the framework's barrier finds it. That costs one
request per directory, per node, per checkpoint; every later file of the directory costs
an fsmeta read.

A put that cannot be made (bucket unreachable) holds the request back for up to
``[cluster] publish_timeout`` seconds, as backpressure; then the request is acknowledged, the
gap is logged and counted (``ckptfs_inflight_publish_failures_total``, ``ckptfs status``), and
:meth:`Records.retry_unpublished` keeps trying in the background.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time

import trio
from prometheus_client import Counter

from ckptfs.drain.store import StoreError
from ckptfs.fsmeta import MetaStore, Txn, cluster

from .bucket import BucketClient

log = logging.getLogger("ckptfs.records")

PUBLISH_FAILURES = Counter("ckptfs_inflight_publish_failures",
                           "In-flight records the write path could not put within publish_timeout")
PUBLISHED = Counter("ckptfs_inflight_records_published", "In-flight records put by the write path")
RETRY_FIRST = 0.2  # seconds before the second attempt of a put; doubles up to RETRY_MAX
RETRY_MAX = 5.0
MIN_ATTEMPT_SECONDS = 5.0  # a put's own time limit when no wait is left (the background retry)


class Records:
    """The write guard that puts in-flight records (install with :meth:`install`)."""

    def __init__(self, meta: MetaStore, bucket: BucketClient, *, markers: list[str], publish_timeout: float,
                 clock=time.monotonic):
        self.meta = meta
        self.bucket = bucket
        self.markers = tuple(markers)
        self.publish_timeout = publish_timeout
        self.clock = clock
        self.node = meta.write(cluster.ensure_node_id)
        self.run = secrets.token_hex(4)
        self.failed = 0  # puts that ran out of time (the status shows them)
        # Records whose wait in a request ran out: later requests of the directory do not wait
        # for them again (the background task retries them). One wait per record, not per file.
        self._given_up: set[str] = set()
        self._given_up_lock = threading.Lock()

    def install(self) -> "Records":
        self.meta.write_guard = self
        return self

    # -- WriteGuard ------------------------------------------------------------------------

    def in_txn(self, txn: Txn) -> list[cluster.Publication]:
        if not txn.queued:
            return []
        return cluster.needs_records(txn, self.node, self.run, self.markers)

    def after(self, pubs: list[cluster.Publication]) -> None:
        if self.bucket.in_its_thread():
            return  # (a write made by the bucket's own loop cannot wait for it: the retry task puts them)
        deadline = self.clock() + self.publish_timeout  # one wait for the request, however many records
        for pub in pubs:
            with self._given_up_lock:
                if pub.key in self._given_up:
                    continue
            if not self._publish(pub, deadline=deadline):
                with self._given_up_lock:
                    self._given_up.add(pub.key)

    # -- putting ---------------------------------------------------------------------------

    def _body(self, pub: cluster.Publication) -> bytes:
        return json.dumps({"node": self.node, "run": self.run, "seq": pub.seq, "host": socket.gethostname(),
                           "pid": os.getpid(), "published_ns": time.time_ns()}).encode()

    def _publish(self, pub: cluster.Publication, *, deadline: float) -> bool:
        delay = RETRY_FIRST
        body = self._body(pub)

        async def put(store) -> None:
            # One request may itself hang (a stalled connection, the store's own retries): it
            # gets what is left of the wait, and at least a moment in the background retry.
            with trio.fail_after(max(deadline - self.clock(), MIN_ATTEMPT_SECONDS)):
                await store.put_object(pub.key, body)

        while True:
            try:
                self.bucket.call(put)
            except (StoreError, OSError, TimeoutError, trio.TooSlowError) as exc:
                if self.clock() + delay > deadline:
                    self.failed += 1
                    PUBLISH_FAILURES.inc()
                    log.error("in-flight record %s could not be put (%s): a commit marker on another node may "
                              "go out before this node's files there; retrying in the background", pub.key, exc)
                    return False
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            PUBLISHED.inc()
            self.meta.write(lambda txn: cluster.published(txn, pub))
            with self._given_up_lock:
                self._given_up.discard(pub.key)
            return True

    def retry_unpublished(self) -> int:
        """Put the records still PUBLISHING (failed puts, or a crashed run's); returns how many
        are left. Runs in a worker thread of the gateway's background loop."""
        with self.meta.read() as txn:
            pubs = cluster.unpublished(txn)
        left = 0
        for pub in pubs:
            if not self._publish(pub, deadline=self.clock()):
                left += 1
        return left

    def sweep_orphans(self) -> int:
        """Delete this node's records that fsmeta does not know, put by an earlier run that
        crashed before the batch recording them was committed. Run at mount, before any
        request: records of this run are never touched."""
        listing = self.bucket.call(lambda store: store.list(cluster.INFLIGHT_PREFIX))
        with self.meta.read() as txn:
            known = cluster.known_keys(txn)
        orphans = []
        for obj in listing.objects:
            parsed = cluster.parse_record_key(obj.key)
            if parsed is not None and parsed[1] == self.node and parsed[2] != self.run and obj.key not in known:
                orphans.append(obj.key)
        if orphans:
            self.bucket.call(lambda store: store.delete_many(orphans))
            log.info("deleted %d in-flight record(s) an earlier run put and never recorded", len(orphans))
        return len(orphans)

"""Prometheus metrics of the drain and the cache, read from fsmeta at scrape time.

The drain is its own process (or none, after a crash), so it does not serve metrics itself
while a gateway runs: it publishes its counters and histograms in fsmeta
(``meta/drain_status``, every second), and :class:`DrainCollector` turns them, plus the
``pending``, ``uploads`` and ``errors`` tables, into metric families on each scrape. One
endpoint per node then covers both processes: the gateway's, or a standalone ``ckptfs
drain``'s when no gateway runs.

Names follow the Prometheus conventions (base units, ``_total`` on counters); the list is
in ``docs/OPERATIONS.md``, and the Helm chart's dashboard and alerts use only these.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import socket
import threading
import time

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ckptfs import __version__
from ckptfs.fsmeta import MetaStore, durability
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.fsmeta.settings import parse_addr

log = logging.getLogger("ckptfs.metrics")

# Seconds of one object-store request (PUT, UploadPart, Complete, copy, delete).
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Seconds from a file's last close or fsync to its being durable in the bucket.
DURABLE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class Histogram:
    """A histogram the drain fills in memory and publishes as JSON (cumulative on export)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def to_json(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total}


def _histogram_family(name: str, doc: str, labelnames: list[str], series: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labelnames)
    for key, data in series.items():
        cumulative, running = [], 0
        for bound, count in zip([*data["buckets"], float("inf")], data["counts"]):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        family.add_metric([key] if labelnames else [], cumulative, data["sum"])
    return family


class TimedStore:
    """An object store whose requests are timed, by operation, into ``observe(op, seconds)``."""

    OPS = {"put_object": "put", "create_multipart": "create", "upload_part": "upload_part",
           "complete_multipart": "complete", "abort_multipart": "abort", "copy": "copy",
           "delete_many": "delete", "head": "head"}

    def __init__(self, store, observe):
        self._store = store
        self._observe = observe

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        op = self.OPS.get(name)
        if op is None:
            return attr

        async def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await attr(*args, **kwargs)
            finally:
                self._observe(op, time.perf_counter() - start)

        return timed


class DrainCollector(Collector):
    """Backlog, uploads, errors and cache use of one cache directory, at scrape time."""

    def __init__(self, cache: CacheDir, meta: MetaStore):
        self.cache = cache
        self.meta = meta

    def collect(self):
        # A collector that raises turns the whole scrape into an HTTP 500: every other metric
        # (the FUSE requests', the process's) would be lost with it. Log it, keep the rest.
        try:
            yield from self._collect()
        except Exception:
            log.exception("metrics: the cache and drain figures could not be read for this scrape")

    def _collect(self):
        with self.meta.read() as txn:
            summary = durability.backlog_summary(txn)
            status = txn.get_drain_status() or {}
            open_uploads = sum(1 for _ in txn.iter_uploads())
            in_error = txn.count_errors()
            space = txn.get_space_status() or {}
        if space and self.cache.gateway_pid() is None:
            space = {}  # the last figures of a stopped gateway
        now_s = status.get("updated_ns", 0) / 1e9
        yield GaugeMetricFamily("ckptfs_dirty_files", "Files and directories the bucket does not match yet",
                                value=summary.files)
        yield GaugeMetricFamily("ckptfs_dirty_bytes", "Bytes still to upload", value=summary.bytes)
        age = summary.oldest_age_seconds()
        yield GaugeMetricFamily("ckptfs_oldest_dirty_age_seconds",
                                "Seconds the longest-waiting pending file has waited (0: none)", value=age or 0.0)
        yield CounterMetricFamily("ckptfs_uploaded_bytes", "Bytes uploaded by the drain since it started",
                                  value=status.get("uploaded_bytes", 0))
        yield CounterMetricFamily("ckptfs_uploaded_files", "Files uploaded by the drain since it started",
                                  value=status.get("uploaded_files", 0))
        retries = CounterMetricFamily("ckptfs_upload_retries", "Retried object-store requests, by error code",
                                      labels=["code"])
        for code, n in (status.get("retries_by_code") or {}).items():
            retries.add_metric([code], n)
        yield retries
        errors = CounterMetricFamily("ckptfs_upload_errors", "Permanent upload errors, by error code",
                                     labels=["code"])
        for code, n in (status.get("errors_by_code") or {}).items():
            errors.add_metric([code], n)
        yield errors
        yield GaugeMetricFamily("ckptfs_files_in_error", "Files whose last upload failed permanently",
                                value=in_error)
        yield GaugeMetricFamily("ckptfs_multipart_uploads_open", "Multipart uploads the drain has in progress",
                                value=open_uploads)
        histograms = status.get("histograms") or {}
        yield _histogram_family("ckptfs_upload_request_duration_seconds", "Seconds per object-store request",
                                ["op"], histograms.get("upload_request_duration_seconds") or {})
        yield _histogram_family("ckptfs_time_to_durable_seconds",
                                "Seconds from a file's last close or fsync to its being durable", [],
                                {"": histograms["time_to_durable_seconds"]}
                                if "time_to_durable_seconds" in histograms else {})
        yield from _cache_families(self.cache, summary.bytes, space)
        held = (status.get("held_markers") or {}).values()
        yield GaugeMetricFamily("ckptfs_markers_held",
                                "Commit markers waiting for other nodes' files of their checkpoint", value=len(held))
        longest = max(((time.time_ns() - h.get("since_ns", time.time_ns())) / 1e9 for h in held), default=0.0)
        yield GaugeMetricFamily("ckptfs_nodes_lost",
                                "Other nodes holding a marker back with no heartbeat for node_timeout",
                                value=len({n for h in held for n in (h.get("lost") or {})}))
        yield GaugeMetricFamily("ckptfs_marker_held_longest_seconds",
                                "Seconds the longest-held commit marker has waited for other nodes (0: none)",
                                value=max(0.0, longest))
        yield GaugeMetricFamily("ckptfs_drain_status_age_seconds",
                                "Seconds since the drain last published its status (a stuck or absent drain grows)",
                                value=max(0.0, time.time() - now_s) if now_s else 0.0)


def _cache_families(cache: CacheDir, dirty_bytes: int, space: dict):
    """Cache use (measured here), and the cap, evictions and backpressure from a live
    gateway's ``meta/space_status`` (gateway/space.py); without a gateway the cap is the device."""
    used = cache.used_bytes()
    dirty = min(dirty_bytes, used)
    # REMOTE files' cache files (crash leftovers, partial fetches) as of the gateway's last scan
    remote = min((space.get("bytes_by_state") or {}).get("remote", 0), used - dirty)
    by_state = {"dirty": dirty, "clean": used - dirty - remote, "remote": remote}
    family = GaugeMetricFamily("ckptfs_cache_bytes", "Bytes of cache files, by state (dirty: not in the bucket "
                               "yet; clean: evictable; remote: leftovers and partial fetches)", labels=["state"])
    for state in ("dirty", "clean", "remote"):
        family.add_metric([state], by_state.get(state, 0))
    yield family
    cap = space.get("cap_bytes")
    if cap is None:
        fs = os.statvfs(cache.root)
        cap = fs.f_blocks * fs.f_frsize
    yield GaugeMetricFamily("ckptfs_cache_max_bytes", "Bytes the cache may use ([cache] max_size)", value=cap)
    yield CounterMetricFamily("ckptfs_cache_evictions", "Clean files evicted from the cache since the gateway started",
                              value=space.get("evictions_total", 0))
    yield CounterMetricFamily("ckptfs_cache_evicted_bytes", "Bytes of clean files evicted since the gateway started",
                              value=space.get("evicted_bytes_total", 0))
    yield CounterMetricFamily("ckptfs_backpressure_wait_seconds",
                              "Seconds writers waited for cache space (summed over writers)",
                              value=space.get("wait_seconds_total", 0.0))
    yield GaugeMetricFamily("ckptfs_backpressure_waiting_writers", "Writes waiting for cache space now",
                            value=space.get("waiting_writers", 0))
    yield CounterMetricFamily("ckptfs_backpressure_refused_writes",
                              "Writes refused with ENOSPC after waiting backpressure_timeout for space",
                              value=space.get("enospc_total", 0))


def add_build_info(registry: CollectorRegistry) -> None:
    Gauge("ckptfs_build_info", "Always 1; the version of ckptfs serving these metrics", ["version"],
          registry=registry).labels(__version__).set(1)


def start_endpoint(addr: str, registry: CollectorRegistry):
    """Start the /metrics endpoint in a background thread: ``(server, None)`` (``shutdown()``
    stops it), or ``(None, why)``: a busy address is logged, not fatal."""
    host, port = parse_addr(addr)
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("metrics endpoint %s not started: %s", addr, exc)
        return None, exc.strerror or str(exc)
    # The port bound, which port 0 leaves to the kernel: the log line is how to find it.
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server, None


def serve(addr: str, registry: CollectorRegistry):
    """:func:`start_endpoint`'s server, or None."""
    return start_endpoint(addr, registry)[0]


@contextlib.contextmanager
def standalone_endpoint(addr: str, cache: CacheDir, meta: MetaStore):
    """The node's endpoint while a drain runs with no gateway (which would serve it otherwise)."""
    registry = CollectorRegistry(auto_describe=True)
    add_build_info(registry)
    registry.register(DrainCollector(cache, meta))
    server = serve(addr, registry)
    try:
        yield server
    finally:
        if server is not None:
            stop(server)


def stop(server) -> None:
    """Stop a server :func:`serve` started. ``shutdown()`` returns once ``serve_forever``
    next wakes, which it does every 0.5 s or for a connection: connecting wakes it at once,
    so a one-shot drain does not spend up to half a second of its exit here."""
    stopper = threading.Thread(target=server.shutdown, name="metrics-shutdown")
    stopper.start()
    host, port = server.server_address[:2]
    while stopper.is_alive():
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), timeout=0.2).close()
        stopper.join(0.01)
    server.server_close()

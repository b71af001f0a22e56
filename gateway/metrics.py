"""Prometheus metrics of a node: the gateway's own, plus the drain's and the cache's, read
from fsmeta at scrape time (:class:`ckptfs.drain.metrics.DrainCollector`). Served on
127.0.0.1:9810 unless configured. The full list is in docs/OPERATIONS.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from ckptfs.drain import metrics as drain_metrics
from ckptfs.fsmeta import MetaStore
from ckptfs.fsmeta.layout import CacheDir

REGISTRY = CollectorRegistry(auto_describe=True)

FUSE_ERRORS = Counter(
    "ckptfs_fuse_errors_total", "FUSE requests answered with an error, by operation and errno name",
    ["op", "errno"], registry=REGISTRY,
)
FUSE_UNEXPECTED = Counter(
    "ckptfs_fuse_unexpected_errors_total",
    "Handler exceptions that were not a filesystem error (answered EIO, logged)", ["op"], registry=REGISTRY,
)
WRITE_BYTES = Counter("ckptfs_write_bytes_total", "Bytes written through the mount", registry=REGISTRY)
READ_BYTES = Counter("ckptfs_read_bytes_total", "Bytes read through the mount", registry=REGISTRY)
# The read path (gateway/fetch.py): reads of files opened while REMOTE, and their GETs.
REMOTE_READ_BYTES = Counter(
    "ckptfs_remote_read_bytes_total",
    "Bytes read from files opened while remote, by where they were when asked: source=cache (already "
    "fetched) or bucket (the read waited for a GET)", ["source"], registry=REGISTRY,
)
BUCKET_GET_BYTES = Counter("ckptfs_bucket_get_bytes_total", "Bytes fetched from the bucket into the cache "
                           "(ranged GETs of reads, read-ahead, prefetch and open for writing)", registry=REGISTRY)
BUCKET_GET_SECONDS = Histogram(
    "ckptfs_bucket_get_duration_seconds", "Seconds per ranged GET into the cache (excluding the queue)",
    registry=REGISTRY, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
FETCHES_IN_FLIGHT = Gauge("ckptfs_fetches_in_flight", "Ranged GETs into the cache in flight", registry=REGISTRY)
FETCH_ERRORS = Counter(
    "ckptfs_fetch_errors_total", "Failed ranged GETs, by kind: changed (ETag moved: ESTALE), missing "
    "(object gone), failed (other errors; the next read retries)", ["kind"], registry=REGISTRY,
)
INTEGRITY_FAILURES = Counter(
    "ckptfs_integrity_failures_total",
    "Remote files fetched whole whose content did not match x-amz-meta-blake3 (EIO, error state)",
    registry=REGISTRY,
)
DATA_PATH = Gauge("ckptfs_data_path", "1 for the data path this gateway runs: passthrough or writeback",
                  ["mode"], registry=REGISTRY)
FUSE_TRANSPORT = Gauge("ckptfs_fuse_transport",
                       "1 for how FUSE requests reach this gateway: io_uring (a queue per CPU) or dev_fuse",
                       ["transport"], registry=REGISTRY)
NAMESPACE_REQUESTS = Counter(
    "ckptfs_namespace_bucket_requests_total",
    "Bucket requests the namespace sent (list: directory listings, head: object metadata, get: symlink targets)",
    ["op"], registry=REGISTRY,
)
NAMESPACE_REQUEST_SECONDS = Histogram(
    "ckptfs_namespace_bucket_request_duration_seconds", "Seconds per bucket request of the namespace, by op",
    ["op"], registry=REGISTRY, buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
NAMESPACE_NEGATIVE_HITS = Counter(
    "ckptfs_namespace_negative_hits_total",
    "Lookups of missing names answered from a directory listing younger than the TTL (no request)",
    registry=REGISTRY,
)
NAMESPACE_ERRORS = Counter(
    "ckptfs_namespace_bucket_errors_total",
    "Failed bucket requests of the namespace (the cache answers until the TTL ends)", registry=REGISTRY,
)
# The gateway's supervision of its drain (gateway/supervisor.py).
DRAIN_RESTARTS = Counter(
    "ckptfs_drain_restarts", "Times the drain process exited and the gateway restarted it (counted at the exit)",
    registry=REGISTRY,
)
DRAIN_CRASH_LOOPING = Gauge(
    "ckptfs_drain_crash_looping", "1 while the drain is crash-looping (3 exits within 60 s, until it stays up "
    "60 s), else 0", registry=REGISTRY,
)
drain_metrics.add_build_info(REGISTRY)


class FuseRequestCollector:
    """``ckptfs_fuse_requests_total`` and ``ckptfs_fuse_request_duration_seconds``, by op (and
    ``ckptfs_fuse_dir_attrs_answered_total``): the
    front end counts and times every request in C (``Session.request_stats``), from the
    moment a thread read it until its reply was sent, so no request pays for Prometheus'
    locks in Python."""

    def __init__(self, session, bounds):
        self._session = session
        self._bounds = bounds

    def describe(self):
        return []

    def collect(self):
        requests = CounterMetricFamily("ckptfs_fuse_requests", "FUSE requests served, by operation", labels=["op"])
        seconds = HistogramMetricFamily("ckptfs_fuse_request_duration_seconds",
                                        "Seconds to answer a FUSE request, by operation", labels=["op"])
        gil = CounterMetricFamily("ckptfs_fuse_interpreter_wait_seconds",
                                  "Of the seconds answering FUSE requests, those spent waiting for the Python "
                                  "interpreter (the GIL) held by other threads, by operation", labels=["op"])
        for op, (count, total, counts, gil_seconds) in sorted(self._session.request_stats().items()):
            requests.add_metric([op], count)
            cumulative, running = [], 0
            for bound, n in zip((*map(str, self._bounds), "+Inf"), counts):
                running += n
                cumulative.append((bound, running))
            seconds.add_metric([op], cumulative, total)
            gil.add_metric([op], gil_seconds)
        kept = CounterMetricFamily("ckptfs_fuse_dir_attrs_answered",
                                   "GETATTRs of a directory just changed, answered by the front end from the "
                                   "attributes the change left, without Python (counted in ckptfs_fuse_requests too)")
        kept.add_metric([], self._session.dir_attr_hits)
        ringed = CounterMetricFamily("ckptfs_fuse_io_uring_requests",
                                     "FUSE requests that came through the io_uring queues (counted in "
                                     "ckptfs_fuse_requests too)")
        ringed.add_metric([], self._session.io_uring_requests)
        yield ringed
        yield requests
        yield seconds
        yield gil
        yield kept


def watch_fuse(session, bounds) -> None:
    """Serve the request counts and durations of a FUSE front-end session."""
    REGISTRY.register(FuseRequestCollector(session, bounds))


def watch_cache(cache_dir: str, meta: MetaStore) -> None:
    """Also serve the backlog, uploads and cache use of this cache directory."""
    REGISTRY.register(drain_metrics.DrainCollector(CacheDir(cache_dir), meta))


def set_data_path(mode: str) -> None:
    for other in ("passthrough", "writeback"):
        DATA_PATH.labels(other).set(1 if other == mode else 0)


def set_fuse_transport(transport: str) -> None:
    for other in ("io_uring", "dev_fuse"):
        FUSE_TRANSPORT.labels(other).set(1 if other == transport else 0)


def serve(addr: str) -> str | None:
    """Serve the endpoint; None, or why it could not (a busy address is not fatal to the mount)."""
    return drain_metrics.start_endpoint(addr, REGISTRY)[1]

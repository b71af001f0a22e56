"""Prometheus metrics of the gateway (served on 127.0.0.1:9810 unless configured)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("ckptfs.metrics")

REGISTRY = CollectorRegistry(auto_describe=True)

FUSE_OPS = Counter("ckptfs_fuse_ops", "FUSE requests served, by operation", ["op"], registry=REGISTRY)
FUSE_ERRORS = Counter(
    "ckptfs_fuse_errors", "FUSE requests answered with an error, by operation and errno name",
    ["op", "errno"], registry=REGISTRY,
)
FUSE_UNEXPECTED = Counter(
    "ckptfs_fuse_unexpected_errors",
    "Handler exceptions that were not a filesystem error (answered EIO, logged)", ["op"], registry=REGISTRY,
)
WRITE_BYTES = Counter("ckptfs_write_bytes", "Bytes written through the mount", registry=REGISTRY)
READ_BYTES = Counter("ckptfs_read_bytes", "Bytes read through the mount", registry=REGISTRY)
FSYNC_SECONDS = Histogram(
    "ckptfs_fsync_seconds", "Time fsync took", registry=REGISTRY,
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
)
BACKPRESSURE_SECONDS = Counter(
    "ckptfs_backpressure_wait_seconds", "Seconds writers waited for cache space", registry=REGISTRY,
)
CACHE_USED_BYTES = Gauge("ckptfs_cache_used_bytes", "Bytes of the cache device used by cache files",
                         registry=REGISTRY)


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics_addr: expected HOST:PORT, got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def serve(addr: str) -> None:
    """Start the /metrics endpoint in a background thread; a busy port is logged, not fatal."""
    host, port = parse_addr(addr)
    try:
        start_http_server(port, addr=host, registry=REGISTRY)
        log.info("metrics on http://%s:%d/metrics", host, port)
    except OSError as exc:
        log.warning("metrics endpoint %s not started: %s", addr, exc)

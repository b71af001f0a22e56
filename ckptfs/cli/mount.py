"""``ckptfs mount`` and ``ckptfs umount``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from ckptfs.fsmeta.layout import CacheDir
from ckptfs.fsmeta.settings import ConfigError, build_settings
from ckptfs.gateway import mount
from ckptfs.gateway.mountpoint import mount_cache_dir

from .common import setup_logging
from .status import wait_durable


def cmd_mount(args: argparse.Namespace, argv: list[str]) -> int:
    overrides = {
        "bucket_url": args.bucket_url,
        "cache_dir": args.cache_dir,
        "endpoint_url": args.endpoint_url,
        "fsync": args.fsync,
        "metrics_addr": args.metrics_addr,
        "allow_other": args.allow_other,
        "data_path": args.data_path,
        "fuse_io_uring": args.fuse_io_uring,
        "cache_max_size": args.cache_max_size,
        "cache_high_watermark": args.cache_high_watermark,
        "cache_low_watermark": args.cache_low_watermark,
        "backpressure_timeout": args.backpressure_timeout,
    }
    try:
        settings = build_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return 2
    if args.foreground:
        setup_logging(args.verbose)
        return mount.run_foreground(settings, args.mountpoint, ready_fd=args.ready_fd)
    # Re-run ourselves detached; pass the original arguments unchanged.
    return mount.run_daemon([a for a in argv if a != "--foreground"], settings)


def cmd_umount(args: argparse.Namespace, argv: list[str]) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    if mount.clear_dead_mount(mountpoint):
        print(f"ckptfs: {mountpoint}: the gateway had died; cleared its mount "
              f"(fsynced data is still in the cache: mount again or run ckptfs drain)", file=sys.stderr)
        return 0
    cache_dir = mount_cache_dir(mountpoint)
    if cache_dir is None:
        print(f"ckptfs: {mountpoint}: not a ckptfs mount", file=sys.stderr)
        return 1
    if args.wait_durable:
        if not wait_durable(mountpoint, timeout=args.timeout, show_progress=sys.stderr.isatty()):
            print(f"ckptfs: {mountpoint}: not everything is durable yet; not unmounting", file=sys.stderr)
            return 1
    cache = CacheDir(cache_dir)
    pid = cache.gateway_pid()
    result = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"ckptfs: {mountpoint}: {result.stderr.strip() or 'unmount failed'}", file=sys.stderr)
        return 1
    # Wait for the gateway to finish (it persists state and releases the cache directory).
    deadline = time.monotonic() + (args.timeout or 60)
    while pid and cache.gateway_pid() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mount", help="mount BUCKET_URL on MOUNTPOINT")
    p.add_argument("bucket_url", help="s3://bucket[/prefix] or file:///abs/dir")
    p.add_argument("mountpoint")
    p.add_argument("--cache-dir", help="cache directory on local NVMe (default /var/cache/ckptfs)")
    p.add_argument("--cache-max-size", metavar="SIZE",
                   help='cap on the cache files: bytes ("500GiB") or a share of the cache device ("80%%"); '
                        'default 90%%')
    p.add_argument("--cache-high-watermark", metavar="FRACTION",
                   help="evict clean files above this share of the cap (0.9 or 90%%; default 0.9)")
    p.add_argument("--cache-low-watermark", metavar="FRACTION",
                   help="...down to this share of the cap (default 0.8)")
    p.add_argument("--backpressure-timeout", type=float, metavar="S",
                   help="seconds a write waits for cache space before ENOSPC (default 600)")
    p.add_argument("--endpoint-url", help="S3 endpoint, e.g. http://127.0.0.1:7480")
    p.add_argument("--config", help="TOML settings file")
    p.add_argument("--foreground", "-f", action="store_true", help="stay attached; log to stderr")
    p.add_argument("--fsync", choices=["local", "remote"], help="remote: fsync waits until durable in the bucket")
    p.add_argument("--data-path", choices=["auto", "passthrough", "writeback"],
                   help="file data path: FUSE passthrough, the writeback cache, or auto (passthrough "
                        "when available; default)")
    p.add_argument("--fuse-io-uring", choices=["auto", "on", "off"],
                   help="FUSE requests through io_uring queues, one per CPU: auto (when the kernel offers "
                        "them: the fuse module's enable_uring parameter; default), on (refuse to mount "
                        "otherwise) or off (/dev/fuse only)")
    p.add_argument("--metrics-addr", help="HOST:PORT of the Prometheus endpoint (default 127.0.0.1:9810)")
    p.add_argument("--allow-other", dest="allow_other", action="store_true", default=None,
                   help="let other users access the mount (default when root)")
    p.add_argument("--no-allow-other", dest="allow_other", action="store_false")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("umount", help="unmount a ckptfs mount")
    p.add_argument("mountpoint")
    p.add_argument("--wait-durable", action="store_true", help="first wait until everything is in the bucket")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait (default: no limit)")
    p.set_defaults(func=cmd_umount)

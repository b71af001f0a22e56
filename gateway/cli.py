"""The ``ckptfs`` command line (contract: ../shared/ARCHITECTURE.md, "CLI contract")."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from .config import ConfigError, build_settings


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s ckptfs[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Request logs of botocore could carry signed headers; keep them quiet.
    logging.getLogger("botocore").setLevel(logging.WARNING)
    logging.getLogger("aiobotocore").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request


def cmd_mount(args: argparse.Namespace, argv: list[str]) -> int:
    from . import mount

    overrides = {
        "bucket_url": args.bucket_url,
        "cache_dir": args.cache_dir,
        "endpoint_url": args.endpoint_url,
        "fsync": args.fsync,
        "metrics_addr": args.metrics_addr,
        "allow_other": args.allow_other,
    }
    try:
        settings = build_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return 2
    if args.foreground:
        _setup_logging(args.verbose)
        return mount.run_foreground(settings, args.mountpoint, ready_fd=args.ready_fd)
    # Re-run ourselves detached; pass the original arguments unchanged.
    return mount.run_daemon([a for a in argv if a != "--foreground"], settings)


def cmd_umount(args: argparse.Namespace, argv: list[str]) -> int:
    from .mount import gateway_pid

    mountpoint = os.path.abspath(args.mountpoint)
    from .durability import mount_cache_dir
    from .mount import clear_dead_mount

    if clear_dead_mount(mountpoint):
        print(f"ckptfs: {mountpoint}: the gateway had died; cleared its mount "
              f"(fsynced data is still in the cache: mount again or run ckptfs drain)", file=sys.stderr)
        return 0
    cache_dir = mount_cache_dir(mountpoint)
    if cache_dir is None:
        print(f"ckptfs: {mountpoint}: not a ckptfs mount", file=sys.stderr)
        return 1
    if args.wait_durable:
        from .durability import wait_durable

        if not wait_durable(mountpoint, timeout=args.timeout, show_progress=sys.stderr.isatty()):
            print(f"ckptfs: {mountpoint}: not everything is durable yet; not unmounting", file=sys.stderr)
            return 1
    pid = gateway_pid(cache_dir)
    result = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"ckptfs: {mountpoint}: {result.stderr.strip() or 'unmount failed'}", file=sys.stderr)
        return 1
    # Wait for the gateway to finish (it persists state and releases the cache directory).
    deadline = time.monotonic() + (args.timeout or 60)
    while pid and gateway_pid(cache_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfs", description="POSIX caching gateway for ML checkpoints")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("mount", help="mount BUCKET_URL on MOUNTPOINT")
    p.add_argument("bucket_url", help="s3://bucket[/prefix] or file:///abs/dir")
    p.add_argument("mountpoint")
    p.add_argument("--cache-dir", help="cache directory on local NVMe (default /var/cache/ckptfs)")
    p.add_argument("--endpoint-url", help="S3 endpoint, e.g. http://127.0.0.1:7480")
    p.add_argument("--config", help="TOML settings file")
    p.add_argument("--foreground", "-f", action="store_true", help="stay attached; log to stderr")
    p.add_argument("--fsync", choices=["local", "remote"], help="remote: fsync waits until durable in the bucket")
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

    from . import cli_more

    cli_more.add_commands(sub)
    __import__("lifecycle.cli", fromlist=["add_commands"]).add_commands(sub)  # lifecycle plan|apply, promote
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command != "mount":
        _setup_logging(args.verbose)
    return args.func(args, argv) or 0


if __name__ == "__main__":
    sys.exit(main())

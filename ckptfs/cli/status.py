"""``ckptfs status`` and ``ckptfs wait-durable``: what is not in the bucket yet."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ckptfs.fsmeta import durability
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.gateway.mount import NotOnMount, find_mount

from .common import human_bytes


def wait_durable(path: str, *, timeout: float | None = None, show_progress: bool = False,
                 out=sys.stderr, interval: float = 0.2) -> bool:
    """Block until everything at or under ``path`` is durable; False on timeout (pending printed)."""
    root, cache_dir, rel = find_mount(path)
    meta = CacheDir(cache_dir).open_meta()
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        start_bytes = None
        warned = set()
        while True:
            with meta.read() as txn:
                backlog = durability.pending_under(txn, rel)
            if backlog.empty:
                if show_progress and start_bytes:
                    out.write("\r" + " " * 78 + "\r")
                return True
            for p, error in backlog.errors.items():
                if p not in warned:
                    warned.add(p)
                    out.write(f"ckptfs: {p}: upload failing: {error} (data kept in the cache; retrying)\n")
            if show_progress:
                start_bytes = max(start_bytes or 0, backlog.bytes)
                done = start_bytes - backlog.bytes
                frac = done / start_bytes if start_bytes else 0.0
                bar = "#" * int(frac * 30)
                out.write(f"\r[{bar:<30}] {human_bytes(backlog.bytes)} left, {len(backlog.files)} files, "
                          f"{len(backlog.deletes)} deletes   ")
                out.flush()
            if deadline is not None and time.monotonic() >= deadline:
                if show_progress:
                    out.write("\n")
                out.write(f"ckptfs: timed out; still pending under {path}:\n")
                for p, size, state in backlog.files[:50]:
                    out.write(f"  {state:10} {human_bytes(size):>10}  {p}\n")
                for key in backlog.deletes[:50]:
                    out.write(f"  {'delete':10} {'':>10}  {key}\n")
                more = len(backlog.files) + len(backlog.deletes) - 100
                if more > 0:
                    out.write(f"  … and {more} more\n")
                return False
            time.sleep(interval)
    finally:
        meta.close()


def cmd_wait_durable(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        ok = wait_durable(args.path, timeout=args.timeout, show_progress=sys.stderr.isatty())
    except NotOnMount as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return 2
    return 0 if ok else 1


def cmd_status(args: argparse.Namespace, argv: list[str]) -> int:
    if args.cache_dir:
        cache, rel = CacheDir(args.cache_dir), ""
    else:
        try:
            _, cache_dir, rel = find_mount(args.mountpoint or ".")
        except NotOnMount as exc:
            print(f"ckptfs: {exc}", file=sys.stderr)
            return 2
        cache = CacheDir(cache_dir)
    meta = cache.open_meta()
    try:
        with meta.read() as txn:
            backlog = durability.pending_under(txn, rel)
            drain = txn.get_drain_status() or {}
            settings = txn.get_settings() or {}
    finally:
        meta.close()
    report = {
        "bucket_url": settings.get("bucket_url"),
        "cache_dir": cache.root,
        "gateway_pid": cache.gateway_pid(),
        "drain_pid": cache.drain_pid(),
        "pending_files": len(backlog.files),
        "pending_bytes": backlog.bytes,
        "pending_deletes": len(backlog.deletes),
        "errors": backlog.errors,
        "retrying": drain.get("retrying", {}),
        "uploaded_bytes": drain.get("uploaded_bytes", 0),
        "uploaded_files": drain.get("uploaded_files", 0),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"bucket   {report['bucket_url']}")
    print(f"cache    {cache.root}   gateway pid {report['gateway_pid'] or '-'}   drain pid {report['drain_pid'] or '-'}")
    print(f"backlog  {len(backlog.files)} files, {human_bytes(backlog.bytes)}, {len(backlog.deletes)} deletes")
    print(f"drained  {report['uploaded_files']} files, {human_bytes(report['uploaded_bytes'])} since the drain started")
    for what, msg in report["retrying"].items():
        print(f"retrying {what}: {msg}")
    for path, err in backlog.errors.items():
        print(f"error    {path}: {err}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wait-durable", help="block until everything under PATH is durable in the bucket")
    p.add_argument("path")
    p.add_argument("--timeout", type=float, default=None)
    p.set_defaults(func=cmd_wait_durable)

    p = sub.add_parser("status", help="drain backlog and errors of a mount or cache directory")
    p.add_argument("mountpoint", nargs="?")
    p.add_argument("--cache-dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

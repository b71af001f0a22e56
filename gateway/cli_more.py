"""ckptfs commands beyond mount/umount: drain, wait-durable, status."""

from __future__ import annotations

import argparse
import json
import os
import sys


def cmd_drain(args: argparse.Namespace, argv: list[str]) -> int:
    import time

    from fsmeta import locks

    from drain import main as drain_main

    cache_dir = os.path.abspath(args.cache_dir)
    holder = locks.holder(cache_dir, locks.DRAIN_LOCK) if os.path.isdir(cache_dir) else None
    if holder is not None and args.until_empty:
        # A drain (the mount's) is already working on it: wait for it to empty the queue.
        from fsmeta import MetaStore

        from .durability import backlog_under

        print(f"ckptfs: a drain is running (pid {holder}); waiting until the cache is empty", file=sys.stderr)
        meta = MetaStore(os.path.join(cache_dir, "meta"), create=False)
        try:
            while True:
                with meta.read() as txn:
                    if backlog_under(txn, "").empty:
                        return 0
                if locks.holder(cache_dir, locks.DRAIN_LOCK) is None:
                    break
                time.sleep(0.2)
        finally:
            meta.close()
    return drain_main.run(cache_dir, until_empty=args.until_empty)


def cmd_wait_durable(args: argparse.Namespace, argv: list[str]) -> int:
    from .durability import NotOnMount, wait_durable

    try:
        ok = wait_durable(args.path, timeout=args.timeout, show_progress=sys.stderr.isatty())
    except NotOnMount as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return 2
    return 0 if ok else 1


def cmd_status(args: argparse.Namespace, argv: list[str]) -> int:
    from fsmeta import MetaStore, locks

    from .durability import NotOnMount, backlog_under, find_mount, _human

    if args.cache_dir:
        cache_dir, rel = os.path.abspath(args.cache_dir), ""
    else:
        try:
            _, cache_dir, rel = find_mount(args.mountpoint or ".")
        except NotOnMount as exc:
            print(f"ckptfs: {exc}", file=sys.stderr)
            return 2
    meta = MetaStore(os.path.join(cache_dir, "meta"), create=False)
    try:
        with meta.read() as txn:
            backlog = backlog_under(txn, rel)
            drain = txn.get_drain_status() or {}
            settings = txn.get_settings() or {}
    finally:
        meta.close()
    report = {
        "bucket_url": settings.get("bucket_url"),
        "cache_dir": cache_dir,
        "gateway_pid": locks.holder(cache_dir, locks.GATEWAY_LOCK),
        "drain_pid": locks.holder(cache_dir, locks.DRAIN_LOCK),
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
    print(f"cache    {cache_dir}   gateway pid {report['gateway_pid'] or '-'}   drain pid {report['drain_pid'] or '-'}")
    print(f"backlog  {len(backlog.files)} files, {_human(backlog.bytes)}, {len(backlog.deletes)} deletes")
    print(f"drained  {report['uploaded_files']} files, {_human(report['uploaded_bytes'])} since the drain started")
    for what, msg in report["retrying"].items():
        print(f"retrying {what}: {msg}")
    for path, err in backlog.errors.items():
        print(f"error    {path}: {err}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drain", help="upload what a cache directory holds, with or without a mount")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--until-empty", action="store_true", help="exit once everything is durable")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("wait-durable", help="block until everything under PATH is durable in the bucket")
    p.add_argument("path")
    p.add_argument("--timeout", type=float, default=None)
    p.set_defaults(func=cmd_wait_durable)

    p = sub.add_parser("status", help="drain backlog and errors of a mount or cache directory")
    p.add_argument("mountpoint", nargs="?")
    p.add_argument("--cache-dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

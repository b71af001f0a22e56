"""``ckptfs drain``: upload what a cache directory holds, with or without a mount.

A mount runs its own drain as ``python -m ckptfs drain --cache-dir DIR --supervised``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from ckptfs.fsmeta import durability
from ckptfs.fsmeta.layout import CacheDir


def cmd_drain(args: argparse.Namespace, argv: list[str]) -> int:
    cache = CacheDir(args.cache_dir)
    holder = cache.drain_pid() if os.path.isdir(cache.root) else None
    if holder is not None and args.until_empty and not args.supervised:
        # A drain (the mount's) is already working on it: wait for it to empty the queue.
        print(f"ckptfs: a drain is running (pid {holder}); waiting until the cache is empty", file=sys.stderr)
        meta = cache.open_meta()
        try:
            while True:
                with meta.read() as txn:
                    if durability.pending_under(txn, "").empty:
                        return 0
                if cache.drain_pid() is None:
                    break
                time.sleep(0.2)
        finally:
            meta.close()
    # The imports and the S3 client allocate a few hundred thousand objects that live as long
    # as the process: collecting while they pile up costs ~10% of a one-shot drain's start.
    # process._run freezes them and collects again from then on.
    gc.disable()
    from ckptfs.drain import process

    return process.run(cache.root, until_empty=args.until_empty, supervised=args.supervised)


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drain", help="upload what a cache directory holds, with or without a mount")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--until-empty", action="store_true", help="exit once everything is durable")
    p.add_argument("--supervised", action="store_true", help=argparse.SUPPRESS)  # started by a mount
    p.set_defaults(func=cmd_drain)

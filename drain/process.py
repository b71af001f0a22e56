"""The drain process: what ``ckptfs drain --cache-dir DIR [--until-empty]`` runs.

A mount starts it as ``python -m ckptfs drain --cache-dir DIR --supervised``. The cache directory remembers its bucket URL
and settings (fsmeta ``settings``); credentials come from the AWS chain.

One drain per cache directory (``drain.lock``). A supervised drain started by
a gateway waits for that lock, so a drain that outlived a crashed gateway
finishes first; a drain whose gateway is gone exits once the queue is empty.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import stat
import sys

import trio

from ckptfs.fsmeta import MetaStore, locks
from ckptfs.fsmeta.layout import CacheDir, NoCacheHere
from ckptfs.fsmeta.settings import Settings

from .factory import open_store_for
from .metrics import standalone_endpoint
from .store import StoreError, exception_leaves
from .worker import Drain

log = logging.getLogger("ckptfs.drain")


class DrainSetupError(Exception):
    pass


def log_to_cache_dir_if_stderr_is_a_pipe(cache_dir: str) -> None:
    """A supervised drain's stderr is a pipe its gateway copies to the log: once that gateway
    is gone, write to the cache directory's log instead, so the rest is not lost."""
    try:
        if not stat.S_ISFIFO(os.fstat(2).st_mode):
            return
        fd = os.open(CacheDir(cache_dir).gateway_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    os.dup2(fd, 2)
    os.close(fd)


def load_settings(cache_dir: str) -> tuple[MetaStore, Settings]:
    try:
        meta = CacheDir(cache_dir).open_meta()
    except NoCacheHere as exc:
        raise DrainSetupError(str(exc)) from None
    stored = meta.get_settings()
    if not stored or not stored.get("bucket_url"):
        meta.close()
        raise DrainSetupError(f"cache directory {cache_dir}: does not record a bucket URL")
    return meta, Settings.from_json(stored)


async def _run(cache_dir: str, meta: MetaStore, settings, *, until_empty: bool, supervised: bool) -> dict[str, str]:
    """Drain; returns what is left behind (path -> code): files whose cache lost data, and
    the markers that wait for them."""
    stop = trio.Event()
    gateway_pid = os.getppid() if supervised else None

    async def watch() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                log.info("drain stopping (in-flight uploads resume on the next start)")
                stop.set()
                return

    async with open_store_for(settings) as store:
        # botocore's service model and client are tens of thousands of long-lived objects:
        # keep them out of every later GC pass (a few % of the drain's CPU otherwise). The
        # command may have kept the collector off through start-up (ckptfs/cli/drain.py).
        gc.freeze()
        gc.enable()
        drain = Drain(cache_dir, meta, settings, store)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            if supervised:
                async def orphan_watch() -> None:
                    # Outlived our gateway: finish what is queued, then let the next one take over.
                    while os.getppid() == gateway_pid:
                        await trio.sleep(1.0)
                    log_to_cache_dir_if_stderr_is_a_pipe(cache_dir)
                    log.info("gateway is gone; draining what is left, then exiting")
                    drain.until_empty = True
                nursery.start_soon(orphan_watch)
            await drain.run(until_empty=until_empty, stop=stop)
            nursery.cancel_scope.cancel()
        return {**drain.lost, **{path: "MarkerHeldByLostFile" for path in drain.held}}


def run(cache_dir: str, *, until_empty: bool = False, supervised: bool = False) -> int:
    cache_dir = os.path.abspath(cache_dir)
    lock_path = CacheDir(cache_dir).drain_lock
    try:
        lock_fd = locks.acquire(lock_path, wait=supervised)
    except locks.LockHeld as exc:
        print(f"ckptfs: cache directory {cache_dir}: a drain is already running (pid {exc.holder})",
              file=sys.stderr)
        return 3
    except OSError as exc:
        print(f"ckptfs: cache directory {cache_dir}: cannot open {lock_path}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        meta, settings = load_settings(cache_dir)
    except DrainSetupError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return 1
    if not supervised and CacheDir(cache_dir).gateway_pid() is None:
        # No gateway, so no handle is open: writer counts left by a crashed one are stale, and
        # would keep the drain from reconciling those files' cache lengths.
        meta.write(lambda txn: txn.clear_writers())
    # Supervised, the gateway serves the node's metrics (this drain's included, from fsmeta).
    endpoint = (contextlib.nullcontext() if supervised
                else standalone_endpoint(settings.metrics_addr, CacheDir(cache_dir), meta))
    try:
        with endpoint:
            lost = trio.run(lambda: _run(cache_dir, meta, settings, until_empty=until_empty, supervised=supervised))
    except Exception as exc:
        # Raised inside _run's nursery, a StoreError arrives wrapped in an ExceptionGroup.
        leaves = exception_leaves(exc)
        if leaves and all(isinstance(leaf, StoreError) for leaf in leaves):
            print(f"ckptfs: drain: {leaves[0]}", file=sys.stderr)
            return 1
        raise
    finally:
        meta.close()
        os.close(lock_fd)
    if until_empty and lost:
        # Not empty, and never will be: these files' cache data is gone (see `ckptfs status`).
        print(f"ckptfs: drain: {len(lost)} files cannot be uploaded (a cache file lost data fsmeta "
              "recorded, or a marker waits for one; write them again or remove them):", file=sys.stderr)
        for path, code in sorted(lost.items()):
            print(f"  {code}: {path}", file=sys.stderr)
        return 2
    return 0

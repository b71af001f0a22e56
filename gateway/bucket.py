"""The gateway's view of the bucket: the async object store behind a blocking facade.

The core runs in FUSE worker threads and is synchronous; the object store
(``ckptfs.drain.store.ObjectStore``) is async (trio). :class:`BucketClient` runs the store
in a trio loop of its own, in one thread, and the core's threads call into it with
:meth:`BucketClient.call`. The FUSE loop never waits on the bucket, and a slow GET blocks
only the worker thread that asked for it.

Bytes fetched are written to cache files by the calling thread or by a worker thread of
the client's loop (``trio.to_thread``), never in a trio loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from ckptfs.drain.store import ListResult, ObjectInfo, ObjectStore

log = logging.getLogger("ckptfs.bucket")

T = TypeVar("T")


class BucketClient:
    """A store opened in a loop of its own; blocking calls from any other thread.

    ``make_store`` creates (but does not open) the store, e.g.
    ``lambda: open_store_for(settings)``.
    """

    def __init__(self, make_store: Callable[[], ObjectStore], *, name: str = "ckptfs-bucket"):
        self._make_store = make_store
        self._name = name
        self._store: ObjectStore | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> BucketClient:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"bucket client: the store did not open within {timeout:g} s")
        if self._failed is not None:
            raise self._failed
        return self

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        thread.join()

    def __enter__(self) -> BucketClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start(); a failure after start is logged
            if not self._ready.is_set():
                self._failed = exc
            else:
                log.exception("bucket client loop ended with an error")
        finally:
            self._ready.set()

    async def _main(self) -> None:
        async with self._make_store() as store:
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                self._store = store
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        self._store = None

    # -- calls -----------------------------------------------------------------------

    def in_its_thread(self) -> bool:
        """Whether the caller is the client's own loop (which must not wait for itself)."""
        return threading.current_thread() is self._thread

    @property
    def url(self) -> str:
        return self._need_store().url

    def _need_store(self) -> ObjectStore:
        if self._store is None or self._token is None:
            raise RuntimeError("bucket client is not started")
        return self._store

    def call(self, fn: Callable[[ObjectStore], Awaitable[T]]) -> T:
        """Run ``await fn(store)`` in the client's loop and return its result (blocking)."""
        store = self._need_store()

        async def run() -> T:
            return await fn(store)

        return trio.from_thread.run(run, trio_token=self._token)

    def submit(self, fn: Callable[[ObjectStore], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Start ``await fn(store)`` in the client's loop without waiting for it."""
        store = self._need_store()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = await fn(store)
            except BaseException as exc:  # handed to the waiter
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                future.set_result(result)

        trio.from_thread.run_sync(self._nursery.start_soon, run, trio_token=self._token)
        return future

    def head(self, key: str) -> ObjectInfo | None:
        return self.call(lambda store: store.head(key))

    def list(self, prefix: str = "", delimiter: str | None = None) -> ListResult:
        return self.call(lambda store: store.list(prefix, delimiter))

    def get_range(self, key: str, start: int, end: int, *, if_match: str | None = None) -> bytes:
        return self.call(lambda store: store.get_range(key, start, end, if_match=if_match))

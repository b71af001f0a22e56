"""Shared helpers of the drain tests (no tests here).

:class:`DrainEnv` is a cache directory driven by :class:`gateway.core.FsCore`
(no FUSE) plus a ``file://`` bucket in a temp dir; :meth:`DrainEnv.drain`
runs :class:`drain.worker.Drain` in-process under ``trio.run`` until the
queue is empty. :class:`RecStore` wraps the real store, records every call
(start and end, in order) and lets a test inject delays and failures.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, os.path.dirname(__file__))

from ckptfs.fsmeta import MetaStore, ROOT_INO  # noqa: E402
from ckptfs.fsmeta.settings import Settings  # noqa: E402
from ckptfs.gateway.core import Caller, FsCore  # noqa: E402

from ckptfs.drain.factory import open_store  # noqa: E402
from ckptfs.drain.worker import Drain  # noqa: E402

MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[1]
USER = Caller(uid=1234, gid=5678, umask=0o022)


class Crash(BaseException):
    """Stands in for a kill -9 of the drain: nothing in the drain catches it."""


class RecStore:
    """Delegates to a real store; records calls and runs per-operation hooks.

    ``events``: ``(op, key, phase, extra)`` in the order they happened, phase
    ``"start"`` or ``"end"``/``"error"``. ``hooks[op]`` is an async function
    ``hook(key, extra)`` run after the start is recorded and before the real
    call; it may sleep or raise.
    """

    OPS = ("put_object", "create_multipart", "upload_part", "complete_multipart", "abort_multipart",
           "copy", "delete", "delete_many", "head")

    def __init__(self, inner):
        self._inner = inner
        self.events: list[tuple[str, object, str, object]] = []
        self.hooks: dict = {}
        self.after_hooks: dict = {}  # op -> async fn(key, extra, result), run after the real call

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def _call(self, op, key, extra, fn):
        self.events.append((op, key, "start", extra))
        try:
            hook = self.hooks.get(op)
            if hook is not None:
                await hook(key, extra)
            result = await fn()
        except BaseException:
            self.events.append((op, key, "error", extra))
            raise
        self.events.append((op, key, "end", extra))
        after = self.after_hooks.get(op)
        if after is not None:
            await after(key, extra, result)
        return result

    async def put_object(self, key, data, metadata=None, **kw):
        return await self._call("put_object", key, None,
                                lambda: self._inner.put_object(key, data, metadata, **kw))

    async def create_multipart(self, key, metadata=None, **kw):
        return await self._call("create_multipart", key, None,
                                lambda: self._inner.create_multipart(key, metadata, **kw))

    async def upload_part(self, key, upload_id, part_number, path, offset, length, **kw):
        return await self._call("upload_part", key, part_number,
                                lambda: self._inner.upload_part(key, upload_id, part_number, path, offset, length, **kw))

    async def complete_multipart(self, key, upload_id, parts):
        return await self._call("complete_multipart", key, upload_id,
                                lambda: self._inner.complete_multipart(key, upload_id, parts))

    async def abort_multipart(self, key, upload_id):
        return await self._call("abort_multipart", key, upload_id,
                                lambda: self._inner.abort_multipart(key, upload_id))

    async def copy(self, src_key, dst_key, metadata=None, **kw):
        return await self._call("copy", dst_key, src_key,
                                lambda: self._inner.copy(src_key, dst_key, metadata, **kw))

    async def delete(self, key):
        return await self._call("delete", key, None, lambda: self._inner.delete(key))

    async def delete_many(self, keys):
        keys = list(keys)
        return await self._call("delete_many", tuple(keys), None, lambda: self._inner.delete_many(keys))

    async def head(self, key):
        return await self._call("head", key, None, lambda: self._inner.head(key))

    # -- queries ---------------------------------------------------------------------

    def calls(self, op: str, phase: str = "start") -> list:
        return [e[1] for e in self.events if e[0] == op and e[2] == phase]

    def extras(self, op: str, phase: str = "start") -> list:
        return [(e[1], e[3]) for e in self.events if e[0] == op and e[2] == phase]

    def written_keys(self) -> list[str]:
        """Keys whose content was sent (PUT or a multipart upload), in start order."""
        return [e[1] for e in self.events
                if e[0] in ("put_object", "create_multipart", "upload_part") and e[2] == "start"]

    def parts_sent(self) -> list[int]:
        """Part numbers of every upload_part call that returned."""
        return [e[3] for e in self.events if e[0] == "upload_part" and e[2] == "end"]

    def uploads(self) -> list[str]:
        """Like :meth:`written_keys`, without zero-byte directory markers."""
        return [k for k in self.written_keys() if not k.endswith("/")]

    def deleted_keys(self) -> list[str]:
        out = []
        for e in self.events:
            if e[2] != "start":
                continue
            if e[0] == "delete":
                out.append(e[1])
            elif e[0] == "delete_many":
                out.extend(e[1])
        return out

    def index(self, op: str, key, phase: str) -> list[int]:
        return [i for i, e in enumerate(self.events) if e[0] == op and e[1] == key and e[2] == phase]


class DrainEnv:
    """A cache directory filled through FsCore, and a file:// bucket."""

    def __init__(self, base: Path, **settings):
        self.base = base
        self.cache = base / "cache"
        self.bucket = base / "bucket"
        self.bucket.mkdir(parents=True, exist_ok=True)
        self.cache.mkdir(parents=True, exist_ok=True)
        values = dict(bucket_url=f"file://{self.bucket}", cache_dir=str(self.cache), settle_seconds=0,
                      part_size=5 * MiB, concurrency=4)
        values.update(settings)
        self.settings = Settings(**values)
        self.meta = MetaStore(str(self.cache / "meta"))
        self.meta.put_settings(self.settings.to_json())
        self.core = FsCore(str(self.cache), self.meta)

    def close(self) -> None:
        for of in list(self.core._open.values()):
            try:
                os.close(of.fd)
            except OSError:
                pass
        self.meta.close()

    # -- the filesystem side -------------------------------------------------------------

    def ino(self, path: str) -> int | None:
        with self.meta.read() as txn:
            return txn.resolve(path.encode())

    def parent_and_name(self, path: str) -> tuple[int, bytes]:
        head, _, name = path.rpartition("/")
        parent = self.ino(head) if head else ROOT_INO
        assert parent is not None, f"no directory {head!r}"
        return parent, name.encode()

    def mkdir(self, path: str, mode: int = 0o755) -> int:
        """mkdir -p."""
        cur = ROOT_INO
        for part in path.strip("/").split("/"):
            with self.meta.read() as txn:
                child = txn.lookup(cur, part.encode())
            if child is None:
                child = self.core.mkdir(cur, part.encode(), mode, USER).ino
            cur = child
        return cur

    def create(self, path: str, mode: int = 0o644) -> tuple[int, int]:
        """Create and open for writing: (fh, ino). Parent directories are made."""
        head = path.rpartition("/")[0]
        if head:
            self.mkdir(head)
        parent, name = self.parent_and_name(path)
        fh, attr = self.core.create(parent, name, mode, os.O_WRONLY, USER)
        return fh, attr.ino

    def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> int:
        """Create (or truncate) ``path``, write ``data`` in 1 MiB writes, close. Returns the ino."""
        ino = self.ino(path)
        if ino is None:
            fh, ino = self.create(path, mode)
        else:
            fh = self.core.open(ino, os.O_WRONLY | os.O_TRUNC)
        step = 1 * MiB
        for off in range(0, len(data), step):
            self.core.write(fh, off, data[off:off + step])
        self.core.release(fh)
        return ino

    def overwrite(self, path: str, offset: int, data: bytes) -> None:
        ino = self.ino(path)
        fh = self.core.open(ino, os.O_WRONLY)
        self.core.write(fh, offset, data)
        self.core.release(fh)

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        op, on = self.parent_and_name(old)
        np_, nn = self.parent_and_name(new)
        self.core.rename(op, on, np_, nn, flags)

    def unlink(self, path: str) -> None:
        self.core.unlink(*self.parent_and_name(path))

    def rmdir(self, path: str) -> None:
        self.core.rmdir(*self.parent_and_name(path))

    def state(self, path: str) -> str:
        return self.core.getxattr(self.ino(path), b"user.ckptfs.state").decode()

    def pending(self) -> dict:
        with self.meta.read() as txn:
            return {ino: rec for ino, rec in txn.iter_pending()}

    def tombstones(self) -> dict:
        with self.meta.read() as txn:
            return dict(txn.iter_tombstones())

    def upload_record(self, path: str):
        with self.meta.read() as txn:
            return txn.get_upload(self.ino(path))

    def cache_bytes(self, path: str) -> bytes:
        return (self.cache / "data" / f"{self.ino(path):x}").read_bytes()

    # -- the bucket side -------------------------------------------------------------------

    def store(self):
        return open_store(self.settings.bucket_url, checksum=self.settings.checksum)

    def listing(self, prefix: str = "") -> list[str]:
        async def run():
            async with self.store() as st:
                return [o.key for o in (await st.list(prefix)).objects]

        return trio.run(run)

    def head(self, key: str):
        async def run():
            async with self.store() as st:
                return await st.head(key)

        return trio.run(run)

    def open_uploads(self) -> list:
        async def run():
            async with self.store() as st:
                return await st.list_multipart_uploads("")

        return trio.run(run)

    def object_bytes(self, key: str) -> bytes:
        return (self.bucket / key).read_bytes()

    # -- the drain -----------------------------------------------------------------------------

    def make_drain(self, store, **overrides) -> Drain:
        settings = self.settings
        if overrides:
            settings = Settings(**{**settings.to_json(), **overrides})
        return Drain(str(self.cache), self.meta, settings, store)

    def drain(self, *, rec: RecStore | None = None, timeout: float = 20.0, setup=None, **overrides) -> RecStore:
        """Run a drain until the queue is empty; returns the recording store wrapper.

        ``setup(drain)`` may patch the Drain before it runs.
        """
        async def run():
            async with self.store() as inner:
                nonlocal rec
                if rec is None:
                    rec = RecStore(inner)
                else:
                    rec._inner = inner
                d = self.make_drain(rec, **overrides)
                if setup is not None:
                    setup(d)
                with trio.fail_after(timeout):
                    await d.run(until_empty=True)
            return rec

        return trio.run(run)


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll a (sync) predicate from trio, in a thread; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await trio.to_thread.run_sync(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        await trio.sleep(interval)


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out = []
        for e in exc.exceptions:
            out.extend(leaves(e))
        return out
    return [exc]


import pytest  # noqa: E402


@pytest.fixture
def denv(tmp_path, monkeypatch):
    from ckptfs.drain import worker

    monkeypatch.setattr(worker, "POLL_SECONDS", 0.01)
    env = DrainEnv(tmp_path)
    yield env
    env.close()

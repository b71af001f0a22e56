"""Model-based test of the drain: random namespace changes, drain steps, store faults and
crashes, against a ``file://`` bucket (no FUSE).

A Hypothesis state machine drives :class:`FsCore` and :class:`Drain` in-process. The model
is the namespace itself (read back through fsmeta and the core) plus the checkpoints saved
so far; the properties are what a checkpoint reader relies on:

* after every step, fsmeta's invariants hold (:func:`ckptfs.fsmeta.check.fsmeta_problems`);
* after every step, a visible commit marker never lies: a ``.metadata`` object names the
  save that wrote it, and every shard of that save is in the bucket, at that directory,
  with the content of that save (shards first, marker last; deletes the other way);
* after draining to empty with the faults off: the bucket is the namespace's projection
  (files and empty-directory markers; content hash, mode, uid and gid metadata), no
  multipart upload is left open, and no cache file is left without an inode.

A sequence this test finds must be kept, shrunk and written out as plain code, in
tests/regressions/ (``xfail(strict=True)`` until its defect is fixed).
Raise CKPTFS_DRAIN_MODEL_EXAMPLES (and set CKPTFS_DRAIN_MODEL_RANDOM=1) for a longer hunt.
"""

from __future__ import annotations

import contextlib
import os
import stat

import blake3
import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from conftest import RENAME_EXCHANGE, RENAME_NOREPLACE
from test_drain_support import MiB, USER, Crash, DrainEnv, RecStore

from ckptfs.drain import upload, worker
from ckptfs.drain.check import bucket_findings
from ckptfs.drain.store import StoreError
from ckptfs.fsmeta import ROOT_INO, MetaStore
from ckptfs.fsmeta.check import cache_file_findings, fsmeta_problems
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.gateway.core import FsCore, SetattrRequest
from ckptfs.gateway.errors import FsError

# Names collide on purpose, and any name may be a file at one step and a directory at the
# next (a key that turns from a file into a directory or back). No name starts with
# ".ckptfs-" (defect 4: such a name stops uploads on file://; its own regression test covers it).
NAMES = ["a", "b", "c", "d"]
DIR_PATHS = st.sampled_from(NAMES)  # directories are made at the top
PATHS = st.tuples(st.sampled_from(["", *NAMES]), st.sampled_from(NAMES)).map(
    lambda t: f"{t[0]}/{t[1]}" if t[0] else t[1])
PART = 5 * MiB
SMALL = st.binary(min_size=0, max_size=64)
# One size above the part size, so multipart uploads (and resets in a part) happen.
BIG = st.integers(0, 255).map(lambda b: bytes([b]) * (PART + 4096))
DATA = SMALL | SMALL | SMALL | BIG
RENAME_FLAGS = st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])

CHECKPOINTS = ["ck0", "ck1", "ck2"]
SHARDS = ["s0", "s1", "sub/s2"]
MARKER = ".metadata"

MUTATING = ("put_object", "create_multipart", "upload_part", "complete_multipart", "copy",
            "delete", "delete_many", "abort_multipart")


def h(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


class FaultyStore(RecStore):
    """The recording wrapper plus the faults a step switched on, and a step budget.

    ``budget``: mutating calls this drain run may start; the one after it either stops the
    drain (``stop`` is set: the drain cancels what is in flight) or, with ``crash``, raises
    :class:`Crash` out of the drain as a kill -9 would.
    """

    def __init__(self, inner):
        super().__init__(inner)
        self.slowdowns = 0  # next mutating calls answered 503 SlowDown
        self.denied_name: str | None = None  # keys containing this name: AccessDenied
        self.resets = 0  # next upload_part calls: the part lands, the answer is lost
        self.budget: int | None = None
        self.crash = False
        self.stop: trio.Event | None = None
        self.after_write = None  # async fn(store, op, key): checks the bucket while the drain runs

    def faults_off(self) -> None:
        self.slowdowns = self.resets = 0
        self.denied_name = None

    async def _call(self, op, key, extra, fn):
        if op in MUTATING:
            if self.budget is not None:
                if self.budget <= 0:
                    if self.crash:
                        raise Crash()
                    if self.stop is not None:
                        self.stop.set()
                self.budget -= 1
            if self.slowdowns > 0:
                self.slowdowns -= 1
                raise StoreError("injected throttle", code="SlowDown", status=503, op=op, key=str(key))
            keys = key if isinstance(key, tuple) else (key,)
            if (self.denied_name and op in ("put_object", "create_multipart", "copy")
                    and any(self.denied_name in str(k).split("/") for k in keys)):
                raise StoreError("injected denial", code="AccessDenied", status=403, op=op, key=str(key))
            if op == "upload_part" and self.resets > 0:
                self.resets -= 1
                await super()._call(op, key, extra, fn)
                raise StoreError("connection reset by peer", code="ConnectionError", retryable=True,
                                 op=op, key=str(key))
            result = await super()._call(op, key, extra, fn)
            if self.after_write is not None:
                await self.after_write(self._inner, op, key)
            return result
        return await super()._call(op, key, extra, fn)


class DrainModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.base = _BASE.make()
        self.env = DrainEnv(self.base, settle_seconds=0, part_size=PART, concurrency=2)
        self.rec: FaultyStore | None = None
        self.saves: dict[int, dict[str, bytes]] = {}  # save id -> shard -> content
        self.next_save = 1
        self.crash_count = 0  # drain runs that ended in a Crash
        self.violation: str | None = None  # seen by a check while the drain ran

    # -- helpers ---------------------------------------------------------------------------

    @property
    def core(self):
        return self.env.core

    def ino(self, path: str) -> int | None:
        return self.env.ino(path)

    def parent_and_name(self, path: str) -> tuple[int | None, bytes]:
        head, _, name = path.rpartition("/")
        return (self.ino(head) if head else ROOT_INO), name.encode()

    def fs(self, fn, *args):
        """One namespace operation; an errno the core answers is a valid outcome here
        (test_model_fs checks which one against a local filesystem)."""
        try:
            return fn(*args)
        except FsError:
            return None

    def write_whole(self, path: str, data: bytes) -> None:
        ino = self.ino(path)
        if ino is None:
            parent, name = self.parent_and_name(path)
            if parent is None:
                return
            created = self.fs(self.core.create, parent, name, 0o644, os.O_WRONLY, USER)
            if created is None:
                return
            fh = created[0]
        else:
            fh = self.fs(self.core.open, ino, os.O_WRONLY | os.O_TRUNC)
            if fh is None:
                return
        try:
            for off in range(0, len(data), 1 * MiB):
                self.core.write(fh, off, data[off:off + MiB])
        finally:
            self.core.release(fh)

    def mkdir_p(self, path: str) -> int | None:
        cur = ROOT_INO
        for part in path.split("/"):
            child = self.fs(self.core.lookup, cur, part.encode())
            if child is None:
                child = self.fs(self.core.mkdir, cur, part.encode(), 0o755, USER)
            if child is None or not stat.S_ISDIR(child.mode):
                return None
            cur = child.ino
        return cur

    def store_run(self, fn):
        async def run():
            async with self.env.store() as st_:
                return await fn(st_)

        return trio.run(run)

    def run_drain(self, *, budget: int | None, crash: bool = False) -> None:
        async def run():
            async with self.env.store() as inner:
                if self.rec is None:
                    self.rec = FaultyStore(inner)
                    self.rec.after_write = self.check_markers_during_drain
                self.rec._inner = inner
                self.rec.events.clear()
                self.rec.budget, self.rec.crash = budget, crash
                self.rec.stop = stop = trio.Event()
                drain = self.env.make_drain(self.rec)
                with trio.fail_after(30):
                    await drain.run(until_empty=True, stop=stop)

        try:
            trio.run(run)
        except BaseException as exc:  # noqa: BLE001 - a Crash may come wrapped in groups
            if self.violation is None and not all(isinstance(e, Crash) for e in _leaves(exc)):
                raise
            self.crash_count += 1
        finally:
            if self.rec is not None:
                self.rec.budget = None
        assert self.violation is None, self.violation

    # -- the bucket ------------------------------------------------------------------------

    def bucket_objects(self) -> dict[str, bytes]:
        return self.read_objects(self.env.listing())

    def read_objects(self, keys: list[str]) -> dict[str, bytes]:
        bucket = self.env.bucket
        return {k: (b"" if k.endswith("/") else (bucket / k).read_bytes()) for k in keys}

    def projection(self) -> dict[str, tuple[bytes | None, int, int, int]]:
        """key -> (content or None for a directory marker, mode, uid, gid) of the namespace."""
        out = {}
        with self.env.meta.read() as txn:
            items = list(txn.iter_subtree(ROOT_INO))
            inodes = {ino: txn.get_inode(ino) for _, ino in items}
        for rel, ino in items:
            inode = inodes[ino]
            path = rel.decode()
            if inode.is_dir:
                with self.env.meta.read() as txn:
                    empty = txn.dir_is_empty(ino)
                if empty:
                    out[path + "/"] = (None, inode.mode, inode.uid, inode.gid)
            elif inode.is_reg:
                fh = self.core.open(ino, os.O_RDONLY)
                try:
                    content = self.core.read(fh, 0, inode.size + 1)
                finally:
                    self.core.release(fh)
                out[path] = (content, inode.mode, inode.uid, inode.gid)
        return out

    # -- namespace rules -------------------------------------------------------------------

    @rule(path=PATHS, data=DATA)
    def write_file(self, path, data):
        """create+write, or rewrite from the start (O_TRUNC) of an existing file."""
        self.write_whole(path, data)

    @rule(path=PATHS, offset=st.sampled_from([0, 3, 100]), data=SMALL)
    def overwrite(self, path, offset, data):
        ino = self.ino(path)
        if ino is None:
            return
        fh = self.fs(self.core.open, ino, os.O_WRONLY)
        if fh is None:
            return
        try:
            self.core.write(fh, offset, data)
        finally:
            self.core.release(fh)

    @rule(path=PATHS, size=st.sampled_from([0, 1, 10, 200]))
    def truncate(self, path, size):
        ino = self.ino(path)
        if ino is not None:
            self.fs(self.core.setattr, ino, SetattrRequest(size=size))

    @rule(path=PATHS, mode=st.sampled_from([0o600, 0o644, 0o755]))
    def chmod(self, path, mode):
        ino = self.ino(path)
        if ino is not None:
            self.fs(self.core.setattr, ino, SetattrRequest(mode=mode))

    @rule(old=PATHS, new=PATHS, flags=RENAME_FLAGS)
    def rename(self, old, new, flags):
        op, on = self.parent_and_name(old)
        np_, nn = self.parent_and_name(new)
        if op is None or np_ is None:
            return
        self.fs(self.core.rename, op, on, np_, nn, flags)

    @rule(old=PATHS, new=PATHS)
    def link(self, old, new):
        ino = self.ino(old)
        np_, nn = self.parent_and_name(new)
        if ino is None or np_ is None:
            return
        self.fs(self.core.link, ino, np_, nn)

    @rule(path=PATHS)
    def unlink(self, path):
        parent, name = self.parent_and_name(path)
        if parent is not None:
            self.fs(self.core.unlink, parent, name)

    @rule(old=DIR_PATHS, new=DIR_PATHS, flags=RENAME_FLAGS)
    def rename_dir(self, old, new, flags):
        self.fs(self.core.rename, ROOT_INO, old.encode(), ROOT_INO, new.encode(), flags)

    @rule(path=DIR_PATHS)
    def mkdir(self, path):
        parent, name = self.parent_and_name(path)
        if parent is not None:
            self.fs(self.core.mkdir, parent, name, 0o755, USER)

    @rule(path=DIR_PATHS)
    def rmdir(self, path):
        parent, name = self.parent_and_name(path)
        if parent is not None:
            self.fs(self.core.rmdir, parent, name)

    # -- checkpoints -----------------------------------------------------------------------

    @rule(ck=st.sampled_from(CHECKPOINTS), contents=st.lists(DATA, min_size=len(SHARDS), max_size=len(SHARDS)))
    def save_checkpoint(self, ck, contents):
        """A trainer saving into ``ck``: every shard, then the marker."""
        if self.mkdir_p(ck + "/sub") is None:
            return
        save = self.next_save
        self.next_save += 1
        shards = dict(zip(SHARDS, contents))
        for shard, data in shards.items():
            self.write_whole(f"{ck}/{shard}", data)
        self.saves[save] = shards
        self.write_whole(f"{ck}/{MARKER}", f"save {save}".encode())

    @rule(old=st.sampled_from(CHECKPOINTS), new=st.sampled_from(CHECKPOINTS), flags=RENAME_FLAGS)
    def rename_checkpoint(self, old, new, flags):
        self.fs(self.core.rename, ROOT_INO, old.encode(), ROOT_INO, new.encode(), flags)

    # -- the drain, the store, crashes -------------------------------------------------------

    @rule(budget=st.integers(0, 12))
    def drain_some(self, budget):
        """The drain works for a while (``budget`` store writes), then stops mid-flight."""
        self.run_drain(budget=budget)

    @rule(budget=st.integers(0, 12))
    def drain_crashes(self, budget):
        """The drain is killed after ``budget`` store writes: its memory is gone."""
        self.run_drain(budget=budget, crash=True)

    @precondition(lambda self: self.rec is None or self.rec.denied_name is None)
    @rule()
    def drain_until_empty(self):
        """(Not while a key is denied: the drain retries it for ever, as it should.)"""
        self.run_drain(budget=None)

    @rule(kind=st.sampled_from(["slowdown", "denied", "reset"]), n=st.integers(1, 3),
          name=st.sampled_from(NAMES + ["s1"]))
    def store_fault(self, kind, n, name):
        if self.rec is None:
            self.run_drain(budget=0)  # creates the wrapper
        if kind == "slowdown":
            self.rec.slowdowns = n
        elif kind == "reset":
            self.rec.resets = n
        else:
            self.rec.denied_name = name

    @rule()
    def store_heals(self):
        if self.rec is not None:
            self.rec.faults_off()

    @rule(lose_unflushed=st.booleans(), path=PATHS, data=SMALL)
    def gateway_crashes(self, lose_unflushed, path, data):
        """The gateway dies (handles, lookup counts gone) and restarts with recover().

        With ``lose_unflushed``, a file was being written when it died: its bytes past the
        last recorded size are not acknowledged, recovery cuts them off.
        """
        if lose_unflushed:
            ino = self.ino(path)
            fh = self.fs(self.core.open, ino, os.O_WRONLY) if ino is not None else None
            if fh is not None:
                self.core.write(fh, 0, data + b"unflushed")
        env = self.env
        for of in list(env.core._open.values()):
            with contextlib.suppress(OSError):
                os.close(of.fd)
        env.meta.close()
        env.meta = MetaStore(str(env.cache / "meta"))
        env.core = FsCore(str(env.cache), env.meta)
        env.core.recover()

    # -- properties ------------------------------------------------------------------------

    @invariant()
    def fsmeta_is_consistent(self):
        assert fsmeta_problems(self.env.meta) == []

    async def check_markers_during_drain(self, store, op, key):
        # A reader may list the bucket between any two requests of the drain.
        # A violation is kept and the drain stopped, so that the failure Hypothesis sees is the
        # same AssertionError on every replay, not one shape of exception group or another.
        keys = [o.key for o in (await store.list()).objects]
        try:
            self.check_markers(self.read_objects(keys), f"after {op} {key}")
        except AssertionError as exc:
            if self.violation is None:
                self.violation = str(exc)
            self.rec.stop.set()

    @invariant()
    def visible_markers_tell_the_truth(self):
        self.check_markers(self.bucket_objects(), "between steps")

    def check_markers(self, objects: dict[str, bytes], when: str):
        for key, data in objects.items():
            directory, _, name = key.rpartition("/")
            if name != MARKER or not data.startswith(b"save "):
                continue
            save = int(data.split()[1])
            for shard, content in self.saves[save].items():
                shard_key = f"{directory}/{shard}"
                assert shard_key in objects, f"{when}: {key} (save {save}) is visible but {shard_key} is missing"
                assert objects[shard_key] == content, (
                    f"{when}: {key} (save {save}) is visible but {shard_key} has other content "
                    f"({len(objects[shard_key])} bytes, the save wrote {len(content)})")

    def teardown(self):
        try:
            if self.rec is not None:
                self.rec.faults_off()
            self.run_drain(budget=None)
            self.check_drained()
        finally:
            self.env.close()

    def check_drained(self):
        expected = self.projection()
        objects = self.bucket_objects()
        # A directory that held nothing once keeps its marker when it fills (harmless: S3 tools
        # take "d/" for the directory d); every other key must be the namespace's.
        with self.env.meta.read() as txn:
            extra_markers = {k for k in objects if k.endswith("/") and txn.resolve(k[:-1].encode()) is not None}
        assert sorted(set(expected) - set(objects)) == [], "missing from the bucket"
        assert sorted(set(objects) - set(expected) - extra_markers) == [], "in the bucket, not in the namespace"
        for key, (content, mode, uid, gid) in expected.items():  # (extra markers: no claim)
            info = self.env.head(key)
            if content is not None:
                assert objects[key] == content, key
                assert info.metadata.get("blake3") == h(content), key
            assert (info.metadata.get("mode"), info.metadata.get("uid"), info.metadata.get("gid")) == (
                str(mode), str(uid), str(gid)), key
        assert self.env.open_uploads() == []
        with self.env.meta.read() as txn:
            pending = list(txn.iter_pending())
            tombstones = list(txn.iter_tombstones())
            orphan_files = [name for name in os.listdir(self.env.cache / "data")
                            if txn.get_inode(int(name, 16)) is None]
        assert pending == [] and tombstones == []
        assert orphan_files == []
        # ckptfs fsck --bucket agrees: nothing to report on a drained cache.
        with self.env.meta.read() as txn:
            assert cache_file_findings(txn, str(self.env.cache / "data")) == []
        assert self.store_run(lambda store: bucket_findings(CacheDir(str(self.env.cache)), self.env.meta, store)) == []


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


class _Bases:
    """Fresh directories for each example, under the test's tmp_path."""

    root = None
    count = 0

    def make(self):
        _Bases.count += 1
        path = self.root / f"ex{_Bases.count}"
        path.mkdir()
        return path


_BASE = _Bases()


@pytest.fixture
def fast_drain(monkeypatch):
    """Retries and polls in milliseconds: the test exercises order, not patience."""
    monkeypatch.setattr(worker, "POLL_SECONDS", 0.002)
    monkeypatch.setattr(worker, "PERMANENT_RETRY_FIRST", 0.005)
    monkeypatch.setattr(worker, "PERMANENT_RETRY_SECONDS", 0.02)
    backoff = upload.RETRY_BACKOFF
    old = (backoff.base, backoff.cap)
    object.__setattr__(backoff, "base", 0.001)  # the default argument of retry_forever
    object.__setattr__(backoff, "cap", 0.01)
    yield
    object.__setattr__(backoff, "base", old[0])
    object.__setattr__(backoff, "cap", old[1])


def test_drain_model(tmp_path, fast_drain):
    _BASE.root = tmp_path
    run_state_machine_as_test(DrainModel, settings=settings(
        max_examples=int(os.environ.get("CKPTFS_DRAIN_MODEL_EXAMPLES", "30")),
        stateful_step_count=30,
        deadline=None,
        derandomize=not os.environ.get("CKPTFS_DRAIN_MODEL_RANDOM"),  # CI: the same examples every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    ))

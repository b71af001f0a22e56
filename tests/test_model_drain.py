"""Model-based test of the drain: random namespace changes, drain steps, store faults and
crashes, against a ``file://`` bucket (no FUSE).

A Hypothesis state machine drives :class:`FsCore` and :class:`Drain` in-process (by turns,
except that ``drain_while_changing`` makes a namespace change while a store call of the drain
is in flight, right after it landed and before the drain has its answer). The model
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
Raise CKPTFS_DRAIN_MODEL_EXAMPLES (and set CKPTFS_DRAIN_MODEL_RANDOM=1, and pass --hypothesis-seed=N
and --timeout=0) for a longer hunt: pytest-timeout stopping a hunt inside a step cuts a save off
halfway, and the marker check then reports the torn save the namespace itself holds.

A failure that depends on how the drain's concurrent tasks interleave may not come back when
Hypothesis replays it: it then reports the example as flaky and prints no steps. With
``CKPTFS_DRAIN_MODEL_TRACE=DIR``, each rule call is recorded, and the calls of an example whose
rule, invariant or teardown raises are written to ``DIR/<n>-<exception>.steps``, one call a line;
``python tests/test_model_drain.py replay FILE`` runs such a file again (invariants after each
step, then the teardown), as often as it takes to hit the interleaving, and
``python tests/test_model_drain.py shrink FILE MESSAGE`` deletes steps while a replay still
fails with MESSAGE (a few minutes; 121 steps usually come down to 5-10).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import itertools
import os
import pathlib
import re
import stat
import sys
import tempfile
import time

import blake3
import pytest
import trio
from conftest import RENAME_EXCHANGE, RENAME_NOREPLACE
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    INVARIANT_MARKER,
    RULE_MARKER,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_drain_support import USER, Crash, DrainEnv, MiB, RecStore

from ckptfs.drain import upload, worker
from ckptfs.drain.check import bucket_findings
from ckptfs.drain.filestore import FileStore
from ckptfs.drain.store import MOVING_PREFIX, StoreError
from ckptfs.drain.worker import Drain, object_metadata
from ckptfs.fsmeta import ROOT_INO, FileState, MetaStore, durability
from ckptfs.fsmeta.check import cache_file_findings, fsmeta_problems
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.gateway.bucket import BucketClient
from ckptfs.gateway.core import FsCore, SetattrRequest
from ckptfs.gateway.errors import FsError
from ckptfs.gateway.listing import FILE_MODE
from ckptfs.gateway.space import SpaceLimits

# Names collide on purpose, and any name may be a file at one step and a directory at the
# next (a key that turns from a file into a directory or back). No name starts with
# ".ckptfs-" (defect 4: such a name stops uploads on file://; its own regression test covers it).
NAMES = ["a", "b", "c", "d"]
# And long names, so that bucket keys reach S3's 1,024 bytes, past LMDB's 511-byte key limit
# (issue 34): two NAME_MAX-sized names of multi-byte UTF-8, up to four deep, and "a" below them.
# "U/U" is a 511-byte key, "U/U/a" 513; four long names make 1,019 to 1,023 bytes ("U/U/U/U/",
# a directory's marker, 1,024), and with "/a" 1,021 to 1,025: three U and a V 1,024, four U
# 1,025 (refused). Renaming the top directory V to U adds a byte to every key below it.
U = "ü" * 127 + "u"  # 255 bytes
V = "é" * 127  # 254 bytes
LONG_NAMES = [U, V]
DIR_PATHS = st.sampled_from(NAMES + LONG_NAMES)  # directories are made at the top
SHORT_PATHS = st.tuples(st.sampled_from(["", *NAMES]), st.sampled_from(NAMES)).map(
    lambda t: f"{t[0]}/{t[1]}" if t[0] else t[1])
# The keys at the limits: 511, 513, 1,023, 1,024 and 1,025 bytes.
AT_THE_LIMITS = [f"{U}/{U}", f"{U}/{U}/a", f"{U}/{U}/{U}/{U}", f"{U}/{U}/{U}/{V}/a", f"{U}/{U}/{U}/{U}/a"]
DEEP_PATHS = st.sampled_from(AT_THE_LIMITS) | st.tuples(
    st.integers(1, 4).flatmap(lambda n: st.lists(st.sampled_from(LONG_NAMES), min_size=n, max_size=n)),
    st.booleans()).map(lambda t: "/".join(t[0] + ["a"] * t[1]))
# Mostly short names, so that steps still collide on them.
PATHS = st.one_of(SHORT_PATHS, SHORT_PATHS, SHORT_PATHS, DEEP_PATHS)
PART = 5 * MiB
SMALL = st.binary(min_size=0, max_size=64)
# One size above the part size, so multipart uploads (and resets in a part) happen.
BIG = st.integers(0, 255).map(lambda b: bytes([b]) * (PART + 4096))
DATA = SMALL | SMALL | SMALL | BIG
RENAME_FLAGS = st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])
# Namespace changes the user makes while a drain's store call is in flight (rule name, its args)
CONCURRENT_CHANGES = st.one_of(
    st.tuples(st.just("rename"), PATHS, PATHS, RENAME_FLAGS),
    st.tuples(st.just("unlink"), PATHS),
    st.tuples(st.just("rmdir"), PATHS),
    st.tuples(st.just("mkdir"), PATHS),
    st.tuples(st.just("write_file"), PATHS, SMALL),
    st.tuples(st.just("link"), PATHS, PATHS),
    st.tuples(st.just("truncate"), PATHS, st.sampled_from([0, 1, 10])),
)

# ck3: a checkpoint whose marker and shards have keys over 511 bytes, below long names no other
# step makes: like the others, it moves only by rename_checkpoint, so that it stays a checkpoint
# (the marker check knows the saves of checkpoints only).
CK_PARENT = "ö" * 127 + "k"  # 255 bytes
CHECKPOINTS = ["ck0", "ck1", "ck2", f"{CK_PARENT}/{CK_PARENT}/ck3"]
SHARDS = ["s0", "s1", "sub/s2"]
MARKER = ".metadata"
# Seconds a drain of the model's few small files gets to empty; a hunt's shrink of a drain that
# never empties (TooSlowError) replays faster with less (CKPTFS_DRAIN_MODEL_DRAIN_TIMEOUT=8).
DRAIN_TIMEOUT = float(os.environ.get("CKPTFS_DRAIN_MODEL_DRAIN_TIMEOUT", "30"))


def checkpoints_holding(paths) -> set[str]:
    """The checkpoints (of CHECKPOINTS) that these paths are in."""
    return {ck for ck in CHECKPOINTS for path in paths if path.startswith(ck + "/")}


def saved_by(marker_content: bytes) -> int | None:
    """The save a marker's content names (``save N``, as ``save_checkpoint`` writes it); None
    for anything else, e.g. a marker the user truncated or wrote (``save 3\\0\\0``, ``sav``)."""
    match = re.fullmatch(rb"save (\d+)", marker_content)
    return int(match[1]) if match else None


# The read path: the core lists the bucket (its clock is the model's: a step lets the TTL pass),
# another node writes into the bucket, the cache evicts.
TTL = 2.0
FOREIGN = {"uid": 1234, "gid": 5678, "mode": stat.S_IFREG | 0o640}  # what another node's drain writes
# Another node writes below the top directories: names local steps make too (a-d), and names
# only it makes (e, f: local steps reach those only through the directory's rename or rmdir).
FOREIGN_PATHS = st.tuples(st.sampled_from(NAMES), st.sampled_from([*NAMES, "e", "f"])).map("/".join)
RANGES = st.sampled_from([(0, None), (0, 10), (3, 50), (PART - 5, 100)])  # (offset, size; None: to the end)

# What the read-path rules did, over the whole run (printed at the end: with -s, a hunt shows
# that its reads reached the bucket, its evictions happened and its readers saw changes).
EVENTS: collections.Counter[str] = collections.Counter()


def event(what: str) -> None:
    EVENTS[what] += 1


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
        # [(n, fn)]: fn() runs once the n-th mutating call of this drain run has landed, before
        # the drain sees its answer (a user changing the namespace while a request is in flight)
        self.during: list[tuple[int, object]] = []
        self.writes = 0  # mutating calls of this drain run that landed

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
            self.writes += 1
            for due, change in [d for d in self.during if d[0] <= self.writes]:
                self.during.remove((due, change))
                change()
            return result
        return await super()._call(op, key, extra, fn)


class Reader:
    """A handle open for reading across steps, and the bytes it must read."""

    def __init__(self, fh: int, ino: int, content: bytes, key: str | None):
        self.fh, self.ino, self.content = fh, ino, content
        self.key = key  # the object it reads from (a REMOTE file), else None
        self.may_fail = False  # another node replaced or deleted that object since the open


class DrainModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.base = _BASE.make()
        self.env = DrainEnv(self.base, settle_seconds=0, part_size=PART, concurrency=2)
        self.skew = 0  # ns the model's clock is ahead of the wall clock (TTLs that passed)
        self.bucket_client = BucketClient(lambda: FileStore(str(self.env.bucket))).start()
        self.env.core = self.make_core()
        self.readers: list[Reader] = []
        self.rec: FaultyStore | None = None
        self.saves: dict[int, dict[str, bytes]] = {}  # save id -> shard -> content
        self.altered_saves: set[int] = set()  # saves whose files an exchange or a hard link changed: no marker check
        # Objects another node wrote over a name the namespace has, not listed here since.
        self.unlisted_overwrites: set[str] = set()
        self.next_save = 1
        self.crash_count = 0  # drain runs that ended in a Crash
        self.violation: str | None = None  # seen by a check while the drain ran
        self.trace: list[str] = []  # this example's rule calls (CKPTFS_DRAIN_MODEL_TRACE)

    # -- helpers ---------------------------------------------------------------------------

    @property
    def core(self):
        return self.env.core

    def clock(self) -> int:
        return time.time_ns() + self.skew

    def make_core(self) -> FsCore:
        """The gateway's core with the bucket as its namespace and a cache cap nothing reaches
        (its evictor evicts only when a step says so)."""
        core = FsCore(str(self.env.cache), self.env.meta, bucket=self.bucket_client, remote_ttl=TTL,
                      clock=self.clock)
        core.enable_space(SpaceLimits(cap=1 << 50, high=1 << 49, low=1 << 48, timeout=600.0, device_reserve=0))
        return core

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
        self.close_readers(ino)
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
            self.alter_saves_named_elsewhere(ino, path)
        try:
            for off in range(0, len(data), 1 * MiB):
                self.core.write(fh, off, data[off:off + MiB])
        finally:
            self.core.release(fh)

    def alter_saves_named_elsewhere(self, ino: int | None, written: str | None) -> None:
        """A write reaches ``ino`` under ``written``: under its other names in a checkpoint
        (a hard link, ``ln b/b ck2/s1``), the save that checkpoint's marker names no longer
        holds what the save wrote. The user changed the shard: the marker will vouch for the
        new content (the drain cannot know which save it was), so that save is not checked."""
        if ino is None:
            return
        with self.env.meta.read() as txn:
            names = {p.decode("utf-8", "surrogateescape") for p in txn.paths_of(ino)} - {written}
        for ck in checkpoints_holding(names):
            self.alter_save_of(ck)

    def alter_save_of(self, ck: str) -> bool:
        """The save ``ck``'s marker names no longer matches what ``ck`` holds. False: the marker
        changed on another node (which save it names is unknown)."""
        marker = self.ino(f"{ck}/{MARKER}")
        content = self.expected_content(marker)[0] if marker is not None and self.is_reg(marker) else b""
        if content is None:
            return False
        if (save := saved_by(content)) is not None:
            self.altered_saves.add(save)
        return True

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

    def run_drain(self, *, budget: int | None, crash: bool = False, during=()) -> None:
        async def run():
            async with self.env.store() as inner:
                if self.rec is None:
                    self.rec = FaultyStore(inner)
                    self.rec.after_write = self.check_markers_during_drain
                self.rec._inner = inner
                self.rec.events.clear()
                self.rec.budget, self.rec.crash = budget, crash
                self.rec.writes, self.rec.during = 0, list(during)
                self.rec.stop = stop = trio.Event()
                drain = Drain(str(self.env.cache), self.env.meta, self.env.settings, self.rec, clock=self.clock)
                with trio.fail_after(DRAIN_TIMEOUT):
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
                self.rec.during = []  # a change whose call never came is not made
        assert self.violation is None, self.violation

    # -- the bucket ------------------------------------------------------------------------

    def bucket_objects(self) -> dict[str, bytes]:
        return self.read_objects(self.env.listing())

    def read_objects(self, keys: list[str]) -> dict[str, bytes]:
        bucket = self.env.bucket
        out = {}
        for k in keys:
            try:
                out[k] = b"" if k.endswith("/") else (bucket / k).read_bytes()
            except FileNotFoundError:
                continue  # deleted since the listing (the drain runs two requests at once)
        return out

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
        self.close_readers(ino)
        fh = self.fs(self.core.open, ino, os.O_WRONLY)
        if fh is None:
            return
        self.alter_saves_named_elsewhere(ino, path)
        try:
            self.core.write(fh, offset, data)
        finally:
            self.core.release(fh)

    @rule(path=PATHS, size=st.sampled_from([0, 1, 10, 200]))
    def truncate(self, path, size):
        ino = self.ino(path)
        if ino is not None:
            self.close_readers(ino)
            self.alter_saves_named_elsewhere(ino, path)
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
        # A directory taking the name of a file another node has overwritten since the last
        # listing: a file:// bucket cannot hold that directory's marker next to the other
        # node's object (S3 can), and this node does not know it is there: the drain would
        # retry the marker for ever (drain model seed 419).
        is_dir = {path: (ino := self.ino(path)) is not None and self.is_dir(ino) for path in (old, new)}
        made_dirs = {new} if is_dir[old] else set()
        if flags & RENAME_EXCHANGE and is_dir[new]:
            made_dirs.add(old)
        if made_dirs & self.unlisted_overwrites:
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

    @rule(path=DEEP_PATHS, data=DATA)
    def write_deep(self, path, data):
        """``mkdir -p`` and a write: a run, experiment and config-hash tree whose keys come
        near, reach or pass 1,024 bytes."""
        if self.mkdir_p(path.rpartition("/")[0]) is not None:
            self.write_whole(path, data)
        length = len(path.encode())
        band = ("over 1,024" if length > 1024 else "1,024" if length == 1024 else "1,000-1,023" if length >= 1000
                else "512-999" if length > 511 else "up to 511")
        event(f"deep write, key of {band} bytes" + ("" if self.ino(path) is not None else ": not made"))

    @rule(path=PATHS)
    def mkdir_below(self, path):
        """A directory inside a directory: renames then move whole subtrees with their files."""
        self.mkdir(path)

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
        inos = [ino for ino in (self.ino(f"{ck}/{shard}") for shard in shards) if ino is not None]
        if len(set(inos)) < len(inos):
            self.altered_saves.add(save)  # two shards are one file (a hard link): the last write won
        self.write_whole(f"{ck}/{MARKER}", f"save {save}".encode())

    @rule(old=st.sampled_from(CHECKPOINTS), new=st.sampled_from(CHECKPOINTS), flags=RENAME_FLAGS)
    def rename_checkpoint(self, old, new, flags):
        op, on = self.parent_and_name(old)
        np_, nn = self.parent_and_name(new)
        if op is not None and np_ is not None:
            self.fs(self.core.rename, op, on, np_, nn, flags)

    # -- the drain, the store, crashes -------------------------------------------------------

    @rule(budget=st.integers(0, 12))
    def drain_some(self, budget):
        """The drain works for a while (``budget`` store writes), then stops mid-flight."""
        self.run_drain(budget=budget)

    @rule(budget=st.integers(1, 12), at=st.integers(1, 6), change=CONCURRENT_CHANGES)
    def drain_while_changing(self, budget, at, change):
        """The user changes the namespace while the drain works: right after the ``at``-th
        store write of this run lands, before the drain has its answer or has committed it
        (the drain and the gateway are separate processes in use; only the store call's
        await separates them here)."""
        name, *args = change

        def make_change() -> None:
            event(f"changed while the drain ran: {name}")
            getattr(self, name)(*args)

        self.run_drain(budget=budget, during=[(at, make_change)])

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
        self.readers.clear()  # their handles die with the gateway
        if lose_unflushed:
            ino = self.ino(path)
            fh = self.fs(self.core.open, ino, os.O_WRONLY) if ino is not None else None
            if fh is not None:
                self.alter_saves_named_elsewhere(ino, path)
                self.core.write(fh, 0, data + b"unflushed")
        env = self.env
        for of in list(env.core._open.values()):
            with contextlib.suppress(OSError):
                os.close(of.fd)
        env.meta.close()
        env.meta = MetaStore(str(env.cache / "meta"))
        env.core = self.make_core()
        env.core.recover()

    # -- another node, the listing TTL, reads and evictions -----------------------------------

    def bucket_object(self, key: str) -> tuple[bytes, str] | None:
        """(content, etag) of the object at ``key`` now, or None."""
        info = self.bucket_client.head(key)
        return None if info is None else ((self.env.bucket / key).read_bytes(), info.etag)

    def close_readers(self, ino: int | None) -> None:
        """A local write to a file a reader holds: the reader closes first (what it then must
        read is test_model_fs's to check)."""
        for reader in [r for r in self.readers if r.ino == ino]:
            self.close_reader(reader)

    def close_reader(self, reader: Reader) -> None:
        self.readers.remove(reader)
        try:
            self.core.release(reader.fh)
        except FsError as exc:
            assert reader.may_fail and exc.errno in (errno.ESTALE, errno.EIO), exc

    def expected_content(self, ino: int) -> tuple[bytes | None, str | None]:
        """What a read of ``ino`` must return, and the object it reads from (REMOTE). None:
        the object changed (or went) since it was listed: the read may fail (ESTALE, EIO)."""
        with self.env.meta.read() as txn:
            inode = txn.get_inode(ino)
            record = txn.get_remote(ino)
        if inode.state == FileState.REMOTE:
            if record is None:
                # Its object went before the drain could move it (RemoteObjectGone): nothing
                # holds its content any more.
                return None, None
            obj = self.bucket_object(record.key)
            if obj is None or obj[1] != record.etag:
                return None, record.key
            return obj[0], record.key
        with open(self.core.cache.data_path(ino), "rb") as f:
            data = f.read(inode.size)
        return data + bytes(inode.size - len(data)), None

    def read_through_core(self, ino: int, offset: int, size: int | None) -> bytes:
        fh = self.core.open(ino, os.O_RDONLY)
        try:
            return self.core.read(fh, offset, (1 << 30) if size is None else size)
        finally:
            self.core.release(fh)

    def check_read(self, path: str, offset: int = 0, size: int | None = None) -> bytes | None:
        """Read ``path`` (a range of it) through the core: the bytes its content says, or, only
        for an object changed in the bucket since it was listed, ESTALE or EIO."""
        ino = self.ino(path)
        if ino is None or not self.is_reg(ino):
            return None
        expected, key = self.expected_content(ino)
        try:
            got = self.read_through_core(ino, offset, size)
        except FsError as exc:
            assert expected is None and exc.errno in (errno.ESTALE, errno.EIO), f"read {path}: {exc}"
            event(f"read of an object changed since its listing: {errno.errorcode[exc.errno]}")
            return None
        with self.env.meta.read() as txn:
            lost = durability.is_remote_lost(txn, txn.get_inode(ino))
        assert not lost, f"read {path}: its content is lost, yet the read returned {len(got)} bytes"
        event("read of a remote file" if key is not None else "read of a cached file")
        if expected is not None:
            want = expected[offset:] if size is None else expected[offset:offset + size]
            assert got == want, f"read {path} [{offset}, +{size}): {len(got)} bytes, not the content ({key=})"
        return expected

    def is_dir(self, ino: int) -> bool:
        with self.env.meta.read() as txn:
            inode = txn.get_inode(ino)
        return inode is not None and inode.is_dir

    def is_reg(self, ino: int) -> bool:
        with self.env.meta.read() as txn:
            inode = txn.get_inode(ino)
        return inode is not None and inode.is_reg

    def shape_conflict(self, key: str) -> bool:
        """``key`` cannot show in the namespace: a local file sits where it needs a directory,
        or a local directory where it is a file (the listing shows one shape per name)."""
        with self.env.meta.read() as txn:
            parts = key.split("/")
            for i in range(1, len(parts)):
                ino = txn.resolve("/".join(parts[:i]).encode())
                if ino is not None and not txn.get_inode(ino).is_dir:
                    return True
            ino = txn.resolve(key.encode())
            return ino is not None and txn.get_inode(ino).is_dir

    @rule(path=FOREIGN_PATHS, data=SMALL | SMALL | BIG, with_metadata=st.booleans())
    def other_node_writes(self, path, data, with_metadata):
        """Another node's drain (metadata and blake3) or another tool (none) puts ``path``:
        new, or over what is there (a new ETag), or where a local file of that name is.

        Only below a directory (or where one can be), and only a name no local step makes
        (or one a local file has now): a file:// bucket cannot hold "a" and "a/b" at once (S3 can), so a
        name that one side makes a file and the other a directory would stop the drain."""
        directory, name = path.split("/")
        local_dir = self.ino(directory)
        local_file = self.ino(path)
        if (local_dir is not None and not self.is_dir(local_dir)) or (
                name in NAMES and (local_file is None or not self.is_reg(local_file))):
            return
        keys = self.env.listing()
        if any(k.startswith(path + "/") or path.startswith(k.rstrip("/") + "/") for k in keys):
            return
        if any(k == directory or k.startswith(directory + "/") for k in self.env.tombstones()):
            # A local delete not drained yet shadows that directory (rmdir a: "a/" is still
            # to delete): the new name would not show, and a local file could take the name.
            return
        metadata = object_metadata(FOREIGN["mode"], FOREIGN["uid"], FOREIGN["gid"], time.time_ns(),
                                   blake3=h(data)) if with_metadata else {}
        new = self.bucket_client.head(path) is None
        try:
            self.bucket_client.call(lambda store: store.put_object(path, data, metadata))
        except StoreError as exc:
            assert exc.code == "KeyConflict", exc
            return  # a file:// bucket cannot hold "a" and "a/b" at once (S3 can)
        self.foreign_changed(path)
        if new:
            # A new name shows here before any local step could give it the other shape
            # (a local file "a" over another node's "a/b": S3 holds both, a file:// bucket
            # cannot, and the drain would retry that upload for ever).
            self.ttl_passes()
        else:
            self.unlisted_overwrites.add(path)

    @rule(path=FOREIGN_PATHS)
    def other_node_deletes(self, path):
        if self.bucket_client.head(path) is not None:
            self.bucket_client.call(lambda store: store.delete(path))
            self.foreign_changed(path)

    def foreign_changed(self, key: str) -> None:
        for reader in self.readers:
            if reader.key == key:
                reader.may_fail = True

    @rule()
    def ttl_passes(self):
        """The listing TTL passes and every directory is looked at (listed again)."""
        self.skew += int((TTL + 0.1) * 1e9)
        self.list_everything()
        self.check_remote_view()

    def list_everything(self) -> None:
        self.unlisted_overwrites.clear()
        todo = [ROOT_INO]
        while todo:
            fh = self.core.opendir(todo.pop())
            try:
                for _, attr, _ in self.core.readdir(fh, 0):
                    if stat.S_ISDIR(attr.mode):
                        todo.append(attr.ino)
            finally:
                self.core.releasedir(fh)

    def pick_file(self, pick: int) -> str | None:
        """One of the namespace's regular files (the steps below reach every file, also those
        other nodes or the checkpoints made, not only the names PATHS draws)."""
        with self.env.meta.read() as txn:
            files = sorted(rel.decode() for rel, ino in txn.iter_subtree(ROOT_INO) if txn.get_inode(ino).is_reg)
        return files[pick % len(files)] if files else None

    @rule(pick=st.integers(0, 99), where=RANGES)
    def read(self, pick, where):
        """A whole-file or ranged read (of a remote file: fetched from the bucket)."""
        path = self.pick_file(pick)
        if path is not None:
            self.check_read(path, *where)

    @precondition(lambda self: len(self.readers) < 2)
    @rule(pick=st.integers(0, 99))
    def open_reader(self, pick):
        path = self.pick_file(pick)
        ino = self.ino(path) if path is not None else None
        if ino is None:
            return
        content, key = self.expected_content(ino)
        if content is None:
            return
        fh = self.fs(self.core.open, ino, os.O_RDONLY)
        if fh is not None:
            self.readers.append(Reader(fh, ino, content, key))

    @precondition(lambda self: self.readers)
    @rule(i=st.integers(0, 1), where=RANGES)
    def reader_reads(self, i, where):
        """An open reader goes on reading, whatever happened since it opened (renames,
        evictions, listings); only its object replaced or deleted by another node may fail it."""
        reader = self.readers[i % len(self.readers)]
        offset, size = where
        try:
            got = self.core.read(reader.fh, offset, (1 << 30) if size is None else size)
        except FsError as exc:
            assert reader.may_fail and exc.errno in (errno.ESTALE, errno.EIO), f"open reader of {reader.key}: {exc}"
            event("open reader failed: its object changed")
            return
        event("open reader read")
        want = reader.content[offset:] if size is None else reader.content[offset:offset + size]
        assert got == want, f"open reader of {reader.key}: {len(got)} bytes, not the content"

    @precondition(lambda self: self.readers)
    @rule(i=st.integers(0, 1))
    def reader_closes(self, i):
        self.close_reader(self.readers[i % len(self.readers)])

    @rule(pick=st.integers(0, 99))
    def evict(self, pick):
        """The cache evicts a file now (as above its high watermark): only a clean file
        nobody has open goes, and it reads back the same bytes, from the bucket."""
        self.evict_file(self.pick_file(pick))

    def evict_file(self, path: str | None, *, read_back: bool = True) -> None:
        """(``read_back``: read it at once, which fetches it into the cache again.)"""
        ino = self.ino(path) if path is not None else None
        if ino is None:
            return
        before, _ = self.expected_content(ino)
        with self.env.meta.read() as txn:
            was = txn.get_inode(ino).state
        self.core.evict(ino)  # user.ckptfs.evict
        with self.env.meta.read() as txn:
            now = txn.get_inode(ino).state
        if now != was and was != FileState.REMOTE:
            assert now == FileState.REMOTE and not os.path.exists(self.core.cache.data_path(ino))
            assert not any(r.ino == ino for r in self.readers), "an open file was evicted"
            event("evicted" + (" (another file open for reading)" if self.readers else ""))
        if read_back:
            after = self.check_read(path)
            assert before is None or after is None or after == before, f"{path} reads other bytes after its eviction"

    @rule(first=st.integers(0, 99), second=st.integers(0, 99))
    def exchange_two_evicted_files(self, first, second):
        """Two files the cache no longer holds swap names: a rename cycle that only the bucket's
        objects can break (the drain parks one of them aside), also a checkpoint's marker and
        its shard (the marker waits for the shard, the shard for the marker's object)."""
        a, b = self.pick_file(first), self.pick_file(second)
        if a is None or b is None or a == b:
            return
        # A checkpoint's files change: the saves its marker names are no longer what its
        # directory holds (the bucket follows the namespace; the marker check cannot).
        for ck in checkpoints_holding((a, b)):
            if not self.alter_save_of(ck):
                return  # (another node changed its marker: which save it names is unknown)
        if self.rec is None or self.rec.denied_name is None:
            self.run_drain(budget=None)  # (clean files only are evicted: most are dirty otherwise)
        for path in (a, b):
            self.close_readers(self.ino(path))  # (an open file is not evicted)
        self.evict_file(a, read_back=False)  # (a read would fetch it into the cache again)
        self.evict_file(b, read_back=False)
        op, on = self.parent_and_name(a)
        np_, nn = self.parent_and_name(b)
        if op is None or np_ is None:
            return
        with self.env.meta.read() as txn:
            both_evicted = all(txn.get_inode(txn.resolve(p.encode())).state == FileState.REMOTE for p in (a, b))
        try:
            self.core.rename(op, on, np_, nn, RENAME_EXCHANGE)
        except FsError:
            return
        event("two evicted files exchanged" if both_evicted else "two files exchanged (not both evicted)")

    def check_remote_view(self) -> None:
        """Just after a listing: every object shows, with its content, unless a local change the
        drain has not finished shadows it; every settled file left has its object."""
        objects = {k: v for k, v in self.bucket_objects().items() if not k.endswith("/")}
        open_inos = {r.ino for r in self.readers}
        with self.env.meta.read() as txn:
            for key in objects:
                if self.shape_conflict(key):
                    continue
                ino = txn.resolve(key.encode())
                if ino is None:
                    assert self.shadowed(txn, key), f"{key} is in the bucket, not in the namespace"
                    continue
                inode = txn.get_inode(ino)
                if (inode.nlink != 1 or ino in open_inos or durability.pending_at_or_above(txn, ino)
                        or txn.get_remote(ino) is None):
                    continue
                record = txn.get_remote(ino)
                assert (record.key, record.etag) == (key, self.bucket_client.head(key).etag), (
                    f"{key}: fsmeta records {record.key} {record.etag} after the listing")
            settled_files = [
                (rel.decode(), ino) for rel, ino in txn.iter_subtree(ROOT_INO)
                if txn.get_inode(ino).is_reg and txn.get_inode(ino).nlink == 1 and ino not in open_inos
                and txn.get_remote(ino) is not None and not durability.pending_at_or_above(txn, ino)]
        for path, _ in settled_files:
            assert path in objects, f"{path}: settled here, gone from the bucket, still listed"
            self.check_read(path)

    @staticmethod
    def shadowed(txn, key: str) -> bool:
        """The object is the remains of a local unlink or rename the drain has not finished."""
        if txn.get_tombstone(key) is not None or txn.owner_of_remote_key(key) is not None:
            return True
        parts = key.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i]) + "/"
            if (next(txn.tombstones_below(prefix), None) is not None
                    or next(txn.remote_keys_below(prefix), None) is not None
                    and txn.resolve(prefix[:-1].encode()) is None):
                return True
        return False

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
            save = saved_by(data) if name == MARKER else None
            if save is None or save in self.altered_saves:
                continue
            for shard, content in self.saves[save].items():
                shard_key = f"{directory}/{shard}"
                assert shard_key in objects, f"{when}: {key} (save {save}) is visible but {shard_key} is missing"
                assert objects[shard_key] == content, (
                    f"{when}: {key} (save {save}) is visible but {shard_key} has other content "
                    f"({len(objects[shard_key])} bytes, the save wrote {len(content)})")

    def teardown(self):
        try:
            for reader in list(self.readers):
                self.close_reader(reader)
            if self.rec is not None:
                self.rec.faults_off()
            self.run_drain(budget=None)
            self.ttl_passes()  # what other nodes wrote is in the namespace now
            self.check_drained()
        finally:
            self.env.close()
            self.bucket_client.close()

    def check_drained(self):
        expected = self.projection()
        objects = self.bucket_objects()
        # A directory that held nothing once keeps its marker when it fills (harmless: S3 tools
        # take "d/" for the directory d); every other key must be the namespace's.
        with self.env.meta.read() as txn:
            extra_markers = {k for k in objects if k.endswith("/") and txn.resolve(k[:-1].encode()) is not None}
        # Another node's object where a local file has the other shape (a file where it needs a
        # directory) cannot show here, and is not ours to delete.
        hidden = {k for k in objects if not k.endswith("/") and self.shape_conflict(k)}
        assert sorted(set(expected) - set(objects)) == [], "missing from the bucket"
        assert self.env.listing(MOVING_PREFIX) == [], "objects parked to break a rename cycle are left"
        assert sorted(set(objects) - set(expected) - extra_markers - hidden) == [], "in the bucket, not in the namespace"
        for key, (content, mode, uid, gid) in expected.items():  # (extra markers: no claim)
            info = self.env.head(key)
            if content is not None:
                assert objects[key] == content, key
            if "mode" not in info.metadata:  # another tool's object: the defaults, and no hash
                assert content is not None and (mode, uid, gid) == (FILE_MODE, os.getuid(), os.getgid()), key
                continue
            if content is not None:
                # Another tool's object moved by a rename here gets our metadata, but no hash
                # (its content was never read): a hash that is there must be right.
                assert info.metadata.get("blake3", h(content)) == h(content), key
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

# -- tracing a hunt, and replaying what it found (see the module docstring) ----------------------

TRACE_DIR = os.environ.get("CKPTFS_DRAIN_MODEL_TRACE")
_TRACE_FILES = itertools.count(1)


def _compact(value) -> str:
    """``repr`` that writes a run of one byte as ``bytes([b]) * n`` (the BIG files)."""
    if isinstance(value, bytes) and len(value) > 16 and len(set(value)) == 1:
        n = len(value)
        return f"bytes([{value[0]}]) * ({f'PART + {n - PART}' if n > PART else n})"
    if isinstance(value, list):
        return "[" + ", ".join(_compact(v) for v in value) + "]"
    return repr(value)


def _keep_trace(machine: DrainModel, exc: BaseException) -> None:
    path = pathlib.Path(TRACE_DIR) / f"{next(_TRACE_FILES)}-{type(exc).__name__}.steps"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in machine.trace))


def _traced(name: str, fn):
    def call(self, **kwargs):
        self.trace.append(f"{name}({', '.join(f'{k}={_compact(v)}' for k, v in kwargs.items())})")
        try:
            return fn(self, **kwargs)
        except BaseException as exc:
            _keep_trace(self, exc)
            raise
    return call


def _traced_invariant(fn):
    """An invariant that fails writes the steps that led to it (it is not a step itself)."""
    def check(self):
        try:
            return fn(self)
        except BaseException as exc:
            _keep_trace(self, exc)
            raise
    return check


if TRACE_DIR:
    for _name, _method in list(vars(DrainModel).items()):
        if (_rule := getattr(_method, RULE_MARKER, None)) is not None:
            _rule.function = _traced(_name, _rule.function)
        if (_invariant := getattr(_method, INVARIANT_MARKER, None)) is not None:  # (a frozen dataclass)
            setattr(_method, INVARIANT_MARKER,
                    dataclasses.replace(_invariant, function=_traced_invariant(_invariant.function)))
    DrainModel.teardown = _traced("teardown", DrainModel.teardown)


def replay(steps_file: str) -> None:
    """Run the rule calls of ``steps_file`` (a trace) on a fresh model, the invariants after
    each, then the teardown (unless the trace ends in it): raises what the failing step raises."""
    invariants = [getattr(DrainModel, name) for name, method in vars(DrainModel).items()
                  if getattr(method, INVARIANT_MARKER, None) is not None]
    lines = [line for line in pathlib.Path(steps_file).read_text().splitlines() if line.strip()]
    with fast_drain_settings(), tempfile.TemporaryDirectory(prefix="ckptfs-replay-") as tmp:
        _BASE.root = pathlib.Path(tmp)
        machine = DrainModel()
        for number, line in enumerate(lines, 1):
            name, args = line.split("(", 1)
            print(f"step {number}: {line[:160]}", flush=True)
            getattr(machine, name)(**eval("dict(" + args, {"PART": PART}))  # (a trace this module wrote)
            if name == "teardown":
                return
            for check in invariants:
                check(machine)
        machine.teardown()


@contextlib.contextmanager
def fast_drain_settings():
    """Retries and polls in milliseconds: the test exercises order, not patience."""
    saved = (worker.POLL_SECONDS, worker.PERMANENT_RETRY_FIRST, worker.PERMANENT_RETRY_SECONDS)
    worker.POLL_SECONDS, worker.PERMANENT_RETRY_FIRST, worker.PERMANENT_RETRY_SECONDS = 0.002, 0.005, 0.02
    backoff = upload.RETRY_BACKOFF
    old = (backoff.base, backoff.cap)
    object.__setattr__(backoff, "base", 0.001)  # the default argument of retry_forever
    object.__setattr__(backoff, "cap", 0.01)
    try:
        yield
    finally:
        object.__setattr__(backoff, "base", old[0])
        object.__setattr__(backoff, "cap", old[1])
        worker.POLL_SECONDS, worker.PERMANENT_RETRY_FIRST, worker.PERMANENT_RETRY_SECONDS = saved


@pytest.fixture
def fast_drain():
    with fast_drain_settings():
        yield


def test_drain_model(tmp_path, fast_drain):
    _BASE.root = tmp_path
    EVENTS.clear()
    run_state_machine_as_test(DrainModel, settings=settings(
        max_examples=int(os.environ.get("CKPTFS_DRAIN_MODEL_EXAMPLES", "30")),
        stateful_step_count=int(os.environ.get("CKPTFS_DRAIN_MODEL_STEPS", "50")),
        deadline=None,
        derandomize=not os.environ.get("CKPTFS_DRAIN_MODEL_RANDOM"),  # CI: the same examples every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    ))
    print("read-path events:", dict(sorted(EVENTS.items())))


def shrink(steps_file: str, message: str, tries: int = 2) -> list[str]:
    """Delete steps of a trace (runs of 8, 4, 2, then 1, from the end) for as long as a replay
    still fails with ``message`` in its output (``tries`` replays each: a failure that depends
    on how the drain's tasks interleave may need more). Writes ``FILE.shrunk`` as it goes."""
    import subprocess

    out = pathlib.Path(steps_file + ".shrunk")
    attempt = pathlib.Path(steps_file + ".try")
    lines = [line for line in pathlib.Path(steps_file).read_text().splitlines()
             if line.strip() and not line.startswith("teardown")]

    def fails(candidate: list[str]) -> bool:
        attempt.write_text("".join(line + "\n" for line in candidate))
        for _ in range(tries):
            run = subprocess.run([sys.executable, __file__, "replay", str(attempt)], capture_output=True, text=True)
            if message in run.stdout + run.stderr:
                return True
        return False

    if not fails(lines):
        raise SystemExit(f"{steps_file} does not fail with {message!r}")
    changed = True
    while changed:
        changed = False
        for run_length in (8, 4, 2, 1):
            end = len(lines)
            while end > 0:
                candidate = lines[:max(0, end - run_length)] + lines[end:]
                if candidate and fails(candidate):
                    lines, changed = candidate, True
                    out.write_text("".join(line + "\n" for line in lines))
                    print(f"{len(lines)} steps", flush=True)
                end -= run_length
    attempt.unlink(missing_ok=True)
    out.write_text("".join(line + "\n" for line in lines))
    return lines


if __name__ == "__main__" and sys.argv[1:2] == ["replay"] and len(sys.argv) == 3:
    replay(sys.argv[2])
    print("replayed without a failure")
elif __name__ == "__main__" and sys.argv[1:2] == ["shrink"] and len(sys.argv) == 4:
    print("".join(line + "\n" for line in shrink(sys.argv[2], sys.argv[3])), end="")

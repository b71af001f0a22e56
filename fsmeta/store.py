"""The fsmeta LMDB environment: opening, multi-process rules, transactions.

Rules this module enforces (why, briefly):

* One environment per process, opened after any fork: LMDB's lock table is per
  process. The gateway and the drain each open ``CACHE/meta`` themselves.
* Write transactions are run through :meth:`MetaStore.write`, which takes a
  function and re-runs it after growing the map on ``MapFullError``; the
  function therefore must only touch the transaction. Other processes see
  ``MapResizedError`` and adopt the new size with ``set_mapsize(0)``.
* ``set_mapsize`` is only legal while no transaction of this process is live
  (LMDB remaps the file under them). Every transaction holds a shared turn of
  :class:`_TxnGate`; growing or adopting the map takes it exclusively, waiting
  for the transactions of other threads to finish.
* A process killed inside a read transaction leaves its reader slot behind,
  which pins the oldest snapshot so the file grows with every commit.
  ``reader_check()`` clears such slots at open and then every
  ``READER_CHECK_SECONDS`` of writes.
* Commits fsync the data pages but not the meta page (``metasync=False``):
  the database stays consistent after a power cut and may lose only the last
  transaction; :meth:`MetaStore.sync` forces that too, and fsync calls it.
  ``sync=False`` (MDB_NOSYNC) is never used: the meta page could reach the disk
  before the pages it points to, and a power cut would corrupt the database.
* Deferred commits (:meth:`MetaStore.defer_commits`, the gateway): a synced commit
  per operation costs an fdatasync, so every ``write`` of the process joins one
  open LMDB write transaction (each ``fn`` in a nested transaction of its own, so
  an ``fn`` that raises leaves nothing behind), which a committer thread commits
  after ``interval`` seconds, or at once for :meth:`commit`/:meth:`sync`.
  ``read`` sees that open transaction (read-your-writes). A crash loses the open
  transaction as a whole: what survives is always a prefix of the writes, in the
  order they were made. LMDB ties a write transaction to the thread that began it
  (the writer mutex), so only the committer thread begins and commits the batch;
  writers and readers use it in turn under ``_batch_lock``. :meth:`MetaStore.write_soon`
  queues a write nobody waits for; the next writer, or the committer, runs it in turn.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from typing import Callable, Iterator, Protocol, TypeVar

import lmdb

from . import schema
from .txn import Txn

T = TypeVar("T")
log = logging.getLogger("ckptfs.fsmeta")

DEFAULT_MAP_SIZE = 1 << 30  # grows on demand; address space only, not disk
MAX_MAP_SIZE = 1 << 40
READER_CHECK_SECONDS = 30.0
BATCH_IDLE_SECONDS = 0.002  # a batch with no write for this long is committed early
# write_soon's queued writes that one write runs before its own, and the committer before a
# commit: a burst of them (the FORGETs of a dropped dentry cache) delays no single request for
# long, and the rest wait for the next turn (the committer asks for another batch).
SOON_PER_WRITE = 64
SOON_PER_COMMIT = 512


class _Committer(threading.Thread):
    """Begins and commits the deferred batch of a :class:`MetaStore` (one per process).

    A batch opens when a writer asks for one and is committed ``interval`` seconds
    later, or ``BATCH_IDLE_SECONDS`` after its last write, or at once when someone
    waits for a commit. Between batches it holds no LMDB lock, so the drain's
    transactions get the writer lock at least once per interval.
    """

    def __init__(self, store: MetaStore, interval: float):
        super().__init__(name="fsmeta-committer", daemon=True)
        self.store = store
        self.interval = interval
        self.cond = threading.Condition()
        self.open_wanted = False
        self.commit_wanted = False
        self.stopping = False
        self.committed_seq = 0  # store._write_seq at the last commit
        self.error: BaseException | None = None  # of the last commit, for those waiting on it

    def request_batch(self) -> None:
        """Wait until a batch is open (it may already be committed again on return)."""
        with self.cond:
            if self.error is not None:
                raise self.error
            if self.store._batch is not None:
                return
            self.open_wanted = True
            self.cond.notify_all()
            while self.open_wanted and not self.stopping and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            if self.stopping:
                raise RuntimeError("fsmeta is closed")

    def want_batch(self) -> None:
        """Ask for a batch without waiting for it."""
        with self.cond:
            if not self.open_wanted:
                self.open_wanted = True
                self.cond.notify_all()

    def wait_committed(self, seq: int) -> None:
        """Wait until every write up to ``seq`` is committed; raise the commit's error."""
        with self.cond:
            while self.committed_seq < seq:
                if self.error is not None:
                    raise self.error
                if self.stopping and not self.is_alive():
                    raise RuntimeError("fsmeta is closed")
                self.commit_wanted = True
                self.cond.notify_all()
                self.cond.wait()
            if self.error is not None:
                raise self.error

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.commit_wanted = True
            self.cond.notify_all()
        self.join()

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # writers must not wait for a dead thread
            log.exception("fsmeta: the committer thread failed")
            with self.cond:
                self.error = self.error or OSError(errno.EIO, f"fsmeta: the committer thread failed: {exc}")
                self.stopping = True
                self.cond.notify_all()

    def _serve(self) -> None:
        store = self.store
        while True:
            with self.cond:
                while not self.open_wanted and not self.stopping:
                    self.cond.wait()
                if not self.open_wanted:
                    return
            with store._txn(write=True) as raw:
                opened = time.monotonic()
                with store._batch_lock:
                    store._batch = raw
                    store._last_write = opened
                with self.cond:
                    self.open_wanted = False
                    self.cond.notify_all()
                    while not (self.commit_wanted or self.stopping):
                        now = time.monotonic()
                        due = min(opened + self.interval, store._last_write + BATCH_IDLE_SECONDS)
                        if now >= due:
                            break
                        self.cond.wait(due - now)
                    self.commit_wanted = False
                with store._batch_lock:
                    # what write_soon queued and no write took
                    map_full = bool(store._soon) and store._run_soon(raw, SOON_PER_COMMIT)
                    more_soon = bool(store._soon)
                    seq = store._write_seq
                    hooks, store._after_commit = store._after_commit, []
                    error = None
                    try:
                        raw.commit()
                        store.commits += 1
                    except lmdb.Error as exc:  # the writes of this batch are lost
                        error = OSError(errno.EIO, f"fsmeta: a deferred commit failed: {exc}")
                    store._batch = None
            if error is not None:
                # Later writes would build on a state that no longer exists: refuse them
                # (EIO) until a restart recovers from what was committed.
                log.error("%s; its writes are lost, fsmeta refuses writes until restarted", error)
            elif map_full:
                store._grow()  # no write of its own may come to grow it for the queued ones
            else:
                store._grow_if_nearly_full()
            for hook in hooks if error is None else ():
                try:
                    hook()
                except Exception:
                    log.exception("fsmeta: an after-commit action failed")
            with self.cond:
                self.committed_seq = seq
                self.error = self.error or error
                if more_soon and error is None:
                    self.open_wanted = True  # the next batch runs the rest
                self.cond.notify_all()


class _TxnGate:
    """Shared turns for transactions, an exclusive one for remapping.

    A waiting remap holds back new transactions (else a busy gateway would starve it),
    except in a thread that already holds a turn: its nested transaction goes ahead,
    since the remap is waiting for that very thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._live = 0
        self._remaps_waiting = 0
        self._remapping = False
        self._held = threading.local()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._held, "depth", 0)
        with self._cond:
            while depth == 0 and (self._remapping or self._remaps_waiting):
                self._cond.wait()
            self._live += 1
        self._held.depth = depth + 1
        try:
            yield
        finally:
            self._held.depth = depth
            with self._cond:
                self._live -= 1
                if self._live == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._held, "depth", 0):
            raise RuntimeError("fsmeta: the map cannot be resized from inside a transaction")
        with self._cond:
            self._remaps_waiting += 1
            try:
                while self._remapping or self._live:
                    self._cond.wait()
            finally:
                self._remaps_waiting -= 1
            self._remapping = True
        try:
            yield
        finally:
            with self._cond:
                self._remapping = False
                self._cond.notify_all()


class _Reading:
    """:meth:`MetaStore.read`: the open batch (under ``_batch_lock``) if there is one, else a
    read transaction of its own. A class rather than a generator: every request reads fsmeta,
    and a generator-based context manager costs several times as much to enter and leave."""

    __slots__ = ("store", "batch", "plain")

    def __init__(self, store: "MetaStore"):
        self.store = store
        self.batch = None
        self.plain = None

    def __enter__(self) -> Txn:
        store = self.store
        if store._committer is not None:
            store._batch_lock.acquire()
            batch = store._batch
            if batch is not None:
                depth = store._batch_depth
                depth.n = getattr(depth, "n", 0) + 1
                self.batch = batch
                return Txn(batch, store.dbs, write=False)
            store._batch_lock.release()
        self.plain = store._txn(write=False)
        return Txn(self.plain.__enter__(), store.dbs, write=False)

    def __exit__(self, *exc) -> bool | None:
        if self.batch is not None:
            self.store._batch_depth.n -= 1
            self.store._batch_lock.release()
            return None
        return self.plain.__exit__(*exc)


class _GroupedWrite:
    """One write of a group commit: its function, and once done, its result or error."""

    __slots__ = ("fn", "result", "error", "done")

    def __init__(self, fn: Callable[[Txn], T]):
        self.fn = fn
        self.result = None
        self.error: BaseException | None = None
        self.done = False

    def outcome(self):
        if self.error is not None:
            raise self.error
        return self.result


class WriteGuard(Protocol):
    """Sees every write of a process (the gateway's in-flight records, fsmeta/cluster.py)."""

    def in_txn(self, txn: Txn) -> object:
        """At the end of the write's transaction, in it (may write; may raise to abort the
        write). Returns a token for :meth:`after`, or a false value for nothing to do."""

    def after(self, token: object) -> None:
        """Once the write returned, outside every lock and transaction, in the writer's
        thread (network requests are allowed here)."""


class MetaStore:
    def __init__(self, path: str, *, map_size: int = DEFAULT_MAP_SIZE, create: bool = True):
        self.path = path
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        elif not os.path.exists(os.path.join(path, "data.mdb")):
            raise FileNotFoundError(f"no fsmeta database at {path}")
        self.env = lmdb.open(
            path,
            map_size=map_size,
            max_dbs=len(schema.DB_NAMES) + 2,
            subdir=True,
            sync=True,
            metasync=False,
            readahead=False,
            max_readers=256,
            lock=True,
        )
        if (max_key := self.env.max_key_size()) < schema.LMDB_KEY_MAX:
            # Bucket keys are encoded for this limit (schema.bucket_key); a smaller build of
            # LMDB would refuse some of them at the first write.
            self.env.close()
            raise RuntimeError(f"fsmeta needs LMDB keys of {schema.LMDB_KEY_MAX} bytes; this py-lmdb allows {max_key}")
        self._gate = _TxnGate()
        self.write_guard: WriteGuard | None = None
        self._guard_due = threading.local()  # tokens of nested writes, acted on at the outermost
        # Deferred commits (defer_commits): the open batch and who uses it.
        self._committer: _Committer | None = None
        self._batch: lmdb.Transaction | None = None
        self._batch_lock = threading.RLock()
        self._batch_depth = threading.local()  # this thread's turns of _batch_lock
        self._write_seq = 0  # writes made into batches so far
        self._last_write = 0.0
        self._after_commit: list[Callable[[], None]] = []
        self._soon: list = []  # write_soon's (fn, then) not run yet; under _batch_lock
        # Group commits (_write_grouped): writes waiting for the next commit, and whether a
        # thread is committing a group now.
        self._group_cond = threading.Condition()
        self._group_queue: list[_GroupedWrite] = []
        self._group_leading = False
        self.commits = 0  # LMDB commits of writes made so far (for tests and probes)
        self.env.reader_check()
        self._next_reader_check = time.monotonic() + READER_CHECK_SECONDS
        self.dbs = {}
        with self.env.begin(write=True) as txn:
            for name in schema.DB_NAMES:
                self.dbs[name.decode()] = self.env.open_db(name, txn=txn)
        self.write(self._init_schema)

    @staticmethod
    def _init_schema(txn: Txn) -> None:
        current = txn.raw.get(b"schema", db=txn.dbs["meta"])
        if current is None:
            txn.raw.put(b"schema", str(schema.SCHEMA_VERSION).encode(), db=txn.dbs["meta"])
            txn.raw.put(b"next_ino", schema.pack_u64(schema.ROOT_INO + 1), db=txn.dbs["meta"])
            txn.init_root()
        elif int(current) != schema.SCHEMA_VERSION:
            raise RuntimeError(
                f"fsmeta schema version {int(current)} is not supported (expected {schema.SCHEMA_VERSION})"
            )

    # -- transactions -------------------------------------------------------------

    @contextlib.contextmanager
    def _txn(self, write: bool) -> Iterator[lmdb.Transaction]:
        """A raw transaction inside a shared turn of the gate; aborted on exit unless committed."""
        while True:
            with self._gate.shared():
                try:
                    raw = self.env.begin(write=write)
                except lmdb.MapResizedError:
                    pass  # another process grew the map: adopt its size, outside our turn
                else:
                    try:
                        yield raw
                    finally:
                        raw.abort()  # a no-op after commit
                    return
            self._remap(0)

    def _run_nested(self, parent: lmdb.Transaction, fn: Callable[[Txn], T]) -> T:
        """``fn`` in a nested write transaction of ``parent``: committed into it if ``fn``
        returns, gone without a trace if it raises."""
        child = self.env.begin(write=True, parent=parent)
        try:
            result = fn(Txn(child, self.dbs, write=True))
            child.commit()
            return result
        finally:
            child.abort()  # a no-op after commit

    def _remap(self, size: int) -> None:
        """``set_mapsize`` (0: adopt the size another process set) with no transaction live."""
        with self._gate.exclusive():
            self.env.set_mapsize(size)

    def read(self) -> "_Reading":
        """A read transaction; with deferred commits it includes the writes not committed yet."""
        return _Reading(self)

    @contextlib.contextmanager
    def read_committed(self) -> Iterator[Txn]:
        """A read transaction of what other processes (the drain) can see: committed writes."""
        with self._txn(write=False) as raw:
            yield Txn(raw, self.dbs, write=False)

    def write(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in one write transaction and commit it; grow the map if full.

        ``fn`` may raise to abort; it may be run more than once. With deferred commits,
        ``fn`` runs in a nested transaction of the open batch, and the commit happens
        later (see the module docstring). A :attr:`write_guard` sees the end of each write's
        transaction and acts once the write returned (:class:`WriteGuard`).
        """
        guard = self.write_guard
        if guard is None:
            return self._write(fn)
        seen = []

        def guarded(txn: Txn) -> T:
            result = fn(txn)
            seen[:] = [guard.in_txn(txn)]  # (fn may run more than once: the last run counts)
            return result

        result = self._write(guarded)
        due = self._guard_due.__dict__.setdefault("tokens", [])
        if seen and seen[0]:
            due.append(seen[0])
        if getattr(self._batch_depth, "n", 0) == 0:  # the outermost write acts for the nested ones
            while due:
                guard.after(due.pop(0))
        return result

    def _write(self, fn: Callable[[Txn], T]) -> T:
        if time.monotonic() >= self._next_reader_check:
            self._next_reader_check = time.monotonic() + READER_CHECK_SECONDS
            self.env.reader_check()
        if self._committer is None:
            return self._write_grouped(fn)
        while True:
            try:
                return self._write_deferred(fn)
            except lmdb.MapFullError:
                self.commit()  # no transaction may be live while the map grows
                self._grow()

    def _write_grouped(self, fn: Callable[[Txn], T]) -> T:
        """:meth:`write` without deferred commits (the drain, the CLI): a group commit. The
        writes that threads make while one commit is on its way join the next: one thread,
        once it holds LMDB's writer lock, runs every write queued by then, each in a nested
        transaction of its own, and commits them together. Each caller still returns only
        once its write is committed (or raises what its ``fn`` raised, alone): the same
        promise as a commit per write, for one fdatasync, and one turn of the writer lock,
        per group instead of per write."""
        mine = _GroupedWrite(fn)
        with self._group_cond:
            self._group_queue.append(mine)
            while self._group_leading and not mine.done:
                self._group_cond.wait()
            if mine.done:
                return mine.outcome()
            self._group_leading = True
        try:
            self._commit_group(mine)
        finally:
            with self._group_cond:
                self._group_leading = False
                self._group_cond.notify_all()
        return mine.outcome()

    def _commit_group(self, mine: "_GroupedWrite") -> None:
        """Commit the queued writes as one transaction (the leader of a group commit, whose
        own write is ``mine``)."""
        group: list[_GroupedWrite] = []
        while True:
            try:
                with self._txn(write=True) as raw:
                    with self._group_cond:  # what was queued while the writer lock was awaited
                        group += self._group_queue
                        self._group_queue = []
                    for write in group:
                        try:
                            write.result = self._run_nested(raw, write.fn)
                            write.error = None
                        except lmdb.MapFullError:
                            raise
                        except Exception as exc:  # its caller's error alone
                            write.error = exc
                    raw.commit()
                    self.commits += 1
                break
            except BaseException as exc:
                if isinstance(exc, lmdb.MapFullError):
                    try:
                        self._grow()  # then every write of the group runs again
                        continue
                    except BaseException as grow_exc:  # (at the largest map)
                        exc = grow_exc
                # The commit failed: none of them is stored.
                if mine not in group:  # (it failed before it took the queue)
                    with self._group_cond:
                        self._group_queue.remove(mine)
                    group.append(mine)
                for write in group:
                    write.error = exc
                break
        with self._group_cond:
            for write in group:
                write.done = True

    def write_soon(self, fn: Callable[[Txn], T], then: Callable[[T], None] | None = None) -> None:
        """Run ``fn`` in a write transaction soon, and ``then(its result)`` after it; for a
        write nobody waits for (the purge after a FORGET).

        With deferred commits ``fn`` joins the batch: the next :meth:`write` of any thread runs
        it first, or else the committer before it commits the batch (a batch is asked for now).
        Either way it runs in turn with the other writes, not beside them, in a nested
        transaction of its own: if it raises, it is logged and dropped, and nothing else is
        lost. :meth:`commit` and :meth:`sync` run what is queued first. Without deferred
        commits it runs now. ``then`` runs with ``_batch_lock`` held: it may use
        :meth:`after_commit`, not transactions."""
        if self._committer is None:
            result = self.write(fn)
            if then is not None:
                then(result)
            return
        with self._batch_lock:  # the committer runs the queue and ends the batch in one turn
            self._soon.append((fn, then))
            if self._batch is not None:
                return
        self._committer.want_batch()

    def _run_soon(self, batch: lmdb.Transaction, limit: int) -> bool:
        """Run the first ``limit`` of what :meth:`write_soon` queued, in nested transactions of
        ``batch``; with ``_batch_lock`` held. True if it stopped at a full map: the rest stays
        queued, for after the map grew."""
        queued, self._soon = self._soon[:limit], self._soon[limit:]
        done = 0
        depth = self._batch_depth
        depth.n = getattr(depth, "n", 0) + 1
        try:
            for fn, then in queued:
                try:
                    result = self._run_nested(batch, fn)
                except lmdb.MapFullError:
                    return True
                except Exception:
                    log.exception("fsmeta: a deferred write failed; it is dropped")
                    done += 1
                    continue
                done += 1
                self._write_seq += 1
                if then is not None:
                    try:
                        then(result)
                    except Exception:
                        log.exception("fsmeta: the action after a deferred write failed")
            return False
        finally:
            depth.n -= 1
            self._soon[:0] = queued[done:]

    def _write_deferred(self, fn: Callable[[Txn], T], soon_limit: int | None = None) -> T:
        lock, depth = self._batch_lock, self._batch_depth
        while True:
            with lock:
                batch = self._batch
                if batch is not None:
                    if self._soon:
                        self._run_soon(batch, SOON_PER_WRITE if soon_limit is None else soon_limit)
                    depth.n = getattr(depth, "n", 0) + 1
                    try:
                        result = self._run_nested(batch, fn)
                    finally:
                        depth.n -= 1
                    self._write_seq += 1
                    self._last_write = time.monotonic()
                    return result
            self._committer.request_batch()

    # -- deferred commits --------------------------------------------------------------

    def defer_commits(self, interval: float) -> None:
        """From now on, commit writes in batches at most ``interval`` seconds apart (the
        gateway). :meth:`commit` and :meth:`sync` force one; :meth:`close` commits."""
        if self._committer is None:
            self._committer = _Committer(self, interval)
            self._committer.start()

    @property
    def deferring(self) -> bool:
        return self._committer is not None

    def commit(self) -> None:
        """Make every write made so far visible to other processes (committed, not synced)."""
        if self._committer is None:
            return
        if getattr(self._batch_depth, "n", 0):
            raise RuntimeError("fsmeta: commit() from inside a transaction would wait for itself")
        if self._soon:  # what write_soon queued so far, in the batch
            self._write_deferred(lambda txn: None, soon_limit=len(self._soon))
        with self._batch_lock:
            seq = self._write_seq
        self._committer.wait_committed(seq)

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` (which must not use fsmeta) once every write made so far is
        committed: e.g. removing the cache file of an inode whose removal is in the batch."""
        with self._batch_lock:
            if self._batch is not None:
                self._after_commit.append(action)
                return
        action()

    def _grow_if_nearly_full(self) -> None:
        """Grow the map between batches, before a batch's commit could find it full (a
        full map at the commit of a batch would lose all its writes)."""
        info = self.env.info()
        used = (info["last_pgno"] + 1) * self.env.stat()["psize"]
        if used * 4 >= info["map_size"] * 3:
            self._grow()

    def _grow(self) -> None:
        size = self.env.info()["map_size"]
        if size >= MAX_MAP_SIZE:
            raise lmdb.MapFullError("fsmeta map reached its maximum size")
        self._remap(min(size * 2, MAX_MAP_SIZE))

    def sync(self) -> None:
        """Make every write made so far durable on the device."""
        self.commit()
        self.env.sync(True)

    def close(self) -> None:
        if self._committer is not None:
            self.commit()
            self._committer.stop()
            self._committer = None
        self.env.close()

    # -- settings ------------------------------------------------------------------

    def get_settings(self) -> dict | None:
        with self.read() as txn:
            return txn.get_settings()

    def put_settings(self, settings: dict) -> None:
        self.write(lambda txn: txn.put_settings(settings))

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
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator, TypeVar

import lmdb

from . import schema
from .txn import Txn

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 30  # grows on demand; address space only, not disk
MAX_MAP_SIZE = 1 << 40
READER_CHECK_SECONDS = 30.0


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
        self._gate = _TxnGate()
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

    def _remap(self, size: int) -> None:
        """``set_mapsize`` (0: adopt the size another process set) with no transaction live."""
        with self._gate.exclusive():
            self.env.set_mapsize(size)

    @contextlib.contextmanager
    def read(self) -> Iterator[Txn]:
        with self._txn(write=False) as raw:
            yield Txn(raw, self.dbs, write=False)

    def write(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in one write transaction and commit it; grow the map if full.

        ``fn`` may raise to abort; it may be run more than once.
        """
        if time.monotonic() >= self._next_reader_check:
            self._next_reader_check = time.monotonic() + READER_CHECK_SECONDS
            self.env.reader_check()
        while True:
            try:
                with self._txn(write=True) as raw:
                    result = fn(Txn(raw, self.dbs, write=True))
                    raw.commit()
                    return result
            except lmdb.MapFullError:
                self._grow()

    def _grow(self) -> None:
        size = self.env.info()["map_size"]
        if size >= MAX_MAP_SIZE:
            raise lmdb.MapFullError("fsmeta map reached its maximum size")
        self._remap(min(size * 2, MAX_MAP_SIZE))

    def sync(self) -> None:
        """Make every committed transaction durable on the device."""
        self.env.sync(True)

    def close(self) -> None:
        self.env.close()

    # -- settings ------------------------------------------------------------------

    def get_settings(self) -> dict | None:
        with self.read() as txn:
            return txn.get_settings()

    def put_settings(self, settings: dict) -> None:
        self.write(lambda txn: txn.put_settings(settings))

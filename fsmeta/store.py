"""The fsmeta LMDB environment: opening, multi-process rules, transactions.

Rules this module enforces (why, briefly):

* One environment per process, opened after any fork: LMDB's lock table is per
  process. The gateway and the drain each open ``CACHE/meta`` themselves.
* Write transactions are run through :meth:`MetaStore.write`, which takes a
  function and re-runs it after growing the map on ``MapFullError``; the
  function therefore must only touch the transaction. Other processes see
  ``MapResizedError`` and adopt the new size with ``set_mapsize(0)``.
* Commits fsync the data pages but not the meta page (``metasync=False``):
  the database stays consistent after a power cut and may lose only the last
  transaction; :meth:`MetaStore.sync` forces that too, and fsync calls it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, TypeVar

import lmdb

from . import schema
from .txn import Txn

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 30  # grows on demand; address space only, not disk
MAX_MAP_SIZE = 1 << 40


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
        self._resize_lock = threading.Lock()
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

    def _begin(self, write: bool) -> lmdb.Transaction:
        for _ in range(3):
            try:
                return self.env.begin(write=write)
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size.
                with self._resize_lock:
                    self.env.set_mapsize(0)
        return self.env.begin(write=write)

    @contextlib.contextmanager
    def read(self) -> Iterator[Txn]:
        raw = self._begin(write=False)
        try:
            yield Txn(raw, self.dbs, write=False)
        finally:
            raw.abort()

    def write(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in one write transaction and commit it; grow the map if full.

        ``fn`` may raise to abort; it may be run more than once.
        """
        while True:
            raw = self._begin(write=True)
            try:
                result = fn(Txn(raw, self.dbs, write=True))
                raw.commit()
                return result
            except lmdb.MapFullError:
                raw.abort()
                self._grow()
            except BaseException:
                raw.abort()
                raise

    def _grow(self) -> None:
        with self._resize_lock:
            size = self.env.info()["map_size"]
            if size >= MAX_MAP_SIZE:
                raise lmdb.MapFullError("fsmeta map reached its maximum size")
            self.env.set_mapsize(min(size * 2, MAX_MAP_SIZE))

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

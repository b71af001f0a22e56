"""fsmeta's LMDB environment across threads and processes (map growth, dead readers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from ckptfs.fsmeta import MetaStore
from ckptfs.fsmeta import store as store_module


def put_blob(store: MetaStore, key: bytes, size: int) -> None:
    store.write(lambda txn: txn.raw.put(key, os.urandom(size), db=txn.dbs["meta"]))


def test_map_growth_waits_for_live_transactions_of_other_threads(tmp_path):
    """set_mapsize with a live transaction in the process is forbidden by LMDB: a write
    that must grow the map waits until other threads' transactions have ended."""
    store = MetaStore(str(tmp_path / "meta"), map_size=1 << 20)
    try:
        reading, release = threading.Event(), threading.Event()

        def long_reader() -> None:
            with store.read() as txn:
                txn.get_settings()
                reading.set()
                release.wait(30)

        reader = threading.Thread(target=long_reader)
        reader.start()
        assert reading.wait(10)
        writer = threading.Thread(target=put_blob, args=(store, b"blob", 4 << 20))  # needs a bigger map
        writer.start()
        writer.join(1.0)
        assert writer.is_alive(), "the map was resized under a live read transaction"
        release.set()
        reader.join(10)
        writer.join(30)
        assert not writer.is_alive()
        assert store.env.info()["map_size"] > 1 << 20
        with store.read() as txn:
            assert len(txn.raw.get(b"blob", db=txn.dbs["meta"])) == 4 << 20
    finally:
        store.close()


def test_a_reader_killed_mid_transaction_does_not_pin_the_database(tmp_path, monkeypatch):
    """A process killed inside a read transaction leaves a reader slot that pins old pages;
    a process that keeps the environment open (the drain outliving its gateway) clears it."""
    monkeypatch.setattr(store_module, "READER_CHECK_SECONDS", 0.0)
    path = str(tmp_path / "meta")
    store = MetaStore(path)
    try:
        child = subprocess.Popen([sys.executable, "-c", (
            "import lmdb, sys, time\n"
            f"env = lmdb.open({path!r}, max_dbs=16)\n"
            "txn = env.begin()\n"
            "print('reading', flush=True)\n"
            "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "reading"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        store.put_settings({"status": 1})  # a commit, as the drain makes every second
        assert store.env.reader_check() == 0, "the dead reader's slot is still there"
    finally:
        store.close()


def test_many_threads_reading_while_the_map_grows_see_every_committed_value(tmp_path):
    store = MetaStore(str(tmp_path / "meta"), map_size=1 << 20)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                with store.read() as txn:
                    value = txn.raw.get(b"counter", db=txn.dbs["meta"])
                    assert value is None or int(value) >= 0
                time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for i in range(24):
            put_blob(store, f"blob{i}".encode(), 256 << 10)  # 6 MiB in all: several doublings
            store.write(lambda txn, i=i: txn.raw.put(b"counter", str(i).encode(), db=txn.dbs["meta"]))
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    with store.read() as txn:
        assert int(txn.raw.get(b"counter", db=txn.dbs["meta"])) == 23
    store.close()

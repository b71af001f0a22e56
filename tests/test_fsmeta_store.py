"""fsmeta's LMDB environment across threads and processes (map growth, dead readers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import lmdb
import pytest

from ckptfs.fsmeta import MetaStore
from ckptfs.fsmeta import store as store_module


def wait_until(condition, failure: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.002)


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


# -- deferred commits (the gateway) -------------------------------------------------------------


def get(store: MetaStore, key: bytes, committed: bool = False) -> bytes | None:
    with (store.read_committed() if committed else store.read()) as txn:
        value = txn.raw.get(key, db=txn.dbs["meta"])
        return bytes(value) if value is not None else None


def _put_fn(key: bytes, value: bytes):
    return lambda txn: txn.raw.put(key, value, db=txn.dbs["meta"])


def put(store: MetaStore, key: bytes, value: bytes) -> None:
    store.write(_put_fn(key, value))


def read_in_other_process(path: str, key: bytes) -> bytes | None:
    out = subprocess.run([sys.executable, "-c", (
        "import lmdb, sys\n"
        f"env = lmdb.open({path!r}, max_dbs=16, readonly=True, lock=True)\n"
        "db = env.open_db(b'meta')\n"
        f"v = env.begin(db=db).get({key!r})\n"
        "print(v.decode() if v is not None else 'NONE')\n")], capture_output=True, text=True, check=True)
    value = out.stdout.strip()
    return None if value == "NONE" else value.encode()


@pytest.fixture
def store_committing_on_demand(tmp_path, monkeypatch):
    """A store with deferred commits that commits only when asked (commit/sync/close)."""
    monkeypatch.setattr(store_module, "BATCH_IDLE_SECONDS", 3600.0)
    store = MetaStore(str(tmp_path / "meta"))
    store.defer_commits(3600.0)
    yield store
    store.close()


def test_deferred_writes_are_read_back_at_once_and_reach_other_processes_at_commit(store_committing_on_demand):
    store = store_committing_on_demand
    put(store, b"k", b"1")
    assert get(store, b"k") == b"1"  # this process reads its own writes
    assert get(store, b"k", committed=True) is None
    assert read_in_other_process(store.path, b"k") is None  # the drain does not see it yet
    store.commit()
    assert read_in_other_process(store.path, b"k") == b"1"


@pytest.mark.parametrize("how", ["write", "write_soon"])
def test_deferred_batch_commits_by_itself_within_the_interval(tmp_path, how):
    """A write is committed within the interval with nobody asking; so is a write queued
    with write_soon and taken by no later write (the committer runs it before its commit)."""
    store = MetaStore(str(tmp_path / "meta"))
    try:
        store.defer_commits(0.01)
        getattr(store, how)(_put_fn(b"k", b"1"))
        wait_until(lambda: get(store, b"k", committed=True) is not None, "the batch was never committed")
    finally:
        store.close()


def test_a_deferred_write_that_raises_leaves_nothing_behind(store_committing_on_demand):
    store = store_committing_on_demand
    put(store, b"before", b"1")

    def half_done(txn) -> None:
        txn.raw.put(b"half", b"1", db=txn.dbs["meta"])
        raise ValueError("abort")

    with pytest.raises(ValueError):
        store.write(half_done)
    put(store, b"after", b"1")
    store.commit()
    assert get(store, b"half", committed=True) is None
    assert get(store, b"before", committed=True) == get(store, b"after", committed=True) == b"1"


def test_after_commit_actions_run_once_the_writes_before_them_are_committed(store_committing_on_demand):
    store = store_committing_on_demand
    put(store, b"gone", b"1")
    seen = []
    store.after_commit(lambda: seen.append(read_in_other_process(store.path, b"gone")))
    assert seen == []
    store.commit()
    assert seen == [b"1"]


def test_a_write_soon_runs_before_the_next_write_in_the_batch(store_committing_on_demand):
    """A write nobody waits for (the purge after a FORGET) is queued, and the next write of
    any thread runs it first, in the same batch."""
    store = store_committing_on_demand
    put(store, b"open", b"1")  # a batch is open: the queued write waits for a writer
    after = []
    store.write_soon(_put_fn(b"soon", b"1"), after.append)
    assert get(store, b"soon") is None
    assert after == []
    store.write(lambda txn: after.append(txn.raw.get(b"soon", db=txn.dbs["meta"]) is not None))
    assert after == [True, True]  # its result went to `then`, then the write saw it
    assert get(store, b"soon", committed=True) is None  # still in the batch
    store.commit()
    assert read_in_other_process(store.path, b"soon") == b"1"


def test_a_burst_of_writes_queued_soon_is_spread_over_later_writes(store_committing_on_demand, monkeypatch):
    """One write runs a bounded share of the queue before its own (a burst of FORGETs delays
    no single request for long); commit() runs all of it."""
    monkeypatch.setattr(store_module, "SOON_PER_WRITE", 2)
    store = store_committing_on_demand
    put(store, b"open", b"1")
    for i in range(5):
        store.write_soon(_put_fn(b"soon%d" % i, b"1"))
    put(store, b"next", b"1")
    assert [get(store, b"soon%d" % i) for i in range(5)] == [b"1", b"1", None, None, None]
    store.commit()
    assert [get(store, b"soon%d" % i, committed=True) for i in range(5)] == [b"1"] * 5


def test_the_committer_runs_a_long_queue_over_several_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "SOON_PER_COMMIT", 2)
    store = MetaStore(str(tmp_path / "meta"))
    try:
        store.defer_commits(0.01)
        for i in range(7):
            store.write_soon(_put_fn(b"soon%d" % i, b"1"))
        wait_until(lambda: get(store, b"soon6", committed=True) is not None, "the queue was never run to its end")
        assert all(get(store, b"soon%d" % i, committed=True) == b"1" for i in range(7))
    finally:
        store.close()


def test_a_write_soon_that_finds_the_map_full_runs_once_the_committer_grew_it(tmp_path):
    """No later write grows the map for it: the committer does, and runs it in the next batch."""
    store = MetaStore(str(tmp_path / "meta"), map_size=1 << 20)
    try:
        store.defer_commits(0.01)
        store.write_soon(lambda txn: txn.raw.put(b"blob", os.urandom(4 << 20), db=txn.dbs["meta"]))
        wait_until(lambda: get(store, b"blob", committed=True) is not None, "the queued write never ran")
        assert store.env.info()["map_size"] > 1 << 20
    finally:
        store.close()


def test_commit_runs_the_writes_queued_soon(store_committing_on_demand):
    store = store_committing_on_demand
    store.write_soon(_put_fn(b"soon", b"1"))
    store.commit()
    assert read_in_other_process(store.path, b"soon") == b"1"


def test_a_write_soon_that_raises_is_dropped_alone(store_committing_on_demand, caplog):
    store = store_committing_on_demand

    def half_done(txn) -> None:
        txn.raw.put(b"half", b"1", db=txn.dbs["meta"])
        raise ValueError("abort")

    put(store, b"open", b"1")
    store.write_soon(half_done)
    store.write_soon(_put_fn(b"next", b"1"))
    put(store, b"after", b"1")
    store.commit()
    assert get(store, b"half", committed=True) is None
    assert get(store, b"next", committed=True) == get(store, b"after", committed=True) == b"1"
    assert "a deferred write failed" in caplog.text


def test_a_write_soon_without_deferred_commits_runs_at_once(tmp_path):
    store = MetaStore(str(tmp_path / "meta"))
    try:
        after = []
        store.write_soon(_put_fn(b"soon", b"1"), after.append)
        assert after == [True]
        assert get(store, b"soon", committed=True) == b"1"
    finally:
        store.close()


def test_deferred_writes_grow_the_map(tmp_path):
    store = MetaStore(str(tmp_path / "meta"), map_size=1 << 20)
    try:
        store.defer_commits(0.01)
        for i in range(12):
            put_blob(store, f"blob{i}".encode(), 512 << 10)
        store.sync()
        assert store.env.info()["map_size"] > 1 << 20
        assert len(get(store, b"blob11", committed=True)) == 512 << 10
    finally:
        store.close()


def _writes_behind_a_slow_one(store: MetaStore, fns: list) -> tuple[list, list]:
    """The first write holds the writer lock, in its function, until the others (``fns``,
    from threads of their own) are waiting; returns their results and errors by index."""
    in_first, release = threading.Event(), threading.Event()

    def slow(txn) -> None:
        in_first.set()
        release.wait(10)
        txn.raw.put(b"first", b"1", db=txn.dbs["meta"])

    results, errors = [None] * len(fns), [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = store.write(fns[i])
            results[i] = (results[i], get(store, b"k%d" % i, committed=True))  # once write returned
        except Exception as exc:
            errors[i] = exc

    first = threading.Thread(target=store.write, args=(slow,))
    first.start()
    assert in_first.wait(10)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    wait_until(lambda: len(store._group_queue) >= len(fns), "the writes never queued")
    release.set()
    for t in [first, *threads]:
        t.join(10)
        assert not t.is_alive()
    return results, errors


def _numbered_put(i: int):
    def fn(txn) -> int:
        txn.raw.put(b"k%d" % i, b"%d" % i, db=txn.dbs["meta"])
        return i
    return fn


def test_writes_from_threads_that_wait_for_a_commit_share_the_next_one(tmp_path):
    """Without deferred commits (the drain) a write returns once it is committed; the writes
    that wait meanwhile are committed together, in one transaction and one fdatasync, and
    each caller gets its own result."""
    store = MetaStore(str(tmp_path / "meta"))
    try:
        before = store.commits
        results, errors = _writes_behind_a_slow_one(store, [_numbered_put(i) for i in range(6)])
        assert errors == [None] * 6
        assert results == [(i, b"%d" % i) for i in range(6)]  # committed when write returned
        assert store.commits - before == 2  # the slow write's, then one for the six
        assert get(store, b"first", committed=True) == b"1"
    finally:
        store.close()


def test_a_write_that_raises_in_a_group_commit_fails_alone(tmp_path):
    store = MetaStore(str(tmp_path / "meta"))
    try:
        def half_done(txn) -> None:
            txn.raw.put(b"k1", b"half", db=txn.dbs["meta"])
            raise ValueError("abort")

        results, errors = _writes_behind_a_slow_one(store, [_numbered_put(0), half_done, _numbered_put(2)])
        assert isinstance(errors[1], ValueError)
        assert errors[0] is None and errors[2] is None
        assert results[0] == (0, b"0") and results[2] == (2, b"2")
        assert get(store, b"k1", committed=True) is None  # nothing of it is left
    finally:
        store.close()


def test_a_grouped_write_whose_transaction_cannot_begin_raises(tmp_path, monkeypatch):
    """A write whose transaction fails to begin (EIO, no reader slot) reports it to its
    caller, never returns as if it had been stored."""
    store = MetaStore(str(tmp_path / "meta"))
    try:
        def failing_txn(write):
            raise lmdb.Error("cannot begin")

        monkeypatch.setattr(store, "_txn", failing_txn)
        with pytest.raises(lmdb.Error, match="cannot begin"):
            store.write(_numbered_put(0))
        monkeypatch.undo()
        assert store.write(_numbered_put(1)) == 1  # the next leader is not blocked
        assert get(store, b"k0", committed=True) is None
    finally:
        store.close()


def test_grouped_writes_that_overflow_the_largest_map_fail_and_the_store_goes_on(tmp_path, monkeypatch):
    """Every caller of a group that cannot be stored (the map at its largest) gets the error;
    none returns as if stored, and later writes are stored."""
    monkeypatch.setattr(store_module, "MAX_MAP_SIZE", 1 << 20)
    store = MetaStore(str(tmp_path / "meta"), map_size=1 << 20)
    try:
        def blob(i: int):
            def fn(txn) -> int:
                txn.raw.put(b"k%d" % i, os.urandom(600 << 10), db=txn.dbs["meta"])
                return i
            return fn

        results, errors = _writes_behind_a_slow_one(store, [blob(i) for i in range(3)])
        assert all(isinstance(e, lmdb.MapFullError) for e in errors), (results, errors)
        assert store.write(_numbered_put(7)) == 7
        assert get(store, b"k7", committed=True) == b"7"
    finally:
        store.close()


def test_a_group_commit_that_fills_the_map_grows_it_and_stores_every_write(tmp_path):
    store = MetaStore(str(tmp_path / "meta"), map_size=1 << 20)
    try:
        def blob(i: int):
            def fn(txn) -> int:
                txn.raw.put(b"k%d" % i, b"%d" % i, db=txn.dbs["meta"])
                txn.raw.put(b"blob%d" % i, os.urandom(300 << 10), db=txn.dbs["meta"])
                return i
            return fn

        results, errors = _writes_behind_a_slow_one(store, [blob(i) for i in range(6)])
        assert errors == [None] * 6
        assert [r[0] for r in results] == list(range(6))
        assert store.env.info()["map_size"] > 1 << 20
        assert all(len(get(store, b"blob%d" % i, committed=True)) == 300 << 10 for i in range(6))
    finally:
        store.close()


WRITER = r'''
import sys, time
from ckptfs.fsmeta import MetaStore
store = MetaStore(sys.argv[1])
store.defer_commits(0.01)
i = 0
while True:
    store.write(lambda txn, i=i: txn.raw.put(b"w%08d" % i, b"%d" % i, db=txn.dbs["meta"]))
    if i % 200 == 0:
        store.sync()
        print("synced", i, flush=True)
    i += 1
'''


def test_a_crash_keeps_a_prefix_of_the_deferred_writes_and_every_synced_one(tmp_path):
    """kill -9 in the middle of deferred writes: what survives is the first n writes for some
    n (never a later write without an earlier one), every write before the last sync included,
    and the database opens clean."""
    path = str(tmp_path / "meta")
    MetaStore(path).close()
    child = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, text=True)
    synced = -1
    try:
        while synced < 2000:
            line = child.stdout.readline()
            assert line, "the writer died"
            synced = int(line.split()[1])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    store = MetaStore(path)
    try:
        with store.read() as txn:
            cursor = txn.raw.cursor(db=txn.dbs["meta"])
            found = [int(bytes(k)[1:]) for k, _ in cursor if bytes(k).startswith(b"w")]
        assert found == list(range(len(found))), "a write survived without one made before it"
        assert len(found) > synced
        put(store, b"after", b"1")  # and the database takes writes again
    finally:
        store.close()

"""The core in passthrough mode, without FUSE: the kernel's reads and writes are simulated by
writing the cache file directly, as a passthrough WRITE (or a shared mapping) does."""

from __future__ import annotations

import os
import time

import pytest
from conftest import ROOT, ROOT_CALLER, fsmeta_problems

from ckptfs.fsmeta import FileState, RemoteRecord, durability
from ckptfs.gateway import datapath
from ckptfs.gateway.core import SetattrRequest


class FakeIds:
    def __init__(self):
        self.next = 1
        self.live: dict[int, int] = {}  # id -> fd it was opened on
        self.opened = self.closed = 0

    def open(self, fd: int) -> int:
        os.fstat(fd)  # a real fd
        bid, self.next = self.next, self.next + 1
        self.live[bid] = fd
        self.opened += 1
        return bid

    def close(self, bid: int) -> None:
        del self.live[bid]
        self.closed += 1


@pytest.fixture
def pt(core):
    ids = FakeIds()
    core.enable_passthrough(ids.open, ids.close)
    return core, ids


def _inode(core, ino):
    with core.meta.read() as txn:
        return txn.get_inode(ino)


def _kernel_write(core, ino, offset, data):
    """What a passthrough WRITE does: the bytes go to the cache file, the gateway hears nothing."""
    fd = os.open(core._data_path(ino), os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)



def written(core, data: bytes, flags: int) -> tuple[int, int]:
    """Create ``f`` and write ``data`` as the kernel does in passthrough mode: (fh, ino)."""
    fh, attr = core.create(ROOT, b"f", 0o644, flags, ROOT_CALLER)
    _kernel_write(core, attr.ino, 0, data)
    return fh, attr.ino


def fsynced_and_uploaded(core, fh: int, ino: int) -> int:
    """fsync the handle, then do what the drain does once it uploaded the file (with
    fsync=remote, while the handle stays open): durable, off the queue. The generation."""
    core.fsync(fh, False)

    def the_drain_uploaded_it(txn):
        inode = txn.get_inode(ino)
        durability.mark_durable(txn, inode, inode.generation, RemoteRecord("f", 100, "h", inode.generation))
        durability.mark_settled(txn, ino)

    core.meta.write(the_drain_uploaded_it)
    return _inode(core, ino).generation

def test_one_backing_id_per_inode_closed_with_the_last_handle(pt):
    core, ids = pt
    fh1, attr = core.create(ROOT, b"f", 0o644, os.O_WRONLY, ROOT_CALLER)
    fh2 = core.open(attr.ino, os.O_RDONLY)
    fh3 = core.open(attr.ino, os.O_RDWR)
    bid = core.backing_id(fh1)
    assert bid > 0 and core.backing_id(fh2) == bid == core.backing_id(fh3)
    assert ids.opened == 1
    core.release(fh1)
    core.release(fh3)
    assert ids.closed == 0
    core.release(fh2)
    assert ids.closed == 1 and not ids.live
    fh4 = core.open(attr.ino, os.O_RDONLY)
    assert core.backing_id(fh4) != bid and ids.opened == 2
    core.release(fh4)


def test_open_for_writing_bumps_before_any_byte_can_change(pt):
    core, _ = pt
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_WRONLY, ROOT_CALLER)
    core.release(fh)
    g0 = _inode(core, attr.ino).generation
    fh = core.open(attr.ino, os.O_RDONLY)
    assert _inode(core, attr.ino).generation == g0  # reading changes nothing
    core.release(fh)
    fh = core.open(attr.ino, os.O_RDWR)
    inode = _inode(core, attr.ino)
    assert inode.generation == g0 + 1 and inode.state == FileState.DIRTY
    core.release(fh)
    fh = core.open(attr.ino, os.O_RDONLY | os.O_TRUNC)
    assert _inode(core, attr.ino).generation == g0 + 2
    core.release(fh)


def test_size_and_mtime_come_from_the_cache_file(pt):
    core, _ = pt
    fh, ino = written(core, b"x" * 5000, os.O_WRONLY)
    st = os.stat(core._data_path(ino))
    got = core.getattr(ino)
    assert got.size == 5000 and got.mtime_ns == st.st_mtime_ns  # getattr of an open file
    assert _inode(core, ino).size == 0  # not persisted yet
    core.flush(fh)
    inode = _inode(core, ino)
    assert (inode.size, inode.mtime_ns) == (5000, st.st_mtime_ns)
    _kernel_write(core, ino, 5000, b"y" * 100)
    core.fsync(fh, False)
    assert _inode(core, ino).size == 5100
    _kernel_write(core, ino, 5100, b"z")
    core.release(fh)
    assert _inode(core, ino).size == 5101
    assert fsmeta_problems(core.meta) == []


def test_a_created_file_shows_its_creation_time_until_written_whatever_its_cache_file_shows(pt, monkeypatch):
    # A create leaves its (spare) cache file's older times alone (no utime): the gateway
    # must still answer the creation time, and the first write's time after it.
    core, _ = pt
    old = 1_000_000_000_000_000_000
    make = core._state.create_cache_file

    def spare_with_old_times(*a, **kw):
        fd = make(*a, **kw)
        os.utime(fd, ns=(old, old))
        return fd

    monkeypatch.setattr(core._state, "create_cache_file", spare_with_old_times)
    before = time.time_ns()
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_WRONLY, ROOT_CALLER)
    assert attr.mtime_ns >= before - 10**9 and attr.mtime_ns != old
    assert core.getattr(attr.ino).mtime_ns == attr.mtime_ns
    core.release(fh)
    assert _inode(core, attr.ino).mtime_ns == attr.mtime_ns  # the release stored no old time
    fh = core.open(attr.ino, os.O_RDONLY)  # a later open aligns the cache file
    assert os.stat(core._data_path(attr.ino)).st_mtime_ns == attr.mtime_ns
    core.release(fh)

    fh, attr = core.create(ROOT, b"g", 0o644, os.O_WRONLY, ROOT_CALLER)
    _kernel_write(core, attr.ino, 0, b"x")
    st = os.stat(core._data_path(attr.ino))
    assert core.getattr(attr.ino).mtime_ns == st.st_mtime_ns != old and core.getattr(attr.ino).size == 1
    core.release(fh)
    assert (_inode(core, attr.ino).size, _inode(core, attr.ino).mtime_ns) == (1, st.st_mtime_ns)
    assert fsmeta_problems(core.meta) == []


def test_handles_the_unmount_left_unreleased_store_their_size_at_the_end_of_the_session(pt):
    """A passthrough close(2) sends no FLUSH, and an unmount ends the RELEASEs still queued:
    what the writes gave the file is stored at the end of the session, its writer count
    dropped (else it never drains), and no backing id is closed on a session that is gone."""
    core, ids = pt
    fh, ino = written(core, b"x" * 5000, os.O_WRONLY)
    core.open(ino, os.O_RDONLY)
    assert _inode(core, ino).size == 0  # nothing stored it yet
    assert core.release_all() == 2
    inode = _inode(core, ino)
    assert inode.size == 5000 and inode.state == FileState.DIRTY
    with core.meta.read() as txn:
        assert txn.writer_count(ino) == 0
    assert ids.closed == 0  # (the session's ids went with it)
    assert fsmeta_problems(core.meta) == []


def test_a_directory_fsync_stores_the_size_of_files_whose_release_has_not_come(pt):
    """close(2) of a passthrough file has returned once the RELEASE is on its way: a directory
    fsync after it must make that close durable all the same (the kernel may deliver the
    FSYNCDIR to another front-end thread first)."""
    core, _ = pt
    fh, ino = written(core, b"x" * 7000, os.O_WRONLY)
    dfh = core.opendir(ROOT)
    core.fsyncdir(dfh, False)
    with core.meta.read() as txn:  # committed: the deferred batch went with the fsync
        assert txn.get_inode(ino).size == 7000
    core.release(fh)
    core.releasedir(dfh)
    assert fsmeta_problems(core.meta) == []


def test_truncate_and_utimes_of_an_open_file_reach_the_cache_file(pt):
    core, _ = pt
    fh, ino = written(core, b"x" * 100, os.O_RDWR)
    core.setattr(ino, SetattrRequest(size=10), fh)
    assert os.stat(core._data_path(ino)).st_size == 10 and core.getattr(ino).size == 10
    core.setattr(ino, SetattrRequest(mtime_ns=1_000_000_000, atime_ns=1_000_000_000), fh)
    assert os.stat(core._data_path(ino)).st_mtime_ns == 1_000_000_000  # the kernel shows these
    core.release(fh)
    inode = _inode(core, ino)
    assert (inode.size, inode.mtime_ns) == (10, 1_000_000_000)


def test_first_open_reconciles_the_cache_file_with_fsmeta(core_env):
    core = core_env.core
    core.enable_passthrough(FakeIds().open, lambda bid: None)
    fh, ino = written(core, b"x" * 100, os.O_WRONLY)
    core.fsync(fh, False)
    path = core._data_path(ino)
    os.truncate(path, 40)  # e.g. a power cut lost the tail of data fsmeta's size covers
    core = core_env.reopen()  # the crash: nothing in memory survives
    core.enable_passthrough(FakeIds().open, lambda bid: None)
    fh = core.open(ino, os.O_RDONLY)
    assert os.stat(path).st_size == 100  # the missing tail reads as zeros, as fsmeta's size says
    core.release(fh)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cache_file_changed_after_the_last_release_gets_a_new_generation(pt):
    core, ids = pt
    clock = core._state.backing.clock = FakeClock()
    fh, ino = written(core, b"x" * 100, os.O_RDWR)
    core.release(fh)
    g0 = _inode(core, ino).generation
    assert core.sweep_mapped() == 0
    _kernel_write(core, ino, 100, b"m" * 10)  # a shared mapping that outlived close()
    clock.now += datapath.SWEEP_SECONDS
    assert core.sweep_mapped() == 1
    inode = _inode(core, ino)
    assert inode.generation == g0 + 1 and inode.size == 110 and inode.state == FileState.DIRTY
    clock.now += datapath.SWEEP_SECONDS
    assert core.sweep_mapped() == 0
    # ... and at the next open, if the sweep has not run yet
    _kernel_write(core, ino, 110, b"n")
    fh = core.open(ino, os.O_RDONLY)
    inode = _inode(core, ino)
    assert inode.generation == g0 + 2 and inode.size == 111 and core.getattr(ino).size == 111
    core.release(fh)


def test_stat_id_includes_ctime():
    st = os.stat(__file__)
    assert datapath.stat_id(st) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def test_writes_after_the_bucket_got_the_file_bump_again_while_the_handle_stays_open(pt):
    """fsync=remote can make a file durable while its writer keeps the handle: the next
    passthrough writes must not be taken for the durable content (no new generation = no upload)."""
    core, _ = pt
    fh, ino = written(core, b"x" * 100, os.O_RDWR)
    g0 = fsynced_and_uploaded(core, fh, ino)
    _kernel_write(core, ino, 100, b"tail")
    core.fsync(fh, False)
    inode = _inode(core, ino)
    assert inode.generation > g0 and inode.size == 104
    with core.meta.read() as txn:
        assert txn.get_pending(ino).reason == durability.DATA
    core.release(fh)


def test_a_getattr_between_the_writes_and_the_flush_does_not_hide_them_from_the_drain(pt):
    """The kernel asks for attributes at any time (stat, its attribute cache expiring). A
    GETATTR that sees the passthrough writes of a file the bucket already has must not make
    the next flush take them for the durable content: same size, new bytes, new generation."""
    core, _ = pt
    fh, ino = written(core, b"x" * 100, os.O_RDWR)
    g0 = fsynced_and_uploaded(core, fh, ino)
    _kernel_write(core, ino, 10, b"y" * 10)  # overwritten in place: the size stays
    assert core.getattr(ino).size == 100
    core.fsync(fh, False)
    inode = _inode(core, ino)
    assert inode.generation > g0 and inode.durable_generation != inode.generation
    with core.meta.read() as txn:
        assert txn.get_pending(ino).reason == durability.DATA
    core.release(fh)


def _watched_file(tmp_path, name: str = "f") -> tuple[str, tuple]:
    path = tmp_path / name
    path.write_bytes(b"x")
    return str(path), datapath.stat_id(os.stat(path))


def test_a_watched_file_is_compared_at_doubling_intervals_and_dropped_after_the_watch(tmp_path, monkeypatch):
    """Comparing every watched file at every sweep cost a third of a CPU with 60,000 files
    written in the last hour: an unchanged file is compared less and less often."""
    clock = FakeClock()
    backing = datapath.Backing(lambda fd: 1, lambda bid: None, clock=clock)
    path, sid = _watched_file(tmp_path)
    released = clock.now
    backing.watch(7, path, sid)
    compared = []
    stat = os.stat
    monkeypatch.setattr(datapath.os, "stat", lambda p: (compared.append(clock.now), stat(p))[1])
    while clock.now <= released + datapath.WATCH_SECONDS + 2 * datapath.SWEEP_INTERVAL_MAX:
        assert backing.changed() == []
        clock.now += datapath.SWEEP_SECONDS
    gaps = [b - a for a, b in zip(compared, compared[1:])]
    assert compared[0] == released  # at the first sweep after the release
    assert gaps[:7] == [1, 2, 4, 8, 16, 32, 64] and set(gaps[6:]) == {datapath.SWEEP_INTERVAL_MAX}
    assert len(compared) < 70  # against 3,600 at one comparison per sweep
    assert backing.watched == {}  # unchanged for the whole watch: dropped


def test_a_watched_file_that_moves_late_is_found_within_the_longest_interval_then_compared_soon(tmp_path):
    clock = FakeClock()
    backing = datapath.Backing(lambda fd: 1, lambda bid: None, clock=clock)
    path, sid = _watched_file(tmp_path)
    backing.watch(7, path, sid)
    for _ in range(300):  # five minutes unchanged: compared every 64 s by now
        assert backing.changed() == []
        clock.now += datapath.SWEEP_SECONDS
    with open(path, "ab") as f:  # a shared mapping that outlived close()
        f.write(b"m")
    waited = 0.0
    while not backing.changed():
        clock.now += datapath.SWEEP_SECONDS
        waited += datapath.SWEEP_SECONDS
        assert waited <= datapath.SWEEP_INTERVAL_MAX
    # not rebased (e.g. the sweep found it open): it is compared again at the next sweep
    clock.now += datapath.SWEEP_SECONDS
    assert [ino for ino, _ in backing.changed()] == [7]


def test_a_sweep_compares_at_most_its_budget_longest_due_first(tmp_path, monkeypatch):
    monkeypatch.setattr(datapath, "SWEEP_BUDGET", 10)
    clock = FakeClock()
    backing = datapath.Backing(lambda fd: 1, lambda bid: None, clock=clock)
    for ino in range(25):
        path, sid = _watched_file(tmp_path, f"f{ino}")
        backing.watch(ino, path, sid)
        with open(path, "ab") as f:  # all of them moved
            f.write(b"m")
        clock.now += 0.01
    found = [[ino for ino, _ in backing.changed()] for _ in range(3)]
    assert found == [list(range(10)), list(range(10, 20)), list(range(20, 25))]


def test_a_watched_file_removed_is_dropped_and_one_that_cannot_be_read_stays(tmp_path, monkeypatch):
    clock = FakeClock()
    backing = datapath.Backing(lambda fd: 1, lambda bid: None, clock=clock)
    removed, sid = _watched_file(tmp_path, "removed")
    backing.watch(1, removed, sid)
    failing, sid = _watched_file(tmp_path, "failing")
    backing.watch(2, failing, sid)
    os.unlink(removed)
    stat = os.stat

    def eio_for_failing(path):
        if path == failing:
            raise OSError(5, "Input/output error")
        return stat(path)

    monkeypatch.setattr(datapath.os, "stat", eio_for_failing)
    assert backing.changed() == []
    assert list(backing.watched) == [2]  # compared again later
    monkeypatch.setattr(datapath.os, "stat", stat)
    with open(failing, "ab") as f:
        f.write(b"m")
    clock.now += datapath.SWEEP_SECONDS
    assert [ino for ino, _ in backing.changed()] == [2]

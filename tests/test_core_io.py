"""The filesystem core without FUSE: open modes, read/write, truncate, fsync, recovery."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from conftest import ROOT, ROOT_CALLER, fs_errno as err, fsmeta_problems
from ckptfs.fsmeta import FileState
from ckptfs.gateway.core import FsCore, SetattrRequest

GiB = 1 << 30


def new_file(core: FsCore, name: bytes = b"f", flags: int = os.O_RDWR) -> tuple[int, int]:
    fh, attr = core.create(ROOT, name, 0o644, flags, ROOT_CALLER)
    return fh, attr.ino


def read_all(core: FsCore, ino: int) -> bytes:
    fh = core.open(ino, os.O_RDONLY)
    try:
        return core.read(fh, 0, 1 << 30)
    finally:
        core.release(fh)


@pytest.fixture(autouse=True)
def _consistent(core_env):
    yield
    if core_env.meta is not None:
        assert fsmeta_problems(core_env.meta) == []


def test_write_read_and_size(core):
    fh, ino = new_file(core)
    assert core.write(fh, 0, b"hello world") == 11
    assert core.read(fh, 6, 100) == b"world"
    assert core.read(fh, 11, 10) == b""
    assert core.read(fh, 100, 10) == b""
    assert core.getattr(ino).size == 11  # the open file's size, before any flush
    core.release(fh)
    assert core.getattr(ino).size == 11
    assert read_all(core, ino) == b"hello world"


def test_access_mode_is_per_handle(core):
    fh, ino = new_file(core, flags=os.O_WRONLY)
    core.write(fh, 0, b"abc")
    ro = core.open(ino, os.O_RDONLY)
    assert err(core.write, ro, 0, b"x") == errno.EBADF
    rw = core.open(ino, os.O_RDWR)
    core.write(rw, 1, b"X")
    assert core.read(ro, 0, 3) == b"aXc"
    for h in (fh, ro, rw):
        core.release(h)
    assert err(core.release, fh) == errno.EBADF
    assert err(core.read, fh, 0, 1) == errno.EBADF


def test_o_trunc_truncates_on_open_also_read_only(core):
    # libfuse negotiates atomic_o_trunc: O_TRUNC comes with the open (the kernel has
    # checked write permission), and Linux truncates even for O_RDONLY.
    fh, ino = new_file(core)
    core.write(fh, 0, b"content")
    core.release(fh)
    ro = core.open(ino, os.O_RDONLY | os.O_TRUNC)
    assert core.getattr(ino).size == 0
    assert core.read(ro, 0, 100) == b""
    core.release(ro)
    core.setattr(ino, SetattrRequest(size=3))
    assert read_all(core, ino) == bytes(3)  # the cut bytes never come back
    wo = core.open(ino, os.O_WRONLY | os.O_TRUNC)
    core.write(wo, 0, b"new")
    core.release(wo)
    assert read_all(core, ino) == b"new"


def test_sparse_write_reads_zeros_in_the_hole(core):
    fh, ino = new_file(core)
    core.write(fh, 1 << 20, b"tail")
    assert core.getattr(ino).size == (1 << 20) + 4
    data = core.read(fh, 0, (1 << 20) + 4)
    assert data == bytes(1 << 20) + b"tail"
    core.release(fh)
    data_file = os.path.join(core.data_dir, f"{ino:x}")
    assert os.stat(data_file).st_blocks * 512 < (1 << 20)  # the cache file stays sparse


def test_offsets_past_4_gib(core_env):
    core = core_env.core
    fh, ino = new_file(core)
    off = 5 * GiB + 123
    core.write(fh, off, b"far away")
    core.write(fh, 4 * GiB - 2, b"span")  # crosses the 32-bit boundary
    core.fsync(fh, False)
    core.release(fh)
    core = core_env.reopen()
    assert core.getattr(ino).size == off + 8
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, off, 100) == b"far away"
    assert core.read(fh, 4 * GiB - 4, 8) == b"\0\0span\0\0"
    core.release(fh)


def test_truncate_down_and_up_zero_fills(core):
    fh, ino = new_file(core)
    core.write(fh, 0, b"0123456789")
    core.setattr(ino, SetattrRequest(size=4), fh)
    assert core.read(fh, 0, 100) == b"0123"
    core.setattr(ino, SetattrRequest(size=8), fh)  # the old bytes must not come back
    assert core.read(fh, 0, 100) == b"0123\0\0\0\0"
    core.release(fh)
    core.setattr(ino, SetattrRequest(size=2))  # truncate(2) of a closed file
    assert core.getattr(ino).size == 2
    assert read_all(core, ino) == b"01"
    core.setattr(ino, SetattrRequest(size=6))
    assert read_all(core, ino) == b"01\0\0\0\0"


def test_write_after_truncate_in_another_handle(core):
    fh1, ino = new_file(core)
    core.write(fh1, 0, b"x" * 100)
    fh2 = core.open(ino, os.O_RDWR)
    core.setattr(ino, SetattrRequest(size=0), fh2)
    core.write(fh1, 10, b"y")
    assert core.read(fh2, 0, 100) == bytes(10) + b"y"
    core.release(fh1)
    core.release(fh2)
    assert core.getattr(ino).size == 11


def test_every_write_after_a_flush_bumps_the_generation(core):
    fh, ino = new_file(core)

    def gen():
        with core.meta.read() as txn:
            inode = txn.get_inode(ino)
            return inode.generation, inode.state, txn.get_pending(ino)

    g1, _, _ = gen()
    core.write(fh, 0, b"a")
    # A file created by this open was born DIRTY, queued and with its writer counted, in
    # one transaction: its first epoch needs no bump (no one saw it without a writer).
    assert gen() == (g1, FileState.DIRTY, gen()[2]) and gen()[2] is not None
    core.write(fh, 1, b"b")
    assert gen()[0] == g1  # one bump per flush interval, not per write
    core.flush(fh)
    core.write(fh, 2, b"c")
    assert gen()[0] == g1 + 1
    core.fsync(fh, True)
    core.setattr(ino, SetattrRequest(size=1), fh)
    assert gen()[0] == g1 + 2
    core.release(fh)


def test_fsync_makes_size_and_data_visible_to_a_new_process(core_env):
    core = core_env.core
    fh, ino = new_file(core)
    core.write(fh, 0, b"A" * 5000)
    core.fsync(fh, False)
    # Crash: the handle is never released; a new gateway opens the same cache.
    core = core_env.reopen()
    assert core.lookup(ROOT, b"f").size == 5000
    assert read_all(core, ino) == b"A" * 5000
    with core.meta.read() as txn:
        assert txn.writer_count(ino) == 0  # open-writer counts do not survive a restart


def test_close_persists_size_without_fsync(core_env):
    core = core_env.core
    fh, ino = new_file(core)
    core.write(fh, 0, b"B" * 3000)
    core.release(fh)  # no fsync: committed to fsmeta, not forced to the device
    core = core_env.reopen()  # a gateway crash (the kernel keeps its page cache)
    assert core.getattr(ino).size == 3000
    assert read_all(core, ino) == b"B" * 3000


def test_recovery_cuts_unacknowledged_bytes(core_env):
    core = core_env.core
    fh, ino = new_file(core)
    core.write(fh, 0, b"A" * 100)
    core.fsync(fh, False)
    core.write(fh, 100, b"B" * 100)  # never flushed: fsmeta still says 100 bytes
    core = core_env.reopen(recover=False)
    assert core.recover()["trimmed_files"] == 1
    assert read_all(core, ino) == b"A" * 100
    # Extending it again must show zeros, not the cut bytes.
    core.setattr(ino, SetattrRequest(size=150))
    assert read_all(core, ino) == b"A" * 100 + bytes(50)


def test_fdatasync_and_fsyncdir(core):
    fh, ino = new_file(core)
    core.write(fh, 0, b"data")
    core.fsync(fh, True)
    dh = core.opendir(ROOT)
    core.fsyncdir(dh, False)
    core.fsyncdir(dh, True)
    core.releasedir(dh)
    core.release(fh)
    assert read_all(core, ino) == b"data"


def test_open_of_a_directory_is_eisdir(core):
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    assert err(core.open, d.ino, os.O_RDONLY) == errno.EISDIR
    s = core.symlink(ROOT, b"s", b"d", ROOT_CALLER)
    assert err(core.open, s.ino, os.O_RDONLY) == errno.EINVAL
    assert err(core.open, 999999, os.O_RDONLY) == errno.ENOENT


def test_concurrent_writers_from_threads(core):
    fh, ino = new_file(core)
    chunk = 64 * 1024

    def writer(k):
        for i in range(16):
            off = (i * 8 + k) * chunk
            core.write(fh, off, bytes([k + 1]) * chunk)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    core.release(fh)
    data = read_all(core, ino)
    assert len(data) == 128 * chunk
    for j in range(128):
        assert data[j * chunk:(j + 1) * chunk] == bytes([j % 8 + 1]) * chunk


def test_statfs_reports_the_cache_device(core):
    st = core.statfs()
    ref = os.statvfs(core.cache_dir)
    assert (st.f_bsize, st.f_blocks, st.f_files) == (ref.f_bsize, ref.f_blocks, ref.f_files)


def test_writer_count_follows_writable_handles(core):
    fh, ino = new_file(core)
    ro = core.open(ino, os.O_RDONLY)
    wo = core.open(ino, os.O_WRONLY)

    def writers():
        with core.meta.read() as txn:
            return txn.writer_count(ino)

    assert writers() == 2
    core.release(fh)
    assert writers() == 1
    core.release(wo)
    core.release(ro)
    assert writers() == 0


def test_new_file_never_shows_a_stale_cache_file_of_its_inode_number(core):
    """After a power cut loses the commit that handed out an inode number, the next file
    gets that number again while its old cache file may survive: it must read empty."""
    with core.meta.read() as txn:
        from ckptfs.fsmeta import schema
        next_ino = schema.unpack_u64(txn.raw.get(b"next_ino", db=txn.dbs["meta"]))
    with open(core._data_path(next_ino), "wb") as stale:
        stale.write(b"leftover bytes of a lost file")
    fh, attr = core.create(ROOT, b"fresh", 0o644, os.O_RDWR, ROOT_CALLER)
    assert attr.ino == next_ino
    core.setattr(attr.ino, SetattrRequest(size=29), fh)
    assert core.read(fh, 0, 100) == bytes(29)
    core.release(fh)


def test_a_created_file_reaches_the_drain_with_its_writer_and_a_failed_create_leaves_none(core, monkeypatch):
    """The drain must never see a file created for writing without its writer (it would
    upload it while it is written); a create whose cache file cannot be made must not
    leave a writer behind (the file would never drain)."""
    fh, ino = new_file(core, b"kept", os.O_WRONLY)
    core.meta.commit()
    with core.meta.read_committed() as txn:
        assert txn.get_inode(ino) is not None and txn.writer_count(ino) == 1
    core.release(fh)
    core.meta.commit()
    with core.meta.read_committed() as txn:
        assert txn.writer_count(ino) == 0

    failed = []

    def full_device(ino, spare=None):
        failed.append(ino)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core._state, "create_cache_file", full_device)
    with pytest.raises(OSError):
        core.create(ROOT, b"failed", 0o644, os.O_WRONLY, ROOT_CALLER)
    with core.meta.read() as txn:  # (the name goes too: tests/regressions/test_create_workers_found.py)
        assert txn.writer_count(failed[0]) == 0


def test_a_writer_of_a_file_created_read_only_bumps_before_its_first_bytes(core):
    """Only a create for writing is born with its writer; a file created O_RDONLY may be
    uploaded before someone opens it for writing, so that writer's bytes need a bump."""
    fh_ro, ino = new_file(core, b"ro", os.O_RDONLY)

    def generation():
        with core.meta.read() as txn:
            return txn.get_inode(ino).generation

    g0 = generation()
    fh_w = core.open(ino, os.O_WRONLY)
    core.write(fh_w, 0, b"x")
    assert generation() == g0 + 1
    core.release(fh_w)
    core.release(fh_ro)


def test_release_drops_handle_and_writer_count_even_when_persisting_fails(core, monkeypatch):
    fh, ino = new_file(core)
    core.write(fh, 0, b"data")

    def full_device(of, then=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(core._files, "persist", full_device)
        with pytest.raises(OSError) as exc:
            core.release(fh)
    assert exc.value.errno == errno.ENOSPC  # reported...
    with core.meta.read() as txn:
        assert txn.writer_count(ino) == 0  # ...but the drain is not blocked by a dead writer
    assert ino not in core._open
    assert err(core.release, fh) == errno.EBADF
    # The file can be opened, written and closed again, and its size is stored.
    fh = core.open(ino, os.O_WRONLY)
    core.write(fh, 0, b"again")
    core.release(fh)
    assert core.getattr(ino).size == 5 and read_all(core, ino) == b"again"


def data_dir_fsyncs(core, monkeypatch) -> list[int]:
    """Record each fsync of the cache's data/ directory."""
    calls = []
    real_fsync = os.fsync
    data_dir = os.stat(core.data_dir)

    def spy(fd):
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (data_dir.st_dev, data_dir.st_ino):
            calls.append(fd)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_fsync_makes_the_cache_file_name_durable_after_reopen(core, monkeypatch):
    fh, ino = new_file(core)
    core.write(fh, 0, b"data")
    core.release(fh)  # its cache file's name is not on the device yet
    synced = data_dir_fsyncs(core, monkeypatch)
    fh = core.open(ino, os.O_RDWR)
    core.fsync(fh, False)
    assert len(synced) == 1
    core.fsync(fh, True)
    assert len(synced) == 1  # once is enough
    core.release(fh)


def test_fsync_makes_a_cache_file_made_by_truncate_durable(core, monkeypatch):
    fh, ino = new_file(core)
    core.fsync(fh, False)
    core.release(fh)
    os.unlink(core._data_path(ino))  # e.g. evicted once its bytes were in the bucket
    core.setattr(ino, SetattrRequest(size=10))  # truncate re-creates the cache file
    synced = data_dir_fsyncs(core, monkeypatch)
    fh = core.open(ino, os.O_RDWR)
    core.fsync(fh, False)
    core.release(fh)
    assert len(synced) == 1


def test_a_symlink_planted_in_the_cache_is_not_followed(core, tmp_path):
    fh, ino = new_file(core)
    core.release(fh)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = core._data_path(ino)
    os.unlink(path)
    os.symlink(victim, path)
    with pytest.raises(OSError) as exc:
        core.open(ino, os.O_WRONLY)
    assert exc.value.errno == errno.ELOOP
    with pytest.raises(OSError):
        core.setattr(ino, SetattrRequest(size=0))
    assert victim.read_bytes() == b"precious"
    with core.meta.read() as txn:
        assert txn.writer_count(ino) == 0


def test_recovery_removes_cache_files_of_inodes_that_do_not_exist(core_env):
    core = core_env.core
    fh, ino = new_file(core)
    core.write(fh, 0, b"kept")
    core.release(fh)
    data = core.data_dir
    # A crash after the commit that dropped an inode, before its cache file was unlinked.
    stray = os.path.join(data, f"{ino + 1000:x}")
    with open(stray, "wb") as f:
        f.write(b"bytes of a deleted file")
    foreign = [os.path.join(data, name) for name in ("notes.txt", "0x10", "00ff")]
    for path in foreign:
        open(path, "wb").close()
    core = core_env.reopen(recover=False)
    assert core.recover()["stray_cache_files"] == 1
    assert not os.path.exists(stray)
    assert all(os.path.exists(p) for p in foreign)  # not a cache file name: left alone
    assert read_all(core, ino) == b"kept"


def test_names_awaiting_a_data_dir_fsync_do_not_pile_up(core, monkeypatch):
    """Checkpoints are often closed without fsync: the gateway must not remember every
    such cache file forever."""
    from ckptfs.gateway import state

    monkeypatch.setattr(state, "UNSYNCED_NAMES_MAX", 3)
    synced = data_dir_fsyncs(core, monkeypatch)
    for i in range(7):
        fh, _ = new_file(core, b"f%d" % i)
        core.release(fh)
    assert len(core._state.unsynced_cache_names) < 3 and len(synced) == 2
    fh, ino = new_file(core, b"gone")
    core.release(fh)
    core.unlink(ROOT, b"gone")
    core.forget([(ino, 1)])
    assert ino not in core._state.unsynced_cache_names


def committed_generation(core: FsCore, ino: int) -> int | None:
    """The generation the drain sees (committed), None if the drain cannot see the inode yet."""
    with core.meta.read_committed() as txn:
        inode = txn.get_inode(ino)
        return inode.generation if inode is not None else None


def test_with_deferred_commits_the_drain_sees_a_bump_before_the_bytes_change(core_env, monkeypatch):
    from ckptfs.fsmeta import store

    monkeypatch.setattr(store, "BATCH_IDLE_SECONDS", 3600.0)
    core = core_env.core
    core.meta.defer_commits(3600.0)  # nothing is committed unless someone needs it
    fh, ino = new_file(core)
    core.write(fh, 0, b"first")
    # A file created in the open batch: the drain sees it only together with its bump.
    assert committed_generation(core, ino) is None
    core.release(fh)
    core.meta.commit()
    before = committed_generation(core, ino)
    fh = core.open(ino, os.O_WRONLY)
    core.write(fh, 0, b"second")
    after_write = committed_generation(core, ino)
    assert after_write > before
    core.release(fh)
    core.meta.commit()
    core.setattr(ino, SetattrRequest(size=2))
    assert committed_generation(core, ino) > after_write


def test_with_deferred_commits_a_cache_file_is_removed_only_once_its_unlink_is_committed(core_env, monkeypatch):
    """A crash before the commit brings the unlinked file back: it must come back with its bytes."""
    from ckptfs.fsmeta import store

    monkeypatch.setattr(store, "BATCH_IDLE_SECONDS", 3600.0)
    core = core_env.core
    core.meta.defer_commits(3600.0)
    fh, ino = new_file(core)
    core.write(fh, 0, b"kept until the unlink is committed")
    core.release(fh)
    core.meta.commit()
    core.unlink(ROOT, b"f")
    core.forget([(ino, 1)])  # the kernel's last reference: the inode is purged
    cache_file = core._data_path(ino)
    assert os.path.exists(cache_file)
    core.meta.commit()
    assert not os.path.exists(cache_file)


def test_with_deferred_commits_a_forgotten_unlinked_inode_is_purged_without_another_write(core_env):
    """The purge after the kernel's last FORGET waits for no later operation: the committer
    runs it (MetaStore.write_soon), and the cache file goes after that commit."""
    core = core_env.core
    core.meta.defer_commits(0.01)
    fh, ino = new_file(core)
    core.write(fh, 0, b"bytes")
    core.release(fh)
    core.unlink(ROOT, b"f")
    core.meta.commit()
    cache_file = core._data_path(ino)
    assert os.path.exists(cache_file)  # the kernel still holds a reference
    core.forget([(ino, 1)])
    deadline = time.monotonic() + 10
    while os.path.exists(cache_file):
        assert time.monotonic() < deadline, "the forgotten inode was never purged"
        time.sleep(0.005)
    with core.meta.read_committed() as txn:
        assert txn.get_inode(ino) is None

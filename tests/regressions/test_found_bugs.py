"""Bugs the test suite found, each reduced to the smallest sequence that showed it.

Keep every one of these: each failed before its fix (named in the docstring).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading

import pytest
from ckptfs_fuse import FuseError

from conftest import ROOT, ROOT_CALLER, CoreEnv, in_mount_table, needs_fuse
from ckptfs.fsmeta import FileState
from ckptfs.gateway.core import SetattrRequest
from ckptfs.gateway.errors import FsError
from ckptfs.gateway.fuse_ops import CkptOperations


def test_directory_rename_to_a_key_of_exactly_1024_bytes(tmp_path):
    """gateway/core.py FsCore._check_key counted the "/" after a renamed directory twice
    (once for its marker key, once at the start of the longest key below it), so a
    directory rename whose deepest key would be exactly 1024 bytes got ENAMETOOLONG."""
    env = CoreEnv(tmp_path / "cache", key_prefix="p")  # "p/" = 2 bytes
    core = env.core
    for top, leaf in ((b"a", b"f" * 254), (b"b", b"f" * 255)):
        d = core.mkdir(ROOT, top, 0o755, ROOT_CALLER).ino
        for part in (b"B" * 255, b"C" * 255):
            d = core.mkdir(d, part, 0o755, ROOT_CALLER).ino
        fh, _ = core.create(d, leaf, 0o644, 1, ROOT_CALLER)
        core.release(fh)
    # "p/" + 255 + "/" + 255 + "/" + 255 + "/" + 254 = 1024 bytes exactly: allowed.
    core.rename(ROOT, b"a", ROOT, b"A" * 255)
    assert core.lookup(ROOT, b"A" * 255)
    # One byte more is not.
    with pytest.raises(FsError) as exc:
        core.rename(ROOT, b"b", ROOT, b"Z" * 255)
    assert exc.value.errno == errno.ENAMETOOLONG
    env.close()


def test_security_capability_lookups_do_not_reach_the_core(core, monkeypatch):
    """gateway/fuse_ops.py CkptOperations.getxattr: FUSE clears SB_NOSEC, so the kernel sends
    getxattr("security.capability") before every write(2). Each went through a worker
    thread and an LMDB read transaction; 4 KiB writes ran at ~10 MiB/s. Non-user names are
    now answered ENODATA at once (by the front end itself, ``user_xattrs_only``, and by this
    handler if one gets through)."""
    ops = CkptOperations(core)

    def must_not_run(*args):
        raise AssertionError("core.getxattr called for a non-user attribute")

    monkeypatch.setattr(core, "getxattr", must_not_run)
    for name in (b"security.capability", b"system.posix_acl_access", b"trusted.x"):
        with pytest.raises(FuseError) as exc:
            ops.getxattr(ROOT, name)
        assert exc.value.errno == errno.ENODATA


@needs_fuse
def test_dead_mount_is_detected_while_stat_is_still_cached(gateway_factory):
    """gateway/mount.py clear_dead_mount used os.stat to spot a crashed gateway's mount, but
    the kernel answers stat of the mount root from its attribute cache for up to a second
    after the daemon died: a gateway restarted at once by its supervisor then refused with
    "something is already mounted there". statfs always reaches the (dead) connection."""
    from ckptfs.gateway.mount import clear_dead_mount

    gw = gateway_factory()
    os.stat(gw.mnt)  # the root's attributes are now cached
    gw.kill9()
    with contextlib.suppress(OSError):
        os.stat(gw.mnt)  # typically still succeeds here: this is what fooled the old check
    assert clear_dead_mount(str(gw.mnt)) is True
    assert not in_mount_table(gw.mnt)
    gw.start()
    assert os.listdir(gw.mnt) == []


@needs_fuse
def test_model_sequence_fstat_of_a_directory_opened_read_only(mnt):
    """Found by tests/test_model_fs.py: mkdir a; open(a, O_RDONLY); fstat. The mount and ext4
    agree on everything but st_size (ext4: 4096, ckptfs: 0), which the model now ignores for
    directories; the sequence itself must keep working."""
    import stat

    os.mkdir(mnt / "a")
    fd = os.open(mnt / "a", os.O_RDONLY)
    try:
        st = os.fstat(fd)
        assert stat.S_ISDIR(st.st_mode) and st.st_nlink == 2 and st.st_size == 0
        assert stat.S_IMODE(st.st_mode) == 0o755
        with pytest.raises(IsADirectoryError):
            os.read(fd, 1)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_read_only_o_trunc_open_truncates_in_the_core(core):
    """gateway/core.py FsCore.open skipped O_TRUNC for O_RDONLY opens. With atomic_o_trunc
    (negotiated by libfuse) the kernel sets its size to 0 and leaves the truncation to the
    open; the gateway kept the old size and bytes, which came back after the attribute
    timeout or when the file was extended again."""
    fh, attr = core.create(ROOT, b"b", 0o644, os.O_WRONLY, ROOT_CALLER)
    core.write(fh, 0, b"\x01")
    core.flush(fh)
    ro = core.open(attr.ino, os.O_RDONLY | os.O_TRUNC)
    assert core.getattr(attr.ino).size == 0
    core.setattr(attr.ino, SetattrRequest(size=1), fh)
    assert core.read(ro, 0, 10) == b"\x00"
    core.release(ro)
    core.release(fh)


@needs_fuse
def test_model_sequence_read_only_o_trunc_then_extend(mnt):
    """Found by tests/test_model_fs.py (the mount showed b"\\x01", ext4 b"\\x00"):
    create b and write 1 byte (kept open); read b through another handle (its close
    flushes the byte to the gateway); open b O_RDONLY|O_TRUNC; ftruncate the first
    handle to 1 byte; read b."""
    p = mnt / "b"
    fd0 = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd0, b"\x01")
    assert p.read_bytes() == b"\x01"
    fd1 = os.open(p, os.O_RDONLY | os.O_TRUNC)
    assert p.read_bytes() == b""
    os.ftruncate(fd0, 1)
    assert p.read_bytes() == b"\x00"
    os.close(fd0)
    os.close(fd1)


@needs_fuse
def test_read_only_o_trunc_survives_a_remount(gateway):
    """Same bug, second symptom: the kernel showed size 0 after the open (with the
    writeback cache it trusts its own size), the gateway kept the old content, and after
    a remount the old content was back."""
    p = gateway.mnt / "f"
    p.write_bytes(b"old content")
    os.close(os.open(p, os.O_RDONLY | os.O_TRUNC))
    assert os.stat(p).st_size == 0
    assert gateway.stop() == 0
    gateway.start()
    assert os.stat(p).st_size == 0 and p.read_bytes() == b""


def _passthrough(core) -> dict[int, int]:
    """Passthrough mode with backing ids handed out in memory; returns the live ids' fds."""
    backing_ids = {}
    new_ids = itertools.count(1)

    def open_id(fd):
        backing_ids[bid := next(new_ids)] = fd
        return bid

    core.enable_passthrough(open_id, backing_ids.pop)
    return backing_ids


def test_truncate_by_path_while_the_last_handle_is_released_elsewhere(core):
    """CI, test_mount_stress (passthrough): one EBADF among 17,000 operations. FsCore.setattr
    took the open file from ``open_files`` and used its fd after dropping the state lock; the
    last handle's release, in another worker thread, closed that fd in between (and a reused
    number could have named another file). The open file is pinned now (OpenFiles.pinned_or_claimed)."""
    backing_ids = _passthrough(core)
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    with open(core._data_path(attr.ino), "r+b") as kernel_write:  # a passthrough WRITE
        kernel_write.write(b"x" * 1000)
    files = core._files
    persist = files.persist
    released = []

    def release_elsewhere_then_persist(of, then=None):
        if not released:
            released.append(fh)
            worker = threading.Thread(target=core.release, args=(fh,))
            worker.start()
            worker.join()
        return persist(of, then)

    files.persist = release_elsewhere_then_persist
    assert core.setattr(attr.ino, SetattrRequest(size=10)).size == 10  # was EBADF
    assert released
    assert not core._state.open_files and not backing_ids  # the pin closed both at its end
    assert os.stat(core._data_path(attr.ino)).st_size == 10
    assert core.getattr(attr.ino).size == 10


def test_an_open_that_read_the_inode_before_the_last_release_stored_its_size(core):
    """Fresh-clone CI, test_mount_posix.py::test_open_creat_excl_trunc[passthrough]: a file
    rewritten, closed and read back at once read back empty. A passthrough close(2) sends no
    FLUSH, so the next open can read the inode (old size) before the RELEASE stores the new
    one; the RELEASE then closed the open file, and the open, finding none, took itself for
    the first and cut the cache file to the size it had read (OpenFiles._adopt). A last
    close now counts as a change an open must read again after (CoreState.claim_seq)."""
    _passthrough(core)
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_WRONLY, ROOT_CALLER)
    with open(core._data_path(attr.ino), "r+b") as kernel_write:  # a passthrough WRITE
        kernel_write.write(b"2nd")
    files = core._files
    open_handle = files.open_handle

    def release_lands_first(inode, flags, **kwargs):
        if fh in core._state.handles:  # the writer's RELEASE, between the read and the open
            core.release(fh)
        return open_handle(inode, flags, **kwargs)

    files.open_handle = release_lands_first
    reader = core.open(attr.ino, os.O_RDONLY)
    assert fh not in core._state.handles
    assert os.stat(core._data_path(attr.ino)).st_size == 3  # was 0
    assert core.getattr(attr.ino).size == 3
    core.release(reader)


# -- races between the FUSE worker threads (gateway/workers.py), forced deterministically --------


def _in_main_thread_after_first_read(core, monkeypatch, action):
    """Run ``action()`` right after the calling (main) thread's next fsmeta read ends."""
    real_read, main, done = core.meta.read, threading.current_thread(), []

    @contextlib.contextmanager
    def read_then_act():
        with real_read() as txn:
            yield txn
        if not done and threading.current_thread() is main:
            done.append(True)
            action()

    monkeypatch.setattr(core.meta, "read", read_then_act)
    return done


def _run_elsewhere(fn, *args, wait: float | None = None) -> threading.Thread:
    """``fn(*args)`` in another thread (a second FUSE worker), joined up to ``wait`` seconds
    (None: to its end). A fixed build blocks it on a lock; the test goes on and joins later."""
    errors = []

    def run():
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test after join
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.errors = errors
    worker.start()
    worker.join(wait)
    return worker


def test_open_of_a_clean_file_while_the_evictor_removes_it_never_reads_zeros(core, monkeypatch):
    """Audit of the worker-thread races. FsCore.open read the inode (clean, cached) after the
    evictor had claimed it, and reached OpenFiles.open_handle after the eviction ended: the
    inode was no longer in ``evicting`` and ``eviction_seq`` had moved only at the claim,
    before the open looked at it. So the open created an empty cache file for an evicted
    (REMOTE) file and read zeros for its bytes. The claim count moves when a claim ends too
    (CoreState.end_claims), so the open reads the inode again."""
    from test_cache_space import cached, cap, make_durable, state, write_file

    ino = write_file(core, b"f", 4096)
    make_durable(core, ino)
    space = cap(core, 1)
    claimed, opener_read = threading.Event(), threading.Event()
    real_write = core.meta.write

    def mark_evicted_after_the_opener_read(fn):
        if threading.current_thread() is evictor and not claimed.is_set():
            claimed.set()  # the evictor has claimed the inode, and not marked it yet
            assert opener_read.wait(10)
        return real_write(fn)

    monkeypatch.setattr(core.meta, "write", mark_evicted_after_the_opener_read)
    evictor = threading.Thread(target=space.evict_now, args=([ino],))
    evictor.start()
    assert claimed.wait(10)
    _in_main_thread_after_first_read(core, monkeypatch, lambda: (opener_read.set(), evictor.join()))
    try:
        fh = core.open(ino, os.O_RDONLY)
    except FsError as exc:
        assert exc.errno == errno.EIO  # in the bucket only, and this core has no bucket
    else:
        data = core.read(fh, 0, 4096)
        core.release(fh)
        assert data == b"x" * 4096  # was 4096 zero bytes
    assert not evictor.is_alive()
    assert state(core, ino) == FileState.REMOTE and not cached(core, ino)


def test_first_open_while_a_truncate_by_path_runs_sees_the_new_size(core, monkeypatch):
    """Audit of the worker-thread races. The first open of a file read its inode (1000 bytes),
    then a truncate by path (no handle open: nothing pinned, nothing locked) cut it to 10
    bytes and returned, and only then did the open register its OpenFile with the old size:
    stat showed 1000 and reads gave 990 zeros after the truncate had returned (passthrough:
    the open even cut the cache file back to 1000). A truncate with no open file now claims
    the inode (OpenFiles.pinned_or_claimed) like the evictor does, so the open reads it again."""
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, b"x" * 1000)
    core.release(fh)
    ino = attr.ino
    truncated = _in_main_thread_after_first_read(
        core, monkeypatch, lambda: _run_elsewhere(core.setattr, ino, SetattrRequest(size=10)))
    fh = core.open(ino, os.O_RDONLY)
    assert truncated
    assert core.getattr(ino).size == 10  # was 1000
    assert core.read(fh, 0, 4096) == b"x" * 10
    core.release(fh)


def test_write_through_a_first_open_during_a_truncate_by_path_is_kept(core, monkeypatch):
    """Audit of the worker-thread races. A truncate by path found no open file, so it held no
    I/O lock; another thread opened the file and wrote b"hello" after the truncate had cut
    the cache file, and the truncate then set that new open file's size to 0: the write,
    acknowledged, was gone (reads empty, size 0 stored at close). The truncate now holds the
    inode claimed until it is done, so the first open (and its write) waits for it."""
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, b"x" * 1000)
    core.release(fh)
    ino = attr.ino
    files = core._files
    truncate_data = files.truncate_data
    handles = []

    def open_and_write():
        handles.append(core.open(ino, os.O_RDWR))
        assert core.write(handles[0], 0, b"hello") == 5

    writers = []

    def cut_then_let_another_thread_write(*args):
        truncate_data(*args)
        if not writers:  # the fixed build blocks the open here: go on after a while
            writers.append(_run_elsewhere(open_and_write, wait=1.0))

    monkeypatch.setattr(files, "truncate_data", cut_then_let_another_thread_write)
    core.setattr(ino, SetattrRequest(size=0))
    writers[0].join()
    assert not writers[0].errors
    assert core.read(handles[0], 0, 100) == b"hello"  # was b""
    core.release(handles[0])
    assert core.getattr(ino).size == 5


def test_utimes_while_another_handle_flushes_keeps_the_new_mtime(core, monkeypatch):
    """Audit of the worker-thread races. A flush took the open file's size and times (and
    cleared ``attrs_dirty``), then a setattr of the mtime (utimes, touch -d, tar) stored its
    time and returned, and then the flush's transaction stored the old time over it; nothing
    was dirty any more, so the new mtime was lost at close. A setattr of an open file now
    holds its I/O lock, as persist does, so the two are one after the other."""
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, b"x" * 10)
    new_mtime = 1_600_000_000 * 10**9
    real_write = core.meta.write
    setters = []

    def persist_after_a_setattr_elsewhere(fn):
        if fn.__name__ == "persist" and not setters:  # the flush's snapshot is taken
            setters.append(_run_elsewhere(core.setattr, attr.ino, SetattrRequest(mtime_ns=new_mtime), wait=1.0))
        return real_write(fn)

    monkeypatch.setattr(core.meta, "write", persist_after_a_setattr_elsewhere)
    core.flush(fh)
    setters[0].join()
    assert not setters[0].errors
    core.release(fh)
    assert core.getattr(attr.ino).mtime_ns == new_mtime


def test_sweep_of_mapped_files_never_stores_a_size_older_than_a_later_writers(core, monkeypatch):
    """Audit of the worker-thread races (passthrough). The sweep (every second, in a thread)
    stats the watched cache files; one had grown to 150 bytes through a shared mapping. Before
    the sweep stored that, another writer opened the file, wrote up to 300 bytes and closed
    it (storing 300); the sweep then stored its 150: the file shrank to 150 bytes in fsmeta
    (stat, reads, the upload). The sweep now claims each inode, stats it again and stores it
    only if it moved since the last persist (datapath.Backing.rebase)."""
    _passthrough(core)
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    path = core._data_path(attr.ino)
    with open(path, "r+b") as kernel:  # passthrough WRITEs
        kernel.write(b"x" * 100)
    core.release(fh)
    with open(path, "r+b") as mapping:  # a shared mapping that outlived close()
        mapping.seek(100)
        mapping.write(b"m" * 50)
    backing = core._state.backing
    changed = backing.changed

    def changed_then_another_writer():
        found = changed()  # the sweep's stat: 150 bytes
        fh = core.open(attr.ino, os.O_RDWR)
        with open(path, "r+b") as kernel:
            kernel.seek(150)
            kernel.write(b"y" * 150)
        core.release(fh)  # stores 300
        return found

    monkeypatch.setattr(backing, "changed", changed_then_another_writer)
    core.sweep_mapped()
    assert core.getattr(attr.ino).size == 300  # was 150
    assert os.stat(path).st_size == 300


def test_an_evicted_file_truncated_while_a_reader_opens_it_keeps_its_prefix(tmp_path, monkeypatch):
    """Audit of the worker-thread races. A truncate of an evicted (REMOTE) file fetched the
    bytes it keeps, dropped the fetch state (Fetcher.detach), then recorded the truncate. A
    reader that opened the file in between registered new fetch state, which cuts the cache
    file to nothing first ("what a dropped fetch left is not known to be anything"): the kept
    prefix was zeros from then on. The truncate now holds its fetch state until the truncate is
    recorded and detaches it under the claim; Fetcher.acquire reads the inode again after
    opening the cache file, and leaves a file that stopped being REMOTE alone."""
    from test_core_readpath import ReadEnv

    from ckptfs.gateway.fetch import ReadSettings

    env = ReadEnv(tmp_path, ReadSettings(part_size=256 << 10, max_readahead=1 << 20, concurrency=4))
    try:
        core = env.core
        data = os.urandom(300_000)
        ino = env.remote(b"f", data)  # as an eviction leaves it
        fetcher = core._state.fetcher
        detach = fetcher.detach
        readers = []

        def open_and_close():
            core.release(core.open(ino, os.O_RDONLY))

        def detach_then_a_reader_opens(i):
            detach(i)
            if not readers:
                readers.append(_run_elsewhere(open_and_close, wait=1.0))

        monkeypatch.setattr(fetcher, "detach", detach_then_a_reader_opens)
        assert core.setattr(ino, SetattrRequest(size=100_000)).size == 100_000
        if not readers:  # the fixed build detaches where no reader can come in; open one after
            readers.append(_run_elsewhere(open_and_close))
        readers[0].join()
        assert not readers[0].errors
        fh = core.open(ino, os.O_RDONLY)
        assert core.read(fh, 0, 300_000) == data[:100_000]  # was 100,000 zero bytes
        core.release(fh)
    finally:
        env.close()
        env.client.close()


def test_an_eviction_during_the_last_release_leaves_no_phantom_allocation(core, monkeypatch):
    """Audit of the worker-thread races. The last release took the file out of the open-file
    table, then recorded its allocation in the cache accounting (CacheSpace.note_closed); an
    eviction in between removed the file and its allocation first, and the release then put
    the allocation back: the cache counted 1 MiB that was gone (writers waited, or got
    ENOSPC, for it until the next full scan). The release records it before the file leaves
    the table, so the evictor cannot take it before."""
    from test_cache_space import MIB, cached, cap, make_durable, write_file

    ino = write_file(core, b"f", MIB)
    make_durable(core, ino)
    space = cap(core, 64)
    fh = core.open(ino, os.O_RDONLY)
    note_closed = space.note_closed
    evictors = []

    def evict_then_note(*args):
        if not evictors:  # the fixed build holds the state lock here: the evictor waits
            evictors.append(_run_elsewhere(space.evict_now, [ino], wait=1.0))
        note_closed(*args)

    monkeypatch.setattr(space, "note_closed", evict_then_note)
    core.release(fh)
    evictors[0].join()
    assert not evictors[0].errors
    assert not cached(core, ino)
    assert space.used_bytes() == 0  # was 1 MiB


def test_an_open_while_the_listing_drops_a_replaced_objects_cache_never_reads_zeros(tmp_path, monkeypatch):
    """Audit of the worker-thread races. A bucket listing found a cached file's object
    replaced (another node wrote it), made the file REMOTE and removed its cache file, having
    checked only that the file was not open. An open that had read the inode before the
    listing's transaction (cached-clean, 4 bytes) registered after the removal: it created an
    empty cache file and read 4 zero bytes. The listing now claims the inode to remove the
    cache file (CoreState.claim_if_closed), so the open reads the inode again."""
    from test_core_remote_names import Node

    from ckptfs.drain.worker import object_metadata

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    node = Node(tmp_path / "cache", bucket)
    try:
        core = node.core
        meta = object_metadata(0o100644, 0, 0, 1_700_000_000 * 10**9)
        node.put("ckpt/a", b"1111", meta)
        ino = node.walk("ckpt/a").ino
        fh = core.open(ino, os.O_RDONLY)
        assert core.read(fh, 0, 100) == b"1111"
        core.release(fh)  # now cached-clean
        assert node.inode("ckpt/a").state == FileState.CACHED_CLEAN
        node.put("ckpt/a", b"22", meta)  # replaced in the bucket by another node
        node.advance()
        ckpt = node.walk("ckpt").ino
        listings = []
        _in_main_thread_after_first_read(
            core, monkeypatch, lambda: listings.append(_run_elsewhere(core.remote.refresh, ckpt)))
        fh = core.open(ino, os.O_RDONLY)
        listings[0].join()
        assert not listings[0].errors
        data = core.read(fh, 0, 100)
        core.release(fh)
        assert data in (b"1111", b"22")  # was b"\0\0\0\0"
    finally:
        node.close()


def test_a_setattr_of_a_name_between_its_create_and_open_is_not_lost(core, monkeypatch):
    """Audit of the worker-thread races (core API: through FUSE the kernel holds the directory
    until CREATE answers). FsCore.create registered the open file with the inode as its own
    transaction made it (size 0), after a setattr by name had made it 5 bytes: stat showed 0
    while open. With setattr claiming closed inodes the open could even fail with
    EvictedMeanwhile. create now reads the inode again if a claim was taken or ended since."""
    namespace = core._namespace
    create_file = namespace.create_file

    def create_then_truncate_elsewhere(*args, **kwargs):
        inode = create_file(*args, **kwargs)
        worker = _run_elsewhere(core.setattr, inode.ino, SetattrRequest(size=5))
        assert not worker.errors
        return inode

    monkeypatch.setattr(namespace, "create_file", create_then_truncate_elsewhere)
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    assert core.getattr(attr.ino).size == 5  # was 0
    assert core.read(fh, 0, 100) == bytes(5)
    core.release(fh)
    assert core.getattr(attr.ino).size == 5


class _ReleaseAfterTheRead:
    """``meta.read()`` that runs ``action`` once, right after the first read it serves: as if
    another front-end thread handled a RELEASE between a request's fsmeta read and its look
    at the open files."""

    def __init__(self, meta, action):
        self._read, self._action = meta.read, action

    def __call__(self):
        outer = self
        reading = self._read()

        class _Read:
            def __enter__(self):
                return reading.__enter__()

            def __exit__(self, *exc):
                done = reading.__exit__(*exc)
                action, outer._action = outer._action, None
                if action is not None:
                    action()
                return done

        return _Read()


def _passthrough_file_with_unseen_bytes(tmp_path):
    """A passthrough core and a file created and written as the kernel writes it (the gateway
    has not seen the bytes: fsmeta still says size 0): (env, fh, ino)."""
    env = CoreEnv(tmp_path / "cache")
    ids = itertools.count(1)
    env.core.enable_passthrough(lambda fd: next(ids), lambda bid: None)
    fh, attr = env.core.create(ROOT, b"f", 0o644, os.O_WRONLY, ROOT_CALLER)
    fd = os.open(env.core._data_path(attr.ino), os.O_WRONLY)
    try:
        os.pwrite(fd, b"x" * 5000, 0)
    finally:
        os.close(fd)
    return env, fh, attr.ino


@pytest.mark.parametrize("request_kind", ["getattr", "lookup"])
def test_a_stat_racing_the_last_release_never_answers_the_size_from_before_it(tmp_path, monkeypatch,
                                                                            request_kind):
    """CI, 2026-11-29 (`test_write_updates_mtime_reads_leave_atime[passthrough]`): a `stat`
    right after `close(2)` showed the size and mtime from before the file's last writes, for
    the attribute timeout. close(2) sends RELEASE without waiting; the GETATTR read the inode,
    the RELEASE then stored the new size and dropped the open file, and the GETATTR, finding
    no open file, answered the inode it had read. Fixed in `FsCore.getattr`/`lookup`: read
    again if a last close came in between (``claim_seq``)."""
    env, fh, ino = _passthrough_file_with_unseen_bytes(tmp_path)
    try:
        monkeypatch.setattr(env.meta, "read", _ReleaseAfterTheRead(env.meta, lambda: env.core.release(fh)))
        attr = env.core.getattr(ino) if request_kind == "getattr" else env.core.lookup(ROOT, b"f")
        assert attr.size == 5000
    finally:
        env.close()


def test_a_utimes_of_a_file_open_for_writing_keeps_the_bytes_written_before_it(tmp_path):
    """Found with the test above: `utime` of a passthrough file whose writes the gateway had
    not looked at yet set the cache file's times and took the result as the new baseline,
    so those writes were never seen: the reply gave the size from before them (an O_APPEND
    write then landed over the old bytes), and the close stored it. Fixed in
    `FsCore._setattr`: the open file takes the cache file's changes in before the times."""
    env, fh, ino = _passthrough_file_with_unseen_bytes(tmp_path)
    try:
        attr = env.core.setattr(ino, SetattrRequest(atime_ns=10**9, mtime_ns=10**9))
        assert (attr.size, attr.mtime_ns) == (5000, 10**9)
        env.core.release(fh)
        with env.meta.read() as txn:
            inode = txn.get_inode(ino)
        assert (inode.size, inode.mtime_ns) == (5000, 10**9)
    finally:
        env.close()

"""The cache cap without FUSE (gateway/space.py): LRU eviction of clean files, what is never
evicted, backpressure (wait, then ENOSPC without a torn file), and evicted files elsewhere
(recovery, fsck, the drain's cache-length reconcile)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import ROOT, ROOT_CALLER, fsmeta_problems

from ckptfs.fsmeta import FileState, RemoteRecord, durability
from ckptfs.fsmeta.check import cache_file_findings
from ckptfs.fsmeta.recovery import reconcile_cache_lengths
from ckptfs.gateway.core import EVICT_XATTR, FsCore, SetattrRequest
from ckptfs.gateway.errors import FsError
from ckptfs.gateway import space as space_module
from ckptfs.gateway.space import SpaceLimits

MIB = 1 << 20


def huge_device(_path):
    return SimpleNamespace(f_bavail=1 << 40, f_frsize=1, f_blocks=1 << 40)


def cap(core: FsCore, cap_mib: float, *, high=0.9, low=0.5, timeout=0.5, markers=(".metadata",)):
    space = core.enable_space(SpaceLimits(int(cap_mib * MIB), int(cap_mib * MIB * high), int(cap_mib * MIB * low),
                                          timeout, 0), markers=markers)
    space._statvfs = huge_device
    space.scan()
    return space


def write_file(core: FsCore, name: bytes, size: int, byte: bytes = b"x") -> int:
    fh, attr = core.create(ROOT, name, 0o644, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, byte * size)
    core.release(fh)
    return attr.ino


def make_durable(core: FsCore, ino: int) -> None:
    """What the drain does once the file is in the bucket."""
    with core.meta.read() as txn:
        generation = txn.get_inode(ino).generation
    core.meta.write(lambda txn: durability.mark_uploading(txn, ino, generation))

    def commit(txn):
        inode = txn.get_inode(ino)
        durability.mark_durable(txn, inode, generation, RemoteRecord(f"k{ino}", inode.size, "h", generation))
        durability.mark_settled(txn, ino)

    core.meta.write(commit)


def state(core: FsCore, ino: int) -> FileState:
    with core.meta.read() as txn:
        return txn.get_inode(ino).state


def cached(core: FsCore, ino: int) -> bool:
    return os.path.exists(core.cache.data_path(ino))


def test_eviction_is_least_recently_used_down_to_the_low_watermark(core):
    inos = [write_file(core, f"f{i}".encode(), MIB) for i in range(4)]
    for ino in inos:
        make_durable(core, ino)
    space = cap(core, 3.5, high=0.9, low=0.5)  # 4 MiB used > 3.15: free down to 1.75 MiB
    # Use order: f2, f0, f3, f1 (oldest first)
    for ino in (inos[2], inos[0], inos[3], inos[1]):
        core.release(core.open(ino, os.O_RDONLY))
        time.sleep(0.002)
    files, freed = space.tick()
    assert files == 3 and freed >= 3 * MIB
    assert [state(core, ino) for ino in inos] == [FileState.REMOTE, FileState.DURABLE, FileState.REMOTE,
                                                  FileState.REMOTE]
    assert [cached(core, ino) for ino in inos] == [False, True, False, False]
    assert space.used_bytes() <= space.limits.low
    # Still there, same size; the contents come back from the bucket (read path).
    assert {name for name, _, _ in core.readdir(core.opendir(ROOT), 0)} == {b"f0", b"f1", b"f2", b"f3"}
    assert core.getattr(inos[0]).size == MIB
    assert fsmeta_problems(core.meta) == []


def test_below_the_high_watermark_nothing_is_evicted(core):
    ino = write_file(core, b"f", MIB)
    make_durable(core, ino)
    space = cap(core, 2)  # 1 MiB of 2: below 90%
    assert space.tick() == (0, 0)
    assert state(core, ino) == FileState.DURABLE and cached(core, ino)


def test_dirty_open_pending_uploading_and_markers_are_never_evicted(core):
    dirty = write_file(core, b"dirty", MIB)
    held_open = write_file(core, b"open", MIB)
    renamed = write_file(core, b"renamed", MIB)
    uploading = write_file(core, b"uploading", MIB)
    marker = write_file(core, b".metadata", MIB)
    clean = write_file(core, b"clean", MIB)
    for ino in (held_open, renamed, uploading, marker, clean):
        make_durable(core, ino)
    core.rename(ROOT, b"renamed", ROOT, b"renamed2")  # pending: the bucket must copy it
    with core.meta.read() as txn:
        generation = txn.get_inode(uploading).generation
    core.meta.write(lambda txn: durability.mark_dirty(txn, txn.get_inode(uploading), 1) or None)
    core.meta.write(lambda txn: durability.mark_uploading(txn, uploading, generation))
    fh = core.open(held_open, os.O_RDONLY)
    space = cap(core, 1)  # everything is over the cap
    space.tick()
    assert state(core, clean) == FileState.REMOTE and not cached(core, clean)
    for ino in (dirty, held_open, renamed, uploading, marker):
        assert state(core, ino) != FileState.REMOTE and cached(core, ino), ino
    core.release(fh)
    space.tick()
    assert state(core, held_open) == FileState.REMOTE  # once closed, it goes too


@pytest.fixture
def read_env(tmp_path):
    from test_core_readpath import ReadEnv

    from ckptfs.gateway.fetch import ReadSettings
    e = ReadEnv(tmp_path, ReadSettings(part_size=256 << 10, max_readahead=MIB, concurrency=4))
    yield e
    e.close()
    e.client.close()


def test_evicted_file_opens_with_o_trunc_and_reads_back_through_the_fetcher(read_env):
    core = read_env.core
    data = os.urandom(MIB)
    ino = read_env.remote(b"f", data)  # as an eviction leaves it
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, 0, MIB) == data  # fetched again, never zeros
    core.release(fh)
    assert state(core, ino) == FileState.CACHED_CLEAN
    cap(core, 0.5).tick()
    assert state(core, ino) == FileState.REMOTE and not cached(core, ino)
    core.setattr(ino, SetattrRequest(size=10))  # keeps a prefix: fetched
    with open(core.cache.data_path(ino), "rb") as f:
        assert f.read() == data[:10]
    other = read_env.remote(b"g", data)
    fh = core.open(other, os.O_WRONLY | os.O_TRUNC)  # a checkpoint overwritten in place
    core.write(fh, 0, b"new")
    core.release(fh)
    assert state(core, other) == FileState.DIRTY and core.getattr(other).size == 3
    with open(core.cache.data_path(other), "rb") as f:
        assert f.read() == b"new"


def test_the_evict_xattr_drops_a_clean_file_now_and_keeps_dirty_and_open_ones(read_env):
    """``getfattr -n user.ckptfs.evict FILE``: an operator frees a file's cache space now."""
    core = read_env.core
    cap(core, 1024)  # far from the watermarks: nothing goes by itself
    data = os.urandom(MIB)
    ino = read_env.remote(b"f", data)
    core.fetch(ino)
    assert state(core, ino) == FileState.CACHED_CLEAN and cached(core, ino)
    fh = core.open(ino, os.O_RDONLY)
    assert json.loads(core.getxattr(ino, EVICT_XATTR)) == {"bytes": MIB, "evicted": False}  # open
    core.release(fh)
    assert json.loads(core.getxattr(ino, EVICT_XATTR)) == {"bytes": MIB, "evicted": True}
    assert state(core, ino) == FileState.REMOTE and not cached(core, ino)
    assert core.getattr(ino).size == MIB
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, 0, MIB) == data  # fetched again
    core.release(fh)
    dirty = write_file(core, b"dirty", 10)
    assert json.loads(core.getxattr(dirty, EVICT_XATTR)) == {"bytes": 10, "evicted": False}
    assert cached(core, dirty)
    with pytest.raises(FsError) as exc:
        core.setxattr(ino, EVICT_XATTR, b"1")
    assert exc.value.errno == errno.EPERM


def test_a_file_being_fetched_is_never_evicted_under_its_fetcher(read_env, monkeypatch):
    """Prefetches race with the evictor, which also removes the cache files of REMOTE files:
    a file the fetcher holds must keep its cache file, or it becomes cached-clean with none
    and later reads serve zeros."""
    from ckptfs.gateway import space as space_mod
    monkeypatch.setattr(space_mod, "NOTHING_TO_EVICT_PAUSE", 0.0)
    core = read_env.core
    blobs = {}
    for i in range(12):
        data = os.urandom(256 << 10)
        blobs[read_env.remote(f"f{i}".encode(), data)] = data
    # Anything cached is over the high watermark; the cap leaves room for the two files in
    # flight (fetched bytes count toward it from their reservation on).
    space = cap(core, 2, high=0.05, low=0.01)
    stop = threading.Event()
    bad: list[str] = []
    compared = [0]

    def unless_no_room(fn, *args):
        # Waiting for room past the backpressure timeout (0.5 s here) is ENOSPC by design; on a
        # loaded machine the evictor can be that slow. What must never happen is wrong bytes.
        try:
            return fn(*args)
        except FsError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return None

    def fetcher():
        while not stop.is_set():
            for ino in blobs:
                unless_no_room(core.fetch, ino)

    def reader():
        while not stop.is_set():
            for ino, data in blobs.items():
                fh = core.open(ino, os.O_RDONLY)
                try:
                    got = unless_no_room(core.read, fh, 0, len(data))
                finally:
                    core.release(fh)
                if got is None:
                    continue
                compared[0] += 1
                if got != data:
                    bad.append(f"inode {ino}: {len(got)} bytes, {got.count(0)} zero bytes")

    def reporting(fn):
        def run():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a thread that died would leave nothing to compare
                bad.append(repr(exc))
        return run

    threads = [threading.Thread(target=reporting(fetcher)), threading.Thread(target=reporting(reader))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not bad:
        space.scan()
        space.evict()
    stop.set()
    for t in threads:
        t.join()
    assert bad == []
    assert compared[0] > 0, "no read got room to compare"
    for ino, data in blobs.items():
        if state(core, ino) != FileState.REMOTE:
            with open(core.cache.data_path(ino), "rb") as f:
                assert f.read() == data, ino


def allocated_in_cache(core: FsCore) -> int:
    total = 0
    with os.scandir(core.cache.data_dir) as entries:
        for entry in entries:
            try:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@pytest.mark.parametrize("how", ["prefetch", "read"])
def test_a_cold_fetch_bigger_than_the_free_room_evicts_instead_of_passing_the_cap(read_env, how):
    """Fetched bytes count toward the cap as their GETs start, not at the next full scan: a
    prefetch or cold read of a file bigger than the room left makes the evictor take older
    clean files first, and the cache never holds more than the cap."""
    core = read_env.core
    old = []
    for i in range(3):
        ino = read_env.remote(f"old{i}".encode(), os.urandom(512 << 10))
        core.fetch(ino)
        old.append(ino)
    space = cap(core, 2, high=0.9, low=0.5, timeout=10)  # 1.5 MiB cached: room for 0.5 MiB
    data = os.urandom(MIB)
    big = read_env.remote(b"big", data)
    stop = threading.Event()
    peak = [0]

    def space_task():  # what the gateway's space task does, and a witness of the real use
        while not stop.is_set():
            space.tick()
            peak[0] = max(peak[0], allocated_in_cache(core))
            time.sleep(0.005)

    task = threading.Thread(target=space_task)
    task.start()
    try:
        if how == "prefetch":
            core.fetch(big)
        else:
            fh = core.open(big, os.O_RDONLY)
            got = b"".join(core.read(fh, off, 128 << 10) for off in range(0, MIB, 128 << 10))
            core.release(fh)
            assert got == data
    finally:
        stop.set()
        task.join()
    peak[0] = max(peak[0], allocated_in_cache(core))
    assert peak[0] <= 2 * MIB, f"the cache held {peak[0] / MIB:.2f} MiB against a 2 MiB cap"
    assert state(core, big) == FileState.CACHED_CLEAN
    assert state(core, old[0]) == FileState.REMOTE and not cached(core, old[0])  # least recently used


def test_an_open_racing_with_eviction_never_sees_a_removed_cache_file(core):
    """Opens race with the evictor: each either keeps the file cached (open first) or sees it
    evicted (EIO here, read-through later); never an empty cache file standing for it."""
    inos = [write_file(core, f"f{i}".encode(), 64 << 10) for i in range(40)]
    for ino in inos:
        make_durable(core, ino)
    space = cap(core, 0.1, high=0.5, low=0.01)
    opened: list[tuple[int, int]] = []
    stop = threading.Event()

    def opener():
        while not stop.is_set():
            for ino in inos:
                try:
                    opened.append((ino, core.open(ino, os.O_RDONLY)))
                except FsError as exc:
                    assert exc.errno == errno.EIO
                if len(opened) > 5:
                    _, fh = opened.pop(0)
                    assert core.read(fh, 0, 64 << 10) == b"x" * (64 << 10)
                    core.release(fh)

    t = threading.Thread(target=opener)
    t.start()
    for _ in range(20):
        space.tick()
        time.sleep(0.005)
    stop.set()
    t.join()
    for _, fh in opened:
        assert core.read(fh, 0, 64 << 10) == b"x" * (64 << 10)
        core.release(fh)
    for ino in inos:
        assert cached(core, ino) == (state(core, ino) != FileState.REMOTE)


def test_a_writer_waits_for_room_then_gets_enospc_and_the_file_is_a_whole_prefix(core):
    write_file(core, b"dirty", 3 * MIB)  # dirty: not evictable
    space = cap(core, 4, timeout=0.4)
    fh, attr = core.create(ROOT, b"g", 0o644, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, b"a" * MIB)  # fits: 3 + 1 MiB (allocation rounding aside)
    start = time.monotonic()
    with pytest.raises(FsError) as exc:
        core.write(fh, MIB, b"b" * MIB)
    assert exc.value.errno == errno.ENOSPC and time.monotonic() - start >= 0.4
    assert space.status()["enospc_total"] == 1 and space.wait_seconds_total >= 0.4
    with pytest.raises(FsError):  # later writes of this open file fail too: no hole can form
        core.write(fh, 2 * MIB, b"c" * MIB)
    with pytest.raises(FsError) as exc:
        core.flush(fh)  # close reports it
    assert exc.value.errno == errno.ENOSPC
    core.release(fh)
    assert core.getattr(attr.ino).size == MIB
    with open(core.cache.data_path(attr.ino), "rb") as f:
        assert f.read() == b"a" * MIB


def test_a_waiting_writer_proceeds_once_the_drain_makes_room(core):
    dirty = write_file(core, b"dirty", 3 * MIB)
    space = cap(core, 4, timeout=30)
    fh, attr = core.create(ROOT, b"g", 0o644, os.O_RDWR, ROOT_CALLER)
    done = threading.Event()

    def writer():
        core.write(fh, 0, b"a" * (2 * MIB))
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 10
    while space.status()["waiting_writers"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert space.status()["waiting_writers"] == 1 and not done.is_set()
    make_durable(core, dirty)  # the drain uploaded it: now evictable
    space.tick()
    t.join(10)
    assert done.is_set() and state(core, dirty) == FileState.REMOTE
    core.release(fh)
    assert core.getattr(attr.ino).size == 2 * MIB


def test_a_crash_between_mark_evicted_and_the_unlink_is_harmless(core_env):
    core = core_env.core
    ino = write_file(core, b"f", MIB)
    make_durable(core, ino)
    core.meta.write(lambda txn: durability.mark_evicted(txn, txn.get_inode(ino)))  # crash here
    core = core_env.reopen()  # the start removes the cache files of REMOTE inodes
    assert not cached(core, ino) and state(core, ino) == FileState.REMOTE
    assert fsmeta_problems(core.meta) == []
    with core.meta.read() as txn:
        assert cache_file_findings(txn, core.cache.data_dir) == []


def test_an_evicted_file_is_normal_to_recovery_fsck_and_the_drain_reconcile(core_env):
    core = core_env.core
    ino = write_file(core, b"f", MIB)
    make_durable(core, ino)
    cap(core, 0.5).tick()
    core.rename(ROOT, b"f", ROOT, b"g")  # pending again (a move), still without a cache file
    core.setattr(ino, SetattrRequest(mode=0o600))
    core = core_env.reopen()  # the gateway's start-up recovery
    assert not cached(core, ino) and state(core, ino) == FileState.REMOTE
    assert reconcile_cache_lengths(core.meta, core.cache) == {"trimmed_files": 0, "lost_files": {}}
    with core.meta.read() as txn:
        assert cache_file_findings(txn, core.cache.data_dir) == []
        assert txn.get_error(ino) is None
        assert durability.state_label(txn, txn.get_inode(ino)) != f"error: {durability.CACHE_FILE_MISSING}"
    assert fsmeta_problems(core.meta) == []


def test_a_nearly_full_cache_device_makes_writers_wait_and_evicts_for_them(core):
    clean = write_file(core, b"clean", MIB)
    make_durable(core, clean)
    # The cap is far away, but the device (used by others too) has 1.5 MiB free and keeps 1 MiB.
    space = core.enable_space(SpaceLimits(1 << 30, 900 << 20, 800 << 20, 5.0, MIB))
    space._statvfs = lambda _path: SimpleNamespace(f_bavail=3 * MIB // 2, f_frsize=1, f_blocks=1 << 40)
    space.scan()
    fh, attr = core.create(ROOT, b"g", 0o644, os.O_RDWR, ROOT_CALLER)
    t = threading.Thread(target=core.write, args=(fh, 0, b"a" * MIB))
    t.start()
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:
        space.tick()  # a waiting writer short of room: the clean file goes for it
        time.sleep(0.02)
    t.join()
    assert state(core, clean) == FileState.REMOTE and space.status()["enospc_total"] == 0
    core.release(fh)
    assert core.getattr(attr.ino).size == MIB
    fh = core.open(attr.ino, os.O_RDWR)
    space.limits = SpaceLimits(1 << 30, 900 << 20, 800 << 20, 0.2, MIB)
    with pytest.raises(FsError) as exc:  # nothing left to evict: ENOSPC after the timeout
        core.write(fh, MIB, b"b" * MIB)
    assert exc.value.errno == errno.ENOSPC
    core.release(fh)


def test_an_evicted_file_renamed_and_chmodded_moves_in_the_bucket_and_stays_evicted(tmp_path):
    """The drain copies an evicted file to its new key with the new metadata, without its
    cache file, and it stays REMOTE: never DURABLE with no content in the cache."""
    from test_drain_support import DrainEnv

    env = DrainEnv(tmp_path)
    try:
        data = os.urandom(MIB + 5)
        ino = env.write_file("run/f", data)
        env.drain()
        cap(env.core, 0.5).tick()
        assert state(env.core, ino) == FileState.REMOTE and not cached(env.core, ino)
        run = env.ino("run")
        env.core.rename(run, b"f", run, b"g")
        env.core.setattr(ino, SetattrRequest(mode=0o600))
        env.drain()
        assert (env.bucket / "run/g").read_bytes() == data and not (env.bucket / "run/f").exists()
        assert int(env.head("run/g").metadata["mode"]) & 0o777 == 0o600
        assert env.pending() == {}
        assert state(env.core, ino) == FileState.REMOTE and not cached(env.core, ino)
        with pytest.raises(FsError):
            env.core.open(ino, os.O_RDONLY)  # no zeros: it must come from the bucket
    finally:
        env.close()


def test_passthrough_under_pressure_new_writers_are_served_by_the_gateway(core):
    """Passthrough writes never reach the gateway: above the high watermark, a file opened for
    writing that nobody has open gets no backing id (the gateway serves it, and can make its
    writes wait); an inode's opens never mix the two paths."""
    ids = iter(range(1, 1000))
    core.enable_passthrough(lambda fd: next(ids), lambda bid: None)
    already_open, _ = core.create(ROOT, b"a", 0o644, os.O_RDWR, ROOT_CALLER)
    assert core.backing_id(already_open) > 0
    fh, attr = core.create(ROOT, b"before", 0o644, os.O_RDWR, ROOT_CALLER)
    assert core.backing_id(fh) > 0  # no pressure yet
    core.release(fh)
    write_file(core, b"dirty", 2 * MIB)  # dirty: nothing to evict
    cap(core, 2.2, timeout=0.3)  # 2 MiB of 2.2: above the 90% high watermark
    new, _ = core.create(ROOT, b"new", 0o644, os.O_RDWR, ROOT_CALLER)
    assert core.backing_id(new) == 0  # served by the gateway
    again = core.open(core.handle_inode(new), os.O_RDONLY)
    assert core.backing_id(again) == 0  # same inode, same path
    reader = core.open(attr.ino, os.O_RDONLY)
    assert core.backing_id(reader) > 0  # a reader adds nothing: passthrough
    joined = core.open(core.handle_inode(already_open), os.O_WRONLY)
    assert core.backing_id(joined) == core.backing_id(already_open)  # never mixed
    with pytest.raises(FsError) as exc:  # the gateway-served writer waits, then ENOSPC
        core.write(new, 0, b"x" * MIB)
    assert exc.value.errno == errno.ENOSPC
    for h in (new, again, reader, joined, already_open):
        core.release(h)


def test_full_scans_of_a_cache_that_takes_long_to_scan_come_less_often(core, monkeypatch):
    """A full scan costs some 10 µs per cache file: at 60,000 files, one every 5 s took a tenth
    of a CPU. The next scan waits SCAN_COST_FACTOR times as long as the last one took."""
    space = cap(core, 100)
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(space_module, "time", SimpleNamespace(monotonic=lambda: clock.now, time_ns=time.time_ns))
    scans = []

    def device(path):  # each full scan measures the device once, and takes `took` seconds
        scans.append(clock.now)
        clock.now += took
        return huge_device(path)

    space._statvfs = device

    def ticks_for(seconds):
        end = clock.now + seconds
        while clock.now < end:
            space.tick()
            clock.now += space_module.TICK_SECONDS

    took = 0.001  # a small cache: every SCAN_SECONDS
    space.scan()
    ticks_for(21)
    gaps = [b - a for a, b in zip(scans, scans[1:])]
    assert len(gaps) == 4 and all(5 <= gap < 5.5 for gap in gaps)
    took = 0.5  # 60,000 files: every 25 s
    del scans[:]
    space.scan()
    ticks_for(110)
    gaps = [b - a for a, b in zip(scans, scans[1:])]
    assert len(gaps) == 4 and all(25 <= gap < 26.5 for gap in gaps)
    took = 10.0  # a million: still every SCAN_MAX_SECONDS, for the device's free space
    space.scan()
    ticks_for(500)
    assert scans[-1] - scans[-2] < space_module.SCAN_MAX_SECONDS + 11

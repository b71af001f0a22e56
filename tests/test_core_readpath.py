"""The read path without FUSE: reads of REMOTE files fill the cache with ranged GETs."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest
from conftest import CoreEnv, fsmeta_problems
from readpath_helpers import RecordingStore, make_remote, put_object

from ckptfs.fsmeta import FileState
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.gateway import metrics
from ckptfs.gateway.bucket import BucketClient
from ckptfs.gateway.core import PREFETCH_XATTR, STATE_XATTR, FsCore, SetattrRequest
from ckptfs.gateway.errors import FsError
from ckptfs.gateway.fetch import BLOCK, INITIAL_READAHEAD, ReadSettings

MIB = 1 << 20
PART = 1 * MIB
READ = 128 * 1024  # what the kernel asks for at a time


class ReadEnv(CoreEnv):
    """An FsCore with a ``file://`` bucket whose GETs are recorded."""

    def __init__(self, base, read: ReadSettings):
        self.bucket_root = str(base / "bucket")
        os.makedirs(self.bucket_root)
        self.store = RecordingStore(self.bucket_root)
        self.client = BucketClient(lambda: self.store).start()
        self.read_settings = read
        super().__init__(base / "cache")
        self.cache = CacheDir(str(self.cache_dir))

    def open(self) -> FsCore:
        from ckptfs.fsmeta import MetaStore
        self.meta = MetaStore(str(self.cache_dir / "meta"))
        self.core = FsCore(str(self.cache_dir), self.meta, bucket=self.client, read=self.read_settings)
        return self.core

    def remote(self, name: bytes, data: bytes, **kw) -> int:
        return make_remote(self.meta, self.cache, self.bucket_root, name, data, **kw)

    def state(self, ino: int) -> FileState:
        with self.meta.read() as txn:
            return txn.get_inode(ino).state

    def settle(self) -> None:
        """Wait until no GET is in flight (read-ahead lands after the read that asked for it)."""
        deadline = time.monotonic() + 10
        fetcher = self.core._state.fetcher
        while any(rf.inflight for rf in list(fetcher._files.values())):
            assert time.monotonic() < deadline
            time.sleep(0.005)


@pytest.fixture
def env(tmp_path):
    e = ReadEnv(tmp_path, ReadSettings(part_size=PART, max_readahead=8 * MIB, concurrency=4))
    yield e
    e.close()
    e.client.close()


def payload(size: int) -> bytes:
    return os.urandom(size)


def read_all(core, fh, size, chunk=READ) -> bytes:
    out = bytearray()
    for off in range(0, size, chunk):
        out += core.read(fh, off, chunk)
    return bytes(out)


def test_sequential_read_fetches_with_a_growing_read_ahead(env):
    data = payload(32 * MIB)
    ino = env.remote(b"seq", data)
    core = env.core
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, 0, READ) == data[:READ]
    env.settle()
    # The first read fetched itself and the initial window, no more.
    assert env.store.fetched_bytes() == READ + INITIAL_READAHEAD
    got = bytearray(data[:READ])
    for off in range(READ, 16 * MIB, READ):
        got += core.read(fh, off, READ)
    env.settle()
    ahead = max(off + length for _, off, length, _ in env.store.gets) - 16 * MIB
    # Half-way, the window has grown past the initial one, within max_readahead.
    assert INITIAL_READAHEAD < ahead <= 8 * MIB + READ
    for off in range(16 * MIB, len(data), READ):
        got += core.read(fh, off, READ)
    assert bytes(got) == data
    core.release(fh)
    gets = env.store.gets
    # Every byte once, in GETs of at most a part, all conditional on the listed etag.
    assert env.store.fetched_bytes() == len(data)
    assert all(length <= PART for _, _, length, _ in gets)
    assert len(gets) < len(data) // READ // 4
    assert all(etag for *_, etag in gets)
    assert max(off + length for _, off, length, _ in gets) == len(data)


def test_random_reads_fetch_only_what_they_read_and_once(env):
    data = payload(32 * MIB)
    ino = env.remote(b"rnd", data)
    core = env.core
    fh = core.open(ino, os.O_RDONLY)
    for off in (20 * MIB + 5, 5 * MIB, 13 * MIB + 100_000):
        assert core.read(fh, off, 4096) == data[off:off + 4096]
    env.settle()
    assert env.store.fetched_bytes() == 3 * BLOCK
    before = len(env.store.gets)
    assert core.read(fh, 5 * MIB, 4096) == data[5 * MIB:5 * MIB + 4096]
    core.release(fh)
    # A later open is served from the cache too.
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, 20 * MIB + 5, 4096) == data[20 * MIB + 5:20 * MIB + 5 + 4096]
    core.release(fh)
    assert len(env.store.gets) == before
    assert env.state(ino) == FileState.REMOTE


def test_whole_file_becomes_cached_clean_and_is_then_read_from_the_cache(env):
    data = payload(3 * MIB + 17)
    ino = env.remote(b"whole", data)
    core = env.core
    fh = core.open(ino, os.O_RDONLY)
    assert read_all(core, fh, len(data)) == data
    core.flush(fh)
    core.release(fh)
    assert env.state(ino) == FileState.CACHED_CLEAN
    assert core.getxattr(ino, STATE_XATTR) == b"durable"
    with open(env.cache.data_path(ino), "rb") as f:
        assert f.read() == data
    gets = len(env.store.gets)
    fh = core.open(ino, os.O_RDONLY)
    assert read_all(core, fh, len(data)) == data
    core.release(fh)
    assert len(env.store.gets) == gets
    assert fsmeta_problems(env.meta) == []


def test_cached_clean_file_reopens_on_the_native_data_path(env):
    opened = []
    env.core.enable_passthrough(lambda fd: opened.append(fd) or len(opened), lambda bid: None)
    data = payload(2 * MIB)
    ino = env.remote(b"native", data)
    core = env.core
    fh = core.open(ino, os.O_RDONLY)
    assert core.backing_id(fh) == 0  # REMOTE: the gateway must see the reads
    assert read_all(core, fh, len(data)) == data
    core.release(fh)
    assert env.state(ino) == FileState.CACHED_CLEAN
    fh = core.open(ino, os.O_RDONLY)
    assert core.backing_id(fh) != 0
    core.release(fh)


def test_blake3_mismatch_is_eio_and_an_error_state_never_cached_clean(env):
    data = payload(2 * MIB)
    ino = env.remote(b"bad", data, blake3_hex="0" * 64)
    core = env.core
    failures = metrics.INTEGRITY_FAILURES._value.get()
    fh = core.open(ino, os.O_RDONLY)
    # Ranges before the end are served as they come; the read that reaches the end, and
    # close, report the mismatch.
    assert core.read(fh, 0, READ) == data[:READ]
    with pytest.raises(FsError) as exc:
        read_all(core, fh, len(data))
    assert exc.value.errno == errno.EIO
    with pytest.raises(FsError) as exc:
        core.flush(fh)
    assert exc.value.errno == errno.EIO
    core.release(fh)
    assert env.state(ino) == FileState.REMOTE
    assert core.getxattr(ino, STATE_XATTR) == b"error: RemoteHashMismatch"
    assert metrics.INTEGRITY_FAILURES._value.get() == failures + 1
    assert os.path.getsize(env.cache.data_path(ino)) == 0  # the corrupt bytes are gone


def test_object_changed_while_read_is_estale_not_a_mix(env):
    data = payload(4 * MIB)
    ino = env.remote(b"chg", data)
    core = env.core
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, 2 * MIB, 4096) == data[2 * MIB:2 * MIB + 4096]
    put_object(env.bucket_root, "chg", payload(4 * MIB))
    with pytest.raises(FsError) as exc:
        core.read(fh, 0, 4096)
    assert exc.value.errno == errno.ESTALE
    core.release(fh)
    assert env.state(ino) == FileState.REMOTE


def test_object_without_blake3_has_nothing_to_check(env):
    data = payload(MIB)
    ino = env.remote(b"foreign", data, blake3_hex="")
    fh = env.core.open(ino, os.O_RDONLY)
    assert read_all(env.core, fh, len(data)) == data
    env.core.release(fh)
    assert env.state(ino) == FileState.CACHED_CLEAN


def test_writing_a_remote_file_fetches_it_whole_before_the_first_write(env):
    data = payload(3 * MIB)
    ino = env.remote(b"rw", data)
    core = env.core
    fh = core.open(ino, os.O_WRONLY)
    # Writeback data path: the kernel's O_TRUNC, if any, comes after the open (a SETATTR),
    # so the open fetches nothing yet.
    assert env.store.fetched_bytes() == 0
    core.write(fh, 10, b"XYZ")
    assert env.store.fetched_bytes() == len(data)
    core.release(fh)
    with env.meta.read() as txn:
        assert txn.get_inode(ino).state == FileState.DIRTY and txn.get_pending(ino) is not None
    fh = core.open(ino, os.O_RDONLY)
    assert read_all(core, fh, len(data)) == data[:10] + b"XYZ" + data[13:]
    core.release(fh)


def test_an_open_for_writing_then_truncated_to_zero_fetches_nothing(env):
    """The kernel's O_TRUNC on the writeback data path: an open without O_TRUNC, then a
    SETATTR of size 0 (atomic O_TRUNC is off there: see gateway/fuse_ops.py)."""
    ino = env.remote(b"tr", payload(3 * MIB))
    core = env.core
    fh = core.open(ino, os.O_WRONLY)
    core.setattr(ino, SetattrRequest(size=0))
    core.write(fh, 0, b"new")
    core.release(fh)
    assert env.store.gets == []
    assert core.getattr(ino).size == 3
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, 0, 100) == b"new"
    core.release(fh)
    with env.meta.read() as txn:
        assert txn.get_inode(ino).state == FileState.DIRTY


def test_a_read_write_handle_reads_through_then_fetches_the_rest_at_its_first_write(env):
    data = payload(3 * MIB)
    ino = env.remote(b"rw", data)
    core = env.core
    fh = core.open(ino, os.O_RDWR)
    assert core.read(fh, 0, 100) == data[:100]
    assert env.store.fetched_bytes() < len(data)
    core.write(fh, 2 * MIB, b"XYZ")
    assert env.store.fetched_bytes() == len(data)
    assert read_all(core, fh, len(data)) == data[:2 * MIB] + b"XYZ" + data[2 * MIB + 3:]
    core.release(fh)
    with env.meta.read() as txn:
        assert txn.get_inode(ino).state == FileState.DIRTY


def test_open_with_o_trunc_fetches_nothing(env):
    ino = env.remote(b"tr", payload(3 * MIB))
    core = env.core
    fh = core.open(ino, os.O_WRONLY | os.O_TRUNC)
    core.write(fh, 0, b"new")
    core.release(fh)
    assert env.store.gets == []
    assert core.getattr(ino).size == 3
    fh = core.open(ino, os.O_RDONLY)
    assert core.read(fh, 0, 100) == b"new"
    core.release(fh)
    assert env.state(ino) == FileState.DIRTY


def test_truncate_fetches_only_what_stays(env):
    data = payload(8 * MIB)
    ino = env.remote(b"cut", data)
    core = env.core
    core.setattr(ino, SetattrRequest(size=3 * MIB))
    assert env.store.fetched_bytes() == 3 * MIB
    fh = core.open(ino, os.O_RDONLY)
    assert read_all(core, fh, 3 * MIB) == data[:3 * MIB]
    core.release(fh)
    assert env.state(ino) == FileState.DIRTY


def test_prefetch_xattr_fetches_the_whole_file(env):
    data = payload(5 * MIB + 3)
    ino = env.remote(b"pre", data)
    answer = json.loads(env.core.getxattr(ino, PREFETCH_XATTR))
    assert answer == {"bytes": len(data), "fetched": len(data)}
    assert env.state(ino) == FileState.CACHED_CLEAN
    assert json.loads(env.core.getxattr(ino, PREFETCH_XATTR)) == {"bytes": len(data), "fetched": 0}
    assert env.core.listxattr(ino) == []
    with open(env.cache.data_path(ino), "rb") as f:
        assert f.read() == data


def test_empty_remote_file(env):
    ino = env.remote(b"empty", b"")
    fh = env.core.open(ino, os.O_RDONLY)
    assert env.core.read(fh, 0, 100) == b""
    env.core.release(fh)
    assert env.state(ino) == FileState.CACHED_CLEAN



@pytest.mark.parametrize("content_matches", [True, False], ids=["blake3_matches", "blake3_differs"])
def test_an_empty_remote_file_released_without_a_read_or_flush_is_checked_at_release(env, content_matches):
    """The kernel can send RELEASE with no FLUSH before it (an open that fails after the
    daemon's OPEN; a descriptor closed in flight over a unix socket). An empty object is
    whole without any GET, so no landing GET starts its check: the release must, and return.
    (Found by the drain model, seed 251: the release waited for ever.)"""
    ino = env.remote(b"empty", b"", blake3_hex=None if content_matches else "0" * 64)
    fh = env.core.open(ino, os.O_RDONLY)
    released = threading.Thread(target=env.core.release, args=(fh,), daemon=True)
    released.start()
    released.join(timeout=60)  # milliseconds when it works; for ever before the fix
    assert not released.is_alive(), "release of an unread empty remote file never returned"
    if content_matches:
        assert env.state(ino) == FileState.CACHED_CLEAN
    else:
        assert env.state(ino) == FileState.REMOTE
        assert env.core.getxattr(ino, STATE_XATTR) == b"error: RemoteHashMismatch"

def test_a_fetch_cut_by_a_crash_is_never_taken_for_complete(env):
    data = payload(4 * MIB)
    ino = env.remote(b"crash", data)
    fh = env.core.open(ino, os.O_RDONLY)
    assert env.core.read(fh, MIB, 4096) == data[MIB:MIB + 4096]
    env.settle()
    # kill -9: nothing is released, the cache file holds one block of the object.
    core = env.reopen(recover=True)
    assert not os.path.exists(env.cache.data_path(ino))
    assert env.state(ino) == FileState.REMOTE
    fetched = env.store.fetched_bytes()
    fh = core.open(ino, os.O_RDONLY)
    assert read_all(core, fh, len(data)) == data
    core.release(fh)
    assert env.store.fetched_bytes() - fetched == len(data)
    assert env.state(ino) == FileState.CACHED_CLEAN


def test_read_settings_are_validated_by_name():
    from ckptfs.fsmeta.settings import ConfigError, Settings
    with pytest.raises(ConfigError, match=r"^read\.part_size"):
        Settings(read_part_size=100).validate()
    with pytest.raises(ConfigError, match=r"^read\.max_readahead"):
        Settings(read_part_size=8 * MIB, read_max_readahead=MIB).validate()
    with pytest.raises(ConfigError, match=r"^read\.concurrency"):
        Settings(read_concurrency=0).validate()


def test_read_settings_from_toml(tmp_path):
    from ckptfs.fsmeta.settings import build_settings
    cfg = tmp_path / "c.toml"
    cfg.write_text('[read]\npart_size = "4MiB"\nmax_readahead = "64MiB"\nconcurrency = 3\n')
    s = build_settings(str(cfg), {})
    assert ReadSettings.from_settings(s) == ReadSettings(4 * MIB, 64 * MIB, 3)
    cfg.write_text('[read]\nwindow = 3\n')
    from ckptfs.fsmeta.settings import ConfigError
    with pytest.raises(ConfigError, match=r"^read\.window: unknown setting"):
        build_settings(str(cfg), {})


def test_concurrency_bounds_gets_in_flight(env, monkeypatch):
    peak = [0]
    live = [0]
    orig = RecordingStore.get_to_file

    async def counting(self, *a, **kw):
        import trio
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await trio.sleep(0.01)
        try:
            return await orig(self, *a, **kw)
        finally:
            live[0] -= 1

    monkeypatch.setattr(RecordingStore, "get_to_file", counting)
    data = payload(16 * MIB)
    ino = env.remote(b"conc", data)
    assert json.loads(env.core.getxattr(ino, PREFETCH_XATTR))["fetched"] == len(data)
    assert peak[0] == 4  # [read] concurrency



@pytest.mark.parametrize("matches", [True, False])
def test_a_file_filled_out_of_order_is_checked_whole(env, matches):
    """The blake3 check runs over the present prefix as blocks land (not one pass at the end):
    whatever order the blocks arrive in, a file becomes cached-clean only if its whole
    content matches, and a one-byte difference anywhere is EIO."""
    import blake3

    data = payload(3 * MIB + 5)
    other = bytearray(data)
    other[MIB + 7] ^= 1  # what the object's recorded hash was computed from, when it differs
    digest = blake3.blake3(data if matches else bytes(other)).hexdigest()
    ino = env.remote(b"ooo", data, blake3_hex=digest)
    core = env.core
    fh = core.open(ino, os.O_RDONLY)
    offsets = list(range(0, len(data), 3 * BLOCK))
    offsets = offsets[1::2][::-1] + offsets[::2]  # from the end back, then the gaps forwards
    try:
        for off in offsets:
            n = min(3 * BLOCK, len(data) - off)
            assert core.read(fh, off, n) == data[off:off + n]
        core.flush(fh)
        ok = True
    except FsError as exc:
        assert exc.errno == errno.EIO
        ok = False
    core.release(fh)
    assert ok == matches
    assert env.state(ino) == (FileState.CACHED_CLEAN if matches else FileState.REMOTE)

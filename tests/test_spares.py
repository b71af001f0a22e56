"""Empty cache files made ahead of creates (gateway/spares.py)."""

from __future__ import annotations

import errno
import os
import time

import pytest

from conftest import ROOT, ROOT_CALLER
from ckptfs.fsmeta import check
from ckptfs.gateway.errors import FsError
from ckptfs.gateway.spares import RECYCLE_MAX_BYTES, Spares


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def next_ino(core) -> int:
    with core.meta.read() as txn:
        return int.from_bytes(bytes(txn.raw.get(b"next_ino", db=txn.dbs["meta"])), "big")


def ownerless_cache_files(core) -> list[int]:
    """Inodes named in data/ that fsmeta does not have: spares waiting for a create."""
    with core.meta.read() as txn:
        return sorted(ino for ino in (int(n, 16) for n in os.listdir(core._state.cache.data_dir))
                      if txn.get_inode(ino) is None)


def test_a_create_takes_a_spare_named_for_its_inode_and_the_pool_is_topped_up(core):
    spares = core.enable_spares(target=4)
    try:
        wait_until(lambda: spares.placed == 4)
        waiting = ownerless_cache_files(core)
        assert len(waiting) == 4
        with core.meta.read() as txn:
            assert all(ino in txn.spare_inos() for ino in waiting)  # fsck leaves them alone
        handed_out = next_ino(core)
        fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
        assert spares.taken == 1 and attr.ino == waiting[0]
        assert next_ino(core) == handed_out  # the create used the reserved number
        core.write(fh, 0, b"hello")
        core.release(fh)
        data_file = core._state.data_path(attr.ino)
        with open(data_file, "rb") as f:
            assert f.read() == b"hello"
        assert oct(os.stat(data_file).st_mode & 0o777) == oct(0o600)
        for name in (b"g", b"h"):  # fewer than half of the target are left after these
            core.release(core.create(ROOT, name, 0o644, os.O_RDWR, ROOT_CALLER)[0])
        assert spares.taken == 3
        wait_until(lambda: spares.placed == 7)  # topped up again, to the target
        assert len(ownerless_cache_files(core)) == 4
        assert os.listdir(core.cache_dir + "/spare") == []
    finally:
        core.close_spares()
    assert ownerless_cache_files(core) == []  # the spares nobody took are removed


def test_fsck_of_a_live_gateway_leaves_its_spares_alone_and_finds_them_once_it_is_gone(core):
    spares = core.enable_spares(target=3)
    try:
        wait_until(lambda: spares.placed == 3)
        core.meta.commit()
        with core.meta.read_committed() as txn:  # what `ckptfs fsck` reads, from another process
            assert check.cache_file_findings(txn, core._state.cache.data_dir, skip_open=True) == []
            gone = check.cache_file_findings(txn, core._state.cache.data_dir, skip_open=False)
        assert sorted(f.ino for f in gone if f.kind == check.ORPHAN_CACHE_FILE) == ownerless_cache_files(core)
    finally:
        core.close_spares()


def test_a_spare_replaces_a_leftover_at_its_inodes_name(core):
    """A power cut can lose the commit that reserved an inode number while a cache file at its
    name survived: the new file must not show the leftover's bytes (as with O_EXCL and unlink)."""
    leftover = core._state.data_path(next_ino(core))
    with open(leftover, "wb") as f:
        f.write(b"stale bytes of a lost inode")
    spares = core.enable_spares(target=2)
    try:
        wait_until(lambda: spares.placed == 2)
        fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
        assert core._state.data_path(attr.ino) == leftover
        assert core.read(fh, 0, 100) == b""
        core.release(fh)
        assert os.path.getsize(leftover) == 0
    finally:
        core.close_spares()


def test_a_create_that_fails_gives_its_spare_back(core):
    spares = core.enable_spares(target=2)
    try:
        wait_until(lambda: spares.placed == 2)
        core.release(core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)[0])
        [next_spare] = ownerless_cache_files(core)
        with pytest.raises(FsError) as exc:
            core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
        assert exc.value.errno == errno.EEXIST
        # (taking it may have woken the thread to name more meanwhile)
        assert next_spare in ownerless_cache_files(core)
        fh, attr = core.create(ROOT, b"g", 0o644, os.O_RDWR, ROOT_CALLER)  # takes the same spare
        core.release(fh)
        assert attr.ino == next_spare
    finally:
        core.close_spares()


def test_spares_of_an_earlier_run_are_removed_at_start(tmp_path):
    spare_dir = tmp_path / "spare"
    spare_dir.mkdir()
    (spare_dir / "7").write_bytes(b"left by a crash")
    data = tmp_path / "data"
    data.mkdir()
    os.link(spare_dir / "7", data / "2a")  # a power cut after the rename reached data/ only half
    numbers = iter(range(100, 200))
    spares = Spares(str(spare_dir), lambda ino: str(data / f"{ino:x}"), lambda n, oldest: next(numbers),
                    target=1).start()
    try:
        wait_until(lambda: spares.made == 1)
        assert list(spare_dir.iterdir()) == []
        assert (data / "2a").read_bytes() == b"left by a crash"  # its other name is untouched
        assert (data / "64").exists()  # the spare, named for the number it reserved
    finally:
        spares.close()
    assert not (data / "64").exists()


def test_spare_files_of_a_crashed_gateway_are_removed_at_the_next_start(core_env):
    """Unused spares are cache files no inode owns: recovery removes them, and the numbers they
    were named for are never handed out again."""
    core = core_env.core
    spares = core.enable_spares(target=3)
    wait_until(lambda: spares.placed == 3)
    core.meta.commit()
    left = ownerless_cache_files(core)
    with spares._cond:  # a crash: nobody removes them
        spares._stopping = True
        spares._cond.notify_all()
    spares._thread.join()
    for _, fd in spares._placed:  # (as the crash closes them)
        os.close(fd)
    assert len(left) == 3
    core = core_env.reopen(recover=False)
    recovered = core.recover()
    assert recovered["stray_cache_files"] == 3 and ownerless_cache_files(core) == []
    _, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    assert attr.ino > max(left)


def test_without_spares_ready_a_create_makes_its_own_file(core):
    spares = core.enable_spares(target=0)  # never makes any
    try:
        fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
        core.release(fh)
        assert spares.taken == 0 and os.path.exists(core._state.data_path(attr.ino))
    finally:
        core.close_spares()


def remove(core, name: bytes, ino: int) -> None:
    """Unlink ``name`` and drop the kernel's reference from its create: the inode goes."""
    core.unlink(ROOT, name)
    core.forget([(ino, 1)])
    core.meta.commit()  # the removal's after-commit action recycles (or unlinks) its cache file


def write_file(core, name: bytes, data: bytes) -> int:
    fh, attr = core.create(ROOT, name, 0o644, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, data)
    core.release(fh)
    return attr.ino


@pytest.mark.parametrize("named", ["ahead by the spare thread", "by the create itself"])
def test_a_removed_files_cache_file_is_recycled_empty_for_the_next_create(core, named):
    """Deleting a checkpoint's files and writing the next one's reuses the cache inodes:
    neither side allocates or frees one (gateway/spares.py). The spare thread names each
    emptied file for a reserved inode; a create that comes first renames one itself."""
    ahead = named == "ahead by the spare thread"
    # only recycled spares; with target 0 the thread names none
    spares = core.enable_spares(target=4 if ahead else 0, make_new=False)
    try:
        ino = write_file(core, b"old", b"the old file's bytes")
        old_cache = core._state.data_path(ino)
        old_st_ino = os.stat(old_cache).st_ino
        remove(core, b"old", ino)
        assert spares.recycled == 1 and not os.path.exists(old_cache)
        wait_until(lambda: spares.emptied == 1)  # once the removal is synced
        if ahead:
            wait_until(lambda: spares.placed == 1)
            [waiting] = ownerless_cache_files(core)
            assert os.path.getsize(core._state.data_path(waiting)) == 0
        else:
            [spare] = os.listdir(core.cache_dir + "/spare")
            assert os.path.getsize(os.path.join(core.cache_dir, "spare", spare)) == 0
            assert ownerless_cache_files(core) == []

        fh, new = core.create(ROOT, b"new", 0o644, os.O_RDWR, ROOT_CALLER)
        assert spares.taken == 1
        if ahead:
            assert new.ino == waiting
        new_cache = core._state.data_path(new.ino)
        assert os.stat(new_cache).st_ino == old_st_ino
        assert core.read(fh, 0, 100) == b""
        core.write(fh, 0, b"new")
        core.release(fh)
        with open(new_cache, "rb") as f:
            assert f.read() == b"new"
        assert os.listdir(core.cache_dir + "/spare") == []
    finally:
        core.close_spares()


def test_a_recycled_file_keeps_its_bytes_until_its_inodes_removal_is_synced(core, monkeypatch):
    """A power cut may lose a removal fsmeta has committed but not synced: the inode then comes
    back, and must not come back with its cache file emptied."""
    synced = []
    spares = core.enable_spares(target=0)
    real_sync = spares._sync_removals
    monkeypatch.setattr(spares, "_sync_removals", lambda: (real_sync(), synced.append(True)))
    try:
        spares._emptied_at = time.monotonic() + 3600  # hold step 2 back
        ino = write_file(core, b"f", b"bytes a power cut may bring back")
        remove(core, b"f", ino)
        [spare] = os.listdir(core.cache_dir + "/spare")
        path = os.path.join(core.cache_dir, "spare", spare)
        with open(path, "rb") as f:
            assert f.read() == b"bytes a power cut may bring back"
        assert not synced
        with spares._cond:
            spares._emptied_at = 0.0
            spares._cond.notify()
        wait_until(lambda: spares.emptied == 1)
        assert synced and os.path.getsize(path) == 0
    finally:
        core.close_spares()


def test_recycling_is_bounded_and_closing_removes_what_was_kept(core):
    spares = core.enable_spares(target=0, recycled_max=1)
    try:
        inos = {name: write_file(core, name, b"x" * 100) for name in (b"a", b"b")}
        for name, ino in inos.items():
            remove(core, name, ino)
        assert spares.recycled == 1
        assert not any(os.path.exists(core._state.data_path(ino)) for ino in inos.values())  # the other one unlinked
        assert len(os.listdir(core.cache_dir + "/spare")) == 1
    finally:
        core.close_spares()
    assert os.listdir(core.cache_dir + "/spare") == []


def test_a_cache_file_someone_still_reads_is_unlinked_not_recycled(core):
    """The drain uploading a removed file, or `ckptfs verify` hashing it, keeps reading the
    bytes it opened: they must not become the next file's (gateway/spares.py)."""
    spares = core.enable_spares(target=0)
    try:
        ino = write_file(core, b"f", b"the removed file's bytes")
        reader = os.open(core._state.data_path(ino), os.O_RDONLY)  # another reader's descriptor
        try:
            remove(core, b"f", ino)
            assert spares.recycled == 0 and os.listdir(core.cache_dir + "/spare") == []
            assert not os.path.exists(core._state.data_path(ino))
            write_file(core, b"g", b"the next file")
            assert os.pread(reader, 100, 0) == b"the removed file's bytes"
        finally:
            os.close(reader)
    finally:
        core.close_spares()


def test_a_recycled_file_someone_opened_meanwhile_is_never_reused(core):
    """An open of the removed file that came while it was being recycled waited for the lease
    and holds it: it must never be emptied, nor get the next file's bytes."""
    for opened_when in ("before emptying", "after emptying"):
        spares = core.enable_spares(target=0)
        try:
            ino = write_file(core, b"f", b"the removed file's bytes")
            if opened_when == "before emptying":
                spares._emptied_at = time.monotonic() + 3600  # hold step 2 back
            remove(core, b"f", ino)
            [spare] = os.listdir(core.cache_dir + "/spare")
            if opened_when == "after emptying":
                wait_until(lambda: spares.emptied == 1)
            late_reader = os.open(os.path.join(core.cache_dir, "spare", spare), os.O_RDONLY)
            try:
                if opened_when == "before emptying":
                    with spares._cond:
                        spares._emptied_at = 0.0
                        spares._cond.notify()
                    wait_until(lambda: os.fstat(late_reader).st_nlink == 0)  # removed, not emptied
                    assert spares.emptied == 0
                    assert os.pread(late_reader, 100, 0) == b"the removed file's bytes"
                else:
                    with spares._cond:  # now it may be named for an inode
                        spares._target = 1
                        spares._cond.notify()
                    wait_until(lambda: os.fstat(late_reader).st_nlink == 0)  # removed, not named
                    wait_until(lambda: spares.placed == 1)  # a new file instead
                fh, new = core.create(ROOT, b"g", 0o644, os.O_RDWR, ROOT_CALLER)
                core.write(fh, 0, b"the next file")
                core.release(fh)
                assert os.fstat(late_reader).st_nlink == 0  # dropped, not reused
                assert os.stat(core._state.data_path(new.ino)).st_ino != os.fstat(late_reader).st_ino
                assert os.pread(late_reader, 100, 0) in (b"the removed file's bytes", b"")
            finally:
                os.close(late_reader)
            core.unlink(ROOT, b"g")
        finally:
            core.close_spares()


def test_a_big_cache_file_is_unlinked_not_recycled(core):
    """Until it is emptied a recycled file still holds its blocks: a big one (the evictor's
    usual victim) is unlinked at once, so that its space is free at once."""
    spares = core.enable_spares(target=0)
    try:
        ino = write_file(core, b"shard", os.urandom(RECYCLE_MAX_BYTES + 4096))
        remove(core, b"shard", ino)
        assert spares.recycled == 0 and os.listdir(core.cache_dir + "/spare") == []
        assert not os.path.exists(core._state.data_path(ino))
    finally:
        core.close_spares()

"""The filesystem core without FUSE: names, directories, links, renames, lookup counts."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from conftest import CoreEnv, ROOT, ROOT_CALLER, fs_errno as err, fsmeta_problems
from ckptfs.gateway.core import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    Caller,
    FsCore,
    SetattrRequest,
)
from ckptfs.gateway.errors import FsError

USER = Caller(uid=1000, gid=1000, umask=0o022)


def mkfile(core: FsCore, parent: int, name: bytes, data: bytes = b"", caller: Caller = ROOT_CALLER) -> int:
    fh, attr = core.create(parent, name, 0o644, os.O_WRONLY | os.O_CREAT, caller)
    if data:
        core.write(fh, 0, data)
    core.release(fh)
    return attr.ino


def read_all(core: FsCore, ino: int) -> bytes:
    fh = core.open(ino, os.O_RDONLY)
    try:
        return core.read(fh, 0, 1 << 30)
    finally:
        core.release(fh)


def names(core: FsCore, ino: int) -> list[bytes]:
    fh = core.opendir(ino)
    try:
        return [name for name, _, _ in core.readdir(fh, 0)]
    finally:
        core.releasedir(fh)


@pytest.fixture(autouse=True)
def _consistent(core_env):
    """After every test, fsmeta must satisfy its documented invariants."""
    yield
    if core_env.meta is not None:
        assert fsmeta_problems(core_env.meta) == []


# -- creating names ---------------------------------------------------------------------------


def test_create_owner_and_mode_follow_caller(core):
    caller = Caller(uid=1234, gid=5678, umask=0o027)
    fh, attr = core.create(ROOT, b"f", 0o666, os.O_WRONLY, caller)
    core.release(fh)
    assert (attr.uid, attr.gid) == (1234, 5678)
    assert attr.mode == stat.S_IFREG | 0o640
    d = core.mkdir(ROOT, b"d", 0o777, caller)
    assert d.mode == stat.S_IFDIR | 0o750 and (d.uid, d.gid) == (1234, 5678)
    n = core.mknod(ROOT, b"n", stat.S_IFREG | 0o666, 0, caller)
    assert n.mode == stat.S_IFREG | 0o640 and n.uid == 1234
    s = core.symlink(ROOT, b"s", b"f", caller)
    assert stat.S_ISLNK(s.mode) and (s.uid, s.gid) == (1234, 5678)


def test_setgid_directory_passes_group_down(core):
    d = core.mkdir(ROOT, b"shared", 0o777, ROOT_CALLER)
    core.setattr(d.ino, SetattrRequest(mode=stat.S_ISGID | 0o777, gid=4242))
    fh, attr = core.create(d.ino, b"x", 0o644, os.O_WRONLY, USER)
    core.release(fh)
    assert attr.gid == 4242 and attr.uid == 1000
    sub = core.mkdir(d.ino, b"sub", 0o755, USER)
    assert sub.gid == 4242 and sub.mode & stat.S_ISGID


def test_create_existing_name_is_eexist(core):
    mkfile(core, ROOT, b"a")
    core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    assert err(core.create, ROOT, b"a", 0o644, os.O_WRONLY, ROOT_CALLER) == errno.EEXIST
    assert err(core.mkdir, ROOT, b"a", 0o755, ROOT_CALLER) == errno.EEXIST
    assert err(core.symlink, ROOT, b"d", b"x", ROOT_CALLER) == errno.EEXIST
    assert err(core.mknod, ROOT, b"a", stat.S_IFREG | 0o644, 0, ROOT_CALLER) == errno.EEXIST


def test_name_of_256_bytes_is_enametoolong_255_is_fine(core):
    long, ok = b"n" * 256, b"n" * 255
    a = mkfile(core, ROOT, b"a")
    assert err(core.create, ROOT, long, 0o644, os.O_WRONLY, ROOT_CALLER) == errno.ENAMETOOLONG
    assert err(core.mkdir, ROOT, long, 0o755, ROOT_CALLER) == errno.ENAMETOOLONG
    assert err(core.symlink, ROOT, long, b"a", ROOT_CALLER) == errno.ENAMETOOLONG
    assert err(core.link, a, ROOT, long) == errno.ENAMETOOLONG
    assert err(core.rename, ROOT, b"a", ROOT, long) == errno.ENAMETOOLONG
    assert err(core.lookup, ROOT, long) == errno.ENAMETOOLONG
    mkfile(core, ROOT, ok)
    assert core.lookup(ROOT, ok).size == 0


def test_names_must_be_utf8(core):
    assert err(core.create, ROOT, b"bad\xff", 0o644, os.O_WRONLY, ROOT_CALLER) == errno.EILSEQ
    assert err(core.mkdir, ROOT, b"\xc3", 0o755, ROOT_CALLER) == errno.EILSEQ
    mkfile(core, ROOT, b"a")
    assert err(core.rename, ROOT, b"a", ROOT, b"\xfe") == errno.EILSEQ
    mkfile(core, ROOT, "ünïcode-✓".encode())
    assert "ünïcode-✓".encode() in names(core, ROOT)


def test_mknod_makes_fifos_sockets_and_devices(core):
    fifo = core.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o666, 0, USER)
    assert fifo.mode == stat.S_IFIFO | 0o644 and fifo.uid == 1000 and fifo.size == 0
    sock = core.mknod(ROOT, b"sock", stat.S_IFSOCK | 0o755, 0, ROOT_CALLER)
    assert stat.S_ISSOCK(core.getattr(sock.ino).mode)
    rdev = os.makedev(1, 3)
    chr_ = core.mknod(ROOT, b"null", stat.S_IFCHR | 0o666, rdev, ROOT_CALLER)
    blk = core.mknod(ROOT, b"blk", stat.S_IFBLK | 0o600, os.makedev(7, 0), ROOT_CALLER)
    assert (core.getattr(chr_.ino).mode, core.getattr(chr_.ino).rdev) == (stat.S_IFCHR | 0o644, rdev)
    assert core.getattr(blk.ino).rdev == os.makedev(7, 0) and stat.S_ISBLK(blk.mode)
    # Device nodes need CAP_MKNOD, as on a local filesystem; no cache file for any of them.
    assert err(core.mknod, ROOT, b"dev", stat.S_IFCHR | 0o644, rdev, USER) == errno.EPERM
    assert sorted(os.listdir(core.data_dir)) == []
    assert sorted(names(core, ROOT)) == [b"blk", b"fifo", b"null", b"sock"]


def test_mknod_of_a_regular_file_gets_a_cache_file(core):
    attr = core.mknod(ROOT, b"reg", stat.S_IFREG | 0o600, 0, ROOT_CALLER)
    assert stat.S_ISREG(attr.mode) and attr.size == 0
    assert os.path.isfile(core._data_path(attr.ino))  # so the drain can upload it
    assert names(core, ROOT) == [b"reg"]


def test_names_reserved_by_the_file_bucket_are_einval(core):
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    f = mkfile(core, ROOT, b"f")
    bad = b".ckptfs-m.f"
    assert err(core.create, ROOT, bad, 0o644, os.O_WRONLY, ROOT_CALLER) == errno.EINVAL
    assert err(core.mkdir, d.ino, b".ckptfs-multipart", 0o755, ROOT_CALLER) == errno.EINVAL
    assert err(core.mknod, ROOT, bad, stat.S_IFREG | 0o644, 0, ROOT_CALLER) == errno.EINVAL
    assert err(core.symlink, ROOT, bad, b"f", ROOT_CALLER) == errno.EINVAL
    assert err(core.link, f, d.ino, bad) == errno.EINVAL
    assert err(core.rename, ROOT, b"f", d.ino, b".ckptfs-tmp.x") == errno.EINVAL
    # Only a leading ".ckptfs-" is reserved.
    mkfile(core, ROOT, b"x.ckptfs-1")
    assert sorted(names(core, ROOT)) == [b"d", b"f", b"x.ckptfs-1"]


def test_symlink_and_readlink(core):
    target = b"../some/where/" + b"x" * 200
    s = core.symlink(ROOT, b"s", target, ROOT_CALLER)
    assert core.readlink(s.ino) == target
    assert core.getattr(s.ino).size == len(target)
    f = mkfile(core, ROOT, b"f")
    assert err(core.readlink, f) == errno.EINVAL
    assert err(core.symlink, ROOT, b"t", b"x" * 4096, ROOT_CALLER) == errno.ENAMETOOLONG


# -- bucket key length ------------------------------------------------------------------------------


@pytest.fixture
def prefixed(tmp_path):
    env = CoreEnv(tmp_path / "pcache", key_prefix="ckpt/run-1")  # "ckpt/run-1/" is 11 bytes
    yield env.core
    assert fsmeta_problems(env.meta) == []
    env.close()


def test_key_length_limit_counts_prefix_and_path(prefixed):
    core = prefixed
    room = 1024 - len(b"ckpt/run-1/")  # 1013 bytes for the relative path
    parent = ROOT
    for c in b"abcd":
        parent = core.mkdir(parent, bytes([c]) * 200, 0o755, ROOT_CALLER).ino  # 201 bytes each
    exact = b"f" * (room - 4 * 201)  # this file's key is exactly 1024 bytes
    mkfile(core, parent, exact)
    assert err(core.create, parent, exact + b"g", 0o644, os.O_WRONLY, ROOT_CALLER) == errno.ENAMETOOLONG
    # A directory's marker key carries a trailing "/".
    assert err(core.mkdir, parent, exact[:-1] + b"h", 0o755, ROOT_CALLER) == errno.ENAMETOOLONG
    core.mkdir(parent, exact[:-2] + b"h", 0o755, ROOT_CALLER)
    assert err(core.symlink, parent, exact + b"s", b"t", ROOT_CALLER) == errno.ENAMETOOLONG
    short = mkfile(core, ROOT, b"short")
    assert err(core.link, short, parent, exact + b"l") == errno.ENAMETOOLONG
    assert err(core.rename, ROOT, b"short", parent, exact + b"r") == errno.ENAMETOOLONG
    assert b"short" in names(core, ROOT)  # the refused rename changed nothing
    core.rename(ROOT, b"short", parent, exact[:-1] + b"r")  # 1024 bytes: allowed


def test_rename_of_directory_checks_the_longest_key_below_it(prefixed):
    core = prefixed
    parent = ROOT
    for c in b"DEF":
        parent = core.mkdir(parent, bytes([c]) * 250, 0o755, ROOT_CALLER).ino
    mkfile(core, parent, b"f" * 220)  # key: 11 + 3 * 251 + 220 = 984 bytes
    t = core.mkdir(ROOT, b"t" * 50, 0o755, ROOT_CALLER)
    core.rename(ROOT, b"D" * 250, t.ino, b"d" * 10)  # 11 + 51 + 11 + 502 + 220 = 795
    # Renaming the directory itself would push the file's key to 1035 bytes.
    assert err(core.rename, t.ino, b"d" * 10, t.ino, b"D" * 250) == errno.ENAMETOOLONG
    assert err(core.rename, t.ino, b"d" * 10, t.ino, b"D" * 250, RENAME_NOREPLACE) == errno.ENAMETOOLONG
    assert names(core, t.ino) == [b"d" * 10]
    core.rename(t.ino, b"d" * 10, t.ino, b"D" * 239)  # exactly 1024


def test_key_length_follows_a_directory_renamed_after_creates_in_it(prefixed):
    # The check keeps directory paths between creates (gateway/names.py): a rename of an
    # ancestor, done or refused, must not leave it an old path, longer or shorter.
    core = prefixed
    d = ROOT
    for name in (b"t", b"A" * 250, b"B" * 250, b"C" * 10, b"d"):
        d = core.mkdir(d, name, 0o755, ROOT_CALLER).ino
    mkfile(core, d, b"first")  # its path is kept: t/AAA.../BBB.../CCC.../d, 516 bytes
    core.rename(ROOT, b"t", ROOT, b"T" * 250)  # 249 bytes longer
    room = 1024 - len(b"ckpt/run-1/") - (516 + 249) - 1  # 247 bytes for a name in d
    assert err(core.create, d, b"f" * (room + 1), 0o644, os.O_WRONLY, ROOT_CALLER) == errno.ENAMETOOLONG
    mkfile(core, d, b"f" * room)  # its key: exactly 1024 bytes
    # Refused: that file's key would be 1025 bytes. The path stays as it was.
    assert err(core.rename, ROOT, b"T" * 250, ROOT, b"T" * 251) == errno.ENAMETOOLONG
    mkfile(core, d, b"g" * room)
    core.rename(ROOT, b"T" * 250, ROOT, b"t")  # and back: a name of 255 bytes fits again
    mkfile(core, d, b"h" * 255)


def test_key_length_without_prefix(core):
    d = [ROOT]
    for c in b"abcd":
        d.append(core.mkdir(d[-1], bytes([c]) * 200, 0o755, ROOT_CALLER).ino)
    mkfile(core, d[-1], b"f" * (1024 - 4 * 201))
    assert err(core.create, d[-1], b"g" * (1025 - 4 * 201), 0o644, os.O_WRONLY, ROOT_CALLER) == errno.ENAMETOOLONG


# -- directories ----------------------------------------------------------------------------------------


def test_mkdir_rmdir_and_nlink(core):
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    assert d.nlink == 2
    assert core.getattr(ROOT).nlink == 3
    sub = core.mkdir(d.ino, b"sub", 0o755, ROOT_CALLER)
    assert core.getattr(d.ino).nlink == 3
    assert err(core.rmdir, ROOT, b"d") == errno.ENOTEMPTY
    mkfile(core, sub.ino, b"f")
    assert err(core.rmdir, d.ino, b"sub") == errno.ENOTEMPTY
    assert err(core.rmdir, sub.ino, b"f") == errno.ENOTDIR
    assert err(core.unlink, d.ino, b"sub") == errno.EISDIR
    core.unlink(sub.ino, b"f")
    core.rmdir(d.ino, b"sub")
    assert core.getattr(d.ino).nlink == 2
    core.rmdir(ROOT, b"d")
    assert core.getattr(ROOT).nlink == 2
    assert err(core.lookup, ROOT, b"d") == errno.ENOENT
    assert err(core.rmdir, ROOT, b"d") == errno.ENOENT


def test_create_in_removed_directory_is_enoent(core):
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    core.rmdir(ROOT, b"d")  # the kernel still holds a reference (cwd of a process)
    assert err(core.create, d.ino, b"x", 0o644, os.O_WRONLY, ROOT_CALLER) == errno.ENOENT
    assert err(core.mkdir, d.ino, b"x", 0o755, ROOT_CALLER) == errno.ENOENT
    assert names(core, d.ino) == []


def test_readdir_lists_names_without_dot_entries(core):
    for n in (b"b", b"a", b"c"):
        mkfile(core, ROOT, n)
    core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    fh = core.opendir(ROOT)
    entries = core.readdir(fh, 0)
    core.releasedir(fh)
    assert sorted(n for n, _, _ in entries) == [b"a", b"b", b"c", b"d"]
    kinds = {n: stat.S_ISDIR(a.mode) for n, a, _ in entries}
    assert kinds == {b"a": False, b"b": False, b"c": False, b"d": True}
    # Offsets are positions: resuming at any returned offset gives exactly the rest.
    fh = core.opendir(ROOT)
    first = core.readdir(fh, 0)
    rest = core.readdir(fh, first[1][2])
    core.releasedir(fh)
    assert [n for n, _, _ in rest] == [n for n, _, _ in first[2:]]


def test_readdir_is_stable_while_the_directory_changes(core):
    for i in range(100):
        mkfile(core, ROOT, b"f%03d" % i)
    fh = core.opendir(ROOT)
    seen = []
    offset = 0
    while True:
        chunk = core.readdir(fh, offset)[:7]  # the kernel reads a few entries at a time
        if not chunk:
            break
        for name, _, nxt in chunk:
            seen.append(name)
            offset = nxt
        # Meanwhile: delete entries ahead and behind, add new ones.
        i = len(seen)
        for victim in (b"f%03d" % (i + 3), b"f%03d" % (i - 2)):
            try:
                core.unlink(ROOT, victim)
            except FsError:
                pass
        mkfile(core, ROOT, b"new%03d" % i)
    core.releasedir(fh)
    assert len(seen) == len(set(seen)), "an entry was returned twice"
    assert set(seen) == {b"f%03d" % i for i in range(100)}


def test_opendir_of_file_is_enotdir(core):
    f = mkfile(core, ROOT, b"f")
    assert err(core.opendir, f) == errno.ENOTDIR
    assert err(core.lookup, f, b"x") == errno.ENOTDIR


# -- links and unlink ----------------------------------------------------------------------------------


def test_hard_link_shares_content_and_counts(core):
    a = mkfile(core, ROOT, b"a", b"hello")
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    attr = core.link(a, d.ino, b"b")
    assert attr.ino == a and attr.nlink == 2
    fh = core.open(a, os.O_RDWR)
    core.write(fh, 0, b"J")
    core.release(fh)
    assert read_all(core, core.lookup(d.ino, b"b").ino) == b"Jello"
    core.unlink(ROOT, b"a")
    assert core.getattr(a).nlink == 1
    assert read_all(core, a) == b"Jello"
    assert err(core.link, d.ino, ROOT, b"dlink") == errno.EPERM
    assert err(core.link, a, d.ino, b"b") == errno.EEXIST


def test_hard_link_is_queued_under_every_name(core):
    a = mkfile(core, ROOT, b"a", b"data")
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    core.link(a, d.ino, b"b")
    with core.meta.read() as txn:
        # The drain uploads one object per name: hard links are separate objects in the bucket.
        assert sorted(txn.paths_of(a)) == [b"a", b"d/b"]
        assert txn.get_pending(a) is not None
    core.unlink(ROOT, b"a")
    with core.meta.read() as txn:
        assert txn.paths_of(a) == [b"d/b"]
        assert "a" in dict(txn.iter_tombstones())  # the object of the removed name goes


def test_unlinked_open_file_stays_usable_until_release_and_forget(core_env):
    core = core_env.core
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)  # lookup count 1
    ino = attr.ino
    core.write(fh, 0, b"before")
    core.unlink(ROOT, b"f")
    assert err(core.lookup, ROOT, b"f") == errno.ENOENT
    assert core.getattr(ino).nlink == 0
    core.write(fh, 6, b"+after")
    core.setattr(ino, SetattrRequest(size=10), fh)
    assert core.read(fh, 0, 100) == b"before+aft"
    core.fsync(fh, False)
    data_file = os.path.join(core.data_dir, f"{ino:x}")
    core.release(fh)
    # The kernel still holds its reference: the inode stays until forget.
    assert core.getattr(ino).nlink == 0
    assert os.path.exists(data_file)
    core.forget([(ino, 1)])
    assert err(core.getattr, ino) == errno.ENOENT
    assert not os.path.exists(data_file)
    with core.meta.read() as txn:
        assert txn.get_pending(ino) is None and ino not in txn.iter_orphans()


def test_forget_purges_only_when_every_reference_is_gone(core):
    ino = mkfile(core, ROOT, b"f", b"x")  # create: 1 reference
    core.lookup(ROOT, b"f")  # 2
    core.unlink(ROOT, b"f")
    core.forget([(ino, 1)])
    assert core.getattr(ino).nlink == 0  # one reference left
    fh = core.open(ino, os.O_RDONLY)
    core.forget([(ino, 1)])  # no reference left, but still open
    assert core.read(fh, 0, 10) == b"x"
    core.release(fh)
    assert err(core.getattr, ino) == errno.ENOENT


def test_forget_of_a_linked_inode_keeps_it(core):
    ino = mkfile(core, ROOT, b"f", b"data")
    core.forget([(ino, 1)])
    assert read_all(core, core.lookup(ROOT, b"f").ino) == b"data"


def test_orphans_of_a_crashed_run_are_purged_at_recovery(core_env):
    core = core_env.core
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, b"x" * 100)
    core.flush(fh)
    core.unlink(ROOT, b"f")
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    core.rmdir(ROOT, b"d")  # still referenced by the kernel
    core = core_env.reopen(recover=False)
    stats = core.recover()
    assert stats["purged_orphans"] == 2
    assert err(core.getattr, attr.ino) == errno.ENOENT
    assert err(core.getattr, d.ino) == errno.ENOENT
    assert not os.path.exists(os.path.join(core.data_dir, f"{attr.ino:x}"))


# -- rename -------------------------------------------------------------------------------------------


def test_rename_over_existing_file_replaces_it(core):
    a = mkfile(core, ROOT, b"a", b"new")
    b = mkfile(core, ROOT, b"b", b"old")
    core.forget([(b, 1)])
    core.rename(ROOT, b"a", ROOT, b"b")
    assert names(core, ROOT) == [b"b"]
    assert core.lookup(ROOT, b"b").ino == a
    assert read_all(core, a) == b"new"
    assert err(core.getattr, b) == errno.ENOENT  # the replaced inode had no reference left


def test_rename_over_file_that_is_open_keeps_it_readable(core):
    mkfile(core, ROOT, b"a", b"new")
    b = mkfile(core, ROOT, b"b", b"old")
    fh = core.open(b, os.O_RDONLY)
    core.rename(ROOT, b"a", ROOT, b"b")
    assert core.read(fh, 0, 10) == b"old"
    core.release(fh)
    core.forget([(b, 1)])
    assert err(core.getattr, b) == errno.ENOENT


def test_rename_noreplace(core):
    mkfile(core, ROOT, b"a", b"A")
    mkfile(core, ROOT, b"b", b"B")
    assert err(core.rename, ROOT, b"a", ROOT, b"b", RENAME_NOREPLACE) == errno.EEXIST
    core.rename(ROOT, b"a", ROOT, b"c", RENAME_NOREPLACE)
    assert names(core, ROOT) == [b"b", b"c"]
    assert err(core.rename, ROOT, b"b", ROOT, b"x", RENAME_NOREPLACE | RENAME_EXCHANGE) == errno.EINVAL
    assert err(core.rename, ROOT, b"b", ROOT, b"x", 4) == errno.EINVAL  # RENAME_WHITEOUT


def test_rename_exchange_files_and_directories_across_parents(core):
    d1 = core.mkdir(ROOT, b"d1", 0o755, ROOT_CALLER)
    d2 = core.mkdir(ROOT, b"d2", 0o755, ROOT_CALLER)
    f = mkfile(core, d1.ino, b"x", b"file")
    sub = core.mkdir(d2.ino, b"y", 0o755, ROOT_CALLER)
    mkfile(core, sub.ino, b"inner", b"in")
    core.rename(d1.ino, b"x", d2.ino, b"y", RENAME_EXCHANGE)
    assert core.lookup(d1.ino, b"x").ino == sub.ino
    assert core.lookup(d2.ino, b"y").ino == f
    assert core.getattr(d1.ino).nlink == 3 and core.getattr(d2.ino).nlink == 2
    assert read_all(core, core.lookup(sub.ino, b"inner").ino) == b"in"
    assert err(core.rename, d1.ino, b"x", d2.ino, b"missing", RENAME_EXCHANGE) == errno.ENOENT
    assert err(core.rename, d1.ino, b"missing", d2.ino, b"y", RENAME_EXCHANGE) == errno.ENOENT


def test_directory_into_its_own_subtree_is_einval(core):
    a = core.mkdir(ROOT, b"a", 0o755, ROOT_CALLER)
    b = core.mkdir(a.ino, b"b", 0o755, ROOT_CALLER)
    c = core.mkdir(b.ino, b"c", 0o755, ROOT_CALLER)
    assert err(core.rename, ROOT, b"a", c.ino, b"a") == errno.EINVAL
    assert err(core.rename, ROOT, b"a", a.ino, b"x") == errno.EINVAL
    assert err(core.rename, ROOT, b"a", b.ino, b"c", RENAME_EXCHANGE) == errno.EINVAL
    assert err(core.rename, b.ino, b"c", ROOT, b"a", RENAME_EXCHANGE) == errno.EINVAL
    assert names(core, ROOT) == [b"a"] and names(core, c.ino) == []


def test_rename_type_rules(core):
    core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    full = core.mkdir(ROOT, b"full", 0o755, ROOT_CALLER)
    mkfile(core, full.ino, b"x")
    core.mkdir(ROOT, b"empty", 0o755, ROOT_CALLER)
    mkfile(core, ROOT, b"f")
    assert err(core.rename, ROOT, b"f", ROOT, b"d") == errno.EISDIR
    assert err(core.rename, ROOT, b"d", ROOT, b"f") == errno.ENOTDIR
    assert err(core.rename, ROOT, b"d", ROOT, b"full") == errno.ENOTEMPTY
    assert err(core.rename, ROOT, b"nope", ROOT, b"g") == errno.ENOENT
    core.rename(ROOT, b"d", ROOT, b"empty")  # over an empty directory
    assert names(core, ROOT) == [b"empty", b"f", b"full"]
    assert core.getattr(ROOT).nlink == 4


def test_rename_of_a_whole_directory_moves_its_subtree(core):
    a = core.mkdir(ROOT, b"a", 0o755, ROOT_CALLER)
    sub = core.mkdir(a.ino, b"sub", 0o755, ROOT_CALLER)
    mkfile(core, sub.ino, b"f", b"deep")
    dst = core.mkdir(ROOT, b"dst", 0o755, ROOT_CALLER)
    core.rename(ROOT, b"a", dst.ino, b"moved")
    moved = core.lookup(dst.ino, b"moved")
    assert moved.ino == a.ino
    f = core.lookup(core.lookup(moved.ino, b"sub").ino, b"f")
    assert read_all(core, f.ino) == b"deep"
    assert core.lookup(moved.ino, b"..").ino == dst.ino
    assert core.getattr(ROOT).nlink == 3 and core.getattr(dst.ino).nlink == 3
    with core.meta.read() as txn:
        assert txn.path_of(f.ino) == b"dst/moved/sub/f"


def test_rename_between_two_links_of_one_inode_does_nothing(core):
    a = mkfile(core, ROOT, b"a", b"x")
    core.link(a, ROOT, b"b")
    core.rename(ROOT, b"a", ROOT, b"b")
    assert names(core, ROOT) == [b"a", b"b"]
    assert core.getattr(a).nlink == 2


def test_rename_queues_the_new_name_for_the_drain(core):
    a = mkfile(core, ROOT, b"a", b"x")
    with core.meta.read() as txn:
        before = txn.get_pending(a)
    core.rename(ROOT, b"a", ROOT, b"b")
    with core.meta.read() as txn:
        rec = txn.get_pending(a)
        tomb = dict(txn.iter_tombstones())
        assert txn.paths_of(a) == [b"b"]
    assert rec is not None and before is not None
    assert "a" in tomb  # whatever was uploaded at the old key goes away


# -- attributes -----------------------------------------------------------------------------------------


def test_setattr_chmod_chown_utimens_keep_type_and_nanoseconds(core):
    f = mkfile(core, ROOT, b"f")
    attr = core.setattr(f, SetattrRequest(mode=0o4751))
    assert attr.mode == stat.S_IFREG | 0o4751
    attr = core.setattr(f, SetattrRequest(uid=7, gid=8))
    assert (attr.uid, attr.gid) == (7, 8)
    attr = core.setattr(f, SetattrRequest(atime_ns=1_000_000_001, mtime_ns=1_234_567_891_123_456_789))
    got = core.getattr(f)
    assert got.atime_ns == 1_000_000_001 and got.mtime_ns == 1_234_567_891_123_456_789
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    assert core.setattr(d.ino, SetattrRequest(mode=0o700)).mode == stat.S_IFDIR | 0o700
    assert err(core.setattr, d.ino, SetattrRequest(size=0)) == errno.EISDIR


def test_directory_mtime_changes_with_its_entries(core):
    clock = iter(range(10**18, 10**18 + 10**6, 1000))
    core.clock = lambda: next(clock)
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    m0 = core.getattr(d.ino).mtime_ns
    mkfile(core, d.ino, b"x")
    m1 = core.getattr(d.ino).mtime_ns
    core.rename(d.ino, b"x", d.ino, b"y")
    m2 = core.getattr(d.ino).mtime_ns
    core.unlink(d.ino, b"y")
    m3 = core.getattr(d.ino).mtime_ns
    assert m0 < m1 < m2 < m3


def test_rename_into_a_removed_directory_is_enoent(core):
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    mkfile(core, ROOT, b"f", b"x")
    core.mkdir(ROOT, b"sub", 0o755, ROOT_CALLER)
    core.rmdir(ROOT, b"d")  # a process still has it as its cwd
    assert err(core.rename, ROOT, b"f", d.ino, b"f") == errno.ENOENT
    assert err(core.rename, ROOT, b"sub", d.ino, b"sub") == errno.ENOENT
    assert err(core.link, core.lookup(ROOT, b"f").ino, d.ino, b"g") == errno.ENOENT
    assert names(core, ROOT) == [b"f", b"sub"]

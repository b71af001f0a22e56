"""Model-based test: random operation sequences on the mount and on a local filesystem agree.

A Hypothesis state machine applies each step to a fresh directory on a ckptfs mount
and to one on a local disk filesystem (ext4/xfs/..., with user xattrs), and compares
return values, errnos, file contents, directory listings, link counts and xattrs.
Names come mostly from a three-letter alphabet so that steps collide, and from two long
names at depths whose bucket keys come near, reach or pass S3's 1,024 bytes: the mount refuses
a longer key with ENAMETOOLONG (the local filesystem has no such limit), and takes every other.

A sequence this test finds must be kept, written out as plain code, in tests/regressions/.
Raise CKPTFS_MODEL_EXAMPLES / CKPTFS_MODEL_REMOUNT_EXAMPLES for a longer hunt.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import mmap
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import DATA_PATHS, RENAME_EXCHANGE, RENAME_NOREPLACE, both_data_paths, needs_fuse, renameat2
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

# Every test here runs on both data paths (one mount per path: see conftest.DATA_PATHS).
data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

pytestmark = [needs_fuse, pytest.mark.mounted]

NAMES = ["a", "b", "c"]
SHORT_PATHS = st.lists(st.sampled_from(NAMES), min_size=1, max_size=2).map("/".join)
# Long names (issue 34), multi-byte UTF-8, up to four deep, and "a" below them. Below the
# compared root ("ex000/root/", 11 bytes of key) four long names make keys of 994 to 1,034
# bytes, 10 apart: "U/U/U/W" is 1,024 bytes (as a directory, its marker 1,025: refused), four U
# 1,034 (refused); "U/U/U/W/a" is over, "U/U/U/a" 779 bytes.
U = "ü" * 127 + "u"  # 255 bytes
W = "é" * 122 + "w"  # 245 bytes
# The keys at the limits: 512, 1,024 and 1,034 bytes.
AT_THE_LIMITS = [f"{U}/{W}", f"{U}/{U}/{U}/{W}", f"{U}/{U}/{U}/{U}"]
DEEP_PATHS = st.sampled_from(AT_THE_LIMITS) | st.tuples(
    st.integers(1, 4).flatmap(lambda n: st.lists(st.sampled_from([U, W]), min_size=n, max_size=n)),
    st.booleans()).map(lambda t: "/".join(t[0] + ["a"] * t[1]))
# Mostly short names, so that steps still collide on them.
PATHS = st.one_of(SHORT_PATHS, SHORT_PATHS, SHORT_PATHS, DEEP_PATHS)
S3_KEY_MAX = 1024
DATA = st.binary(min_size=0, max_size=300) | st.sampled_from([b"x" * 5000, bytes(70000)])
OFFSETS = st.sampled_from([0, 1, 100, 4095, 4096, 70000, (4 << 30) + 5])
SIZES = st.sampled_from([0, 1, 50, 4096, 10000, (4 << 30) + 1])
XNAMES = st.sampled_from(["user.x", "user.y"])
OPEN_FLAGS = st.sampled_from([
    os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC,
    os.O_RDWR | os.O_TRUNC, os.O_WRONLY | os.O_APPEND, os.O_RDWR | os.O_APPEND,
])
CREATE_FLAGS = st.sampled_from([
    os.O_CREAT | os.O_WRONLY, os.O_CREAT | os.O_RDWR, os.O_CREAT | os.O_EXCL | os.O_RDWR,
    os.O_CREAT | os.O_TRUNC | os.O_WRONLY, os.O_CREAT | os.O_APPEND | os.O_WRONLY,
    # A create that does not count a writer (a later open for writing must bump first)
    os.O_CREAT | os.O_RDONLY,
])
RENAME_FLAGS = st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])


def supports_user_xattrs(path: Path) -> bool:
    probe = path / ".xattr-probe"
    try:
        probe.write_bytes(b"")
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def local_base(tmp_path):
    """A directory on a real local filesystem with user xattrs (/tmp may be tmpfs without them)."""
    if supports_user_xattrs(tmp_path):
        yield tmp_path
        return
    var_tmp = Path(tempfile.mkdtemp(prefix="ckptfs-model-", dir="/var/tmp"))
    try:
        if not supports_user_xattrs(var_tmp):
            pytest.skip("no local directory with user xattr support for the reference filesystem")
        yield var_tmp
    finally:
        shutil.rmtree(var_tmp, ignore_errors=True)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno, exc.errno))


def content(path: str):
    """A file's bytes; for huge sparse files only the regions the steps can touch (reading 4 GiB is slow)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= 1 << 20:
            return f.read()
        fd = f.fileno()
        return (size, os.pread(fd, 256 << 10, 0), os.pread(fd, 128 << 10, (4 << 30) - (64 << 10)),
                os.pread(fd, 64 << 10, max(0, size - (64 << 10))))


def snapshot(root: str) -> dict:
    """Everything the model compares about a tree (not timestamps, not inode numbers)."""
    out = {}
    groups: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        st_dir = os.lstat(dirpath)
        out[rel_dir] = ("dir", stat.S_IMODE(st_dir.st_mode), st_dir.st_nlink, st_dir.st_uid, st_dir.st_gid,
                        sorted(dirnames + filenames), xattrs(dirpath))
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            s = os.lstat(p)
            if stat.S_ISLNK(s.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(s.st_mode):
                out[rel] = ("file", stat.S_IMODE(s.st_mode), s.st_nlink, s.st_uid, s.st_gid, s.st_size,
                            content(p), xattrs(p))
                groups.setdefault(s.st_ino, []).append(rel)
    out["<hard link groups>"] = sorted(sorted(g) for g in groups.values())
    return out


def xattrs(path: str) -> dict:
    return {n: os.getxattr(path, n, follow_symlinks=False)
            for n in sorted(os.listxattr(path, follow_symlinks=False)) if n.startswith("user.")}


class FsModel(RuleBasedStateMachine):
    mount_base: Path
    local_base: Path
    counter = itertools.count()

    def __init__(self):
        super().__init__()
        n = next(self.counter)
        # The compared tree is exN/root; a symlink to "../a" reaches exN/a, still private to
        # this example. (N has three digits: the bucket keys below the root start the same
        # number of bytes in, and the long paths reach 1,024 bytes exactly.)
        self.roots = (str(self.mount_base / f"ex{n:03d}" / "root"), str(self.local_base / f"ex{n:03d}" / "root"))
        for r in self.roots:
            os.makedirs(r)
        self.fds: list[tuple[int, int, str, int]] = []  # (mount fd, local fd, path, flags)

    def both(self, what: str, fn, *, key_over_limit: bool = False):
        """``fn`` on the mount, then locally: the same outcome. ``key_over_limit``: the step
        would make a bucket key over 1,024 bytes, which the mount refuses with ENAMETOOLONG
        (the local step is then not made); it may fail otherwise too, as the local one does."""
        mount = outcome(fn, self.roots[0])
        if key_over_limit:
            assert mount[0] == "err", f"{what}: the mount made a bucket key over {S3_KEY_MAX} bytes"
            if mount == ("err", "ENAMETOOLONG"):
                return mount
        local = outcome(fn, self.roots[1])
        assert mount == local, f"{what}: mount gave {mount}, local gave {local}"
        return mount

    def key_over_limit(self, path: str, moved: str | None = None, *, is_dir: bool = False,
                       follow: bool = False) -> bool:
        """Would naming ``path`` make a bucket key over 1,024 bytes? The key is the path below
        the mount's root, symlinks in the parent directories resolved (``follow``: also a
        symlink ``path`` is, as an open with O_CREAT follows it); a directory's marker key ends
        in "/". ``moved``: a rename's source, whose subtree takes the new name with it."""
        local_root = self.roots[1]
        base = os.path.realpath(os.path.dirname(local_root))  # exN: the mount's key prefix is ex{N}/
        prefix = os.path.relpath(os.path.dirname(local_root), self.local_base)
        full = os.path.join(local_root, path)
        real = os.path.realpath(full) if follow else os.path.join(os.path.realpath(os.path.dirname(full)),
                                                                   os.path.basename(full))
        key = os.path.join(prefix, os.path.relpath(real, base))
        extra = 1 if is_dir else 0
        if moved is not None:
            src = os.path.join(local_root, moved)
            src = os.path.join(os.path.realpath(os.path.dirname(src)), os.path.basename(src))
            if os.path.lexists(src) and stat.S_ISDIR(os.lstat(src).st_mode):
                extra = 1
                for dirpath, dirnames, filenames in os.walk(src):
                    for name in dirnames + filenames:
                        below = os.path.join(dirpath, name)
                        is_subdir = stat.S_ISDIR(os.lstat(below).st_mode)
                        extra = max(extra, 1 + len(os.path.relpath(below, src).encode()) + is_subdir)
        return len(key.encode()) + extra > S3_KEY_MAX

    def both_fd(self, what: str, i: int, fn):
        fm, fl, path, flags = self.fds[i % len(self.fds)]
        res = [outcome(fn, fm), outcome(fn, fl)]
        assert res[0] == res[1], f"{what} on fd of {path} (flags {flags:#o}): mount gave {res[0]}, local gave {res[1]}"
        return res[0]

    # -- names -------------------------------------------------------------------------------------

    @rule(path=PATHS, flags=CREATE_FLAGS, data=DATA)
    def create(self, path, flags, data):
        new = not os.path.exists(os.path.join(self.roots[1], path))  # (a dangling symlink: its target is made)
        if new and self.key_over_limit(path, follow=not flags & os.O_EXCL):
            self.both(f"open({path}, {flags:#o})", lambda r: os.close(os.open(os.path.join(r, path), flags, 0o644)),
                      key_over_limit=True)
            return
        res = [outcome(os.open, os.path.join(r, path), flags, 0o644) for r in self.roots]
        kinds = [r[0] for r in res]
        if kinds == ["ok", "ok"]:
            self.fds.append((res[0][1], res[1][1], path, flags))
            if data:
                self.both_fd(f"write after create {path}", -1, lambda fd: os.write(fd, data))
        else:
            for k, r in zip(kinds, res):
                if k == "ok":
                    os.close(r[1])
            assert res[0] == res[1], f"open({path}, {flags:#o}): mount gave {res[0]}, local gave {res[1]}"

    @rule(path=PATHS, flags=OPEN_FLAGS)
    def open_existing(self, path, flags):
        res = [outcome(os.open, os.path.join(r, path), flags) for r in self.roots]
        if [r[0] for r in res] == ["ok", "ok"]:
            self.fds.append((res[0][1], res[1][1], path, flags))
        else:
            for r in res:
                if r[0] == "ok":
                    os.close(r[1])
            assert res[0] == res[1], f"open({path}, {flags:#o}): mount gave {res[0]}, local gave {res[1]}"

    @rule(path=DEEP_PATHS, flags=CREATE_FLAGS, data=DATA)
    def create_deep(self, path, flags, data):
        """``mkdir -p`` (each level compared) and a create: trees of long names, keys up to and
        past 1,024 bytes."""
        parts = path.split("/")
        for depth in range(1, len(parts)):
            self.mkdir("/".join(parts[:depth]))
        self.create(path, flags, data)

    @rule(path=PATHS)
    def mknod(self, path):
        """A regular file made without an open (its cache file is made with no handle).
        (No FIFOs: the steps' opens and reads of one would block.)"""
        self.both(f"mknod {path}", lambda r: os.mknod(os.path.join(r, path), stat.S_IFREG | 0o640),
                  key_over_limit=self.key_over_limit(path))

    @rule(path=PATHS)
    def mkdir(self, path):
        self.both(f"mkdir {path}", lambda r: os.mkdir(os.path.join(r, path)),
                  key_over_limit=self.key_over_limit(path, is_dir=True))

    @rule(path=PATHS)
    def rmdir(self, path):
        self.both(f"rmdir {path}", lambda r: os.rmdir(os.path.join(r, path)))

    @rule(path=PATHS)
    def unlink(self, path):
        self.both(f"unlink {path}", lambda r: os.unlink(os.path.join(r, path)))

    @rule(src=PATHS, dst=PATHS, flags=RENAME_FLAGS)
    def rename(self, src, dst, flags):
        over = self.key_over_limit(dst, src) or bool(flags & RENAME_EXCHANGE and self.key_over_limit(src, dst))
        self.both(f"rename {src} -> {dst} flags {flags}",
                  lambda r: renameat2(os.path.join(r, src), os.path.join(r, dst), flags), key_over_limit=over)

    @rule(src=PATHS, dst=PATHS)
    def link(self, src, dst):
        self.both(f"link {src} -> {dst}", lambda r: os.link(os.path.join(r, src), os.path.join(r, dst)),
                  key_over_limit=self.key_over_limit(dst))

    @rule(dest=st.sampled_from(NAMES + ["../a", "nowhere"]), path=PATHS)
    def symlink(self, dest, path):
        self.both(f"symlink {path} -> {dest}", lambda r: os.symlink(dest, os.path.join(r, path)),
                  key_over_limit=self.key_over_limit(path))

    @rule(path=PATHS, size=SIZES)
    def truncate(self, path, size):
        self.do_truncate(path, size)

    def do_truncate(self, path, size):
        self.both(f"truncate {path} {size}", lambda r: os.truncate(os.path.join(r, path), size))

    @rule(path=PATHS, mode=st.sampled_from([0o600, 0o644, 0o755, 0o4711]))
    def chmod(self, path, mode):
        self.both(f"chmod {path} {mode:o}", lambda r: os.chmod(os.path.join(r, path), mode))

    @rule(path=PATHS, uid=st.sampled_from([0, 1000, 4242]), gid=st.sampled_from([-1, 0, 1000]))
    def chown(self, path, uid, gid):
        self.both(f"chown {path} {uid}:{gid}", lambda r: os.chown(os.path.join(r, path), uid, gid))

    @rule(path=PATHS, times=st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)))
    def utime(self, path, times):
        def set_and_get(r):
            p = os.path.join(r, path)
            os.utime(p, ns=times)
            s = os.stat(p)
            return s.st_atime_ns, s.st_mtime_ns

        self.both(f"utime {path} {times}", set_and_get)

    @rule(path=PATHS, name=XNAMES, value=st.binary(max_size=20), flags=st.sampled_from([0, os.XATTR_CREATE, os.XATTR_REPLACE]))
    def setxattr(self, path, name, value, flags):
        self.both(f"setxattr {path} {name} flags {flags}",
                  lambda r: os.setxattr(os.path.join(r, path), name, value, flags))

    @rule(path=PATHS, name=XNAMES)
    def removexattr(self, path, name):
        self.both(f"removexattr {path} {name}", lambda r: os.removexattr(os.path.join(r, path), name))

    @rule(path=PATHS, name=XNAMES)
    def getxattr(self, path, name):
        self.both(f"getxattr {path} {name}", lambda r: os.getxattr(os.path.join(r, path), name))

    @rule(path=PATHS)
    def stat_and_list(self, path):
        def look(r):
            p = os.path.join(r, path)
            s = os.stat(p)
            if stat.S_ISDIR(s.st_mode):
                return ("dir", sorted(os.listdir(p)), s.st_nlink)
            return ("file", s.st_size, s.st_nlink, stat.S_IMODE(s.st_mode), content(p))

        self.both(f"stat {path}", look)

    @rule(path=PATHS)
    def readlink(self, path):
        self.both(f"readlink {path}", lambda r: os.readlink(os.path.join(r, path)))

    # -- open files --------------------------------------------------------------------------------

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), offset=OFFSETS, data=DATA)
    def pwrite(self, i, offset, data):
        self.do_pwrite(i, offset, data)

    def do_pwrite(self, i, offset, data):
        self.both_fd(f"pwrite {len(data)}@{offset}", i, lambda fd: os.pwrite(fd, data, offset))

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), data=DATA)
    def write(self, i, data):
        self.both_fd(f"write {len(data)}", i, lambda fd: os.write(fd, data))

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), offset=OFFSETS, size=st.sampled_from([1, 100, 5000, 100000]))
    def pread(self, i, offset, size):
        self.both_fd(f"pread {size}@{offset}", i, lambda fd: os.pread(fd, size, offset))

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), offset=OFFSETS, size=st.sampled_from([1, 100, 5000, 100000]))
    def mmap_read(self, i, offset, size):
        """Read through a shared read-only mapping of the open file (as ``torch.load(mmap=True)``
        and safetensors do), made and dropped in this step; only inside the file's size (past
        its last page a mapping raises SIGBUS)."""
        def mapped(fd):
            st_ = os.fstat(fd)
            if stat.S_ISDIR(st_.st_mode) or st_.st_size == 0:
                return None
            with mmap.mmap(fd, st_.st_size, access=mmap.ACCESS_READ) as m:
                return m[min(offset, st_.st_size):min(offset + size, st_.st_size)]

        self.both_fd(f"mmap read {size}@{offset}", i, mapped)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), size=SIZES)
    def ftruncate(self, i, size):
        self.do_ftruncate(i, size)

    def do_ftruncate(self, i, size):
        self.both_fd(f"ftruncate {size}", i, lambda fd: os.ftruncate(fd, size))

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), datasync=st.booleans())
    def fsync(self, i, datasync):
        self.both_fd("fsync", i, lambda fd: (os.fdatasync if datasync else os.fsync)(fd))

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50))
    def fstat(self, i):
        def look(fd):
            s = os.fstat(fd)  # a directory opened O_RDONLY too; its st_size means nothing
            return (None if stat.S_ISDIR(s.st_mode) else s.st_size, s.st_nlink, stat.S_IMODE(s.st_mode))

        self.both_fd("fstat", i, look)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50))
    def close(self, i):
        fm, fl, _, _ = self.fds.pop(i % len(self.fds))
        os.close(fm)
        os.close(fl)

    # -- the whole tree ----------------------------------------------------------------------------

    @invariant()
    def trees_agree(self):
        assert os.path.ismount(self.mount_base), "the mount is gone: the steps ran on the directory below it"
        mount, local = (snapshot(r) for r in self.roots)
        if mount != local:
            diff = {k: (mount.get(k), local.get(k)) for k in set(mount) | set(local) if mount.get(k) != local.get(k)}
            raise AssertionError(f"trees differ (mount, local): {diff}")

    def teardown(self):
        for fm, fl, _, _ in self.fds:
            os.close(fm)
            os.close(fl)
        self.fds = []


class FsModelWithRemount(FsModel):
    """The same, plus clean remounts and gateway crashes (kill -9 with all files closed and a
    directory fsynced): everything must come back as it was."""

    gateway = None

    @rule()
    def remount(self):
        self.teardown()  # handles do not survive an unmount
        assert self.gateway.stop() == 0
        self.gateway.start()

    @rule()
    def crash(self):
        # kill -9 with every file closed after an fsync of a directory, which makes every
        # namespace change and close before it durable: all of them must survive. (Without
        # the fsync, the changes of the last commit interval may be lost, as a prefix:
        # test_crash_recovery.py.)
        self.teardown()
        dfd = os.open(self.mount_base, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.gateway.kill9()
        self.gateway.start()


EVICT_XATTR = "user.ckptfs.evict"
SMALL_OFFSETS = st.sampled_from([0, 1, 100, 4095, 4096, 70000])
SMALL_SIZES = st.sampled_from([0, 1, 50, 4096, 10000])


class FsModelWithEvictions(FsModel):
    """The same on a mount whose drain uploads every closed file at once, plus "evict now" at
    any step: files that are clean and not open leave the cache as the cap would evict them
    (``user.ckptfs.evict``). Nothing the comparison sees may change; reads of evicted files
    fetch them from the bucket. (Sizes stay small: the drain uploads every file.)"""

    evictions = 0

    def mount_files(self) -> list[str]:
        return sorted(os.path.join(dirpath, name) for dirpath, _, names in os.walk(self.roots[0]) for name in names)

    @rule(pick=st.integers(0, 99), durable_first=st.booleans())
    def evict(self, pick, durable_first):
        """One of the files; ``durable_first``: an fsync first (the mount runs with
        --fsync=remote: it returns once the file is in the bucket), so that it is clean."""
        files = self.mount_files()
        if files:
            self.evict_file(files[pick % len(files)], durable_first)

    @rule()
    def close_all_and_evict(self):
        """Every file closed, made durable (fsync) and evicted: then everything reads back
        from the bucket."""
        self.teardown()  # closes every descriptor on both sides
        for target in self.mount_files():
            self.evict_file(target, durable_first=True)

    @rule()
    def evict_everything(self):
        """Every file that is clean now (the drain uploads closed files within a second)."""
        for target in self.mount_files():
            self.evict_file(target, durable_first=False)

    def evict_file(self, target: str, durable_first: bool) -> None:
        if os.path.islink(target) or not os.path.isfile(target):
            return  # (user.* attributes of a symlink are not asked for: the kernel says ENODATA)
        with contextlib.suppress(OSError):  # e.g. EACCES after a chmod 0: the comparison covers it
            if durable_first:
                fd = os.open(target, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            answer = json.loads(os.getxattr(target, EVICT_XATTR))
            FsModelWithEvictions.evictions += answer["evicted"]

    # The parent's rules, without the multi-GiB sparse offsets and sizes.
    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), offset=SMALL_OFFSETS, data=DATA)
    def pwrite(self, i, offset, data):
        self.do_pwrite(i, offset, data)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, 50), size=SMALL_SIZES)
    def ftruncate(self, i, size):
        self.do_ftruncate(i, size)

    @rule(path=PATHS, size=SMALL_SIZES)
    def truncate(self, path, size):
        self.do_truncate(path, size)


def model_settings(examples_env: str, default_examples: int, steps: int, **extra) -> settings:
    """Hypothesis settings of the mounted models: ``examples_env`` raises the example count."""
    return settings(
        max_examples=int(os.environ.get(examples_env, str(default_examples))),
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
        **extra,
    )


def test_mount_behaves_like_a_local_filesystem(shared_gateway, local_base):
    FsModel.mount_base = shared_gateway.mnt
    FsModel.local_base = local_base
    run_state_machine_as_test(
        FsModel,
        settings=model_settings("CKPTFS_MODEL_EXAMPLES", 200, 30),
    )
    assert shared_gateway.alive


def test_state_survives_remounts(gateway, local_base):
    FsModelWithRemount.gateway = gateway
    FsModelWithRemount.mount_base = gateway.mnt
    FsModelWithRemount.local_base = local_base
    run_state_machine_as_test(
        FsModelWithRemount,
        settings=model_settings("CKPTFS_MODEL_REMOUNT_EXAMPLES", 15, 20),
    )
    assert gateway.alive


def test_evictions_at_any_step_change_nothing_the_mount_shows(gateway_factory, tmp_path, local_base):
    config = tmp_path / "ckptfs.toml"
    config.write_text('[drain]\nsettle_seconds = 0\n')
    gw = gateway_factory(extra_args=("--config", str(config), "--fsync", "remote"))
    FsModelWithEvictions.mount_base = gw.mnt
    FsModelWithEvictions.local_base = local_base
    FsModelWithEvictions.evictions = 0
    run_state_machine_as_test(
        FsModelWithEvictions,
        settings=model_settings("CKPTFS_MODEL_EVICT_EXAMPLES", 40, 30,
                                # the same examples every run
                                derandomize=not os.environ.get("CKPTFS_MODEL_EVICT_RANDOM")),
    )
    # (Open and not yet uploaded files are refused, as they must be: most attempts evict nothing.)
    assert FsModelWithEvictions.evictions > 0, "no step evicted anything: the model tests nothing new"
    assert gw.alive
    assert not gw.unexpected(), "gateway logged unexpected errors:\n" + gw.log()[-12000:]

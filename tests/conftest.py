"""Shared fixtures: the filesystem core without FUSE, real mounts, fsmeta checks.

Mounted tests start ``ckptfs mount --foreground`` in its own session (so the
gateway and its drain form one process group that a crash test can kill -9),
wait until the mountpoint is mounted, and unmount with ``fusermount3 -u`` in
teardown, killing the group if it does not go away. They are skipped, with the
reason, only where FUSE is not usable.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckptfs.fsmeta import MetaStore, ROOT_INO  # noqa: E402
from ckptfs.fsmeta.check import fsmeta_problems as product_fsmeta_problems  # noqa: E402
from ckptfs.gateway.core import Caller, FsCore  # noqa: E402
from ckptfs.gateway.errors import FsError  # noqa: E402

# -- FUSE availability ----------------------------------------------------------------------


def fuse_unavailable_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this environment)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not accessible to this user"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed"
    return None


FUSE_SKIP = fuse_unavailable_reason()
needs_fuse = pytest.mark.skipif(FUSE_SKIP is not None, reason=FUSE_SKIP or "")


def ckptfs_cmd() -> list[str]:
    script = Path(sys.executable).parent / "ckptfs"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "ckptfs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- renameat2 ------------------------------------------------------------------------------

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def renameat2(old: str | bytes, new: str | bytes, flags: int = 0) -> None:
    """rename(2) with flags (RENAME_NOREPLACE, RENAME_EXCHANGE), via libc."""
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), ctypes.c_uint(flags))
    else:  # glibc < 2.28: raw syscall (x86_64: 316, aarch64: 276)
        nr = 316 if os.uname().machine == "x86_64" else 276
        rc = _libc.syscall(nr, _AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), ctypes.c_uint(flags))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(old), None, os.fsdecode(new))


class _Dirent(ctypes.Structure):
    _fields_ = [
        ("d_ino", ctypes.c_uint64),
        ("d_off", ctypes.c_int64),
        ("d_reclen", ctypes.c_ushort),
        ("d_type", ctypes.c_ubyte),
        ("d_name", ctypes.c_char * 256),
    ]


_libc.opendir.restype = ctypes.c_void_p
_libc.opendir.argtypes = [ctypes.c_char_p]
_libc.readdir.restype = ctypes.POINTER(_Dirent)
_libc.readdir.argtypes = [ctypes.c_void_p]
_libc.closedir.argtypes = [ctypes.c_void_p]


def raw_readdir(path: str) -> list[bytes]:
    """Every name readdir(3) returns, including any ``.``/``..`` (os.listdir hides them)."""
    d = _libc.opendir(os.fsencode(path))
    if not d:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    names = []
    try:
        while True:
            ent = _libc.readdir(d)
            if not ent:
                break
            names.append(ent.contents.d_name)
    finally:
        _libc.closedir(d)
    return names


# -- the core without FUSE --------------------------------------------------------------------

ROOT = ROOT_INO
ROOT_CALLER = Caller(uid=0, gid=0, umask=0o022)


class CoreEnv:
    """An FsCore on a fresh cache directory; ``reopen()`` simulates a gateway restart."""

    def __init__(self, cache_dir: Path, key_prefix: str = ""):
        self.cache_dir = cache_dir
        self.key_prefix = key_prefix
        self.meta: MetaStore | None = None
        self.core: FsCore | None = None
        self.open()

    def open(self) -> FsCore:
        self.meta = MetaStore(str(self.cache_dir / "meta"))
        self.core = FsCore(str(self.cache_dir), self.meta, key_prefix=self.key_prefix)
        return self.core

    def close(self) -> None:
        if self.core is not None:
            for of in list(self.core._open.values()):
                with contextlib.suppress(OSError):
                    os.close(of.fd)
            self.core = None
        if self.meta is not None:
            self.meta.close()
            self.meta = None

    def reopen(self, recover: bool = True) -> FsCore:
        """Drop all in-memory state (handles, lookup counts) as a crash would, and start again."""
        self.close()
        core = self.open()
        if recover:
            core.recover()
        return core


@pytest.fixture
def core_env(tmp_path):
    env = CoreEnv(tmp_path / "cache")
    yield env
    env.close()


@pytest.fixture
def core(core_env) -> FsCore:
    return core_env.core


# -- fsmeta consistency --------------------------------------------------------------------------


def fsmeta_problems(meta: MetaStore) -> list[str]:
    """Invariants of fsmeta.schema that any committed state must satisfy (the product's checker)."""
    return product_fsmeta_problems(meta)


def check_cache_dir(cache_dir: str | Path) -> list[str]:
    """Open a cache directory's fsmeta (read-mostly) and list invariant violations."""
    meta = MetaStore(os.path.join(str(cache_dir), "meta"), create=False)
    try:
        return fsmeta_problems(meta)
    finally:
        meta.close()


# -- real mounts ---------------------------------------------------------------------------------


# What the gateway logs when a handler hit a bug (answered EIO) or its main loop died. The drain
# shares the log file but is someone else's process: its own tracebacks are not counted here.
UNEXPECTED_MARKERS = ("failed unexpectedly", "main loop ended with an error")


def in_mount_table(path: str | Path) -> bool:
    """True if path is a mountpoint, also when its FUSE daemon died (os.path.ismount says False then)."""
    target = os.path.abspath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def lazy_unmount(path: str | Path) -> None:
    if in_mount_table(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


def make_public_dir(prefix: str) -> Path:
    """A temp dir every user can traverse (the pytest tmp_path root is 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


_STARTED: list["Gateway"] = []


def _kill_leftover_gateways() -> None:
    """Last resort at interpreter exit (an interrupted run): no gateway may outlive the tests."""
    for gw in _STARTED:
        if gw.alive:
            gw.kill9()
        lazy_unmount(gw.mnt)


atexit.register(_kill_leftover_gateways)


# The gateway's data paths (``--data-path``). Mounted test modules that must hold in both
# define a module-scoped ``data_path`` fixture over DATA_PATHS (see ``both_data_paths``);
# elsewhere mounts run the writeback path, as ``data_path`` below says.
DATA_PATHS = ["writeback", "passthrough"]

# How the mounts take FUSE requests (``--fuse-io-uring``): /dev/fuse alone unless
# CKPTFS_TEST_FUSE_IO_URING says otherwise (``on`` runs every mounted test through the io_uring
# queues; the fuse module's enable_uring parameter must be on). Not left to ``auto``, so that what
# the suite runs does not depend on the machine. tests/test_mount_io_uring.py covers the queues
# in the default run.
FUSE_IO_URING = os.environ.get("CKPTFS_TEST_FUSE_IO_URING", "off")


def both_data_paths(request) -> str:
    """Body of a module's ``data_path`` fixture parametrized over DATA_PATHS."""
    return request.param


@pytest.fixture(scope="module")
def data_path() -> str:
    return "writeback"


class Gateway:
    """One ``ckptfs mount --foreground`` process (group) and its directories."""

    def __init__(self, base: Path, *, cache: Path | None = None, bucket: Path | None = None,
                 mnt: Path | None = None, extra_args: tuple = (), data_path: str | None = "writeback"):
        self.base = base
        self.data_path = data_path  # --data-path; None: the setting's default (auto)
        self.cache = cache or base / "cache"
        self.bucket = bucket or base / "bucket"
        self.mnt = mnt or base / "mnt"
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.metrics_port = free_port()
        self.log_path = base / "gateway.log"
        # The drain runs (the mount starts it) but uploads nothing during a test unless the test
        # passes its own --config: tests must not depend on it, and it must not copy multi-GiB
        # sparse test files into the bucket directory.
        self.config = base / "ckptfs-test.toml"
        # (part_size: the drain pre-hashes settling files larger than a part; with parts of
        # 5 GiB it leaves the tests' sparse multi-GiB files alone.)
        self.config.write_text('[drain]\nsettle_seconds = 3600\npart_size = "5GiB"\n')
        self.bucket.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.mnt.chmod(0o755)
        self.runs = 0
        self.expect_unexpected = False  # a test that provokes handler errors on purpose sets this

    @property
    def url(self) -> str:
        return f"file://{self.bucket}"

    def argv(self) -> list[str]:
        config = [] if "--config" in self.extra_args else ["--config", str(self.config)]
        return [*ckptfs_cmd(), "mount", self.url, str(self.mnt), "--cache-dir", str(self.cache),
                "--foreground", "--metrics-addr", f"127.0.0.1:{self.metrics_port}", *config, *self.mode_args(),
                *self.extra_args]

    def mode_args(self) -> list[str]:
        args = [] if "--fuse-io-uring" in self.extra_args else ["--fuse-io-uring", FUSE_IO_URING]
        if self.data_path is None or "--data-path" in self.extra_args:
            return args
        return [*args, "--data-path", self.data_path]

    def start(self, timeout: float = 30.0) -> "Gateway":
        self.runs += 1
        log = open(self.log_path, "ab")
        log.write(f"--- start #{self.runs}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True, cwd=str(REPO))
        log.close()
        if self not in _STARTED:
            _STARTED.append(self)
        deadline = time.monotonic() + timeout
        while not self.serving():
            if self.proc.poll() is not None:
                mounts = [line for line in open("/proc/self/mounts") if str(self.mnt) in line]
                try:
                    below = os.listdir(self.mnt)
                except OSError as exc:
                    below = repr(exc)
                raise RuntimeError(f"gateway exited with {self.proc.returncode} (mount table: {mounts}, "
                                   f"mountpoint shows {below}):\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill9()
                raise RuntimeError(f"gateway did not mount within {timeout}s:\n{self.log()}")
            time.sleep(0.02)
        return self

    def serving(self) -> bool:
        """Mounted by a live gateway.

        After a crash the dead mount still looks mounted to ``ismount`` (stat is answered
        from the kernel's attribute cache) but fails statfs with ENOTCONN. statfs comes
        first: checked the other way round, the new gateway could lazily unmount the dead
        mount between the two calls, statfs would then succeed on the empty directory
        below, and the test would write there before the new mount exists.
        """
        try:
            os.statvfs(self.mnt)
        except OSError:
            return False
        return os.path.ismount(self.mnt)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def unexpected(self) -> list[str]:
        if self.expect_unexpected:
            return []
        return [line for line in self.log().splitlines() if any(m in line for m in UNEXPECTED_MARKERS)]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """Unmount with fusermount3 -u; kill the process group if it does not exit."""
        if self.proc is None:
            return None
        if os.path.ismount(self.mnt):
            for _ in range(50):
                r = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True, text=True)
                if r.returncode == 0 or not os.path.ismount(self.mnt):
                    break
                time.sleep(0.1)  # EBUSY: a test process may still be closing files
            else:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            rc = None
        self._reap_group()
        self.proc = None
        lazy_unmount(self.mnt)  # a crashed gateway leaves a dead (ENOTCONN) mount
        return rc

    def kill9(self) -> None:
        """Crash: SIGKILL the gateway's whole process group (gateway + drain)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._reap_group()

    def _reap_group(self) -> None:
        """Wait until nothing of the group (a drain) is left running; zombies do not count."""
        if self.proc is None:
            return
        deadline = time.monotonic() + 10
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            if group_members(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def clear_dead_mount(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


def remove_base(base: Path) -> None:
    """Remove a test's directories, unless CKPTFS_TEST_KEEP is set (to read gateway.log)."""
    if os.environ.get("CKPTFS_TEST_KEEP"):
        print(f"\nkept {base}")
        return
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def gateway_factory(data_path):
    """Make Gateways in world-traversable temp dirs; stop them all at teardown.

    They run the module's ``data_path`` unless a test passes its own."""
    made: list[Gateway] = []
    bases: list[Path] = []

    def make(*, start: bool = True, **kwargs) -> Gateway:
        if FUSE_SKIP:
            pytest.skip(FUSE_SKIP)
        base = make_public_dir("ckptfs-test-")
        bases.append(base)
        kwargs.setdefault("data_path", data_path)
        gw = Gateway(base, **kwargs)
        made.append(gw)
        if start:
            gw.start()
        return gw

    yield make
    for gw in made:
        gw.stop()
        lazy_unmount(gw.mnt)
    for base in bases:
        remove_base(base)


def gateway_under_cache_pressure(gateway_factory, config_dir: Path, *, cap: int, high: float, low: float,
                                 drain: str = "") -> Gateway:
    """A gateway whose drain uploads files as soon as they settle (0.1 s) and whose cache is capped
    at ``cap`` bytes: clean files are evicted from ``high`` down to ``low`` of it, and writers
    wait for room (never ENOSPC). ``drain``: more lines of the [drain] table."""
    config = config_dir / "ckptfs.toml"
    config.write_text(f'[drain]\nsettle_seconds = 0.1\n{drain}'
                      f'[cache]\nmax_size = {cap}\nhigh_watermark = {high}\nlow_watermark = {low}\n'
                      'backpressure_timeout = 300\n')
    return gateway_factory(extra_args=("--config", str(config)))


@pytest.fixture
def gateway(gateway_factory) -> Gateway:
    """A fresh mount; teardown fails the test if the gateway logged an unexpected exception."""
    gw = gateway_factory()
    yield gw
    gw.stop()
    bad = gw.unexpected()
    assert not bad, "gateway logged unexpected errors:\n" + gw.log()[-12000:]


@pytest.fixture(scope="module")
def shared_gateway(data_path):
    """One mount per test module and data path (mounting costs ~0.5 s); tests work in their
    own subdirectory."""
    if FUSE_SKIP:
        pytest.skip(FUSE_SKIP)
    base = make_public_dir("ckptfs-test-")
    gw = Gateway(base, data_path=data_path).start()
    yield gw
    gw.stop()
    bad = gw.unexpected()
    log = gw.log()
    remove_base(base)
    assert not bad, "gateway logged unexpected errors:\n" + log[-12000:]


@pytest.fixture
def mnt(shared_gateway, request) -> Path:
    """A fresh, world-writable directory on the module's shared mount."""
    assert shared_gateway.alive, "the gateway died:\n" + shared_gateway.log()[-4000:]
    path = shared_gateway.mnt / request.node.name.replace("[", "_").replace("]", "_")[:100]
    path.mkdir()
    path.chmod(0o777)
    return path


def tree(root: Path) -> dict:
    """{relative path: bytes | 'dir' | ('link', target)} of a directory tree."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = Path(dirpath, d)
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            else:
                out[str(p.relative_to(root))] = "dir"
        for f in filenames:
            p = Path(dirpath, f)
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            else:
                out[str(p.relative_to(root))] = p.read_bytes()
    return out


def poll(what: str, check, timeout: float = 30.0, interval: float = 0.05):
    """Call ``check`` until it returns a true value, and return it; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(interval)


def fs_errno(fn, *args) -> int | None:
    """The errno of the FsError ``fn(*args)`` raises (None if it succeeds): the core's answer."""
    try:
        fn(*args)
    except FsError as exc:
        return exc.errno
    return None


def errno_of(fn, *args, **kwargs) -> int | None:
    """Call fn; return the errno it raised (None if it succeeded)."""
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno
    return None


def run_as(uid: int, gid: int, code: str, *, umask: int = 0o022, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python code as another user (no supplementary groups)."""
    prelude = f"import os, sys, errno, json\nos.umask({umask:#o})\n"
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-c", prelude + code],
        capture_output=True, text=True, timeout=timeout, cwd="/",
    )

"""FUSE passthrough helpers: can it be used here, and backing ids for open/create replies.

With passthrough the kernel sends READ, WRITE, splice and mmap of an open file straight to a
*backing file* (here the cache file) instead of to the daemon; OPEN/CREATE, FLUSH, FSYNC,
SETATTR, GETATTR and RELEASE still reach the daemon. It needs libfuse >= 3.17, a pyfuse3 with
``native/pyfuse3-passthrough.patch`` (built by ``scripts/build-fuse.sh``), Linux >= 6.9 with
``CONFIG_FUSE_PASSTHROUGH``, and CAP_SYS_ADMIN in the initial user namespace (for the ioctls).

How a file system uses it (the patched pyfuse3 API):

- set ``enable_passthrough = True`` on its ``pyfuse3.Operations`` subclass; passthrough then
  replaces the writeback cache (the kernel refuses passthrough opens with writeback cache);
- after ``pyfuse3.init()`` and the kernel's INIT (``Operations.init`` has run),
  ``pyfuse3.passthrough_enabled()`` says whether passthrough was negotiated; if not, serve
  READ/WRITE in the daemon as before;
- in ``open``/``create``: ``bid = open_backing(fd_of_cache_file)`` and return
  ``pyfuse3.FileInfo(fh=..., backing_id=bid)``. The kernel keeps its own reference to the
  file, so the fd may be closed after ``open_backing``;
- one backing id per inode: every open of an inode while any handle is open must reuse the
  same id (mixing passthrough and plain opens of an inode fails with EIO); count handles and
  ``close_backing(bid)`` when the last one is released (``release``), not after the reply.

This module uses only the standard library and pyfuse3, and imports pyfuse3 lazily.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gzip
import os
import platform
import struct

__all__ = [
    "FUSE_DEV_IOC_BACKING_OPEN",
    "FUSE_DEV_IOC_BACKING_CLOSE",
    "probe",
    "granted",
    "direct_io_mmap_granted",
    "session_fd",
    "open_backing",
    "close_backing",
    "libfuse_version",
]

# <linux/fuse.h> (kernel uapi, also libfuse's include/fuse_kernel.h):
#   struct fuse_backing_map { int32_t fd; uint32_t flags; uint64_t padding; };
#   #define FUSE_DEV_IOC_MAGIC          229
#   #define FUSE_DEV_IOC_BACKING_OPEN   _IOW(FUSE_DEV_IOC_MAGIC, 1, struct fuse_backing_map)
#   #define FUSE_DEV_IOC_BACKING_CLOSE  _IOW(FUSE_DEV_IOC_MAGIC, 2, uint32_t)
_BACKING_MAP = struct.Struct("=iIQ")
_FUSE_DEV_IOC_MAGIC = 229


def _IOW(typ: int, nr: int, size: int) -> int:
    # asm-generic/ioctl.h (x86, arm, arm64, riscv, s390): dir<<30 | size<<16 | type<<8 | nr
    # powerpc, mips, sparc use a 3-bit direction field with _IOC_WRITE = 4 at bit 29.
    if platform.machine().startswith(("ppc", "powerpc", "mips", "sparc")):
        return (4 << 29) | (size << 16) | (typ << 8) | nr
    return (1 << 30) | (size << 16) | (typ << 8) | nr


FUSE_DEV_IOC_BACKING_OPEN = _IOW(_FUSE_DEV_IOC_MAGIC, 1, _BACKING_MAP.size)  # 0x4010e501
FUSE_DEV_IOC_BACKING_CLOSE = _IOW(_FUSE_DEV_IOC_MAGIC, 2, 4)  # 0x4004e502

_CAP_SYS_ADMIN = 21
_MIN_LIBFUSE = (3, 17)
_MIN_KERNEL = (6, 9)


def session_fd() -> int:
    """The /dev/fuse fd of the current pyfuse3 session (after ``pyfuse3.init``)."""
    import pyfuse3

    get = getattr(pyfuse3, "get_session_fd", None)
    if get is None:
        raise OSError(errno.ENOTSUP, "pyfuse3 lacks the passthrough patch (no get_session_fd)")
    try:
        return get()
    except RuntimeError as e:  # no session yet
        raise OSError(errno.ENOTCONN, f"no FUSE session: {e}") from None


def granted() -> bool:
    """Whether the kernel and the file system negotiated passthrough at INIT.

    False before INIT was handled, when ``Operations.enable_passthrough`` was not set, when the
    kernel did not offer it, or when pyfuse3 is not patched.
    """
    return _negotiated("passthrough_enabled")


def direct_io_mmap_granted() -> bool:
    """Whether the kernel allows shared mappings of files opened with direct I/O
    (FUSE_DIRECT_IO_ALLOW_MMAP, Linux >= 6.6), negotiated at INIT when the file system set
    ``Operations.enable_direct_io_mmap``. Without it ``mmap(MAP_SHARED)`` of such a file fails
    with ENODEV. False before INIT, or with a pyfuse3 that predates this part of the patch.
    """
    return _negotiated("direct_io_mmap_enabled")


def _negotiated(query: str) -> bool:
    """The answer of the patched pyfuse3's ``query()`` (False without pyfuse3 or the query)."""
    try:
        import pyfuse3
    except ImportError:
        return False
    fn = getattr(pyfuse3, query, None)
    return bool(fn()) if fn is not None else False


def open_backing(fd: int, *, fuse_fd: int | None = None) -> int:
    """Register *fd* (an open regular file) as a passthrough backing file; return its id (> 0).

    Pass the id as ``FileInfo.backing_id`` in the open/create reply; release it with
    :func:`close_backing` when the inode's last handle is released. *fd* may be closed once
    this returns. *fuse_fd* defaults to the current pyfuse3 session's fd.
    Raises OSError: EPERM without CAP_SYS_ADMIN, EOPNOTSUPP if passthrough was not negotiated,
    ELOOP if the backing file is on a filesystem stacked too deep, EBADF/EINVAL for a bad fd.
    """
    dev = session_fd() if fuse_fd is None else fuse_fd
    arg = bytearray(_BACKING_MAP.pack(fd, 0, 0))
    try:
        backing_id = fcntl.ioctl(dev, FUSE_DEV_IOC_BACKING_OPEN, arg, True)
    except OSError as e:
        raise OSError(e.errno, f"FUSE_DEV_IOC_BACKING_OPEN(fd={fd}): {os.strerror(e.errno)}") from None
    if backing_id <= 0:  # the kernel returns ids >= 1; 0 would mean "no passthrough"
        raise OSError(errno.EIO, f"FUSE_DEV_IOC_BACKING_OPEN(fd={fd}) returned {backing_id}")
    return backing_id


def close_backing(backing_id: int, *, fuse_fd: int | None = None) -> None:
    """Release a backing id from :func:`open_backing` (open files keep the backing file)."""
    dev = session_fd() if fuse_fd is None else fuse_fd
    arg = bytearray(struct.pack("=I", backing_id))
    try:
        fcntl.ioctl(dev, FUSE_DEV_IOC_BACKING_CLOSE, arg, True)
    except OSError as e:
        raise OSError(
            e.errno, f"FUSE_DEV_IOC_BACKING_CLOSE({backing_id}): {os.strerror(e.errno)}"
        ) from None


def libfuse_version() -> str | None:
    """Version of the libfuse3 that the loaded pyfuse3 extension uses (e.g. "3.17.2").

    Read from the library mapped into this process (so the rpath'd build, not the system's),
    after importing pyfuse3. None if it cannot be determined.
    """
    try:
        import pyfuse3  # noqa: F401  (maps libfuse3 into the process)
    except ImportError:
        return None
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1] if line.strip() else ""
            if "/libfuse3.so" in p and p not in paths:
                paths.append(p)
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        fn = getattr(lib, "fuse_pkgversion", None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            return fn().decode()
        fn = getattr(lib, "fuse_version", None)
        if fn is not None:
            v = fn()
            return f"{v // 100}.{v % 100}"
    return None


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.replace("-", ".").split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def _kernel_reason() -> str | None:
    rel = os.uname().release
    if _version_tuple(rel)[:2] < _MIN_KERNEL:
        return f"kernel {rel} < {'.'.join(map(str, _MIN_KERNEL))} has no FUSE passthrough"
    for path in ("/proc/config.gz", f"/boot/config-{rel}"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                conf = f.read()
        except OSError:
            continue
        if "CONFIG_FUSE_PASSTHROUGH=y" not in conf:
            return f"kernel {rel} is built without CONFIG_FUSE_PASSTHROUGH ({path})"
        return None
    return None  # unknown config: the kernel's answer comes at INIT (granted())


def _privilege_reason() -> str | None:
    try:
        with open("/proc/self/status") as f:
            cap_eff = next(int(l.split()[1], 16) for l in f if l.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return "cannot read the effective capabilities from /proc/self/status"
    if not cap_eff >> _CAP_SYS_ADMIN & 1:
        return f"no CAP_SYS_ADMIN (uid {os.geteuid()}); the backing-file ioctls need it"
    try:
        with open("/proc/self/uid_map") as f:
            first = f.read().split()
        if first[:3] != ["0", "0", "4294967295"]:
            return "running in a user namespace; passthrough needs CAP_SYS_ADMIN in the initial one"
    except OSError:
        pass
    return None


def probe() -> tuple[bool, str]:
    """Whether passthrough can be used here, before mounting: ``(ok, reason)``.

    Checks CAP_SYS_ADMIN in the initial user namespace, /dev/fuse, a pyfuse3 with the
    passthrough patch built against libfuse >= 3.17 (version read from the loaded library),
    and the kernel (version and, when readable, CONFIG_FUSE_PASSTHROUGH). The final word is
    the kernel's at INIT: :func:`granted` after mounting with ``enable_passthrough``.
    """
    reason = _privilege_reason()
    if reason:
        return False, reason
    if not os.path.exists("/dev/fuse"):
        return False, "/dev/fuse is missing"
    try:
        import pyfuse3
    except ImportError as e:
        return False, f"pyfuse3 is not importable: {e}"
    if not hasattr(pyfuse3, "HAVE_PASSTHROUGH"):
        return False, (
            f"pyfuse3 {getattr(pyfuse3, '__version__', '?')} lacks the passthrough patch "
            "(run scripts/build-fuse.sh)"
        )
    if not pyfuse3.HAVE_PASSTHROUGH:
        return False, "pyfuse3 was built against libfuse < 3.17 (run scripts/build-fuse.sh)"
    ver = libfuse_version()
    if ver is None:
        return False, "cannot tell the version of the libfuse3 loaded by pyfuse3"
    if _version_tuple(ver)[:2] < _MIN_LIBFUSE:
        return False, f"pyfuse3 loads libfuse {ver} < {'.'.join(map(str, _MIN_LIBFUSE))}"
    reason = _kernel_reason()
    if reason:
        return False, reason
    return True, f"libfuse {ver}, kernel {os.uname().release}, CAP_SYS_ADMIN"

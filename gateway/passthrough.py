"""FUSE passthrough helpers: can it be used here, and backing ids for open/create replies.

With passthrough the kernel sends READ, WRITE, splice and mmap of an open file straight to a
*backing file* (here the cache file) instead of to the daemon; OPEN/CREATE, FLUSH, FSYNC,
SETATTR, GETATTR and RELEASE still reach the daemon. It needs libfuse >= 3.17 under the
gateway's front end (``ckptfs_fuse``, built by ``scripts/build-fuse.sh``), Linux >= 6.9 with
``CONFIG_FUSE_PASSTHROUGH``, and CAP_SYS_ADMIN in the initial user namespace (for the ioctls).

How the gateway uses it:

- ``ckptfs_fuse.Session(..., passthrough=True)`` asks for it at INIT, where it replaces the
  writeback cache (the kernel refuses passthrough opens with the writeback cache);
  ``Session.passthrough_granted`` says, once INIT was handled, whether the kernel agreed; if
  not, the gateway serves READ/WRITE itself;
- in ``open``/``create``: ``bid = open_backing(fd_of_cache_file, fuse_fd=session.fd)`` and the
  reply carries ``bid``. The kernel keeps its own reference to the file, so the fd may be
  closed after ``open_backing``;
- one backing id per inode: every open of an inode while any handle is open must reuse the
  same id (mixing passthrough and plain opens of an inode fails with EIO); count handles and
  ``close_backing(bid)`` when the last one is released (``release``), not after the reply.

This module uses only the standard library, and imports ``ckptfs_fuse`` lazily.
"""

from __future__ import annotations

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


def open_backing(fd: int, *, fuse_fd: int) -> int:
    """Register *fd* (an open regular file) as a passthrough backing file; return its id (> 0).

    Pass the id as ``FileInfo.backing_id`` in the open/create reply; release it with
    :func:`close_backing` when the inode's last handle is released. *fd* may be closed once
    this returns. *fuse_fd* is the session's /dev/fuse fd (``Session.fd``).
    Raises OSError: EPERM without CAP_SYS_ADMIN, EOPNOTSUPP if passthrough was not negotiated,
    ELOOP if the backing file is on a filesystem stacked too deep, EBADF/EINVAL for a bad fd.
    """
    arg = bytearray(_BACKING_MAP.pack(fd, 0, 0))
    try:
        backing_id = fcntl.ioctl(fuse_fd, FUSE_DEV_IOC_BACKING_OPEN, arg, True)
    except OSError as e:
        raise OSError(e.errno, f"FUSE_DEV_IOC_BACKING_OPEN(fd={fd}): {os.strerror(e.errno)}") from None
    if backing_id <= 0:  # the kernel returns ids >= 1; 0 would mean "no passthrough"
        raise OSError(errno.EIO, f"FUSE_DEV_IOC_BACKING_OPEN(fd={fd}) returned {backing_id}")
    return backing_id


def close_backing(backing_id: int, *, fuse_fd: int) -> None:
    """Release a backing id from :func:`open_backing` (open files keep the backing file)."""
    arg = bytearray(struct.pack("=I", backing_id))
    try:
        fcntl.ioctl(fuse_fd, FUSE_DEV_IOC_BACKING_CLOSE, arg, True)
    except OSError as e:
        raise OSError(
            e.errno, f"FUSE_DEV_IOC_BACKING_CLOSE({backing_id}): {os.strerror(e.errno)}"
        ) from None


def libfuse_version() -> str | None:
    """Version of the libfuse3 the front end (``ckptfs_fuse``) runs on, e.g. "3.17.2"; None if
    the front end is not importable."""
    try:
        import ckptfs_fuse
    except ImportError:
        return None
    return ckptfs_fuse.LIBFUSE_VERSION


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
    return None  # unknown config: the kernel's answer comes at INIT (Session.passthrough_granted)


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

    Checks CAP_SYS_ADMIN in the initial user namespace, /dev/fuse, the front end built
    against libfuse >= 3.17, and the kernel (version and, when readable,
    CONFIG_FUSE_PASSTHROUGH). The final word is the kernel's at INIT
    (``Session.passthrough_granted``).
    """
    reason = _privilege_reason()
    if reason:
        return False, reason
    if not os.path.exists("/dev/fuse"):
        return False, "/dev/fuse is missing"
    ver = libfuse_version()
    if ver is None:
        return False, "the FUSE front end ckptfs_fuse is not importable (run scripts/build-fuse.sh)"
    if _version_tuple(ver)[:2] < _MIN_LIBFUSE:
        return False, f"the front end runs on libfuse {ver} < {'.'.join(map(str, _MIN_LIBFUSE))}"
    reason = _kernel_reason()
    if reason:
        return False, reason
    return True, f"libfuse {ver}, kernel {os.uname().release}, CAP_SYS_ADMIN"

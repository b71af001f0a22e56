"""Local-file helpers for the drain: checksums, ranged reads into reusable
buffers, gathered writes.  Everything here is *blocking* and must be called
from a worker thread (``trio.to_thread.run_sync``), never on the trio loop.

Checksum CPU cost measured on the dev VM (Xeon w/ AVX-512, SHA-NI), 64 MiB
buffers, single thread:

===============  =========
algorithm        CPU s/GiB
===============  =========
crc32c (crc32c)  0.07
crc64nvme (crt)  0.08
crc32c (awscrt)  0.10
blake3 (1 thr)   0.21
crc32 (zlib)     0.51
sha256 (OpenSSL) 0.98
md5              1.52
===============  =========
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import zlib
from collections.abc import Sequence

__all__ = [
    "Checksummer",
    "PartDigest",
    "resolve_checksum_mode",
    "checksum_factory",
    "crc32c_available",
    "read_range",
    "read_bytes",
    "BufferPool",
    "pwritev_all",
    "SourceChangedError",
    "READ_CHUNK",
]

#: chunk size for reads: big enough for few syscalls, small enough to stay in
#: L2/L3 while the checksum runs over it right after the read.
READ_CHUNK = 4 << 20


class SourceChangedError(Exception):
    """The local file is shorter than the range we were asked to read (it was
    truncated or replaced while we were uploading it)."""


# --------------------------------------------------------------------------
# checksums


def _load_crc32c():
    try:
        import crc32c as _m  # type: ignore[import-not-found]

        return lambda data, value=0: _m.crc32c(data, value)
    except ImportError:
        pass
    try:
        from awscrt import checksums as _ck  # type: ignore[import-not-found]

        return lambda data, value=0: _ck.crc32c(data, value)
    except ImportError:
        return None


def _load_crc64nvme():
    try:
        from awscrt import checksums as _ck  # type: ignore[import-not-found]

        return lambda data, value=0: _ck.crc64nvme(data, value)
    except ImportError:
        return None


_crc32c_fn = _load_crc32c()
_crc64nvme_fn = _load_crc64nvme()


def crc32c_available() -> bool:
    return _crc32c_fn is not None


class Checksummer:
    """Incremental checksum producing the base64 value S3 expects.

    ``algorithm``: S3 flexible-checksum name (``CRC32C``...) or ``MD5`` for
    Content-MD5.
    """

    __slots__ = ("algorithm", "_fn", "_value", "_nbytes", "_h")

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self._value = 0
        self._h = None
        if algorithm == "CRC32":
            self._fn, self._nbytes = zlib.crc32, 4
        elif algorithm == "CRC32C":
            if _crc32c_fn is None:
                raise ValueError("checksum crc32c needs the 'crc32c' (or 'awscrt') package")
            self._fn, self._nbytes = _crc32c_fn, 4
        elif algorithm == "CRC64NVME":
            if _crc64nvme_fn is None:
                raise ValueError("checksum crc64nvme needs the 'awscrt' package")
            self._fn, self._nbytes = _crc64nvme_fn, 8
        elif algorithm == "SHA256":
            self._fn, self._h = None, hashlib.sha256()
        elif algorithm == "MD5":
            self._fn, self._h = None, hashlib.md5(usedforsecurity=False)
        else:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._value = self._fn(data, self._value)

    def digest(self) -> bytes:
        if self._h is not None:
            return self._h.digest()
        return self._value.to_bytes(self._nbytes, "big")

    def b64(self) -> str:
        return base64.b64encode(self.digest()).decode("ascii")


class PartDigest:
    """What an UploadPart request must carry in its headers, computed before its body
    streams: the part checksum (base64) and, for signed payloads, the SHA-256 hex.

    Fed by the uploader's one hashing pass over the file (the same chunks that feed the
    whole-file BLAKE3), then :meth:`finish`-ed; the store sends the body afterwards (with
    ``sendfile``, or streamed and checked against ``checksum`` on the bytes it sends).  ``header=False``: the checksum is only
    for that local check (the store sends none)."""

    __slots__ = ("_ck", "_sha", "algorithm", "checksum", "header", "payload_sha256")

    def __init__(self, new_checksum=None, sign: bool = False, *, header: bool = True):
        self.header = header
        self._ck = new_checksum() if new_checksum is not None else None
        self._sha = hashlib.sha256() if sign else None
        self.algorithm = self._ck.algorithm if self._ck is not None else None
        self.checksum: str | None = None
        self.payload_sha256: str | None = None

    def update(self, data) -> None:
        if self._ck is not None:
            self._ck.update(data)
        if self._sha is not None:
            self._sha.update(data)

    def finish(self) -> PartDigest:
        if self._ck is not None:
            self.checksum = self._ck.b64()
        if self._sha is not None:
            self.payload_sha256 = self._sha.hexdigest()
        self._ck = self._sha = None
        return self


def resolve_checksum_mode(mode: str) -> str:
    """``auto`` -> ``crc32c`` if a fast implementation is importable else ``crc32``.
    Raises ValueError if the requested algorithm is unavailable."""
    if mode == "auto":
        return "crc32c" if _crc32c_fn is not None else "crc32"
    if mode == "crc32c" and _crc32c_fn is None:
        raise ValueError("checksum='crc32c' needs the 'crc32c' (or 'awscrt') package; use 'crc32' or install it")
    if mode == "crc64nvme" and _crc64nvme_fn is None:
        raise ValueError("checksum='crc64nvme' needs the 'awscrt' package; use 'crc32c'/'crc32' or install it")
    return mode


#: checksum mode -> S3 flexible checksum algorithm name
FLEXIBLE = {"crc32": "CRC32", "crc32c": "CRC32C", "crc64nvme": "CRC64NVME", "sha256": "SHA256"}


def checksum_factory(mode: str):
    """Return ``(flexible_algorithm_or_None, make)`` where ``make()`` builds a
    :class:`Checksummer` for the body integrity value (flexible checksum, or
    MD5 for ``md5`` mode) or is None for ``none``."""
    if mode in FLEXIBLE:
        alg = FLEXIBLE[mode]
        Checksummer(alg)  # availability check
        return alg, lambda: Checksummer(alg)
    if mode == "md5":
        return None, lambda: Checksummer("MD5")
    if mode == "none":
        return None, None
    raise ValueError(f"unresolved checksum mode {mode!r}")


# --------------------------------------------------------------------------
# buffers


def new_buffer(size: int):
    """A writable buffer of ``size`` bytes for part/PUT bodies.

    Large ones are anonymous mappings, not ``bytearray(size)``: a bytearray is
    memset to zero by CPython (a full pass over memory the kernel has just
    zeroed on first touch), which cost ~15% of the drain's CPU per fresh 64 MiB
    part buffer. Transparent huge pages (where enabled) also cut the page faults
    of first touch 512-fold. Use through ``memoryview(buf)``.
    """
    if size < (1 << 20):
        return bytearray(size)
    import mmap

    # private: a plain (shared) anonymous mapping is shmem, without transparent huge pages
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):
        pass
    return buf


class BufferPool:
    """Free list of large ``bytearray`` buffers, so that every part upload does
    not fault-in fresh anonymous memory (a fresh 64 MiB bytearray costs a page
    fault per 4 KiB on first touch).  Holds at most ``max_idle`` idle buffers."""

    def __init__(self, max_idle: int = 8):
        self.max_idle = max_idle
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> bytearray:
        with self._lock:
            best = None
            for i, b in enumerate(self._free):
                if len(b) >= size and (best is None or len(b) < len(self._free[best])):
                    best = i
            if best is not None:
                return self._free.pop(best)
        return new_buffer(size)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self.max_idle:
                self._free.append(buf)
            else:
                # replace the smallest idle buffer if this one is bigger
                small = min(range(len(self._free)), key=lambda i: len(self._free[i]), default=None)
                if small is not None and len(self._free[small]) < len(buf):
                    self._free[small] = buf

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


# --------------------------------------------------------------------------
# reads / writes


def read_range(
    src: str | os.PathLike | int,
    offset: int,
    length: int,
    out: memoryview,
    hashers: Sequence = (),
    chunk: int = READ_CHUNK,
) -> None:
    """Read exactly ``length`` bytes of ``src`` (path or fd) at ``offset`` into
    ``out[:length]`` with ``preadv``, feeding each chunk to every hasher (object
    with ``update``) right after it is read, while it is still cache-hot.
    Raises :class:`SourceChangedError` on EOF before ``length`` bytes."""
    if len(out) < length:
        raise ValueError("buffer too small")
    own = not isinstance(src, int)
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC) if own else src
    try:
        pos = 0
        while pos < length:
            n = min(chunk, length - pos)
            view = out[pos : pos + n]
            got = 0
            while got < n:
                r = os.preadv(fd, [view[got:]], offset + pos + got)
                if r == 0:
                    raise SourceChangedError(
                        f"file ended at {offset + pos + got} while reading [{offset}, {offset + length})"
                    )
                got += r
            for h in hashers:
                h.update(view)
            pos += n
    finally:
        if own:
            os.close(fd)


def read_bytes(fd: int, offset: int, length: int, hashers: Sequence = ()) -> bytes:
    """Read exactly ``length`` bytes of ``fd`` at ``offset`` into a new ``bytes`` (one
    copy from the page cache) and feed them to every hasher.  Raises
    :class:`SourceChangedError` on EOF before ``length`` bytes."""
    data = os.pread(fd, length, offset)
    if len(data) < length:  # a short read: finish it (rare), or the file ended
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(fd, length - got, offset + got)
            if not more:
                raise SourceChangedError(f"file ended at {offset + got} while reading [{offset}, {offset + length})")
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    for h in hashers:
        h.update(data)
    return data


def pwritev_all(fd: int, chunks: Sequence, offset: int) -> int:
    """Write all ``chunks`` (bytes-like) at ``offset`` with gathered ``pwritev``
    calls (handles short writes and IOV_MAX).  Returns bytes written."""
    iov_max = min(getattr(os, "IOV_MAX", 1024), 1024)
    bufs = [memoryview(c).cast("B") for c in chunks if len(c)]
    total = 0
    i = 0
    while i < len(bufs):
        batch = bufs[i : i + iov_max]
        want = sum(len(b) for b in batch)
        w = os.pwritev(fd, batch, offset + total)
        total += w
        if w == want:
            i += len(batch)
            continue
        # short write: drop fully written buffers, trim the partial one
        left = w
        while left >= len(bufs[i]):
            left -= len(bufs[i])
            i += 1
        if left:
            bufs[i] = bufs[i][left:]
    return total

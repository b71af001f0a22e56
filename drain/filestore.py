"""``file:///dir`` implementation of :class:`ckptfs.drain.store.ObjectStore`.

Layout under the root directory ``D``:

* object ``a/b/c``          -> regular file ``D/a/b/c``
* dir marker ``a/b/``        -> directory ``D/a/b`` whose metadata record has
  ``"marker": true`` (a plain directory that is not a marker is just a
  "prefix" and is not listed as an object, like in S3)
* metadata record (JSON: user metadata, etag, storage class, content type,
  tags, checksum, marker flag) in a sidecar file ``D/a/b/.ckptfs-m.c`` (and
  ``D/a/b/.ckptfs-m`` for the marker of ``a/b/``; for a name too long to take the
  prefix within NAME_MAX, ``D/a/b/.ckptfs-m#<sha256 of the name>``), recording the inode number
  of the data file it describes.  It is written after the data rename; a
  crash in between leaves the *new* object with no metadata (the record's
  inode does not match), never with wrong metadata, and the put had not
  returned so the caller retries it.

  Why sidecar files and not extended attributes: the bucket directory stays
  a plain tree of files that any tool can read, back up and copy (``cp -r``,
  ``rsync -a``, ``tar`` keep sidecars but drop xattrs unless told to), and it
  works on every filesystem users point it at: ext4/xfs, Lustre, and NFS,
  which has no user xattrs before NFSv4.2.  There is one metadata mode.

* multipart uploads: ``D/.ckptfs-multipart/<upload_id>/upload.json`` plus part
  files ``00001`` and their records ``00001.json``; complete concatenates the
  parts with ``copy_file_range`` (in-kernel, reflinks where supported) into a
  temp file that is then published like a put.
* every put/copy/complete writes a temp file ``.ckptfs-tmp.*`` in the target
  directory, fsyncs it, renames it over the key and fsyncs the directory: a
  crash never leaves a partial object.
* an object file has the permission bits of its ``mode`` metadata (the file it
  stores), plus owner read; 0644 without one.

Path components starting with ``.ckptfs-`` are reserved for sidecars, temp
files and uploads (never listed); a key using one, or with an empty, ``.`` or
``..`` component, raises :class:`~drain.store.InvalidObjectNameError`. The exceptions
are the drain's ``.ckptfs-moving/<name>`` (``MOVING_PREFIX``) and the in-flight records of
cluster commit, ``.ckptfs-inflight/<dir>/.ckptfs-node-<node>-<run>-<seq>``
(``fsmeta/cluster.py``): plain objects, listed only by a listing whose prefix starts with
them.
Limitation vs S3: a key cannot be both an object and a prefix (``a`` and
``a/b``): that raises ``StoreError(code="KeyConflict")``.

ETags are opaque: blake3 of the content (first 128 bits, hex) for puts,
``blake3(part etags)-N`` for multipart objects; copies keep the source etag.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence

import blake3
import trio

from ckptfs.fsmeta.cluster import INFLIGHT_PREFIX, RECORD_LEAF_PREFIX

from . import localio
from .store import (
    MOVING_PREFIX,
    InvalidObjectNameError,
    ListResult,
    ObjectInfo,
    ObjectStore,
    ObjectSummary,
    PartRecord,
    PutResult,
    StoreError,
    StoreLimits,
    UploadInfo,
    make_error,
    normalize_etag,
    validate_key,
    validate_metadata,
    validate_tags,
)

__all__ = ["FileStore"]

RESERVED = ".ckptfs-"
MULTIPART_DIR = ".ckptfs-multipart"
SIDECAR_PREFIX = ".ckptfs-m"
INFLIGHT_DIR = INFLIGHT_PREFIX.rstrip("/")  # in-flight records of cluster commit (fsmeta/cluster.py)


def _inflight_component(comps: list[str], i: int) -> bool:
    """``comps[i]`` is the records' reserved directory, or a record's name below it."""
    if not comps or comps[0] != INFLIGHT_DIR:
        return False
    return i == 0 or (i == len(comps) - 1 and comps[i].startswith(RECORD_LEAF_PREFIX))
SIDECAR_NAME_MAX = 255  # NAME_MAX of the filesystems a file:// bucket lives on
MOVING_DIR = MOVING_PREFIX.rstrip("/")  # the one reserved directory that holds objects (the drain's)
COPY_CHUNK = 4 << 20


def _etag_of(h) -> str:
    return h.hexdigest()[:32]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _permissions(meta: Mapping[str, str]) -> int:
    """An object file's permission bits: those of the file it stores (its ``mode``
    metadata), as a local copy would have them; the owner (the store) keeps read,
    so it can still copy the object for a rename. 0644 without a usable ``mode``."""
    try:
        mode = int(meta.get("mode", ""))
    except ValueError:
        return 0o644
    return (mode & 0o777) | 0o400


def _utc(ts: float) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc)


class _LocalError(Exception):
    """Wraps an OSError about the *local source file* (not the store), so
    that it is re-raised unchanged instead of being turned into a StoreError."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


class FileStore(ObjectStore):
    #: parts and PUTs are plain files: no size limits beyond the filesystem's;
    #: tags and storage classes are recorded in the sidecar; no bucket lifecycle
    limits = StoreLimits(min_part_size=1, max_part_size=1 << 62, max_parts=10_000, max_put_size=1 << 62)

    def __init__(self, root: str, *, checksum: str = "auto"):
        self.root = os.path.abspath(root)
        self.url = f"file://{self.root}"
        self.checksum_mode = localio.resolve_checksum_mode(checksum)
        self.checksum_algorithm, self._new_checksum = localio.checksum_factory(self.checksum_mode)
        self.multipart_root = os.path.join(self.root, MULTIPART_DIR)

    # ------------------------------------------------------------------
    # plumbing

    async def _run(self, fn, *args, op: str = "", key: str | None = None):
        def wrapped():
            try:
                return fn(*args)
            except StoreError:
                raise
            except _LocalError as e:
                raise e.original from None
            except localio.SourceChangedError:
                raise
            except FileNotFoundError as e:
                if not os.path.isdir(self.root):
                    raise make_error(f"{op}: store directory {self.root} does not exist", code="NoSuchBucket", op=op, key=key) from e
                raise make_error(f"{op}: {e}", code="NoSuchKey", op=op, key=key) from e
            except (NotADirectoryError, IsADirectoryError) as e:
                raise make_error(
                    f"{op}: key {key!r} conflicts with an existing object/prefix in {self.root} ({e.strerror})",
                    code="KeyConflict",
                    op=op,
                    key=key,
                ) from e
            except PermissionError as e:
                raise make_error(f"{op}: {e}", code="AccessDenied", op=op, key=key) from e
            except OSError as e:
                if e.errno == errno.ENAMETOOLONG:
                    raise make_error(f"{op}: key too long for the filesystem", code="KeyTooLongError", op=op, key=key, retryable=False) from e
                if e.errno == errno.EROFS:
                    raise make_error(f"{op}: {e}", code="AccessDenied", op=op, key=key) from e
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise make_error(f"{op}: {e}", code="KeyConflict", op=op, key=key) from e
                # EIO/ENOSPC/... : treat as transient (disk may be freed / remounted)
                raise make_error(f"{op}: {e}", code="InternalError", op=op, key=key, retryable=True) from e

        return await trio.to_thread.run_sync(wrapped)

    def _key_path(self, key: str, *, allow_empty: bool = False) -> str:
        validate_key(key, allow_empty=allow_empty)
        body = key[:-1] if key.endswith("/") else key
        if not body:
            if allow_empty:
                return self.root
            raise InvalidObjectNameError(f"invalid key {key!r}", key=key)
        comps = body.split("/")
        for i, c in enumerate(comps):
            if c in ("", ".", ".."):
                raise InvalidObjectNameError(
                    f"object key {key!r} has an empty, '.' or '..' component (not representable in file://)", key=key
                )
            if c.startswith(RESERVED) and not (i == 0 and c == MOVING_DIR and len(comps) == 2) \
                    and not _inflight_component(comps, i):
                raise InvalidObjectNameError(f"object key {key!r} uses the reserved name prefix {RESERVED!r}", key=key)
        return os.path.join(self.root, *comps)

    # -- metadata records --------------------------------------------------

    def _sidecar(self, path: str, is_dir: bool) -> str:
        if is_dir:
            return os.path.join(path, SIDECAR_PREFIX)
        d, n = os.path.split(path)
        side = f"{SIDECAR_PREFIX}.{n}"
        if len(os.fsencode(side)) > SIDECAR_NAME_MAX:
            # A name near NAME_MAX has no room for the prefix: its sidecar is named by a hash.
            side = f"{SIDECAR_PREFIX}#{hashlib.sha256(os.fsencode(n)).hexdigest()}"
        return os.path.join(d, side)

    def _read_rec(self, path: str, st: os.stat_result) -> dict | None:
        """The sidecar record of ``path``, or None if there is none or it
        describes another inode (a crash between data and sidecar writes)."""
        try:
            with open(self._sidecar(path, stat.S_ISDIR(st.st_mode)), "rb") as f:
                rec = json.loads(f.read())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        if rec.get("ino") != st.st_ino:
            return None
        return rec

    def _write_rec(self, path: str, st: os.stat_result, rec: dict) -> None:
        """Write the sidecar of an already-published path (``st``: its stat)."""
        rec = dict(rec, ino=st.st_ino)
        side = self._sidecar(path, stat.S_ISDIR(st.st_mode))
        self._atomic_write_small(side, json.dumps(rec, separators=(",", ":")).encode())

    def _remove_sidecar(self, path: str, is_dir: bool) -> None:
        try:
            os.unlink(self._sidecar(path, is_dir))
        except FileNotFoundError:
            pass

    def _atomic_write_small(self, path: str, data: bytes) -> None:
        d = os.path.dirname(path)
        tmp = os.path.join(d, f"{RESERVED}tmp.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, path)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        _fsync_dir(d)

    # -- directories ----------------------------------------------------------

    def _makedirs(self, d: str) -> None:
        """mkdir -p with fsync of each parent that got a new entry."""
        if os.path.isdir(d):
            return
        if not os.path.isdir(self.root):
            raise make_error(f"store directory {self.root} does not exist", code="NoSuchBucket")
        rel = os.path.relpath(d, self.root)
        cur = self.root
        for c in rel.split(os.sep):
            nxt = os.path.join(cur, c)
            try:
                os.mkdir(nxt, 0o755)
                _fsync_dir(cur)
            except FileExistsError:
                if not os.path.isdir(nxt):
                    raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", nxt) from None
            cur = nxt

    def _prune_dirs(self, d: str) -> None:
        """Remove now-empty non-marker directories up to the root."""
        while d != self.root and d.startswith(self.root + os.sep):
            try:
                st = os.stat(d)
                rec = self._read_rec(d, st)
                if rec and rec.get("marker"):
                    return
                os.rmdir(d)
            except OSError:
                return
            d = os.path.dirname(d)

    # -- publishing -----------------------------------------------------------

    def _tmp_in(self, d: str) -> tuple[str, int]:
        for attempt in range(5):
            self._makedirs(d)
            tmp = os.path.join(d, f"{RESERVED}tmp.{secrets.token_hex(8)}")
            try:
                return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                if attempt == 4:  # a concurrent delete pruned the dir; retry
                    raise
        raise AssertionError("unreachable")

    def _publish(self, tmp: str, fd: int, final: str, rec: dict) -> os.stat_result:
        """fsync the temp file, rename it over ``final``, fsync the
        directory, then write the sidecar."""
        try:
            os.fchmod(fd, _permissions(rec["meta"]))
            os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        try:
            if os.path.isdir(final):
                raise IsADirectoryError(errno.EISDIR, "a prefix (directory) is in the way", final)
            os.rename(tmp, final)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        _fsync_dir(os.path.dirname(final))
        self._write_rec(final, st, rec)
        return st

    def _new_rec(self, etag, metadata, storage_class, content_type, checksum, tags=None) -> dict:
        rec = {
            "v": 1,
            "etag": etag,
            "meta": dict(metadata or {}),
            "storage_class": storage_class or "STANDARD",
            "content_type": content_type or "binary/octet-stream",
            "tags": dict(tags or {}),
        }
        if checksum and self.checksum_algorithm:
            rec["checksum"] = {self.checksum_algorithm: checksum}
        return rec

    def _hashers(self):
        ck = self._new_checksum() if self._new_checksum else None
        b3 = blake3.blake3()
        return ck, b3, [h for h in (ck, b3) if h is not None]

    def _copy_hashing(self, src, offset: int, length: int, dst_fd: int, hashers) -> None:
        """Copy ``length`` bytes of src (path/fd) at offset to dst_fd (at its
        current position) through a 4 MiB buffer, hashing each chunk."""
        buf = bytearray(min(COPY_CHUNK, max(length, 1)))
        mv = memoryview(buf)
        pos = 0
        own = not isinstance(src, int)
        try:
            sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC) if own else src
        except OSError as e:
            raise _LocalError(e) from e
        try:
            while pos < length:
                n = min(len(buf), length - pos)
                try:
                    localio.read_range(sfd, offset + pos, n, mv, hashers, chunk=n)
                except OSError as e:
                    raise _LocalError(e) from e
                view = mv[:n]
                while view:
                    w = os.write(dst_fd, view)
                    view = view[w:]
                pos += n
        finally:
            if own:
                os.close(sfd)

    # ------------------------------------------------------------------
    # access / metadata

    async def check_access(self, *, write: bool = False) -> None:
        def chk():
            if not os.path.isdir(self.root):
                raise make_error(
                    f"cannot use store {self.url}: NoSuchBucket (directory {self.root} does not exist)", code="NoSuchBucket", op="CheckAccess"
                )
            mode = os.R_OK | os.X_OK | (os.W_OK if write else 0)
            if not os.access(self.root, mode):
                raise make_error(
                    f"cannot use store {self.url}: AccessDenied (no {'write' if write else 'read'} permission on {self.root})",
                    code="AccessDenied",
                    op="CheckAccess",
                )

        await self._run(chk, op="CheckAccess")
        if write:
            # reserved-name temp file (not a key): create + remove
            def probe_rw():
                tmp, fd = self._tmp_in(self.root)
                os.close(fd)
                os.unlink(tmp)

            await self._run(probe_rw, op="CheckAccess")

    def _stat_key(self, key: str):
        path = self._key_path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return path, None, None
        if key.endswith("/"):
            if not stat.S_ISDIR(st.st_mode):
                return path, None, None
            rec = self._read_rec(path, st)
            if not rec or not rec.get("marker"):
                return path, None, None
            return path, st, rec
        if not stat.S_ISREG(st.st_mode):
            return path, None, None
        return path, st, self._read_rec(path, st) or {}

    def _info(self, key: str, st: os.stat_result, rec: dict) -> ObjectInfo:
        is_dir = stat.S_ISDIR(st.st_mode)
        return ObjectInfo(
            key=key,
            size=0 if is_dir else st.st_size,
            etag=rec.get("etag") or f"x{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}",
            last_modified=_utc(st.st_mtime),
            storage_class=rec.get("storage_class") or "STANDARD",
            metadata=dict(rec.get("meta") or {}),
            content_type=rec.get("content_type") or "binary/octet-stream",
            checksums=dict(rec.get("checksum") or {}),
        )

    async def head(self, key: str) -> ObjectInfo | None:
        def h():
            _, st, rec = self._stat_key(key)
            return None if st is None else self._info(key, st, rec)

        return await self._run(h, op="HeadObject", key=key)

    def _walk(self, prefix: str) -> list[tuple[str, os.stat_result, str]]:
        """All (key, stat, path) with key.startswith(prefix), unsorted."""
        out = []
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = os.path.join(self.root, *base_rel.split("/")) if base_rel else self.root
        comps = [c for c in base_rel.split("/") if c]
        if base_rel != MOVING_DIR and any(c.startswith(RESERVED) and not _inflight_component(comps, i)
                                          for i, c in enumerate(comps)):
            return out  # (the drain's parked objects are listed only when asked for by name)
        if base_rel and prefix == base_rel + "/":
            # The marker of the prefix's own directory: as in S3, a key equal to the prefix is listed.
            try:
                st = os.stat(start, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return out
            rec = self._read_rec(start, st) if stat.S_ISDIR(st.st_mode) else None
            if rec and rec.get("marker"):
                out.append((prefix, st, start))
        stack = [(start, base_rel + "/" if base_rel else "")]
        while stack:
            d, rel = stack.pop()
            try:
                it = os.scandir(d)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for e in it:
                    if e.name.startswith(RESERVED) and not (rel.startswith(INFLIGHT_DIR + "/")
                                                            and e.name.startswith(RECORD_LEAF_PREFIX)):
                        continue
                    k = rel + e.name
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        dk = k + "/"
                        if dk.startswith(prefix) or prefix.startswith(dk):
                            if dk.startswith(prefix):
                                rec = self._read_rec(e.path, st)
                                if rec and rec.get("marker"):
                                    out.append((dk, st, e.path))
                            stack.append((e.path, dk))
                    elif stat.S_ISREG(st.st_mode) and k.startswith(prefix):
                        out.append((k, st, e.path))
        return out

    async def list_pages(
        self, prefix: str = "", delimiter: str | None = None, *, start_after: str | None = None
    ) -> AsyncIterator[ListResult]:
        validate_key(prefix, allow_empty=True)

        def collect():
            entries = self._walk(prefix)
            entries.sort(key=lambda t: t[0])
            items: list = []  # ObjectSummary | str (common prefix), in key order
            seen: set[str] = set()
            for k, st, path in entries:
                if start_after is not None and k <= start_after:
                    continue
                if delimiter:
                    i = k.find(delimiter, len(prefix))
                    if i >= 0:
                        cp = k[: i + len(delimiter)]
                        if cp not in seen:
                            seen.add(cp)
                            items.append(cp)
                        continue
                rec = self._read_rec(path, st) or {}
                info = self._info(k, st, rec)
                items.append(ObjectSummary(k, info.size, info.etag, info.last_modified, info.storage_class))
            return items

        items = await self._run(collect, op="ListObjects", key=prefix)
        for i in range(0, len(items), 1000):
            chunk = items[i : i + 1000]
            yield ListResult(
                [x for x in chunk if isinstance(x, ObjectSummary)], [x for x in chunk if isinstance(x, str)]
            )

    # ------------------------------------------------------------------
    # writes

    async def put_object(
        self,
        key: str,
        data,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        content_type: str | None = None,
        digest=None,  # no header to precompute: the copy hashes itself
    ) -> PutResult:
        meta = validate_metadata(metadata)
        final = self._key_path(key)
        is_marker = key.endswith("/")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = os.fspath(data)

        def put():
            ck, b3, hs = self._hashers()
            if is_marker:
                if isinstance(data, str) or memoryview(data).nbytes:
                    raise ValueError("a directory marker key (ending in '/') must have empty content")
                self._makedirs(final)
                rec = self._new_rec(_etag_of(b3), meta, storage_class, content_type, ck.b64() if ck else None)
                rec["marker"] = True
                self._write_rec(final, os.stat(final), rec)
                _fsync_dir(final)
                return PutResult(rec["etag"], checksum=ck.b64() if ck else None)
            tmp, fd = self._tmp_in(os.path.dirname(final))
            try:
                if isinstance(data, str):
                    try:
                        size = os.stat(data).st_size
                    except OSError as e:
                        raise _LocalError(e) from e
                    self._copy_hashing(data, 0, size, fd, hs)
                else:
                    mv = memoryview(data).cast("B")
                    for h in hs:
                        h.update(mv)
                    while mv:
                        w = os.write(fd, mv)
                        mv = mv[w:]
            except BaseException:
                os.close(fd)
                _unlink_quiet(tmp)
                raise
            cks = ck.b64() if ck else None
            rec = self._new_rec(_etag_of(b3), meta, storage_class, content_type, cks)
            self._publish(tmp, fd, final, rec)
            return PutResult(rec["etag"], checksum=cks if self.checksum_algorithm else None)

        return await self._run(put, op="PutObject", key=key)

    def _upload_dir(self, upload_id: str) -> str:
        if not upload_id or not all(c in "0123456789abcdef" for c in upload_id):
            raise make_error(f"unknown upload id {upload_id!r}", code="NoSuchUpload", op="Multipart")
        return os.path.join(self.multipart_root, upload_id)

    def _load_upload(self, key: str, upload_id: str) -> tuple[str, dict]:
        d = self._upload_dir(upload_id)
        try:
            with open(os.path.join(d, "upload.json"), "rb") as f:
                info = json.loads(f.read())
        except (FileNotFoundError, ValueError):
            raise make_error(f"no such upload {upload_id} for {key!r}", code="NoSuchUpload", key=key) from None
        if info.get("key") != key:
            raise make_error(f"upload {upload_id} is for {info.get('key')!r}, not {key!r}", code="NoSuchUpload", key=key)
        return d, info

    async def create_multipart(
        self,
        key: str,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        content_type: str | None = None,
    ) -> str:
        meta = validate_metadata(metadata)
        self._key_path(key)
        if key.endswith("/"):
            raise ValueError("cannot multipart-upload a directory marker")
        upload_id = secrets.token_hex(16)

        def create():
            os.makedirs(self.multipart_root, exist_ok=True)
            d = self._upload_dir(upload_id)
            os.mkdir(d)
            info = {
                "key": key,
                "initiated": time.time(),
                "meta": meta,
                "storage_class": storage_class or "STANDARD",
                "content_type": content_type or "binary/octet-stream",
            }
            self._atomic_write_small(os.path.join(d, "upload.json"), json.dumps(info).encode())
            return upload_id

        return await self._run(create, op="CreateMultipartUpload", key=key)

    async def upload_part(self, key, upload_id, part_number, path, offset, length, *, digest=None) -> PartRecord:
        if not 1 <= part_number <= self.limits.max_parts:
            raise ValueError(f"part number {part_number} out of range 1..{self.limits.max_parts}")
        src = os.fspath(path)

        def up():
            d, _ = self._load_upload(key, upload_id)
            name = f"{part_number:05d}"
            ck, b3, hs = self._hashers()
            tmp = os.path.join(d, f"{RESERVED}tmp.{secrets.token_hex(8)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                self._copy_hashing(src, offset, length, fd, hs)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                _unlink_quiet(tmp)
                raise
            os.close(fd)
            rec = PartRecord(part_number, _etag_of(b3), length, ck.b64() if ck and self.checksum_algorithm else None)
            os.rename(tmp, os.path.join(d, name))
            self._atomic_write_small(os.path.join(d, name + ".json"), json.dumps(rec.to_dict()).encode())
            return rec

        return await self._run(up, op="UploadPart", key=key)

    def _parts_sync(self, d: str) -> dict[int, PartRecord]:
        out = {}
        for n in os.listdir(d):
            if n.endswith(".json") and n[:-5].isdigit():
                try:
                    with open(os.path.join(d, n), "rb") as f:
                        p = PartRecord.from_dict(json.loads(f.read()))
                except (FileNotFoundError, ValueError):
                    continue
                if os.path.exists(os.path.join(d, n[:-5])):
                    out[p.number] = p
        return out

    async def complete_multipart(self, key, upload_id, parts: Sequence[PartRecord]) -> PutResult:
        if not parts:
            raise ValueError("complete_multipart needs at least one part")
        final = self._key_path(key)
        wanted = sorted(parts, key=lambda p: p.number)
        if len({p.number for p in wanted}) != len(wanted):
            raise make_error("duplicate part numbers", code="InvalidPartOrder", key=key)

        def complete():
            d, info = self._load_upload(key, upload_id)
            have = self._parts_sync(d)
            for p in wanted:
                hp = have.get(p.number)
                if hp is None or hp.etag != normalize_etag(p.etag):
                    raise make_error(f"part {p.number} of upload {upload_id} missing or etag mismatch", code="InvalidPart", key=key)
            tmp, fd = self._tmp_in(os.path.dirname(final))
            try:
                for p in wanted:
                    with open(os.path.join(d, f"{p.number:05d}"), "rb") as pf:
                        _copy_fd(pf.fileno(), fd, have[p.number].size)
            except BaseException:
                os.close(fd)
                _unlink_quiet(tmp)
                raise
            b3 = blake3.blake3()
            for p in wanted:
                b3.update(bytes.fromhex(have[p.number].etag))
            etag = f"{_etag_of(b3)}-{len(wanted)}"
            rec = self._new_rec(etag, info.get("meta"), info.get("storage_class"), info.get("content_type"), None)
            self._publish(tmp, fd, final, rec)
            shutil.rmtree(d, ignore_errors=True)
            return PutResult(etag)

        return await self._run(complete, op="CompleteMultipartUpload", key=key)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        def abort():
            try:
                d, _ = self._load_upload(key, upload_id)
            except StoreError:
                return
            shutil.rmtree(d, ignore_errors=True)

        await self._run(abort, op="AbortMultipartUpload", key=key)

    async def list_multipart_uploads(self, prefix: str = "") -> list[UploadInfo]:
        def lst():
            out = []
            try:
                names = os.listdir(self.multipart_root)
            except FileNotFoundError:
                return out
            for uid in names:
                try:
                    with open(os.path.join(self.multipart_root, uid, "upload.json"), "rb") as f:
                        info = json.loads(f.read())
                except (FileNotFoundError, NotADirectoryError, ValueError):
                    continue
                if info["key"].startswith(prefix):
                    out.append(UploadInfo(info["key"], uid, _utc(info["initiated"])))
            out.sort(key=lambda u: (u.key, u.initiated))
            return out

        return await self._run(lst, op="ListMultipartUploads")

    async def list_parts(self, key: str, upload_id: str) -> list[PartRecord]:
        def lp():
            d, _ = self._load_upload(key, upload_id)
            return sorted(self._parts_sync(d).values(), key=lambda p: p.number)

        return await self._run(lp, op="ListParts", key=key)

    async def copy(
        self,
        src_key: str,
        dst_key: str,
        metadata: Mapping[str, str] | None = None,
        *,
        storage_class: str | None = None,
        if_match: str | None = None,
    ) -> PutResult:
        meta = None if metadata is None else validate_metadata(metadata)
        dst = self._key_path(dst_key)
        if src_key.endswith("/") or dst_key.endswith("/"):
            raise ValueError("copy of directory markers is not supported")

        def cp():
            src, st, rec = self._stat_key(src_key)
            if st is None:
                raise make_error(f"copy source {src_key!r} does not exist", code="NoSuchKey", op="CopyObject", key=src_key)
            etag = self._info(src_key, st, rec).etag
            if if_match is not None and normalize_etag(if_match) != etag:
                raise make_error(f"copy source {src_key!r} changed", code="PreconditionFailed", op="CopyObject", key=src_key)
            new = dict(rec) if rec else self._new_rec(etag, {}, None, None, None)
            new["etag"] = etag
            if meta is not None:
                new["meta"] = meta
            new["storage_class"] = storage_class or "STANDARD"  # S3 CopyObject semantics
            tmp, fd = self._tmp_in(os.path.dirname(dst))
            try:
                with open(src, "rb") as sf:
                    if os.fstat(sf.fileno()).st_ino != st.st_ino:
                        raise make_error("copy source replaced concurrently", code="PreconditionFailed", key=src_key)
                    _copy_fd(sf.fileno(), fd, st.st_size)
            except BaseException:
                os.close(fd)
                _unlink_quiet(tmp)
                raise
            self._publish(tmp, fd, dst, new)
            return PutResult(etag)

        return await self._run(cp, op="CopyObject", key=dst_key)

    def _delete_sync(self, key: str) -> None:
        path = self._key_path(key)
        if key.endswith("/"):
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                return
            if not stat.S_ISDIR(st.st_mode):
                return
            self._remove_sidecar(path, True)
            self._prune_dirs(path)
            return
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        if not stat.S_ISREG(st.st_mode):
            return
        os.unlink(path)
        self._remove_sidecar(path, False)
        _fsync_dir(os.path.dirname(path))
        self._prune_dirs(os.path.dirname(path))

    async def delete_many(self, keys: Iterable[str]) -> dict[str, StoreError]:
        keys = list(keys)
        for k in keys:
            self._key_path(k)

        def dm():
            failed = {}
            for k in keys:
                try:
                    self._delete_sync(k)
                except OSError as e:
                    failed[k] = make_error(f"DeleteObjects: {e}", code="InternalError", key=k, retryable=True)
            return failed

        return await self._run(dm, op="DeleteObjects")

    # ------------------------------------------------------------------
    # reads

    def _open_for_read(self, key: str, if_match: str | None):
        path, st, rec = self._stat_key(key)
        if st is None:
            raise make_error(f"no such key {key!r}", code="NoSuchKey", op="GetObject", key=key)
        if key.endswith("/"):
            return None, 0
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        if if_match is not None:
            fst = os.fstat(fd)
            etag = self._info(key, fst, self._read_rec(path, fst) or {}).etag
            if etag != normalize_etag(if_match):
                os.close(fd)
                raise make_error(f"{key!r} changed (etag {etag})", code="PreconditionFailed", op="GetObject", key=key)
        return fd, os.fstat(fd).st_size

    async def get_range(self, key: str, start: int, end: int, *, if_match: str | None = None) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")

        def gr():
            fd, size = self._open_for_read(key, if_match)
            if fd is None:
                return b""
            try:
                e = min(end, size)
                if start >= e:
                    return b""
                out = bytearray(e - start)
                localio.read_range(fd, start, e - start, memoryview(out))
                return bytes(out)
            finally:
                os.close(fd)

        return await self._run(gr, op="GetObject", key=key)

    async def get_to_file(
        self, key: str, dest, offset: int = 0, length: int | None = None, *, file_offset: int | None = None, if_match: str | None = None
    ) -> int:
        if offset < 0 or (length is not None and length < 0):
            raise ValueError("bad range")

        def g():
            fd, size = self._open_for_read(key, if_match)
            if fd is None:
                return 0
            try:
                n = max(0, (size if length is None else min(size, offset + length)) - offset)
                own = not isinstance(dest, int)
                dfd = os.open(os.fspath(dest), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600) if own else dest
                try:
                    return _copy_range(fd, offset, dfd, offset if file_offset is None else file_offset, n)
                finally:
                    if own:
                        os.close(dfd)
            finally:
                os.close(fd)

        return await self._run(g, op="GetObject", key=key)

    # ------------------------------------------------------------------
    # tags / lifecycle

    async def get_tags(self, key: str) -> dict[str, str]:
        def gt():
            _, st, rec = self._stat_key(key)
            if st is None:
                raise make_error(f"no such key {key!r}", code="NoSuchKey", op="GetObjectTagging", key=key)
            return dict(rec.get("tags") or {})

        return await self._run(gt, op="GetObjectTagging", key=key)

    async def put_tags(self, key: str, tags: Mapping[str, str]) -> None:
        tags = validate_tags(tags)

        def pt():
            path, st, rec = self._stat_key(key)
            if st is None:
                raise make_error(f"no such key {key!r}", code="NoSuchKey", op="PutObjectTagging", key=key)
            new = dict(rec) if rec else self._new_rec(self._info(key, st, {}).etag, {}, None, None, None)
            new["tags"] = tags
            self._write_rec(path, st, new)

        await self._run(pt, op="PutObjectTagging", key=key)


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def _copy_range(sfd: int, soff: int, dfd: int, doff: int, n: int) -> int:
    """copy_file_range with a pread/pwrite fallback; returns bytes copied."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < n:
        if use_cfr:
            try:
                w = os.copy_file_range(sfd, dfd, n - done, soff + done, doff + done)
            except OSError as e:
                if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    use_cfr = False
                    continue
                raise
            if w == 0:
                break
            done += w
        else:
            chunk = os.pread(sfd, min(COPY_CHUNK, n - done), soff + done)
            if not chunk:
                break
            done += localio.pwritev_all(dfd, [chunk], doff + done)
    return done


def _copy_fd(sfd: int, dfd: int, n: int) -> None:
    """Append n bytes of sfd (from offset 0) at dfd's current position."""
    doff = os.lseek(dfd, 0, os.SEEK_CUR)
    got = _copy_range(sfd, 0, dfd, doff, n)
    if got != n:
        raise localio.SourceChangedError(f"short copy: {got} of {n} bytes")
    os.lseek(dfd, doff + n, os.SEEK_SET)

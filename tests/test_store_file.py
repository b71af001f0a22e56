"""drain.filestore: file:// object store semantics."""

from __future__ import annotations

import os
import sys

import pytest
import trio

sys.path.insert(0, os.path.dirname(__file__))

from ckptfs.drain.filestore import MULTIPART_DIR, FileStore  # noqa: E402
from ckptfs.drain.store import NoSuchUploadError, NotSupportedError, PartRecord, PreconditionFailedError, StoreError
from ckptfs.drain.factory import open_store
from ckptfs.fsmeta.settings import parse_store_url


@pytest.fixture
def store(tmp_path) -> FileStore:
    root = tmp_path / "bucket"
    root.mkdir()
    st = open_store(f"file://{root}")
    assert isinstance(st, FileStore)
    return st


def run(fn, *a):
    return trio.run(fn, *a)


def test_url_parsing():
    u = parse_store_url("s3://my-bucket/some/prefix/")
    assert (u.bucket, u.prefix) == ("my-bucket", "some/prefix/")
    assert parse_store_url("s3://my-bucket").prefix == ""
    assert parse_store_url("file:///tmp/x/").path == "/tmp/x"
    for bad, msg in [
        ("", "non-empty"),
        ("bucket/prefix", "no scheme"),
        ("gs://b/p", "unsupported"),
        ("s3://", "no bucket"),
        ("s3://a", "not a valid bucket"),
        ("s3://AKIA:Zk9SeCrEt@bucket/x", "credentials"),
        ("file://u:Zk9SeCrEt@host/x", "credentials"),
        ("s3://b:9000/x", "endpoint_url"),
        ("s3://bucket/a//b", "empty"),
        ("s3://bucket/a/../b", "'..'"),
        ("file://relative/dir", "file:///absolute"),
        ("file:///", "root"),
    ]:
        with pytest.raises(ValueError, match=msg) as ei:
            open_store(bad)
        assert "Zk9SeCrEt" not in str(ei.value)
    with pytest.raises(ValueError, match="checksum"):
        open_store("file:///tmp/x", checksum="sha1")


def test_put_head_get_metadata_roundtrip(store, tmp_path):
    async def main():
        meta = {"blake3": "ab" * 32, "mode": "33188", "uid": "1000", "gid": "1000", "mtime": "1700000000.5"}
        r = await store.put_object("run1/step1/model.pt", b"hello world", meta, storage_class="STANDARD_IA")
        info = await store.head("run1/step1/model.pt")
        assert info is not None
        assert info.size == 11 and info.etag == r.etag
        assert dict(info.metadata) == meta
        assert info.storage_class == "STANDARD_IA"
        assert await store.get_range("run1/step1/model.pt", 2, 5) == b"llo"
        assert await store.get_range("run1/step1/model.pt", 6, 100) == b"world"
        assert await store.get_range("run1/step1/model.pt", 50, 100) == b""
        assert await store.head("run1/step1/nope") is None
        assert await store.head("run1/step1") is None  # a prefix, not an object
        # overwrite replaces data and metadata atomically
        await store.put_object("run1/step1/model.pt", b"v2", {"mode": "1"})
        info2 = await store.head("run1/step1/model.pt")
        assert info2.size == 2 and dict(info2.metadata) == {"mode": "1"} and info2.etag != info.etag
        # put from a path
        src = tmp_path / "src.bin"
        src.write_bytes(os.urandom(100_000))
        await store.put_object("fromfile", src, {"a": "b"})
        assert await store.get_range("fromfile", 0, 10**9) == src.read_bytes()

    run(main)


def test_atomic_put_leaves_no_partial_object(store, tmp_path, monkeypatch):
    async def main():
        await store.put_object("k", b"old", {"v": "1"})
        src = tmp_path / "src.bin"
        src.write_bytes(b"x" * (9 << 20))
        from ckptfs.drain import filestore as fsmod

        real = fsmod.FileStore._publish

        def boom(self, *a, **kw):
            raise OSError(5, "simulated EIO before rename")

        monkeypatch.setattr(fsmod.FileStore, "_publish", boom)
        with pytest.raises(StoreError):
            await store.put_object("k", src, {"v": "2"})
        monkeypatch.setattr(fsmod.FileStore, "_publish", real)
        assert await store.get_range("k", 0, 100) == b"old"
        assert dict((await store.head("k")).metadata) == {"v": "1"}

    run(main)


def test_list_excludes_internals_and_delimiter(store):
    async def main():
        for k in ["a/1", "a/2", "a/b/3", "a/b/c/4", "ab", "z", "dir/"]:
            await store.put_object(k, b"" if k.endswith("/") else k.encode(), {"k": "v"})
        upload_id = await store.create_multipart("a/inflight", {})
        assert upload_id
        # stray temp file of a crashed writer
        open(os.path.join(store.root, "a", ".ckptfs-tmp.deadbeef"), "wb").close()

        keys = [o.key for o in (await store.list()).objects]
        assert keys == ["a/1", "a/2", "a/b/3", "a/b/c/4", "ab", "dir/", "z"]
        r = await store.list("a/", "/")
        assert [o.key for o in r.objects] == ["a/1", "a/2"]
        assert r.prefixes == ["a/b/"]
        r = await store.list("", "/")
        assert [o.key for o in r.objects] == ["ab", "z"]
        assert r.prefixes == ["a/", "dir/"]
        assert [o.key for o in (await store.list("a/b")).objects] == ["a/b/3", "a/b/c/4"]
        assert [o.key for o in (await store.list("a", start_after="a/b/3")).objects] == ["a/b/c/4", "ab"]
        assert [o.key for o in (await store.list(limit=2)).objects] == ["a/1", "a/2"]
        marker = await store.head("dir/")
        assert marker is not None and marker.size == 0 and marker.is_dir_marker
        # As in S3 (integration/test_store_get.py): a marker is listed under its own prefix,
        # which is how the bucket namespace finds out that an empty directory still exists.
        assert [o.key for o in (await store.list("dir/", limit=1)).objects] == ["dir/"]
        assert [o.key for o in (await store.list("dir/", "/")).objects] == ["dir/"]
        assert not any(".ckptfs" in k for k in keys)
        # reserved names are rejected as keys
        with pytest.raises(ValueError):
            await store.put_object(".ckptfs-multipart/x", b"")
        with pytest.raises(ValueError):
            await store.put_object("a/../etc", b"")

    run(main)


def test_delete_and_markers(store):
    async def main():
        await store.put_object("d/x/y", b"1")
        await store.put_object("d/", b"")
        await store.delete("d/x/y")
        assert not os.path.exists(os.path.join(store.root, "d", "x"))  # empty prefix dir pruned
        assert await store.head("d/") is not None  # marker dir kept
        await store.delete("d/")
        assert await store.head("d/") is None
        assert not os.path.exists(os.path.join(store.root, "d"))
        await store.delete("never/existed")  # idempotent
        await store.put_object("m1", b"1")
        await store.put_object("m2", b"2")
        assert await store.delete_many(["m1", "m2", "m3"]) == {}
        assert (await store.list()).objects == []

    run(main)


def test_key_conflict_is_permanent_error(store):
    async def main():
        await store.put_object("a", b"1")
        with pytest.raises(StoreError) as ei:
            await store.put_object("a/b", b"2")
        assert ei.value.code == "KeyConflict" and not ei.value.retryable

    run(main)


def test_multipart_complete_abort_list(store, tmp_path):
    src = tmp_path / "big.bin"
    data = os.urandom(3 * 1000 + 17)
    src.write_bytes(data)

    async def main():
        uid = await store.create_multipart("ckpt/big", {"blake3": "f" * 64}, storage_class="GLACIER_IR")
        p3 = await store.upload_part("ckpt/big", uid, 3, src, 2000, 1017)
        p1 = await store.upload_part("ckpt/big", uid, 1, src, 0, 1000)
        p2 = await store.upload_part("ckpt/big", uid, 2, src, 1000, 1000)
        assert p1.checksum and store.checksum_algorithm in ("CRC32", "CRC32C")
        assert [p.number for p in await store.list_parts("ckpt/big", uid)] == [1, 2, 3]
        ups = await store.list_multipart_uploads("ckpt/")
        assert [(u.key, u.upload_id) for u in ups] == [("ckpt/big", uid)]
        assert await store.head("ckpt/big") is None  # invisible until complete
        with pytest.raises(StoreError) as ei:
            await store.complete_multipart("ckpt/big", uid, [p1, PartRecord(2, "00" * 16, 1000)])
        assert ei.value.code == "InvalidPart"
        res = await store.complete_multipart("ckpt/big", uid, [p3, p1, p2])
        assert res.etag.endswith("-3")
        info = await store.head("ckpt/big")
        assert info.size == len(data) and info.metadata["blake3"] == "f" * 64 and info.storage_class == "GLACIER_IR"
        assert await store.get_range("ckpt/big", 0, len(data)) == data
        assert await store.list_multipart_uploads() == []
        with pytest.raises(NoSuchUploadError):
            await store.list_parts("ckpt/big", uid)
        # abort
        uid2 = await store.create_multipart("ckpt/other", {})
        await store.upload_part("ckpt/other", uid2, 1, src, 0, 10)
        await store.abort_multipart("ckpt/other", uid2)
        await store.abort_multipart("ckpt/other", uid2)  # idempotent
        assert await store.list_multipart_uploads() == []
        assert not os.listdir(os.path.join(store.root, MULTIPART_DIR))
        with pytest.raises(NoSuchUploadError):
            await store.upload_part("ckpt/other", uid2, 2, src, 0, 10)

    run(main)


def test_copy_get_to_file_tags(store, tmp_path):
    data = os.urandom(50_000)

    async def main():
        await store.put_object("src", data, {"blake3": "1" * 64, "mode": "420"})
        await store.put_tags("src", {"tier": "hot"})
        src_info = await store.head("src")
        # metadata kept by default, tags copied, storage class per S3 CopyObject
        r = await store.copy("src", "dst/copy", storage_class="STANDARD_IA")
        info = await store.head("dst/copy")
        assert info.etag == r.etag == src_info.etag
        assert dict(info.metadata) == dict(src_info.metadata) and info.storage_class == "STANDARD_IA"
        assert await store.get_tags("dst/copy") == {"tier": "hot"}
        # replace metadata in place (copy onto itself)
        await store.copy("src", "src", {"mode": "384"})
        assert dict((await store.head("src")).metadata) == {"mode": "384"}
        with pytest.raises(PreconditionFailedError):
            await store.copy("src", "x", if_match="nope")
        with pytest.raises(StoreError) as ei:
            await store.copy("missing", "x")
        assert ei.value.code == "NoSuchKey"
        # ranged download into a cache file at the same offsets
        dest = tmp_path / "cache"
        n = await store.get_to_file("dst/copy", dest, 1000, 2000)
        assert n == 2000
        got = dest.read_bytes()
        assert got[1000:3000] == data[1000:3000] and len(got) == 3000
        fd = os.open(dest, os.O_RDWR)
        try:
            assert await store.get_to_file("dst/copy", fd) == len(data)
        finally:
            os.close(fd)
        assert dest.read_bytes() == data
        with pytest.raises(PreconditionFailedError):
            await store.get_range("dst/copy", 0, 1, if_match="other")
        assert await store.get_range("dst/copy", 0, 4, if_match=info.etag) == data[:4]
        await store.put_tags("src", {"a": "1", "b": "2"})
        assert await store.get_tags("src") == {"a": "1", "b": "2"}
        assert dict((await store.head("src")).metadata) == {"mode": "384"}

    run(main)


def test_lifecycle_not_supported_and_check_access(store, tmp_path):
    async def main():
        with pytest.raises(NotSupportedError):
            await store.get_bucket_lifecycle()
        with pytest.raises(NotSupportedError):
            await store.put_bucket_lifecycle([])
        await store.check_access(write=True)
        missing = open_store(f"file://{tmp_path}/does-not-exist")
        with pytest.raises(StoreError) as ei:
            await missing.check_access()
        assert ei.value.code == "NoSuchBucket" and "does-not-exist" in str(ei.value)

    run(main)


def test_sidecar_stale_record_is_ignored(tmp_path):
    root = tmp_path / "b"
    root.mkdir()
    st = open_store(f"file://{root}")

    async def main():
        await st.put_object("k", b"v", {"m": "1"})
        assert dict((await st.head("k")).metadata) == {"m": "1"}
        # replace the data file behind the store's back: new inode -> record ignored
        os.replace(_write(root / "tmpfile", b"other"), root / "k")
        info = await st.head("k")
        assert info.size == 5 and dict(info.metadata) == {}
        assert [o.key for o in (await st.list()).objects] == ["k"]

    run(main)


def _write(p, data):
    p.write_bytes(data)
    return p


def test_objects_have_the_permission_bits_of_their_files(store, tmp_path):
    """A file:// object is readable by whom the file was readable, as a local copy would be."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100)

    def perms(key):
        return os.stat(os.path.join(store.root, key)).st_mode & 0o7777

    async def main():
        await store.put_object("private", b"secret", {"mode": str(0o100600)})
        await store.put_object("shared", b"open", {"mode": str(0o100664)})
        await store.put_object("setuid", b"x", {"mode": str(0o104750)})
        await store.put_object("no-mode", b"x", {})
        assert (perms("private"), perms("shared"), perms("setuid"), perms("no-mode")) == (0o600, 0o664, 0o750, 0o644)
        # A chmod reaches the bucket as a copy with new metadata; a rename as a copy.
        await store.copy("shared", "shared", {"mode": str(0o100640)})
        await store.copy("private", "renamed", {"mode": str(0o100600)})
        assert (perms("shared"), perms("renamed")) == (0o640, 0o600)
        uid = await store.create_multipart("big", {"mode": str(0o100600)})
        part = await store.upload_part("big", uid, 1, src, 0, 100)
        await store.complete_multipart("big", uid, [part])
        assert perms("big") == 0o600

    run(main)


def test_names_up_to_name_max_keep_their_metadata(store, tmp_path):
    """A name of up to 255 bytes is an object with its metadata: the sidecar of a name with no
    room for the sidecar prefix is named by a hash, and a copy and a delete find it too."""
    async def main():
        for name in ("s" * 245, "l" * 246, "m" * 255, "é" * 127):
            key = f"dir/{name}"
            await store.put_object(key, b"data", {"mode": "33188"})
            assert dict((await store.head(key)).metadata) == {"mode": "33188"}
            await store.copy(key, f"other/{name}", {"mode": "33261"})
            assert dict((await store.head(f"other/{name}")).metadata) == {"mode": "33261"}
            assert [o.key for o in (await store.list("dir/")).objects] == [key]
            await store.delete(key)
            await store.delete(f"other/{name}")
            assert await store.head(key) is None
        assert not (tmp_path / "bucket" / "dir").exists()  # no sidecar left behind

    run(main)

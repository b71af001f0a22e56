"""drain.s3store against a moto S3 server subprocess (aiobotocore + httpx under trio)."""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zlib

import pytest
import trio

sys.path.insert(0, os.path.dirname(__file__))

from _moto import FAKE_ENV, MotoServer, fake_aws_env, free_port, shared_server  # noqa: E402

from ckptfs.drain import localio  # noqa: E402
from ckptfs.drain.s3store import BODY_CHUNK, S3Store  # noqa: E402
from ckptfs.drain.store import MiB, NoSuchUploadError, PreconditionFailedError, StoreError  # noqa: E402
from ckptfs.drain.factory import open_store

BUCKET = "ckptfs-test"

pytestmark = pytest.mark.filterwarnings("ignore:aiobotocore's httpx backend:DeprecationWarning")


@pytest.fixture(scope="module")
def servers():
    with fake_aws_env():
        auth = MotoServer(enforce_auth=True)  # starts while the main one is readied
        try:
            main = shared_server()
            auth.wait_ready()
            main.make_bucket(BUCKET)
            yield main, auth
        finally:
            auth.stop()


@pytest.fixture
def moto(servers):
    with fake_aws_env():
        yield servers[0]


def mk(moto, url=f"s3://{BUCKET}/pfx", **kw) -> S3Store:
    st = open_store(url, endpoint_url=moto.endpoint, **kw)
    assert isinstance(st, S3Store)
    return st


def capture_headers(store: S3Store, op: str) -> list[dict]:
    seen: list[dict] = []

    def hook(request, **kwargs):
        seen.append({k.lower(): (v.decode() if isinstance(v, bytes) else v) for k, v in request.headers.items()})

    store._client.meta.events.register(f"before-send.s3.{op}", hook)
    return seen


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def test_put_head_list_get(moto):
    async def main():
        async with mk(moto, checksum="crc32") as st:
            heads = capture_headers(st, "PutObject")
            meta = {"blake3": "ab" * 32, "mode": "33188", "uid": "0", "gid": "0", "mtime": "1.5"}
            r = await st.put_object("a/b/one", b"hello world", meta)
            h = heads[-1]
            assert h["x-amz-checksum-crc32"] == b64(zlib.crc32(b"hello world").to_bytes(4, "big"))
            assert h["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
            info = await st.head("a/b/one")
            assert info.size == 11 and info.etag == r.etag and dict(info.metadata) == meta
            assert info.storage_class == "STANDARD"
            assert await st.head("a/b/missing") is None
            await st.put_object("a/two", b"2", {})
            await st.put_object("a/dir/", b"", {"mode": "16877"})
            await st.put_object("z", b"z", {}, storage_class="STANDARD_IA")
            lst = await st.list()
            assert [o.key for o in lst.objects] == ["a/b/one", "a/dir/", "a/two", "z"]
            assert lst.objects[1].is_dir_marker
            r = await st.list("a/", "/")
            assert [o.key for o in r.objects] == ["a/two"] and r.prefixes == ["a/b/", "a/dir/"]
            assert await st.get_range("a/b/one", 6, 11) == b"world"
            assert await st.get_range("a/b/one", 6, 100) == b"world"
            assert await st.get_range("a/b/one", 50, 60) == b""
            with pytest.raises(PreconditionFailedError):
                await st.get_range("a/b/one", 0, 1, if_match="0123")
            assert await st.get_range("a/b/one", 0, 5, if_match=info.etag) == b"hello"
            # the store prefix is invisible to callers but present in the bucket
            raw = moto.boto3_client().list_objects_v2(Bucket=BUCKET, Prefix="pfx/")
            assert "pfx/a/b/one" in [o["Key"] for o in raw["Contents"]]
            assert await st.delete_many([o.key for o in lst.objects] + ["never"]) == {}
            assert (await st.list()).objects == []

    trio.run(main)


def test_list_pagination(moto):
    keys = [f"many/{i:05d}" for i in range(25)]
    c = moto.boto3_client()
    for k in keys:
        c.put_object(Bucket=BUCKET, Key="pg/" + k, Body=b"")
    c.put_object(Bucket=BUCKET, Key="pg/many/sub/x", Body=b"")

    async def main():
        async with mk(moto, f"s3://{BUCKET}/pg/") as st:
            st.list_page_size = 10
            pages = [p async for p in st.list_pages("many/")]
            assert len(pages) == 3
            assert [o.key for p in pages for o in p.objects] == keys + ["many/sub/x"]
            r = await st.list("many/", "/")
            assert [o.key for o in r.objects] == keys and r.prefixes == ["many/sub/"]
            assert [o.key for o in (await st.list("many/", start_after="many/00020")).objects] == keys[21:] + [
                "many/sub/x"
            ]
            keys.append("many/sub/x")
            assert len((await st.list("many/", limit=10)).objects) == 10
            assert await st.delete_many(keys) == {}

    trio.run(main)


@pytest.mark.parametrize("mode", ["crc32", "crc32c", "md5", "sha256-signed", "none"])
def test_multipart_with_checksums(moto, tmp_path, mode):
    if mode == "crc32c" and not localio.crc32c_available():
        pytest.skip("no crc32c implementation installed (pip install crc32c)")
    data = os.urandom(10 * MiB + 123)
    src = tmp_path / "f.bin"
    src.write_bytes(data)
    sign = mode == "sha256-signed"
    checksum = "crc32" if sign else mode

    async def main():
        async with mk(moto, checksum=checksum, sign_payload=sign) as st:
            await st.open()
            heads = capture_headers(st, "UploadPart")
            uid = await st.create_multipart("big/obj", {"blake3": "c" * 64})
            ranges = [(1, 0, 5 * MiB), (2, 5 * MiB, 5 * MiB), (3, 10 * MiB, len(data) - 10 * MiB)]
            parts = []
            for n, off, ln in reversed(ranges):
                parts.append(await st.upload_part("big/obj", uid, n, src, off, ln))
            for h, (n, off, ln) in zip(heads, reversed(ranges)):
                chunk = data[off : off + ln]
                assert int(h["content-length"]) == ln
                if mode == "crc32":
                    assert h["x-amz-checksum-crc32"] == b64(zlib.crc32(chunk).to_bytes(4, "big"))
                elif mode == "crc32c":
                    ck = localio.Checksummer("CRC32C")
                    ck.update(chunk)
                    assert h["x-amz-checksum-crc32c"] == ck.b64()
                elif mode == "md5":
                    assert h["content-md5"] == b64(hashlib.md5(chunk).digest())
                    assert not any(k.startswith("x-amz-checksum") for k in h)
                elif mode == "none":
                    assert "content-md5" not in h and not any(k.startswith("x-amz-checksum") for k in h)
                if sign:
                    assert h["x-amz-content-sha256"] == hashlib.sha256(chunk).hexdigest()
                else:
                    assert h["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
            listed = await st.list_parts("big/obj", uid)
            assert [(p.number, p.etag, p.size) for p in listed] == [
                (p.number, p.etag, p.size) for p in sorted(parts, key=lambda p: p.number)
            ]
            assert ("big/obj", uid) in [(u.key, u.upload_id) for u in await st.list_multipart_uploads("big/")]
            res = await st.complete_multipart("big/obj", uid, parts)
            assert res.etag.endswith("-3")
            info = await st.head("big/obj")
            assert info.size == len(data) and info.metadata["blake3"] == "c" * 64
            if mode != "crc32":
                await st.delete("big/obj")
                return
            dest = tmp_path / "back.bin"
            assert await st.get_to_file("big/obj", dest) == len(data)
            assert dest.read_bytes() == data
            # ranged fill of a cache file at the object's offsets
            dest2 = tmp_path / "sparse.bin"
            assert await st.get_to_file("big/obj", dest2, 5 * MiB - 10, 20) == 20
            assert dest2.read_bytes()[5 * MiB - 10 :] == data[5 * MiB - 10 : 5 * MiB + 10]
            await st.delete("big/obj")
            await st.delete("big/obj")  # idempotent

    trio.run(main)


def test_abort_and_missing_upload(moto, tmp_path):
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(6 * MiB))

    async def main():
        async with mk(moto) as st:
            uid = await st.create_multipart("ab/x", {})
            await st.upload_part("ab/x", uid, 1, src, 0, 6 * MiB)
            await st.abort_multipart("ab/x", uid)
            await st.abort_multipart("ab/x", uid)  # idempotent
            assert uid not in [u.upload_id for u in await st.list_multipart_uploads()]
            with pytest.raises(NoSuchUploadError) as ei:
                await st.list_parts("ab/x", uid)
            assert ei.value.code == "NoSuchUpload" and not ei.value.retryable

    trio.run(main)


def test_copy_small_and_multipart(moto, tmp_path):
    data = os.urandom(12 * MiB + 5)
    src = tmp_path / "f.bin"
    src.write_bytes(data)

    async def main():
        # threshold lowered so that the 12 MiB object goes through UploadPartCopy
        async with mk(moto, multipart_copy_threshold=6 * MiB, copy_part_size=5 * MiB) as st:
            uid = await st.create_multipart("cp/src", {"blake3": "d" * 64, "mode": "420"})
            p1 = await st.upload_part("cp/src", uid, 1, src, 0, 6 * MiB)
            p2 = await st.upload_part("cp/src", uid, 2, src, 6 * MiB, len(data) - 6 * MiB)
            await st.complete_multipart("cp/src", uid, [p1, p2])
            await st.put_tags("cp/src", {"tier": "hot"})
            await st.put_object("cp/small", b"small", {"mode": "1"})

            await st.copy("cp/small", "cp/small2")  # metadata kept
            assert dict((await st.head("cp/small2")).metadata) == {"mode": "1"}
            await st.copy("cp/small", "cp/small", {"mode": "2"})  # metadata replaced in place
            assert dict((await st.head("cp/small")).metadata) == {"mode": "2"}

            await st.copy("cp/src", "cp/big-same-meta")
            info = await st.head("cp/big-same-meta")
            assert info.size == len(data) and info.metadata["blake3"] == "d" * 64
            assert info.etag.endswith("-3")  # 3 copied parts of 5 MiB
            assert await st.get_tags("cp/big-same-meta") == {"tier": "hot"}
            await st.copy("cp/src", "cp/big-new-meta", {"blake3": "e" * 64})
            assert dict((await st.head("cp/big-new-meta")).metadata) == {"blake3": "e" * 64}
            assert await st.get_range("cp/big-new-meta", 0, len(data)) == data
            with pytest.raises(PreconditionFailedError):
                await st.copy("cp/src", "cp/zzz", if_match="not-the-etag")
            with pytest.raises(StoreError) as ei:
                await st.copy("cp/missing", "cp/zzz")
            assert ei.value.code == "NoSuchKey"
            assert [u for u in await st.list_multipart_uploads("cp/")] == []

    trio.run(main)


def test_tags_and_lifecycle(moto):
    rules = [
        {
            "ID": "ckptfs-abort-mpu",
            "Status": "Enabled",
            "Filter": {"Prefix": "pfx/"},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 2},
        },
        {
            "ID": "ckptfs-ia",
            "Status": "Enabled",
            "Filter": {"Prefix": "pfx/old/"},
            "Transitions": [{"Days": 30, "StorageClass": "STANDARD_IA"}],
        },
    ]

    async def main():
        async with mk(moto, checksum="md5") as st:
            await st.open()
            tag_heads = capture_headers(st, "PutObjectTagging")
            del_heads = capture_headers(st, "DeleteObjects")
            await st.put_object("t/obj", b"x", {})
            assert await st.get_tags("t/obj") == {}
            await st.put_tags("t/obj", {"ckptfs-keep": "1", "step": "100"})
            assert await st.get_tags("t/obj") == {"ckptfs-keep": "1", "step": "100"}
            assert await st.get_bucket_lifecycle() == []
            await st.put_bucket_lifecycle(rules)
            got = await st.get_bucket_lifecycle()
            assert sorted(r["ID"] for r in got) == ["ckptfs-abort-mpu", "ckptfs-ia"]
            await st.put_bucket_lifecycle([])
            assert await st.get_bucket_lifecycle() == []
            assert await st.delete_many(["t/obj"]) == {}
            # md5 mode: checksum-required requests carry Content-MD5 (radosgw < 18 needs it)
            assert tag_heads and all("content-md5" in h for h in tag_heads)
            assert del_heads and all("content-md5" in h for h in del_heads)

    trio.run(main)


def test_check_access_errors(moto, servers):
    auth_server = servers[1]

    async def main():
        async with mk(moto) as st:
            await st.check_access(write=True)
            assert (await st.list(".ckptfs-probe/")).objects == []

        async with mk(moto, "s3://no-such-bucket-here/x") as st:
            with pytest.raises(StoreError) as ei:
                await st.check_access()
        e = ei.value
        assert e.code == "NoSuchBucket" and not e.retryable
        assert "no-such-bucket-here" in str(e) and moto.endpoint in str(e)

        async with open_store(f"s3://{BUCKET}", endpoint_url=auth_server.endpoint) as st:
            with pytest.raises(StoreError) as ei:
                await st.check_access()
        e = ei.value
        assert e.code == "InvalidAccessKeyId" and not e.retryable and e.status == 403
        assert FAKE_ENV["AWS_SECRET_ACCESS_KEY"] not in str(e)
        assert auth_server.endpoint in str(e) and "credentials from env" in str(e)

        dead = f"http://127.0.0.1:{free_port()}"
        async with open_store(f"s3://{BUCKET}", endpoint_url=dead, connect_timeout=2) as st:
            with pytest.raises(StoreError) as ei:
                await st.check_access()
        assert ei.value.code == "ConnectionError" and ei.value.retryable

    trio.run(main)


def test_get_to_file_dead_endpoint(tmp_path):
    """The read path's GET (presigned, read in a worker thread) to an endpoint that is not
    there: a retryable ConnectionError whose message carries no part of the presigned URL
    (its query string holds the access key id). The other answers: integration/test_store_get.py."""

    async def main():
        dead = f"http://127.0.0.1:{free_port()}"
        async with open_store(f"s3://{BUCKET}", endpoint_url=dead, connect_timeout=2) as st:
            with pytest.raises(StoreError) as ei:
                await st.get_to_file("g/obj", tmp_path / "x", 0, 10)
        assert ei.value.code == "ConnectionError" and ei.value.retryable
        assert FAKE_ENV["AWS_ACCESS_KEY_ID"] not in str(ei.value) and "Signature" not in str(ei.value)

    with fake_aws_env():
        trio.run(main)


def test_concurrent_parts_share_pool(moto, tmp_path):
    """Several part uploads in flight on one client; without a digest from the caller
    each reads its range once to checksum it, through chunk-sized pooled buffers
    (never part-sized ones), then streams it."""
    data = os.urandom(4 * 5 * MiB)
    src = tmp_path / "f.bin"
    src.write_bytes(data)

    async def main():
        async with mk(moto, concurrency=4) as st:
            uid = await st.create_multipart("conc/x", {})
            parts = []

            async def one(n):
                parts.append(await st.upload_part("conc/x", uid, n, src, (n - 1) * 5 * MiB, 5 * MiB))

            async with trio.open_nursery() as nursery:
                for n in range(1, 5):
                    nursery.start_soon(one, n)
            await st.complete_multipart("conc/x", uid, parts)
            assert await st.get_range("conc/x", 0, len(data)) == data
            free = st._chunk_pool._free
            assert 0 < len(free) <= 8 and all(len(b) == BODY_CHUNK for b in free)
            await st.delete("conc/x")

    trio.run(main)

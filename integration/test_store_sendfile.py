"""UploadPart bodies sent with ``sendfile`` (``S3Store``'s :class:`_SendfileSender`) against
the real radosgw: the object a multipart upload gives, a resumed upload, the server's
answers, and the https fallback to the streamed body."""

from __future__ import annotations

import os
import socket

import blake3
import pytest
import trio

from ckptfs.drain import localio
from ckptfs.drain.s3store import S3Store
from ckptfs.drain.store import MiB, NoSuchUploadError
from ckptfs.drain.upload import UploadOptions, digest_file, upload_file
from ckptfs.fsmeta.records import UploadRecord
from integration.s3server import S3Server

PART = 5 * MiB


def store(s3: S3Server, bucket: str, *, tls: bool = False, **kw) -> S3Store:
    kwargs = {"bucket": bucket, "prefix": "s/", "region": s3.region, "connect_timeout": 5,
              "aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key,
              "endpoint_url": s3.https_endpoint_url if tls else s3.endpoint_url}
    if tls:
        kwargs["verify_tls"] = s3.ca_bundle
    return S3Store(**{**kwargs, **kw})


def make_file(tmp_path, size: int):
    data = os.urandom(size)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(data)
    return src, data


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


async def assert_object(st: S3Store, key: str, data: bytes) -> None:
    info = await st.head(key)
    assert info.size == len(data)
    assert info.metadata["blake3"] == blake3.blake3(data).hexdigest()
    assert await st.get_range(key, 0, 10**10) == data


@pytest.mark.parametrize(("checksum", "sign"), [("crc32c", False), ("md5", False), ("crc32c", True)])
def test_multipart_upload_with_sendfile_gives_the_file_and_its_blake3(s3_server, s3_bucket, tmp_path, checksum, sign):
    # sign: the SHA-256 of the hashing pass signs each part, which radosgw verifies
    src, data = make_file(tmp_path, 3 * PART + 4321)

    async def main():
        async with store(s3_server, s3_bucket, checksum=checksum, sign_payload=sign) as st:
            res = await upload_file(st, "a/model.pt", src, {}, options=UploadOptions(part_size=PART, concurrency=3))
            assert res.multipart and res.parts == 4
            assert st._sender.parts_sent == 4
            await assert_object(st, "a/model.pt", data)

    trio.run(main)


def test_resumed_upload_with_sendfile_gives_the_file_and_its_blake3(s3_server, s3_bucket, tmp_path):
    # a drain that crashed after part 2 left the upload and its record: the next drain
    # keeps parts 1-2 (checked against ListParts) and sends the rest
    src, data = make_file(tmp_path, 4 * PART + 99)
    key = "r/opt.pt"

    async def main():
        async with store(s3_server, s3_bucket) as st:
            d = await digest_file(src, len(data), PART, st)
            upload_id = await st.create_multipart(key, {"blake3": d.blake3})
            parts = [await st.upload_part(key, upload_id, n, src, (n - 1) * PART, PART, digest=d.parts[n - 1])
                     for n in (1, 2)]
            record = UploadRecord(key=key, upload_id=upload_id, generation=1, part_size=PART, size=len(data),
                                  blake3=d.blake3, parts=[p.to_dict() for p in parts],
                                  checksum_algorithm=st.checksum_algorithm)
        async with store(s3_server, s3_bucket) as st:
            res = await upload_file(st, key, src, {}, resume=record,
                                    options=UploadOptions(part_size=PART, concurrency=2))
            assert (res.upload_id, res.parts_reused, res.parts_uploaded) == (upload_id, 2, 3)
            assert st._sender.parts_sent == 3
            await assert_object(st, key, data)

    trio.run(main)


def test_part_changed_since_hashing_is_refused_by_a_server_that_checks_it(s3_server, s3_bucket, tmp_path):
    # radosgw verifies Content-MD5 (it ignores flexible checksums): the bytes sent with
    # sendfile no longer match the digest of the hashing pass, the server refuses the
    # part, and the drain sees SourceChangedError (hash again), not an error to retry.
    src, data = make_file(tmp_path, 2 * PART)

    async def main():
        async with store(s3_server, s3_bucket, checksum="md5") as st:
            d = await digest_file(src, len(data), PART, st)
            await trio.to_thread.run_sync(overwrite, src, PART - 3, b"xyz")  # the end of part 1
            upload_id = await st.create_multipart("c/x", {"blake3": d.blake3})
            with pytest.raises(localio.SourceChangedError):
                await st.upload_part("c/x", upload_id, 1, src, 0, PART, digest=d.parts[0])
            assert await st.list_parts("c/x", upload_id) == []
            p2 = await st.upload_part("c/x", upload_id, 2, src, PART, PART, digest=d.parts[1])
            assert p2.etag and st._sender.parts_sent == 2
            await st.abort_multipart("c/x", upload_id)

    trio.run(main)


def test_error_answers_to_sendfile_parts_are_translated_as_before(s3_server, s3_bucket, tmp_path):
    src, _ = make_file(tmp_path, PART)

    async def main():
        async with store(s3_server, s3_bucket) as st:
            with pytest.raises(NoSuchUploadError) as ei:
                await st.upload_part("e/x", "no-such-upload", 1, src, 0, PART)
            assert ei.value.status == 404 and not ei.value.retryable
            # the connection that carried the error answer is still usable
            upload_id = await st.create_multipart("e/x", {})
            p = await st.upload_part("e/x", upload_id, 1, src, 0, PART)
            assert [q.etag for q in await st.list_parts("e/x", upload_id)] == [p.etag]
            await st.abort_multipart("e/x", upload_id)

    trio.run(main)


def test_https_parts_stream_through_httpx(s3_server, s3_bucket, tmp_path):
    """sendfile cannot write into a TLS socket: parts stream (and are re-checked) as before."""
    if not s3_server.https_endpoint_url:
        pytest.skip("server not started with tls=True")
    src, data = make_file(tmp_path, 2 * PART + 1)

    async def main():
        async with store(s3_server, s3_bucket, tls=True) as st:
            res = await upload_file(st, "t/x", src, {}, options=UploadOptions(part_size=PART, concurrency=2))
            assert res.parts == 3 and st._sender.parts_sent == 0
            await assert_object(st, "t/x", data)

    trio.run(main)


def test_kept_alive_connection_found_closed_is_replaced_without_an_error(s3_server, s3_bucket, tmp_path):
    """An idle kept-alive connection may have been closed (S3 drops idle ones after ~20 s):
    the part goes out on a new connection instead of failing into a retry with back-off."""
    src, data = make_file(tmp_path, 2 * PART)

    async def main():
        async with store(s3_server, s3_bucket) as st:
            upload_id = await st.create_multipart("k/x", {})
            p1 = await st.upload_part("k/x", upload_id, 1, src, 0, PART)
            idle = [conn for conns in st._sender._idle.values() for _, conn in conns]
            assert idle  # radosgw keeps connections alive
            for conn in idle:
                conn.sock.shutdown(socket.SHUT_RDWR)
            p2 = await st.upload_part("k/x", upload_id, 2, src, PART, PART)
            await st.complete_multipart("k/x", upload_id, [p1, p2])
            assert await st.get_range("k/x", 0, 10**10) == data

    trio.run(main)

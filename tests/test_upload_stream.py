"""Streamed multipart uploads (drain.upload + S3Store): one hashing pass gives the
whole-file BLAKE3 and every part's checksum; parts then go out with sendfile (or
stream through httpx, re-checked), and a file that changed since it was hashed never
gives a completed object.
Runs against a moto S3 server."""

from __future__ import annotations

import base64
import os
import sys

import blake3
import crc32c
import pytest
import trio

sys.path.insert(0, os.path.dirname(__file__))

from _moto import fake_aws_env, shared_server

from ckptfs.drain import localio
from ckptfs.drain.factory import open_store
from ckptfs.drain.store import MiB
from ckptfs.drain.upload import UploadOptions, digest_file, upload_file

BUCKET = "ckptfs-stream"

pytestmark = pytest.mark.filterwarnings("ignore:aiobotocore's httpx backend:DeprecationWarning")


@pytest.fixture(scope="module")
def s3_url():
    with fake_aws_env():
        srv = shared_server()
        srv.make_bucket(BUCKET)
        yield srv.endpoint


def crc32c_store(url: str, prefix: str):
    return open_store(f"s3://{BUCKET}/{prefix}", endpoint_url=url, checksum="crc32c")


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def test_one_hash_pass_gives_the_file_blake3_and_each_part_checksum(s3_url, tmp_path):
    # 8 MiB hash chunks against 5 MiB + 1 KiB parts: chunks must be cut at part boundaries
    ps = 5 * MiB + 1024
    data = os.urandom(3 * ps + 12345)
    src = tmp_path / "f"
    src.write_bytes(data)

    async def main():
        async with crc32c_store(s3_url, "d") as st:
            return await digest_file(src, len(data), ps, st)

    d = trio.run(main)
    assert d.blake3 == blake3.blake3(data).hexdigest()
    assert [p.checksum for p in d.parts] == [crc32c_b64(data[o:o + ps]) for o in range(0, len(data), ps)]


def test_multipart_object_has_the_file_content_and_blake3(s3_url, tmp_path):
    ps = 5 * MiB
    data = os.urandom(4 * ps + 777)
    src = tmp_path / "model.pt"
    src.write_bytes(data)

    async def main():
        async with crc32c_store(s3_url, "m") as st:
            res = await upload_file(st, "ckpt/model.pt", src, {}, options=UploadOptions(part_size=ps, concurrency=3))
            assert res.multipart and res.parts == 5
            assert st._sender.parts_sent == 5  # each part went out with sendfile
            info = await st.head("ckpt/model.pt")
            assert info.size == len(data)
            assert info.metadata["blake3"] == blake3.blake3(data).hexdigest() == res.blake3
            assert await st.get_range("ckpt/model.pt", 0, 10**9) == data

    trio.run(main)


def test_streamed_part_changed_since_it_was_hashed_never_reaches_the_server_complete(s3_url, tmp_path):
    # Where parts stream through httpx (TLS endpoints, proxies: no sendfile) the part
    # checksum header comes from the hashing pass and the body is read again as it
    # streams. If the file changed in between (same size, so nothing else notices yet),
    # the request must fail before the server has the whole part.
    ps = 5 * MiB
    src = tmp_path / "f"
    src.write_bytes(os.urandom(2 * ps))

    async def main():
        async with crc32c_store(s3_url, "c") as st:
            st.sendfile_parts = False
            d = await digest_file(src, 2 * ps, ps, st)
            await trio.to_thread.run_sync(overwrite, src, ps - 3, b"xyz")  # the end of part 1
            upload_id = await st.create_multipart("chg/x", {"blake3": d.blake3})
            with pytest.raises(localio.SourceChangedError):
                await st.upload_part("chg/x", upload_id, 1, src, 0, ps, digest=d.parts[0])
            assert await st.list_parts("chg/x", upload_id) == []
            # part 2 did not change: it goes through
            p2 = await st.upload_part("chg/x", upload_id, 2, src, ps, ps, digest=d.parts[1])
            assert p2.checksum == d.parts[1].checksum
            await st.abort_multipart("chg/x", upload_id)

    trio.run(main)


class PartOverwritingStore:
    """Delegates to a real store; rewrites a few bytes of the source (same size) just
    before part ``part`` is sent (after upload_file's hashing pass)."""

    def __init__(self, inner, src, part: int, offset: int):
        self._inner, self._src, self._part, self._offset = inner, src, part, offset

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def upload_part(self, key, upload_id, number, path, offset, length, **kw):
        if number == self._part:
            await trio.to_thread.run_sync(overwrite, self._src, self._offset, b"changed")
        return await self._inner.upload_part(key, upload_id, number, path, offset, length, **kw)


def test_file_changed_during_a_sendfile_upload_is_never_completed(s3_url, tmp_path):
    # Parts sent with sendfile are not re-read by the drain, and moto (like radosgw 16)
    # does not verify the part checksum: what keeps the changed bytes out of a completed
    # object is the stat comparison before CompleteMultipartUpload.
    ps = 5 * MiB
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 * ps))

    async def main():
        async with crc32c_store(s3_url, "sf") as st:
            changing = PartOverwritingStore(st, src, part=2, offset=ps + 100)
            with pytest.raises(localio.SourceChangedError):
                await upload_file(changing, "ckpt/x", src, {}, options=UploadOptions(part_size=ps, concurrency=1))
            assert st._sender.parts_sent >= 2  # the parts did go out with sendfile
            assert await st.head("ckpt/x") is None
            assert await st.list_multipart_uploads("ckpt/") == []  # aborted

    trio.run(main)


class OverwritingStore:
    """Delegates to a real store; rewrites part of the source just before the PUT is sent
    (after upload_file's hashing pass and stat check)."""

    def __init__(self, inner, src, offset: int):
        self._inner, self._src, self._offset = inner, src, offset

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def put_object(self, key, data, metadata=None, **kw):
        await trio.to_thread.run_sync(overwrite, self._src, self._offset, b"changed")
        return await self._inner.put_object(key, data, metadata, **kw)


def test_big_single_put_streams_and_refuses_content_changed_since_hashing(s3_url, tmp_path):
    # Above BUFFERED_PUT_MAX a single PUT is hashed, then streamed from the file: the
    # object must still be exactly what was hashed, or not be written at all.
    ps = 16 * MiB
    data = os.urandom(12 * MiB)
    src = tmp_path / "opt.pt"
    src.write_bytes(data)

    async def main():
        async with crc32c_store(s3_url, "p") as st:
            res = await upload_file(st, "ckpt/opt.pt", src, {}, options=UploadOptions(part_size=ps))
            assert not res.multipart
            info = await st.head("ckpt/opt.pt")
            assert info.metadata["blake3"] == blake3.blake3(data).hexdigest()
            assert await st.get_range("ckpt/opt.pt", 0, 10**9) == data

            with pytest.raises(localio.SourceChangedError):
                await upload_file(OverwritingStore(st, src, 9 * MiB), "ckpt/opt2.pt", src, {},
                                  options=UploadOptions(part_size=ps))
            assert await st.head("ckpt/opt2.pt") is None

    trio.run(main)

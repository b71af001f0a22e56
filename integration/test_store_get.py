"""``S3Store.get_to_file`` (the read path's GET: presigned, read in a worker thread with
urllib3) against the real radosgw, over http and https: what the fetcher relies on; and the listing
of a directory marker that the bucket namespace relies on."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.drain.s3store import S3Store
from ckptfs.drain.store import MiB, NotFoundError, PreconditionFailedError, StoreError
from integration.faultproxy import FaultProxy
from integration.s3server import S3Server
from integration.test_drain_common import proxy  # noqa: F401 - the fixture


def store(s3: S3Server, bucket: str, *, tls: bool = False, **kw) -> S3Store:
    kwargs = {"bucket": bucket, "prefix": "g/", "region": s3.region, "connect_timeout": 5,
              "aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key,
              "endpoint_url": s3.https_endpoint_url if tls else s3.endpoint_url}
    return S3Store(**{**kwargs, **kw})


def test_get_to_file_ranges_and_answers(s3_server: S3Server, s3_bucket: str, tmp_path):
    data = os.urandom(5 * MiB + 7)
    s3_server.client().put_object(Bucket=s3_bucket, Key="g/obj", Body=data)
    whole, cache = tmp_path / "whole.bin", tmp_path / "cache.bin"

    async def main():
        async with store(s3_server, s3_bucket) as st:
            info = await st.head("obj")
            assert await st.get_to_file("obj", whole) == len(data)
            assert whole.read_bytes() == data
            fd = os.open(cache, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, len(data))
                # parts landing out of order at their offsets, as the fetcher issues them
                async with trio.open_nursery() as nursery:
                    for off in range(0, len(data), 2 * MiB):
                        nursery.start_soon(lambda o=off: st.get_to_file(
                            "obj", fd, o, min(2 * MiB, len(data) - o), if_match=info.etag))
                assert os.pread(fd, len(data) + 1, 0) == data
                with pytest.raises(PreconditionFailedError):
                    await st.get_to_file("obj", fd, 0, 10, if_match="0" * 32)
                with pytest.raises(NotFoundError):
                    await st.get_to_file("missing", fd, 0, 10)
                assert await st.get_to_file("obj", fd, len(data) + 1, 10) == 0
            finally:
                os.close(fd)

        async with store(s3_server, s3_bucket, aws_secret_access_key="wrong" * 8) as st:
            with pytest.raises(StoreError) as ei:
                await st.get_to_file("obj", whole, 0, 10)
        e = ei.value
        assert e.code == "SignatureDoesNotMatch" and not e.retryable and e.status == 403
        assert s3_server.access_key not in str(e) and "wrong" * 8 not in str(e)

    trio.run(main)


def test_get_to_file_over_https(s3_server: S3Server, s3_bucket: str, tmp_path):
    """The store's CA bundle is used; a certificate it does not trust is a permanent TLSError."""
    if not s3_server.https_endpoint_url:
        pytest.skip("server not started with tls=True")
    data = os.urandom(MiB + 3)
    s3_server.client().put_object(Bucket=s3_bucket, Key="g/tls", Body=data)
    dest = tmp_path / "tls.bin"

    async def main():
        async with store(s3_server, s3_bucket, tls=True, verify_tls=s3_server.ca_bundle) as st:
            assert await st.get_to_file("tls", dest, 1, MiB + 2) == MiB + 2
        assert dest.read_bytes()[1:] == data[1:]
        async with store(s3_server, s3_bucket, tls=True) as st:  # botocore's bundle: self-signed fails
            with pytest.raises(StoreError) as ei:
                await st.get_to_file("tls", dest, 0, 10)
        assert ei.value.code == "TLSError" and not ei.value.retryable

    trio.run(main)


def _connections_to(port: int) -> int:
    """This process's TCP sockets connected to 127.0.0.1:``port`` (from /proc/self/fd)."""
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                if inode in inodes and state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def test_aclose_closes_the_get_connections(s3_server: S3Server, s3_bucket: str, tmp_path):
    """The read path's GETs keep pooled connections (urllib3, worker threads); closing the
    store closes them too, so a gateway that closes its bucket leaves no socket open."""
    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    data = os.urandom(MiB)
    s3_server.client().put_object(Bucket=s3_bucket, Key="g/obj", Body=data)

    async def main():
        st = store(s3_server, s3_bucket)
        await st.open()
        before = _connections_to(port)
        assert await st.get_to_file("obj", tmp_path / "x", 0, len(data)) == len(data)
        assert _connections_to(port) > before  # kept for the next GET
        await st.aclose()
        assert _connections_to(port) <= before  # the store object still lives: closed, not collected

    trio.run(main)


@pytest.mark.parametrize("rst", [False, True], ids=["closed", "reset"])
def test_a_body_cut_short_mid_buffer_fails_and_leaves_no_bad_connection(
        s3_server: S3Server, s3_bucket: str, proxy: FaultProxy, tmp_path, rst):
    """A GET whose body ends before its Content-Length (the server closed the connection,
    or reset it, in the middle of a receive buffer) is an error the fetcher retries, never
    a short success; the message carries no presigned URL; the next GET on the same store
    gets the whole range on a new connection (the broken one did not go back into the pool),
    while whole bodies leave theirs kept alive for the next GET."""
    data = os.urandom(5 * MiB + 7)
    s3_server.client().put_object(Bucket=s3_bucket, Key="g/cut", Body=data)
    dest = tmp_path / "cut.bin"

    async def main():
        async with store(s3_server, s3_bucket, endpoint_url=proxy.url) as st:
            assert await st.get_to_file("cut", dest, 0, MiB) == MiB
            assert await st.get_to_file("cut", dest, MiB, MiB) == MiB
            assert proxy.connections == 1  # a whole body read leaves the connection reusable
            proxy.cut("GetObject", after_bytes=3 * MiB // 2 + 5, rst=rst, count=1)
            with pytest.raises(StoreError) as ei:
                await st.get_to_file("cut", dest, 0, len(data))
            assert await st.get_to_file("cut", dest, 0, len(data)) == len(data)
            assert proxy.connections == 2  # the cut one was not reused
        return ei.value

    e = trio.run(main)
    assert e.retryable and e.code == "ConnectionError"
    assert s3_server.access_key not in str(e) and "Signature" not in str(e)
    assert dest.read_bytes() == data
    assert [r.fault for r in proxy.records() if r.op == "GetObject"].count("cut-response") == 1


def test_a_body_that_stalls_mid_way_is_a_timeout(s3_server: S3Server, s3_bucket: str, proxy: FaultProxy, tmp_path):
    """A body that stops coming for longer than ``read_timeout`` after the response's head
    (a stalled server) is a retryable Timeout, not a hang: the proxy sends the body at 4 KiB/s
    in chunks of up to 64 KiB, so 1 MiB cannot arrive without a gap longer than the timeout."""
    s3_server.client().put_object(Bucket=s3_bucket, Key="g/slow", Body=os.urandom(MiB))
    proxy.set_bandwidth(down=4 * 1024)

    async def main():
        async with store(s3_server, s3_bucket, endpoint_url=proxy.url, read_timeout=0.5) as st:
            with pytest.raises(StoreError) as ei:
                await st.get_to_file("slow", tmp_path / "slow.bin", 0, MiB)
        return ei.value

    e = trio.run(main)
    assert e.retryable and e.code == "Timeout"
    assert s3_server.access_key not in str(e) and "Signature" not in str(e)


def test_a_directory_marker_is_listed_under_its_own_prefix(s3_server: S3Server, s3_bucket: str):
    """The ``file://`` store does the same (tests/test_store_file.py): the bucket namespace
    and ``fsck --bucket`` probe ``d/`` to learn whether an empty directory still exists."""
    async def main():
        async with store(s3_server, s3_bucket) as st:
            await st.put_object("empty/", b"")
            assert [o.key for o in (await st.list("empty/", limit=1)).objects] == ["empty/"]
            assert [o.key for o in (await st.list("empty/", "/")).objects] == ["empty/"]
            await st.delete("empty/")
            listed = await st.list("empty/", limit=1)
            assert listed.objects == [] and listed.prefixes == []

    trio.run(main)

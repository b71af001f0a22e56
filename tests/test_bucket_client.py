"""The gateway's bucket client: blocking calls into a store that lives in a loop of its own."""

from __future__ import annotations

import threading

import pytest
import trio

from ckptfs.drain.filestore import FileStore
from ckptfs.gateway.bucket import BucketClient


@pytest.fixture
def bucket(tmp_path):
    root = tmp_path / "bucket"
    root.mkdir()
    with BucketClient(lambda: FileStore(str(root))) as client:
        yield client


def test_calls_from_a_plain_thread_reach_the_store(bucket):
    bucket.call(lambda store: store.put_object("ckpt/a.bin", bytes(range(256)) * 4, {"blake3": "x"}))
    info = bucket.head("ckpt/a.bin")
    assert info.size == 1024 and info.metadata["blake3"] == "x"
    assert bucket.head("ckpt/missing") is None
    listing = bucket.list("", "/")
    assert listing.prefixes == ["ckpt/"]
    assert bucket.get_range("ckpt/a.bin", 250, 260) == bytes(range(250, 256)) + bytes(range(4))


def test_calls_from_a_worker_thread_of_another_trio_loop(bucket):
    # The FUSE handlers call the core in trio worker threads of the FUSE loop.
    bucket.call(lambda store: store.put_object("k", b"hello"))

    async def main():
        return await trio.to_thread.run_sync(lambda: bucket.get_range("k", 1, 4))

    assert trio.run(main) == b"ell"


def test_submitted_calls_run_concurrently_and_report_errors(bucket):
    both_running = threading.Barrier(2, timeout=10)

    async def meet(store):
        await trio.to_thread.run_sync(both_running.wait)
        return "met"

    futures = [bucket.submit(meet) for _ in range(2)]
    assert [f.result(timeout=10) for f in futures] == ["met", "met"]

    async def fail(store):
        raise ValueError("no such thing")

    with pytest.raises(ValueError, match="no such thing"):
        bucket.submit(fail).result(timeout=10)


def test_a_store_that_cannot_open_fails_start(tmp_path):
    class Broken(FileStore):
        async def open(self):
            raise OSError("endpoint unreachable")

    client = BucketClient(lambda: Broken(str(tmp_path)))
    with pytest.raises(OSError, match="endpoint unreachable"):
        client.start()
    client.close()


def test_calls_after_close_are_refused(tmp_path):
    client = BucketClient(lambda: FileStore(str(tmp_path))).start()
    client.close()
    with pytest.raises(RuntimeError, match="not started"):
        client.head("k")

"""drain.upload.upload_file: single PUT / multipart, BLAKE3 metadata, crash +
resume (only the missing parts are sent), should_abort, source changes.
Runs against the file:// store and against a moto S3 server."""

from __future__ import annotations

import os
import sys

import blake3
import pytest
import trio

sys.path.insert(0, os.path.dirname(__file__))

from _moto import fake_aws_env, shared_server  # noqa: E402

from ckptfs.drain import localio  # noqa: E402
from ckptfs.drain.store import MiB  # noqa: E402
from ckptfs.drain.factory import open_store
from ckptfs.drain.upload import UploadAborted, UploadOptions, upload_bytes, upload_file  # noqa: E402
from ckptfs.fsmeta import UploadRecord  # noqa: E402
from upload_hooks import Hooks  # noqa: E402

BUCKET = "ckptfs-upload"

pytestmark = pytest.mark.filterwarnings("ignore:aiobotocore's httpx backend:DeprecationWarning")


class Crash(Exception):
    pass


class CountingStore:
    """Delegates to a real store, counting part uploads."""

    def __init__(self, inner):
        self._inner = inner
        self.parts_sent: list[int] = []
        self.creates = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def upload_part(self, key, upload_id, n, path, off, ln, **kw):
        self.parts_sent.append(n)
        return await self._inner.upload_part(key, upload_id, n, path, off, ln, **kw)

    async def create_multipart(self, *a, **kw):
        self.creates += 1
        return await self._inner.create_multipart(*a, **kw)


@pytest.fixture(scope="module")
def moto_server():
    with fake_aws_env():
        srv = shared_server()
        srv.make_bucket(BUCKET)
        yield srv


@pytest.fixture(params=["file", "s3"])
def store_factory(request, tmp_path):
    """Returns (factory, part_size): a fresh store per trio.run."""
    if request.param == "file":
        root = tmp_path / "bucket"
        root.mkdir()
        yield (lambda: open_store(f"file://{root}")), 64 * 1024
    else:
        srv = request.getfixturevalue("moto_server")
        with fake_aws_env():
            yield (lambda: open_store(f"s3://{BUCKET}/up", endpoint_url=srv.endpoint)), 5 * MiB


def make_file(tmp_path, size, name="src.bin"):
    p = tmp_path / name
    p.write_bytes(os.urandom(size))
    return p


def test_small_file_single_put(store_factory, tmp_path):
    factory, ps = store_factory
    src = make_file(tmp_path, ps // 2)

    async def main():
        async with factory() as st:
            counting = CountingStore(st)
            res = await upload_file(counting, "small/f", src, {"mode": "420"}, options=UploadOptions(part_size=ps))
            assert not res.multipart and counting.creates == 0
            info = await st.head("small/f")
            assert info.metadata["blake3"] == blake3.blake3(src.read_bytes()).hexdigest() == res.blake3
            assert info.metadata["mode"] == "420"
            assert await st.get_range("small/f", 0, 10**9) == src.read_bytes()
            empty = tmp_path / "empty"
            empty.write_bytes(b"")
            r = await upload_file(st, "small/empty", empty, {}, options=UploadOptions(part_size=ps))
            assert r.size == 0 and (await st.head("small/empty")).size == 0
            r = await upload_bytes(st, "small/link", "target/path", {"mode": str(0o120777)})
            assert await st.get_range("small/link", 0, 100) == b"target/path"
            assert r.blake3 == blake3.blake3(b"target/path").hexdigest()

    trio.run(main)


def test_crash_then_resume_sends_only_missing_parts(store_factory, tmp_path):
    factory, ps = store_factory
    nparts = 5
    src = make_file(tmp_path, ps * (nparts - 1) + ps // 3)
    saved: dict = {}
    done: list[int] = []

    def on_created(rec):
        saved["rec"] = rec.to_dict()

    def on_part_done_crashing(part):
        done.append(part.number)
        saved["rec"]["parts"].append(part.to_dict())
        if len(done) == 2:
            raise Crash("simulated crash after 2 persisted parts")

    async def first():
        async with factory() as st:
            with pytest.raises(Crash):
                await upload_file(
                    st, "ckpt/model.pt", src, {"mode": "420"}, options=UploadOptions(part_size=ps, concurrency=1),
                    journal=Hooks(created=on_created, part_done=on_part_done_crashing),
                )
            assert await st.head("ckpt/model.pt") is None  # not completed
            ups = await st.list_multipart_uploads("ckpt/")
            assert [u.upload_id for u in ups] == [saved["rec"]["upload_id"]]  # not aborted

    trio.run(first)
    assert sorted(p["number"] for p in saved["rec"]["parts"]) == [1, 2]

    async def second():
        async with factory() as st:
            counting = CountingStore(st)
            record = UploadRecord.from_bytes(UploadRecord.from_dict(saved["rec"]).to_bytes())
            persisted = []
            res = await upload_file(
                counting, "ckpt/model.pt", src, {"mode": "420"}, options=UploadOptions(part_size=ps, concurrency=2),
                resume=record, journal=Hooks(part_done=lambda p: persisted.append(p.number)),
            )
            assert counting.creates == 0
            assert sorted(counting.parts_sent) == [3, 4, 5]
            assert sorted(persisted) == [3, 4, 5]
            assert res.multipart and res.parts == nparts and res.parts_reused == 2 and res.parts_uploaded == 3
            assert res.upload_id == saved["rec"]["upload_id"]
            assert await st.get_range("ckpt/model.pt", 0, 10**9) == src.read_bytes()
            info = await st.head("ckpt/model.pt")
            assert info.metadata["blake3"] == blake3.blake3(src.read_bytes()).hexdigest()
            assert await st.list_multipart_uploads("ckpt/") == []

    trio.run(second)


def test_resume_with_vanished_upload_starts_over(store_factory, tmp_path):
    factory, ps = store_factory
    src = make_file(tmp_path, ps * 2 + 7)
    saved: dict = {}

    def crash(part):
        raise Crash()

    async def main():
        async with factory() as st:
            with pytest.raises(Crash):
                await upload_file(
                    st, "gone/x", src, {}, options=UploadOptions(part_size=ps, concurrency=1),
                    journal=Hooks(created=lambda r: saved.setdefault("rec", r), part_done=crash),
                )
            rec: UploadRecord = saved["rec"]
            assert {p["number"] for p in rec.parts} == {1}
            await st.abort_multipart(rec.key, rec.upload_id)  # e.g. lifecycle AbortIncompleteMultipartUpload
            counting = CountingStore(st)
            res = await upload_file(counting, "gone/x", src, {}, options=UploadOptions(part_size=ps), resume=rec)
            assert counting.creates == 1 and sorted(counting.parts_sent) == [1, 2, 3]
            assert res.restarts == 1 and res.upload_id != rec.upload_id
            assert await st.get_range("gone/x", 0, 10**9) == src.read_bytes()

    trio.run(main)


def test_resume_record_for_changed_file_is_discarded(store_factory, tmp_path):
    factory, ps = store_factory
    src = make_file(tmp_path, ps * 2 + 7)
    saved: dict = {}

    async def main():
        async with factory() as st:
            with pytest.raises(Crash):
                await upload_file(
                    st, "chg/x", src, {}, options=UploadOptions(part_size=ps, concurrency=1),
                    journal=Hooks(created=lambda r: saved.setdefault("rec", r),
                                  part_done=lambda p: (_ for _ in ()).throw(Crash())),
                )
            src.write_bytes(os.urandom(ps * 2 + 7))  # same size, new content
            counting = CountingStore(st)
            # duck-typed record (like the metadata DB's own upload record) with dict parts
            old = saved["rec"]

            class DbRecord:
                key, upload_id, part_size, size, blake3 = old.key, old.upload_id, old.part_size, old.size, old.blake3
                parts = [dict(p) for p in old.parts]
                generation = 7

            res = await upload_file(counting, "chg/x", src, {}, options=UploadOptions(part_size=ps), resume=DbRecord())
            assert counting.creates == 1 and sorted(counting.parts_sent) == [1, 2, 3] and res.restarts == 1
            assert await st.get_range("chg/x", 0, 10**9) == src.read_bytes()
            assert await st.list_multipart_uploads("chg/") == []  # old upload aborted

    trio.run(main)


def test_should_abort_aborts_multipart(store_factory, tmp_path):
    factory, ps = store_factory
    src = make_file(tmp_path, ps * 4)
    flag = {"abort": False}

    def on_part_done(part):
        flag["abort"] = True  # e.g. the file was rewritten: generation moved

    async def main():
        async with factory() as st:
            created = {}
            with pytest.raises(UploadAborted):
                await upload_file(
                    st, "ab/x", src, {}, options=UploadOptions(part_size=ps, concurrency=1, abort_poll=0.01),
                    journal=Hooks(created=lambda r: created.setdefault("id", r.upload_id),
                                  part_done=on_part_done, should_abort=lambda: flag["abort"]),
                )
            assert created["id"]
            assert await st.list_multipart_uploads("ab/") == []
            assert await st.head("ab/x") is None
            # a may_complete() veto also aborts
            with pytest.raises(UploadAborted):
                await upload_file(st, "ab/y", src, {}, options=UploadOptions(part_size=ps),
                                  journal=Hooks(may_complete=lambda: False))
            assert await st.list_multipart_uploads("ab/") == []
            assert await st.head("ab/y") is None
            small = make_file(tmp_path, 100, "small")
            with pytest.raises(UploadAborted):
                await upload_file(st, "ab/small", small, {}, options=UploadOptions(part_size=ps),
                                  journal=Hooks(may_complete=lambda: False))
            assert await st.head("ab/small") is None

    trio.run(main)


def test_source_changed_during_upload(store_factory, tmp_path):
    factory, ps = store_factory
    src = make_file(tmp_path, ps * 3)

    async def main():
        async with factory() as st:
            def touch(part):
                if part.number == 1:
                    os.utime(src, ns=(1, 1))

            with pytest.raises(localio.SourceChangedError):
                await upload_file(st, "chg2/x", src, {}, options=UploadOptions(part_size=ps, concurrency=1),
                                  journal=Hooks(part_done=touch))
            assert await st.head("chg2/x") is None
            assert await st.list_multipart_uploads("chg2/") == []
            with pytest.raises(localio.SourceChangedError):
                await upload_file(st, "chg2/x", src, {}, options=UploadOptions(part_size=ps), size=123)

    trio.run(main)


def test_source_rewritten_in_place_with_its_old_size_and_mtime_is_caught_by_ctime(store_factory, tmp_path):
    # Passthrough writes and shared mappings reach the cache file without the gateway: a
    # same-size overwrite whose mtime is set back must still abort the upload (ctime moves).
    factory, ps = store_factory
    src = make_file(tmp_path, ps * 3)
    st0 = os.stat(src)

    async def main():
        async with factory() as st:
            def rewrite(part):
                if part.number == 1:
                    with open(src, "r+b") as fh:
                        fh.write(b"changed")
                    os.utime(src, ns=(st0.st_atime_ns, st0.st_mtime_ns))

            with pytest.raises(localio.SourceChangedError):
                await upload_file(st, "chg3/x", src, {}, options=UploadOptions(part_size=ps, concurrency=1),
                                  journal=Hooks(part_done=rewrite))
            assert await st.head("chg3/x") is None

    trio.run(main)


def test_part_limiter_bounds_parts_in_flight(tmp_path):
    root = tmp_path / "b"
    root.mkdir()
    srcs = [make_file(tmp_path, 10 * 4096 + 1, f"s{i}") for i in range(3)]
    in_flight = {"now": 0, "max": 0}

    class Slow(CountingStore):
        async def upload_part(self, *a, **kw):
            in_flight["now"] += 1
            in_flight["max"] = max(in_flight["max"], in_flight["now"])
            try:
                await trio.sleep(0.005)
                return await super().upload_part(*a, **kw)
            finally:
                in_flight["now"] -= 1

    async def main():
        async with open_store(f"file://{root}") as st:
            slow = Slow(st)
            limiter = trio.CapacityLimiter(3)
            async with trio.open_nursery() as n:
                for i, s in enumerate(srcs):
                    n.start_soon(lambda s=s, i=i: upload_file(
                        slow, f"lim/{i}", s, {},
                        options=UploadOptions(part_size=4096, concurrency=4, part_limiter=limiter)))
            for i, s in enumerate(srcs):
                assert await st.get_range(f"lim/{i}", 0, 10**9) == s.read_bytes()

    trio.run(main)
    assert 1 < in_flight["max"] <= 3

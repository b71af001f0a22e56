"""drain.upload retry logic (retry_forever, flaky stores), error
classification, and abort_stale_uploads."""

from __future__ import annotations

import datetime as dt
import os
import random

import pytest
import trio

from ckptfs.drain.store import StoreError, UploadInfo, is_retryable, make_error
from ckptfs.drain.factory import open_store
from ckptfs.drain.upload import (
    Backoff,
    RetryState,
    UploadOptions,
    plan_parts,
    UploadAborted,
    abort_stale_uploads,
    backoff_delay,
    retry_forever,
    upload_file,
)
from upload_hooks import Hooks


def err(code: str, status: int | None = None) -> StoreError:
    return make_error(f"simulated {code}", code=code, status=status, op="UploadPart")


def test_classification():
    for code, status in [
        ("SlowDown", 503),
        ("ServiceUnavailable", 503),
        ("InternalError", 500),
        ("RequestTimeout", 400),
        ("ConnectionError", None),
        ("Timeout", None),
        ("BadGateway", 502),
        ("GatewayTimeout", 504),
        ("TooManyRequests", 429),
        ("ExpiredToken", 400),
        ("SomethingNew", 500),
    ]:
        assert is_retryable(code, status), code
        assert err(code, status).retryable
    for code, status in [
        ("AccessDenied", 403),
        ("InvalidAccessKeyId", 403),
        ("SignatureDoesNotMatch", 403),
        ("NoSuchBucket", 404),
        ("NoSuchKey", 404),
        ("NoSuchUpload", 404),
        ("InvalidPart", 400),
        ("EntityTooSmall", 400),
        ("NotImplemented", 501),
        ("SomethingElse", 400),
    ]:
        assert not is_retryable(code, status), code
    e = err("NoSuchUpload", 404)
    assert type(e).__name__ == "NoSuchUploadError" and "NoSuchUpload" in str(e)


def test_backoff_is_exponential_with_jitter_and_capped():
    rng = random.Random(1)
    for attempt in range(1, 40):
        d = backoff_delay(attempt, 0.2, 30.0, rng)
        full = min(30.0, 0.2 * 2 ** (attempt - 1))
        assert full / 2 <= d <= full
    assert backoff_delay(100, 0.2, 30.0) <= 30.0


def test_retry_forever_retries_retryable_and_reports_state():
    calls = {"n": 0}
    states: list[RetryState | None] = []
    slept: list[float] = []

    async def op():
        calls["n"] += 1
        if calls["n"] <= 7:
            raise err("SlowDown", 503)
        return "ok"

    async def fake_sleep(d):
        slept.append(d)

    async def main():
        return await retry_forever(op, what="UploadPart 3/9 k", on_retry=states.append, sleep=fake_sleep)

    assert trio.run(main) == "ok"
    assert calls["n"] == 8 and len(slept) == 7
    assert [s.attempt for s in states[:-1]] == list(range(1, 8))
    assert states[6].describe() == "retrying: SlowDown (attempt 7) UploadPart 3/9 k"
    assert states[-1] is None  # recovered: state cleared
    assert slept[-1] > slept[0]


def test_retry_forever_raises_permanent_immediately():
    calls = {"n": 0}

    async def op():
        calls["n"] += 1
        raise err("AccessDenied", 403)

    async def main():
        with pytest.raises(StoreError) as ei:
            await retry_forever(op, on_retry=lambda s: pytest.fail("no retry for permanent errors"))
        assert ei.value.code == "AccessDenied"

    trio.run(main)
    assert calls["n"] == 1


def test_retry_forever_non_store_errors_propagate():
    async def op():
        raise OSError(5, "EIO reading the cache file")

    async def main():
        with pytest.raises(OSError):
            await retry_forever(op)

    trio.run(main)


def test_retry_forever_should_abort_while_backing_off():
    abort = {"v": False}

    async def op():
        abort["v"] = True
        raise err("ServiceUnavailable", 503)

    async def main():
        with trio.fail_after(5):
            with pytest.raises(UploadAborted):
                await retry_forever(op, backoff=Backoff(60, 60), should_abort=lambda: abort["v"])

    trio.run(main)


class FlakyStore:
    """Wraps a store; ``upload_part`` fails with scripted errors first."""

    def __init__(self, inner, failures: dict[int, list[StoreError]]):
        self._inner = inner
        self.failures = failures
        self.attempts: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def upload_part(self, key, upload_id, n, path, off, ln, **kw):
        self.attempts[n] = self.attempts.get(n, 0) + 1
        pending = self.failures.get(n)
        if pending:
            raise pending.pop(0)
        return await self._inner.upload_part(key, upload_id, n, path, off, ln, **kw)


def test_upload_with_flaky_store_retries(tmp_path):
    root = tmp_path / "b"
    root.mkdir()
    src = tmp_path / "src"
    data = os.urandom(5 * 1000 + 1)
    src.write_bytes(data)
    states: list = []

    async def main():
        async with open_store(f"file://{root}") as st:
            flaky = FlakyStore(
                st,
                {
                    2: [err("SlowDown", 503), err("SlowDown", 503), err("SlowDown", 503)],
                    4: [err("ConnectionError"), err("InternalError", 500)],
                },
            )
            res = await upload_file(
                flaky, "k", src, {},
                options=UploadOptions(part_size=1000, concurrency=3, backoff=Backoff(0.001, 0.01)),
                journal=Hooks(retrying=states.append),
            )
            assert res.parts == 6
            assert flaky.attempts[2] == 4 and flaky.attempts[4] == 3 and flaky.attempts[1] == 1
            assert await st.get_range("k", 0, 10**9) == data

    trio.run(main)
    codes = [s.code for s in states if s is not None]
    assert codes.count("SlowDown") == 3 and "ConnectionError" in codes and "InternalError" in codes
    assert states.count(None) == 2  # each part's streak cleared on success


def test_upload_permanent_error_propagates_and_stays_resumable(tmp_path):
    root = tmp_path / "b"
    root.mkdir()
    src = tmp_path / "src"
    src.write_bytes(os.urandom(3000))
    created = {}

    async def main():
        async with open_store(f"file://{root}") as st:
            flaky = FlakyStore(st, {2: [err("AccessDenied", 403)]})
            with pytest.raises(StoreError) as ei:
                await upload_file(
                    flaky, "k", src, {}, options=UploadOptions(part_size=1000, concurrency=1, backoff=Backoff(0.001, 30.0)),
                    journal=Hooks(created=lambda r: created.setdefault("r", r)),
                )
            assert ei.value.code == "AccessDenied"
            ups = await st.list_multipart_uploads()
            assert [u.upload_id for u in ups] == [created["r"].upload_id]
            res = await upload_file(st, "k", src, {}, options=UploadOptions(part_size=1000), resume=created["r"])
            assert res.parts_reused == 1 and res.parts_uploaded == 2
            assert await st.get_range("k", 0, 10**9) == src.read_bytes()

    trio.run(main)


def test_custom_retry_policy_hook(tmp_path):
    root = tmp_path / "b"
    root.mkdir()
    src = tmp_path / "src"
    src.write_bytes(os.urandom(2500))
    seen: list[str] = []

    async def my_retry(what, op):
        seen.append(what.split()[0])
        while True:
            try:
                return await op()
            except StoreError as e:
                if not e.retryable:
                    raise

    async def main():
        async with open_store(f"file://{root}") as st:
            flaky = FlakyStore(st, {1: [err("SlowDown", 503)]})
            await upload_file(flaky, "k", src, {}, options=UploadOptions(part_size=1000, concurrency=1, retry=my_retry))

    trio.run(main)
    assert seen == ["CreateMultipartUpload", "UploadPart", "UploadPart", "UploadPart", "CompleteMultipartUpload"]


def test_abort_stale_uploads(tmp_path):
    root = tmp_path / "b"
    root.mkdir()

    async def main():
        async with open_store(f"file://{root}") as st:
            known = await st.create_multipart("a/known", {})
            leaked = await st.create_multipart("a/leaked", {})
            other = await st.create_multipart("b/leaked", {})
            now = dt.datetime.now(dt.timezone.utc).timestamp()
            # too young: nothing aborted
            assert await abort_stale_uploads(st, {known}, older_than=3600, now=now) == []
            aborted = await abort_stale_uploads(st, {known}, older_than=3600, now=now + 7200, prefix="a/")
            assert [(u.key, u.upload_id) for u in aborted] == [("a/leaked", leaked)]
            assert isinstance(aborted[0], UploadInfo)
            left = {u.upload_id for u in await st.list_multipart_uploads()}
            assert left == {known, other}

    trio.run(main)


def test_plan_parts():
    MiB = 1 << 20
    assert plan_parts(100 * MiB, 64 * MiB) == 64 * MiB
    assert plan_parts(100 * MiB, 1 * MiB) == 5 * MiB  # S3 minimum
    assert plan_parts(100 * MiB, 10 * 1024 * MiB) == 5 * 1024 * MiB  # S3 maximum
    big = 1_000_000 * MiB  # ~1 TB at 64 MiB would need 15625 parts
    ps = plan_parts(big, 64 * MiB)
    assert ps % MiB == 0 and -(-big // ps) <= 10_000
    with pytest.raises(ValueError):
        plan_parts(60_000_000 * MiB, 64 * MiB)

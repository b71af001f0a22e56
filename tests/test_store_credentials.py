"""S3Store's credentials under trio: botocore's standard chain resolved in a worker thread,
refreshed before expiry for every signature (presigned URLs included), refresh failures
by window. Fast: nothing here sends an S3 request (integration/test_credentials_radosgw.py
runs every provider against radosgw, and the rotation test)."""

from __future__ import annotations

import datetime as dt
import stat
import sys
import threading
import urllib.parse

import pytest
import trio
from botocore.credentials import ReadOnlyCredentials, RefreshableCredentials

from ckptfs.drain.credentials import ThreadedRefreshableCredentials
from ckptfs.drain.s3store import S3Store
from ckptfs.drain.store import StoreError

CRED_VARS = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
)


def _iso(seconds_from_now: float) -> str:
    t = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds_from_now)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def process_profile(tmp_path, monkeypatch):
    """``process_profile(lifetimes)``: a ``credential_process`` profile whose n-th run prints key
    ``AKIDn`` expiring ``lifetimes[n-1]`` seconds later (None: no Expiration; "fail": exits 1)."""

    def make(lifetimes):
        runs = tmp_path / "runs"
        runs.write_text("0")
        script = tmp_path / "helper"
        script.write_text(
            f"#!{sys.executable}\n"
            "import datetime as dt, json, sys\n"
            f"runs = {str(runs)!r}\n"
            "n = int(open(runs).read()) + 1\n"
            "open(runs, 'w').write(str(n))\n"
            f"lifetimes = {lifetimes!r}\n"
            "life = lifetimes[min(n, len(lifetimes)) - 1]\n"
            "if life == 'fail':\n"
            "    sys.exit('helper: session expired, run the login command')\n"
            "out = {'Version': 1, 'AccessKeyId': f'AKID{n}', 'SecretAccessKey': f'secret-{n}'}\n"
            "if life is not None:\n"
            "    t = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=life)\n"
            "    out['Expiration'] = t.strftime('%Y-%m-%dT%H:%M:%SZ')\n"
            "print(json.dumps(out))\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        (tmp_path / "config").write_text(f"[profile helper]\ncredential_process = {script}\n")
        for k in CRED_VARS:
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("AWS_PROFILE", "helper")
        return lambda: int(runs.read_text())

    return make


def _store() -> S3Store:
    # never contacted: presigning and resolving credentials send nothing
    return S3Store(bucket="b", endpoint_url="http://127.0.0.1:9", region="us-east-1")


async def _presigned_key_id(store: S3Store) -> str:
    client = await store._c()
    url = await client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": "k"}, ExpiresIn=60)
    cred = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["X-Amz-Credential"][0]
    return cred.split("/")[0]


def test_a_credential_process_profile_works_under_trio(process_profile):
    runs = process_profile([None])

    async def main():
        store = _store()
        try:
            assert await store._credential_source() == "from custom-process"
            assert await _presigned_key_id(store) == "AKID1"
            assert await _presigned_key_id(store) == "AKID1"
        finally:
            await store.aclose()

    trio.run(main)
    assert runs() == 1  # static credentials: fetched once


def test_expiring_credentials_are_refreshed_before_they_expire_for_presigned_urls_too(process_profile):
    """Credentials with 20 min left are used as they are; with 12 min left (botocore's advisory
    window) they are refreshed at the next signature, with 5 min left (its mandatory window)
    before it. A presigned URL is a signature like any other."""
    runs = process_profile([20 * 60, 12 * 60, 5 * 60, 3600])

    async def main():
        store = _store()
        try:
            for _ in range(3):
                assert await _presigned_key_id(store) == "AKID1"
            assert runs() == 1
            creds = (await store._c())._request_signer._credentials
            assert isinstance(creds, ThreadedRefreshableCredentials)
            assert creds.refreshes == 0
        finally:
            await store.aclose()
        store = _store()  # a new process, say: the helper now hands out 12 min, then 5, then 1 h
        try:
            # AKID2 (12 min left: advisory) is refreshed at once, in the thread that loaded it;
            # AKID3 (5 min: mandatory) before the first signature
            assert await _presigned_key_id(store) == "AKID4"
            assert runs() == 4
            assert (await store._c())._request_signer._credentials.refreshes == 1
            assert await _presigned_key_id(store) == "AKID4"  # an hour left: nothing to do
            assert runs() == 4
        finally:
            await store.aclose()

    trio.run(main)


@pytest.mark.parametrize("minutes_left, kept", [(12, True), (5, False)])
def test_a_failed_refresh_keeps_the_current_credentials_only_outside_the_mandatory_window(
        process_profile, minutes_left, kept):
    runs = process_profile([minutes_left * 60, "fail"])

    async def main():
        store = _store()
        try:
            if kept:
                assert await _presigned_key_id(store) == "AKID1"  # refresh failed, 12 min left: kept
                return None
            with pytest.raises(StoreError) as e:  # 5 min left: mandatory, and the helper fails
                await store.get_to_file("k", "/nonexistent/never-written")
            return e.value
        finally:
            await store.aclose()

    err = trio.run(main)
    # advisory: each signature tries again (botocore's rule), and keeps AKID1 when that fails
    assert runs() == (3 if kept else 2)
    if not kept:
        assert err.code == "CredentialRetrievalError" and err.retryable
        assert "custom-process" in str(err) and "run the login command" in str(err)


def test_a_failing_credential_process_is_refused_at_start_naming_the_provider(process_profile):
    process_profile(["fail"])

    async def main():
        store = _store()
        try:
            with pytest.raises(StoreError) as e:
                await store.check_access()
            return e.value
        finally:
            await store.aclose()

    err = trio.run(main)
    assert err.code == "CredentialRetrievalError"
    assert "custom-process" in str(err) and "session expired" in str(err)


def _refreshable(key: str, minutes_left: float, refresh) -> RefreshableCredentials:
    meta = {"access_key": key, "secret_key": "s-" + key, "token": None, "expiry_time": _iso(minutes_left * 60)}
    return RefreshableCredentials.create_from_metadata(meta, refresh_using=refresh, method="test")


@pytest.mark.parametrize("minutes_left, others_wait", [(12, False), (5, True)])
def test_one_refresh_at_a_time_in_a_worker_thread(minutes_left, others_wait):
    """Ten signatures at once while a refresh is due: one refresh, in a worker thread. In the
    advisory window the other nine sign at once with the current keys; in the mandatory
    window they wait for the new ones."""
    release = threading.Event()
    calls = []

    def refresh():
        calls.append(threading.current_thread() is threading.main_thread())
        assert release.wait(10)
        return {"access_key": "NEW", "secret_key": "s", "token": None, "expiry_time": _iso(3600)}

    creds = _refreshable("OLD", minutes_left, refresh)

    async def main():
        wrapped = ThreadedRefreshableCredentials(creds, ReadOnlyCredentials("OLD", "s-OLD", None))
        got = []

        async def sign():
            got.append((await wrapped.get_frozen_credentials()).access_key)

        async with trio.open_nursery() as n:
            for _ in range(10):
                n.start_soon(sign)
            with trio.fail_after(10):
                while len(calls) < 1 or (not others_wait and len(got) < 9):
                    await trio.sleep(0.01)
            early = list(got)
            release.set()
        return early, got

    early, got = trio.run(main)
    assert calls == [False]  # one refresh, not on the main (event loop) thread
    if others_wait:
        assert early == [] and got == ["NEW"] * 10
    else:
        assert early == ["OLD"] * 9 and sorted(got) == ["NEW"] + ["OLD"] * 9

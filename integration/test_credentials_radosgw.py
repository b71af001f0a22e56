"""Every provider of the standard AWS credential chain, against radosgw: the store under
trio (every transport), a mount (its gateway's cold reads, and its drain: the ``ckptfs
drain`` process the gateway supervises), the lifecycle CLI, and a rotation of keys.

Where there is no real provider on 127.0.0.1 a fake stands in (integration/credfakes.py):
the container endpoint (EKS Pod Identity's token file, ECS), IMDSv2, STS for web identity.
Each hands out real radosgw keys of the user that owns the bucket, made for the test with
``radosgw-admin``, so the requests signed with them really succeed. The rotation test
deletes each key shortly after the endpoint stops handing it out.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from integration.credfakes import ROLE_ARN, FakeCredentialEndpoints, RadosgwKeys
from integration.test_drain_common import (  # noqa: F401 - fixtures
    MiB,
    ckptfs_cmd,
    listing,
    mounts,
    needs_fuse,
    object_blake3,
    rand,
    s3_env,
    write_file,
)

pytestmark = [pytest.mark.radosgw]

FAST = {"settle_seconds": 0.2, "part_size": "5MiB", "concurrency": 4}
#: FUSE requests through /dev/fuse, as in tests/ (conftest.FUSE_IO_URING): these tests are about
#: credentials, and the io_uring queues depend on the fuse module's enable_uring, a global knob
#: that other test runs on the machine may turn while these mounts are up
FUSE = {"fuse_io_uring": "off"}
PROVIDERS = ["env", "shared-file", "credential-process", "web-identity", "container", "imds"]
#: botocore's name for each (Credentials.method)
METHODS = {
    "env": "env",
    "shared-file": "shared-credentials-file",
    "credential-process": "custom-process",
    "web-identity": "assume-role-with-web-identity",
    "container": "container-role",
    "imds": "iam-role",
}
_CRED_VARS = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "AWS_EC2_METADATA_DISABLED", "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "AWS_ENDPOINT_URL_STS", "AWS_CREDENTIAL_EXPIRATION", "BOTO_CONFIG",
)


class Provider:
    """The environment (and files) that make botocore's chain find ``keys`` through one provider."""

    def __init__(self, name: str, s3, keys: RadosgwKeys, fake: FakeCredentialEndpoints, tmp: Path):
        self.name = name
        self.keys = keys
        self.fake = fake
        env = {k: v for k, v in s3_env(s3).items() if k not in _CRED_VARS}
        env.update(
            AWS_CONFIG_FILE=str(tmp / "aws-config"),  # absent unless written below
            AWS_SHARED_CREDENTIALS_FILE=str(tmp / "aws-credentials"),
            BOTO_CONFIG=str(tmp / "no-boto-config"),
            AWS_EC2_METADATA_DISABLED="true",
        )
        key = keys.current()
        if name == "env":
            env.update(AWS_ACCESS_KEY_ID=key.access_key, AWS_SECRET_ACCESS_KEY=key.secret_key)
        elif name == "shared-file":
            (tmp / "aws-credentials").write_text(
                f"[ckpt]\naws_access_key_id = {key.access_key}\naws_secret_access_key = {key.secret_key}\n")
            env["AWS_PROFILE"] = "ckpt"
        elif name == "credential-process":
            # a helper that asks the fake container endpoint (so it hands out the current key)
            script = tmp / "cred-helper"
            script.write_text(
                f"#!{sys.executable}\n"
                "import json, urllib.request\n"
                f"req = urllib.request.Request({fake.url + '/v1/credentials'!r}, "
                f"headers={{'Authorization': {fake.container_token!r}}})\n"
                "c = json.load(urllib.request.urlopen(req))\n"
                "out = {'Version': 1, 'AccessKeyId': c['AccessKeyId'], 'SecretAccessKey': c['SecretAccessKey']}\n"
                "if 'Expiration' in c: out['Expiration'] = c['Expiration']\n"
                "print(json.dumps(out))\n")
            script.chmod(script.stat().st_mode | stat.S_IXUSR)
            (tmp / "aws-config").write_text(f"[profile ckpt]\ncredential_process = {script}\n")
            env["AWS_PROFILE"] = "ckpt"
        elif name == "web-identity":
            token = tmp / "web-identity-token"
            token.write_text(fake.web_identity_token)
            env.update(AWS_WEB_IDENTITY_TOKEN_FILE=str(token), AWS_ROLE_ARN=ROLE_ARN,
                       AWS_ROLE_SESSION_NAME="ckptfs-test", AWS_ENDPOINT_URL_STS=fake.url)
        elif name == "container":
            token = tmp / "pod-identity-token"
            token.write_text(fake.container_token)
            env.update(AWS_CONTAINER_CREDENTIALS_FULL_URI=fake.url + "/v1/credentials",
                       AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE=str(token))
        elif name == "imds":
            del env["AWS_EC2_METADATA_DISABLED"]
            env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake.url + "/"
        else:
            raise ValueError(name)
        self.env = env

    def fetches(self) -> int:
        """Answers with credentials the fakes gave (0 for env and the shared file)."""
        what = {"credential-process": "container", "web-identity": "sts", "container": "container",
                "imds": "imds"}.get(self.name)
        return self.fake.hits.get(what, 0) if what else 0


@pytest.fixture
def provider_for(s3_server, tmp_path):
    """Factory: ``provider_for(name, **keys_kw)`` -> :class:`Provider` over fresh radosgw keys."""
    made = []

    def make(name: str, **keys_kw) -> Provider:
        keys = RadosgwKeys(s3_server, **keys_kw).start()
        fake = FakeCredentialEndpoints(keys, container_token="pod-identity-" + os.urandom(8).hex(),
                                       web_identity_token="eyJ.fake-jwt." + os.urandom(8).hex()).start()
        made.append((keys, fake))
        d = tmp_path / f"aws-{name}-{len(made)}"
        d.mkdir()
        return Provider(name, s3_server, keys, fake, d)

    yield make
    for keys, fake in made:
        fake.close()
        keys.close()


def _use_env(monkeypatch, env: dict) -> None:
    for k in _CRED_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


# -- the store, in this process, under trio ------------------------------------------------------


@pytest.mark.parametrize("name", PROVIDERS)
def test_the_store_signs_every_transport_with_each_provider(s3_server, s3_bucket, provider_for, monkeypatch,
                                                            tmp_path, name):
    """check_access, a PUT, a multipart upload whose parts go out with sendfile, a GET through
    httpx and one through a presigned urllib3 URL: all signed with the provider's key."""
    from ckptfs.drain.s3store import S3Store

    p = provider_for(name)
    src = tmp_path / "src.bin"
    data = rand(11 * MiB, 3)
    src.write_bytes(data)
    dest = tmp_path / "dest.bin"

    async def main():
        store = S3Store(bucket=s3_bucket, prefix="p/", endpoint_url=s3_server.endpoint_url, region=s3_server.region)
        try:
            await store.check_access(write=True)
            assert await store._credential_source() == f"from {METHODS[name]}"
            await store.put_object("small", b"hello")
            upload = await store.create_multipart("big")
            parts = [await store.upload_part("big", upload, n + 1, src, off, min(5 * MiB, len(data) - off))
                     for n, off in enumerate(range(0, len(data), 5 * MiB))]
            await store.complete_multipart("big", upload, parts)
            assert store._sender.parts_sent == 3  # the sendfile path signed too
            assert await store.get_range("small", 0, 5) == b"hello"
            assert await store.get_to_file("big", dest) == len(data)
        finally:
            await store.aclose()

    with monkeypatch.context() as env:
        _use_env(env, p.env)
        trio.run(main)
    assert dest.read_bytes() == data
    assert set(listing(s3_server.client(), s3_bucket)) == {"p/small", "p/big"}
    if name not in ("env", "shared-file"):
        assert p.fetches() >= 1
    assert p.fake.refusals == []


# -- a mount: its drain and its gateway's reads -----------------------------------------------------


@needs_fuse
@pytest.mark.parametrize("name", PROVIDERS)
def test_a_mount_drains_and_reads_cold_with_each_provider(s3_server, s3_bucket, provider_for, mounts, name):
    p = provider_for(name)
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "run", drain=FAST, env=p.env, **FUSE).start()
    data = rand(12 * MiB + 5, 11)
    digest = write_file(m.path("ckpt/shard.bin"), data)
    m.wait_durable(timeout=60)
    got, meta = object_blake3(c, s3_bucket, "run/ckpt/shard.bin")
    assert got == digest == meta["blake3"]
    # a second mount with an empty cache reads it from the bucket (the gateway's read path)
    m2 = mounts(s3_server, s3_bucket, "run", drain=FAST, env=p.env, **FUSE).start()
    assert m2.path("ckpt/shard.bin").read_bytes() == data
    assert m.unmount() == 0 and m2.unmount() == 0
    for mm in (m, m2):
        log = mm.log_path.read_text(errors="replace")
        assert p.keys.current().secret_key not in log  # never logged
    assert p.fake.refusals == []


@needs_fuse
@pytest.mark.parametrize("name, token_var, words", [
    ("container", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", ["container-role", "401"]),
    ("web-identity", "AWS_WEB_IDENTITY_TOKEN_FILE", ["sts", "AccessDenied", "AssumeRoleWithWebIdentity"]),
])
def test_a_mount_whose_provider_fails_is_refused_naming_it(s3_server, s3_bucket, provider_for, tmp_path,
                                                          name, token_var, words):
    """The container endpoint refuses the pod's token, or STS the web identity token: the mount
    does not start, and its one line names the provider and what it said, never a token."""
    p = provider_for(name)
    Path(p.env[token_var]).write_text("not-the-pod-token")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([*ckptfs_cmd(), "mount", f"s3://{s3_bucket}/p", str(mnt), "--endpoint-url",
                        s3_server.endpoint_url, "--cache-dir", str(tmp_path / "cache"), "--foreground",
                        "--metrics-addr", "127.0.0.1:0"], capture_output=True, text=True, env=p.env, timeout=90)
    assert r.returncode != 0 and not os.path.ismount(mnt)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptfs: ") and all(w in last for w in words), r.stderr
    assert "not-the-pod-token" not in r.stderr and p.fake.container_token not in r.stderr
    assert p.fake.web_identity_token not in r.stderr
    assert p.fake.refusals and p.fetches() == 0


@pytest.mark.parametrize("name", ["container", "credential-process", "imds"])
def test_the_lifecycle_cli_plans_with_provider_credentials(s3_server, s3_bucket, provider_for, tmp_path, name):
    p = provider_for(name)
    c = s3_server.client()
    for step in (1, 2):
        c.put_object(Bucket=s3_bucket, Key=f"lc/step_{step}/shard_0.pt", Body=b"x" * 1000)
        c.put_object(Bucket=s3_bucket, Key=f"lc/step_{step}/.metadata", Body=b"{}")
    cfg = tmp_path / "lc.toml"
    cfg.write_text(f'bucket_url = "s3://{s3_bucket}/lc"\nendpoint_url = "{s3_server.endpoint_url}"\n'
                   f'[cache]\ndir = "{tmp_path / "no-cache"}"\n'
                   '[lifecycle]\ncheckpoints = ["step_{step}"]\nmarkers = [".metadata"]\nkeep_latest = 1\n'
                   "expire_after_days = 10\n")
    r = subprocess.run([*ckptfs_cmd(), "lifecycle", "plan", "--config", str(cfg), "--json"],
                       capture_output=True, text=True, env=p.env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {d["path"] for d in json.loads(r.stdout)} == {"step_1", "step_2"}
    assert p.fetches() >= 1
    assert p.keys.current().secret_key not in r.stdout + r.stderr


# -- rotation ---------------------------------------------------------------------------------------

ROTATE_EVERY = 12.0  # s: a new key every 12 s ...
GRACE = 6.0  # ... the previous one deleted 6 s later, which is also the Expiration handed out with it
PHASES = 4
FILE_SIZE = 80 * MiB


@needs_fuse
def test_rotating_keys_through_a_drain_and_a_cold_read(s3_server, s3_bucket, provider_for, mounts):
    """The container endpoint hands out a new radosgw key every 12 s with an 18-s Expiration,
    and the previous key is deleted 6 s after each rotation. In each of four phases a mount
    drains an 80 MiB file and a second mount (its own, cold cache) reads the previous phase's
    file from the bucket; each phase starts only once radosgw refuses the key of the phase
    before, so each one's requests can only succeed with refreshed credentials. Every file
    ends durable and byte-identical, every read whole."""
    p = provider_for("container", rotate_every=ROTATE_EVERY, grace=GRACE)
    c = s3_server.client()
    t0 = time.monotonic()
    m = mounts(s3_server, s3_bucket, "rot", env=p.env, **FUSE,
               drain={"settle_seconds": 0.2, "part_size": "8MiB", "concurrency": 4}).start()
    reader = mounts(s3_server, s3_bucket, "rot", env=p.env, drain=FAST, **FUSE).start()
    files = {f"phase{i}.bin": rand(FILE_SIZE, 100 + i) for i in range(PHASES)}
    digests = {}
    for i, (rel, data) in enumerate(files.items()):
        if i:
            # the key of the previous phase is deleted, and radosgw refuses it
            deadline = time.monotonic() + ROTATE_EVERY + GRACE + 30
            while not (len(p.keys.deleted) >= i and p.keys.refused(p.keys.issued[i - 1])):
                assert time.monotonic() < deadline, f"key {i - 1} not refused yet: {p.keys.errors}"
                time.sleep(0.2)
        digests[rel] = write_file(m.path(rel), data)
        m.wait_durable(rel, timeout=60)
        if i:
            prev = f"phase{i - 1}.bin"
            assert reader.path(prev).read_bytes() == files[prev], prev
    last = f"phase{PHASES - 1}.bin"
    assert reader.path(last).read_bytes() == files[last]
    elapsed = time.monotonic() - t0
    for rel, digest in digests.items():
        got, meta = object_blake3(c, s3_bucket, f"rot/{rel}")
        assert got == digest == meta["blake3"], rel
        assert m.state(rel) == "durable"
    assert m.unmount() == 0 and reader.unmount() == 0
    assert p.keys.errors == [] and p.fake.refusals == []
    print(f"\nrotation: {len(p.keys.issued) - 1} rotations, {len(p.keys.deleted)} keys deleted in "
          f"{elapsed:.0f} s; {PHASES} x {FILE_SIZE // MiB} MiB drained and read cold; "
          f"{p.fetches()} answers from the endpoint")
    for mm in (m, reader):
        log = mm.log_path.read_text(errors="replace")
        assert not any(k.secret_key in log for k in p.keys.issued)

"""Faults between the drain and radosgw (through integration/faultproxy.py), and the
multipart uploads the drain must not leave behind."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from integration.test_drain_common import (  # noqa: F401 - fixtures
    MiB,
    assert_bucket_matches,
    ckptfs_cmd,
    listing,
    mounts,
    needs_fuse,
    open_uploads,
    proxy,
    rand,
    write_file,
)

pytestmark = [needs_fuse, pytest.mark.radosgw]

CFG = {"settle_seconds": 0.1, "part_size": "5MiB", "concurrency": 4}
DATA_OPS = ["UploadPart", "PutObject", "CreateMultipartUpload", "CompleteMultipartUpload"]


def wait_until(pred, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def drain_ready(proxy, timeout: float = 30) -> None:
    """Wait until the drain passed its startup check (its write probe, after the mount's own)."""
    assert wait_until(lambda: len([r for r in proxy.records("DeleteObject")
                                   if ".ckptfs-probe/" in r.key and r.status == 204]) >= 2, timeout)


def test_transient_faults_retry_visibly_and_lose_nothing(s3_server, s3_bucket, mounts, proxy):
    c = s3_server.client()
    # (publish_timeout: the first file of a new directory waits that long for its in-flight
    # record, which the throttling refuses too; the directory may get its dir/ marker meanwhile)
    m = mounts(s3_server, s3_bucket, "faults", endpoint=proxy.url, drain=CFG,
               cluster={"publish_timeout": 2}).start()
    drain_ready(proxy)
    # 1. every data request is throttled: status shows the retrying state
    slowdown = proxy.fail(DATA_OPS, status=503, code="SlowDown")
    expected = {}
    for i in range(2):
        rel = f"ckpt/shard_{i}.bin"
        expected[m.key(rel)] = write_file(m.path(rel), rand(12 * MiB + i * 777, 40 + i))
    for i in range(6):
        rel = f"ckpt/small_{i}.json"
        expected[m.key(rel)] = write_file(m.path(rel), (f"small {i} " * 100).encode())

    def retrying():
        st = m.status()
        return st["retrying"] if any("SlowDown" in v for v in st["retrying"].values()) else None

    shown = wait_until(retrying, 30)
    assert shown, m.status()
    assert m.state("ckpt/small_0.json") in ("dirty", "uploading")  # not an error: retried
    assert listing(c, s3_bucket) == {}

    # 2. a mix of transient faults: 503s, 500s, resets mid-body, stalls, lost responses
    proxy.remove_rule(slowdown)
    # (fractions kept modest: a streak of failures backs off exponentially, 0.2 s * 2^n)
    proxy.fail(DATA_OPS, status=503, code="SlowDown", fraction=0.15)
    proxy.fail(["CompleteMultipartUpload", "PutObject"], status=500, code="InternalError", fraction=0.1)
    proxy.reset("UploadPart", count=2)  # the next two parts: RST half-way through the body
    proxy.reset(["CompleteMultipartUpload"], when="response", count=1)
    proxy.reset(["PutObject"], when="response", count=1)
    proxy.reset(["CreateMultipartUpload"], when="response", count=1)  # leaks an upload unless cleaned
    proxy.stall(None, 0.3, fraction=0.1)
    t0 = time.monotonic()
    m.wait_durable(timeout=120)
    print(f"durable {time.monotonic() - t0:.1f}s after the faults became intermittent")
    injected = {r.fault.split()[0] if r.fault else None for r in proxy.records()}
    assert {"error", "reset", "reset-response"} <= injected, injected
    assert_bucket_matches(c, s3_bucket, expected, ignore_dir_markers=True)
    assert wait_until(lambda: m.status()["retrying"] == {}, 5), m.status()
    assert m.unmount() == 0


def test_access_denied_keeps_data_dirty_until_fixed(s3_server, s3_bucket, mounts, proxy):
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "denied", endpoint=proxy.url, drain=CFG).start()
    drain_ready(proxy)  # the drain's own startup probe is a PUT: let it pass first
    denied = proxy.fail(["PutObject", "UploadPart", "CreateMultipartUpload"], status=403, code="AccessDenied",
                        message="Access Denied")
    expected = {m.key("run/a.bin"): write_file(m.path("run/a.bin"), rand(7 * MiB, 3)),
                m.key("run/b.txt"): write_file(m.path("run/b.txt"), b"b" * 100)}
    for rel in ("run/a.bin", "run/b.txt"):
        assert wait_until(lambda rel=rel: m.state(rel) == "error: AccessDenied", 30), m.state(rel)
    st = m.status()
    assert st["errors"] == {"run/a.bin": "AccessDenied", "run/b.txt": "AccessDenied"}
    r = subprocess.run([*ckptfs_cmd(), "wait-durable", str(m.mnt), "--timeout", "1"], capture_output=True,
                       text=True, env=m.env)
    assert r.returncode == 1 and "AccessDenied" in r.stderr
    assert listing(c, s3_bucket) == {}
    assert (m.path("run/a.bin")).stat().st_size == 7 * MiB  # still served from the cache
    assert m.state("run/a.bin") == "error: AccessDenied"  # data stays dirty

    proxy.remove_rule(denied)
    t0 = time.monotonic()
    m.wait_durable(timeout=90)
    recovered = time.monotonic() - t0
    assert m.state("run/a.bin") == "durable" and m.state("run/b.txt") == "durable"
    assert m.status()["errors"] == {}
    assert_bucket_matches(c, s3_bucket, expected)
    assert recovered < 30, f"took {recovered:.1f}s to notice the access came back"
    assert m.unmount() == 0


def test_upload_of_a_deleted_file_is_aborted(s3_server, s3_bucket, mounts, proxy):
    """Uploads recorded in fsmeta whose files are deleted while the drain is down get aborted,
    also when the name is taken again by a new file right away."""
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "gone", endpoint=proxy.url, drain=CFG).start()
    gate = proxy.hold("UploadPart", when="request", count=None)
    write_file(m.path("ckpt/a.bin"), rand(12 * MiB, 5))
    write_file(m.path("ckpt/b.bin"), rand(12 * MiB, 6))
    assert wait_until(lambda: m.fsmeta_upload("ckpt/a.bin") and m.fsmeta_upload("ckpt/b.bin"), 30)
    assert gate.wait_held(30)
    ids = {m.fsmeta_upload("ckpt/a.bin").upload_id, m.fsmeta_upload("ckpt/b.bin").upload_id}
    assert {u["UploadId"] for u in open_uploads(c, s3_bucket)} == ids
    m.kill_drain()
    os.unlink(m.path("ckpt/a.bin"))
    os.unlink(m.path("ckpt/b.bin"))
    expected = {m.key("ckpt/b.bin"): write_file(m.path("ckpt/b.bin"), b"new b")}
    gate.release()
    m.wait_durable(timeout=60)
    assert wait_until(lambda: open_uploads(c, s3_bucket) == [], 20), open_uploads(c, s3_bucket)
    aborted = {r.upload_id for r in proxy.records("AbortMultipartUpload") if r.status in (200, 204)}
    assert ids <= aborted
    assert_bucket_matches(c, s3_bucket, expected)
    assert m.unmount() == 0


def test_upload_discarded_when_the_file_changes(s3_server, s3_bucket, mounts, proxy):
    """A write while its upload is in flight: that upload is aborted (not completed, not
    left open) and the new content is uploaded."""
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "gen", endpoint=proxy.url, drain=CFG).start()
    proxy.set_bandwidth(up=8 * MiB)
    data = bytearray(rand(30 * MiB, 8))
    write_file(m.path("model.bin"), bytes(data))
    assert wait_until(lambda: [r for r in proxy.records("UploadPart") if r.status == 200], 30)
    first = m.fsmeta_upload("model.bin").upload_id
    with open(m.path("model.bin"), "r+b") as f:
        f.seek(7 * MiB)
        f.write(b"changed!")
        os.fsync(f.fileno())
    data[7 * MiB:7 * MiB + 8] = b"changed!"
    proxy.set_bandwidth(None)
    m.wait_durable(timeout=90)
    import blake3

    assert_bucket_matches(c, s3_bucket, {m.key("model.bin"): blake3.blake3(bytes(data)).hexdigest()})
    assert first in {r.upload_id for r in proxy.records("AbortMultipartUpload")}
    assert first not in {r.upload_id for r in proxy.records("CompleteMultipartUpload")}
    assert m.unmount() == 0


def test_stale_foreign_uploads_aborted_at_start(s3_server, s3_bucket, mounts, monkeypatch):
    """Uploads under our prefix that fsmeta does not know and that are older than
    STALE_UPLOAD_SECONDS are aborted when a drain starts (24 h in production; 0 here),
    uploads outside the prefix are not touched."""
    from ckptfs.drain import process as drain_process
    from ckptfs.drain import worker

    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "mine", drain=CFG).start()
    expected = {m.key("x.bin"): write_file(m.path("x.bin"), b"x" * 1000)}
    m.wait_durable(timeout=30)
    assert m.unmount() == 0
    ours = c.create_multipart_upload(Bucket=s3_bucket, Key="mine/leaked.bin")["UploadId"]
    other = c.create_multipart_upload(Bucket=s3_bucket, Key="someone-else/big.bin")["UploadId"]
    time.sleep(1.1)
    monkeypatch.setattr(worker, "STALE_UPLOAD_SECONDS", 1)
    for k, v in m.env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    assert drain_process.run(str(m.cache), until_empty=True) == 0
    left = {u["UploadId"] for u in open_uploads(c, s3_bucket)}
    assert ours not in left and other in left
    c.abort_multipart_upload(Bucket=s3_bucket, Key="someone-else/big.bin", UploadId=other)
    assert_bucket_matches(c, s3_bucket, expected)

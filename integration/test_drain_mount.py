"""A real mount on s3://bucket/prefix against radosgw: object layout, metadata, torch.save,
commit markers last, hard links below a renamed directory, --fsync=remote, refused credentials."""

from __future__ import annotations

import os
import subprocess
import time

import blake3
import pytest

from integration.test_drain_common import (  # noqa: F401 - fixtures
    MiB,
    ckptfs_cmd,
    listing,
    mounts,
    needs_fuse,
    object_blake3,
    open_uploads,
    proxy,
    rand,
    s3_env,
    write_file,
)

pytestmark = [needs_fuse, pytest.mark.radosgw]

FAST = {"settle_seconds": 0.2, "part_size": "5MiB", "concurrency": 4}


def test_files_appear_under_prefix_with_metadata(s3_server, s3_bucket, mounts):
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "ckpt/run1", drain=FAST).start()
    files = {
        "a.txt": b"hello ckptfs\n",
        "empty": b"",
        "sub/dir/big.bin": rand(12 * MiB + 12345, 1),  # 3 parts of 5 MiB
    }
    (m.mnt / "sub" / "dir").mkdir(parents=True)
    (m.mnt / "emptydir").mkdir()
    digests = {rel: write_file(m.path(rel), data) for rel, data in files.items()}
    os.chmod(m.path("a.txt"), 0o640)
    os.chown(m.path("a.txt"), 1234, 5678)
    mtime_ns = 1_700_000_000_123_456_789
    os.utime(m.path("sub/dir/big.bin"), ns=(mtime_ns, mtime_ns))

    # A file still open for writing is not uploaded, however long it sits (settle is 0.2 s).
    held = open(m.path("open-writer.bin"), "wb")
    held.write(b"x" * 1000)
    held.flush()
    os.fsync(held.fileno())
    time.sleep(1.5)
    assert m.key("open-writer.bin") not in listing(c, s3_bucket)
    held.close()
    digests["open-writer.bin"] = blake3.blake3(b"x" * 1000).hexdigest()

    m.wait_durable(timeout=60)
    objs = listing(c, s3_bucket)
    assert set(objs) == {m.key(r) for r in digests} | {m.key("emptydir/")}
    assert objs[m.key("emptydir/")]["Size"] == 0
    for rel, digest in digests.items():
        got, meta = object_blake3(c, s3_bucket, m.key(rel))
        assert got == digest, rel
        assert meta["blake3"] == digest, rel
        st = os.stat(m.path(rel))
        assert meta["mode"] == str(st.st_mode), rel
        assert meta["uid"] == str(st.st_uid) and meta["gid"] == str(st.st_gid), rel
        assert meta["mtime"] == f"{st.st_mtime_ns // 10**9}.{st.st_mtime_ns % 10**9:09d}", rel
        assert os.getxattr(m.path(rel), "user.ckptfs.blake3").decode() == digest
        assert m.state(rel) == "durable"
    a = c.head_object(Bucket=s3_bucket, Key=m.key("a.txt"))["Metadata"]
    assert (a["mode"], a["uid"], a["gid"]) == (str(0o100640), "1234", "5678")
    big = c.head_object(Bucket=s3_bucket, Key=m.key("sub/dir/big.bin"))
    assert big["Metadata"]["mtime"] == "1700000000.123456789"
    assert big["ETag"].strip('"').endswith("-3")  # multipart, 5 MiB parts
    assert open_uploads(c, s3_bucket) == []
    assert m.unmount() == 0


def test_torch_save_tmp_fsync_rename(s3_server, s3_bucket, mounts, tmp_path):
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (pip install torch==2.13.0 into the venv to run this test)")
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "jobs/j1", drain=FAST).start()
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(512, 1024), "b": torch.randn(1024), "emb": torch.randn(4096, 256)},
        "step": 100,
        "optim": {"lr": 1e-3, "m": torch.zeros(512, 1024)},
    }
    (m.mnt / "step_100").mkdir()
    tmp = m.path("step_100/model.pt.tmp")
    final = m.path("step_100/model.pt")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    dfd = os.open(m.path("step_100"), os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    m.wait_durable("step_100", timeout=60)

    objs = listing(c, s3_bucket)
    assert list(objs) == [m.key("step_100/model.pt")], objs.keys()
    local = final.read_bytes()
    got, meta = object_blake3(c, s3_bucket, m.key("step_100/model.pt"))
    assert got == meta["blake3"] == blake3.blake3(local).hexdigest()
    dl = tmp_path / "downloaded.pt"
    c.download_file(s3_bucket, m.key("step_100/model.pt"), str(dl))
    loaded = torch.load(dl, weights_only=True)
    assert loaded["step"] == 100
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    assert torch.equal(loaded["optim"]["m"], state["optim"]["m"])
    assert open_uploads(c, s3_bucket) == []
    m.unmount()


def test_sharded_checkpoint_marker_drains_last(s3_server, s3_bucket, mounts, proxy):
    """DCP-style directory: 4 x 40 MiB shards + ``.metadata``, the marker written *early*
    (after the first shard): it must still reach the bucket after every shard."""
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "dcp", endpoint=proxy.url,
               drain={"settle_seconds": 0.2, "part_size": "8MiB", "concurrency": 4}).start()
    d = m.mnt / "step_200"
    digests = {}
    shard = rand(40 * MiB, 7)
    d.mkdir()
    for i in range(4):
        data = shard[:-8] + i.to_bytes(8, "little")
        digests[f"step_200/__{i}_0.distcp"] = write_file(d / f"__{i}_0.distcp", data)
        if i == 0:
            digests["step_200/.metadata"] = write_file(d / ".metadata", b"dcp metadata " * 100)
            time.sleep(0.5)  # past the settle window: the marker is a candidate from now on
    m.wait_durable("step_200", timeout=120)

    objs = listing(c, s3_bucket)
    assert set(objs) == {m.key(k) for k in digests}
    for rel, digest in digests.items():
        got, meta = object_blake3(c, s3_bucket, m.key(rel))
        assert got == digest == meta["blake3"]
    marker_time = objs[m.key("step_200/.metadata")]["LastModified"]
    for i in range(4):
        assert objs[m.key(f"step_200/__{i}_0.distcp")]["LastModified"] <= marker_time
    # Stronger, from the proxy's log: the marker's PUT started after every shard's Complete ended.
    recs = proxy.records()
    marker_put = [r for r in recs if r.op == "PutObject" and r.key.endswith("step_200/.metadata")]
    completes = [r for r in recs if r.op == "CompleteMultipartUpload" and r.status == 200]
    assert len(marker_put) == 1 and len(completes) == 4
    assert all(r.t_end <= marker_put[0].t_start for r in completes)
    assert sum(1 for r in recs if r.op == "UploadPart" and r.status == 200) == 4 * 5
    m.unmount()


def test_a_renamed_directory_holding_a_second_hard_link_leaves_no_object_at_the_old_name(s3_server, s3_bucket, mounts):
    """``ln b c/x; mv c a``: other nodes must not keep seeing ``c/x`` in the bucket."""
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "links", drain=FAST).start()
    write_file(m.path("b"), b"linked")
    (m.mnt / "c").mkdir()
    os.link(m.path("b"), m.path("c/x"))
    m.wait_durable(timeout=60)
    assert set(listing(c, s3_bucket)) == {m.key("b"), m.key("c/x")}
    os.rename(m.path("c"), m.path("a"))
    m.wait_durable(timeout=60)
    assert set(listing(c, s3_bucket)) == {m.key("b"), m.key("a/x")}
    assert c.get_object(Bucket=s3_bucket, Key=m.key("a/x"))["Body"].read() == b"linked"
    assert m.unmount() == 0


def test_fsync_remote_waits_for_the_bucket(s3_server, s3_bucket, mounts):
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "remote", fsync="remote",
               drain={"settle_seconds": 5, "part_size": "5MiB", "concurrency": 4}).start()
    for rel, size in (("small.bin", 4096), ("multi.bin", 11 * MiB)):
        data = rand(size, size)
        with open(m.path(rel), "wb") as f:
            f.write(data)
            f.flush()
            t0 = time.monotonic()
            os.fsync(f.fileno())
            took = time.monotonic() - t0
            head = c.head_object(Bucket=s3_bucket, Key=m.key(rel))  # right after fsync returned
            assert head["ContentLength"] == size
            assert head["Metadata"]["blake3"] == blake3.blake3(data).hexdigest()
            # settle_seconds=5 is not waited for: fsync=remote makes the file urgent
            assert took < 5, took
            # a second write + fsync on the same handle: the bucket gets the new content
            f.write(b"tail")
            f.flush()
            os.fsync(f.fileno())
            head = c.head_object(Bucket=s3_bucket, Key=m.key(rel))
            assert head["ContentLength"] == size + 4
            assert head["Metadata"]["blake3"] == blake3.blake3(data + b"tail").hexdigest()
    assert open_uploads(c, s3_bucket) == []
    m.unmount()


@pytest.mark.parametrize("what, env_change, words", [
    ("wrong secret", {"AWS_SECRET_ACCESS_KEY": "not-the-secret-key-000000000000000000000"},
     ["SignatureDoesNotMatch", "wrong secret key"]),
    ("unknown key id", {"AWS_ACCESS_KEY_ID": "NOSUCHACCESSKEY00000"}, ["InvalidAccessKeyId"]),
    ("no bucket", None, ["NoSuchBucket"]),
])
def test_bad_credentials_refused_at_mount(s3_server, s3_bucket, tmp_path, what, env_change, words):
    env = s3_env(s3_server, **(env_change or {}))
    bucket = s3_bucket if env_change else "ckptfs-no-such-bucket-x"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([*ckptfs_cmd(), "mount", f"s3://{bucket}/p", str(mnt), "--endpoint-url",
                        s3_server.endpoint_url, "--cache-dir", str(tmp_path / "cache"), "--foreground",
                        "--metrics-addr", "127.0.0.1:0"], capture_output=True, text=True, env=env, timeout=90)
    assert r.returncode != 0, what
    assert not os.path.ismount(mnt)
    err = r.stderr.strip().splitlines()
    assert err and err[-1].startswith("ckptfs: "), r.stderr
    assert all(w in err[-1] for w in words), err[-1]
    assert bucket in err[-1]
    assert env["AWS_SECRET_ACCESS_KEY"] not in r.stderr  # never log the secret

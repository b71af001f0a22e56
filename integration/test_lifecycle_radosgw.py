"""``ckptfs lifecycle plan|apply`` and ``ckptfs promote`` against a real radosgw, on
checkpoints written through real mounts.

* tiering through the bucket's lifecycle rules (tag-filtered Transition to the
  COLD class, executed by radosgw itself; 1 lifecycle "day" = 10 s here, and
  the rules use Days 0 so tagged objects move on the next lifecycle pass),
  idempotent re-runs, expiry by age read back from ``ckptfs-mtime``;
* ``--direct`` tiering (copy in place) keeping data, metadata and tags; pins
  made through a mount path;
* a checkpoint written by two mounts (two caches) seen as one checkpoint,
  complete once the marker lands; pending keys of a live mount's cache.

Ages: objects are seconds old, so the tests pass ``--now +Nd`` (a hidden
option) to look at the bucket N days later.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime

import pytest

from integration.test_drain_common import (  # noqa: F401 - fixtures
    ckptfs_cmd,
    listing,
    mounts,
    needs_fuse,
    object_blake3,
    rand,
    s3_env,
    write_file,
)

pytestmark = [needs_fuse, pytest.mark.radosgw]

FAST = {"settle_seconds": 0.2, "part_size": "5MiB", "concurrency": 4}
SHARD = 256 * 1024  # above min_transition_bytes below; a single PUT (below the part size)
# The newest checkpoint kept, every 200th tiered to COLD after a day, the others gone after five.
TIERED_RULES = """
checkpoints = ["step_{step}"]
markers = [".metadata"]
keep_latest = 1
keep_every_steps = 200
expire_after_days = 5
min_transition_bytes = 65536
[[lifecycle.tiers]]
after_days = 1
storage_class = "COLD"
"""


def lc_config(path, s3, bucket: str, prefix: str, lifecycle: str, cache_dir=None):
    path.write_text(
        f'bucket_url = "s3://{bucket}/{prefix}"\n'
        f'endpoint_url = "{s3.endpoint_url}"\n'
        "[cache]\n"
        f'dir = "{cache_dir or path.parent / "no-cache-here"}"\n'
        "[lifecycle]\n" + lifecycle
    )
    return path


def lifecycle_cli(s3, *args, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = s3_env(s3, **(env_extra or {}))
    return subprocess.run([*ckptfs_cmd(), *args], capture_output=True, text=True, env=env, timeout=timeout)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def by_path(r: subprocess.CompletedProcess) -> dict[str, dict]:
    return {d["path"]: d for d in json.loads(r.stdout)}


def write_checkpoint(m, step: int, shards: range, *, marker: bool = True, seed: int = 0) -> dict[str, str]:
    out = {}
    for i in shards:
        rel = f"step_{step}/shard_{i}.pt"
        out[rel] = write_file(m.path(rel), rand(SHARD, seed + step * 10 + i))
    if marker:
        rel = f"step_{step}/.metadata"
        out[rel] = write_file(m.path(rel), f'{{"step": {step}}}'.encode())
    return out


def heads(c, bucket: str, keys) -> dict[str, dict]:
    return {k: c.head_object(Bucket=bucket, Key=k) for k in keys}


def storage_class(head: dict) -> str:
    return head.get("StorageClass") or "STANDARD"


def tags_of(c, bucket: str, key: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in c.get_object_tagging(Bucket=bucket, Key=key).get("TagSet", [])}


# ------------------------------------------------------------------------------------------------


def test_tiering_through_bucket_lifecycle_rules_then_expiry(s3_server, s3_bucket, mounts, tmp_path):
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "ckpt", drain=FAST).start()
    written = {}
    for step in (100, 200, 300, 400, 500):
        written.update(write_checkpoint(m, step, range(2)))
    m.wait_durable(timeout=60)
    # a rule somebody else wrote: must survive ckptfs installing its own
    c.put_bucket_lifecycle_configuration(Bucket=s3_bucket, LifecycleConfiguration={"Rules": [{
        "ID": "user-tmp-expire", "Status": "Enabled",
        "Filter": {"And": {"Prefix": "tmp/", "Tags": [{"Key": "scratch", "Value": "yes"}]}},
        "Expiration": {"Days": 30}}]})
    cfg = lc_config(tmp_path / "lc.toml", s3_server, s3_bucket, "ckpt", TIERED_RULES)
    shards = {f"ckpt/step_{s}/shard_{i}.pt" for s in (100, 200, 300, 400) for i in range(2)}

    plan = by_path(ok(lifecycle_cli(s3_server, "lifecycle", "plan", "--config", str(cfg), "--json", "--now", "+2d")))
    assert set(plan) == {f"step_{s}" for s in (100, 200, 300, 400, 500)}
    assert plan["step_500"]["action"] == "keep" and plan["step_500"]["reasons"] == ["latest"]
    for s in (100, 200, 300, 400):
        assert plan[f"step_{s}"]["action"] == "transition" and plan[f"step_{s}"]["target_class"] == "COLD"
    assert "milestone" in plan["step_200"]["reasons"] and "within-expiry" in plan["step_100"]["reasons"]
    assert {k["Key"] for k in listing(c, s3_bucket).values()} == {f"ckpt/{k}" for k in written}  # plan: no change

    r = ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--json", "--now", "+2d"))
    applied = by_path(r)
    for s in (100, 200, 300, 400):
        assert applied[f"step_{s}"]["result"]["status"] == "done"
        assert applied[f"step_{s}"]["result"]["tagged"] == 2
    assert "bucket lifecycle: install rule" in r.stderr
    rules = {rule["ID"]: rule for rule in c.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]}
    assert "user-tmp-expire" in rules
    tier_rule = next(rule for rid, rule in rules.items() if rid.startswith("ckptfs-") and rid.endswith("-tier-COLD"))
    assert tier_rule["Transitions"] == [{"Days": 0, "StorageClass": "COLD"}]
    assert any(rid.endswith("-abort-incomplete-uploads") for rid in rules)
    for key in shards:
        tags = tags_of(c, s3_bucket, key)
        assert tags["ckptfs-tier"] == "COLD" and "ckptfs-mtime" in tags

    # Again right away: tagged objects wait for radosgw; nothing is written.
    snapshot = {k: v["LastModified"] for k, v in listing(c, s3_bucket).items()}
    r = ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--json", "--now", "+2d"))
    again = by_path(r)
    assert "nothing to do" in r.stderr
    for d in again.values():
        assert d["result"] is None or (d["result"]["status"] == "waiting" and d["result"]["tagged"] == 0), d
    # (radosgw 16.2's PutObjectTagging bumps LastModified: unchanged times prove no re-tagging)
    assert {k: v["LastModified"] for k, v in listing(c, s3_bucket).items()} == snapshot

    # radosgw's lifecycle worker moves the tagged shards to COLD (Days 0: next pass, ~10 s)
    deadline = time.monotonic() + 120
    while True:
        classes = {k: storage_class(h) for k, h in heads(c, s3_bucket, shards).items()}
        if set(classes.values()) == {"COLD"}:
            break
        assert time.monotonic() < deadline, f"not transitioned by radosgw: {classes}"
        time.sleep(2)
    for s in (100, 200, 300, 400, 500):
        assert storage_class(c.head_object(Bucket=s3_bucket, Key=f"ckpt/step_{s}/.metadata")) == "STANDARD"
    for rel, digest in written.items():  # data and metadata survive the transition
        got, meta = object_blake3(c, s3_bucket, f"ckpt/{rel}")
        assert got == digest == meta["blake3"], rel
    assert storage_class(c.head_object(Bucket=s3_bucket, Key="ckpt/step_500/shard_0.pt")) == "STANDARD"

    r = ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--json", "--now", "+2d"))
    assert all(d["action"] == "keep" for d in by_path(r).values())
    assert "nothing to do" in r.stderr

    # Four days later: step_100 and step_300 expire (ages from ckptfs-mtime, although
    # tagging reset LastModified); the milestones stay, in COLD.
    r = ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--json", "--now", "+6d"))
    result = by_path(r)
    assert result["step_100"]["action"] == "delete" and result["step_300"]["action"] == "delete"
    assert result["step_100"]["result"]["deleted"] == 3
    keys = set(listing(c, s3_bucket))
    assert not any(k.startswith(("ckpt/step_100/", "ckpt/step_300/")) for k in keys)
    assert {f"ckpt/step_{s}/.metadata" for s in (200, 400, 500)} <= keys
    assert result["step_200"]["storage_class"] == "mixed" and result["step_200"]["action"] == "keep"
    assert "delete step_100/.metadata (batch 1/2)" in r.stderr  # every action is logged (keys below the prefix)
    m.unmount()


def test_direct_tiering_keeps_metadata_and_pins_from_a_mount(s3_server, s3_bucket, mounts, tmp_path):
    c = s3_server.client()
    m = mounts(s3_server, s3_bucket, "jobs/j2", drain=FAST).start()
    written = {}
    for step in (10, 20, 30):
        written.update(write_checkpoint(m, step, range(2)))
    m.wait_durable(timeout=60)
    cfg = lc_config(tmp_path / "lc.toml", s3_server, s3_bucket, "jobs/j2", """
checkpoints = ["step_{step}"]
markers = [".metadata"]
keep_latest = 1
expire_after_days = 10
min_transition_bytes = 65536
[[lifecycle.tiers]]
after_days = 1
storage_class = "COLD"
""")
    # pin step_10 through its path on the mount
    r = ok(lifecycle_cli(s3_server, "promote", str(m.path("step_10"))))
    assert "pinned step_10" in r.stdout
    assert "jobs/j2/.ckptfs/pins/step_10/" in listing(c, s3_bucket)

    key = "jobs/j2/step_20/shard_0.pt"
    before = c.head_object(Bucket=s3_bucket, Key=key)
    c.put_object_tagging(Bucket=s3_bucket, Key=key, Tagging={"TagSet": [{"Key": "team", "Value": "nlp"}]})
    r = ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--direct", "--json", "--now", "+2d"))
    result = by_path(r)
    assert set(result) == {"step_10", "step_20", "step_30"}  # the pin is no checkpoint
    assert result["step_10"]["action"] == "keep" and "promoted" in result["step_10"]["reasons"]
    assert result["step_20"]["result"]["copied"] == 2
    # moved right away, by the copy
    after = c.head_object(Bucket=s3_bucket, Key=key)
    assert storage_class(after) == "COLD"
    assert after["Metadata"] == before["Metadata"]  # blake3, mode, uid, gid, mtime
    assert after["ContentLength"] == before["ContentLength"]
    tags = tags_of(c, s3_bucket, key)
    assert tags["team"] == "nlp" and tags["ckptfs-tier"] == "COLD"
    original = datetime.fromisoformat(tags["ckptfs-mtime"])
    assert abs((original - before["LastModified"]).total_seconds()) < 60
    assert after["LastModified"] >= before["LastModified"]  # the copy made a new object version
    got, meta = object_blake3(c, s3_bucket, key)
    assert got == written["step_20/shard_0.pt"] == meta["blake3"]
    for s in (10, 30):
        assert storage_class(c.head_object(Bucket=s3_bucket, Key=f"jobs/j2/step_{s}/shard_0.pt")) == "STANDARD"
    with pytest.raises(Exception) as err:  # --direct leaves the bucket's lifecycle configuration alone
        c.get_bucket_lifecycle_configuration(Bucket=s3_bucket)
    assert "NoSuchLifecycleConfiguration" in str(err.value)

    r = ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--direct", "--now", "+2d"))
    assert "applied: nothing to do" in r.stdout

    # unpin; eleven days on, step_10 and step_20 expire (step_20's age from ckptfs-mtime)
    r = ok(lifecycle_cli(s3_server, "promote", str(m.path("step_10")), "--undo"))
    assert "unpinned step_10" in r.stdout
    plan = by_path(ok(lifecycle_cli(s3_server, "lifecycle", "plan", "--config", str(cfg), "--json", "--now", "+9d")))
    assert plan["step_20"]["action"] == "keep" and 8.9 < plan["step_20"]["age_days"] < 9.1
    ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--direct", "--now", "+11d"))
    keys = set(listing(c, s3_bucket))
    assert not any(k.startswith(("jobs/j2/step_10/", "jobs/j2/step_20/")) for k in keys)
    assert {f"jobs/j2/step_30/{n}" for n in ("shard_0.pt", "shard_1.pt", ".metadata")} <= keys
    m.unmount()


def test_checkpoint_written_by_two_mounts(s3_server, s3_bucket, mounts, tmp_path):
    """Two nodes (two mounts, two caches) write halves of the same step directories;
    one of them writes the marker last. The plan sees one checkpoint per step,
    complete once the marker is in the bucket."""
    a = mounts(s3_server, s3_bucket, "shared", drain=FAST, name="node-a").start()
    b = mounts(s3_server, s3_bucket, "shared", drain=FAST, name="node-b").start()
    cfg = lc_config(tmp_path / "lc.toml", s3_server, s3_bucket, "shared", """
checkpoints = ["step_{step}"]
markers = [".metadata"]
keep_latest = 1
min_transition_bytes = 65536
[[lifecycle.tiers]]
after_days = 1
storage_class = "COLD"
""")
    for step in (100, 200):
        write_checkpoint(a, step, range(0, 2), marker=False)
        write_checkpoint(b, step, range(2, 4), marker=False)
    a.wait_durable(timeout=60)
    b.wait_durable(timeout=60)
    plan = by_path(ok(lifecycle_cli(s3_server, "lifecycle", "plan", "--config", str(cfg), "--json")))
    assert set(plan) == {"step_100", "step_200"}
    assert all(not d["complete"] and d["objects"] == 4 and d["action"] == "keep" for d in plan.values())

    for step in (100, 200):  # node b writes the markers, after every shard is durable
        write_file(b.path(f"step_{step}/.metadata"), b"{}")
    b.wait_durable(timeout=60)
    plan = by_path(ok(lifecycle_cli(s3_server, "lifecycle", "plan", "--config", str(cfg), "--json", "--now", "+2d")))
    for step in (100, 200):
        d = plan[f"step_{step}"]
        assert d["complete"] and d["objects"] == 5 and d["bytes"] == 4 * SHARD + 2
    assert plan["step_100"]["action"] == "transition" and plan["step_200"]["reasons"] == ["latest"]

    # Node a is still writing into step_100 (held open: not drained): with its cache the plan
    # leaves step_100 alone, and so does a plan made with node b's cache, or with none: node
    # a's in-flight record of step_100 is in the bucket (cluster commit).
    held = open(a.path("step_100/straggler.pt"), "wb")
    try:
        held.write(b"x" * 1000)
        held.flush()
        os.fsync(held.fileno())
        plan = by_path(ok(lifecycle_cli(s3_server, "lifecycle", "plan", "--config", str(cfg), "--json",
                                        "--now", "+2d", "--cache-dir", str(a.cache))))
        assert plan["step_100"]["action"] == "keep" and "pending-upload" in plan["step_100"]["reasons"]
        for cache in (["--cache-dir", str(b.cache)], []):
            plan = by_path(ok(lifecycle_cli(s3_server, "lifecycle", "plan", "--config", str(cfg), "--json",
                                            "--now", "+2d", *cache)))
            assert plan["step_100"]["action"] == "keep" and "pending-upload" in plan["step_100"]["reasons"]
        r = ok(lifecycle_cli(s3_server, "lifecycle", "apply", "--config", str(cfg), "--direct", "--json",
                             "--now", "+2d", "--cache-dir", str(a.cache)))
        assert by_path(r)["step_100"]["result"] is None
        c = s3_server.client()
        assert storage_class(c.head_object(Bucket=s3_bucket, Key="shared/step_100/shard_0.pt")) == "STANDARD"
    finally:
        held.close()

    # The people's table fits 80 columns.
    r = ok(lifecycle_cli(s3_server, "lifecycle", "plan", "--config", str(cfg), "--now", "+2d",
                         env_extra={"COLUMNS": "80"}))
    lines = r.stdout.splitlines()
    assert lines[0].startswith("PATH") and any(line.startswith("step_100") for line in lines)
    assert max(len(line) for line in lines) <= 80, r.stdout
    a.unmount()
    b.unmount()

"""``ckptfs fsck --bucket`` against a real bucket (radosgw): objects that another tool wrote
under keys no mount shows. A ``file://`` bucket cannot hold most such keys (a file ``a`` next
to ``a/b``, an empty component), so this runs on S3."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from integration.test_drain_common import (  # noqa: F401 - fixtures
    ckptfs_cmd,
    mounts,
    needs_fuse,
)

pytestmark = [needs_fuse, pytest.mark.radosgw]

FAST = {"settle_seconds": 0.2, "part_size": "5MiB", "concurrency": 4}
LONG_NAME = "n" * 300  # over NAME_MAX; S3 takes it (keys up to 1024 bytes)


def test_objects_no_mount_shows_are_reported_by_fsck_and_do_not_fail_it(s3_server, s3_bucket, mounts):
    m = mounts(s3_server, s3_bucket, "jobs/hidden", drain=FAST).start()
    m.path_mk("mine/step_1").write_bytes(b"written through the mount")
    m.wait_durable()
    c = s3_server.client()
    hidden = ["other/step_2", "other/a//b", f"other/{LONG_NAME}"]
    for key in [*hidden, "other/step_2/shard0", "other/fine"]:
        c.put_object(Bucket=s3_bucket, Key=m.key(key), Body=b"another tool wrote this")

    # What a mount shows of them, once the root's listing is older than the TTL (3 s): the
    # directory step_2 wins over the file of the same name; "a" shows as a directory whose
    # one key has an empty name.
    deadline = time.monotonic() + 30
    while not os.path.exists(m.path("other/fine")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(os.listdir(m.path("other"))) == ["a", "fine", "step_2"]
    assert os.path.isdir(m.path("other/step_2")) and os.listdir(m.path("other/a")) == []

    r = subprocess.run([*ckptfs_cmd(), "fsck", str(m.cache), "--bucket", "--json"], capture_output=True,
                       text=True, env=m.env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr  # informational: nothing is wrong with the cache
    report = json.loads(r.stdout)
    assert report["ok"]
    found = {f["key"]: f["detail"] for f in report["findings"] if f["kind"] == "hidden-object"}
    assert sorted(found) == sorted(hidden)
    assert "directory 'step_2' of the same name" in found["other/step_2"]
    assert "''" in found["other/a//b"] and "300 bytes" in found[f"other/{LONG_NAME}"]
    assert [f for f in report["findings"] if f["kind"] != "hidden-object"] == []

    table = subprocess.run([*ckptfs_cmd(), "fsck", str(m.cache), "--bucket"], capture_output=True, text=True,
                           env=m.env, timeout=120)
    assert table.returncode == 0 and "hidden-object" in table.stdout and "info" in table.stdout

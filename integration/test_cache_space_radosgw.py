"""The cache cap end to end against radosgw: a writer writes three times the cap through a
mount on s3://bucket/prefix; it never gets ENOSPC, the cache stays under the cap (plus the
documented passthrough slack), and every object in the bucket is whole."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ckptfs.fsmeta.layout import CacheDir
from integration.test_drain_common import (  # noqa: F401 - fixtures
    MiB,
    mounts,
    needs_fuse,
    object_blake3,
    rand,
    write_file,
)

pytestmark = [needs_fuse, pytest.mark.radosgw]

CAP = 96 * MiB
FILE = 12 * MiB


def test_three_times_the_cap_through_radosgw(s3_server, s3_bucket, mounts):
    m = mounts(s3_server, s3_bucket, "capped", drain={"settle_seconds": 0.1, "part_size": "5MiB", "concurrency": 4},
               cache={"max_size": CAP, "high_watermark": 0.75, "low_watermark": 0.5,
                      "backpressure_timeout": 300}).start()
    cache = CacheDir(str(m.cache))
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], cache.used_bytes())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    digests, seeds = {}, {}
    for step in range(3 * CAP // (4 * FILE)):
        for shard in range(4):
            rel = f"run/step_{step}/shard_{shard}.pt"
            seeds[rel] = step * 10 + shard
            digests[rel] = write_file(m.path(rel), rand(FILE, seeds[rel]), fsync=False)
        write_file(m.path(f"run/step_{step}/.metadata"), b"step %d" % step)
    stop.set()
    sampler.join()
    m.wait_durable(timeout=300)
    c = s3_server.client()
    wrong = {rel: _difference(c.get_object(Bucket=s3_bucket, Key=m.key(rel))["Body"].read(), seeds[rel])
             for rel, digest in digests.items() if object_blake3(c, s3_bucket, m.key(rel))[0] != digest}
    assert not wrong, wrong
    assert all(os.stat(m.path(rel)).st_size == FILE for rel in digests)
    assert "remote" in {m.state(rel) for rel in digests}
    print(f"radosgw: cache peak {peak[0] / MiB:.1f} MiB, cap {CAP // MiB} MiB")
    assert peak[0] <= CAP + FILE + 4 * MiB  # docs/DESIGN.md "Cache space": the passthrough slack
    assert m.unmount() == 0


def _difference(got: bytes, seed: int) -> str:
    """Where an object differs from what was written (for the failure message)."""
    want = rand(FILE, seed)
    if len(got) != len(want):
        return f"{len(got)} bytes, not {len(want)}"
    bad = [off for off in range(0, FILE, 4096) if got[off:off + 4096] != want[off:off + 4096]]
    zero = sum(got[off:off + 4096] == bytes(4096) for off in bad)
    return f"{len(bad)} of {FILE // 4096} 4-KiB blocks differ ({zero} zero), first at {bad[0]}, last at {bad[-1]}"

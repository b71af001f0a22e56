"""The metrics endpoint of a running mount, scraped over HTTP while a checkpoint drains."""

from __future__ import annotations

import os
import re
import time

import pytest

from conftest import Gateway

pytestmark = pytest.mark.mounted

MiB = 1 << 20


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def value(text: str, name: str, default: float | None = None) -> float:
    found = samples(text)
    if name in found:
        return found[name]
    if default is not None:
        return default
    raise AssertionError(f"{name} not in the scrape:\n{text}")


def test_metrics_follow_a_checkpoint_from_dirty_to_durable(gateway_factory, tmp_path):
    config = tmp_path / "drain.toml"
    config.write_text('[drain]\nsettle_seconds = 2.0\npart_size = "5MiB"\n')
    gw: Gateway = gateway_factory(extra_args=("--config", str(config)))
    first = gw.metrics()
    assert value(first, 'ckptfs_data_path{mode="writeback"}') == 1.0
    assert re.search(r'^ckptfs_build_info\{version="[^"]+"\} 1\.0$', first, re.M)
    uploaded_before = value(first, "ckptfs_uploaded_bytes_total", 0.0)

    ckpt = gw.mnt / "run" / "step_10"
    ckpt.mkdir(parents=True)
    for rank in range(2):
        with open(ckpt / f"__{rank}_0.distcp", "wb") as f:
            f.write(os.urandom(12 * MiB))  # multipart at 5 MiB parts
            os.fsync(f.fileno())
    (ckpt / ".metadata").write_bytes(b"done")

    # Within the settle window the backlog shows in the scrape.
    dirty = gw.metrics()
    assert value(dirty, "ckptfs_dirty_bytes") >= 24 * MiB
    assert value(dirty, "ckptfs_dirty_files") >= 3
    assert value(dirty, "ckptfs_oldest_dirty_age_seconds") > 0
    assert value(dirty, 'ckptfs_cache_bytes{state="dirty"}') >= 24 * MiB
    assert value(dirty, "ckptfs_cache_max_bytes") > 0
    assert value(dirty, 'ckptfs_fuse_requests_total{op="write"}') > 0
    assert value(dirty, 'ckptfs_fuse_request_duration_seconds_count{op="fsync"}') >= 2

    deadline = time.monotonic() + 60
    while True:
        text = gw.metrics()
        if value(text, "ckptfs_dirty_files") == 0 and value(text, "ckptfs_uploaded_files_total", 0) >= 3:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    assert value(text, "ckptfs_dirty_bytes") == 0
    assert value(text, "ckptfs_oldest_dirty_age_seconds") == 0
    assert value(text, "ckptfs_uploaded_bytes_total") - uploaded_before >= 24 * MiB
    assert value(text, "ckptfs_time_to_durable_seconds_count") >= 3
    assert value(text, 'ckptfs_upload_request_duration_seconds_count{op="upload_part"}') >= 6
    assert value(text, "ckptfs_multipart_uploads_open") == 0
    assert value(text, "ckptfs_files_in_error") == 0
    assert gw.stop() == 0

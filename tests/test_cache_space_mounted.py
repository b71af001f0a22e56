"""The cache cap through a real mount, in both data paths: a writer that writes three times
the cap while the drain runs never sees ENOSPC and the cache stays under the cap (plus the
documented passthrough slack); with the drain stopped, the writer waits, then gets ENOSPC,
and what it wrote is not torn."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import threading
import time

import pytest
from conftest import DATA_PATHS as _DATA_PATHS
from conftest import REPO, both_data_paths, ckptfs_cmd, needs_fuse

from ckptfs.fsmeta.layout import CacheDir

pytestmark = [needs_fuse, pytest.mark.mounted]

MiB = 1 << 20
CAP = 160 * MiB
FILE = 16 * MiB
# docs/DESIGN.md "Cache space": files already open in passthrough when the cache crossed the
# high watermark keep writing unseen (at most one file here: the writer writes one at a time),
# plus filesystem allocation rounding.
SLACK = FILE + 4 * MiB


@pytest.fixture(scope="module", params=_DATA_PATHS)
def data_path(request) -> str:
    return both_data_paths(request)


def content(step: int, shard: int) -> bytes:
    seed = f"step {step} shard {shard} ".encode()
    return (seed * (FILE // len(seed) + 1))[:FILE]


def capped(gateway_factory, tmp_path, *, settle: float, cap: int = CAP, timeout: float = 120):
    config = tmp_path / "ckptfs.toml"
    config.write_text(f'[drain]\nsettle_seconds = {settle}\n'
                      f'[cache]\nmax_size = {cap}\nhigh_watermark = 0.75\nlow_watermark = 0.5\n'
                      f'backpressure_timeout = {timeout}\n')
    return gateway_factory(extra_args=("--config", str(config)))


def status(gw) -> dict:
    result = subprocess.run([*ckptfs_cmd(), "status", "--cache-dir", str(gw.cache), "--json"],
                            capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def published(gw, check, seconds: float = 10.0):
    """The gateway's space figures reach status and metrics within a second: poll until
    ``check(metrics_text)`` holds (or the time is up), and return the last text."""
    deadline = time.monotonic() + seconds
    while True:
        text = gw.metrics()
        if check(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


class Sampler:
    """The cache's used bytes (allocated blocks of data/), sampled while a test writes."""

    def __init__(self, cache):
        self.cache = CacheDir(str(cache))
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.cache.used_bytes())
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_writing_three_times_the_cap_with_the_drain_running(gateway_factory, tmp_path):
    gw = capped(gateway_factory, tmp_path, settle=0.1)
    sampler = Sampler(gw.cache)
    written = []
    for step in range(3 * CAP // (4 * FILE)):  # 3x the cap in checkpoints of 4 shards
        ckpt = gw.mnt / "run" / f"step_{step}"
        ckpt.mkdir(parents=True)
        for shard in range(4):
            with open(ckpt / f"shard_{shard}.pt", "wb") as f:
                data = content(step, shard)
                f.writelines(data[off:off + MiB] for off in range(0, FILE, MiB))  # no ENOSPC: the writer waits instead
            written.append((step, shard))
        (ckpt / ".metadata").write_bytes(b"step %d" % step)
    peak = sampler.stop()
    print(f"cache peak {peak / MiB:.1f} MiB, cap {CAP // MiB} MiB")  # a figure for docs/DESIGN.md
    assert peak <= CAP + SLACK, f"cache peaked at {peak / MiB:.0f} MiB, cap {CAP // MiB} MiB"

    result = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "120"],
                            capture_output=True, text=True, cwd=str(REPO))
    assert result.returncode == 0, result.stderr + gw.log()[-4000:]
    for step, shard in written:  # every file whole, in the bucket
        assert (gw.bucket / f"run/step_{step}/shard_{shard}.pt").read_bytes() == content(step, shard)
    # Evicted files are still there, same size, listed.
    for step, shard in written:
        assert os.stat(gw.mnt / f"run/step_{step}/shard_{shard}.pt").st_size == FILE
    assert sorted(os.listdir(gw.mnt / "run/step_0")) == [".metadata", *(f"shard_{i}.pt" for i in range(4))]
    states = {os.getxattr(gw.mnt / f"run/step_{s}/shard_{i}.pt", "user.ckptfs.state") for s, i in written}
    assert b"remote" in states and states <= {b"remote", b"durable"}

    deadline = time.monotonic() + 10
    while True:  # the gateway publishes its space figures every second
        report = status(gw)
        if report["cache"]["evictions"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["cache"]["max_bytes"] == CAP and report["cache"]["evictions"] > 0
    assert report["errors"] == {}  # an evicted file is no CacheFileMissing
    text = published(gw, lambda t: metric(t, "ckptfs_cache_evictions_total") > 0)
    assert metric(text, "ckptfs_cache_max_bytes") == CAP
    assert metric(text, "ckptfs_cache_evictions_total") > 0
    assert metric(text, "ckptfs_cache_evicted_bytes_total") >= FILE
    assert metric(text, "ckptfs_backpressure_refused_writes_total") == 0
    print(f"writes waited {metric(text, 'ckptfs_backpressure_wait_seconds_total'):.1f} s in all; "
          f"{metric(text, 'ckptfs_cache_evictions_total'):.0f} evictions")

    gw.stop()
    fsck = subprocess.run([*ckptfs_cmd(), "fsck", str(gw.cache), "--json"], capture_output=True, text=True,
                          timeout=120, cwd=str(REPO))
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_an_evicted_file_reads_back_through_the_mount(gateway_factory, tmp_path):
    gw = capped(gateway_factory, tmp_path, settle=0.1, cap=4 * FILE)
    for shard in range(6):
        (gw.mnt / f"shard_{shard}").write_bytes(content(0, shard))
    deadline = time.monotonic() + 60
    while os.getxattr(gw.mnt / "shard_0", "user.ckptfs.state") != b"remote":
        assert time.monotonic() < deadline, "shard_0 was never evicted"
        time.sleep(0.2)
    assert (gw.mnt / "shard_0").read_bytes() == content(0, 0)


def test_with_the_drain_stopped_a_writer_waits_then_gets_enospc_and_nothing_is_torn(gateway_factory, tmp_path):
    timeout = 5.0
    gw = capped(gateway_factory, tmp_path, settle=3600, cap=64 * MiB, timeout=timeout)  # nothing drains
    outcome = {}
    finished = []

    def writer():
        for n in range(40):  # far past the cap
            path = gw.mnt / f"shard_{n}"
            start = time.monotonic()
            try:
                with open(path, "wb") as f:
                    data = content(0, n)
                    f.writelines(data[off:off + MiB] for off in range(0, FILE, MiB))
                    os.fsync(f.fileno())
            except OSError as exc:
                outcome.update(errno=exc.errno, shard=n, seconds=time.monotonic() - start)
                return
            finished.append(n)

    t = threading.Thread(target=writer)
    t.start()
    seen_waiting = 0
    while t.is_alive():
        seen_waiting = max(seen_waiting, metric(gw.metrics(), "ckptfs_backpressure_waiting_writers"))
        time.sleep(0.1)
    t.join()
    assert outcome.get("errno") == errno.ENOSPC, (outcome, finished)
    assert outcome["seconds"] >= timeout  # it waited first
    assert seen_waiting >= 1
    text = published(gw, lambda t: metric(t, "ckptfs_backpressure_refused_writes_total") >= 1)
    assert metric(text, "ckptfs_backpressure_wait_seconds_total") >= timeout
    assert metric(text, "ckptfs_backpressure_refused_writes_total") >= 1
    report = status(gw)
    assert report["backpressure"]["refused_writes"] >= 1 and report["backpressure"]["wait_seconds_total"] >= timeout
    shown = subprocess.run([*ckptfs_cmd(), "status", "--cache-dir", str(gw.cache)], capture_output=True, text=True,
                           timeout=60, cwd=str(REPO), env={**os.environ, "COLUMNS": "200"}).stdout
    assert "cache cap" in shown and "64.0 MiB" in shown and "write(s) refused (ENOSPC)" in shown, shown

    # After a restart (no kernel page cache left): every file is whole, and the one that failed
    # holds a prefix of what was written, never a hole.
    gw.stop()
    gw.start()
    for n in finished:
        assert (gw.mnt / f"shard_{n}").read_bytes() == content(0, n)
    failed = (gw.mnt / f"shard_{outcome['shard']}").read_bytes()
    assert failed == content(0, outcome["shard"])[:len(failed)]

"""``ckptfs status``: the node summary and ``--by-checkpoint`` rows, checked against a real backlog."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import REPO, ckptfs_cmd

from ckptfs.fsmeta import durability
from ckptfs.fsmeta.layout import CacheDir

from test_drain_support import MiB, denv  # noqa: F401


def status(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*ckptfs_cmd(), "status", "--cache-dir", str(env.cache), *args],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))


def status_json(env, *args) -> dict:
    result = status(env, "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def rows(report: dict) -> dict:
    return {row["path"]: row for row in report["checkpoints"]}


def test_status_counts_a_real_backlog_per_checkpoint_until_it_drains(denv):
    denv.write_file("run/step_100/__0_0.distcp", os.urandom(2 * MiB))
    denv.write_file("run/step_100/__1_0.distcp", os.urandom(3 * MiB))
    denv.write_file("run/step_100/.metadata", b"meta")
    denv.write_file("run/step_200/__0_0.distcp", os.urandom(1 * MiB))
    denv.write_file("notes.txt", b"not a checkpoint")
    denv.meta.sync()

    report = status_json(denv, "--by-checkpoint")
    assert report["pending_files"] == 8  # 5 files and 3 new directories (their markers)
    assert report["pending_bytes"] == 6 * MiB + 4 + len(b"not a checkpoint")
    assert report["oldest_pending_age_seconds"] is not None and report["oldest_pending_age_seconds"] >= 0
    assert report["cache"]["dirty_bytes"] == report["pending_bytes"]
    assert report["cache"]["used_bytes"] >= 6 * MiB
    assert report["drain_pid"] is None and report["gateway_pid"] is None
    r = rows(report)
    assert set(r) == {"run/step_100", "run/step_200"}
    assert (r["run/step_100"]["files"], r["run/step_100"]["bytes"]) == (3, 5 * MiB + 4)
    assert (r["run/step_100"]["dirty"], r["run/step_100"]["durable"]) == (3, 0)
    assert r["run/step_100"]["pending_bytes"] == 5 * MiB + 4
    assert r["run/step_100"]["complete"] and not r["run/step_100"]["marker_in_bucket"]
    assert not r["run/step_200"]["complete"]

    denv.drain()
    report = status_json(denv, "--by-checkpoint")
    assert (report["pending_files"], report["pending_bytes"], report["pending_deletes"]) == (0, 0, 0)
    assert report["oldest_pending_age_seconds"] is None
    assert report["uploaded_files"] >= 5
    r = rows(report)
    assert (r["run/step_100"]["durable"], r["run/step_100"]["dirty"], r["run/step_100"]["pending_bytes"]) == (3, 0, 0)
    assert r["run/step_100"]["marker_in_bucket"]

    # A re-save into step_200 is pending again; errors are listed with their path.
    denv.write_file("run/step_200/__0_0.distcp", os.urandom(MiB))
    denv.meta.write(lambda txn: durability.mark_error(txn, denv.ino("run/step_200/__0_0.distcp"), "AccessDenied"))
    report = status_json(denv, "--by-checkpoint")
    assert report["errors"] == {"run/step_200/__0_0.distcp": "AccessDenied"}
    r = rows(report)
    assert (r["run/step_200"]["errors"], r["run/step_200"]["pending_bytes"]) == (1, MiB)
    assert r["run/step_100"]["pending_bytes"] == 0

    table = status(denv, "--by-checkpoint")
    assert table.returncode == 0, table.stderr
    assert "run/step_100" in table.stdout and "in bucket" in table.stdout
    assert "error" in table.stdout and "AccessDenied" in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines())


def test_checkpoint_eta_counts_what_the_drain_sends_first(denv):
    denv.write_file("run/step_1/a", os.urandom(2 * MiB))
    denv.write_file("run/step_2/a", os.urandom(4 * MiB))
    denv.meta.write(lambda txn: txn.put_drain_status({"upload_rate_bytes_per_second": 2 * MiB}))
    r = rows(status_json(denv, "--by-checkpoint"))
    assert r["run/step_1"]["eta_seconds"] == 1.0  # oldest: sent first
    assert r["run/step_2"]["eta_seconds"] == 3.0  # after step_1's 2 MiB


def test_status_of_a_directory_that_is_no_cache_says_so(tmp_path):
    result = subprocess.run([*ckptfs_cmd(), "status", "--cache-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "no ckptfs cache here" in result.stderr


@pytest.mark.mounted
def test_wait_durable_stops_on_files_whose_cache_data_is_lost(gateway):
    """A file whose cache file lost unsynced bytes will never upload on its own: waiting ends."""
    (gateway.mnt / "ckpt").mkdir()
    (gateway.mnt / "ckpt" / "shard").write_bytes(b"x" * 4096)  # stays pending: the tests' drain settles for 1 h
    meta = CacheDir(gateway.cache).open_meta()
    try:
        def lose(txn):
            ino = txn.resolve(b"ckpt/shard")
            durability.mark_cache_lost(txn, ino, durability.CACHE_FILE_SHORT)

        meta.write(lose)
        meta.write(lambda txn: durability.mark_settled(txn, txn.resolve(b"ckpt")))  # only the file is left
    finally:
        meta.close()
    started = time.monotonic()
    result = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gateway.mnt / "ckpt"), "--timeout", "60"],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 1
    assert time.monotonic() - started < 30, "it waited for a file that cannot become durable"
    assert "ckpt/shard" in result.stderr and "CacheFileShort" in result.stderr
    assert "timed out" not in result.stderr

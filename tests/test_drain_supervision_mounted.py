"""A real mount whose drain cannot run, and a second mount on a taken metrics address: what
``ckptfs status`` and the metrics say about them."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

import conftest
from conftest import Gateway, ckptfs_cmd

from ckptfs.fsmeta.layout import CacheDir

from test_metrics_mounted import value

pytestmark = pytest.mark.mounted


def status(gw: Gateway, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([*ckptfs_cmd(), "status", str(gw.mnt), *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def status_json(gw: Gateway) -> dict:
    return json.loads(status(gw, "--json").stdout)


def poll(what: str, check, timeout: float = 90.0, interval: float = 0.5):
    return conftest.poll(what, check, timeout, interval)


def test_a_drain_that_dies_at_every_start_shows_crash_looping_in_status_and_metrics(gateway_factory):
    gw: Gateway = gateway_factory()
    cache = CacheDir(str(gw.cache))
    drain_pid = poll("the drain holds drain.lock", cache.drain_pid)
    report = status_json(gw)
    assert report["drain"]["state"] == "running" and report["drain"]["pid"] == drain_pid

    # The cache directory's drain.lock can no longer be opened (here: a directory took its
    # place), and the drain dies: every restart now fails at once.
    os.unlink(cache.drain_lock)
    os.mkdir(cache.drain_lock)
    os.kill(drain_pid, signal.SIGKILL)

    report = poll("status says crash-looping",
                  lambda: (r := status_json(gw))["drain"]["state"] == "crash-looping" and r)
    drain = report["drain"]
    assert drain["restarts"] >= 3 and drain["crash_looping_since"]
    assert "drain.lock" in drain["last_error"] and "Is a directory" in drain["last_error"]
    assert drain["last_exit"] == "exited 1"  # the third exit, which made it a loop, was a failed start
    text = status(gw).stdout
    assert "crash-looping since" in text and "Is a directory" in text
    assert "drain pid -" not in text

    scrape = gw.metrics()
    assert value(scrape, "ckptfs_drain_crash_looping") == 1.0
    assert value(scrape, "ckptfs_drain_restarts_total") >= 3

    # The mount keeps working meanwhile, and the gateway keeps trying: once the cause is
    # gone, the drain runs again without a remount.
    (gw.mnt / "still-works.txt").write_bytes(b"yes")
    assert (gw.mnt / "still-works.txt").read_bytes() == b"yes"
    os.rmdir(cache.drain_lock)
    poll("the drain runs again", cache.drain_pid, timeout=120)
    assert gw.stop() == 0


def test_a_mount_whose_metrics_address_is_taken_says_so_in_status_and_still_works(gateway_factory):
    first: Gateway = gateway_factory()
    second: Gateway = gateway_factory(start=False)
    second.metrics_port = first.metrics_port  # a second mount on this host with the same address
    second.start()

    taken = status_json(second)["metrics_endpoint"]
    assert taken["addr"] == f"127.0.0.1:{first.metrics_port}"
    assert taken["serving"] is False and "in use" in taken["error"]
    text = status(second).stdout
    assert "not served" in text and "in use" in text
    assert status_json(first)["metrics_endpoint"]["serving"] is True
    assert value(first.metrics(), "ckptfs_drain_crash_looping") == 0.0  # the address is the first's

    (second.mnt / "f").write_bytes(b"data")
    assert (second.mnt / "f").read_bytes() == b"data"
    assert second.stop() == 0 and first.stop() == 0

"""``ckptfs drain --cache-dir DIR`` as a process: flushing a cache after the gateway is gone, one drain per cache."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time

import blake3
import pytest

from conftest import REPO, ckptfs_cmd
from ckptfs.fsmeta.layout import CacheDir

from test_drain_support import MiB, denv  # noqa: F401


def run_cli(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*ckptfs_cmd(), *args], capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def fill(env) -> dict:
    files = {
        "run/step_1/model.pt": os.urandom(6 * MiB),  # multipart with the stored 5 MiB part size
        "run/step_1/.metadata": b"{}",
        "run/latest": b"step_1",
        "notes.txt": b"hello",
    }
    for path, data in files.items():
        env.write_file(path, data)
    env.mkdir("run/empty")
    env.meta.sync()
    return files


def test_drain_until_empty_flushes_a_cache_without_a_gateway(denv):
    files = fill(denv)
    result = run_cli("drain", "--cache-dir", str(denv.cache), "--until-empty")
    assert result.returncode == 0, result.stderr
    assert sorted(denv.listing()) == sorted([*files, "run/empty/"])
    for path, data in files.items():
        assert denv.object_bytes(path) == data
        assert denv.head(path).metadata["blake3"] == blake3.blake3(data).hexdigest()
        assert denv.state(path) == "durable"
    assert denv.pending() == {} and denv.tombstones() == {}
    assert CacheDir(denv.cache).drain_pid() is None


@contextlib.contextmanager
def running_drain(env):
    """``ckptfs drain --cache-dir`` in the background; killed at the end if it is still running."""
    proc = subprocess.Popen([*ckptfs_cmd(), "drain", "--cache-dir", str(env.cache)], cwd=str(REPO),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_second_drain_on_the_same_cache_is_refused(denv):
    fill(denv)
    with running_drain(denv) as first:
        deadline = time.monotonic() + 30
        while CacheDir(denv.cache).drain_pid() != first.pid:
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first drain never took drain.lock"
            time.sleep(0.05)

        second = run_cli("drain", "--cache-dir", str(denv.cache))
        assert second.returncode != 0
        assert "a drain is already running" in second.stderr and str(first.pid) in second.stderr

        # --until-empty next to a running drain waits for it to empty the queue, then succeeds.
        waiter = run_cli("drain", "--cache-dir", str(denv.cache), "--until-empty")
        assert waiter.returncode == 0, waiter.stderr
        assert denv.pending() == {} and denv.tombstones() == {}
        assert first.poll() is None, "a drain without --until-empty keeps running"

        first.send_signal(signal.SIGTERM)
        assert first.wait(20) == 0
    assert CacheDir(denv.cache).drain_pid() is None


def test_drain_of_a_directory_that_is_no_cache_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("drain", "--cache-dir", str(tmp_path / "empty"), "--until-empty")
    assert result.returncode != 0
    assert "no ckptfs cache here" in result.stderr
    assert "Traceback" not in result.stderr


def test_drain_with_an_unusable_bucket_fails_with_one_line(denv):
    denv.write_file("f", b"f")
    denv.bucket.rmdir()
    result = run_cli("drain", "--cache-dir", str(denv.cache), "--until-empty")
    assert result.returncode == 1
    assert "ckptfs: drain:" in result.stderr and "NoSuchBucket" in result.stderr
    assert "Traceback" not in result.stderr
    assert denv.state("f") == "dirty"


def test_a_drain_without_a_gateway_serves_the_nodes_metrics(denv):
    """After a crash (no gateway), `ckptfs drain` is what uploads: its progress must be scrapeable."""
    import urllib.request

    from conftest import free_port

    port = free_port()
    denv.meta.put_settings({**denv.settings.to_json(), "metrics_addr": f"127.0.0.1:{port}"})
    fill(denv)
    with running_drain(denv) as drain:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                if "ckptfs_dirty_files 0.0" in text and "ckptfs_uploaded_files_total 4.0" in text:
                    break
            except OSError:
                pass  # not listening yet
            assert drain.poll() is None, drain.stderr.read()
            assert time.monotonic() < deadline, "the drain's metrics never showed the cache drained"
            time.sleep(0.2)
        assert 'ckptfs_upload_request_duration_seconds_count{op="put"}' in text
        drain.send_signal(signal.SIGTERM)
        assert drain.wait(20) == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_stopped_metrics_endpoint_frees_its_port_for_the_next_drain(host):
    # A one-shot drain stops its endpoint at exit (woken by a connection rather than waiting
    # for the server's 0.5 s poll), also when bound to every address; the next drain or
    # gateway on the node then binds the same port.
    from conftest import free_port
    from prometheus_client import CollectorRegistry

    from ckptfs.drain import metrics

    port = free_port()
    server = metrics.serve(f"{host}:{port}", CollectorRegistry())
    assert server is not None
    metrics.stop(server)
    again = metrics.serve(f"{host}:{port}", CollectorRegistry())
    assert again is not None, "the port was still taken after stop()"
    metrics.stop(again)


def test_the_metrics_log_line_names_the_port_bound_for_port_0(caplog):
    # "--metrics-addr 127.0.0.1:0" lets the kernel pick a free port (scripts/pjdfstest.sh, the
    # demo): the log line is the only place that says which one it is.
    import urllib.request

    from prometheus_client import CollectorRegistry

    from ckptfs.drain import metrics

    with caplog.at_level(logging.INFO, logger="ckptfs.metrics"):
        server = metrics.serve("127.0.0.1:0", CollectorRegistry())
    assert server is not None
    try:
        port = server.server_address[1]
        assert port != 0
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("metrics on ")]
        assert lines == [f"metrics on http://127.0.0.1:{port}/metrics"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200
    finally:
        metrics.stop(server)

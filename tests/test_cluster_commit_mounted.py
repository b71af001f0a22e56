"""Cluster commit: a checkpoint written from several nodes is complete in the bucket before
its marker is (fsmeta/cluster.py).

Three mounts with their own cache directories share one file:// bucket; each writes its
rank's shard of one checkpoint. One node's drain is stopped (SIGSTOP), as a node whose
drain is behind: the marker written on another node must stay out of the bucket until that
node's shard is in it, whatever the timing, and then go out by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, ckptfs_cmd, needs_fuse, poll

pytestmark = [needs_fuse, pytest.mark.mounted]

INFLIGHT = ".ckptfs-inflight"


@pytest.fixture
def nodes(gateway_factory, tmp_path):
    config = tmp_path / "ckptfs.toml"
    config.write_text("[drain]\nsettle_seconds = 0.1\n[mount]\nremote_ttl = 1.0\n")
    first = gateway_factory(extra_args=("--config", str(config)))
    others = [gateway_factory(bucket=first.bucket, extra_args=("--config", str(config))) for _ in range(2)]
    made = [first, *others]
    yield made
    for gw in made:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(status(gw)["drain_pid"], signal.SIGCONT)
    for gw in made:
        assert not gw.unexpected(), gw.log()[-8000:]


def status(gw) -> dict:
    r = subprocess.run([*ckptfs_cmd(), "status", "--cache-dir", str(gw.cache), "--json"], capture_output=True,
                       text=True, timeout=60, cwd=str(REPO), check=True)
    return json.loads(r.stdout)


def wait_durable(gw, rel: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt / rel), *args], capture_output=True,
                          text=True, timeout=90, cwd=str(REPO))


def records(bucket: Path) -> list[str]:
    root = bucket / INFLIGHT
    return sorted(str(p.relative_to(root)) for p in root.rglob(".ckptfs-node-*")
                  if not p.name.endswith("-heartbeat")) if root.exists() else []


@contextlib.contextmanager
def drain_stopped(gw):
    pid = poll("the drain runs", lambda: status(gw)["drain_pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_marker_waits_until_every_node_s_shard_is_in_the_bucket(nodes):
    a, b, c = nodes
    step = "run/step_10"
    for gw in nodes:
        (gw.mnt / step).mkdir(parents=True, exist_ok=True)
    node_b = status(b)["node"]
    with drain_stopped(b):
        shards = {gw: f"{step}/__{rank}_0.distcp" for rank, gw in enumerate(nodes)}
        data = {gw: os.urandom(200_000 + rank) for rank, gw in enumerate(nodes)}
        for gw in nodes:
            (gw.mnt / shards[gw]).write_bytes(data[gw])
        # B's record is in the bucket before its close returned.
        assert any(r.startswith(f"run/step_10/.ckptfs-node-{node_b}-") for r in records(a.bucket))
        # (the framework's barrier) then rank 0 commits
        (a.mnt / step / ".metadata").write_text('{"ranks": 3}')
        poll("A's and C's shards drain", lambda: all((a.bucket / shards[gw]).exists() for gw in (a, c)))
        # (C's record goes once C's drain has seen its shard in: then only B holds the marker)
        poll("A shows its marker held by B alone",
             lambda: (status(a)["held_markers"].get(f"{step}/.metadata") or {}).get("nodes") == [node_b])
        assert not (a.bucket / step / ".metadata").exists()
        assert not (a.bucket / shards[b]).exists()
        # C has nothing of its own left to upload: it still waits for B's part, and names B.
        r = wait_durable(c, step, "--timeout", "2")
        assert r.returncode == 1 and node_b in r.stderr, r.stderr
        assert wait_durable(c, step, "--local", "--timeout", "30").returncode == 0
    # B drains: its shard, then (its record gone) A's marker.
    poll("the marker goes once B's shard is in", lambda: (a.bucket / step / ".metadata").exists(), timeout=60)
    for gw in nodes:
        assert (a.bucket / shards[gw]).read_bytes() == data[gw]
    poll("every record is deleted once its directory drained", lambda: records(a.bucket) == [])
    assert status(a)["held_markers"] == {}


def test_a_tracker_in_the_parent_waits_for_the_step_directory_another_node_holds(nodes):
    """Megatron: latest_checkpointed_iteration.txt beside iter_0000100/."""
    a, b, _ = nodes
    (a.mnt / "mega" / "iter_0000100").mkdir(parents=True)
    (b.mnt / "mega" / "iter_0000100").mkdir(parents=True, exist_ok=True)
    with drain_stopped(b):
        (a.mnt / "mega/iter_0000100/mp_rank_00.pt").write_bytes(b"rank 0")
        (b.mnt / "mega/iter_0000100/mp_rank_01.pt").write_bytes(b"rank 1")
        (a.mnt / "mega/latest_checkpointed_iteration.txt").write_text("100")
        poll("A's shard drains", lambda: (a.bucket / "mega/iter_0000100/mp_rank_00.pt").exists())
        poll("the tracker is held", lambda: status(a)["held_markers"].get("mega/latest_checkpointed_iteration.txt"))
        assert not (a.bucket / "mega/latest_checkpointed_iteration.txt").exists()
    poll("the tracker goes", lambda: (a.bucket / "mega/latest_checkpointed_iteration.txt").exists(), timeout=60)
    assert (a.bucket / "mega/iter_0000100/mp_rank_01.pt").read_bytes() == b"rank 1"


def test_the_marker_node_restarted_while_its_marker_is_held_still_holds_it(nodes):
    a, b, _ = nodes
    step = "run/step_20"
    (a.mnt / step).mkdir(parents=True)
    (b.mnt / step).mkdir(parents=True, exist_ok=True)
    with drain_stopped(b):
        (b.mnt / step / "__1_0.distcp").write_bytes(b"b's shard")
        with open(a.mnt / step / ".metadata", "w") as f:
            f.write("marker")
            f.flush()
            os.fsync(f.fileno())
        poll("the marker is held", lambda: status(a)["held_markers"].get(f"{step}/.metadata"))
        a.kill9()
        a.start()
        poll("the marker is held after a restart", lambda: status(a)["held_markers"].get(f"{step}/.metadata"))
        assert not (a.bucket / step / ".metadata").exists()
    poll("the marker goes once B's shard is in", lambda: (a.bucket / step / ".metadata").exists(), timeout=60)
    assert (a.bucket / step / "__1_0.distcp").read_bytes() == b"b's shard"


def test_one_node_alone_drains_its_checkpoint_and_leaves_no_record(gateway_factory, tmp_path):
    config = tmp_path / "ckptfs.toml"
    config.write_text("[drain]\nsettle_seconds = 0.1\n")
    gw = gateway_factory(extra_args=("--config", str(config)))
    (gw.mnt / "ck").mkdir()
    for i in range(5):
        (gw.mnt / "ck" / f"s{i}").write_bytes(b"x" * i)
    (gw.mnt / "ck" / ".metadata").write_text("m")
    r = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "60"], capture_output=True,
                       text=True, timeout=90, cwd=str(REPO))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (gw.bucket / "ck" / ".metadata").read_text() == "m"
    poll("the node's record and heartbeat are deleted",
         lambda: not any(p.is_file() for p in (gw.bucket / INFLIGHT).rglob("*")))
    assert sorted(os.listdir(gw.mnt)) == ["ck"]  # the records never show in the namespace

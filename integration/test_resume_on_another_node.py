"""Resume on another node: two mounts of one s3://bucket/prefix (radosgw), each with its own
cache directory. What A saves and drains, B (an empty cache: a new node, or a replaced cache
disk) shows with the same names and sizes, and loads bit for bit.

B reads the content through the read path (ranged GETs into its cache, blake3-checked).
"""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys

import pytest

from integration.test_drain_common import (  # noqa: F401 - fixtures
    mounts,
    needs_fuse,
    s3_env,
)

pytestmark = [needs_fuse, pytest.mark.radosgw]

FAST = {"settle_seconds": 0.2, "part_size": "5MiB", "concurrency": 4}

# One rank of a 2-rank DCP save (gloo on 127.0.0.1): argv rank world port checkpoint_dir.
DCP_SAVE_RANK = r"""
import os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
rank, world, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
dcp.save(state_for(rank), checkpoint_id=path)
dist.destroy_process_group()
"""

def state_for(rank: int) -> dict:
    """What rank ``rank`` saves: rank-local tensors and a replicated step (also the expected load)."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return {f"rank{rank}.w": torch.randn(512, 1024, generator=g), f"rank{rank}.b": torch.randn(1024, generator=g),
            "step": torch.tensor(10)}


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _two_nodes(s3_server, s3_bucket, mounts, prefix: str):
    a = mounts(s3_server, s3_bucket, prefix, drain=FAST, name="a").start()
    b = mounts(s3_server, s3_bucket, prefix, drain=FAST, name="b").start()
    assert a.cache != b.cache
    return a, b


def _tree(root) -> dict[str, int]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = os.stat(path).st_size
    return out


def _dcp_saved_through_a(s3_server, s3_bucket, mounts):
    pytest.importorskip("torch", reason="torch is not installed (an optional test dependency)")
    a, b = _two_nodes(s3_server, s3_bucket, mounts, "jobs/dcp")
    ckpt = a.mnt / "step_10"
    port = _free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", inspect.getsource(state_for) + DCP_SAVE_RANK, str(r), "2", port, str(ckpt)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    a.wait_durable(timeout=120)
    return a, b


def test_dcp_checkpoint_saved_through_a_is_visible_on_b(s3_server, s3_bucket, mounts):
    a, b = _dcp_saved_through_a(s3_server, s3_bucket, mounts)
    saved = _tree(a.mnt / "step_10")
    assert set(saved) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert _tree(b.mnt / "step_10") == saved
    assert os.getxattr(b.mnt / "step_10" / "__1_0.distcp", "user.ckptfs.state") == b"remote"


def test_dcp_checkpoint_saved_through_a_loads_through_b_bit_for_bit(s3_server, s3_bucket, mounts):
    import torch
    import torch.distributed.checkpoint as dcp

    _, b = _dcp_saved_through_a(s3_server, s3_bucket, mounts)
    expected = {**state_for(0), **state_for(1)}
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=str(b.mnt / "step_10"), no_dist=True)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def _torch_saved_through_a(s3_server, s3_bucket, mounts):
    torch = pytest.importorskip("torch", reason="torch is not installed (an optional test dependency)")
    a, b = _two_nodes(s3_server, s3_bucket, mounts, "jobs/pt")
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(512, 1024), "emb": torch.randn(4096, 256)}, "step": 100}
    (a.mnt / "step_100").mkdir()
    tmp, final = a.mnt / "step_100" / "model.pt.tmp", a.mnt / "step_100" / "model.pt"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    a.wait_durable(timeout=120)
    return a, b, state


def test_torch_save_through_a_is_visible_on_b(s3_server, s3_bucket, mounts):
    a, b, _ = _torch_saved_through_a(s3_server, s3_bucket, mounts)
    assert os.listdir(b.mnt / "step_100") == ["model.pt"]
    sa, sb = os.stat(a.mnt / "step_100" / "model.pt"), os.stat(b.mnt / "step_100" / "model.pt")
    assert (sb.st_size, sb.st_mode, sb.st_uid, sb.st_gid, sb.st_mtime_ns) == (
        sa.st_size, sa.st_mode, sa.st_uid, sa.st_gid, sa.st_mtime_ns)


def test_torch_save_through_a_loads_through_b_bit_for_bit(s3_server, s3_bucket, mounts):
    import torch

    a, b, state = _torch_saved_through_a(s3_server, s3_bucket, mounts)
    assert (b.mnt / "step_100" / "model.pt").read_bytes() == (a.mnt / "step_100" / "model.pt").read_bytes()
    loaded = torch.load(b.mnt / "step_100" / "model.pt", weights_only=True)
    assert loaded["step"] == 100
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value), key


def test_a_remote_file_renamed_on_b_reads_back_after_its_copy(s3_server, s3_bucket, mounts):
    """radosgw: A uploads a file in parts; B (which never cached it) renames it, its drain
    moves the object with a server-side copy, and the file reads back on B at once. (radosgw
    keeps a multipart object's ETag on copy, AWS S3 gives the copy a new one: the drain
    records the copy's ETag either way; tests/regressions/test_readpath_model_found.py
    emulates S3's behaviour on a file:// bucket.)"""
    a, b = _two_nodes(s3_server, s3_bucket, mounts, "jobs/rename")
    data = os.urandom(6 << 20)  # above the 5 MiB part size: a multipart object
    (a.mnt / "shard.pt").write_bytes(data)
    a.wait_durable(timeout=120)
    os.rename(b.mnt / "shard.pt", b.mnt / "moved.pt")
    b.wait_durable(timeout=120)
    assert os.getxattr(b.mnt / "moved.pt", "user.ckptfs.state") == b"remote"
    assert (b.mnt / "moved.pt").read_bytes() == data

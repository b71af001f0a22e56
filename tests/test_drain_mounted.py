"""Smoke test through a real mount: a torch.save-like writer, wait-durable, the state xattr, umount --wait-durable."""

from __future__ import annotations

import os
import subprocess

import blake3
import pytest

from conftest import REPO, ckptfs_cmd, needs_fuse

pytestmark = [needs_fuse, pytest.mark.mounted]

MiB = 1 << 20


def torch_save_like(path, data: bytes) -> None:
    """Write a temp file, fsync it, rename it over the final name (what torch.save + atomic rename does)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        for off in range(0, len(data), 1 * MiB):
            fh.write(data[off:off + MiB])
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path)


def cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([*ckptfs_cmd(), *args], capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def bucket_keys(root) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.startswith(".ckptfs-"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(k for k in out if not k.startswith(".ckptfs-"))


def test_checkpoint_through_the_mount_becomes_durable(gateway_factory, tmp_path):
    config = tmp_path / "ckptfs.toml"
    config.write_text("[drain]\nsettle_seconds = 0.2\n")
    gw = gateway_factory(extra_args=("--config", str(config)))
    step = gw.mnt / "run" / "step_1"
    step.mkdir(parents=True)
    model = os.urandom(6 * MiB + 3)
    torch_save_like(step / "model.pt", model)
    torch_save_like(step / ".metadata", b'{"step": 1}')

    result = cli("wait-durable", str(gw.mnt), "--timeout", "30")
    assert result.returncode == 0, result.stderr + gw.log()[-4000:]
    assert (gw.bucket / "run/step_1/model.pt").read_bytes() == model
    assert (gw.bucket / "run/step_1/.metadata").read_bytes() == b'{"step": 1}'
    assert not [k for k in bucket_keys(gw.bucket) if k.endswith(".tmp")]
    assert os.getxattr(step / "model.pt", "user.ckptfs.state") == b"durable"
    assert os.getxattr(step / "model.pt", "user.ckptfs.blake3").decode() == blake3.blake3(model).hexdigest()
    assert os.getxattr(step, "user.ckptfs.state") == b"durable"

    # Written just before the unmount: umount --wait-durable waits for it.
    latest = b"step_1"
    torch_save_like(gw.mnt / "run" / "latest", latest)
    result = cli("umount", str(gw.mnt), "--wait-durable", "--timeout", "30")
    assert result.returncode == 0, result.stderr + gw.log()[-4000:]
    assert not os.path.ismount(gw.mnt)
    assert (gw.bucket / "run/latest").read_bytes() == latest
    assert gw.proc.wait(20) == 0

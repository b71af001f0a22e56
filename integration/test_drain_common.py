"""Shared helpers for the drain integration tests (``test_drain_*.py``) and ``bench_drain.py``.

No tests here. :class:`Mount` runs ``ckptfs mount s3://… --foreground`` in its
own session (so the gateway and its drain form one process group that a crash
test can ``kill -9``), against radosgw directly or through
:class:`integration.faultproxy.FaultProxy`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest

from integration.faultproxy import FaultProxy

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def ckptfs_cmd() -> list[str]:
    script = Path(sys.executable).parent / "ckptfs"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "ckptfs"]


def fuse_skip_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not accessible"
    if subprocess.run(["which", "fusermount3"], capture_output=True).returncode != 0:
        return "fusermount3 is not installed"
    return None


needs_fuse = pytest.mark.skipif(fuse_skip_reason() is not None, reason=fuse_skip_reason() or "")


def s3_env(s3, **extra) -> dict:
    env = dict(os.environ)
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        env.pop(k, None)
    env.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key,
               AWS_DEFAULT_REGION=s3.region, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def toml_config(path: Path, drain: dict | None = None, cache: dict | None = None,
                cluster: dict | None = None) -> Path:
    def val(v):
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return str(v)

    lines = []
    for table, values in (("drain", drain), ("cache", cache), ("cluster", cluster)):
        if values:
            lines.append(f"[{table}]")
            lines += [f"{k} = {val(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_file(path, data: bytes, *, fsync: bool = True, chunk: int = 4 * MiB) -> str:
    """Write ``data`` (in chunks), fsync, close; return its blake3 hex.

    Missing parent directories are created here, right before the file: a directory
    left empty for longer than settle_seconds gets a ``dir/`` marker object, which
    stays after files are added (the expected listings of the tests have none).
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        mv = memoryview(data)
        for off in range(0, len(mv), chunk):
            f.write(mv[off:off + chunk])
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return blake3.blake3(data).hexdigest()


def rand(n: int, seed: int) -> bytes:
    """Incompressible pseudo-random bytes, cheap to make (repeated 1 MiB random block + counter)."""
    import random

    r = random.Random(seed)
    block = r.randbytes(MiB)
    out = bytearray(n)
    for i, off in enumerate(range(0, n, MiB)):
        piece = (i.to_bytes(8, "little") + block[8:])[: min(MiB, n - off)]
        out[off:off + len(piece)] = piece
    return bytes(out)


class Mount:
    """One ``ckptfs mount`` of ``s3://bucket/prefix`` in the foreground, in its own session."""

    def __init__(self, s3, bucket: str, prefix: str, base: Path, *, endpoint: str | None = None,
                 drain: dict | None = None, fsync: str | None = None, cache_dir: Path | None = None,
                 name: str = "m", env: dict | None = None, cache: dict | None = None,
                 fuse_io_uring: str | None = None, cluster: dict | None = None):
        self.s3 = s3
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.base = Path(base)
        self.endpoint = endpoint or s3.endpoint_url
        self.mnt = self.base / f"{name}-mnt"
        self.cache = cache_dir or self.base / f"{name}-cache"
        self.log_path = self.base / f"{name}-gateway.log"
        self.config = toml_config(self.base / f"{name}.toml", drain or {}, cache, cluster)
        self.fsync = fsync
        self.fuse_io_uring = fuse_io_uring  # --fuse-io-uring (None: the gateway's default, auto)
        self.env = env or s3_env(s3)
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def argv(self) -> list[str]:
        argv = [*ckptfs_cmd(), "mount", self.url, str(self.mnt), "--endpoint-url", self.endpoint,
                "--cache-dir", str(self.cache), "--foreground", "--metrics-addr", "127.0.0.1:0",
                "--config", str(self.config)]
        if self.fsync:
            argv += ["--fsync", self.fsync]
        if self.fuse_io_uring:
            argv += ["--fuse-io-uring", self.fuse_io_uring]
        return argv

    def start(self, timeout: float = 60.0) -> Mount:
        self.mnt.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                     cwd=str(REPO))
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mount exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill_group()
                raise RuntimeError(f"mount did not come up in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def path(self, rel: str) -> Path:
        return self.mnt / rel

    def path_mk(self, rel: str) -> Path:
        """``path(rel)`` after creating its parent directories."""
        p = self.mnt / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    # -- processes -------------------------------------------------------------------

    def drain_pid(self, timeout: float = 30.0) -> int:
        """Pid of the drain: the holder of CACHE/drain.lock, checked to be the gateway's child."""
        from ckptfs.fsmeta.layout import CacheDir

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = CacheDir(self.cache).drain_pid()
            if pid and pid > 0 and self.proc is not None and _ppid(pid) == self.proc.pid:
                return pid
            time.sleep(0.05)
        raise AssertionError(f"no drain child of the gateway holds drain.lock\n{self.log_tail()}")

    def kill_drain(self) -> int:
        pid = self.drain_pid()
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        return pid

    def kill_group(self) -> None:
        """``kill -9`` of the gateway's whole process group (gateway + drain), then clear the dead mount."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        # the children too (the drain may take a moment to be reaped by init)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.05)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        self._close_log()

    def unmount(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            rc = -9
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.05)
        self._close_log()
        return rc

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- CLI ---------------------------------------------------------------------------

    def wait_durable(self, rel: str = "", timeout: float = 120.0) -> None:
        r = subprocess.run([*ckptfs_cmd(), "wait-durable", str(self.mnt / rel), "--timeout", str(timeout)],
                           capture_output=True, text=True, env=self.env, timeout=timeout + 30)
        assert r.returncode == 0, f"wait-durable failed: {r.stderr}\n{self.log_tail()}"

    def status(self) -> dict:
        import json

        r = subprocess.run([*ckptfs_cmd(), "status", "--cache-dir", str(self.cache), "--json"],
                           capture_output=True, text=True, env=self.env, timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def state(self, rel: str) -> str:
        return os.getxattr(self.mnt / rel, "user.ckptfs.state").decode()

    def fsmeta_upload(self, rel: str):
        """The fsmeta UploadRecord of a file (read from the cache directory), or None."""
        from ckptfs.fsmeta import MetaStore

        meta = MetaStore(str(self.cache / "meta"), create=False)
        try:
            with meta.read() as txn:
                ino = txn.resolve(os.fsencode(rel))
                return None if ino is None else txn.get_upload(ino)
        finally:
            meta.close()


def drain_until_empty(cache: Path, env: dict, timeout: float = 180.0) -> subprocess.CompletedProcess:
    return subprocess.run([*ckptfs_cmd(), "drain", "--cache-dir", str(cache), "--until-empty"],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


# -- bucket checks -----------------------------------------------------------------------------


def listing(client, bucket: str, prefix: str = "") -> dict[str, dict]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o
    return out


def open_uploads(client, bucket: str) -> list[dict]:
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def object_blake3(client, bucket: str, key: str) -> tuple[str, dict]:
    """(blake3 hex of the GET body, user metadata)."""
    r = client.get_object(Bucket=bucket, Key=key)
    h = blake3.blake3()
    body = r["Body"]
    for chunk in iter(lambda: body.read(8 * MiB), b""):
        h.update(chunk)
    return h.hexdigest(), r.get("Metadata", {})


def assert_bucket_matches(client, bucket: str, expected: dict[str, str], prefix: str = "", *,
                          ignore_dir_markers: bool = False) -> None:
    """The bucket under ``prefix`` holds exactly ``expected`` ({key: blake3}), byte-identical,
    each with a matching x-amz-meta-blake3, and no multipart upload is open. The drain deletes
    a node's in-flight records (and its heartbeat) within a second or so of the files they
    cover being durable: they are waited for, then must be gone like any other object."""
    deadline = time.monotonic() + 30
    while any(".ckptfs-inflight/" in k for k in listing(client, bucket, prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    keys = set(listing(client, bucket, prefix))
    if ignore_dir_markers:  # (a directory left empty for a while may have got its dir/ marker)
        keys = {k for k in keys if not k.endswith("/")}
    assert keys == set(expected), f"listing {sorted(keys)} != expected {sorted(expected)}"
    for key, digest in expected.items():
        got, meta = object_blake3(client, bucket, key)
        assert got == digest, f"{key}: content differs"
        assert meta.get("blake3") == digest, f"{key}: x-amz-meta-blake3 {meta.get('blake3')} != {digest}"
    assert open_uploads(client, bucket) == [], "multipart uploads left open"


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def proxy(s3_server):
    p = FaultProxy(s3_server.endpoint_url, seed=1234).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def mounts(tmp_path):
    """Factory: ``mounts(s3, bucket, prefix, **kw)``; every mount is unmounted (or killed) afterwards."""
    started: list[Mount] = []

    def make(s3, bucket, prefix="", **kw) -> Mount:
        kw.setdefault("name", f"m{len(started)}")
        m = Mount(s3, bucket, prefix, tmp_path, **kw)
        started.append(m)
        return m

    yield make
    for m in started:
        if m.proc is not None and m.proc.poll() is None:
            m.unmount(timeout=30)
        if m.proc is not None and _group_alive(m.proc.pid):
            m.kill_group()
        subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], capture_output=True)

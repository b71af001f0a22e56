"""Throwaway S3 servers for ckptfs integration tests and benchmarks.

Two kinds of server are supported:

* ``radosgw``: a real single-node Ceph cluster (one mon, one mgr, one
  bluestore OSD backed by a sparse file, one radosgw) built from the Debian 12
  packages (Ceph 16.2 "pacific"), everything living under one work directory.
  See :func:`start_radosgw` and ``integration/README.md``.
* ``moto``: ``python -m moto.server`` from the current interpreter, for quick
  tests that need no real S3 semantics (:func:`start_moto`).

Only the standard library and boto3 are used.

Developer usage::

    python -m integration.s3server --workdir /tmp/rgw     # prints export lines

"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "S3Server",
    "S3ServerError",
    "CEPH_BINARIES",
    "CEPH_PACKAGES",
    "ensure_ceph_installed",
    "start_radosgw",
    "start_moto",
    "start_from_env",
]

REGION = "us-east-1"

#: Binaries the radosgw harness needs.
CEPH_BINARIES = (
    "ceph-mon",
    "ceph-osd",
    "ceph-mgr",
    "radosgw",
    "radosgw-admin",
    "ceph",
    "monmaptool",
)

#: Minimal Debian package set providing :data:`CEPH_BINARIES` (installed with
#: ``--no-install-recommends`` so that e.g. ceph-mgr-dashboard, ceph-volume's
#: extra tooling recommendations and friends are not pulled in).
CEPH_PACKAGES = ("ceph-mon", "ceph-osd", "ceph-mgr", "radosgw", "ceph-common")

# Fixed, well-known test credentials for the radosgw user (20 / 40 chars like
# AWS keys).  They only ever protect a throwaway server bound to 127.0.0.1.
RGW_ACCESS_KEY = "CKPTFSTESTACCESSKEY0"
RGW_SECRET_KEY = "ckptfsTestSecretKey000000000000000000000"
RGW_USER = "ckptfs"

MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"


class S3ServerError(RuntimeError):
    """Raised when a server cannot be installed, started or reached."""


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (sockets are held open together to avoid dups)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path | str, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(data.splitlines()[-lines:])


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # pragma: no cover - best effort only
        pass


# ---------------------------------------------------------------------------
# the server object
# ---------------------------------------------------------------------------


class S3Server:
    """A running (or external) S3 endpoint.

    Attributes: ``endpoint_url``, ``access_key``, ``secret_key``, ``region``,
    ``kind`` ("radosgw", "moto" or, for a server given by
    ``CKPTFS_S3_ENDPOINT``, whatever ``CKPTFS_S3`` says / "external"),
    ``workdir`` (None for external servers), ``https_endpoint_url`` and
    ``ca_bundle`` (only when radosgw was started with ``tls=True``),
    ``startup_seconds``.
    """

    def __init__(
        self,
        *,
        endpoint_url: str,
        access_key: str,
        secret_key: str,
        kind: str,
        region: str = REGION,
        workdir: Path | None = None,
        https_endpoint_url: str | None = None,
        ca_bundle: str | None = None,
        remove_workdir: bool = False,
    ) -> None:
        self.endpoint_url = endpoint_url
        self.access_key = access_key
        self.secret_key = secret_key
        self.kind = kind
        self.region = region
        self.workdir = Path(workdir) if workdir is not None else None
        self.https_endpoint_url = https_endpoint_url
        self.ca_bundle = ca_bundle
        self.startup_seconds: float | None = None
        self.timings: dict[str, float] = {}
        self.extra_dirs: list[Path] = []
        self._procs: dict[str, subprocess.Popen] = {}
        self._pgid: int | None = None
        self._remove_workdir = remove_workdir
        self._stopped = False
        self._lock = threading.Lock()

    # -- process bookkeeping (used by the start_* functions) ---------------

    def _spawn(self, name: str, argv: Sequence[str], *, env: dict | None = None,
               log_path: Path, die_with_parent: bool = True) -> subprocess.Popen:
        """Start a daemon in the server's process group, output to log_path."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
        try:
            kwargs: dict = {}
            # all daemons share one new process group (led by the first) so
            # stop() can signal them together; a new *session* is avoided
            # because setpgid() cannot join a group in another session.
            kwargs["process_group"] = 0 if self._pgid is None else self._pgid
            if die_with_parent:
                kwargs["preexec_fn"] = _die_with_parent
            p = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=env, close_fds=True, **kwargs,
            )
        finally:
            out.close()
        if self._pgid is None:
            self._pgid = p.pid
        self._procs[name] = p
        if self.workdir is not None:
            piddir = self.workdir / "pids"
            piddir.mkdir(parents=True, exist_ok=True)
            (piddir / f"{name}.pid").write_text(f"{p.pid}\n")
        return p

    @property
    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self._procs.items() if p.poll() is None}

    def rss_bytes(self) -> dict[str, int]:
        """Resident set size of each live daemon (from /proc)."""
        out = {}
        for name, pid in self.pids.items():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) * 1024
            except OSError:
                pass
        return out

    # -- public API ---------------------------------------------------------

    def client_kwargs(self, *, tls: bool = False) -> dict:
        """Keyword arguments for boto3/aiobotocore ``client("s3", **kw)``
        (without ``config``)."""
        if tls:
            if not self.https_endpoint_url:
                raise S3ServerError("server was not started with tls=True")
            return dict(endpoint_url=self.https_endpoint_url,
                        aws_access_key_id=self.access_key,
                        aws_secret_access_key=self.secret_key,
                        region_name=self.region, verify=self.ca_bundle)
        return dict(endpoint_url=self.endpoint_url,
                    aws_access_key_id=self.access_key,
                    aws_secret_access_key=self.secret_key,
                    region_name=self.region)

    def boto_config(self, **overrides):
        """A ``botocore.config.Config`` suitable for this server.

        Path-style addressing, and for radosgw
        ``request_checksum_calculation="when_required"`` /
        ``response_checksum_validation="when_required"``: botocore >= 1.36
        otherwise sends flexible (x-amz-checksum-*) checksums, which radosgw
        16.2 ignores over http and *rejects* over https (aws-chunked trailer
        -> MissingContentLength).  See README.md.
        """
        from botocore.config import Config

        kw: dict = dict(s3={"addressing_style": "path"},
                        retries={"max_attempts": 3, "mode": "standard"},
                        connect_timeout=10, read_timeout=120)
        if self.kind == "radosgw":
            kw["request_checksum_calculation"] = "when_required"
            kw["response_checksum_validation"] = "when_required"
        kw.update(overrides)
        return Config(**kw)

    def client(self, *, tls: bool = False, **config_overrides):
        """A boto3 S3 client for this server (see :meth:`boto_config`)."""
        import boto3

        return boto3.client("s3", config=self.boto_config(**config_overrides),
                            **self.client_kwargs(tls=tls))

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if we already own it)."""
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def stop(self, remove: bool | None = None) -> None:
        """Kill every daemon (whole process group) and optionally rm workdir.

        The radosgw cluster is throwaway, so daemons get SIGKILL right away:
        there is nothing worth flushing and a graceful radosgw shutdown can
        hang for a long time once the mon/OSD are gone.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        # Signal the group only while one of our daemons is still alive: the
        # group id cannot have been reused by then.
        if self._pgid is not None and any(p.poll() is None for p in self._procs.values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pgid, signal.SIGKILL)
        for p in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.kill()  # no-op for already reaped processes
        for p in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        if remove is None:
            remove = self._remove_workdir
        for d in self.extra_dirs:
            shutil.rmtree(d, ignore_errors=True)
        if remove and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"S3Server(kind={self.kind!r}, endpoint_url={self.endpoint_url!r})"


# ---------------------------------------------------------------------------
# readiness probing
# ---------------------------------------------------------------------------


def _s3_list_buckets_ok(server: S3Server) -> tuple[bool, str]:
    try:
        from botocore.config import Config
        import boto3

        c = boto3.client(
            "s3", config=Config(s3={"addressing_style": "path"},
                                retries={"max_attempts": 1},
                                connect_timeout=2, read_timeout=5),
            **server.client_kwargs())
        c.list_buckets()
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure means "not ready"
        return False, f"{type(e).__name__}: {e}"


def _wait_s3(server: S3Server, timeout: float, procs: dict[str, subprocess.Popen],
             logs: Iterable[Path]) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        ok, last = _s3_list_buckets_ok(server)
        if ok:
            return
        for name, p in procs.items():
            if p.poll() is not None:
                raise S3ServerError(
                    f"{name} exited with code {p.returncode} while waiting for "
                    f"S3 at {server.endpoint_url}\n" + _log_tails(logs))
        if time.monotonic() > deadline:
            raise S3ServerError(
                f"S3 at {server.endpoint_url} did not answer ListBuckets within "
                f"{timeout:.0f}s (last error: {last})\n" + _log_tails(logs))
        time.sleep(0.1)


def _log_tails(logs: Iterable[Path], lines: int = 30) -> str:
    parts = []
    for p in logs:
        if Path(p).exists():
            parts.append(f"----- tail of {p} -----\n{_tail(p, lines)}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# Ceph installation
# ---------------------------------------------------------------------------


def _missing_binaries() -> list[str]:
    return [b for b in CEPH_BINARIES if shutil.which(b) is None]


def ensure_ceph_installed(*, quiet: bool = True) -> None:
    """Make sure the Ceph daemons and tools are installed (Debian packages).

    If any of :data:`CEPH_BINARIES` is missing, runs ``apt-get update`` and
    ``apt-get install -y --no-install-recommends`` :data:`CEPH_PACKAGES`.
    A ``/usr/sbin/policy-rc.d`` that exits 101 is put in place for the
    duration of the install (unless one already exists) so the maintainer
    scripts never start ceph services; we run the daemons ourselves.
    """
    missing = _missing_binaries()
    if not missing:
        return
    if os.geteuid() != 0:
        raise S3ServerError(
            f"Ceph binaries missing ({', '.join(missing)}) and not root; run: "
            "sudo apt-get install -y --no-install-recommends "
            + " ".join(CEPH_PACKAGES))
    if shutil.which("apt-get") is None:
        raise S3ServerError(f"Ceph binaries missing ({', '.join(missing)}) "
                            "and apt-get is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive",
               NEEDRESTART_MODE="l")
    policy = Path("/usr/sbin/policy-rc.d")
    created_policy = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\n# installed by ckptfs integration/s3server.py\nexit 101\n")
        policy.chmod(0o755)
        created_policy = True
    out = subprocess.DEVNULL if quiet else None
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    try:
        for argv in (["apt-get", *lock, "update", "-q"],
                     ["apt-get", *lock, "install", "-y", "-q",
                      "--no-install-recommends", *CEPH_PACKAGES]):
            r = subprocess.run(argv, env=env, stdout=out,
                               stderr=subprocess.PIPE, text=True)
            if r.returncode != 0:
                raise S3ServerError(
                    f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    finally:
        if created_policy:
            with contextlib.suppress(OSError):
                policy.unlink()
    still = _missing_binaries()
    if still:
        raise S3ServerError(f"after installing {CEPH_PACKAGES}, still missing: {still}")


# ---------------------------------------------------------------------------
# radosgw
# ---------------------------------------------------------------------------


def _ceph_conf(*, fsid: str, mon_port: int, rgw_port: int, d: dict[str, Path],
               lc_debug_interval: int, osd_size_bytes: int,
               osd_memory_target: int, tls: tuple[int, Path, Path] | None,
               rgw_threads: int) -> str:
    frontends = f"beast endpoint=127.0.0.1:{rgw_port}"
    if tls:
        tls_port, crt, key = tls
        frontends += (f" ssl_endpoint=127.0.0.1:{tls_port}"
                      f" ssl_certificate={crt} ssl_private_key={key}")
    return f"""\
# Generated by ckptfs integration/s3server.py: a throwaway single-node cluster.
[global]
fsid = {fsid}
mon_host = [v2:127.0.0.1:{mon_port}]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_ipv6 = false
# msgr v2 only: one port for the mon, fewer sockets.
ms_bind_msgr1 = false
ms_bind_msgr2 = true
# cephx off: nothing to provision, no keyrings.
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
# with auth none the "secure" msgr2 mode cannot be negotiated: crc everywhere.
ms_cluster_mode = crc
ms_service_mode = crc
ms_client_mode = crc
ms_mon_cluster_mode = crc
ms_mon_service_mode = crc
ms_mon_client_mode = crc
run_dir = {d['run']}
admin_socket = {d['run']}/$name.asok
pid_file = {d['run']}/$name.pid
log_file = {d['log']}/$name.log
log_to_stderr = false
err_to_stderr = true
mon_cluster_log_file = {d['log']}/cluster.log
crash_dir = {d['crash']}
# one OSD: replicas of 1, few PGs, no autoscaler, everything on one host.
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_max_pg_per_osd = 1000
osd_crush_chooseleaf_type = 0
mon_warn_on_pool_no_redundancy = false
mon_warn_on_insecure_global_id_reclaim = false
mon_warn_on_insecure_global_id_reclaim_allowed = false
# the mon batches paxos proposals every 1s by default; every pool create,
# OSD boot and crush update waits for that.  Propose quickly instead.
paxos_propose_interval = 0.05
paxos_min_wait = 0.01
mon_osd_prime_pg_temp = false

[mon]
mon_data = {d['mon']}
# the store lives in a test dir on a possibly busy disk: never refuse to run.
mon_data_avail_crit = 0
mon_data_avail_warn = 0
mon_allow_pool_delete = true

[mgr]
mgr_data = {d['mgr']}
# keep the mgr small and quick to start: by default it imports every python
# module it ships (~300 MiB RSS, several CPU-seconds).  Only "status" (for
# `ceph -s`/`ceph df`-style reporting) is kept; the mgr core still collects
# PG/OSD stats.
mgr_initial_modules =
mgr_disabled_modules = {_MGR_DISABLED}

[osd]
osd_data = {d['osd']}
osd_objectstore = bluestore
# bluestore on a sparse FILE instead of a block device.
bluestore_block_path = {d['block']}
bluestore_block_create = true
bluestore_block_size = {osd_size_bytes}
bluestore_block_db_create = false
bluestore_block_wal_create = false
bluestore_fsck_on_mkfs = false
bluestore_fsck_on_mount = false
# the aio reaper polls every 250ms and every bdev close waits for it; the OSD
# opens/closes the device ~8 times while starting.
bdev_aio_poll_ms = 10
# memory: the defaults (4 GiB target, 256 MiB x 4 rocksdb memtables) are for
# dedicated storage nodes, not for a daemon sitting next to a test suite.
osd_memory_target = {osd_memory_target}
bluestore_cache_autotune = false
bluestore_cache_size = 134217728
bluestore_rocksdb_options = compression=kNoCompression,max_write_buffer_number=2,min_write_buffer_number_to_merge=1,recycle_log_file_num=2,write_buffer_size=33554432,writable_file_max_buffer_size=0,compaction_readahead_size=2097152,max_background_compactions=1,max_total_wal_size=268435456
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 2
# no scrubbing in a throwaway cluster
osd_scrub_min_interval = 31536000
osd_scrub_max_interval = 31536000
osd_deep_scrub_interval = 31536000
osd_scrub_during_recovery = false

[client]
log_file = {d['log']}/$name.log
rgw_data = {d['rgw']}
rgw_frontends = {frontends}
rgw_thread_pool_size = {rgw_threads}
# lifecycle: with a debug interval > 0 a lifecycle "day" lasts this many
# seconds and the LC worker runs every interval regardless of
# rgw_lifecycle_work_time.
rgw_lc_debug_interval = {lc_debug_interval}
# deleted objects' space is reclaimed after minutes, not hours
rgw_gc_obj_min_wait = 60
rgw_gc_processor_period = 60
rgw_gc_processor_max_time = 60
rgw_enable_usage_log = false
rgw_enable_ops_log = false
# allow SSE-C etc. over plain http (loopback only)
rgw_crypt_require_ssl = false
"""


_MGR_DISABLED = " ".join("""
alerts balancer crash dashboard devicehealth diskprediction_local influx
insights iostat k8sevents localpool mds_autoscaler mirroring nfs orchestrator
osd_perf_query osd_support pg_autoscaler progress prometheus rbd_support
restful rook selftest snap_schedule stats telegraf telemetry
test_orchestrator volumes zabbix cephadm
""".split())


class _Runner:
    """Runs short admin commands against the cluster with good error reports."""

    def __init__(self, env: dict, logdir: Path, server: S3Server) -> None:
        self.env = env
        self.logdir = logdir
        self.server = server

    def __call__(self, *argv: str, timeout: float = 60, check: bool = True) -> str:
        try:
            r = subprocess.run(list(argv), env=self.env, capture_output=True,
                               text=True, timeout=timeout,
                               preexec_fn=_die_with_parent)
        except subprocess.TimeoutExpired as e:
            raise S3ServerError(
                f"{' '.join(argv)} timed out after {timeout}s\n"
                f"stderr: {(e.stderr or b'')[-2000:]!r}\n" + self._tails()) from None
        if check and r.returncode != 0:
            raise S3ServerError(
                f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-4000:]}\n"
                + self._tails())
        return r.stdout

    def _tails(self) -> str:
        return _log_tails(sorted(self.logdir.glob("*.log")) +
                          sorted(self.logdir.glob("*.out")), lines=15)


def _wait_until(pred, timeout: float, what: str, server: S3Server, logs, interval=0.1):
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return
        for name, p in server._procs.items():
            if p.poll() is not None:
                raise S3ServerError(
                    f"{name} exited with code {p.returncode} while waiting for "
                    f"{what}\n" + _log_tails(logs))
        if time.monotonic() > deadline:
            raise S3ServerError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                                + _log_tails(logs))
        time.sleep(interval)


def _make_cert(directory: Path) -> tuple[Path, Path]:
    crt, key = directory / "rgw.crt", directory / "rgw.key"
    if shutil.which("openssl") is None:
        raise S3ServerError("tls=True needs the openssl command line tool")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
         "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
         str(key), "-out", str(crt), "-days", "30", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True)
    return crt, key


def _check_o_direct(directory: Path) -> None:
    """bluestore opens its block file with O_DIRECT (tmpfs can't do that)."""
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as e:
        raise S3ServerError(
            f"{directory} does not support O_DIRECT ({e}); bluestore needs it for "
            "its block file: use a workdir on a disk filesystem (ext4/xfs/btrfs), "
            "not tmpfs") from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def start_radosgw(
    workdir: str | os.PathLike,
    *,
    lc_debug_interval: int = 10,
    storage_classes: Sequence[str] = ("COLD",),
    port: int | None = None,
    tls: bool = False,
    with_mgr: bool = True,
    osd_size_gib: int = 10,
    osd_memory_target: int = 768 * 1024 * 1024,
    rgw_threads: int = 64,
    timeout: float = 180,
    remove_workdir_on_stop: bool = False,
    die_with_parent: bool = True,
    install: bool = True,
) -> S3Server:
    """Build and start a throwaway single-node Ceph cluster + radosgw.

    Everything (config, mon store, OSD block file, logs, pids, sockets) lives
    under ``workdir`` (created; must be empty or absent).  Returns a ready
    :class:`S3Server` (ListBuckets answered) of kind ``"radosgw"`` with a user
    whose keys are ``access_key``/``secret_key``.

    ``storage_classes`` are added to the default placement target, each with
    its own data pool ``default.rgw.<class lower>.data``.  With
    ``lc_debug_interval`` > 0, one lifecycle "day" lasts that many seconds.
    ``tls=True`` additionally serves https on another port with a self-signed
    certificate (``https_endpoint_url``, ``ca_bundle``).  ``die_with_parent``
    makes the daemons get SIGKILL when the starting process dies.
    """
    t0 = time.monotonic()
    if install:
        ensure_ceph_installed()
    elif _missing_binaries():
        raise S3ServerError(f"Ceph binaries missing: {_missing_binaries()}")

    wd = Path(workdir).absolute()
    wd.mkdir(parents=True, exist_ok=True)
    if any(wd.iterdir()):
        raise S3ServerError(f"workdir {wd} is not empty")

    server = S3Server(endpoint_url="", access_key=RGW_ACCESS_KEY,
                      secret_key=RGW_SECRET_KEY, kind="radosgw", workdir=wd,
                      remove_workdir=remove_workdir_on_stop)
    d = {k: wd / k for k in ("mon", "mgr", "osd", "rgw", "log", "crash", "run")}
    # unix socket paths are limited to 108 bytes: keep run_dir short.
    if len(str(d["run"])) > 60:
        short = Path(tempfile.mkdtemp(prefix="ckrgw-"))
        server.extra_dirs.append(short)
        (wd / "run").symlink_to(short)
        d["run"] = short
    for k, p in d.items():
        p.mkdir(parents=True, exist_ok=True)
    d["block"] = wd / "osd-block.img"
    _check_o_direct(wd)

    mon_port, rgw_port_free, tls_port = _free_ports(3)
    if port:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as e:
                raise S3ServerError(f"port {port} on 127.0.0.1 is not free: {e}") from None
    rgw_port = port or rgw_port_free
    tls_cfg = None
    if tls:
        crt, key = _make_cert(wd)
        tls_cfg = (tls_port, crt, key)
        server.https_endpoint_url = f"https://127.0.0.1:{tls_port}"
        server.ca_bundle = str(crt)
    server.endpoint_url = f"http://127.0.0.1:{rgw_port}"

    fsid = str(uuid.uuid4())
    osd_uuid = str(uuid.uuid4())
    conf = wd / "ceph.conf"
    conf.write_text(_ceph_conf(
        fsid=fsid, mon_port=mon_port, rgw_port=rgw_port, d=d,
        lc_debug_interval=lc_debug_interval,
        osd_size_bytes=osd_size_gib * 1024 ** 3,
        osd_memory_target=osd_memory_target, tls=tls_cfg,
        rgw_threads=rgw_threads))

    env = dict(os.environ, CEPH_CONF=str(conf))
    env.pop("CEPH_ARGS", None)
    run = _Runner(env, d["log"], server)
    logs = lambda *names: [d["log"] / n for n in names]  # noqa: E731
    timings: dict[str, float] = {}

    def mark(what: str) -> None:
        timings[what] = round(time.monotonic() - t0, 2)

    mkfs = mute = None
    try:
        # --- mon -----------------------------------------------------------
        run("monmaptool", "--create", "--fsid", fsid, "--addv", "a",
            f"[v2:127.0.0.1:{mon_port}]", str(d["run"] / "monmap"))
        run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(d["run"] / "monmap"),
            "--keyring", "/dev/null")
        server._spawn("mon", ["ceph-mon", "-i", "a", "-f"], env=env,
                      log_path=d["log"] / "mon.out", die_with_parent=die_with_parent)

        # --- OSD mkfs does not need the mon: run it concurrently -----------
        with open(d["log"] / "osd-mkfs.out", "wb") as mkfs_out:
            mkfs = subprocess.Popen(
                ["ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid,
                 "--no-mon-config"],
                env=env, stdout=mkfs_out, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent)

        run("ceph", "--connect-timeout", "30", "osd", "new", osd_uuid, "0",
            timeout=60)
        mark("mon")
        if mkfs.wait(timeout=120) != 0:
            raise S3ServerError("ceph-osd --mkfs failed\n"
                                + _log_tails(logs("osd-mkfs.out", "osd.0.log")))
        mark("osd_mkfs")

        server._spawn("osd", ["ceph-osd", "-i", "0", "-f"], env=env,
                      log_path=d["log"] / "osd.out", die_with_parent=die_with_parent)
        if with_mgr:
            server._spawn("mgr", ["ceph-mgr", "-i", "x", "-f"], env=env,
                          log_path=d["log"] / "mgr.out",
                          die_with_parent=die_with_parent)

        def osd_up() -> bool:
            out = run("ceph", "osd", "dump", "-f", "json", check=False, timeout=30)
            try:
                osds = json.loads(out).get("osds", [])
            except ValueError:
                return False
            return bool(osds) and osds[0].get("up") == 1

        _wait_until(osd_up, timeout, "osd.0 to come up", server,
                    logs("osd.out", "osd.0.log", "mon.a.log"), interval=0.2)
        mark("osd_up")
        if with_mgr:
            # the always-on mgr modules we disabled would otherwise show up
            # as HEALTH_ERR MGR_MODULE_ERROR (cosmetic; runs in background).
            mute = subprocess.Popen(
                ["ceph", "health", "mute", "MGR_MODULE_ERROR", "--sticky"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent)

        # --- rgw realm-less default zone, storage classes, user ------------
        # `user create` initialises the default zonegroup/zone (and creates
        # the .rgw.root / default.rgw.* pools); the placement commands need
        # those to exist.  Without a realm there is no period to commit:
        # radosgw reads the zonegroup/zone objects when it starts.
        run("radosgw-admin", "user", "create", f"--uid={RGW_USER}",
            "--display-name=ckptfs tests", f"--access-key={RGW_ACCESS_KEY}",
            f"--secret-key={RGW_SECRET_KEY}", "--max-buckets=0", timeout=timeout)
        for sc in storage_classes:
            sc = sc.upper()
            if sc == "STANDARD":
                continue
            run("radosgw-admin", "zonegroup", "placement", "add",
                "--rgw-zonegroup=default", "--placement-id=default-placement",
                f"--storage-class={sc}")
            run("radosgw-admin", "zone", "placement", "add",
                "--rgw-zone=default", "--placement-id=default-placement",
                f"--storage-class={sc}",
                f"--data-pool=default.rgw.{sc.lower()}.data")
        mark("rgw_admin")

        rgw = server._spawn("rgw", ["radosgw", "-n", "client.rgw.ckptfs", "-f"],
                            env=env, log_path=d["log"] / "rgw.out",
                            die_with_parent=die_with_parent)
        _wait_s3(server, timeout, {"rgw": rgw, **server._procs},
                 logs("rgw.out", "client.rgw.ckptfs.log"))
        mark("s3_ready")
        if mute is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                mute.wait(timeout=30)
    except BaseException:
        for helper in (mkfs, mute):
            if helper is not None and helper.poll() is None:
                helper.kill()
                helper.wait()
        server.stop(remove=False)
        raise

    server.startup_seconds = round(time.monotonic() - t0, 2)
    (wd / "server.json").write_text(json.dumps({
        "endpoint_url": server.endpoint_url,
        "https_endpoint_url": server.https_endpoint_url,
        "ca_bundle": server.ca_bundle,
        "access_key": server.access_key,
        "secret_key": server.secret_key,
        "region": server.region,
        "pids": server.pids,
        "startup_seconds": server.startup_seconds,
        "timings": timings,
    }, indent=2) + "\n")
    server.timings = timings
    return server


# ---------------------------------------------------------------------------
# moto
# ---------------------------------------------------------------------------


def start_moto(port: int | None = None, *, timeout: float = 60,
               workdir: str | os.PathLike | None = None) -> S3Server:
    """Start ``python -m moto.server`` on 127.0.0.1 (free port unless given)."""
    t0 = time.monotonic()
    port = port or _free_port()
    logdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ckmoto-"))
    logdir.mkdir(parents=True, exist_ok=True)
    server = S3Server(endpoint_url=f"http://127.0.0.1:{port}",
                      access_key=MOTO_ACCESS_KEY, secret_key=MOTO_SECRET_KEY,
                      kind="moto", workdir=None)
    if not workdir:
        server.extra_dirs.append(logdir)
    log = logdir / "moto.out"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=MOTO_ACCESS_KEY,
               AWS_SECRET_ACCESS_KEY=MOTO_SECRET_KEY, AWS_DEFAULT_REGION=REGION)
    p = server._spawn("moto", [sys.executable, "-m", "moto.server", "-H",
                               "127.0.0.1", "-p", str(port)],
                      env=env, log_path=log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if p.poll() is not None:
                raise S3ServerError(f"moto.server exited ({p.returncode})\n"
                                    + _tail(log))
            try:
                with urllib.request.urlopen(server.endpoint_url + "/", timeout=2):
                    pass
                ok, _ = _s3_list_buckets_ok(server)
                if ok:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise S3ServerError(f"moto.server not ready after {timeout}s\n"
                                    + _tail(log))
            time.sleep(0.1)
    except BaseException:
        server.stop()
        raise
    server.startup_seconds = round(time.monotonic() - t0, 2)
    return server


# ---------------------------------------------------------------------------
# env selection
# ---------------------------------------------------------------------------


def start_from_env(workdir: str | os.PathLike, **radosgw_kwargs) -> S3Server:
    """Start (or attach to) the S3 server the environment asks for.

    * ``CKPTFS_S3_ENDPOINT`` set: use that already-running server with
      ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and
      ``AWS_DEFAULT_REGION``, default us-east-1); its ``kind`` is
      ``CKPTFS_S3`` if set, else "external".  ``stop()`` does nothing.
    * else ``CKPTFS_S3=moto``: :func:`start_moto`.
    * else (``CKPTFS_S3=radosgw`` or unset): :func:`start_radosgw` in workdir.
    """
    kind = os.environ.get("CKPTFS_S3", "").strip().lower()
    endpoint = os.environ.get("CKPTFS_S3_ENDPOINT", "").strip()
    if endpoint:
        ak = os.environ.get("AWS_ACCESS_KEY_ID")
        sk = os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not ak or not sk:
            raise S3ServerError("CKPTFS_S3_ENDPOINT needs AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY")
        return S3Server(endpoint_url=endpoint, access_key=ak, secret_key=sk,
                        kind=kind or "external",
                        region=os.environ.get("AWS_DEFAULT_REGION", REGION))
    if kind == "moto":
        return start_moto(workdir=workdir)
    if kind in ("", "radosgw", "rgw", "ceph"):
        return start_radosgw(workdir, **radosgw_kwargs)
    raise S3ServerError(f"CKPTFS_S3={kind!r}: expected 'radosgw' or 'moto'")


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m integration.s3server",
        description="Start a throwaway single-node Ceph radosgw (or moto) on "
                    "127.0.0.1 and print its endpoint/credentials as shell "
                    "export lines; runs until Ctrl-C.")
    ap.add_argument("--workdir", help="directory for the cluster (default: a new temp dir)")
    ap.add_argument("--kind", choices=("radosgw", "moto"), default="radosgw")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--lc-debug-interval", type=int, default=10)
    ap.add_argument("--storage-class", action="append", dest="storage_classes",
                    help="extra storage class (repeatable; default COLD)")
    ap.add_argument("--tls", action="store_true", help="also serve https (self-signed)")
    ap.add_argument("--no-mgr", action="store_true")
    ap.add_argument("--osd-size-gib", type=int, default=10)
    ap.add_argument("--keep", action="store_true", help="keep workdir on exit")
    args = ap.parse_args(argv)

    if args.kind == "moto":
        server = start_moto(args.port)
    else:
        workdir = args.workdir or tempfile.mkdtemp(prefix="ckptfs-rgw-")
        server = start_radosgw(
            workdir, port=args.port, lc_debug_interval=args.lc_debug_interval,
            storage_classes=tuple(args.storage_classes or ("COLD",)),
            tls=args.tls, with_mgr=not args.no_mgr,
            osd_size_gib=args.osd_size_gib, die_with_parent=True)
    try:
        print(f"export CKPTFS_S3={server.kind}")
        print(f"export CKPTFS_S3_ENDPOINT={server.endpoint_url}")
        print(f"export AWS_ACCESS_KEY_ID={server.access_key}")
        print(f"export AWS_SECRET_ACCESS_KEY={server.secret_key}")
        print(f"export AWS_DEFAULT_REGION={server.region}")
        print(f"export AWS_ENDPOINT_URL_S3={server.endpoint_url}")
        if server.kind == "radosgw":
            print(f"export CEPH_CONF={server.workdir / 'ceph.conf'}")
        if server.https_endpoint_url:
            print(f"# https: {server.https_endpoint_url} (CA bundle {server.ca_bundle})")
        print(f"# {server.kind} ready in {server.startup_seconds}s"
              + (f"; workdir {server.workdir}" if server.workdir else "")
              + "; Ctrl-C to stop", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *a: stop.set())
        while not stop.wait(1.0):
            dead = [n for n, p in server._procs.items() if p.poll() is not None]
            if dead:
                print(f"# daemon(s) exited: {dead}; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        server.stop(remove=(not args.keep) and server.kind == "radosgw"
                    and not args.workdir)


if __name__ == "__main__":
    sys.exit(main())

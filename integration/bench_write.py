"""Write-path benchmark: a plain directory against ckptfs mounts, same disk, same run.

Mounts run side by side (``--mounts``): one on the passthrough data path
(``--data-path passthrough``: the kernel writes the cache file itself) and one on the
fallback writeback-cache path (``--data-path writeback``: the gateway serves WRITE), both
taking FUSE requests through /dev/fuse; where the kernel offers FUSE over io_uring
(``/sys/module/fuse/parameters/enable_uring``), a third, ``passthrough+uring``, takes them
through the io_uring queues (``--fuse-io-uring on``). A ``--mounts`` entry is a data path,
with ``+uring`` for the queues.

Workloads (each timed from ``open`` to the end of ``fsync`` + ``close`` [+ ``rename``]):

* ``seq``: N GiB written sequentially in 1 MiB blocks, then fsync.
* ``ckpt``: a ~1 GiB torch-like checkpoint: a zip-like file written as many
  writes of mixed sizes (small local headers, a pickle, tensor blobs from 4 KiB
  to ~200 MiB, a central directory) into ``x.tmp``, fsync, ``rename`` to ``x``,
  which is what ``torch.save`` followed by an atomic rename does. The small
  records are issued unbuffered (~1,100 write(2) calls per GiB), a harsher
  pattern than torch 2.x itself, whose zip writer goes through a buffered
  ofstream and issues one ``writev`` (pending header + tensor) per large
  tensor (seen with strace).
* ``torch``: a real ``torch.save`` of a state dict with the same layout into
  ``x.tmp`` + fsync + rename (``--torch``, when torch is importable; its time
  includes torch's own serialisation work).
* ``meta``: namespace operations, in their own section with the drain running as
  in use (default settle window): ``--meta-files`` (2,000) files of 1 KiB are
  created + written + closed, then each is renamed, then each is unlinked; the
  report gives operations per second of each phase (no fsync: POSIX makes a
  namespace change durable only at fsync of the file or its directory).
  ``--meta-cached-files N`` first leaves N files of 1 KiB in each mount's cache, as a
  long run does, and prints the gateway's and the drain's CPU while idle before and
  after: their background work must not grow with the files the cache holds.
  ``--fuse-references`` adds two of libfuse's example file systems, written in C, to the
  same alternation: ``passthrough_hp`` (a directory on the same disk, FUSE passthrough) and
  ``memfs_ll`` (in memory: the FUSE transport alone). What they reach is what a FUSE daemon
  can reach on the machine at hand (built by ``scripts/build-fuse-references.sh``).

Runs alternate (plain, passthrough, writeback, plain, ...) for ``--rounds`` rounds so
a noisy virtual disk hits every side alike; the report gives medians, the spread
(min..max) and the ratio mount/plain of the medians and of each pair.

The table also gives the CPU time the gateway (and drain) spent per GiB
written through the mount, the figure that least depends on what else runs on
the machine (the load average is printed at start and end: other work skews
both sides of a pair).

Then the gateway's peak RSS (``VmHWM`` from /proc, reset through
``/proc/PID/clear_refs`` before each file when we may, plus the drain
process if one runs) while writing files of ``--rss-sizes`` GiB, to show that
it does not grow with the file size.

The bench starts its own mount (file:// bucket, temporary cache directory on
the same file system as the plain directory, by default under /var/tmp) with
``drain.settle_seconds = 3600`` so the drain does not upload during the runs
(``--drain-live`` keeps the default settle window to see its effect).

Usage::

    .venv/bin/python -m integration.bench_write [--size-gib 4] [--ckpt-gib 1] [--rounds 5]
        [--mounts passthrough,writeback] [--rss-sizes 1,8] [--drop-caches] [--torch]
        [--workdir /var/tmp] [--fuse-references]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

from ckptfs.gateway.mount import ENABLE_URING_PARAM, fuse_io_uring_offered

MIB = 1 << 20
GIB = 1 << 30
BLOCK = MIB

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- workloads ---------------------------------------------------------------------------


def _payload(size: int) -> memoryview:
    """Incompressible bytes to write (made once; cheap to slice)."""
    return memoryview(os.urandom(size))


def write_seq(directory: str, size: int, buf: memoryview) -> float:
    """``size`` bytes in 1 MiB writes + fsync + close; returns seconds."""
    path = os.path.join(directory, "seq.bin")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        block = buf[:BLOCK]
        left = size
        while left > 0:
            n = os.write(fd, block[: min(BLOCK, left)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def checkpoint_layout(total: int, seed: int = 0) -> list[tuple[str, int]]:
    """(record name, size) of a transformer-like fp32 state dict of about ``total`` bytes.

    An embedding, then per layer four attention matrices with biases, two MLP
    matrices with biases and two layer norms, then a final norm and a few
    odd-sized buffers; the number of layers is chosen to land near ``total``.
    Sizes run from a few bytes to ~200 MiB (the embedding).
    """
    rng = random.Random(seed)
    hidden = 1024
    vocab = 50304 if total >= 512 * MIB else max(1024, total // (hidden * 4 * 4))
    layer = [hidden * hidden * 4] * 4 + [hidden * 4] * 4  # q, k, v, o and their biases
    layer += [4 * hidden * hidden * 4] * 2 + [4 * hidden * 4, hidden * 4]  # MLP up/down and biases
    layer += [hidden * 4] * 4  # two layer norms (weight, bias)
    emb = vocab * hidden * 4
    layers = max(1, round((total - emb) / sum(layer)))
    sizes = [emb] + layer * layers + [hidden * 4, hidden * 4]
    sizes += [rng.randrange(8, 5000) for _ in range(6)]  # step counters, rng state, ...
    return [(f"archive/data/{i}", s) for i, s in enumerate(sizes)]


def _align(offset: int, header: int, alignment: int = 64) -> int:
    """Padding torch puts in the extra field so the record's data starts aligned."""
    return (-(offset + header)) % alignment


def write_checkpoint(directory: str, total: int, buf: memoryview, name: str = "model.pt") -> float:
    """A torch.save-like zip into ``name.tmp``, fsync, close, rename; returns seconds.

    Small writes (local headers, pickle chunks, central directory entries)
    interleave with one large write per tensor, as torch's zip writer issues
    them (the small ones unbuffered: the worst case for the write path).
    """
    final = os.path.join(directory, name)
    tmp = final + ".tmp"
    records = [("archive/data.pkl", 48 * 1024 + 321), ("archive/.format_version", 1), ("archive/.storage_alignment", 2),
               ("archive/byteorder", 6)]
    records += checkpoint_layout(total)
    records += [("archive/version", 2), ("archive/.data/serialization_id", 40)]
    start = time.perf_counter()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        central = []
        for rname, size in records:
            nb = rname.encode()
            pad = _align(offset, 30 + len(nb) + 4)
            header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0x08, 0, 0, 0, 0, size, size, len(nb), 4 + pad)
            header += nb + struct.pack("<HH", 0x1234, pad) + bytes(pad)
            central.append((nb, offset, size))
            offset += os.write(fd, header)
            if rname == "archive/data.pkl":
                # The pickler emits many small frames.
                left = size
                while left > 0:
                    n = min(left, 512 + (left * 7919) % 3584)
                    offset += os.write(fd, buf[:n])
                    left -= n
            else:
                left = size
                while left > 0:  # one write per tensor; os.write may return short on huge ones
                    n = os.write(fd, buf[: min(left, len(buf))])
                    offset += n
                    left -= n
            offset += os.write(fd, struct.pack("<IIII", 0x08074B50, 0, size, size))
        cd_start = offset
        for nb, rec_offset, size in central:
            entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0x08, 0, 0, 0, 0, size, size,
                                len(nb), 0, 0, 0, 0, 0, rec_offset) + nb
            offset += os.write(fd, entry)
        offset += os.write(fd, struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(central), len(central),
                                           offset - cd_start, cd_start, 0))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    return time.perf_counter() - start


META_PHASES = ("create", "rename", "unlink")


def write_new_file(path: str, data: bytes) -> None:
    """create + write + close of a file that must not exist yet."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def namespace_ops(directory: str, files: int, size: int = 1024, probe=None) -> dict:
    """``files`` x ``size`` bytes: create+write+close each, rename each, unlink each.

    Returns operations per second of each phase; with ``probe`` (a function returning a
    snapshot dict of counters, e.g. gateway CPU seconds and FUSE requests by op) also
    ``deltas``: the counters' change over each phase.
    """
    data = os.urandom(size)
    work = os.path.join(directory, "meta")
    os.makedirs(work, exist_ok=True)
    names = [os.path.join(work, f"f{i:06d}") for i in range(files)]
    rates: dict = {}
    deltas: dict = {}

    def phase(name, body) -> None:
        before = probe() if probe is not None else None
        start = time.perf_counter()
        body()
        rates[name] = files / (time.perf_counter() - start)
        if probe is not None:
            after = probe()
            deltas[name] = {k: after.get(k, 0) - before.get(k, 0) for k in after}

    def create() -> None:
        for name in names:
            write_new_file(name, data)

    def rename() -> None:
        for name in names:
            os.rename(name, name + ".r")

    def unlink() -> None:
        for name in names:
            os.unlink(name + ".r")

    phase("create", create)
    phase("rename", rename)
    phase("unlink", unlink)
    os.rmdir(work)
    if probe is not None:
        rates["deltas"] = deltas
    return rates


def _metric_samples(port: int, name: str) -> dict[str, float]:
    """``{op: value}`` of a metric with one ``op`` label, from a gateway's metrics endpoint."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{name}{{op="([^"]+)"}} ([0-9.e+]+)$', text, re.MULTILINE):
        out[m.group(1)] = float(m.group(2))
    return out


def gateway_probe(mount: Mount):
    """A probe for :func:`namespace_ops`: gateway CPU seconds (user+system, all threads,
    from /proc) and its FUSE requests by op (``ckptfs_fuse_requests_total``): the figures
    that do not depend on what else runs on the machine."""
    def probe() -> dict[str, float]:
        snap = {f"req:{op}": n for op, n in _metric_samples(mount.metrics_port, "ckptfs_fuse_requests_total").items()}
        snap["cpu"] = _cpu_seconds([mount.pid])
        snap["cpu_sys"] = _cpu_seconds([mount.pid], system_only=True)
        drain = mount.processes().get("drain")
        snap["drain_cpu"] = _cpu_seconds([drain]) if drain else 0.0
        return snap
    return probe


def drain_cpu_until_idle(mount: Mount, *, quiet_cpu: float = 0.02, interval: float = 1.0,
                         timeout: float = 120.0) -> float:
    """The mount's drain CPU seconds once it has gone quiet (less than ``quiet_cpu`` in
    ``interval``): the drain lags the operations, so a phase's own window misses its work."""
    deadline = time.monotonic() + timeout
    drain = mount.processes().get("drain")
    last = _cpu_seconds([drain]) if drain else 0.0
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = _cpu_seconds([drain]) if drain else 0.0
        if now - last < quiet_cpu:
            return now
        last = now
    return last


def drain_requests(mount: Mount) -> float:
    """Object-store requests the mount's drain has sent (its uploads, copies, deletes...)."""
    return sum(_metric_samples(mount.metrics_port, "ckptfs_upload_request_duration_seconds_count").values())


def _per_op(delta: dict[str, float], ops: int) -> tuple[float, float, dict[str, float], float, float]:
    """(FUSE requests per operation, gateway CPU microseconds per operation, requests by op,
    of the CPU the system part in microseconds per operation, the drain's CPU microseconds
    per operation within the phase)."""
    by_op = {k[4:]: v for k, v in delta.items() if k.startswith("req:") and v}
    return (sum(by_op.values()) / ops, delta.get("cpu", 0.0) * 1e6 / ops, by_op,
            delta.get("cpu_sys", 0.0) * 1e6 / ops, delta.get("drain_cpu", 0.0) * 1e6 / ops)


def keep_files(directory: str, files: int, size: int = 1024, per_dir: int = 10_000) -> None:
    """``files`` x ``size`` bytes left in ``directory/kept/<n>/`` (a long run's checkpoints)."""
    data = os.urandom(size)
    for i in range(files):
        sub = os.path.join(directory, "kept", str(i // per_dir))
        if i % per_dir == 0:
            os.makedirs(sub, exist_ok=True)
        write_new_file(os.path.join(sub, f"f{i:07d}"), data)


def idle_cpu(mount: Mount, seconds: float = 10.0) -> tuple[float, float]:
    """The gateway's and the drain's CPU, as fractions of one CPU, while nothing uses the mount."""
    drain = mount.processes().get("drain")
    drain_pids = [drain] if drain else []
    gateway0, drain0 = _cpu_seconds([mount.pid]), _cpu_seconds(drain_pids)
    time.sleep(seconds)
    return (_cpu_seconds([mount.pid]) - gateway0) / seconds, (_cpu_seconds(drain_pids) - drain0) / seconds


def run_namespace_bench(workdir: str, modes: list[str], files: int, rounds: int, cached_files: int = 0,
                        references_dir: str | None = None) -> dict:
    """The ``meta`` section: plain directory and each data path, alternating, drain live.

    Besides operations per second (which depend on the machine's load), it gives for each
    mount and phase the FUSE requests per operation and the gateway's CPU microseconds per
    operation (medians over the rounds), which do not. ``cached_files``: first leave that many
    files of 1 KiB in each mount (drained), and print the gateway's and the drain's CPU while
    idle, before and with them. ``references_dir``: also libfuse's example file systems from
    that directory (:class:`ReferenceMount`), alternating with the others.
    """
    plain = os.path.join(workdir, "meta-plain")
    os.makedirs(plain, exist_ok=True)
    mounts = {m: Mount(os.path.join(workdir, f"meta-{m}"), settle_seconds=None, extra_args=mount_args(m))
              for m in modes}
    references = {f"libfuse-{program}": ReferenceMount(os.path.join(workdir, f"meta-libfuse-{program}"),
                                                        program, references_dir)
                  for program in (REFERENCE_PROGRAMS if references_dir else ())}
    sides = ["plain", *modes, *references]
    results: dict[str, dict[str, list[float]]] = {side: {p: [] for p in META_PHASES} for side in sides}
    # per mount and phase, one entry per round: requests/op, daemon CPU us/op, requests by op
    cost: dict[str, dict[str, list]] = {m: {p: [] for p in META_PHASES} for m in (*modes, *references)}
    # per mount, one entry per round, from the round's start until the drain is idle again:
    # the drain's CPU us per file (its create, rename and unlink together), its CPU us per
    # bucket request, and its bucket requests (the drain's work depends on timing: a file
    # renamed or unlinked before its upload costs fewer requests)
    drain_cost: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    try:
        for m in modes:
            mounts[m].start()
        for daemon in references.values():
            daemon.start()
        idle = {}
        if cached_files:
            for m in modes:
                before = idle_cpu(mounts[m])
                keep_files(mounts[m].mnt, cached_files)
                drain_cpu_until_idle(mounts[m], timeout=600.0)
                idle[m] = {"no_files": before, "cached_files": idle_cpu(mounts[m])}
                print(f"  {m}: CPU while idle, gateway / drain, in % of a CPU: {before[0]:.1%} / {before[1]:.1%}"
                      f" with no files, {idle[m]['cached_files'][0]:.1%} / {idle[m]['cached_files'][1]:.1%}"
                      f" with {cached_files} files kept in the cache (drained)", flush=True)
        print(f"namespace operations: {files} files of 1 KiB, create+write+close / rename / unlink,"
              f" drain running (default settle), {rounds} rounds alternating {', '.join(sides)}"
              + (f", {cached_files} more files in each mount's cache" if cached_files else ""))
        print(f"  load average at start: {_loadavg()}")
        for rnd in range(rounds):
            for side in sides:
                os.sync()
                if side == "plain":
                    directory, probe = plain, None
                elif side in references:
                    directory, probe = references[side].mnt, daemon_probe(references[side])
                else:
                    directory, probe = mounts[side].mnt, gateway_probe(mounts[side])
                if side in mounts:
                    drain_start = drain_cpu_until_idle(mounts[side])
                    requests_start = drain_requests(mounts[side])
                rates = namespace_ops(directory, files, probe=probe)
                if side in mounts:
                    drain_cpu = drain_cpu_until_idle(mounts[side]) - drain_start
                    time.sleep(1.5)  # the drain publishes its request counts once a second
                    requests = drain_requests(mounts[side]) - requests_start
                    drain_cost[side].append((drain_cpu * 1e6 / files, drain_cpu * 1e6 / max(requests, 1), requests))
                for phase in META_PHASES:
                    results[side][phase].append(rates[phase])
                    if probe is not None:
                        cost[side][phase].append(_per_op(rates["deltas"][phase], files))
            print(f"  round {rnd + 1}: " + "  ".join(
                f"{side} " + "/".join(f"{results[side][p][-1]:.0f}" for p in META_PHASES) for side in sides),
                flush=True)
        print(f"  load average at end: {_loadavg()}")
        width = max(18, *(len(side) + 1 for side in sides))
        print(f"{'side':<{width}} " + " ".join(f"{p + ' ops/s med (min..max)':>30}" for p in META_PHASES))
        for side in sides:
            print(f"{side:<{width}} " + " ".join(f"{_spread(results[side][p]):>30}" for p in META_PHASES))
        print("load-independent figures (medians over the rounds): FUSE requests per operation,"
              " the daemon's CPU us per operation (the gateway's; libfuse's examples count no requests)")
        print(f"{'side':<{width}} " + " ".join(f"{p + ' req/op  CPU us/op':>30}" for p in META_PHASES))
        for m in (*modes, *references):
            print(f"{m:<{width}} " + " ".join(
                (f"{statistics.median(c[0] for c in cost[m][p]):>19.2f}" if m in mounts else f"{'-':>19}")
                + f" {statistics.median(c[1] for c in cost[m][p]):>10.0f}"
                for p in META_PHASES))
        for m in modes:
            print(f"  {m} drain CPU (until idle) by round: us per file (its create + rename + unlink) / bucket "
                  "requests / us per request: "
                  + ", ".join(f"{c[0]:.0f} / {c[2]:.0f} / {c[1]:.0f}" for c in drain_cost[m])
                  + "; during each phase (last round): "
                  + ", ".join(f"{p} {rates_drain:.0f}" for p, rates_drain in
                              ((p, cost[m][p][-1][4]) for p in META_PHASES)))
        for m in modes:
            for p in META_PHASES:
                by_op = cost[m][p][-1][2]
                print(f"  {m} {p}, last round, gateway CPU system us/op {cost[m][p][-1][3]:.0f}, requests by op: "
                      + ", ".join(f"{op} {n:.0f}" for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])))
        for side in references:
            print(f"  {side}, last round, CPU system us/op: "
                  + ", ".join(f"{p} {cost[side][p][-1][3]:.0f}" for p in META_PHASES))
    finally:
        for m in (*mounts.values(), *references.values()):
            m.stop()
    return {"idle_cpu": idle, "ops_per_s": results, "cost": {m: {p: [{"requests_per_op": c[0], "gateway_cpu_us_per_op": c[1],
                                                   "requests": c[2], "gateway_system_cpu_us_per_op": c[3],
                                                   "drain_cpu_us_per_op_in_phase": c[4]} for c in cost[m][p]]
                                             for p in META_PHASES} for m in cost},
            "drain_cpu_us_per_file": drain_cost}


def torch_available() -> bool:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "Failed to initialize NumPy" on a torch without numpy
        try:
            import torch  # noqa: F401
        except Exception:
            return False
    return True


_TORCH_STATE: dict = {}


def write_torch(directory: str, total: int, buf: memoryview) -> float:
    """Real ``torch.save`` of a ~``total``-byte state dict into ``x.tmp``, fsync, rename."""
    import torch

    if _TORCH_STATE.get("total") != total:
        state = {}
        for name, size in checkpoint_layout(total):
            state[name.rsplit("/", 1)[1]] = torch.empty(max(1, size // 4), dtype=torch.float32).fill_(1.5)
        _TORCH_STATE.update(total=total, state=state)
    final = os.path.join(directory, "torch.pt")
    tmp = final + ".tmp"
    start = time.perf_counter()
    torch.save(_TORCH_STATE["state"], tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    return time.perf_counter() - start


def clear_dir(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


# -- the mount ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mount_args(spec: str) -> list[str]:
    """ckptfs mount flags for a ``--mounts`` entry: a data path, ``+uring`` for FUSE requests
    through the io_uring queues (else /dev/fuse alone)."""
    data_path, _, transport = spec.partition("+")
    if transport not in ("", "uring"):
        raise SystemExit(f"--mounts: {spec!r}: expected DATA_PATH or DATA_PATH+uring")
    return ["--data-path", data_path, "--fuse-io-uring", "on" if transport else "off"]


class _MountedDaemon:
    """A FUSE daemon run in the foreground in a session of its own, mounted at ``self.mnt``."""

    mnt: str
    log_path: str
    stop_timeout = 60.0
    proc: subprocess.Popen | None = None

    def _spawn(self, args: list[str], what: str, timeout: float, **popen) -> None:
        """Start ``args`` with its output in ``self.log_path``; return once mounted."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     start_new_session=True, **popen)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up in {timeout}s; see {self.log_path}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None:
            return
        subprocess.run(["fusermount3", "-u", self.mnt], check=False, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)
        self._log.close()
        self.proc = None


class Mount(_MountedDaemon):
    """A ``ckptfs mount --foreground`` of a file:// bucket with its own cache directory."""

    def __init__(self, workdir: str, *, settle_seconds: float | None, extra_args: list[str] | None = None):
        self.workdir = workdir
        self.bucket = os.path.join(workdir, "bucket")
        self.cache = os.path.join(workdir, "cache")
        self.mnt = os.path.join(workdir, "mnt")
        self.log_path = os.path.join(workdir, "gateway.log")
        self.settle_seconds = settle_seconds
        self.extra_args = extra_args or []
        self.metrics_port = _free_port()

    def start(self, timeout: float = 60.0) -> None:
        for d in (self.bucket, self.cache, self.mnt):
            os.makedirs(d, exist_ok=True)
        args = [os.path.join(REPO, ".venv", "bin", "ckptfs")]
        if not os.path.exists(args[0]):
            args = [sys.executable, "-m", "ckptfs"]
        args += ["mount", f"file://{self.bucket}", self.mnt, "--cache-dir", self.cache, "--foreground",
                 "--metrics-addr", f"127.0.0.1:{self.metrics_port}"]
        if self.settle_seconds is not None:
            cfg = os.path.join(self.workdir, "bench.toml")
            with open(cfg, "w") as fh:
                fh.write(f"[drain]\nsettle_seconds = {self.settle_seconds}\n")
            args += ["--config", cfg]
        args += self.extra_args
        self._spawn(args, "the mount", timeout, cwd=REPO)

    def processes(self) -> dict[str, int]:
        """{'gateway': pid, 'drain': pid} (the drain only if running)."""
        out = {"gateway": self.pid}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if int(fields[1]) != self.pid:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ")
            except (OSError, IndexError, ValueError):
                continue
            if b"drain" in cmd:
                out["drain"] = int(entry)
        return out


REFERENCE_PROGRAMS = ("passthrough_hp", "memfs_ll")


def fuse_references_dir() -> str:
    """The directory of libfuse's example file systems, built first if missing
    (scripts/build-fuse-references.sh, about 25 s)."""
    out = subprocess.run([os.path.join(REPO, "scripts", "build-fuse-references.sh"),
                          os.path.join(REPO, ".venv")], check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


class ReferenceMount(_MountedDaemon):
    """One of libfuse's example file systems, mounted beside the gateway in the ``meta``
    section (``--fuse-references``): what a FUSE daemon written in C makes of the same
    workload on the same machine.

    * ``libfuse-passthrough_hp`` mirrors a directory on the plain directory's file system,
      with FUSE passthrough for reads and writes (as the gateway's passthrough data path)
      and its default caching: names and attributes kept by the kernel for a day;
    * ``libfuse-memfs_ll`` keeps everything in its memory: the FUSE transport alone.
    """

    def __init__(self, workdir: str, program: str, programs_dir: str):
        self.workdir = workdir
        self.program = program
        self.mnt = os.path.join(workdir, "mnt")
        self.source = os.path.join(workdir, "source")
        self.log_path = os.path.join(workdir, "daemon.log")
        self.binary = os.path.join(programs_dir, program)
        self.stop_timeout = 30.0

    def start(self, timeout: float = 30.0) -> None:
        os.makedirs(self.mnt, exist_ok=True)
        if self.program == "passthrough_hp":
            os.makedirs(self.source, exist_ok=True)
            args = [self.binary, "--foreground", self.source, self.mnt]
        else:
            args = [self.binary, "-f", self.mnt]
        self._spawn(args, self.program, timeout)


def daemon_probe(daemon: ReferenceMount):
    """A probe for :func:`namespace_ops`: the reference daemon's CPU seconds (no requests by
    op: libfuse's examples export none)."""
    def probe() -> dict[str, float]:
        return {"cpu": _cpu_seconds([daemon.pid]), "cpu_sys": _cpu_seconds([daemon.pid], system_only=True)}
    return probe


def _cpu_seconds(pids, *, system_only: bool = False) -> float:
    """User + system (or only system) CPU time of the processes (0 for those gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += int(fields[12]) + (0 if system_only else int(fields[11]))
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def _loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5\n")  # reset VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure_rss(mount: Mount, size: int, buf: memoryview) -> dict:
    """Write ``size`` bytes through the mount; peak RSS (MiB) of gateway and drain during it."""
    procs = mount.processes()
    reset = all(_reset_peak(pid) for pid in procs.values())
    before = {name: _status_kib(pid, "VmRSS") for name, pid in procs.items()}
    samples = {name: 0 for name in procs}
    dirty = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for name, pid in procs.items():
                rss = _status_kib(pid, "VmRSS") or 0
                samples[name] = max(samples[name], rss)
            dirty[0] = max(dirty[0], _meminfo_kib("Dirty") + _meminfo_kib("Writeback"))
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seconds = write_seq(mount.mnt, size, buf)
    stop.set()
    sampler.join()
    hwm = {name: _status_kib(pid, "VmHWM") for name, pid in procs.items()}
    clear_dir(mount.mnt)
    return {
        "size": size, "seconds": seconds, "reset": reset,
        "hwm_mib": {k: (v or 0) / 1024 for k, v in hwm.items()},
        "sampled_mib": {k: v / 1024 for k, v in samples.items()},
        "before_mib": {k: (v or 0) / 1024 for k, v in before.items()},
        "dirty_mib": dirty[0] / 1024,
    }


# -- report -------------------------------------------------------------------------------


def _mbps(size: int, seconds: float) -> float:
    return size / seconds / 1e6


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.0f} ({min(values):.0f}..{max(values):.0f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=4.0, help="sequential file size (default 4)")
    ap.add_argument("--ckpt-gib", type=float, default=1.0, help="torch-like checkpoint size (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating plain/mount rounds (default 5)")
    ap.add_argument("--rss-sizes", default="1,8", help="GiB sizes for the RSS check, '' to skip (default 1,8)")
    ap.add_argument("--workloads", default="seq,ckpt,torch,meta",
                    help="comma list of seq,ckpt,torch,meta (default all four; torch only if importable)")
    ap.add_argument("--meta-files", type=int, default=2000, help="files of the meta workload (default 2000)")
    ap.add_argument("--meta-cached-files", type=int, default=0,
                    help="files of 1 KiB first left in each mount's cache for the meta workload, as after"
                         " a long run (default 0); also prints the gateway's and the drain's idle CPU")
    ap.add_argument("--mounts", default=None,
                    help="data paths to mount side by side, each optionally +uring for FUSE requests through "
                         "io_uring queues (default passthrough,writeback, and passthrough+uring where the "
                         f"kernel offers it: {ENABLE_URING_PARAM})")
    ap.add_argument("--torch", action="store_true", help="also run the real torch.save workload if importable")
    ap.add_argument("--drop-caches", action="store_true", help="sync + drop the page cache before every run")
    ap.add_argument("--drain-live", action="store_true", help="keep the default drain settle window")
    ap.add_argument("--fuse-references", action="store_true",
                    help="meta: also libfuse's passthrough_hp and memfs_ll (C), built by"
                         " scripts/build-fuse-references.sh if missing")
    ap.add_argument("--workdir", default="/var/tmp", help="parent of the bench directory (default /var/tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the bench directory afterwards")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = ap.parse_args(argv)

    workloads = [w for w in args.workloads.split(",") if w]
    run_meta = "meta" in workloads
    workloads = [w for w in workloads if w != "meta"]
    if args.torch and "torch" not in workloads:
        workloads.append("torch")
    if "torch" in workloads and not torch_available():
        print("torch is not importable: skipping the torch.save workload")
        workloads.remove("torch")
    seq_size = int(args.size_gib * GIB)
    ckpt_size = int(args.ckpt_gib * GIB)
    sizes = {"seq": seq_size, "ckpt": ckpt_size, "torch": ckpt_size}
    funcs = {"seq": write_seq, "ckpt": write_checkpoint, "torch": write_torch}

    workdir = tempfile.mkdtemp(prefix="ckptfs-bench-", dir=args.workdir)
    plain = os.path.join(workdir, "plain")
    os.makedirs(plain)
    if args.mounts is None:
        if fuse_io_uring_offered():
            args.mounts = "passthrough,passthrough+uring,writeback"
        else:
            args.mounts = "passthrough,writeback"
            print(f"(FUSE over io_uring not offered here, {ENABLE_URING_PARAM}: not comparing it)")
    modes = [m for m in args.mounts.split(",") if m]
    mounts = {m: Mount(os.path.join(workdir, m), settle_seconds=None if args.drain_live else 3600,
                       extra_args=mount_args(m)) for m in modes}
    sides = ["plain", *modes]
    buf = _payload(256 * MIB)
    results: dict[str, dict[str, list[float]]] = {w: {side: [] for side in sides} for w in workloads}
    # gateway (+drain) CPU s per GiB, by workload and data path
    cpu: dict[str, dict[str, list[float]]] = {w: {m: [] for m in modes} for w in workloads}
    dropped = False
    meta_results = None
    try:
        if run_meta:
            meta_results = run_namespace_bench(workdir, modes, args.meta_files, args.rounds, args.meta_cached_files,
                                               fuse_references_dir() if args.fuse_references else None)
            print()
        if not workloads and not args.rss_sizes:
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"namespace_ops": meta_results, "load_end": _loadavg()}, fh, indent=1)
            return 0
        for m in modes:
            os.makedirs(mounts[m].workdir, exist_ok=True)
            mounts[m].start()
        mount = mounts[modes[0]]
        st_plain = os.stat(plain)
        print(f"ckptfs write bench  kernel {platform.release()}  cpus {os.cpu_count()}  workdir {workdir}")
        for m in modes:
            with open(mounts[m].log_path, errors="replace") as fh:
                said = [line.split("data path: ", 1)[1].strip() for line in fh if "data path: " in line]
            print(f"  mount {m}: data path {said[-1] if said else '?'}  processes {mounts[m].processes()}"
                  f"  cache on the plain dir's device: {os.stat(mounts[m].cache).st_dev == st_plain.st_dev}")
        print(f"  drain settle: {'default' if args.drain_live else '3600 s'}")
        print(f"  rounds {args.rounds} (alternating {', '.join(sides)})  drop caches: {args.drop_caches}"
              "  MB/s = 1e6 bytes/s, open..fsync+close[+rename]")
        print(f"  load average at start: {_loadavg()} (other work on the machine skews every side)")
        for rnd in range(args.rounds):
            for w in workloads:
                for side in sides:
                    directory = plain if side == "plain" else mounts[side].mnt
                    if args.drop_caches:
                        dropped = drop_caches()
                    else:
                        os.sync()
                    pids = mounts[side].processes().values() if side != "plain" else ()
                    cpu0 = _cpu_seconds(pids)
                    seconds = funcs[w](directory, sizes[w], buf)
                    results[w][side].append(_mbps(sizes[w], seconds))
                    if side != "plain":
                        cpu[w][side].append((_cpu_seconds(pids) - cpu0) / (sizes[w] / GIB))
                    clear_dir(directory)
            print(f"  round {rnd + 1}: " + "  ".join(
                f"{w} " + " ".join(f"{side} {results[w][side][-1]:.0f}" for side in sides)
                for w in workloads), flush=True)
        if args.drop_caches and not dropped:
            print("  (could not drop the page cache: not root?)")
        print()
        print(f"load average at end: {_loadavg()}")
        print(f"{'workload':<24} {'side':<18} {'MB/s med (min..max)':>22}"
              f" {'ratio':>6} {'pair ratios med (min..max)':>28} {'gw CPU s/GiB':>13}")
        for w in workloads if args.rounds > 0 else ():
            p = results[w]["plain"]
            label = {"seq": f"seq {args.size_gib:g} GiB 1MiB+fsync",
                     "ckpt": f"ckpt {args.ckpt_gib:g} GiB tmp+fsync+mv",
                     "torch": f"torch.save {args.ckpt_gib:g} GiB"}[w]
            print(f"{label:<24} {'plain':<18} {_spread(p):>22}")
            for m in modes:
                r = results[w][m]
                pairs = [b / a for a, b in zip(p, r)]
                print(f"{'':<24} {m:<18} {_spread(r):>22} {statistics.median(r) / statistics.median(p):6.2f}"
                      f" {statistics.median(pairs):13.2f} ({min(pairs):.2f}..{max(pairs):.2f})"
                      f" {statistics.median(cpu[w][m]):13.2f}")
        rss_sizes = [float(s) for s in args.rss_sizes.split(",") if s.strip()]
        rss_results = []
        if rss_sizes:
            print()
            print(f"peak RSS while writing through the {modes[0]} mount (VmHWM reset before each file"
                  " via clear_refs; 'sampled' = max VmRSS polled every 100 ms)")
            for gib in rss_sizes:
                os.sync()
                r = measure_rss(mount, int(gib * GIB), buf)
                rss_results.append(r)
                parts = [f"{name} VmHWM {r['hwm_mib'][name]:.0f} MiB (sampled {r['sampled_mib'][name]:.0f},"
                         f" idle {r['before_mib'][name]:.0f})" for name in r["hwm_mib"]]
                note = "" if r["reset"] else "  [peak not reset: cumulative]"
                print(f"  {gib:g} GiB file ({_mbps(r['size'], r['seconds']):.0f} MB/s): " + "; ".join(parts) + note
                      + f"; node Dirty+Writeback peak {r['dirty_mib']:.0f} MiB", flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"results": results, "cpu_s_per_gib": cpu, "rss": rss_results, "namespace_ops": meta_results,
                           "sizes": sizes, "load_end": _loadavg()}, fh, indent=1)
    finally:
        with contextlib.suppress(Exception):
            clear_dir(plain)
        for m in mounts.values():
            m.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

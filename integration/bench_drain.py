"""Drain benchmark against a real radosgw: the ckptfs drain vs boto3, same data, same run.

What it measures (radosgw on 127.0.0.1, started by the bench unless
``CKPTFS_S3_ENDPOINT`` points at one; never moto):

1. **Throughput and CPU, drain vs boto3.** The same files (default 8 x 192 MiB
   + 32 small ones, ~1.5 GiB) are uploaded, alternating, for ``--rounds``
   rounds:

   * *drain*: a cache directory is filled once through a real mount with
     ``settle_seconds = 3600`` (nothing drains while writing); before each
     round every file is requeued in fsmeta (new generation, as a rewrite
     would) and ``python -m ckptfs drain --cache-dir C --until-empty`` runs as a
     child process. Wall time is the child's lifetime (process start-up and
     the bucket check included; the start-up of an idle drain is measured and
     shown separately); CPU is the child's rusage (``os.wait4``), all threads.
     The drain hashes every file with BLAKE3 (``x-amz-meta-blake3``); boto3 does not.
   * *boto3*: the same files from a plain directory with boto3's transfer
     manager (what ``upload_file`` uses; all files submitted at once so both
     sides get the same total concurrency), ``TransferConfig`` with the same
     part size and concurrency as the drain, in a child process, peak RSS its
     ``VmHWM``. Two baselines: the upload alone (the child's rusage delta from
     client creation to the end; interpreter start-up and imports excluded),
     against the steady drain; and the whole child process, start-up included,
     against the one-shot drain process, which pays its own. Client config as
     the harness uses for radosgw (path style, ``when_required`` checksums;
     SigV4 signs payloads over http, i.e. SHA-256).

   radosgw's own CPU (rgw + OSD + mon + mgr, from /proc) is shown for each
   side: on 2 cores it competes with the uploader.

2. **Ack -> durable.** A 1 GiB checkpoint written through a mount with the
   default settings (settle 1 s): the time from the writer's fsync + close
   returning until ``wait-durable`` returns, against the target
   ``size / ceiling + 2 s`` where the ceiling is the best upload throughput
   of this run (either side).

Usage::

    .venv/bin/python -m integration.bench_drain [--rounds 3] [--files 8] [--file-mib 192]
        [--small 32] [--part-size-mib 64] [--concurrency 8] [--ack-gib 1] [--workdir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from integration.test_drain_common import Mount, rand, s3_env  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


# -- CPU accounting ----------------------------------------------------------------------------


def proc_cpu(pids) -> float:
    """utime + stime (s) of the given pids, from /proc/PID/stat (live processes only)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK
        except (OSError, ValueError, IndexError):
            pass
    return total


def server_pids(s3) -> list[int]:
    pids = list(s3.pids.values())
    if not pids and os.environ.get("CEPH_CONF"):
        piddir = Path(os.environ["CEPH_CONF"]).parent / "pids"
        for p in piddir.glob("*.pid"):
            try:
                pids.append(int(p.read_text().strip()))
            except ValueError:
                pass
    return pids


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# -- the two uploaders -----------------------------------------------------------------------------


def requeue_all(cache: Path, *, settle: float = 0.0, meta=None) -> int:
    """Mark every file of the cache as rewritten (new generation, pending), settle window 0."""
    from ckptfs.fsmeta import ROOT_INO, MetaStore, durability

    own = meta is None
    if own:
        meta = MetaStore(str(cache / "meta"), create=False)
    try:
        settings = meta.get_settings()
        settings["settle_seconds"] = settle
        meta.put_settings(settings)

        def requeue(txn):
            n = 0
            now = time.time_ns()
            for _, ino in txn.iter_subtree(ROOT_INO):
                inode = txn.get_inode(ino)
                if inode is not None and inode.is_reg:
                    durability.mark_dirty(txn, inode, now)
                    txn.put_inode(inode)
                    n += 1
            return n

        return meta.write(requeue)
    finally:
        if own:
            meta.close()


def vm_hwm_mib(pid: int, cmd_tail: str | None = None) -> float:
    """Peak RSS (VmHWM) of a live process, 0 if gone (or, with ``cmd_tail``, not yet exec'd)."""
    try:
        if cmd_tail is not None:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().rstrip(b"\0").endswith(cmd_tail.encode()):
                    return 0.0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_child(cmd: list[str], env: dict | None = None) -> tuple[bytes, float, object, float]:
    """Run ``cmd`` to its end: (stdout, wall seconds, rusage from ``os.wait4`` (all its
    threads), peak RSS MiB). The peak is VmHWM sampled every 20 ms, not ``ru_maxrss``:
    a child exec'd from a vfork inherits the parent's high-water mark in that."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = [], []
    readers = [threading.Thread(target=lambda s=s, b=b: b.extend(s), daemon=True)
               for s, b in ((p.stdout, out), (p.stderr, err))]
    peak = [0.0]
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], vm_hwm_mib(p.pid, cmd[-1]))

    readers.append(threading.Thread(target=sample, daemon=True))
    for r in readers:
        r.start()
    _, status, ru = os.wait4(p.pid, 0)
    done.set()
    wall = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join(5)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {p.returncode}: {b''.join(err)[-3000:].decode(errors='replace')}")
    return b"".join(out), wall, ru, peak[0]


def run_drain(cache: Path, env: dict, rgw: list[int]) -> dict:
    rgw0 = proc_cpu(rgw)
    _, wall, ru, peak = run_child(
        [sys.executable, "-m", "ckptfs", "drain", "--cache-dir", str(cache), "--until-empty"], env)
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "rgw_cpu": proc_cpu(rgw) - rgw0, "maxrss_mib": peak}


class SteadyDrain:
    """One long-lived ``python -m ckptfs drain --cache-dir C`` child (as under a mount):
    each round requeues every file and waits until fsmeta has nothing pending; CPU is
    the child's utime + stime delta over the round (/proc), start-up excluded."""

    def __init__(self, cache: Path, env: dict):
        from ckptfs.fsmeta import MetaStore

        self.cache = cache
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "drain", "--cache-dir", str(cache)],
                                     env=env, cwd=str(REPO), stdout=subprocess.DEVNULL,
                                     stderr=open(cache.parent / "steady-drain.log", "ab"))
        self.meta = MetaStore(str(cache / "meta"), create=False)
        if not self.wait_idle(120):
            raise RuntimeError("steady drain did not settle")

    def idle(self) -> bool:
        with self.meta.read() as txn:
            return next(txn.iter_pending(), None) is None and next(txn.iter_tombstones(), None) is None

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"drain exited with {self.proc.returncode}")
            if self.idle():
                return True
            time.sleep(0.02)
        return False

    def round(self, rgw: list[int]) -> dict:
        rgw0, cpu0 = proc_cpu(rgw), proc_cpu([self.proc.pid])
        t0 = time.monotonic()
        requeue_all(self.cache, meta=self.meta)
        if not self.wait_idle(900):
            raise RuntimeError("drain round did not finish in 900 s")
        return {"wall": time.monotonic() - t0, "cpu": proc_cpu([self.proc.pid]) - cpu0,
                "rgw_cpu": proc_cpu(rgw) - rgw0, "maxrss_mib": vm_hwm_mib(self.proc.pid)}

    def stop(self) -> None:
        self.meta.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_BOTO3_CHILD = """
import json, resource, sys, time
import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
a = json.loads(sys.argv[1])
cfg = TransferConfig(multipart_threshold=a["part_size"], multipart_chunksize=a["part_size"],
                     max_concurrency=a["concurrency"], use_threads=True)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.monotonic()
client = boto3.client("s3", config=Config(**a["config"]), **a["client"])
with create_transfer_manager(client, cfg) as tm:
    futures = [tm.upload(f, a["bucket"], a["prefix"] + "/" + f.rsplit("/", 1)[1]) for f in a["files"]]
    for fut in futures:
        fut.result()
print(json.dumps({"wall": time.monotonic() - t0, "cpu": cpu() - c0}))
"""


def run_boto3(s3, bucket: str, prefix: str, files: list[Path], part_size: int, concurrency: int,
              rgw: list[int]) -> dict:
    """boto3's transfer manager in a child process (its own peak RSS). ``wall``/``cpu``: the
    child's own clock around the upload (client creation included, interpreter start-up and
    imports excluded), the baseline of the steady drain; ``process_wall``/``process_cpu``: the
    whole child, start-up included, the like-for-like baseline of a one-shot drain process."""
    cfg = s3.boto_config(max_pool_connections=concurrency + 4)
    config = {k: getattr(cfg, k) for k in ("signature_version", "s3", "max_pool_connections",
                                           "request_checksum_calculation", "response_checksum_validation",
                                           "retries", "region_name") if getattr(cfg, k, None) is not None}
    arg = {"part_size": part_size, "concurrency": concurrency, "config": config, "client": s3.client_kwargs(),
           "bucket": bucket, "prefix": prefix, "files": [str(f) for f in files]}
    rgw0 = proc_cpu(rgw)
    out, wall, ru, peak = run_child([sys.executable, "-c", _BOTO3_CHILD, json.dumps(arg)])
    res = json.loads(out.decode().strip().splitlines()[-1])
    res["process_wall"], res["process_cpu"] = wall, ru.ru_utime + ru.ru_stime
    res["rgw_cpu"] = proc_cpu(rgw) - rgw0
    res["maxrss_mib"] = peak
    return res


# -- ack -> durable --------------------------------------------------------------------------------


def ack_to_durable(s3, bucket: str, base: Path, size: int) -> dict:
    from ckptfs.cli.status import wait_durable

    m = Mount(s3, bucket, "ack", base, name="ack")  # default settings: settle 1 s, 64 MiB parts
    m.start()
    try:
        data = rand(size, 4242)
        (m.mnt / "step_1").mkdir()
        path = m.mnt / "step_1" / "model.pt"
        t_open = time.monotonic()
        with open(path, "wb") as f:
            mv = memoryview(data)
            for off in range(0, size, 8 * MiB):
                f.write(mv[off:off + 8 * MiB])
            f.flush()
            os.fsync(f.fileno())
        t_ack = time.monotonic()
        ok = wait_durable(str(path), timeout=600, interval=0.02)
        t_durable = time.monotonic()
        if not ok:
            raise RuntimeError("1 GiB file did not become durable in 600 s")
        head = s3.client().head_object(Bucket=bucket, Key="ack/step_1/model.pt")
        assert head["ContentLength"] == size
        return {"write": t_ack - t_open, "ack_to_durable": t_durable - t_ack}
    finally:
        m.unmount()


# -- main -------------------------------------------------------------------------------------------


def fmt_rate(nbytes: int, secs: float) -> str:
    return f"{nbytes / secs / MiB:7.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m integration.bench_drain", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=192)
    ap.add_argument("--small", type=int, default=32, help="number of small files (64 KiB .. 2 MiB)")
    ap.add_argument("--part-size-mib", type=int, default=None, help="default: the drain's default part_size")
    ap.add_argument("--concurrency", type=int, default=None, help="default: the drain's default concurrency")
    ap.add_argument("--ack-gib", type=float, default=1.0)
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    from ckptfs.fsmeta.settings import Settings

    defaults = Settings()
    part_size = (args.part_size_mib * MiB) if args.part_size_mib else int(defaults.part_size)
    concurrency = args.concurrency or int(defaults.concurrency)

    from integration.s3server import start_from_env

    base = Path(tempfile.mkdtemp(prefix="ckptfs-bench-drain-", dir=args.workdir))
    s3 = None
    try:
        t = time.monotonic()
        s3 = start_from_env(base / "rgw", tls=False, osd_size_gib=64, with_mgr=False)
        print(f"# S3: {s3.kind} at {s3.endpoint_url} (ready in {time.monotonic() - t:.1f}s); "
              f"load average {loadavg()}; {os.cpu_count()} CPUs", flush=True)
        if s3.kind == "moto":
            print("refusing to benchmark against moto", file=sys.stderr)
            return 2
        rgw = server_pids(s3)
        bucket = f"bench-drain-{os.getpid()}"
        s3.make_bucket(bucket)
        env = s3_env(s3)

        # the data: big files + small ones, identical for both sides
        src = base / "src"
        src.mkdir()
        sizes = {f"shard_{i:02d}.bin": args.file_mib * MiB for i in range(args.files)}
        for i in range(args.small):
            sizes[f"small_{i:02d}.json"] = 64 * 1024 * (1 + (i * 7) % 32)
        total = sum(sizes.values())
        block = rand(args.file_mib * MiB, 1)
        for i, (name, size) in enumerate(sizes.items()):
            with open(src / name, "wb") as f:
                f.write(i.to_bytes(8, "little") + block[8:size])
        files = sorted(src.iterdir())

        # fill a cache through a mount; nothing drains (settle 3600 s)
        t = time.monotonic()
        m = Mount(s3, bucket, "drain", base, name="fill",
                  drain={"settle_seconds": 3600, "part_size": part_size, "concurrency": concurrency})
        m.start()
        for f in files:
            shutil.copyfile(f, m.mnt / f.name)
        assert m.unmount() == 0
        cache = m.cache
        print(f"# {len(files)} files, {total / GiB:.2f} GiB; part size {part_size // MiB} MiB, "
              f"concurrency {concurrency}; cache filled through a mount in {time.monotonic() - t:.1f}s",
              flush=True)

        # start-up cost of the drain process alone (nothing queued)
        requeue_all(cache)  # settle 0 from now on (the fill mount recorded 3600)
        warm = run_drain(cache, env, rgw)  # everything is pending after the fill: a warm-up round
        print(f"# warm-up: one-shot drain --until-empty {warm['wall']:.2f}s", flush=True)
        idle = run_drain(cache, env, rgw)  # now nothing is queued
        print(f"# drain process with an empty queue: {idle['wall']:.2f}s wall, {idle['cpu']:.2f} CPU-s",
              flush=True)

        results = {"drain": [], "boto3": [], "oneshot": []}
        steady = SteadyDrain(cache, env)
        try:
            for r in range(args.rounds):
                for side in ("drain", "boto3", "oneshot") if r % 2 == 0 else ("oneshot", "boto3", "drain"):
                    if side == "drain":
                        res = steady.round(rgw)
                    elif side == "oneshot":
                        steady.stop()
                        requeue_all(cache)
                        res = run_drain(cache, env, rgw)
                        steady = SteadyDrain(cache, env)
                    else:
                        res = run_boto3(s3, bucket, "boto3", files, part_size, concurrency, rgw)
                    res["mibps"] = total / res["wall"] / MiB
                    res["cpu_per_gib"] = res["cpu"] / (total / GiB)
                    res["rgw_cpu_per_gib"] = res["rgw_cpu"] / (total / GiB)
                    if side == "boto3":  # the whole child: what a one-shot drain process is held to
                        res["process_mibps"] = total / res["process_wall"] / MiB
                        res["process_cpu_per_gib"] = res["process_cpu"] / (total / GiB)
                    results[side].append(res)
                    print(f"  round {r + 1} {side:7s}: {res['wall']:6.2f}s  {res['mibps']:6.1f} MiB/s  "
                          f"CPU {res['cpu']:5.2f}s ({res['cpu_per_gib']:.2f} s/GiB)  "
                          f"radosgw CPU {res['rgw_cpu']:5.2f}s   load {loadavg()}", flush=True)
        finally:
            steady.stop()

        # sanity: the drain's objects are complete and carry their hash
        c = s3.client()
        head = c.head_object(Bucket=bucket, Key=f"drain/{files[0].name}")
        assert head["ContentLength"] == files[0].stat().st_size and "blake3" in head["Metadata"]

        ack = ack_to_durable(s3, bucket, base, int(args.ack_gib * GiB)) if args.ack_gib > 0 else None

        med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in results.items()}
        best = max(x["mibps"] for rs in results.values() for x in rs)
        d, b, o = med["drain"], med["boto3"], med["oneshot"]

        def row(name, key, fmt, target=None, good=None):
            # steady against boto3's upload alone; one-shot against boto3's whole process
            # (both sides then pay their interpreter start-up, imports and client set-up)
            b_proc = b.get("process_" + key, b[key])
            cells = "".join(f"{fmt.format(v):>12s}" for v in (d[key], o[key], b[key], b_proc))
            r1, r2 = d[key] / b[key], o[key] / b_proc
            verdict = ""
            if target:
                verdict = f"  {target}: {'OK' if good(r1) else 'MISSED'} / {'OK' if good(r2) else 'MISSED'}"
            print(f"{name:24s}{cells}{r1:10.2f}{r2:10.2f}{verdict}")

        print()
        print(f"{'':24s}{'drain':>12s}{'drain':>12s}{'boto3':>12s}{'boto3':>12s}{'ratio':>10s}{'ratio':>10s}")
        print(f"{'':24s}{'(steady)':>12s}{'(one-shot)':>12s}{'(upload)':>12s}{'(process)':>12s}"
              f"{'steady':>10s}{'one-shot':>10s}")
        row("throughput MiB/s", "mibps", "{:.1f}", ">= 1.1", lambda r: r >= 1.1)
        row("CPU s/GiB (uploader)", "cpu_per_gib", "{:.2f}", "<= 1.0 (aim 0.5)", lambda r: r <= 1.0)
        row("CPU s/GiB (radosgw)", "rgw_cpu_per_gib", "{:.2f}")
        peak = {side: max(x["maxrss_mib"] for x in rs) for side, rs in results.items()}
        print(f"{'peak RSS MiB (max)':24s}{peak['drain']:>12.0f}{peak['oneshot']:>12.0f}{peak['boto3']:>12.0f}"
              f"{'':20s}  drain <= 256: {'OK' if peak['drain'] <= 256 else 'MISSED'} / "
              f"{'OK' if peak['oneshot'] <= 256 else 'MISSED'}")
        print(f"(medians of {args.rounds} rounds of {total / GiB:.2f} GiB; spread MiB/s: drain "
              + ", ".join(f"{side} {min(x['mibps'] for x in rs):.0f}..{max(x['mibps'] for x in rs):.0f}"
                          for side, rs in results.items())
              + f"; one-shot includes the process start-up: {idle['wall']:.2f}s / {idle['cpu']:.2f} CPU-s"
              " with nothing to do)")
        if ack:
            size = int(args.ack_gib * GiB)
            target = size / (best * MiB) + 2.0
            print(f"ack -> durable, {args.ack_gib:g} GiB through a mount: {ack['ack_to_durable']:.2f}s "
                  f"(write+fsync {ack['write']:.2f}s); target size/ceiling + 2 s = {target:.2f}s "
                  f"(ceiling {best:.0f} MiB/s) {'OK' if ack['ack_to_durable'] <= target else 'MISSED'}")
        print(f"load average at the end: {loadavg()}")
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "idle": idle, "ack": ack,
                                                   "total_bytes": total}, indent=2))
        return 0
    finally:
        if s3 is not None:
            s3.stop(remove=not args.keep)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())

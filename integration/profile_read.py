"""Where the gateway's CPU goes on the read path: one cold read (one reader, or
``--readers N`` reading N files of ``--mib``/N in parallel) and one ``ckptfs prefetch`` of the
same files, against a real radosgw, with the gateway's CPU seconds
per GiB (``/proc/PID/stat``) and optionally a profile of the gateway process alone:

* ``--profiler perf``: ``perf record -g`` (kernel and user frames) into
  ``OUT-read.perf`` / ``OUT-prefetch.perf``; read with ``perf report -i ... --no-children``;
* ``--profiler py-spy``: ``py-spy record --gil`` (Python frames of the thread holding the GIL)
  into ``OUT-read.txt`` / ``OUT-prefetch.txt`` (collapsed stacks).

The file is written through a mount, drained, and evicted before each side (as
``bench_read.py`` does). radosgw on 127.0.0.1 is started unless ``CKPTFS_S3_ENDPOINT`` points
at one; never moto.

Usage::

    .venv/bin/python -m integration.profile_read [--mib 1024] [--profiler none|perf|py-spy]
        [--out /tmp/ckptfs-read] [--workdir /var/tmp] [--served PASSES] [--readers N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from integration.bench_drain import proc_cpu
from integration.bench_read import Bench, evict_all, read_file, read_parallel, tear_down, write_random
from integration.test_drain_common import ckptfs_cmd, s3_env


def profiler_argv(profiler: str, pid: int, out: str) -> list[str] | None:
    if profiler == "perf":
        return ["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", f"{out}.perf"]
    if profiler == "py-spy":
        return [str(Path(sys.executable).parent / "py-spy"), "record", "--gil", "-r", "200", "-p", str(pid),
                "--format", "raw", "-o", f"{out}.txt"]
    return None


def report(what: str, mib: int, seconds: float, cpu: float) -> None:
    print(f"{what:9s}{mib * MiB / seconds / 1e6:7.0f} MB/s  gateway {cpu / (mib * MiB / GiB):5.2f} "
          "CPU s/GiB", flush=True)


def serve_again(fd: int, chunk: int = 8 * MiB) -> None:
    """Read the open file once more, with the kernel's page cache of it dropped first: the
    blocks are all in the cache file now, so the gateway only serves READs."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buf = bytearray(chunk)
    offset = 0
    while n := os.preadv(fd, [buf], offset):
        offset += n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m integration.profile_read", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--profiler", choices=("none", "perf", "py-spy"), default="none")
    ap.add_argument("--out", default="/tmp/ckptfs-read")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--served", type=int, default=0, metavar="PASSES",
                    help="also measure READ serving alone: after the cold read, PASSES more reads "
                         "through the same open file with its page cache dropped (every READ "
                         "reaches the gateway, every block is in the cache file)")
    ap.add_argument("--readers", type=int, default=1,
                    help="read N files of MIB/N each, one thread per file (not with --served)")
    args = ap.parse_args(argv)
    if args.served and args.readers != 1:
        ap.error("--served reads one file: use it with --readers 1")

    from integration.s3server import start_from_env

    base = Path(tempfile.mkdtemp(prefix="ckptfs-profile-read-", dir=args.workdir))
    s3 = bench = None
    try:
        s3 = start_from_env(base / "rgw", tls=False, osd_size_gib=16, with_mgr=False)
        if s3.kind == "moto":
            print("refusing to measure against moto", file=sys.stderr)
            return 2
        bucket = s3.make_bucket(f"profile-read-{os.getpid()}")
        os.environ.update(s3_env(s3))
        bench = Bench(s3, bucket, base, 8 * MiB, 16)
        m = bench.mount
        src = base / "src.bin"
        write_random(src, args.mib * MiB // args.readers)
        names = ["ckpt/big.bin"] if args.readers == 1 else [f"ckpt/shard_{i}.bin" for i in range(args.readers)]
        m.start()
        (m.mnt / "ckpt").mkdir()
        for name in names:
            shutil.copyfile(src, m.mnt / name)
        m.wait_durable("", timeout=3600)
        m.unmount()
        evict_all(m.cache)
        for what in ("read", "prefetch"):
            m.start()
            pid = m.proc.pid
            cmd = profiler_argv(args.profiler, pid, f"{args.out}-{what}")
            prof = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if cmd else None
            if prof is not None:
                time.sleep(1.5)  # attached before the first byte
            cpu0, t0 = proc_cpu([pid]), time.monotonic()
            if what == "read":
                if args.readers > 1:
                    read_parallel([m.mnt / name for name in names])
                else:
                    with open(m.mnt / "ckpt/big.bin", "rb", buffering=0) as held:
                        read_file(m.mnt / "ckpt/big.bin")
                        if args.served:
                            report("read", args.mib, time.monotonic() - t0, proc_cpu([pid]) - cpu0)
                            what = "served"
                            cpu0, t0 = proc_cpu([pid]), time.monotonic()
                            for _ in range(args.served):
                                serve_again(held.fileno())
                            mib = args.mib * args.served
            else:
                subprocess.run([*ckptfs_cmd(), "prefetch", str(m.mnt / "ckpt")], check=True, capture_output=True)
            seconds, cpu = time.monotonic() - t0, proc_cpu([pid]) - cpu0
            if prof is not None:
                prof.send_signal(signal.SIGINT)
                prof.wait(timeout=120)
            report(what, mib if what == "served" else args.mib, seconds, cpu)
            m.unmount()
            evict_all(m.cache)
        return 0
    finally:
        tear_down(bench, s3, base)


if __name__ == "__main__":
    sys.exit(main())

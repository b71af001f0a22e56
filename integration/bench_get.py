"""GET-path micro-benchmark against a real radosgw: CPU seconds per GiB and MB/s of
``S3Store.get_to_file`` vs boto3's transfer manager vs a bare httpx GET, same object, same run.

The load-independent figure is **CPU seconds per GiB** of this process (all threads,
``getrusage``): on a shared machine wall time moves with the load, CPU per byte does not
(much). Each side fetches the whole object as ``part``-sized ranged GETs, ``concurrency`` in
flight, into a file on ``--workdir`` (page cache writes included for every side):

* ``store``: ``S3Store.get_to_file`` (aiobotocore under trio), one call per part;
* ``boto3``: ``TransferManager.download`` (threads), same part size and concurrency;
* ``httpx``: presigned ranged GETs with a bare ``httpx.AsyncClient`` under trio, each
  streamed to the file with ``pwrite`` in a worker thread: what any async GET costs;
* ``urllib3``: presigned ranged GETs with urllib3 in worker threads, ``pwrite`` of each
  1 MiB read (new ``bytes`` each);
* ``readinto``: the same, the body read with ``readinto`` into one reused buffer per thread
  (what the store does since issue 10's third pass);
* ``splice``: the same, the body moved with ``os.splice`` socket -> pipe -> file (no copy
  through user space; plain http only).

radosgw on 127.0.0.1 is started unless ``CKPTFS_S3_ENDPOINT`` points at one; never moto.
``--profile store`` writes a cProfile of the store side to ``--profile-out``.

Usage::

    .venv/bin/python -m integration.bench_get [--mib 256] [--rounds 3] [--part-size-mib 8]
        [--concurrency 16] [--sides store,boto3,httpx] [--profile store]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from integration.bench_drain import loadavg
from integration.bench_read import write_random


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Timer:
    """CPU and wall time from ``start()`` (after a side's set-up: client creation, loading
    botocore's service models) to the end of the side."""

    def start(self) -> None:
        self.cpu, self.wall = cpu_seconds(), time.monotonic()


def open_dest(dest: Path, size: int) -> int:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    return fd


async def each_part(size: int, part: int, concurrency: int, get) -> None:
    """``await get(offset, length)`` for every part of the object, ``concurrency`` at a time."""
    import trio

    limiter = trio.CapacityLimiter(concurrency)

    async def one(off, ln):
        async with limiter:
            await get(off, ln)

    async with trio.open_nursery() as nursery:
        for off in range(0, size, part):
            nursery.start_soon(one, off, min(part, size - off))


def run_store(s3, bucket: str, key: str, size: int, dest: Path, part: int, concurrency: int, timer: Timer) -> None:
    import trio

    from ckptfs.drain.s3store import S3Store

    async def main():
        store = S3Store(bucket=bucket, endpoint_url=s3.endpoint_url, region=s3.region,
                        concurrency=concurrency, max_pool_connections=concurrency + 4,
                        aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key)
        await store.open()
        timer.start()
        fd = open_dest(dest, size)

        async def get(off, ln):
            n = await store.get_to_file(key, fd, off, ln)
            assert n == ln, (n, ln)

        try:
            await each_part(size, part, concurrency, get)
        finally:
            os.close(fd)
            await store.aclose()

    trio.run(main)


def run_boto3(s3, bucket: str, key: str, size: int, dest: Path, part: int, concurrency: int, timer: Timer) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                         max_concurrency=concurrency, use_threads=True)
    client = boto3.client("s3", config=s3.boto_config(max_pool_connections=concurrency + 4), **s3.client_kwargs())
    client.head_bucket(Bucket=bucket)  # connect, as the store's open does
    timer.start()
    with create_transfer_manager(client, cfg) as tm:
        tm.download(bucket, key, str(dest)).result()


def run_httpx(s3, bucket: str, key: str, size: int, dest: Path, part: int, concurrency: int, timer: Timer) -> None:
    import httpx
    import trio

    url = s3.client().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600)

    async def main():
        fd = open_dest(dest, size)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4), timeout=120) as http:
            timer.start()

            async def get(off, ln):
                async with http.stream("GET", url, headers={"Range": f"bytes={off}-{off + ln - 1}"}) as r:
                    r.raise_for_status()
                    pos = off
                    async for chunk in r.aiter_raw(4 * MiB):
                        await trio.to_thread.run_sync(os.pwrite, fd, chunk, pos)
                        pos += len(chunk)
                    assert pos == off + ln

            try:
                await each_part(size, part, concurrency, get)
            finally:
                os.close(fd)

    trio.run(main)


def _bare_gets(s3, bucket: str, key: str, size: int, dest: Path, part: int, concurrency: int, timer: Timer,
               receive) -> None:
    """Presigned ranged GETs with urllib3 in worker threads; ``receive(r, fd, pos)`` takes
    the body of the urllib3 response ``r`` into ``fd`` at ``pos`` and returns the bytes written."""
    import trio
    import urllib3

    url = s3.client().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600)
    pool = urllib3.PoolManager(maxsize=concurrency + 4)
    timer.start()

    def get_sync(fd, off, ln):
        r = pool.request("GET", url, headers={"Range": f"bytes={off}-{off + ln - 1}"}, preload_content=False,
                         decode_content=False)
        n = receive(r, fd, off)
        r.release_conn()
        assert n == ln

    async def main():
        fd = open_dest(dest, size)
        try:
            await each_part(size, part, concurrency, lambda off, ln: trio.to_thread.run_sync(get_sync, fd, off, ln))
        finally:
            os.close(fd)

    trio.run(main)


def run_urllib3(*args) -> None:
    """``read`` 1 MiB at a time (new ``bytes`` each), ``pwrite`` each."""

    def receive(r, fd, pos):
        start = pos
        while data := r.read(MiB):
            os.pwrite(fd, data, pos)
            pos += len(data)
        return pos - start

    _bare_gets(*args, receive)


def run_readinto(*args) -> None:
    """What ``S3Store.get_to_file`` does now: ``readinto`` one reused 1 MiB buffer per thread."""
    import threading

    local = threading.local()

    def receive(r, fd, pos):
        raw = r._fp
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(MiB))
        start = pos
        while n := raw.readinto(buf):
            os.pwritev(fd, [buf[:n]], pos)
            pos += n
        return pos - start

    _bare_gets(*args, receive)


def run_splice(*args) -> None:
    """Zero-copy: ``os.splice`` socket -> pipe -> file (after the bytes http.client buffered)."""
    import fcntl
    import select
    import threading

    local = threading.local()

    def receive(r, fd, pos):
        raw = r._fp
        pipe = getattr(local, "pipe", None)
        if pipe is None:
            pipe = local.pipe = os.pipe()
            fcntl.fcntl(pipe[1], 1031, MiB)  # F_SETPIPE_SZ
        start, left = pos, raw.length
        head = raw.fp.peek(1)[:left]  # what the buffered reader holds already
        if head:
            raw.fp.read(len(head))
            os.pwrite(fd, head, pos)
            pos += len(head)
            left -= len(head)
        sock = raw.fp.raw._sock
        while left:
            try:
                n = os.splice(sock.fileno(), pipe[1], min(left, MiB), flags=os.SPLICE_F_MOVE)
            except BlockingIOError:
                select.select([sock], [], [], 30)
                continue
            if n == 0:
                break
            left -= n
            while n:
                m = os.splice(pipe[0], fd, n, offset_dst=pos, flags=os.SPLICE_F_MOVE)
                n -= m
                pos += m
        raw.length = 0
        raw._close_conn()
        return pos - start

    _bare_gets(*args, receive)


SIDES = {"store": run_store, "boto3": run_boto3, "httpx": run_httpx, "urllib3": run_urllib3,
         "readinto": run_readinto, "splice": run_splice}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m integration.bench_get", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--part-size-mib", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--sides", default="store,boto3,httpx,urllib3")
    ap.add_argument("--profile", choices=sorted(SIDES), help="cProfile this side (one extra run)")
    ap.add_argument("--profile-out", default="/tmp/bench_get.prof")
    ap.add_argument("--workdir", default="/var/tmp")
    args = ap.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]

    from integration.s3server import start_from_env

    base = Path(tempfile.mkdtemp(prefix="ckptfs-bench-get-", dir=args.workdir))
    s3 = None
    try:
        s3 = start_from_env(base / "rgw", tls=False, osd_size_gib=16, with_mgr=False)
        if s3.kind == "moto":
            print("refusing to benchmark against moto", file=sys.stderr)
            return 2
        bucket = s3.make_bucket(f"bench-get-{os.getpid()}")
        key = "obj.bin"
        size = args.mib * MiB
        src = base / "src.bin"
        write_random(src, size)
        s3.client().upload_file(str(src), bucket, key)
        os.unlink(src)
        part = args.part_size_mib * MiB
        print(f"# {s3.kind} at {s3.endpoint_url}; {args.mib} MiB object, part {args.part_size_mib} MiB, "
              f"concurrency {args.concurrency}; load average {loadavg()}", flush=True)
        res: dict[str, list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                dest = base / f"{side}.out"
                timer = Timer()
                SIDES[side](s3, bucket, key, size, dest, part, args.concurrency, timer)
                c1, t1 = cpu_seconds(), time.monotonic()
                c0, t0 = timer.cpu, timer.wall
                if os.path.getsize(dest) != size:
                    raise SystemExit(f"{side}: wrong size {os.path.getsize(dest)}")
                os.unlink(dest)
                res.setdefault(side, []).append((size / (t1 - t0), (c1 - c0) / (size / GiB)))
                print(f"round {r} {side:6s} {size / (t1 - t0) / 1e6:7.0f} MB/s {(c1 - c0) / (size / GiB):6.2f} CPU s/GiB",
                      flush=True)
        print(f"\n# medians of {args.rounds} rounds; load average now {loadavg()}")
        print(f"{'side':8s}{'MB/s':>8s}{'CPU s/GiB':>11s}")
        for side in sides:
            mbs = statistics.median(v[0] for v in res[side]) / 1e6
            cpu = statistics.median(v[1] for v in res[side])
            print(f"{side:8s}{mbs:8.0f}{cpu:11.2f}")
        if args.profile:
            import cProfile

            dest = base / "prof.out"
            cProfile.runctx(
                "fn(s3, bucket, key, size, dest, part, c, Timer())", globals(),
                {"fn": SIDES[args.profile], "s3": s3, "bucket": bucket, "key": key, "size": size, "dest": dest,
                 "part": part, "c": args.concurrency}, filename=args.profile_out)
            print(f"# profile of {args.profile} in {args.profile_out}")
        return 0
    finally:
        if s3 is not None:
            s3.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""CPU cost of uploads in *this* process (not the server's): ckptfs S3Store /
upload_file vs boto3's TransferManager, same part size and concurrency.

    python -m integration.bench_upload_cpu --endpoint http://127.0.0.1:PORT --bucket B \
        [--size-mib 512] [--part-mib 64] [--concurrency 8] [--only NAME,...]

Needs credentials in the environment (any values for moto).  Reports user+sys
CPU seconds per GiB (getrusage, all threads) and wall time.  Wall time against
moto measures moto, not us.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

import trio

from ckptfs.drain.store import MiB
from ckptfs.drain.factory import open_store


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class Meter:
    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes = name, nbytes

    def __enter__(self):
        self.c0, self.w0 = _cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        u1, s1 = _cpu()
        gib = self.nbytes / (1 << 30)
        u, s = (u1 - self.c0[0]) / gib, (s1 - self.c0[1]) / gib
        w = (time.perf_counter() - self.w0) / gib
        print(f"{self.name:44s} cpu {u + s:6.2f} s/GiB (user {u:5.2f} sys {s:5.2f})  wall {w:6.2f} s/GiB", flush=True)


async def _parts_only(args, path, size, checksum, sign, botocore_signing=False):
    async with open_store(
        f"s3://{args.bucket}/bench", endpoint_url=args.endpoint, checksum=checksum,
        sign_payload=sign, concurrency=args.concurrency,
    ) as st:
        await st.open()
        if botocore_signing:
            # undo our signer selection: botocore hashes the body itself, on the event loop
            for op in ("PutObject", "UploadPart"):
                st._client.meta.events.unregister(f"choose-signer.s3.{op}", unique_id=f"ckptfs-signer-{op}")
        ps = args.part_mib * MiB
        label = f"S3Store.upload_part checksum={checksum}{' +signed payload' if sign else ''}"
        if botocore_signing:
            label = f"S3Store.upload_part {checksum} +botocore body SHA256"
        for run in range(args.repeat):
            uid = await st.create_multipart("parts-only", {})
            ranges = [(i + 1, off, min(ps, size - off)) for i, off in enumerate(range(0, size, ps))]
            parts = []
            sem = trio.Semaphore(args.concurrency)

            async def one(n, off, ln):
                async with sem:
                    parts.append(await st.upload_part("parts-only", uid, n, path, off, ln))

            with Meter(label + (" (warm-up)" if run == 0 and args.repeat > 1 else ""), size):
                async with trio.open_nursery() as nursery:
                    for r in ranges:
                        nursery.start_soon(one, *r)
            await st.complete_multipart("parts-only", uid, parts)
            await st.delete("parts-only")


async def _full(args, path, size, checksum):
    from ckptfs.drain.upload import UploadOptions, upload_file

    async with open_store(
        f"s3://{args.bucket}/bench", endpoint_url=args.endpoint, checksum=checksum, concurrency=args.concurrency
    ) as st:
        await st.open()
        for run in range(args.repeat):
            label = f"upload_file (blake3 pass + multipart) {st.checksum_mode}"
            with Meter(label + (" (warm-up)" if run == 0 and args.repeat > 1 else ""), size):
                options = UploadOptions(part_size=args.part_mib * MiB, concurrency=args.concurrency)
                await upload_file(st, "full", path, {}, options=options)
            await st.delete("full")


async def _hash(path, size):
    from ckptfs.drain.upload import hash_file

    with Meter("blake3 hash pass alone (page cache)", size):
        await hash_file(path)


def _boto3(args, path, size, when_required: bool):
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    cfg = Config(max_pool_connections=args.concurrency + 4)
    if when_required:
        cfg = cfg.merge(Config(request_checksum_calculation="when_required"))
    c = boto3.client("s3", endpoint_url=args.endpoint, region_name="us-east-1", config=cfg)
    tc = TransferConfig(
        multipart_threshold=args.part_mib * MiB,
        multipart_chunksize=args.part_mib * MiB,
        max_concurrency=args.concurrency,
        use_threads=True,
    )
    label = "boto3 upload_file " + ("(checksum when_required)" if when_required else "(defaults: CRC32)")
    for run in range(args.repeat):
        with Meter(label + (" (warm-up)" if run == 0 and args.repeat > 1 else ""), size):
            c.upload_file(path, args.bucket, "bench/boto3", Config=tc)
        c.delete_object(Bucket=args.bucket, Key="bench/boto3")


# --------------------------------------------------------------------------
# a minimal S3 "sink": accepts PutObject/multipart requests, discards bodies
# quickly (threads + recv_into), so that client-side CPU is not distorted by a
# slow server (moto needs ~20 s/GiB).  Not a real S3: no auth, no storage.

_SINK_XML = {
    "init": (
        '<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult>'
        "<Bucket>b</Bucket><Key>k</Key><UploadId>sink-upload</UploadId></InitiateMultipartUploadResult>"
    ),
    "complete": (
        '<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult>'
        '<Bucket>b</Bucket><Key>k</Key><ETag>"0123456789abcdef0123456789abcdef-1"</ETag>'
        "</CompleteMultipartUploadResult>"
    ),
}


def _sink_conn(conn) -> None:
    import socket

    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    pending = b""
    try:
        while True:
            while b"\r\n\r\n" not in pending:
                d = conn.recv(65536)
                if not d:
                    return
                pending += d
            head, pending = pending.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            if hdrs.get("expect", "").lower() == "100-continue":
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            left = int(hdrs.get("content-length", "0")) - len(pending)
            pending = b"" if left >= 0 else pending[left:]
            while left > 0:
                n = conn.recv_into(mv[: min(len(buf), left)])
                if not n:
                    return
                left -= n
            q = target.split("?", 1)[1] if "?" in target else ""
            body = b""
            if method == "POST" and q.startswith("uploads"):
                body = _SINK_XML["init"].encode()
            elif method == "POST" and "uploadId=" in q:
                body = _SINK_XML["complete"].encode()
            status = "204 No Content" if method == "DELETE" else "200 OK"
            resp = (
                f"HTTP/1.1 {status}\r\nETag: \"0123456789abcdef0123456789abcdef\"\r\n"
                f"Content-Length: {len(body)}\r\nContent-Type: application/xml\r\n\r\n"
            ).encode() + body
            conn.sendall(resp)
    except OSError:
        return
    finally:
        conn.close()


def run_sink(port: int) -> None:
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", port), backlog=128)
    while True:
        c, _ = srv.accept()
        threading.Thread(target=_sink_conn, args=(c,), daemon=True).start()


def start_sink():
    """Start the sink in a subprocess; returns (process, endpoint)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-c", f"from integration.bench_upload_cpu import run_sink; run_sink({port})"])
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return p, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", help="S3 endpoint (e.g. moto); default: start the local sink")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--repeat", type=int, default=2, help="runs per variant (first one warms buffers)")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--part-mib", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--only", default="")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    sink = None
    if not args.endpoint:
        sink, args.endpoint = start_sink()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    try:
        _main(args)
    finally:
        if sink is not None:
            sink.terminate()
            sink.wait()


def _main(args) -> None:
    size = args.size_mib * MiB
    only = set(filter(None, args.only.split(",")))

    def want(n):
        return not only or n in only

    with tempfile.NamedTemporaryFile(dir=args.dir) as f:
        chunk = os.urandom(8 * MiB)
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        path = f.name
        with open(path, "rb") as r:  # warm the page cache
            while r.read(16 * MiB):
                pass
        print(f"file {args.size_mib} MiB, part {args.part_mib} MiB, concurrency {args.concurrency}")
        if want("hash"):
            trio.run(_hash, path, size)
        for ck in ("crc32", "crc32c", "crc64nvme", "md5", "sha256", "none"):
            if want(ck):
                try:
                    trio.run(_parts_only, args, path, size, ck, False)
                except ValueError as e:
                    print(f"{ck}: skipped ({e})")
        if want("signed"):
            trio.run(_parts_only, args, path, size, "none", True)
        if want("botocore-sign"):
            trio.run(_parts_only, args, path, size, "crc32", False, True)
        if want("full"):
            trio.run(_full, args, path, size, "auto")
        if want("boto3"):
            _boto3(args, path, size, False)
        if want("boto3-wr"):
            _boto3(args, path, size, True)


if __name__ == "__main__":
    main()

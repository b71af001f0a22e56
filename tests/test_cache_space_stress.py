"""Content under cache pressure, in both data paths: with a small cap (so the gateway toggles
between serving writes itself and passing them through), two writers create and rewrite (O_TRUNC)
files of varied sizes with varied write sizes and fsyncs while the drain runs and evicts.
Every cache file read right after close, and every object in the bucket at the end, holds
exactly the bytes written."""

from __future__ import annotations

import os
import random
import re
import subprocess
import threading
import time

import pytest
from conftest import DATA_PATHS as _DATA_PATHS
from conftest import REPO, both_data_paths, ckptfs_cmd, gateway_under_cache_pressure, needs_fuse

from ckptfs.fsmeta.layout import CacheDir

pytestmark = [needs_fuse, pytest.mark.mounted]

MiB = 1 << 20
CAP = 48 * MiB  # more than the two writers' open files (never evictable) can hold
WRITE_SIZES = (4096, 12345, 65536, 131072 + 17, MiB, 3 * MiB + 5, 4 * MiB)


@pytest.fixture(scope="module", params=_DATA_PATHS)
def data_path(request) -> str:
    return both_data_paths(request)


def content(seed: int, size: int) -> bytes:
    """Bytes that differ in every 4 KiB block, per file and per version."""
    block = random.Random(seed).randbytes(MiB)
    out = bytearray()
    for i in range(0, size, MiB):
        out += (seed.to_bytes(8, "little") + i.to_bytes(8, "little") + block[16:])[: min(MiB, size - i)]
    return bytes(out)


def difference(got: bytes, want: bytes) -> str:
    if len(got) != len(want):
        return f"{len(got)} bytes, not {len(want)}"
    bad = [off for off in range(0, len(want), 4096) if got[off:off + 4096] != want[off:off + 4096]]
    zero = sum(got[off:off + 4096] == bytes(len(got[off:off + 4096])) for off in bad)
    return f"{len(bad)} of {(len(want) + 4095) // 4096} 4-KiB blocks differ ({zero} zero), first at {bad[0]}, last at {bad[-1]}"


def write(path, data: bytes, rng: random.Random) -> None:
    with open(path, "wb") as f:
        off = 0
        while off < len(data):
            n = rng.choice(WRITE_SIZES)
            f.write(data[off:off + n])
            off += n
            if rng.random() < 0.05:
                f.flush()
                os.fsync(f.fileno())
            if rng.random() < 0.05:
                os.stat(path)  # a GETATTR between writes
        if rng.random() < 0.3:
            f.flush()
            os.fsync(f.fileno())


def test_every_byte_written_under_pressure_reaches_the_cache_file_and_the_bucket(gateway_factory, tmp_path):
    gw = gateway_under_cache_pressure(gateway_factory, tmp_path, cap=CAP, high=0.75, low=0.5,
                                      drain='part_size = "5MiB"\n')
    cache = CacheDir(str(gw.cache))
    final: dict[str, bytes] = {}
    mismatches: list[str] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        rng = random.Random(w)
        names = []
        for n in range(30):
            if names and rng.random() < 0.25:
                rel = rng.choice(names)  # a rewrite (the old version may be evicted by now)
            else:
                rel = f"w{w}/f{n}"
                names.append(rel)
            size = rng.choice((rng.randrange(1, 4 * MiB), rng.randrange(5 * MiB, 12 * MiB), 12 * MiB))
            data = content(w * 1000 + n, size)
            path = gw.mnt / rel
            path.parent.mkdir(exist_ok=True)
            write(path, data, rng)
            try:  # the cache file right after close (unless evicted already)
                with open(cache.data_path(os.stat(path).st_ino), "rb") as f:
                    got = f.read()
            except FileNotFoundError:
                got = data
            with lock:
                final[rel] = data
                if got != data:
                    mismatches.append(f"cache file of {rel} after close: {difference(got, data)}")

    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            writer(w)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors  # no ENOSPC: writers wait for room instead
    assert not mismatches, mismatches
    result = subprocess.run([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "300"],
                            capture_output=True, text=True, cwd=str(REPO), check=False)
    assert result.returncode == 0, result.stderr + gw.log()[-4000:]
    wrong = {rel: difference((gw.bucket / rel).read_bytes(), data) for rel, data in final.items()
             if (gw.bucket / rel).read_bytes() != data}
    assert not wrong, wrong
    deadline = time.monotonic() + 10  # the pressure was real: files were evicted on the way
    while not re.search(r"^ckptfs_cache_evictions_total [1-9]", gw.metrics(), re.MULTILINE):
        assert time.monotonic() < deadline, "nothing was evicted"
        time.sleep(0.2)

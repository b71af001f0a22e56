"""Many processes churning one directory through the FUSE front end, while the drain uploads and
the space manager evicts: creates, renames, unlinks, reads, writes, truncates, shared mmaps and
xattrs, on both data paths. The mount must answer only the errors such a race can cause, keep
serving, and leave a cache directory that ``ckptfs fsck`` finds clean.

Small by default (it runs in the default suite, and under the sanitizers in
scripts/test-sanitized.sh); CKPTFS_STRESS_PROCS and CKPTFS_STRESS_SECONDS make it larger
(scripts/stress-native.sh).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import DATA_PATHS, REPO, both_data_paths, ckptfs_cmd, gateway_under_cache_pressure, needs_fuse

pytestmark = [needs_fuse, pytest.mark.mounted]

data_path = pytest.fixture(scope="module", params=DATA_PATHS)(both_data_paths)

MiB = 1 << 20
PROCS = int(os.environ.get("CKPTFS_STRESS_PROCS", "6"))
SECONDS = float(os.environ.get("CKPTFS_STRESS_SECONDS", "4"))
CAP = 24 * MiB  # the big files alone pass the high watermark: clean ones are evicted meanwhile

CHURN = r'''
import errno, json, mmap, os, random, sys, time
d, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = random.Random(seed)
names = [f"n{i}" for i in range(8)] + [f"big{i}" for i in range(4)]
counts, errors = {}, {}

def one(op, p, q):
    if op == "create":
        size = rng.choice((0, 100, 5000, 70000, 2 * 1024 * 1024 + 3 if p.endswith(("0", "1")) else 300000))
        with open(p, "wb") as f:
            f.write(rng.randbytes(size))
            if rng.random() < 0.2:
                f.flush(); os.fsync(f.fileno())
    elif op == "rename":
        os.rename(p, q)
    elif op == "unlink":
        os.unlink(p)
    elif op == "read":
        with open(p, "rb") as f:
            f.read()
    elif op == "write":
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, rng.randbytes(rng.randint(1, 200000)), rng.randint(0, 400000))
        finally:
            os.close(fd)
    elif op == "truncate":
        os.truncate(p, rng.randint(0, 300000))
    elif op == "mmap":
        # a name of this process's own in the directory: a mapping of a file that another
        # process truncates meanwhile faults (SIGBUS), as POSIX says
        mine = os.path.join(d, f"m{seed}")
        with open(mine, "a+b") as f:
            f.truncate(8192)
            m = mmap.mmap(f.fileno(), 8192)
            try:
                m[rng.randrange(8192)] = rng.randrange(256)
                m.read(4096)
                m.flush()
            finally:
                m.close()
    elif op == "setxattr":
        os.setxattr(p, "user.k" + str(rng.randint(0, 2)), rng.randbytes(rng.randint(0, 64)))
    elif op == "getxattr":
        os.getxattr(p, "user.k" + str(rng.randint(0, 2)))
    elif op == "listxattr":
        os.listxattr(p)
    elif op == "removexattr":
        os.removexattr(p, "user.k" + str(rng.randint(0, 2)))
    elif op == "list":
        for e in os.scandir(d):
            e.stat(follow_symlinks=False)

ops = ["create", "rename", "unlink", "read", "write", "truncate", "mmap", "setxattr", "getxattr",
       "listxattr", "removexattr", "list"]
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    op = rng.choice(ops)
    p, q = os.path.join(d, rng.choice(names)), os.path.join(d, rng.choice(names))
    counts[op] = counts.get(op, 0) + 1
    try:
        one(op, p, q)
    except OSError as e:
        key = f"{op}:{errno.errorcode.get(e.errno, e.errno)}"
        errors[key] = errors.get(key, 0) + 1
print(json.dumps({"counts": counts, "errors": errors}))
'''

# What the race itself can cause: the name went or came meanwhile, the attribute is not there.
EXPECTED = {"ENOENT", "EEXIST", "ENODATA"}


def test_many_processes_churning_one_directory(gateway_factory, tmp_path):
    gw = gateway_under_cache_pressure(gateway_factory, tmp_path, cap=CAP, high=0.5, low=0.25)
    d = gw.mnt / "run"
    d.mkdir()
    # Files the drain uploads and the space manager then evicts (and the churn reads back).
    for i in range(4):
        with open(d / f"big{i}", "wb") as f:
            f.write(os.urandom(6 * MiB))
            os.fsync(f.fileno())
    procs = [subprocess.Popen([sys.executable, "-c", CHURN, str(d), str(seed), str(SECONDS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(PROCS)]
    counts, errors = {}, {}
    for p in procs:
        out, err = p.communicate(timeout=SECONDS + 300)
        assert p.returncode == 0, err[-3000:]
        r = json.loads(out)
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    print(f"\n{sum(counts.values())} operations {counts}\nerrors {errors}")
    # A gateway race this test found, outside the front end: opening (and fetching) an evicted file
    # while the churn renames and unlinks is sometimes answered EIO by the gateway itself (its
    # fetch of the bucket object; reported with issue 37). Tolerated only as exactly that: EIO
    # from an open or a read, no more often than the gateway counted such answers.
    fetch_eio = sum(float(line.split()[-1]) for line in gw.metrics().splitlines()
                    if line.startswith("ckptfs_fuse_errors_total") and 'errno="EIO"' in line
                    and ('op="open"' in line or 'op="read"' in line))
    eio = {k: v for k, v in errors.items() if k.endswith(":EIO")}
    if eio:
        print(f"EIO from the gateway's fetch of an evicted file: {eio}")
    unexpected = {k: v for k, v in errors.items() if k.split(":")[1] not in EXPECTED and k not in eio}
    assert not unexpected, f"errors the race cannot explain: {unexpected}"
    assert all(k.split(":")[0] in ("read", "write", "create", "mmap") for k in eio), eio
    assert sum(eio.values()) <= fetch_eio, f"EIO the gateway did not answer to an open or read: {eio}"
    assert gw.alive, gw.log()[-4000:]
    (d / "after").write_bytes(b"still serving")
    assert (d / "after").read_bytes() == b"still serving"
    deadline = time.monotonic() + 60  # the space manager evicted while the churn ran or since
    while not re.search(r"^ckptfs_cache_evictions_total [1-9]", gw.metrics(), re.MULTILINE):
        assert time.monotonic() < deadline, "nothing was evicted"
        time.sleep(0.2)
    assert gw.stop() == 0
    assert not gw.unexpected(), gw.log()[-8000:]
    fsck = subprocess.run([*ckptfs_cmd(), "fsck", str(gw.cache), "--json"], capture_output=True, text=True,
                          cwd=str(REPO), timeout=300)
    assert fsck.returncode == 0, fsck.stdout[-4000:] + fsck.stderr[-4000:]

"""Bucket keys of 511 to 1,024 bytes through a real mount on a ``file://`` bucket (issue 34).

LMDB refuses keys over 511 bytes, and fsmeta keys tombstones and the ``remote_keys`` index by
bucket key: a longer key once crash-looped the drain and stopped every file on the node.
tests/test_long_keys.py drives the core and the drain directly; here the same key lengths go
through the kernel, the gateway, the drain process, the read path and the CLI.

The mounts here use the fixture's bucket URL ``file://BUCKET``: no key prefix, so a file's key
is its path below the mount root, and every test writes at the root to control its length.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import ckptfs_cmd, needs_fuse, tree
from test_lifecycle_cli import Bucket, plan_json
from test_long_keys import KEY_LENGTHS, key_of_length
from test_mount_readpath import cli, settled_state
from test_mount_two_nodes import wait_durable

pytestmark = [needs_fuse, pytest.mark.mounted]

MiB = 1 << 20
# The drain uploads a closed file at once, in 5 MiB parts (so the 6 MiB file is a multipart upload).
FAST_DRAIN = '[drain]\nsettle_seconds = 0.1\npart_size = "5MiB"\n'
# ... or leaves it dirty for an hour: what is in the cache only when the gateway is killed.
SLOW_DRAIN = '[drain]\nsettle_seconds = 3600\npart_size = "5MiB"\n'
MARKER = ".metadata"


def write_synced(path, data: bytes) -> None:
    """Create (with its parents), write and fsync: a checkpoint shard the trainer has saved."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def renamed_leaf(key: str, last: str) -> str:
    """``key`` with the last character of its file name replaced: a sibling of the same length
    (every leaf ``key_of_length`` makes ends with "x")."""
    assert key.endswith("x") and len(last.encode()) == 1
    return key[:-1] + last


def fast_mount(gateway_factory, tmp_path, **kwargs):
    config = tmp_path / f"ckptfs-{len(list(tmp_path.glob('ckptfs-*.toml')))}.toml"
    config.write_text(FAST_DRAIN)
    gw = gateway_factory(extra_args=("--config", str(config)), **kwargs)
    gw.drain_config = config
    return gw


def bucket_of(gw) -> Bucket:
    """The mount's file:// bucket, listed through the object store (test_lifecycle_cli)."""
    bucket = Bucket(gw.base)
    assert bucket.url == gw.url
    return bucket


def assert_bucket_holds(gw, expected: dict[str, bytes]) -> None:
    bucket = bucket_of(gw)
    assert sorted(bucket.keys()) == sorted(expected)
    for key, data in expected.items():
        assert (gw.bucket / key).read_bytes() == data, f"{len(key.encode())}-byte key: other bytes"


def wait_durable_watching_markers(gw, shards_of_marker: dict[str, list[str]], expected: dict[str, bytes]) -> None:
    """``ckptfs wait-durable`` while the bucket is watched: a marker the drain has put never
    shows before every shard of its directory (file:// publishes an object by a rename, so an
    object that shows is whole)."""
    proc = subprocess.Popen([*ckptfs_cmd(), "wait-durable", str(gw.mnt), "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched = dict(shards_of_marker)
    try:
        while watched:
            done = proc.poll() is not None
            for marker, shards in list(watched.items()):
                if (gw.bucket / marker).exists():
                    for shard in shards:
                        assert (gw.bucket / shard).exists(), f"{marker} is in the bucket before {shard}"
                        assert (gw.bucket / shard).read_bytes() == expected[shard]
                    del watched[marker]
            if done:
                break
            time.sleep(0.01)  # (a poll interval: the drain shares the machine's cores)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err + gw.log()[-4000:]


def test_keys_up_to_1024_bytes_go_through_every_operation_the_drain_and_the_read_path(gateway_factory, tmp_path):
    """Keys of 511, 512, 600 and 1,024 bytes (and a NAME_MAX file name, whose file:// metadata
    sidecar is named by a hash) through create, write, fsync, a marker after its shards, the
    state xattr, rename of a file and of a directory, a hard link, a kill -9 with fsynced files
    the drain had not taken yet, a second mount with an empty cache (listing and fetch),
    prefetch, evict and read again, verify, fsck --bucket, then unlink and rmdir to an empty
    bucket."""
    a = fast_mount(gateway_factory, tmp_path)
    keys = [key_of_length(n, stem) for n, stem in zip(KEY_LENGTHS, "abcd")]
    name_max = keys[2].rpartition("/")[0] + "/" + "ñ" * 127 + "x"  # a 255-byte name, beside the 600-byte key
    keys.append(name_max)
    data = {key: os.urandom(64 * 1024 + i) for i, key in enumerate(keys)}
    data[keys[3]] = os.urandom(6 * MiB + 3)  # the 1,024-byte key: a multipart upload
    heads = sorted({key.rpartition("/")[0] for key in keys})

    # create, write, fsync; each directory's marker after its shards
    for key in keys:
        write_synced(a.mnt / key, data[key])
    shards_of_marker = {}
    for head in heads:
        marker = f"{head}/{MARKER}"
        data[marker] = f"shards of {len(head.encode())}-byte directory".encode()
        write_synced(a.mnt / marker, data[marker])
        shards_of_marker[marker] = [key for key in keys if key.startswith(head + "/")]
    wait_durable_watching_markers(a, shards_of_marker, data)
    assert_bucket_holds(a, data)
    for key in keys:
        assert os.getxattr(a.mnt / key, "user.ckptfs.state") == b"durable", len(key.encode())
        assert os.getxattr(a.mnt / key.rpartition("/")[0], "user.ckptfs.state") == b"durable"

    # rename each file within its directory, link it, rename the top directory of each tree
    expected = {}
    for key in keys:
        os.rename(a.mnt / key, a.mnt / renamed_leaf(key, "y"))
        os.link(a.mnt / renamed_leaf(key, "y"), a.mnt / renamed_leaf(key, "z"))
    tops = sorted({key.split("/")[0] for key in keys})
    for top in tops:
        assert len(top.upper().encode()) == len(top.encode())
        os.rename(a.mnt / top, a.mnt / top.upper())

    def moved(key: str) -> str:
        top, _, rest = key.partition("/")
        return f"{top.upper()}/{rest}"

    for key in keys:
        for last in "yz":
            expected[moved(renamed_leaf(key, last))] = data[key]
    for marker in shards_of_marker:
        expected[moved(marker)] = data[marker]
    wait_durable(a)
    assert_bucket_holds(a, expected)
    assert max(len(key.encode()) for key in expected) == 1024

    # kill -9 with fsynced long-key files in the cache only: after the restart they drain
    a.drain_config.write_text(SLOW_DRAIN)
    a.stop()
    a.start()
    for key in keys:
        crashed = moved(renamed_leaf(key, "k"))
        expected[crashed] = os.urandom(1000 + len(crashed))
        write_synced(a.mnt / crashed, expected[crashed])
        assert os.getxattr(a.mnt / crashed, "user.ckptfs.state") == b"dirty"
    a.kill9()
    a.clear_dead_mount()
    a.drain_config.write_text(FAST_DRAIN)
    a.start()
    wait_durable(a)
    assert_bucket_holds(a, expected)

    # another node with an empty cache: the listing shows every key; prefetch fetches them
    b = fast_mount(gateway_factory, tmp_path, bucket=a.bucket)
    some = next(iter(expected))
    assert os.getxattr(b.mnt / some, "user.ckptfs.state") == b"remote"
    result = cli("prefetch", str(b.mnt), "--json")
    assert result.returncode == 0, result.stdout + result.stderr + b.log()[-4000:]
    summary = json.loads(result.stdout)
    assert (summary["files"], summary["fetched"], summary["errors"]) == (
        len(expected), sum(len(d) for d in expected.values()), {})
    for key in expected:
        assert os.getxattr(b.mnt / key, "user.ckptfs.state") == b"durable", len(key.encode())
    assert tree(b.mnt) == tree(a.mnt) == {**expected, **{d: "dir" for k in expected for d in _parents(k)}}

    # evict on the writer: the files stay listed and read back from the bucket (commit
    # markers stay in the cache)
    result = cli("evict", str(a.mnt), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)
    markers = {moved(marker) for marker in shards_of_marker}
    assert sorted(summary["kept"]) == sorted(str(a.mnt / marker) for marker in markers)
    assert (summary["files"], summary["evicted"], summary["errors"]) == (len(expected), len(expected) - len(markers), {})
    for key in expected:
        state = b"durable" if key in markers else b"remote"
        assert os.getxattr(a.mnt / key, "user.ckptfs.state") == state, len(key.encode())
    for key, content in expected.items():
        assert read_past_the_page_cache(a.mnt / key) == content
        assert settled_state(a.mnt / key, b"durable") == b"durable"

    # verify re-reads every object; fsck --bucket finds nothing to say
    result = cli("verify", str(a.mnt), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert {c["key"]: c["status"] for c in json.loads(result.stdout)["checked"]} == dict.fromkeys(expected, "ok")
    result = cli("fsck", str(a.cache), "--bucket", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["findings"] == [], report

    # unlink every file, rmdir every directory: the bucket empties
    for top in tops:
        shutil.rmtree(a.mnt / top.upper())
    wait_durable(a)
    assert bucket_of(a).keys() == set()
    for gw in (a, b):
        assert not gw.unexpected(), gw.log()[-8000:]


def read_past_the_page_cache(path) -> bytes:
    """The file's bytes as the gateway serves them: the kernel still holds the pages it read
    before an eviction, and would answer from them without asking the gateway."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return f.read()


def _parents(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def test_a_key_over_1024_bytes_is_refused_with_enametoolong(gateway_factory):
    """At create, mkdir (a directory's marker key ends in "/"), link and rename, counted in
    bytes of UTF-8; one byte less works."""
    gw = gateway_factory()
    key = key_of_length(1025)
    head = gw.mnt / key.rpartition("/")[0]
    head.mkdir(parents=True)
    too_long, longest = gw.mnt / key, gw.mnt / key[:-1]
    for attempt in (lambda: open(too_long, "wb"), lambda: os.mkdir(longest)):
        with pytest.raises(OSError) as err:
            attempt()
        assert err.value.errno == errno.ENAMETOOLONG
    longest.write_bytes(b"1,024 bytes")
    for attempt in (lambda: os.link(longest, too_long), lambda: os.rename(longest, too_long)):
        with pytest.raises(OSError) as err:
            attempt()
        assert err.value.errno == errno.ENAMETOOLONG
    top = key.split("/")[0]
    with pytest.raises(OSError) as err:  # the directory above it, one byte longer
        os.rename(gw.mnt / top, gw.mnt / (top + "x"))
    assert err.value.errno == errno.ENAMETOOLONG
    assert longest.read_bytes() == b"1,024 bytes"
    assert not too_long.exists()


def test_the_issue_34_checkpoint_three_200_character_directories_deep(gateway_factory, tmp_path):
    """The report: a file below three 200-character directories never reached the bucket, the
    drain crash-looped, a short file written afterwards stayed dirty, and rm -rf answered EIO."""
    gw = fast_mount(gateway_factory, tmp_path)
    run = gw.mnt / ("r" * 200) / ("e" * 200) / ("c" * 200)
    run.mkdir(parents=True)
    (run / "model.pt").write_bytes(b"weights")
    (gw.mnt / "short.txt").write_bytes(b"hi")
    wait_durable(gw)
    key = str((run / "model.pt").relative_to(gw.mnt))
    assert len(key.encode()) == 611
    assert (gw.bucket / key).read_bytes() == b"weights"
    assert (gw.bucket / "short.txt").read_bytes() == b"hi"
    result = subprocess.run(["rm", "-rf", str(gw.mnt / ("r" * 200)), str(gw.mnt / "short.txt")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    wait_durable(gw)
    assert bucket_of(gw).keys() == set()
    assert not gw.unexpected(), gw.log()[-8000:]


def test_lifecycle_plans_and_applies_over_checkpoints_with_1024_byte_keys(gateway_factory, tmp_path):
    """Checkpoints written through the mount below a run directory of 803 bytes, their shard
    keys 1,024 bytes long: keep_latest keeps the newest, a milestone is tiered (a copy of each
    1,024-byte key), an expired one is deleted, marker first; a second apply does nothing."""
    gw = fast_mount(gateway_factory, tmp_path)
    run = key_of_length(803, "p")
    steps = (100, 200, 300)
    for step in steps:
        for shard in range(2):
            key = f"{run}/step_{step}/{'ü' * 100}{'x' * 10}{shard}"
            assert len(key.encode()) == 1024
            write_synced(gw.mnt / key, os.urandom(130 * 1024))  # above min_transition_bytes
        write_synced(gw.mnt / f"{run}/step_{step}/{MARKER}", b"{}")
    wait_durable(gw)

    bucket = bucket_of(gw)  # its config: keep_latest 1, milestones every 200 steps, expiry after 7 days
    plan = {d["path"]: d for d in plan_json(bucket, "--now", "+8d")}
    assert {path: d["action"] for path, d in plan.items()} == {
        f"{run}/step_100": "delete", f"{run}/step_200": "transition", f"{run}/step_300": "keep"}
    assert plan[f"{run}/step_300"]["reasons"] == ["latest"] and plan[f"{run}/step_100"]["complete"]
    table = cli("lifecycle", "plan", "--config", str(bucket.config), "--now", "+8d")
    assert table.returncode == 0 and "step_100" in table.stdout, table.stderr

    result = cli("lifecycle", "apply", "--config", str(bucket.config), "--now", "+8d", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    keys = bucket.keys()
    assert not any(k.startswith(f"{run}/step_100/") for k in keys)
    assert {k for k in keys if k.startswith(f"{run}/step_300/")} == {
        k for k in tree(gw.mnt) if k.startswith(f"{run}/step_300/")}
    milestone = sorted(k for k in keys if k.startswith(f"{run}/step_200/") and not k.endswith(MARKER))
    assert len(milestone) == 2 and {bucket.head(k).storage_class for k in milestone} == {"COLD"}
    assert all(d["action"] == "keep" for d in plan_json(bucket, "--now", "+8d"))

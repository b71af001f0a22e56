"""``ckptfs fsck``: each kind of damage is found, repaired when that is safe, reported when not.

The cache is filled through FsCore and drained into a ``file://`` bucket
(:class:`test_drain_support.DrainEnv`); the damage is done by hand, as a disk problem or a
crash would; the command runs as a user runs it, in a subprocess.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess

import trio

from conftest import REPO, ckptfs_cmd

from ckptfs.drain.store import MOVING_PREFIX
from ckptfs.fsmeta import schema
from ckptfs.fsmeta.check import fsmeta_problems

from test_drain_support import MiB, denv  # noqa: F401


def fsck(env, *args) -> subprocess.CompletedProcess:
    env.meta.sync()
    return subprocess.run([*ckptfs_cmd(), "fsck", str(env.cache), *args],
                          capture_output=True, text=True, timeout=120, cwd=str(REPO))


def fsck_json(env, *args) -> tuple[int, dict]:
    result = fsck(env, "--json", *args)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def kinds(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in report["findings"]:
        out.setdefault(f["kind"], []).append(f)
    return out


def a_drained_cache(denv):  # noqa: F811
    denv.write_file("run/step_1/shard0", b"zero" * 100)
    denv.write_file("run/step_1/shard1", os.urandom(6 * MiB))  # multipart
    denv.write_file("run/step_1/.metadata", b"meta")
    denv.drain()


def test_a_clean_cache_passes_with_and_without_the_bucket(denv):  # noqa: F811
    a_drained_cache(denv)
    denv.write_file("run/step_2/shard0", b"pending, not drained yet")
    result = fsck(denv)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean" in result.stdout
    code, report = fsck_json(denv, "--bucket")
    assert code == 0 and report["ok"] and report["findings"] == []
    assert report["bucket_url"] == denv.settings.bucket_url and report["repair"] is False


def test_orphan_cache_file_is_found_and_deleted(denv):  # noqa: F811
    a_drained_cache(denv)
    orphan = denv.cache / "data" / "ffff"
    orphan.write_bytes(b"left behind")
    code, report = fsck_json(denv)
    assert code == 1 and not report["ok"]
    (finding,) = report["findings"]
    assert finding["kind"] == "orphan-cache-file" and finding["cache_file"] == "data/ffff"
    assert finding["repairable"] and not finding["repaired"]
    assert set(finding) >= {"kind", "path", "key", "detail", "repaired"}

    code, report = fsck_json(denv, "--repair")
    assert code == 0 and report["ok"] and kinds(report)["orphan-cache-file"][0]["repaired"]
    assert not orphan.exists()
    assert fsck(denv).returncode == 0


def test_long_cache_file_of_a_pending_file_is_cut_to_the_recorded_size(denv):  # noqa: F811
    ino = denv.write_file("job/f", b"0123456789")
    with open(denv.cache / "data" / f"{ino:x}", "ab") as f:
        f.write(b"bytes a crash left past the recorded size")
    code, report = fsck_json(denv)
    assert code == 1
    (finding,) = report["findings"]
    assert (finding["kind"], finding["path"], finding["repairable"]) == ("long-cache-file", "job/f", True)

    code, report = fsck_json(denv, "--repair")
    assert code == 0 and report["findings"][0]["repaired"]
    assert denv.cache_bytes("job/f") == b"0123456789"
    denv.drain()
    assert denv.object_bytes("job/f") == b"0123456789"


def test_lost_content_of_a_pending_file_is_reported_not_repaired(denv):  # noqa: F811
    short = denv.write_file("job/short", b"x" * 1000)
    gone = denv.write_file("job/gone", b"y" * 1000)
    os.truncate(denv.cache / "data" / f"{short:x}", 10)
    os.unlink(denv.cache / "data" / f"{gone:x}")
    code, report = fsck_json(denv, "--repair")
    assert code == 1 and not report["ok"]
    found = kinds(report)
    assert [f["path"] for f in found["short-cache-file"]] == ["job/short"]
    assert [f["path"] for f in found["missing-cache-file"]] == ["job/gone"]
    assert not any(f["repaired"] or f["repairable"] for f in report["findings"])
    human = fsck(denv)
    assert human.returncode == 1
    assert "job/gone" in human.stdout and "data lost" in human.stdout


def test_durable_object_missing_or_changed_in_the_bucket_is_requeued_and_uploaded_again(denv):  # noqa: F811
    a_drained_cache(denv)
    (denv.bucket / "run/step_1/shard0").unlink()
    code, report = fsck_json(denv)
    assert code == 0, "without --bucket the local state is clean"
    code, report = fsck_json(denv, "--bucket")
    found = kinds(report)
    assert code == 1
    assert [f["key"] for f in found["missing-object"]] == ["run/step_1/shard0"]
    assert all(f["repairable"] for f in found["missing-object"])

    code, report = fsck_json(denv, "--bucket", "--repair")
    assert code == 0 and all(f["repaired"] for f in report["findings"])
    assert denv.state("run/step_1/shard0") == "dirty"
    denv.drain()
    assert denv.object_bytes("run/step_1/shard0") == b"zero" * 100
    code, report = fsck_json(denv, "--bucket")
    assert code == 0 and report["findings"] == []


def test_an_empty_directory_missing_from_the_bucket_is_found_and_its_marker_put_again(denv):  # noqa: F811
    a_drained_cache(denv)
    denv.mkdir("run/empty")
    denv.mkdir("run/kept/sub")  # (kept and sub: the bucket shows kept through sub's marker)
    denv.drain()

    async def delete_marker():
        async with denv.store() as store:
            await store.delete("run/empty/")

    trio.run(delete_marker)
    code, report = fsck_json(denv, "--bucket")
    found = kinds(report)
    assert code == 1 and list(found) == ["missing-marker"]
    assert [(f["path"], f["key"], f["repairable"]) for f in found["missing-marker"]] == [
        ("run/empty", "run/empty/", True)]

    code, report = fsck_json(denv, "--bucket", "--repair")
    assert code == 0 and all(f["repaired"] for f in report["findings"])
    denv.drain()
    assert "run/empty/" in denv.listing("run/")
    code, report = fsck_json(denv, "--bucket")
    assert code == 0 and report["findings"] == []


def test_different_blake3_in_the_bucket_is_found(denv):  # noqa: F811
    a_drained_cache(denv)
    key = "run/step_1/shard0"
    real = denv.head(key).metadata["blake3"]

    async def run():
        async with denv.store() as store:
            await store.put_object(key, b"other bytes", {"blake3": "0" * 64})

    trio.run(run)
    code, report = fsck_json(denv, "--bucket", "--repair")
    (finding,) = report["findings"]
    assert (finding["kind"], finding["key"], finding["repaired"]) == ("different-object", key, True)
    assert real in finding["detail"]
    denv.drain()
    assert denv.object_bytes(key) == b"zero" * 100 and denv.head(key).metadata["blake3"] == real


def test_unrecorded_multipart_upload_is_aborted_and_tombstoned_keys_are_informational(denv):  # noqa: F811
    a_drained_cache(denv)

    async def start_upload():
        async with denv.store() as store:
            return await store.create_multipart("run/step_9/lost")

    trio.run(start_upload)
    denv.meta.write(lambda txn: txn.add_tombstone("run/step_1/shard0"))
    code, report = fsck_json(denv, "--bucket")
    found = kinds(report)
    assert code == 1
    assert [f["key"] for f in found["unrecorded-upload"]] == ["run/step_9/lost"]
    assert found["unrecorded-upload"][0]["upload_id"]
    assert [f["key"] for f in found["tombstoned-object"]] == ["run/step_1/shard0"]

    code, report = fsck_json(denv, "--bucket", "--repair")
    assert code == 0, "a tombstoned key still present is informational: the drain deletes it"
    assert denv.open_uploads() == []
    assert not kinds(report)["tombstoned-object"][0]["repaired"]


def test_an_object_parked_to_break_a_rename_cycle_that_nobody_records_is_found_and_deleted(denv):  # noqa: F811
    """An object below the drain's parking key space that no file records and no tombstone
    names (left by hand, or by a drain of another fsmeta) is found and deleted; one a file
    records is the file's content and is left alone."""
    a_drained_cache(denv)
    stray, recorded = MOVING_PREFIX + "7-stray", MOVING_PREFIX + "8-recorded"

    async def park():
        async with denv.store() as store:
            for key in (stray, recorded):
                await store.put_object(key, b"parked")

    trio.run(park)
    ino = denv.ino("run/step_1/shard0")
    denv.meta.write(lambda txn: txn.put_remote(ino, dataclasses.replace(txn.get_remote(ino), key=recorded)))
    code, report = fsck_json(denv, "--bucket")
    assert code == 1 and [f["key"] for f in kinds(report)["stray-parked-object"]] == [stray]
    code, report = fsck_json(denv, "--bucket", "--repair")
    assert kinds(report)["stray-parked-object"][0]["repaired"]
    assert denv.listing(MOVING_PREFIX) == [recorded]


def test_broken_fsmeta_invariant_is_reported(denv):  # noqa: F811
    ino = denv.write_file("job/f", b"data")
    with denv.meta.read() as txn:
        parent = txn.resolve(b"job")
    # a dirent without its reverse link record: a bug or a damaged database
    denv.meta.write(lambda txn: txn._delete("links", schema.link_key(ino, parent, b"f")))
    assert fsmeta_problems(denv.meta)
    code, report = fsck_json(denv, "--repair")
    assert code == 1
    assert [f["kind"] for f in report["findings"]][:1] == ["invariant"]
    assert "no reverse link record" in report["findings"][0]["detail"]


def test_a_durable_state_the_bucket_does_not_back_is_an_invariant_finding(denv):  # noqa: F811
    ino = denv.write_file("job/f", b"data")
    denv.write_file("job/g", b"moved")
    denv.drain()
    denv.rename("job/g", "job/h")  # DURABLE while pending for its new name: that holds
    assert fsmeta_problems(denv.meta) == []

    def bump(txn):  # the generation moved but the state still says DURABLE: a bug
        inode = txn.get_inode(ino)
        inode.generation += 1
        txn.put_inode(inode)
        return inode.generation

    generation = denv.meta.write(bump)
    assert fsmeta_problems(denv.meta) == [f"inode {ino}: DURABLE but the bucket does not hold generation {generation}"]


def test_repair_is_refused_while_a_drain_holds_the_cache_but_checking_is_not(denv):  # noqa: F811
    denv.write_file("job/f", b"data")
    (denv.cache / "data" / "ffff").write_bytes(b"orphan")
    with open(denv.cache / "drain.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        refused = fsck(denv, "--repair")
        assert refused.returncode == 2
        assert "drain" in refused.stderr and str(os.getpid()) in refused.stderr
        assert (denv.cache / "data" / "ffff").exists()
        checked = fsck(denv, "--json")
        assert checked.returncode == 1 and json.loads(checked.stdout)["findings"][0]["kind"] == "orphan-cache-file"


def test_no_cache_there_is_a_usage_error(tmp_path):
    result = subprocess.run([*ckptfs_cmd(), "fsck", str(tmp_path / "nothing")], capture_output=True, text=True,
                            timeout=60, cwd=str(REPO))
    assert result.returncode == 2 and "no ckptfs cache" in result.stderr


def test_hidden_objects_follow_the_listing_rules():
    """The rule ``fsck --bucket`` applies to every key (integration/test_fsck_radosgw.py runs it
    against a bucket): what a listing of the bucket would not show, and only that."""
    from ckptfs.gateway.listing import hidden_objects

    keys = ["run/a", "run/a/", "b", "b/c", "ok/", "ok/x", "d//", "e/./f", "g/.ckptfs-tmp", "h/" + "é" * 200]
    found = dict(hidden_objects(keys))
    assert sorted(found) == ["b", "d//", "e/./f", "g/.ckptfs-tmp", "h/" + "é" * 200, "run/a"]
    assert "same name" in found["run/a"] and "same name" in found["b"]  # a marker makes a directory too
    assert "400 bytes" in found["h/" + "é" * 200]  # NAME_MAX counts bytes, not characters

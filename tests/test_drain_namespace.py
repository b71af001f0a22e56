"""The drain makes the bucket match the filesystem: uploads, renames, deletes, directories.

FsCore (no FUSE) fills a cache directory; the Drain runs in-process against a
file:// bucket; a recording store wrapper shows what was sent.
"""

from __future__ import annotations

import errno
import os
import stat
import time

import blake3
import pytest
import trio

from ckptfs.fsmeta import locks
from ckptfs.fsmeta.layout import CacheDir
from ckptfs.gateway.core import RENAME_EXCHANGE, Caller, SetattrRequest

from test_drain_support import MiB, RecStore, USER, denv  # noqa: F401

ROOT = Caller(uid=0, gid=0, umask=0o022)


def check_object(env, path: str, data: bytes) -> None:
    """The object at ``path`` holds ``data`` and the s3fs/rclone metadata of the file."""
    assert env.object_bytes(path) == data
    info = env.head(path)
    assert info is not None and info.size == len(data)
    attr = env.core.getattr(env.ino(path))
    meta = info.metadata
    assert meta["blake3"] == blake3.blake3(data).hexdigest()
    assert int(meta["mode"]) == attr.mode and stat.S_ISREG(int(meta["mode"]))
    assert int(meta["uid"]) == attr.uid == USER.uid
    assert int(meta["gid"]) == attr.gid == USER.gid
    sec, _, frac = meta["mtime"].partition(".")
    assert int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")) == attr.mtime_ns
    assert env.state(path) == "durable"
    assert env.core.getxattr(env.ino(path), b"user.ckptfs.blake3").decode() == meta["blake3"]


def test_every_closed_file_lands_at_its_path_with_metadata(denv):
    files = {
        "top.bin": os.urandom(1000),
        "empty": b"",
        "run1/step_10/model.pt": os.urandom(1 * MiB + 17),
        "run1/step_10/optim/shard_0.pt": os.urandom(11 * MiB + 5),  # multipart: 3 parts of 5 MiB
        "run1/step_10/odd name ü.txt": b"unicode names are keys too",
    }
    for path, data in files.items():
        denv.write_file(path, data, mode=0o640)
        assert denv.state(path) == "dirty"
    rec = denv.drain()
    assert sorted(denv.listing()) == sorted(files)
    for path, data in files.items():
        check_object(denv, path, data)
        assert int(denv.head(path).metadata["mode"]) & 0o777 == 0o640
    assert rec.calls("create_multipart") == ["run1/step_10/optim/shard_0.pt"]
    assert denv.pending() == {} and denv.tombstones() == {}
    assert denv.open_uploads() == []
    # Nothing left to do: a second drain sends nothing.
    again = denv.drain()
    assert again.written_keys() == [] and again.calls("copy") == [] and again.deleted_keys() == []


def test_rewrite_of_a_durable_file_uploads_the_new_content(denv):
    denv.write_file("f", b"one" * 100)
    denv.drain()
    denv.overwrite("f", 0, b"TWO")
    assert denv.state("f") == "dirty"
    rec = denv.drain()
    assert rec.written_keys() == ["f"]
    check_object(denv, "f", b"TWO" + b"one" * 99)


def test_chmod_chown_of_a_durable_file_updates_metadata_without_upload(denv):
    from ckptfs.gateway.core import SetattrRequest

    denv.write_file("f", b"x" * 100)
    denv.drain()
    denv.core.setattr(denv.ino("f"), SetattrRequest(mode=0o600, gid=4321))
    rec = denv.drain()
    assert rec.written_keys() == []
    assert rec.calls("copy") == ["f"]  # copy onto itself with the new metadata
    meta = denv.head("f").metadata
    assert int(meta["mode"]) & 0o777 == 0o600 and meta["gid"] == "4321"


def test_tmp_then_rename_never_uploads_the_tmp_name(denv):
    data = os.urandom(2 * MiB)
    denv.write_file("ckpt/x.tmp", data)
    denv.rename("ckpt/x.tmp", "ckpt/x")
    rec = denv.drain()
    assert denv.listing() == ["ckpt/x"]
    assert all(not k.endswith("x.tmp") for k in rec.written_keys() + rec.calls("copy"))
    check_object(denv, "ckpt/x", data)


def test_tmp_then_rename_while_the_drain_runs(denv):
    """A torch.save-like writer next to a running drain (settle window 0.5 s): no x.tmp object, ever."""
    rec_box = []
    datas = {f"step_{i}/model.pt": os.urandom(256 * 1024 + i) for i in range(2)}

    def writer():
        for path, data in datas.items():
            denv.write_file(path + ".tmp", data)
            fh = denv.core.open(denv.ino(path + ".tmp"), os.O_RDWR)
            denv.core.fsync(fh, False)
            denv.core.release(fh)
            denv.rename(path + ".tmp", path)

    async def main():
        async with denv.store() as inner:
            rec = RecStore(inner)
            rec_box.append(rec)
            drain = denv.make_drain(rec, settle_seconds=0.5)

            async def write_then_let_the_drain_finish():
                await trio.to_thread.run_sync(writer)
                drain.until_empty = True  # (set earlier, a slow writer would find the drain gone)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write_then_let_the_drain_finish)
                with trio.fail_after(20):
                    await drain.run()

    trio.run(main)
    rec = rec_box[0]
    assert sorted(denv.listing()) == sorted(datas)
    for path, data in datas.items():
        check_object(denv, path, data)
    assert not [k for k in rec.written_keys() + rec.calls("copy") if k.endswith(".tmp")]


def test_rename_of_a_durable_file_is_a_server_side_copy(denv):
    data = os.urandom(6 * MiB)  # multipart-sized: a re-upload would be visible
    denv.write_file("a/f", data)
    denv.drain()
    denv.rename("a/f", "b")
    rec = denv.drain()
    assert rec.uploads() == []
    assert rec.extras("copy") == [("b", "a/f")]
    assert "a/f" in rec.deleted_keys()
    assert sorted(denv.listing()) == ["a/", "b"]  # a is empty now: it keeps a marker
    check_object(denv, "b", data)


def test_rename_of_a_durable_directory_tree_moves_every_object(denv):
    files = {"d/x": b"x" * 10, "d/sub/y": b"y" * 20, "d/sub/deep/z": os.urandom(6 * MiB)}
    for path, data in files.items():
        denv.write_file(path, data)
    denv.mkdir("d/empty")
    denv.mkdir("d/sub/deep/void")
    denv.drain()
    assert sorted(denv.listing()) == ["d/empty/", "d/sub/deep/void/", "d/sub/deep/z", "d/sub/y", "d/x"]

    denv.mkdir("target")
    denv.rename("d", "target/e")
    rec = denv.drain()
    expected = ["target/e/empty/", "target/e/sub/deep/void/", "target/e/sub/deep/z", "target/e/sub/y", "target/e/x"]
    assert sorted(denv.listing()) == expected
    # Files were copied server-side, never uploaded again; markers are re-made (zero bytes).
    assert rec.calls("create_multipart") == [] and rec.calls("upload_part") == []
    assert all(k.endswith("/") for k in rec.calls("put_object"))
    assert sorted(rec.extras("copy")) == sorted(
        [("target/e/x", "d/x"), ("target/e/sub/y", "d/sub/y"), ("target/e/sub/deep/z", "d/sub/deep/z")])
    assert set(rec.deleted_keys()) >= {"d/x", "d/sub/y", "d/sub/deep/z", "d/empty/", "d/sub/deep/void/"}
    for path, data in files.items():
        check_object(denv, "target/e/" + path[2:], data)
    assert denv.head("target/e/empty/") is not None and denv.head("d/empty/") is None
    assert denv.pending() == {} and denv.tombstones() == {}


def test_unlink_and_rmdir_delete_objects_empty_dirs_keep_markers(denv):
    denv.mkdir("keep")
    denv.mkdir("gone")
    denv.write_file("dir/f", b"f")
    denv.write_file("dir/g", b"g")
    denv.drain()
    assert sorted(denv.listing()) == ["dir/f", "dir/g", "gone/", "keep/"]

    denv.unlink("dir/f")
    denv.rmdir("gone")
    rec = denv.drain()
    assert sorted(rec.deleted_keys()) == ["dir/f", "gone/"]
    assert sorted(denv.listing()) == ["dir/g", "keep/"]

    # The last file goes: the directory stays, as a marker.
    denv.unlink("dir/g")
    denv.drain()
    assert sorted(denv.listing()) == ["dir/", "keep/"]

    # A marked directory that gets a file keeps working.
    denv.write_file("keep/new", b"new content")
    denv.drain()
    assert "keep/new" in denv.listing()
    check_object(denv, "keep/new", b"new content")
    denv.unlink("keep/new")
    denv.drain()
    assert sorted(denv.listing()) == ["dir/", "keep/"]
    denv.rmdir("keep")
    denv.rmdir("dir")
    denv.drain()
    assert denv.listing() == []
    assert denv.pending() == {} and denv.tombstones() == {}


def test_unlink_of_a_file_never_uploaded_sends_nothing(denv):
    denv.write_file("scratch", b"s" * 1000)
    denv.unlink("scratch")
    rec = denv.drain()
    assert rec.written_keys() == [] and denv.listing() == []


def test_rename_over_a_durable_file_replaces_the_victim_object(denv):
    new, old = os.urandom(1000), os.urandom(2000)
    denv.write_file("a", new)
    denv.write_file("b", old)
    denv.drain()
    denv.rename("a", "b")
    rec = denv.drain()
    assert denv.listing() == ["b"]
    check_object(denv, "b", new)
    # The victim's object was overwritten in place, never deleted once the new content landed.
    landed = rec.index("copy", "b", "end")
    assert landed
    for i, e in enumerate(rec.events):
        if e[2] == "start" and e[0] in ("delete", "delete_many") and "b" in (e[1] if isinstance(e[1], tuple) else (e[1],)):
            assert i < landed[0], "the victim key was deleted after the new content landed"


def test_rename_over_with_a_fresh_file_uploads_under_the_final_name(denv):
    denv.write_file("ckpt.pt", b"old" * 1000)
    denv.drain()
    denv.write_file("ckpt.pt.tmp", b"new" * 1000)
    denv.rename("ckpt.pt.tmp", "ckpt.pt")
    rec = denv.drain()
    assert rec.written_keys() == ["ckpt.pt"]
    assert denv.listing() == ["ckpt.pt"]
    check_object(denv, "ckpt.pt", b"new" * 1000)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_rename_exchange_of_durable_files_swaps_bucket_content(denv, concurrency):
    a, b = os.urandom(1000), os.urandom(2000)
    denv.write_file("a", a)
    denv.write_file("b", b)
    denv.drain()
    denv.rename("a", "b", RENAME_EXCHANGE)
    rec = RecStore(None)

    async def slow_copy(key, src):
        await trio.sleep(0.2)  # the copy source must still be there when the copy runs

    rec.hooks["copy"] = slow_copy
    denv.drain(rec=rec, concurrency=concurrency)
    assert sorted(denv.listing()) == ["a", "b"]
    check_object(denv, "a", b)
    check_object(denv, "b", a)
    assert denv.pending() == {} and denv.tombstones() == {}


def test_backup_rotation_keeps_both_versions(denv):
    """mv ckpt ckpt.bak; write ckpt.tmp; mv ckpt.tmp ckpt — the old object must reach ckpt.bak."""
    old, new = os.urandom(3000), os.urandom(4000)
    denv.write_file("ckpt", old)
    denv.drain()
    denv.rename("ckpt", "ckpt.bak")
    denv.write_file("ckpt.tmp", new)
    denv.rename("ckpt.tmp", "ckpt")
    rec = RecStore(None)

    async def slow_copy(key, src):
        await trio.sleep(0.2)

    rec.hooks["copy"] = slow_copy
    denv.drain(rec=rec)
    assert sorted(denv.listing()) == ["ckpt", "ckpt.bak"]
    check_object(denv, "ckpt.bak", old)
    check_object(denv, "ckpt", new)


def test_rename_exchange_of_durable_directories(denv):
    denv.write_file("p/x", b"px")
    denv.write_file("p/only_p", b"op")
    denv.write_file("q/x", b"qx")
    denv.drain()
    denv.rename("p", "q", RENAME_EXCHANGE)
    denv.drain()
    assert sorted(denv.listing()) == ["p/x", "q/only_p", "q/x"]
    check_object(denv, "p/x", b"qx")
    check_object(denv, "q/x", b"px")
    check_object(denv, "q/only_p", b"op")


def test_hard_link_gets_its_own_object(denv):
    denv.write_file("f", b"linked")
    ino = denv.ino("f")
    denv.core.link(ino, 1, b"g")
    denv.drain()
    assert sorted(denv.listing()) == ["f", "g"]
    assert denv.object_bytes("g") == b"linked"
    denv.unlink("f")
    denv.drain()
    assert denv.listing() == ["g"]
    assert denv.object_bytes("g") == b"linked"


# -- the namespace changes while the drain works on it ----------------------------------------------


def _once(fn):
    done = []

    async def hook(key, extra):
        if not done:
            done.append(key)
            await trio.to_thread.run_sync(fn)

    return hook


@pytest.mark.parametrize("size", [1000, 6 * MiB])
def test_rename_during_upload_ends_with_only_the_new_name(denv, size):
    data = os.urandom(size)
    denv.write_file("dir/x.tmp", data)
    rec = RecStore(None)
    hook = _once(lambda: denv.rename("dir/x.tmp", "dir/x"))
    rec.hooks["put_object"] = hook
    rec.hooks["upload_part"] = hook
    denv.drain(rec=rec, part_size=5 * MiB)
    assert denv.listing() == ["dir/x"]
    check_object(denv, "dir/x", data)
    assert denv.open_uploads() == [] and denv.pending() == {} and denv.tombstones() == {}


@pytest.mark.parametrize("size", [1000, 6 * MiB])
def test_unlink_during_upload_leaves_nothing(denv, size):
    denv.write_file("doomed", os.urandom(size))
    denv.write_file("kept", b"k")
    rec = RecStore(None)
    hook = _once(lambda: denv.unlink("doomed"))

    async def only_doomed(key, extra):
        if key == "doomed":
            await hook(key, extra)

    rec.hooks["put_object"] = only_doomed
    rec.hooks["upload_part"] = only_doomed
    denv.drain(rec=rec, part_size=5 * MiB)
    assert denv.listing() == ["kept"]
    assert denv.open_uploads() == [] and denv.pending() == {} and denv.tombstones() == {}


def test_directory_rename_during_a_child_upload(denv):
    data = os.urandom(6 * MiB)
    denv.write_file("old/sub/shard", data)
    denv.write_file("old/small", b"s")
    rec = RecStore(None)
    rec.hooks["upload_part"] = _once(lambda: denv.rename("old", "new"))
    denv.drain(rec=rec, part_size=5 * MiB)
    assert sorted(denv.listing()) == ["new/small", "new/sub/shard"]
    check_object(denv, "new/sub/shard", data)
    assert denv.open_uploads() == [] and denv.pending() == {} and denv.tombstones() == {}


def test_symlink_is_stored_as_an_object_holding_its_target(denv):
    denv.mkdir("run")
    denv.core.symlink(denv.ino("run"), b"latest", b"step_100", USER)
    denv.drain()
    assert denv.listing() == ["run/latest"]
    assert denv.object_bytes("run/latest") == b"step_100"
    meta = denv.head("run/latest").metadata
    assert stat.S_ISLNK(int(meta["mode"]))
    assert meta["blake3"] == blake3.blake3(b"step_100").hexdigest()


def test_truncate_of_a_durable_file_uploads_the_short_content(denv):
    from ckptfs.gateway.core import SetattrRequest

    data = os.urandom(4000)
    denv.write_file("f", data)
    denv.drain()
    denv.core.setattr(denv.ino("f"), SetattrRequest(size=1000))
    denv.drain()
    check_object(denv, "f", data[:1000])


def test_name_reused_while_its_delete_is_being_decided(denv):
    """unlink x; create x again — while the drain is deciding to delete the old x: the new x survives."""
    denv.write_file("x", b"old" * 100)
    denv.drain()
    denv.unlink("x")
    new = os.urandom(5000)

    def setup(d):
        classify = d._classify_tombstones

        def slow_classify(txn, items):
            result = classify(txn, items)  # decided on the snapshot without the new x
            if any(k == "x" for k, _ in result[0]):
                denv.write_file("x", new)  # the new file appears meanwhile...
                time.sleep(0.3)  # ...and has all the time it needs to be uploaded
            return result

        d._classify_tombstones = slow_classify

    denv.drain(setup=setup)
    assert denv.listing() == ["x"]
    check_object(denv, "x", new)


def test_directory_recreated_while_its_marker_delete_is_decided(denv):
    denv.mkdir("d")
    denv.drain()
    assert denv.listing() == ["d/"]
    denv.rmdir("d")

    def setup(d):
        classify = d._classify_tombstones

        def slow_classify(txn, items):
            result = classify(txn, items)
            if any(k == "d/" for k, _ in result[0]):
                denv.mkdir("d")
                time.sleep(0.3)
            return result

        d._classify_tombstones = slow_classify

    denv.drain(setup=setup)
    assert denv.listing() == ["d/"]
    assert denv.state("d") == "durable"


def test_removed_directory_does_not_steal_the_marker_of_its_successor(denv):
    """rmdir d while the kernel still references it, mkdir d: the new d owns the d/ marker."""
    denv.mkdir("d")
    denv.drain()
    old = denv.ino("d")
    denv.rmdir("d")  # the removed inode lives on (kernel reference) with its record of d/
    denv.mkdir("d")
    denv.drain()
    assert denv.listing() == ["d/"]
    denv.core.forget([(old, 1)])  # the kernel lets go: the old inode is purged
    with denv.meta.read() as txn:
        assert txn.owner_of_remote_key("d/") == denv.ino("d")
    denv.rename("d", "e")
    denv.drain()
    assert denv.listing() == ["e/"]


def test_rename_whose_copy_source_vanished_uploads_from_the_cache(denv):
    """Someone deleted the object behind ckptfs's back: a rename still ends durable, from the cache."""
    data = os.urandom(300_000)
    denv.write_file("a", data)
    denv.drain()
    (denv.bucket / "a").unlink()  # deleted outside ckptfs
    denv.rename("a", "b")
    rec = denv.drain()
    assert denv.listing() == ["b"]
    assert denv.object_bytes("b") == data
    assert denv.state("b") == "durable"
    assert "b" in rec.written_keys()


def test_rename_keeps_storage_class_and_tags(denv):
    """A checkpoint tiered by the lifecycle engine stays tiered when renamed through the mount."""
    data = os.urandom(200_000)
    denv.write_file("ck/a", data)
    denv.drain()

    async def tier():
        async with denv.store() as st:
            await st.copy("ck/a", "ck/a", storage_class="COLD")
            await st.put_tags("ck/a", {"ckptfs-tier": "COLD"})
    trio.run(tier)
    denv.rename("ck", "ck2")
    denv.drain()
    info = denv.head("ck2/a")
    assert info.storage_class == "COLD"

    async def tags():
        async with denv.store() as st:
            return await st.get_tags("ck2/a")
    assert trio.run(tags) == {"ckptfs-tier": "COLD"}
    assert denv.object_bytes("ck2/a") == data


def test_fifos_sockets_and_devices_are_empty_objects_with_mode_and_rdev(denv):
    root = denv.mkdir("run")
    rdev = os.makedev(1, 3)
    made = {
        "run/fifo": denv.core.mknod(root, b"fifo", stat.S_IFIFO | 0o640, 0, USER),
        "run/sock": denv.core.mknod(root, b"sock", stat.S_IFSOCK | 0o755, 0, USER),
        "run/null": denv.core.mknod(root, b"null", stat.S_IFCHR | 0o666, rdev, ROOT),
        "run/COMPLETE": denv.core.mknod(root, b"COMPLETE", stat.S_IFREG | 0o644, 0, USER),
    }
    denv.drain()
    assert sorted(denv.listing()) == sorted(made)
    for path, attr in made.items():
        assert denv.object_bytes(path) == b""
        meta = denv.head(path).metadata
        assert int(meta["mode"]) == attr.mode  # carries the file type bits, as s3fs stores them
        assert int(meta.get("rdev", "0")) == attr.rdev
        assert denv.state(path) == "durable"
    assert stat.S_ISCHR(int(denv.head("run/null").metadata["mode"])) and made["run/null"].rdev == rdev
    # chmod and rename of a FIFO follow it to the bucket.
    denv.core.setattr(made["run/fifo"].ino, SetattrRequest(mode=0o600))
    denv.rename("run/null", "run/zero")
    denv.drain()
    assert sorted(denv.listing()) == ["run/COMPLETE", "run/fifo", "run/sock", "run/zero"]
    assert int(denv.head("run/fifo").metadata["mode"]) == stat.S_IFIFO | 0o600
    assert denv.head("run/zero").metadata["rdev"] == str(rdev)


def test_file_whose_close_failed_to_persist_still_drains(denv, monkeypatch):
    lock_fd = locks.acquire(CacheDir(denv.cache).gateway_lock)  # a live gateway: writers count
    try:
        fh, ino = denv.create("ckpt/model.pt")
        denv.core.write(fh, 0, b"weights")
        denv.core.flush(fh)

        def full_device(of, then=None):
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(denv.core._files, "persist", full_device)
            with pytest.raises(OSError):
                denv.core.release(fh)
        denv.drain(timeout=10)  # the failed close left no writer behind to hold the upload back
    finally:
        os.close(lock_fd)
    assert denv.listing() == ["ckpt/model.pt"] and denv.object_bytes("ckpt/model.pt") == b"weights"
    assert denv.state("ckpt/model.pt") == "durable"

"""The bucket is the namespace (core, no FUSE): listings become inodes, with a TTL.

A node whose cache knows nothing of a bucket (``Node``: an FsCore with a bucket client on a
file:// bucket and an injected clock) must show every object under its prefix with the
attributes the drain wrote, see other nodes' changes once the TTL has passed, answer
repeated misses without asking the bucket, and never let a remote object override a local
change the drain has not finished.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

import pytest
import trio
from test_drain_support import USER, MiB

from ckptfs.drain.filestore import FileStore
from ckptfs.drain.worker import Drain, object_metadata
from ckptfs.fsmeta import ROOT_INO, FileState, MetaStore
from ckptfs.fsmeta.check import fsmeta_problems
from ckptfs.fsmeta.settings import Settings
from ckptfs.gateway.bucket import BucketClient
from ckptfs.gateway.core import FsCore, SetattrRequest
from ckptfs.gateway.errors import FsError
from ckptfs.gateway.listing import DEFAULT_REMOTE_TTL, parse_mode, parse_mtime_ns

SEC = 1_000_000_000
TTL = 2.0
T0 = 1_800_000_000 * SEC


class Node:
    """One mount's core on a bucket: its own cache directory, an injected clock."""

    def __init__(self, cache: Path, bucket: Path, ttl: float = TTL):
        cache.mkdir(parents=True, exist_ok=True)
        self.now = T0
        self.bucket_root = bucket
        self.meta = MetaStore(str(cache / "meta"))
        self.bucket = BucketClient(lambda: FileStore(str(bucket))).start()
        self.core = FsCore(str(cache), self.meta, bucket=self.bucket, remote_ttl=ttl, clock=lambda: self.now)

    def close(self) -> None:
        for of in list(self.core._open.values()):
            os.close(of.fd)
        self.bucket.close()
        self.meta.close()

    @property
    def stats(self):
        return self.core.remote.stats

    def advance(self, seconds: float = TTL + 0.1) -> None:
        self.now += int(seconds * SEC)

    def put(self, key: str, data: bytes = b"", metadata: dict | None = None):
        return self.bucket.call(lambda store: store.put_object(key, data, metadata))

    def delete(self, key: str) -> None:
        self.bucket.call(lambda store: store.delete(key))

    def walk(self, path: str):
        """Look ``path`` up component by component, as the kernel does: its Attr."""
        attr = self.core.getattr(ROOT_INO)
        for part in [p for p in path.split("/") if p]:
            attr = self.core.lookup(attr.ino, part.encode())
        return attr

    def errno_of(self, path: str) -> int | None:
        try:
            self.walk(path)
        except FsError as exc:
            return exc.errno
        return None

    def ls(self, path: str = "") -> list[str]:
        fh = self.core.opendir(self.walk(path).ino)
        try:
            return sorted(name.decode() for name, _, _ in self.core.readdir(fh, 0))
        finally:
            self.core.releasedir(fh)

    def inode(self, path: str):
        with self.meta.read() as txn:
            return txn.get_inode(txn.resolve(path.encode()))

    def remote(self, path: str):
        with self.meta.read() as txn:
            return txn.get_remote(txn.resolve(path.encode()))

    def problems(self) -> list[str]:
        return fsmeta_problems(self.meta)

    @contextlib.contextmanager
    def drain_after_each_list(self):
        """Each bucket LIST runs the drain right after it is taken: a listing that raced
        the drain's writes."""
        real_list = self.bucket.list

        def list_then_drain(prefix, delimiter=None):
            result = real_list(prefix, delimiter)
            self.drain()
            return result

        self.bucket.list = list_then_drain
        try:
            yield
        finally:
            self.bucket.list = real_list

    def drain(self, store_cls=FileStore) -> None:
        """Run a drain on this node's cache until its queue is empty (``store_cls``: the
        bucket's behaviour, a FileStore by default)."""
        settings = Settings(bucket_url=f"file://{self.bucket_root}", cache_dir=self.core.cache_dir,
                            settle_seconds=0, part_size=5 * MiB, concurrency=4)

        async def run():
            async with store_cls(str(self.bucket_root)) as store:
                with trio.fail_after(20):
                    await Drain(self.core.cache_dir, self.meta, settings, store,
                                clock=lambda: self.now).run(until_empty=True)

        trio.run(run)


@pytest.fixture
def bucket(tmp_path) -> Path:
    root = tmp_path / "bucket"
    root.mkdir()
    return root


@pytest.fixture
def node(tmp_path, bucket):
    n = Node(tmp_path / "cache-b", bucket)
    yield n
    n.close()


@pytest.fixture
def writer(tmp_path, bucket):
    """Node A, on the same bucket with a cache of its own."""
    n = Node(tmp_path / "cache-a", bucket)
    yield n
    n.close()


@pytest.fixture(autouse=True)
def fast_drain(monkeypatch):
    from ckptfs.drain import worker

    monkeypatch.setattr(worker, "POLL_SECONDS", 0.01)


MTIME = 1_700_000_000 * SEC + 123_456_789


def test_objects_become_files_and_directories_with_the_drains_metadata(node):
    node.put("ckpt/step_1/model.pt", b"x" * 1000,
             object_metadata(stat.S_IFREG | 0o600, 1234, 5678, MTIME, blake3="ab" * 32))
    node.put("ckpt/step_1/.metadata", b"{}")  # another tool: no metadata
    node.put("ckpt/empty/", b"", object_metadata(stat.S_IFDIR | 0o700, 42, 43, MTIME))

    assert node.ls() == ["ckpt"]
    assert node.ls("ckpt") == ["empty", "step_1"]
    assert node.ls("ckpt/step_1") == [".metadata", "model.pt"]
    model = node.walk("ckpt/step_1/model.pt")
    assert (model.size, model.mode, model.uid, model.gid, model.mtime_ns) == (
        1000, stat.S_IFREG | 0o600, 1234, 5678, MTIME)
    other = node.walk("ckpt/step_1/.metadata")
    modified = node.bucket.head("ckpt/step_1/.metadata").last_modified
    assert (other.size, other.mode, other.uid, other.gid) == (2, stat.S_IFREG | 0o644, os.getuid(), os.getgid())
    assert other.mtime_ns == int(modified.timestamp() * 1e9)  # LastModified
    empty = node.walk("ckpt/empty")
    assert (empty.mode, empty.uid, empty.gid, empty.mtime_ns) == (stat.S_IFDIR | 0o700, 42, 43, MTIME)
    assert stat.S_ISDIR(node.walk("ckpt").mode) and node.walk("ckpt").mode & 0o777 == 0o755
    assert node.walk("ckpt").nlink == 4  # two subdirectories

    assert node.inode("ckpt/step_1/model.pt").state == FileState.REMOTE
    record = node.remote("ckpt/step_1/model.pt")
    assert (record.key, record.size, record.blake3) == ("ckpt/step_1/model.pt", 1000, "ab" * 32)
    assert record.etag == node.bucket.head("ckpt/step_1/model.pt").etag
    assert node.core.getxattr(model.ino, b"user.ckptfs.state") == b"remote"
    assert node.problems() == []


def write(node: Node, path: str, data: bytes, mode: int = 0o644) -> int:
    """Create ``path`` (its directory must exist) and write ``data``, as a user would."""
    head, _, name = path.rpartition("/")
    parent = node.walk(head).ino if head else ROOT_INO
    fh, attr = node.core.create(parent, name.encode(), mode, os.O_WRONLY, USER)
    node.core.write(fh, 0, data)
    node.core.release(fh)
    return attr.ino


def test_a_drained_checkpoint_shows_on_another_node_exactly(writer, node):
    writer.core.mkdir(ROOT_INO, b"run", 0o750, USER)
    writer.core.mkdir(writer.walk("run").ino, b"step_5", 0o755, USER)
    write(writer, "run/step_5/shard_0.pt", os.urandom(3000), mode=0o640)
    meta_ino = write(writer, "run/step_5/.metadata", b'{"step": 5}', mode=0o600)
    writer.core.setattr(meta_ino, SetattrRequest(uid=USER.uid + 1, mtime_ns=MTIME))
    writer.drain()
    for path in ("run/step_5/shard_0.pt", "run/step_5/.metadata"):
        a = writer.walk(path)
        b = node.walk(path)
        assert (b.size, b.mode, b.uid, b.gid, b.mtime_ns) == (a.size, a.mode, a.uid, a.gid, a.mtime_ns), path
        assert node.remote(path).blake3 == writer.core.getxattr(a.ino, b"user.ckptfs.blake3").decode()
    assert node.walk("run/step_5/.metadata").uid == USER.uid + 1
    assert node.problems() == []


def test_renames_and_deletes_on_one_node_show_on_the_other_after_the_ttl(writer, node):
    writer.core.mkdir(ROOT_INO, b"ckpt", 0o755, USER)
    write(writer, "ckpt/a", b"1")
    write(writer, "ckpt/b", b"2")
    writer.drain()
    assert node.ls("ckpt") == ["a", "b"]
    parent = writer.walk("ckpt").ino
    writer.core.rename(parent, b"a", parent, b"c")
    writer.core.unlink(parent, b"b")
    writer.drain()
    assert node.ls("ckpt") == ["a", "b"]  # within the TTL
    node.advance()
    assert node.ls("ckpt") == ["c"]
    assert node.errno_of("ckpt/a") == errno.ENOENT and node.errno_of("ckpt/b") == errno.ENOENT
    assert node.problems() == []


def replace_dir_with_file(writer: Node, data: bytes) -> None:
    """On ``writer``: ``rm ckpt/d/x; rmdir ckpt/d; echo data > ckpt/d``, drained."""
    ckpt = writer.walk("ckpt").ino
    writer.core.unlink(writer.walk("ckpt/d").ino, b"x")
    writer.core.rmdir(ckpt, b"d")
    write(writer, "ckpt/d", data)
    writer.drain()


def test_a_directory_another_node_replaced_by_a_file_becomes_that_file_after_the_ttl(writer, node):
    """Found by the churn test (live node): a settled directory whose name became a file in
    the bucket stayed a directory here for ever (the local one won against any listing)."""
    writer.core.mkdir(ROOT_INO, b"ckpt", 0o755, USER)
    writer.core.mkdir(writer.walk("ckpt").ino, b"d", 0o755, USER)
    write(writer, "ckpt/d/x", b"in the directory")
    writer.drain()
    assert node.ls("ckpt/d") == ["x"]
    assert read_path(node, "ckpt/d/x") == b"in the directory"  # cached here
    old_dir, old_file = node.walk("ckpt/d").ino, node.walk("ckpt/d/x").ino
    assert (Path(node.core.cache_dir) / "data" / f"{old_file:x}").exists()
    replace_dir_with_file(writer, b"now a file")
    assert stat.S_ISDIR(node.walk("ckpt/d").mode)  # within the TTL
    node.advance()
    attr = node.walk("ckpt/d")
    assert stat.S_ISREG(attr.mode) and attr.size == 10 and attr.ino not in (old_dir, old_file)
    assert read_path(node, "ckpt/d") == b"now a file"
    assert node.walk("ckpt").nlink == 2
    node.core.forget([(old_dir, 1 << 20), (old_file, 1 << 20)])  # the kernel drops the old ones
    with node.meta.read() as txn:
        assert txn.get_inode(old_dir) is None and txn.get_inode(old_file) is None
    assert not (Path(node.core.cache_dir) / "data" / f"{old_file:x}").exists()
    assert node.problems() == []


def test_a_file_another_node_replaced_by_a_directory_becomes_that_directory_after_the_ttl(writer, node):
    writer.core.mkdir(ROOT_INO, b"ckpt", 0o755, USER)
    write(writer, "ckpt/d", b"a file")
    writer.drain()
    assert read_path(node, "ckpt/d") == b"a file"
    old = node.walk("ckpt/d").ino
    ckpt = writer.walk("ckpt").ino
    writer.core.unlink(ckpt, b"d")
    writer.core.mkdir(ckpt, b"d", 0o755, USER)
    write(writer, "ckpt/d/x", b"in the directory")
    writer.drain()
    node.advance()
    attr = node.walk("ckpt/d")
    assert stat.S_ISDIR(attr.mode) and attr.ino != old
    assert node.ls("ckpt/d") == ["x"] and read_path(node, "ckpt/d/x") == b"in the directory"
    assert node.walk("ckpt").nlink == 3
    node.core.forget([(old, 1 << 20)])
    with node.meta.read() as txn:
        assert txn.get_inode(old) is None
    assert node.problems() == []


def test_a_name_that_changed_type_elsewhere_keeps_this_nodes_pending_or_open_one(writer, node):
    """This node's own state wins, as against a deletion: a directory holding a file the
    drain has not uploaded, a file open here (until it is closed)."""
    writer.core.mkdir(ROOT_INO, b"ckpt", 0o755, USER)
    writer.core.mkdir(writer.walk("ckpt").ino, b"d", 0o755, USER)
    write(writer, "ckpt/d/x", b"in the directory")
    write(writer, "ckpt/f", b"a file")
    writer.drain()
    assert node.ls("ckpt/d") == ["x"]
    write(node, "ckpt/d/mine", b"not uploaded yet")
    fh = node.core.open(node.walk("ckpt/f").ino, os.O_RDONLY)
    replace_dir_with_file(writer, b"now a file")
    ckpt = writer.walk("ckpt").ino
    writer.core.unlink(ckpt, b"f")
    writer.core.mkdir(ckpt, b"f", 0o755, USER)
    writer.drain()
    node.advance()
    assert stat.S_ISDIR(node.walk("ckpt/d").mode) and node.ls("ckpt/d") == ["mine"]
    assert stat.S_ISREG(node.walk("ckpt/f").mode)
    node.core.release(fh)
    node.advance()
    assert stat.S_ISDIR(node.walk("ckpt/f").mode)
    assert node.problems() == []


def test_a_listing_that_raced_this_nodes_own_replacement_of_a_directory_does_not_undo_it(node):
    """The listing (taken before the drain) still shows the directory this node replaced by
    a file: the directory's objects were queued for deletion here, so it does not come back."""
    node.core.mkdir(ROOT_INO, b"d", 0o755, USER)
    write(node, "d/x", b"1")
    node.drain()
    node.advance()
    assert node.ls("") == ["d"]
    node.core.unlink(node.walk("d").ino, b"x")
    node.core.rmdir(ROOT_INO, b"d")
    ino = write(node, "d", b"a file")
    node.advance()
    with node.drain_after_each_list():  # the listing was taken before the drain ran
        assert node.ls("") == ["d"]
    assert node.walk("d").ino == ino and node.inode("d").state == FileState.DURABLE
    assert node.problems() == []


def test_a_file_stays_until_the_bucket_confirms_its_object_gone_though_listed_as_a_directory(node):
    """As for a name missing from a listing, a HEAD must confirm that the file's object is
    gone before a directory listed at its name replaces it (a listing that raced an upload)."""
    from ckptfs.drain.store import ListResult

    node.put("ckpt/f", b"still here")
    ino = node.walk("ckpt/f").ino
    real_list = node.bucket.list

    def listed_as_a_directory(prefix, delimiter=None):
        result = real_list(prefix, delimiter)
        if prefix != "ckpt/":
            return result
        return ListResult([o for o in result.objects if o.key != "ckpt/f"], [*result.prefixes, "ckpt/f/"])

    node.bucket.list = listed_as_a_directory
    node.advance()
    assert node.ls("ckpt") == ["f"] and node.walk("ckpt/f").ino == ino
    assert stat.S_ISREG(node.walk("ckpt/f").mode)
    node.bucket.list = real_list
    assert node.problems() == []


def test_rclone_octal_modes_and_fractional_mtimes_are_understood():
    assert parse_mode("33188", 0) == stat.S_IFREG | 0o644  # s3fs, ckptfs: decimal
    assert parse_mode("100644", 0) == stat.S_IFREG | 0o644  # rclone: octal
    assert parse_mode("40755", stat.S_IFDIR) == stat.S_IFDIR | 0o755
    assert parse_mode("420", stat.S_IFREG) == stat.S_IFREG | 0o644  # permission bits only
    assert parse_mode("rwx", stat.S_IFREG | 0o644) == stat.S_IFREG | 0o644
    assert parse_mtime_ns("1700000000") == 1_700_000_000 * SEC
    assert parse_mtime_ns("1700000000.5") == 1_700_000_000 * SEC + SEC // 2
    assert parse_mtime_ns("soon") is None
    assert DEFAULT_REMOTE_TTL <= 10


def test_objects_written_elsewhere_appear_after_the_ttl(node):
    node.put("ckpt/a", b"1")
    assert node.ls("ckpt") == ["a"]
    node.put("ckpt/b", b"22")
    assert node.errno_of("ckpt/b") == errno.ENOENT  # the listing is younger than the TTL
    node.advance()
    assert node.walk("ckpt/b").size == 2
    assert node.ls("ckpt") == ["a", "b"]


def test_misses_are_answered_from_the_listing_without_requests(node):
    node.put("ckpt/model.pt", b"m")
    node.walk("ckpt")
    before = node.stats.requests
    for i in range(200):  # a DCP load / an import probing names that do not exist
        assert node.errno_of(f"ckpt/missing_{i}.py") == errno.ENOENT
    # one LIST of ckpt (its HEAD of model.pt), none per miss
    assert node.stats.lists == 2 and node.stats.requests - before == 2
    assert node.stats.negative_hits == 199
    heads = node.stats.heads
    node.advance()
    assert node.errno_of("ckpt/missing_0.py") == errno.ENOENT
    assert node.stats.lists == 4  # the root and ckpt are listed again, once each
    assert node.stats.heads == heads  # model.pt is known: no new HEAD


def test_lookups_the_listing_answers_send_no_request_and_the_kernel_keeps_them_while_it_is_fresh(node):
    """While a directory's listing is fresh a lookup in it, positive or negative, is answered
    from fsmeta alone, and the kernel may keep each answer until the listing expires (at
    least 1 s); after that the next lookup lists the directory again."""
    core = node.core
    node.put("ckpt/a", b"1")
    ckpt = node.walk("ckpt").ino
    assert node.walk("ckpt/a").size == 1  # lists ckpt
    requests = node.stats.requests
    a = core.lookup(ckpt, b"a")
    assert a.size == 1
    with pytest.raises(FsError) as exc:
        core.lookup(ckpt, b"missing")
    assert exc.value.errno == errno.ENOENT
    assert node.stats.requests == requests  # answered from fsmeta alone
    assert core.entry_timeout(ckpt) == pytest.approx(TTL)  # the listing is fresh for the whole TTL
    node.advance(TTL / 2)
    assert core.entry_timeout(ckpt) == pytest.approx(TTL / 2)
    node.advance(TTL / 2)
    assert core.entry_timeout(ckpt) == 1.0  # stale: the 1 s the semantics allow on top of the TTL
    assert core.lookup(ckpt, b"a").ino == a.ino
    assert node.stats.requests > requests  # listed again


def test_a_dirty_local_file_shadows_the_remote_object(node):
    node.put("ckpt/a", b"remote content")
    parent = node.walk("ckpt").ino
    fh = node.core.open(node.walk("ckpt/a").ino, os.O_WRONLY | os.O_TRUNC)
    node.core.write(fh, 0, b"local")
    node.core.release(fh)
    fh, attr = node.core.create(parent, b"new", 0o644, os.O_WRONLY, USER)
    node.core.write(fh, 0, b"mine")
    node.core.release(fh)
    node.put("ckpt/new", b"someone else's")
    node.advance()
    assert node.ls("ckpt") == ["a", "new"]
    assert node.walk("ckpt/a").size == 5 and node.inode("ckpt/a").state == FileState.DIRTY
    assert node.walk("ckpt/new").ino == attr.ino and node.walk("ckpt/new").size == 4
    assert node.problems() == []


def test_a_local_unlink_or_rename_does_not_bring_the_old_object_back(node):
    node.put("ckpt/gone", b"1")
    node.put("ckpt/old", b"2")
    node.put("ckpt/d/x", b"3")
    parent = node.walk("ckpt").ino
    node.walk("ckpt/gone")
    node.core.unlink(parent, b"gone")
    node.core.rename(parent, b"old", parent, b"new")
    node.core.rename(parent, b"d", parent, b"e")
    node.advance()
    # The objects are still in the bucket (the drain has not run): pending deletion or move.
    assert sorted(node.bucket.list("ckpt/").objects[i].key for i in range(3)) == ["ckpt/d/x", "ckpt/gone", "ckpt/old"]
    assert node.ls("ckpt") == ["e", "new"]
    assert node.ls("ckpt/e") == ["x"]
    assert node.problems() == []


def test_a_renamed_directory_holding_a_second_link_does_not_bring_its_old_name_back(node):
    """``ln b c/x; mv c a; mkdir c``: the copy at ``c/x`` is no name of the file any more."""
    node.core.mkdir(ROOT_INO, b"c", 0o755, USER)
    ino = write(node, "b", b"linked")
    node.core.link(ino, node.walk("c").ino, b"x")
    node.drain()
    node.core.rename(ROOT_INO, b"c", ROOT_INO, b"a")
    node.core.mkdir(ROOT_INO, b"c", 0o755, USER)
    node.advance()
    assert node.ls("c") == []  # before the drain (c/x waits for its delete)
    node.drain()
    node.advance()
    assert node.ls("c") == [] and node.ls("a") == ["x"]
    assert node.problems() == []


def test_an_object_deleted_in_the_bucket_disappears_after_the_ttl(node):
    node.put("ckpt/keep", b"0")
    node.put("ckpt/a", b"1")
    node.put("ckpt/sub/b", b"2")
    node.put("ckpt/sub/deeper/c", b"3")
    assert node.ls("ckpt/sub/deeper") == ["c"]
    ino = node.walk("ckpt/a").ino
    node.delete("ckpt/a")
    node.delete("ckpt/sub/b")
    node.delete("ckpt/sub/deeper/c")
    assert node.ls("ckpt") == ["a", "keep", "sub"]  # within the TTL
    node.advance()
    assert node.ls("ckpt") == ["keep"]
    assert node.errno_of("ckpt/a") == errno.ENOENT
    node.core.forget([(ino, 1)])  # the kernel drops its reference: the inode goes
    with node.meta.read() as txn:
        assert txn.get_inode(ino) is None
    assert node.problems() == []


def test_an_open_file_stays_while_its_object_is_deleted(node):
    node.put("ckpt/keep", b"0")
    node.put("ckpt/a", b"1")
    ino = node.walk("ckpt/a").ino
    fh = node.core.open(ino, os.O_RDONLY)
    node.delete("ckpt/a")
    node.advance()
    assert node.ls("ckpt") == ["a", "keep"] and node.walk("ckpt/a").ino == ino
    node.core.release(fh)
    node.advance()
    assert node.ls("ckpt") == ["keep"]
    assert node.problems() == []


def test_the_writers_own_uploads_cost_no_head_and_keep_its_cache(node):
    # A listing (here: after the TTL) that finds the files this node uploaded itself.
    node.ls("")
    fh, attr = node.core.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, USER)
    node.core.write(fh, 0, b"data")
    node.core.release(fh)
    node.drain()
    assert node.inode("f").state == FileState.DURABLE
    heads = node.stats.heads
    node.advance()
    assert node.ls("") == ["f"] and node.inode("f").state == FileState.DURABLE
    assert node.stats.heads == heads  # same etag: no HEAD, and the cache file stays
    assert (Path(node.core.cache_dir) / "data" / f"{attr.ino:x}").read_bytes() == b"data"


def test_a_listing_that_raced_an_upload_does_not_remove_the_uploaded_file(node):
    node.ls("")
    fh, _ = node.core.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, USER)
    node.core.release(fh)
    real_list = node.bucket.list

    def list_then_drain(prefix, delimiter=None):
        result = real_list(prefix, delimiter)  # taken before the upload
        node.drain()
        return result

    node.bucket.list = list_then_drain
    node.advance()
    assert node.ls("") == ["f"]  # a HEAD confirmed the object is there
    node.bucket.list = real_list
    assert node.inode("f").state == FileState.DURABLE


def test_a_listing_that_raced_a_directorys_marker_does_not_remove_the_directory(node):
    """The probe of ``d/`` that confirms a settled directory is gone must see the directory's
    own marker: the ``file://`` store listed only what lies below it, so an empty directory
    whose marker landed after the parent's LIST was taken away (as another node's delete)."""
    node.ls("")
    node.core.mkdir(ROOT_INO, b"d", 0o755, USER)
    node.advance()
    with node.drain_after_each_list():  # the listing was taken before the drain ran
        assert node.ls("") == ["d"]
    assert node.inode("d") is not None and node.remote("d").key == "d/"


def test_a_replaced_object_gets_its_new_attributes(node):
    node.put("ckpt/a", b"1", object_metadata(stat.S_IFREG | 0o644, 1, 1, MTIME))
    first = node.walk("ckpt/a")
    node.put("ckpt/a", b"22", object_metadata(stat.S_IFREG | 0o600, 2, 2, MTIME + SEC))
    node.advance()
    again = node.walk("ckpt/a")
    # A new file at the name, as after a rename over it: the kernel asks afresh about a new
    # inode only (with the writeback cache it keeps a cached file's size whatever GETATTR says).
    assert again.ino != first.ino
    assert (again.size, again.mode, again.uid, again.mtime_ns) == (2, stat.S_IFREG | 0o600, 2, MTIME + SEC)
    assert node.remote("ckpt/a").etag == node.bucket.head("ckpt/a").etag
    node.core.forget([(first.ino, 1)])  # the old one goes once the kernel forgets it
    with node.meta.read() as txn:
        assert txn.get_inode(first.ino) is None
    assert node.problems() == []


def test_rmdir_of_a_remote_directory_with_unlisted_objects_is_refused(node):
    node.put("ckpt/d/inner/x", b"1")
    parent = node.walk("ckpt").ino
    node.walk("ckpt/d")
    with pytest.raises(FsError) as exc:
        node.core.rmdir(parent, b"d")
    assert exc.value.errno == errno.ENOTEMPTY


def test_bucket_errors_do_not_fail_lookups_of_local_files(node):
    parent = ROOT_INO
    fh, attr = node.core.create(parent, b"local", 0o644, os.O_WRONLY, USER)
    node.core.release(fh)
    node.bucket.close()  # the bucket is unreachable
    node.advance()
    assert node.walk("local").ino == attr.ino
    assert node.errno_of("missing") == errno.ENOENT
    assert node.stats.errors >= 1


def test_renames_and_unlinks_of_remote_files_are_drained_as_copies_and_deletes(node):
    node.put("ckpt/a", b"aaa", object_metadata(stat.S_IFREG | 0o600, 7, 8, MTIME, blake3="cd" * 32))
    node.put("ckpt/b", b"bbb")
    node.put("ckpt/d/x", b"xxx")
    node.put("ckpt/d/y/z", b"zzz")
    parent = node.walk("ckpt").ino
    node.walk("ckpt/a")
    node.walk("ckpt/b")
    node.walk("ckpt/d")
    node.core.rename(parent, b"a", parent, b"a2")
    node.core.unlink(parent, b"b")
    node.core.rename(parent, b"d", parent, b"e")  # d/y/z was never listed: the rename lists it
    node.drain()
    keys = sorted(o.key for o in node.bucket.list("ckpt/").objects)
    assert keys == ["ckpt/a2", "ckpt/e/x", "ckpt/e/y/z"]
    info = node.bucket.head("ckpt/a2")
    assert (info.metadata["mode"], info.metadata["uid"], info.metadata["blake3"]) == (
        str(stat.S_IFREG | 0o600), "7", "cd" * 32)
    # Moved, not fetched: still REMOTE (DURABLE would claim the cache holds the content).
    for path in ("ckpt/a2", "ckpt/e/x", "ckpt/e/y/z"):
        assert node.inode(path).state == FileState.REMOTE, path
    assert node.core.getxattr(node.walk("ckpt/a2").ino, b"user.ckptfs.state") == b"remote"
    node.advance()
    assert node.ls("ckpt") == ["a2", "e"] and node.ls("ckpt/e/y") == ["z"]
    assert node.problems() == []


def lost_before_its_move(node) -> tuple[int, int]:
    """``ckpt/a``, known only from the bucket, renamed to ``ckpt/b``; another node deletes
    ``ckpt/a`` before the drain copied it, and the drain runs: the file's content is nowhere.
    Returns (the directory's inode, the file's)."""
    node.put("ckpt/a", b"aaa")
    parent = node.walk("ckpt").ino
    node.walk("ckpt/a")
    node.core.rename(parent, b"a", parent, b"b")
    node.delete("ckpt/a")  # deleted by another node before the drain copied it
    node.drain()  # returns: the file is not requeued forever
    ino = node.walk("ckpt/b").ino
    assert node.core.getxattr(ino, b"user.ckptfs.state") == b"error: RemoteObjectGone"
    return parent, ino


def test_a_remote_file_whose_object_vanished_before_its_move_shows_an_error(node):
    node.put("ckpt/keep", b"0")
    lost_before_its_move(node)
    node.advance()
    assert node.ls("ckpt") == ["keep"]  # nothing in the bucket: it goes at the next listing
    assert node.problems() == []


def test_a_file_whose_object_vanished_renamed_again_does_not_stop_the_drain(node):
    """Found by the drain model (seed 101, 60 x 120). A file whose content is nowhere
    (RemoteObjectGone: off the drain's queue) was renamed again before a listing removed it:
    the rename queued it, and the drain looked for its cache file for ever, so it never
    emptied. It is taken off the queue again, its error kept, and opening it fails."""
    node.put("ckpt/keep", b"0")
    parent, ino = lost_before_its_move(node)
    node.core.rename(parent, b"b", parent, b"c")
    node.drain()  # returns
    assert node.core.getxattr(ino, b"user.ckptfs.state") == b"error: RemoteObjectGone"
    with pytest.raises(FsError) as exc:  # (an open of a REMOTE file starts its fetch: nothing to fetch)
        node.core.open(ino, os.O_RDONLY)
    assert exc.value.errno == errno.EIO
    assert node.bucket.head("ckpt/c") is None  # nothing was made up for it
    node.advance()
    assert node.ls("ckpt") == ["keep"]  # nothing in the bucket: it goes at the next listing
    assert node.problems() == []


def test_a_file_whose_object_vanished_takes_the_object_another_node_put_at_its_name(node):
    """Found by the drain model (seed 13, 60 x 120; shrunk from 121 steps). A file whose
    content is nowhere (RemoteObjectGone) kept its name against another node's object at
    that key: the other node's checkpoint never showed here, and an unlink here would have
    deleted it from the bucket."""
    _, ino = lost_before_its_move(node)
    node.put("ckpt/b", b"another node's b", object_metadata(stat.S_IFREG | 0o640, 2, 2, MTIME))
    node.advance()
    attr = node.walk("ckpt/b")
    assert (attr.size, attr.mode, attr.uid) == (16, stat.S_IFREG | 0o640, 2)  # a new file there
    assert attr.ino != ino
    ino = attr.ino
    assert node.core.getxattr(ino, b"user.ckptfs.state") == b"remote"
    fh = node.core.open(ino, os.O_RDONLY)
    try:
        assert node.core.read(fh, 0, 100) == b"another node's b"
    finally:
        node.core.release(fh)
    assert node.problems() == []


def test_new_metadata_on_the_same_content_keeps_the_cache(node):
    # Another node's chmod reaches the bucket as a copy with new metadata (and a new
    # LastModified, maybe a new etag): the content, the cache file and the generation stay.
    node.ls("")
    ino = write(node, "f", b"data")
    node.drain()
    node.advance()
    assert node.ls("") == ["f"]
    generation = node.inode("f").generation
    info = node.bucket.head("f")
    node.put("f", b"data", {**info.metadata, "mode": str(stat.S_IFREG | 0o600), "uid": "99"})
    node.advance()
    assert node.ls("") == ["f"]
    attr = node.walk("f")
    assert (attr.mode, attr.uid) == (stat.S_IFREG | 0o600, 99)
    assert node.inode("f").state == FileState.DURABLE and node.inode("f").generation == generation
    assert (Path(node.core.cache_dir) / "data" / f"{ino:x}").read_bytes() == b"data"


def hard_linked_and_drained(node: Node) -> int:
    """``b/a`` (its record's name) and its hard link ``c/a``, both in the bucket."""
    for d in (b"b", b"c"):
        node.core.mkdir(ROOT_INO, d, 0o755, USER)
    ino = write(node, "b/a", b"local content")
    node.core.link(ino, node.walk("c").ino, b"a")
    node.drain()
    assert node.remote("b/a").key == "b/a"
    return ino


def read_path(node: Node, path: str) -> bytes:
    fh = node.core.open(node.walk(path).ino, os.O_RDONLY)
    try:
        return node.core.read(fh, 0, 1 << 20)
    finally:
        node.core.release(fh)


def bucket_bytes(node: Node) -> dict[str, bytes]:
    return {str(p.relative_to(node.bucket_root)): p.read_bytes() for p in node.bucket_root.rglob("*")
            if p.is_file() and not p.name.startswith(".ckptfs-")}  # (the file store's metadata files)


@pytest.mark.parametrize("replaced", ["c/a", "b/a"], ids=["second_link", "first_link"])
def test_another_nodes_object_at_one_name_of_a_hard_link_splits_that_name_off(node, replaced):
    """Found by the drain model (seed 311, 60 x 120; shrunk from 121 steps to 5). In the bucket,
    hard links are independent copies. Another node's object at one of them showed here as
    the local file's old content (or, at the file's record, replaced the content of every
    name), and the bucket never matched the namespace. That name now becomes a file of its
    own with the new object; the local file keeps its other names and its content, read
    from its own copy once evicted."""
    from ckptfs.gateway.space import SpaceLimits

    ino = hard_linked_and_drained(node)
    kept = "b/a" if replaced == "c/a" else "c/a"
    node.put(replaced, b"another node's", object_metadata(stat.S_IFREG | 0o640, 2, 2, MTIME))
    node.advance()
    node.ls("b"), node.ls("c")  # (each directory listed again)
    assert node.walk(replaced).ino != ino and node.walk(kept).ino == ino
    assert read_path(node, replaced) == b"another node's" and node.walk(replaced).uid == 2
    assert node.inode(kept).nlink == 1 and node.remote(kept).key == kept
    node.core.enable_space(SpaceLimits(cap=1 << 40, high=1 << 39, low=1 << 38, timeout=600.0, device_reserve=0))
    assert node.core.evict(ino)
    assert read_path(node, kept) == b"local content"
    node.drain()
    assert bucket_bytes(node) == {kept: b"local content", replaced: b"another node's"}
    node.advance()
    assert read_path(node, kept) == b"local content" and read_path(node, replaced) == b"another node's"
    assert node.problems() == []


@pytest.mark.parametrize("copied", ["c/a", "b/a"], ids=["second_link", "first_link"])
def test_a_copy_with_new_metadata_at_a_second_link_keeps_the_link(node, copied):
    """Another node's chmod of one name of a hard link (a copy with the same content) splits
    nothing."""
    ino = hard_linked_and_drained(node)
    data = (node.bucket_root / copied).read_bytes()
    node.put(copied, data, object_metadata(stat.S_IFREG | 0o600, USER.uid, USER.gid, MTIME,
                                           blake3=node.remote("b/a").blake3))
    directory = copied.split("/")[0]
    node.advance()
    node.ls(directory)
    assert node.walk(copied).ino == ino and node.inode("b/a").nlink == 2
    node.advance()
    node.ls(directory)
    assert node.walk(copied).ino == ino and node.problems() == []


def test_an_open_remote_file_unlinked_here_keeps_its_content_until_closed(node):
    """POSIX: an open file outlives its last name. Here its content is still the bucket's
    object (REMOTE: nothing fetched yet), so the drain must not delete that object while a
    handle is open (found by the churn test: the write after an unlink answered EIO)."""
    node.put("ckpt/shard", b"0123456789" * 1000)
    parent = node.walk("ckpt").ino
    ino = node.walk("ckpt/shard").ino
    reader = node.core.open(ino, os.O_RDONLY)
    writer = node.core.open(ino, os.O_RDWR)  # the writeback data path: no fetch at open
    node.core.unlink(parent, b"shard")
    node.drain()  # the object stays while the file is open
    assert node.bucket.head("ckpt/shard") is not None
    assert node.core.read(reader, 5, 10) == b"5678901234"
    assert node.core.write(writer, 0, b"new") == 3  # fetches what it does not overwrite
    assert node.core.read(reader, 0, 8) == b"new34567"
    node.core.release(reader)
    node.core.release(writer)
    node.core.forget([(ino, 1)])
    node.drain()  # the last close: now the object goes
    assert node.bucket.head("ckpt/shard") is None
    assert node.problems() == []

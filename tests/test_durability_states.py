"""fsmeta.durability: every state transition, in one place, as the gateway and the drain use them."""

from __future__ import annotations

import stat

import pytest

from ckptfs.fsmeta import ROOT_INO, FileState, Inode, MetaStore, RemoteRecord, durability, schema


@pytest.fixture
def meta(tmp_path):
    store = MetaStore(str(tmp_path / "meta"))
    yield store
    store.close()


def new_file(meta: MetaStore, name: bytes = b"f") -> int:
    def create(txn):
        inode = Inode(txn.alloc_ino(), stat.S_IFREG | 0o644, 0, 0, parent=ROOT_INO, generation=1)
        durability.mark_created(txn, inode, 100)
        txn.put_inode(inode)
        txn.add_entry(ROOT_INO, name, inode.ino)
        return inode.ino

    return meta.write(create)


def inode_of(meta: MetaStore, ino: int) -> Inode:
    with meta.read() as txn:
        return txn.get_inode(ino)


def label(meta: MetaStore, ino: int) -> str:
    with meta.read() as txn:
        return durability.state_label(txn, txn.get_inode(ino))


def write(meta: MetaStore, ino: int, now: int) -> None:
    """What the gateway does before the first write of an epoch."""

    def dirty(txn):
        inode = txn.get_inode(ino)
        durability.mark_dirty(txn, inode, now)
        txn.put_inode(inode)

    meta.write(dirty)


def upload(meta: MetaStore, ino: int) -> None:
    """What the drain does for a file: uploading, then durable, then off the queue."""
    generation = inode_of(meta, ino).generation
    meta.write(lambda txn: durability.mark_uploading(txn, ino, generation))

    def commit(txn):
        inode = txn.get_inode(ino)
        durability.mark_durable(txn, inode, generation, RemoteRecord("f", inode.size, "h", generation))
        durability.mark_settled(txn, ino)

    meta.write(commit)


def test_a_new_file_is_dirty_and_queued_until_the_drain_settles_it(meta):
    ino = new_file(meta)
    assert inode_of(meta, ino).state == FileState.DIRTY and label(meta, ino) == "dirty"
    upload(meta, ino)
    inode = inode_of(meta, ino)
    assert inode.state == FileState.DURABLE and inode.durable_generation == inode.generation
    assert label(meta, ino) == "durable"
    with meta.read() as txn:
        assert durability.is_durable(txn, ROOT_INO) and txn.get_remote(ino).key == "f"


def test_a_write_moves_the_generation_and_an_upload_of_the_old_one_is_superseded(meta):
    ino = new_file(meta)
    old = inode_of(meta, ino).generation
    meta.write(lambda txn: durability.mark_uploading(txn, ino, old))
    assert inode_of(meta, ino).state == FileState.UPLOADING

    write(meta, ino, 200)
    assert inode_of(meta, ino).generation == old + 1
    # The upload of the old generation may not make it durable, nor mark the new one uploading.
    meta.write(lambda txn: durability.mark_uploading(txn, ino, old))
    meta.write(lambda txn: durability.upload_superseded(txn, txn.get_inode(ino)))
    assert inode_of(meta, ino).state == FileState.DIRTY and label(meta, ino) == "dirty"


def test_a_permanent_error_shows_until_the_next_change(meta):
    ino = new_file(meta)
    meta.write(lambda txn: durability.mark_error(txn, ino, "AccessDenied"))
    assert label(meta, ino) == "error: AccessDenied"
    with meta.read() as txn:
        assert durability.remote_fsync_state(txn, ino) == "AccessDenied"

    write(meta, ino, 300)
    assert label(meta, ino) == "dirty"


def test_metadata_changes_and_moves_queue_a_durable_file_without_a_new_generation(meta):
    ino = new_file(meta)
    upload(meta, ino)
    generation = inode_of(meta, ino).generation

    def chmod(txn):
        inode = txn.get_inode(ino)
        durability.mark_meta_changed(txn, inode, 400)
        txn.put_inode(inode)

    meta.write(chmod)
    with meta.read() as txn:
        assert txn.get_pending(ino).reason == durability.META
    assert inode_of(meta, ino).generation == generation and label(meta, ino) == "dirty"
    upload(meta, ino)
    meta.write(lambda txn: durability.mark_moved(txn, ino, 500))
    with meta.read() as txn:
        assert txn.get_pending(ino).reason == durability.RENAME
        assert durability.pending_keys(txn) == {"f"}  # its name and its object's key


def test_content_gone_from_the_bucket_is_uploaded_again(meta):
    ino = new_file(meta)
    upload(meta, ino)
    meta.write(lambda txn: durability.mark_needs_upload(txn, txn.get_inode(ino), 600))
    inode = inode_of(meta, ino)
    assert inode.state == FileState.DIRTY and inode.durable_generation == 0
    with meta.read() as txn:
        assert txn.get_remote(ino) is None and txn.get_pending(ino).reason == durability.DATA


def test_the_read_path_states_remote_cached_clean_and_evicted(meta):
    ino = new_file(meta)
    upload(meta, ino)
    meta.write(lambda txn: durability.mark_evicted(txn, txn.get_inode(ino)))
    assert inode_of(meta, ino).state == FileState.REMOTE and label(meta, ino) == "remote"
    meta.write(lambda txn: durability.mark_cached_clean(txn, txn.get_inode(ino)))
    assert inode_of(meta, ino).state == FileState.CACHED_CLEAN and label(meta, ino) == "durable"

    other = new_file(meta, b"g")

    def known_from_bucket(txn):
        inode = txn.get_inode(other)
        durability.mark_remote(txn, inode, RemoteRecord("g", 0, "h", inode.generation))
        durability.mark_settled(txn, other)

    meta.write(known_from_bucket)
    assert inode_of(meta, other).state == FileState.REMOTE

    # A queued (not yet durable) file is never evicted: its cache file is the only copy.
    write(meta, ino, 700)
    meta.write(lambda txn: durability.mark_evicted(txn, txn.get_inode(ino)))
    assert inode_of(meta, ino).state == FileState.DIRTY


def test_a_queue_written_by_an_earlier_version_is_read_and_kept(meta):
    """fsmeta of an earlier version holds pending records as JSON: after an upgrade the drain
    still finds them, and the next change keeps when the file became pending."""
    ino = new_file(meta)
    key = schema.ino_key(ino)
    meta.write(lambda txn: txn.raw.put(
        key, b'{"since_ns":100,"changed_ns":150,"reason":"rename","urgent":false}', db=txn.dbs["pending"]))
    with meta.read() as txn:
        (found, rec), = list(txn.iter_pending())
    assert (found, rec.since_ns, rec.changed_ns, rec.reason, rec.urgent) == (ino, 100, 150, "rename", False)
    meta.write(lambda txn: durability.mark_written(txn, ino, 300))
    with meta.read() as txn:
        rec = txn.get_pending(ino)
        stored = bytes(txn.raw.get(key, db=txn.dbs["pending"]))
    assert (rec.since_ns, rec.changed_ns, rec.reason) == (100, 300, "data")
    assert not stored.startswith(b"{")  # rewritten in the current encoding

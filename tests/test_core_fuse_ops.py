"""The FUSE handlers (gateway/fuse_ops.py) without a mount: replies, error mapping, EIO for
unexpected exceptions. The front end calls these methods as they are called here."""

from __future__ import annotations

import errno
import logging
import os

import pytest
from ckptfs_fuse import OPEN_KEEP_CACHE, FuseError

from conftest import ROOT, ROOT_CALLER
from ckptfs.gateway import metrics
from ckptfs.gateway.fuse_ops import CkptOperations

CALLER = (1000, 1000, 0o022, 1)  # uid, gid, umask, pid as the front end passes them


def counter(metric, *labels) -> float:
    return metric.labels(*labels)._value.get()


def test_fs_error_becomes_its_errno_and_is_counted(core):
    ops = CkptOperations(core)
    before = counter(metrics.FUSE_ERRORS, "unlink", "ENOENT")
    with pytest.raises(FuseError) as exc:
        ops.unlink(ROOT, b"missing")
    assert exc.value.errno == errno.ENOENT
    assert counter(metrics.FUSE_ERRORS, "unlink", "ENOENT") == before + 1


def test_a_lookup_miss_is_a_negative_entry_the_kernel_may_keep(core):
    ops = CkptOperations(core)
    ino, entry_timeout = ops.lookup(ROOT, b"missing")
    assert ino == 0  # "no such name", cached by the kernel for entry_timeout
    assert entry_timeout == core.entry_timeout(ROOT) >= 1.0


def test_a_lookup_hit_is_an_entry_with_the_attributes(core):
    ops = CkptOperations(core)
    fh, attr = core.create(ROOT, b"f", 0o640, os.O_RDWR, ROOT_CALLER)
    core.write(fh, 0, b"12345")
    core.release(fh)
    (ino, entry_timeout, attr_timeout, mode, nlink, uid, gid, rdev, size, blksize, blocks,
     atime_ns, mtime_ns, ctime_ns) = ops.lookup(ROOT, b"f")
    assert (ino, mode & 0o7777, nlink, size, blocks) == (attr.ino, 0o640, 1, 5, 1)
    assert entry_timeout >= 1.0 and attr_timeout > 0 and blksize == 1 << 20
    assert mtime_ns == core.getattr(attr.ino).mtime_ns


def test_a_failing_entry_timeout_still_answers_with_the_minimum(core, monkeypatch, caplog):
    ops = CkptOperations(core)

    def boom(parent):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(core, "entry_timeout", boom)
    with caplog.at_level(logging.ERROR, logger="ckptfs.fuse"):
        assert ops.lookup(ROOT, b"missing") == (0, 1.0)  # the reply still goes out
    assert any("entry timeout" in r.getMessage() and r.exc_info for r in caplog.records)


def test_unexpected_exception_becomes_eio_log_and_counter(core, monkeypatch, caplog):
    ops = CkptOperations(core)

    def boom(*args):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(core, "getattr", boom)
    before = counter(metrics.FUSE_UNEXPECTED, "getattr")
    with caplog.at_level(logging.ERROR, logger="ckptfs.fuse"):
        with pytest.raises(FuseError) as exc:
            ops.getattr(ROOT)
    assert exc.value.errno == errno.EIO
    assert counter(metrics.FUSE_UNEXPECTED, "getattr") == before + 1
    assert any("failed unexpectedly" in r.getMessage() and r.exc_info for r in caplog.records)


def test_an_exception_past_the_handlers_is_logged_and_counted(core, caplog):
    """What the front end calls if a handler let something other than FuseError through."""
    ops = CkptOperations(core)
    before = counter(metrics.FUSE_UNEXPECTED, "lookup")
    with caplog.at_level(logging.ERROR, logger="ckptfs.fuse"):
        ops.unexpected("lookup", TypeError("an entry must be a tuple"))
    assert counter(metrics.FUSE_UNEXPECTED, "lookup") == before + 1
    assert any("failed unexpectedly" in r.getMessage() for r in caplog.records)


def test_cache_device_errors_pass_through(core, monkeypatch):
    ops = CkptOperations(core)
    fh, _ = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core, "write", full)
    with pytest.raises(FuseError) as exc:
        ops.write(fh, 0, memoryview(b"x"))
    assert exc.value.errno == errno.ENOSPC
    core.release(fh)


def test_a_write_takes_the_front_ends_buffer_without_keeping_it(core):
    ops = CkptOperations(core)
    fh, _ = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    buf = bytearray(b"abcdef")
    view = memoryview(buf)
    assert ops.write(fh, 0, view) == 6
    view.release()  # what the front end does after the call: fails if a view was kept
    buf[:] = b"XXXXXX"  # the front end reuses its buffer for the next request
    assert ops.read(fh, 0, 6) == b"abcdef"
    ops.release(fh)


def test_forget_errors_are_counted_not_raised_to_a_reply(core, monkeypatch):
    ops = CkptOperations(core)

    def boom(*args):
        raise KeyError("bug")

    monkeypatch.setattr(core, "forget", boom)
    before = counter(metrics.FUSE_UNEXPECTED, "forget")
    with pytest.raises(FuseError):  # the front end sends no reply to a FORGET whatever happens
        ops.forget([(ROOT, 1)])
    assert counter(metrics.FUSE_UNEXPECTED, "forget") == before + 1


def test_create_passes_the_caller_and_replies_with_handle_and_entry(core):
    ops = CkptOperations(core)
    fh, backing_id, flags, entry = ops.create(ROOT, b"f", 0o100666, os.O_WRONLY, *CALLER)
    assert (entry[5], entry[6], entry[3] & 0o777) == (1000, 1000, 0o644)  # uid, gid, mode & ~umask
    assert backing_id == 0 and flags == OPEN_KEEP_CACHE  # no passthrough in this core
    ops.release(fh)


def test_readdir_lists_entries_and_counts_the_ones_the_kernel_took(core):
    ops = CkptOperations(core)
    for name in (b"a", b"b"):
        fh, _ = core.create(ROOT, name, 0o644, os.O_WRONLY, ROOT_CALLER)
        core.release(fh)
    dh = ops.opendir(ROOT)
    entries = ops.readdir(dh, 0)
    assert [(name, nxt) for name, _, nxt in entries] == [(b"a", 1), (b"b", 2)]
    ino_a = entries[0][1][0]
    ops.readdir_taken(dh, [ino_a])
    # The kernel now holds one reference to "a" (as from a lookup): forgetting it is allowed.
    ops.forget([(ino_a, 1)])
    ops.releasedir(dh)


def test_listxattr_is_the_names_nul_terminated(core):
    ops = CkptOperations(core)
    fh, attr = core.create(ROOT, b"f", 0o644, os.O_WRONLY, ROOT_CALLER)
    core.release(fh)
    ops.setxattr(attr.ino, b"user.a", b"1", 0)
    ops.setxattr(attr.ino, b"user.b", b"2", 0)
    assert set(ops.listxattr(attr.ino).split(b"\0")[:-1]) >= {b"user.a", b"user.b"}
    assert ops.listxattr(attr.ino).endswith(b"\0")


def test_a_failing_fsync_remote_hook_answers_eio(core):
    """The --fsync=remote wait runs after the local fsync; a bug there is one EIO."""

    def broken_hook(core, fh):
        raise RuntimeError("simulated bug in the remote wait")

    ops = CkptOperations(core, fsync_hook=broken_hook)
    fh, _ = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    before = counter(metrics.FUSE_UNEXPECTED, "fsync")
    with pytest.raises(FuseError) as exc:
        ops.fsync(fh, False)
    assert exc.value.errno == errno.EIO
    assert counter(metrics.FUSE_UNEXPECTED, "fsync") == before + 1
    core.release(fh)

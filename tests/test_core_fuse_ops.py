"""The pyfuse3 layer without a mount: error mapping, EIO for unexpected exceptions."""

from __future__ import annotations

import errno
import logging
import os

import pyfuse3
import pytest
import trio

from conftest import ROOT, ROOT_CALLER
from ckptfs.gateway import metrics
from ckptfs.gateway.fuse_ops import CkptOperations


class Ctx:
    uid = 1000
    gid = 1000
    umask = 0o022
    pid = 1


def run(fn, *args):
    return trio.run(fn, *args)


def counter(metric, *labels) -> float:
    return metric.labels(*labels)._value.get()


def test_fs_error_becomes_its_errno_and_is_counted(core):
    ops = CkptOperations(core)
    before = counter(metrics.FUSE_ERRORS, "unlink", "ENOENT")
    with pytest.raises(pyfuse3.FUSEError) as exc:
        run(ops.unlink, ROOT, b"missing", Ctx())
    assert exc.value.errno == errno.ENOENT
    assert counter(metrics.FUSE_ERRORS, "unlink", "ENOENT") == before + 1


def test_a_lookup_miss_is_a_negative_entry_the_kernel_may_keep(core):
    ops = CkptOperations(core)
    before = counter(metrics.FUSE_ERRORS, "lookup", "ENOENT")
    entry = run(ops.lookup, ROOT, b"missing", Ctx())
    assert entry.st_ino == 0  # "no such name", cached by the kernel for entry_timeout
    assert entry.entry_timeout == core.entry_timeout(ROOT) >= 1.0
    assert counter(metrics.FUSE_ERRORS, "lookup", "ENOENT") == before + 1


def test_a_failing_entry_timeout_still_answers_with_the_minimum(core, monkeypatch, caplog):
    ops = CkptOperations(core)

    def boom(parent):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(core, "entry_timeout", boom)
    with caplog.at_level(logging.ERROR, logger="ckptfs.fuse"):
        entry = run(ops.lookup, ROOT, b"missing", Ctx())
    assert entry.st_ino == 0 and entry.entry_timeout == 1.0  # the reply still goes out
    assert any("entry timeout" in r.getMessage() and r.exc_info for r in caplog.records)


def test_unexpected_exception_becomes_eio_log_and_counter(core, monkeypatch, caplog):
    ops = CkptOperations(core)

    def boom(*args):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(core, "getattr", boom)
    monkeypatch.setattr(core, "getattr_nowait", boom)  # answered on the trio loop
    before = counter(metrics.FUSE_UNEXPECTED, "getattr")
    with caplog.at_level(logging.ERROR, logger="ckptfs.fuse"):
        with pytest.raises(pyfuse3.FUSEError) as exc:
            run(ops.getattr, ROOT, Ctx())
    assert exc.value.errno == errno.EIO
    assert counter(metrics.FUSE_UNEXPECTED, "getattr") == before + 1
    assert any("failed unexpectedly" in r.getMessage() and r.exc_info for r in caplog.records)


def test_cache_device_errors_pass_through(core, monkeypatch):
    ops = CkptOperations(core)
    fh, _ = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core, "write", full)
    with pytest.raises(pyfuse3.FUSEError) as exc:
        run(ops.write, fh, 0, b"x")
    assert exc.value.errno == errno.ENOSPC
    core.release(fh)


def test_forget_never_raises(core, monkeypatch):
    ops = CkptOperations(core)

    def boom(*args):
        raise KeyError("bug")

    monkeypatch.setattr(core, "forget", boom)
    monkeypatch.setattr(core, "forget_nowait", boom)
    run(ops.forget, [(ROOT, 1)])  # forget has no reply: logged and counted only


def test_create_passes_the_caller(core):
    ops = CkptOperations(core)
    info, entry = run(ops.create, ROOT, b"f", 0o666, os.O_WRONLY, Ctx())
    assert (entry.st_uid, entry.st_gid, entry.st_mode & 0o777) == (1000, 1000, 0o644)
    run(ops.release, info.fh)



def test_a_failing_fsync_remote_hook_answers_eio_and_the_loop_survives(core):
    """The --fsync=remote wait runs after the local fsync; a bug there must not end pyfuse3.main()."""

    async def broken_hook(core, fh):
        raise RuntimeError("simulated bug in the remote wait")

    ops = CkptOperations(core, fsync_hook=broken_hook)
    fh, _ = core.create(ROOT, b"f", 0o644, os.O_RDWR, ROOT_CALLER)
    before = counter(metrics.FUSE_UNEXPECTED, "fsync")
    with pytest.raises(pyfuse3.FUSEError) as exc:
        run(ops.fsync, fh, False)
    assert exc.value.errno == errno.EIO
    assert counter(metrics.FUSE_UNEXPECTED, "fsync") == before + 1
    core.release(fh)


def test_every_request_is_timed_by_operation(core):
    ops = CkptOperations(core)
    run(ops.getattr, ROOT, Ctx())
    samples = {s.name: s.value for s in metrics.FUSE_SECONDS.collect()[0].samples
               if s.labels.get("op") == "getattr"}
    assert samples["ckptfs_fuse_request_duration_seconds_count"] >= 1

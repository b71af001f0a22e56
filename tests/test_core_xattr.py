"""Extended attributes in the core: user.* only, user.ckptfs.* read-only state."""

from __future__ import annotations

import errno
import os

from conftest import ROOT, ROOT_CALLER, fs_errno as err
from ckptfs.gateway.core import XATTR_CREATE, XATTR_REPLACE


def mk(core, name=b"f"):
    fh, attr = core.create(ROOT, name, 0o644, os.O_WRONLY, ROOT_CALLER)
    core.release(fh)
    return attr.ino


def test_user_xattrs_set_get_list_remove(core):
    ino = mk(core)
    core.setxattr(ino, b"user.a", b"1")
    core.setxattr(ino, b"user.b", b"\x00binary\xff")
    core.setxattr(ino, b"user.a", b"2")  # replace
    assert core.getxattr(ino, b"user.a") == b"2"
    assert core.getxattr(ino, b"user.b") == b"\x00binary\xff"
    assert sorted(core.listxattr(ino)) == [b"user.a", b"user.b"]
    core.removexattr(ino, b"user.a")
    assert err(core.getxattr, ino, b"user.a") == errno.ENODATA
    assert err(core.removexattr, ino, b"user.a") == errno.ENODATA
    assert core.listxattr(ino) == [b"user.b"]
    d = core.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    core.setxattr(d.ino, b"user.dir", b"yes")
    assert core.getxattr(d.ino, b"user.dir") == b"yes"


def test_only_user_namespace(core):
    ino = mk(core)
    for name in (b"trusted.x", b"security.x", b"system.x", b"other"):
        assert err(core.setxattr, ino, name, b"v") == errno.ENOTSUP
        assert err(core.getxattr, ino, name) == errno.ENODATA


def test_ckptfs_state_attributes_are_read_only(core):
    ino = mk(core)
    assert core.getxattr(ino, b"user.ckptfs.state") == b"dirty"
    assert core.getxattr(ROOT, b"user.ckptfs.state") == b"dirty"  # something below is dirty
    assert err(core.getxattr, ino, b"user.ckptfs.blake3") == errno.ENODATA  # not durable yet
    assert err(core.setxattr, ino, b"user.ckptfs.state", b"durable") == errno.EPERM
    assert err(core.setxattr, ino, b"user.ckptfs.anything", b"x") == errno.EPERM
    assert err(core.removexattr, ino, b"user.ckptfs.state") == errno.EPERM
    assert b"user.ckptfs.state" not in core.listxattr(ino)


def test_create_and_replace_flags(core):
    ino = mk(core)
    core.setxattr(ino, b"user.k", b"1", XATTR_CREATE)
    assert err(core.setxattr, ino, b"user.k", b"2", XATTR_CREATE) == errno.EEXIST
    core.setxattr(ino, b"user.k", b"3", XATTR_REPLACE)
    assert err(core.setxattr, ino, b"user.missing", b"2", XATTR_REPLACE) == errno.ENODATA
    assert core.getxattr(ino, b"user.k") == b"3"


def test_size_limits(core):
    ino = mk(core)
    core.setxattr(ino, b"user.big", b"v" * 65536)
    assert err(core.setxattr, ino, b"user.big", b"v" * 65537) == errno.E2BIG
    assert err(core.setxattr, ino, b"user." + b"n" * 251, b"v") == errno.ERANGE


def test_xattrs_go_with_the_inode(core):
    ino = mk(core)
    core.setxattr(ino, b"user.k", b"v")
    core.rename(ROOT, b"f", ROOT, b"g")
    assert core.getxattr(core.lookup(ROOT, b"g").ino, b"user.k") == b"v"
    core.unlink(ROOT, b"g")
    core.forget([(ino, 2)])
    with core.meta.read() as txn:
        assert txn.list_xattrs(ino) == []  # purged with the inode

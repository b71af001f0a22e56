"""Ownership and permissions on the mount: a non-root training process owns what it writes.

The gateway runs as root with allow_other + default_permissions; the writers here
run as uid/gid 1000 (setpriv, no supplementary groups).
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from conftest import needs_fuse, run_as

pytestmark = [needs_fuse, pytest.mark.mounted]

UID = GID = 1000


def as_user(code: str, umask: int = 0o022) -> dict:
    r = run_as(UID, GID, code + "\nprint(json.dumps(out))", umask=umask)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


PRELUDE = """
import json
out = {}
def errno_of(fn, *a):
    try:
        fn(*a)
    except OSError as e:
        return errno.errorcode[e.errno]
    return None
"""


def test_mount_is_open_to_other_users(shared_gateway):
    opts = next(line.split()[3] for line in open("/proc/mounts") if line.split()[1] == str(shared_gateway.mnt))
    assert "allow_other" in opts.split(",") and "default_permissions" in opts.split(",")


def test_non_root_writer_owns_what_it_writes(mnt):
    out = as_user(PRELUDE + f"""
d = {str(mnt)!r}
with open(d + "/shard.pt", "wb") as f:
    f.write(b"weights")
os.mkdir(d + "/step_1")
fd = os.open(d + "/step_1/opt.pt", os.O_CREAT | os.O_WRONLY, 0o666)
os.write(fd, b"state")
os.fsync(fd)
os.close(fd)
os.symlink("step_1", d + "/latest")
os.rename(d + "/shard.pt", d + "/step_1/shard.pt")
os.chmod(d + "/step_1/opt.pt", 0o600)
os.utime(d + "/step_1/opt.pt", ns=(1, 2))
os.setxattr(d + "/step_1/opt.pt", "user.owner", b"me")
out["ok"] = True
""")
    assert out["ok"]
    for rel, mode in (("step_1/shard.pt", 0o644), ("step_1", 0o755), ("step_1/opt.pt", 0o600)):
        st = os.lstat(mnt / rel)
        assert (st.st_uid, st.st_gid) == (UID, GID), rel
        assert stat.S_IMODE(st.st_mode) == mode, rel
    st = os.lstat(mnt / "latest")
    assert (st.st_uid, st.st_gid) == (UID, GID)
    assert (mnt / "step_1" / "opt.pt").read_bytes() == b"state"


def test_umask_of_the_caller_applies(mnt):
    as_user(f"""
out = {{}}
open({str(mnt / 'private')!r}, "w").close()
os.mkdir({str(mnt / 'pdir')!r})
""", umask=0o077)
    assert stat.S_IMODE(os.stat(mnt / "private").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(mnt / "pdir").st_mode) == 0o700


def test_non_owner_gets_eacces(mnt):
    (mnt / "root_file").write_bytes(b"root data")
    os.chmod(mnt / "root_file", 0o644)
    (mnt / "root_dir").mkdir(mode=0o755)
    (mnt / "root_dir" / "inside").write_bytes(b"")
    out = as_user(PRELUDE + f"""
d = {str(mnt)!r}
out["write"] = errno_of(os.open, d + "/root_file", os.O_WRONLY)
out["trunc"] = errno_of(os.truncate, d + "/root_file", 0)
out["read"] = open(d + "/root_file", "rb").read().decode()
out["create_in_root_dir"] = errno_of(os.open, d + "/root_dir/mine", os.O_CREAT | os.O_WRONLY, 0o644)
out["unlink_in_root_dir"] = errno_of(os.unlink, d + "/root_dir/inside")
out["rename_out_of_root_dir"] = errno_of(os.rename, d + "/root_dir/inside", d + "/stolen")
out["chmod"] = errno_of(os.chmod, d + "/root_file", 0o666)
out["chown"] = errno_of(os.chown, d + "/root_file", {UID}, {GID})
out["utime"] = errno_of(lambda: os.utime(d + "/root_file", ns=(1, 1)))
out["setxattr"] = errno_of(os.setxattr, d + "/root_file", "user.x", b"1")
""")
    assert out == {
        "write": "EACCES",
        "trunc": "EACCES",
        "read": "root data",
        "create_in_root_dir": "EACCES",
        "unlink_in_root_dir": "EACCES",
        "rename_out_of_root_dir": "EACCES",
        "chmod": "EPERM",
        "chown": "EPERM",
        "utime": "EPERM",
        "setxattr": "EACCES",
    }
    assert (mnt / "root_file").read_bytes() == b"root data"
    assert (mnt / "root_dir" / "inside").exists()


def test_group_permission_lets_group_members_write(mnt):
    p = mnt / "group_file"
    p.write_bytes(b"")
    os.chown(p, 0, GID)
    os.chmod(p, 0o660)
    out = as_user(PRELUDE + f"""
with open({str(p)!r}, "ab") as f:
    f.write(b"by group member")
out["ok"] = True
""")
    assert out["ok"] and p.read_bytes() == b"by group member"
    os.chmod(p, 0o600)
    out = as_user(PRELUDE + f"""
out["err"] = errno_of(open, {str(p)!r}, "rb")
""")
    assert out["err"] == "EACCES"

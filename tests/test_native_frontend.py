"""The FUSE front end's own defects, each on a real mount of the tiny file system of
tests/test_passthrough_native.py (``PtFS``, no gateway code):

- WRITE data that a handler keeps past its request (a slice, ``memoryview()`` of it) keeps the
  request's bytes: it never shows another request's data;
- ``exit()`` before ``run()`` (a SIGTERM while the mount is being set up) unmounts cleanly;
- an io_uring queue thread that dies ends the session visibly instead of leaving the requests
  of its CPU without an answer;
- a reply that does not reach the kernel (the connection aborted) hands back the lookup
  references its handler counted (create, readdirplus);
- a session in a reference cycle with its ops object is freed (and unmounted) by the garbage
  collector, and the front end keeps no state of a session in function-level statics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import in_mount_table, lazy_unmount
from test_mount_io_uring import io_uring_enabled  # noqa: F401  (a fixture)
from test_passthrough_native import CTL, mounted, stats

pytestmark = pytest.mark.mounted

REPO = Path(__file__).resolve().parents[1]
SERVE = Path(__file__).resolve().parent / "test_passthrough_native.py"


def poll(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return v


def wait_for_rings(mnt: Path) -> dict:
    """Until requests come through the io_uring queues (the kernel switches to them once every
    CPU's queue has an entry, a little after the front end set them up)."""
    return poll(lambda: (s := stats(mnt))["io_uring_requests"] > 0 and s, 10, "requests from the io_uring queues")


def daemon_log(base: Path, mode: str) -> str:
    return (base / f"daemon-{mode}.log").read_text(errors="replace")


def refs_at_exit(base: Path, mode: str) -> dict:
    lines = [ln for ln in daemon_log(base, mode).splitlines() if ln.startswith("REFS ")]
    assert lines, daemon_log(base, mode)[-3000:]
    return json.loads(lines[-1][5:])


# -- WRITE data kept past its request ---------------------------------------------------------


def test_write_data_kept_past_the_request_keeps_its_own_bytes(tmp_path):
    # One /dev/fuse thread: every request is read into the same buffer, so a kept view of the
    # first write would show the second one's bytes if it still pointed into that buffer.
    _write_data_kept(tmp_path, "plain+1thread")


def test_write_data_kept_past_a_request_from_an_io_uring_queue(tmp_path, io_uring_enabled):  # noqa: F811
    # (the payload buffer of a ring entry is refilled by the kernel with the next request)
    _write_data_kept(tmp_path, "plain+uring")


def _write_data_kept(tmp_path: Path, mode: str) -> None:
    with mounted(tmp_path, mode) as (mnt, back):
        if "uring" in mode:
            wait_for_rings(mnt)
        os.setxattr(mnt, "user.keep_views", b"1")
        first = b"A" * 5000 + b"yz"
        with open(mnt / "f1", "wb", buffering=0) as f:
            assert f.write(first) == len(first)
        os.setxattr(mnt, "user.keep_views", b"0")
        with open(mnt / "f2", "wb", buffering=0) as f:
            f.write(b"B" * 5002)
        kept = os.getxattr(mnt, "user.kept")
        assert kept == first[:3] + first + first[-2:]
        assert (back / "f1").read_bytes() == first and (back / "f2").read_bytes() == b"B" * 5002
        # and the mount goes on serving writes into fresh buffers
        (mnt / "f3").write_bytes(b"C" * 70000)
        assert (mnt / "f3").read_bytes() == b"C" * 70000
        assert os.getxattr(mnt, "user.kept") == kept


# -- exit() before run() ----------------------------------------------------------------------


def test_exit_before_run_unmounts_cleanly(tmp_path):
    mnt, back = tmp_path / "mnt", tmp_path / "back"
    mnt.mkdir()
    back.mkdir()
    proc = subprocess.run([sys.executable, str(SERVE), "serve", str(mnt), str(back), "plain+exit-before-run"],
                          capture_output=True, text=True, timeout=60)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Error" not in proc.stderr, proc.stderr[-3000:]
        assert not in_mount_table(mnt)
    finally:
        lazy_unmount(mnt)


# -- io_uring queue threads that die -----------------------------------------------------------


def test_an_io_uring_thread_that_dies_ends_the_session_visibly(tmp_path, io_uring_enabled):  # noqa: F811
    mode = "plain+uring"
    with mounted(tmp_path, mode) as (mnt, back):
        assert wait_for_rings(mnt)["io_uring_active"]
        daemon = next(p for p in _children() if "serve" in p[1] and str(mnt) in p[1])[0]
        # Every ring stops working; the request that asks for it is served by a ring thread,
        # whose reply cannot go out. (Its caller waits until the connection ends: a child.)
        caller = subprocess.Popen([sys.executable, "-c",
                                   f"import os; os.setxattr({str(mnt)!r}, 'user.break_rings', b'1')"],
                                  stderr=subprocess.PIPE)
        try:
            poll(lambda: not _alive(daemon), 20, "the daemon to end")
            log = daemon_log(tmp_path, mode)
            assert "io_uring queue thread ended" in log, log[-3000:]
            assert not in_mount_table(mnt)
            caller.wait(timeout=20)  # answered (with an error) once the session ended
        finally:
            if caller.poll() is None:
                caller.kill()


def _children() -> list[tuple[int, str]]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if ppid == os.getpid():
                out.append((int(pid), cmd))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- references of replies that do not reach the kernel ----------------------------------------


def _abort_while_blocked(mnt: Path, back: Path, op: str, syscall) -> None:
    """Run syscall in a thread while the test file system holds its `op` request; abort the
    connection (umount -f) meanwhile; then let the handler finish: its reply cannot go out."""
    os.setxattr(mnt, "user.block_next", op.encode())
    t = threading.Thread(target=lambda: _ignore_oserror(syscall))
    t.start()
    poll(lambda: (back / (CTL + "blocked")).exists(), 10, f"the {op} request to be held")
    subprocess.run(["umount", "-f", str(mnt)], capture_output=True)  # aborts the connection
    t.join(20)
    assert not t.is_alive()
    (back / (CTL + "go")).touch()


def _ignore_oserror(fn) -> None:
    try:
        fn()
    except OSError:
        pass


def test_a_create_whose_reply_fails_hands_back_its_lookup_reference(tmp_path):
    mode = "plain"
    with mounted(tmp_path, mode) as (mnt, back):
        _abort_while_blocked(mnt, back, "create", lambda: open(mnt / "new", "wb").close())
    refs = refs_at_exit(tmp_path, mode)
    assert "new" in refs and refs["new"] == 0, refs


def test_readdirplus_whose_reply_fails_hands_back_its_lookup_references(tmp_path):
    mode = "plain"
    with mounted(tmp_path, mode) as (mnt, back):
        for name in ("a", "b", "c"):
            (back / name).write_bytes(b"x")  # not yet known to the kernel
        _abort_while_blocked(mnt, back, "readdir", lambda: os.listdir(mnt))
    refs = refs_at_exit(tmp_path, mode)
    assert {k: refs.get(k) for k in "abc"} == {"a": 0, "b": 0, "c": 0}, refs


# -- the Session object ------------------------------------------------------------------------


def test_a_session_in_a_cycle_with_its_ops_is_collected_and_unmounted(tmp_path):
    # As in gateway/mount.py: the ops object's callbacks close over the session.
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = textwrap.dedent(f"""
        import gc, os, sys
        import ckptfs_fuse

        class Ops:
            def getattr(self, ino):
                raise ckptfs_fuse.FuseError(38)

        def mount():
            ops = Ops()
            session = ckptfs_fuse.Session(ops, {str(mnt)!r}, ["fsname=ckptfs-gc-test"])
            ops.on_init = lambda: session.passthrough_granted  # ops -> closure -> session
            return sum(1 for l in open("/proc/self/mounts") if l.split()[1] == {str(mnt)!r})

        assert mount() == 1
        gc.collect()
        print(sum(1 for l in open("/proc/self/mounts") if l.split()[1] == {str(mnt)!r}))
    """)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip() == "0", "the session was not freed: still mounted"
    finally:
        lazy_unmount(mnt)


def test_no_session_state_in_function_level_statics():
    # Two sessions in one process (a test, a restart in-process) must not share state: a
    # function-level static in the front end is shared by all of them. Constant tables are fine.
    offenders = []
    for path in sorted((REPO / "native").glob("*.c")):
        # comments and literals out, line breaks kept
        text = re.sub(r'/\*.*?\*/|//[^\n]*|"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])*\'',
                      lambda m: "\n" * m.group(0).count("\n"), path.read_text(), flags=re.S)
        depth = 0
        for no, line in enumerate(text.splitlines(), 1):
            if depth > 0 and re.match(r"\s*static\b(?!.*\bconst\b)", line):
                offenders.append(f"{path.name}:{no}: {line.strip()}")
            depth += line.count("{") - line.count("}")
    assert not offenders, "\n".join(offenders)

"""The cache directory's process locks: who holds them, and no false "in use"."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from ckptfs.fsmeta import locks


def test_holder_names_the_live_holder_and_nobody_after_release(tmp_path):
    path = str(tmp_path / "gateway.lock")
    assert locks.holder(path) is None
    fd = locks.acquire(path)
    assert locks.holder(path) == os.getpid()
    os.close(fd)
    assert locks.holder(path) is None


def test_holder_in_another_process(tmp_path):
    path = str(tmp_path / "drain.lock")
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from ckptfs.fsmeta import locks\n"
        f"locks.acquire({path!r})\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert locks.holder(path) == child.pid
        with pytest.raises(locks.LockHeld) as exc:
            locks.acquire(path)
        assert exc.value.holder == str(child.pid)
    finally:
        child.kill()
        child.wait()
    assert locks.holder(path) is None  # the kernel drops a dead process's flock
    os.close(locks.acquire(path))


def test_asking_who_holds_a_lock_never_makes_taking_it_fail(tmp_path):
    """status and the drain ask holder() every 100 ms: that must not refuse a mount."""
    path = str(tmp_path / "gateway.lock")
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            locks.holder(path)

    probes = [threading.Thread(target=probe) for _ in range(2)]
    for t in probes:
        t.start()
    try:
        for _ in range(300):
            os.close(locks.acquire(path))
    finally:
        stop.set()
        for t in probes:
            t.join()

"""The gateway's drain supervisor without FUSE: crash-loop detection, the back-off, the last
error line of a crashing drain (credentials redacted), and the health it publishes, with
real child processes that crash."""

from __future__ import annotations

import subprocess
import sys

import trio

from ckptfs.cli.status import drain_health
from ckptfs.drain.upload import Backoff
from ckptfs.fsmeta.settings import Settings
from ckptfs.gateway import metrics
from ckptfs.gateway.supervisor import (CrashLoopPolicy, DrainSupervisor, RestartTracker, describe_exit,
                                       last_error_line, redact)

NS = 1_000_000_000


def exits(tracker: RestartTracker, times: list[float], ran_seconds: float = 1.0) -> list[float]:
    return [tracker.exited(now=t, now_ns=int(t * NS), ran_seconds=ran_seconds) for t in times]


def test_three_exits_within_a_minute_are_a_crash_loop_since_the_first_of_them():
    tracker = RestartTracker()
    exits(tracker, [0.0, 10.0])
    assert not tracker.crash_looping
    exits(tracker, [50.0])
    assert tracker.crash_looping and tracker.looping_since_ns == 0
    assert tracker.restarts == 3 and tracker.recent_exits(50.0) == 3


def test_exits_spread_wider_than_the_window_are_no_crash_loop():
    tracker = RestartTracker()
    exits(tracker, [0.0, 40.0, 80.0, 120.0])  # never 3 within 60 s
    assert not tracker.crash_looping and tracker.restarts == 4


def test_the_back_off_grows_while_it_crashes_and_a_stable_run_ends_loop_and_back_off():
    tracker = RestartTracker(backoff=Backoff(1.0, 8.0))
    assert exits(tracker, [0.0, 1.0, 3.0, 7.0, 15.0]) == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert tracker.crash_looping
    assert not tracker.running(ran_seconds=59.0)  # up, but not long enough yet
    assert tracker.crash_looping
    assert tracker.running(ran_seconds=60.0)
    assert not tracker.crash_looping and tracker.looping_since_ns is None
    # the next exit starts the back-off again and is not a loop on its own
    assert exits(tracker, [200.0], ran_seconds=120.0) == [1.0]
    assert not tracker.crash_looping and tracker.restarts == 6


def test_the_last_error_is_the_line_that_says_why():
    traceback = ["2026-01-01 ckptfs[7] INFO ckptfs.drain: drain started\n",
                 "Traceback (most recent call last):\n", '  File "x.py", line 1, in <module>\n',
                 "lmdb.BadValsizeError: mdb_put: MDB_BAD_VALSIZE: Unsupported size of key/DB name/data\n"]
    assert last_error_line(traceback) == "lmdb.BadValsizeError: mdb_put: MDB_BAD_VALSIZE: Unsupported size of key/DB name/data"
    assert last_error_line(["ckptfs: cache directory /c: cannot open /c/drain.lock: Is a directory\n"]) \
        == "ckptfs: cache directory /c: cannot open /c/drain.lock: Is a directory"
    assert last_error_line(["2026-01-01 ckptfs[7] ERROR ckptfs.drain: upload failed: SlowDown\n",
                            "2026-01-01 ckptfs[7] INFO ckptfs.drain: uploaded a\n"]) \
        == "2026-01-01 ckptfs[7] ERROR ckptfs.drain: upload failed: SlowDown"
    assert last_error_line(["2026-01-01 ckptfs[7] INFO ckptfs.drain: uploaded a\n"]) is None
    assert last_error_line(["Fatal Python error: Segmentation fault\n", "\n", "Current thread 0x1:\n",
                            '  File "x.py", line 1\n']) == "Fatal Python error: Segmentation fault"
    assert len(last_error_line(["ckptfs: " + "x" * 5000])) <= 500


def test_credentials_never_reach_the_last_error():
    env = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLE"}
    line = ("botocore.exceptions.ClientError: bad request with key wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY token "
            "FwoGZXIvYXdzEXAMPLE at http://admin:hunter2@rgw:7480/b?X-Amz-Signature=abcdef&X-Amz-Credential=AKIA/1 "
            "aws_secret_access_key=s3cr3t password: pw0rd")
    clean = redact(line, env)
    for secret in ("wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "FwoGZXIvYXdzEXAMPLE", "hunter2", "abcdef", "AKIA/1",
                   "s3cr3t", "pw0rd"):
        assert secret not in clean, (secret, clean)
    assert clean.startswith("botocore.exceptions.ClientError: bad request") and "rgw:7480" in clean


def test_exit_descriptions():
    assert describe_exit(1) == "exited 1"
    assert describe_exit(-9) == "killed by SIGKILL"


# Like the drain: the error comes out of a trio nursery, so its traceback is an exception group's.
CRASHING_DRAIN = [sys.executable, "-c", """
import sys, trio
print('starting', file=sys.stderr)
async def start():
    raise RuntimeError('drain cannot start: broken setting')
async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start)
trio.run(main)
"""]


def test_a_drain_that_crashes_at_every_start_is_reported_crash_looping_and_restarted(tmp_path, capfd):
    published: list[dict] = []
    supervisor = DrainSupervisor(
        Settings(bucket_url=f"file://{tmp_path}/bucket", cache_dir=str(tmp_path / "cache")),
        publish=published.append, command=CRASHING_DRAIN, poll_seconds=0.05,
        tracker=RestartTracker(CrashLoopPolicy(exits=3, window_seconds=60.0), Backoff(0.05, 0.2)))
    restarts_before = metrics.DRAIN_RESTARTS._value.get()

    async def main() -> None:
        supervisor.start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.watch)
            with trio.fail_after(60):
                while not published or published[-1]["state"] != "crash-looping":
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        supervisor.stop()
        crash_looping = metrics.DRAIN_CRASH_LOOPING._value.get()
        metrics.DRAIN_CRASH_LOOPING.set(0)  # the registry is this process's: leave it as found
    health = published[-1]
    assert health["restarts"] >= 3 and health["crash_looping_since_ns"]
    assert health["last_exit"] == "exited 1"
    assert health["last_error"] == "RuntimeError: drain cannot start: broken setting"
    assert [h["state"] for h in published][0] in ("running", "starting")
    assert "down" in [h["state"] for h in published]  # before the third exit: down, restarting
    assert crash_looping == 1
    assert metrics.DRAIN_RESTARTS._value.get() - restarts_before >= 3
    # the drain's own output still reaches the log (our stderr), every time it ran
    log = capfd.readouterr().err
    assert "ExceptionGroup" in log and log.count("RuntimeError: drain cannot start: broken setting") >= 3


# -- what `ckptfs status` makes of it ----------------------------------------------------------

def gateway_record(gateway_pid: int, **drain) -> dict:
    return {"pid": gateway_pid, "drain": {"state": "running", "pid": None, "restarts": 0, "last_exit": None,
                                  "last_error": None, "restart_at_ns": None, "crash_looping_since_ns": None,
                                  **drain}}


def test_status_never_shows_a_drain_that_is_down_as_blank():
    now = 1_700_000_000 * NS
    assert drain_health({}, None, None, now)["summary"] == "not running (no gateway)"
    alone = drain_health({}, None, 4321, now)
    assert alone["state"] == "running" and "without a gateway" in alone["summary"]

    down = drain_health(gateway_record(100, state="down", restarts=1, last_exit="exited 1",
                                       last_error="ckptfs: broken", restart_at_ns=now + 4 * NS), 100, None, now)
    assert down["state"] == "down" and down["restart_in_seconds"] == 4.0
    assert down["summary"] == "down (exited 1, restarting in 4s); last error: ckptfs: broken"

    looping = drain_health(gateway_record(100, state="crash-looping", restarts=5, last_exit="killed by SIGSEGV",
                                          crash_looping_since_ns=now - 120 * NS, restart_at_ns=now + 30 * NS),
                           100, None, now)
    assert looping["state"] == "crash-looping" and looping["crash_looping_since"] == "2023-11-14T22:11:20+00:00"
    assert looping["summary"].startswith("crash-looping since 2023-11-14 22:11:20 UTC (2m ago), 5 restarts; "
                                         "restarting in 30s; last exit: killed by SIGSEGV")

    # The supervisor said running, but that process is gone and nobody holds drain.lock: down.
    no_such_pid = int(open("/proc/sys/kernel/pid_max").read()) + 1
    gone = drain_health(gateway_record(100, pid=no_such_pid), 100, None, now)
    assert gone["state"] == "down" and gone["pid"] is None and gone["summary"].startswith("down (exited")

    # A record left by a gateway that is no longer running is not believed.
    stale = drain_health(gateway_record(100, state="crash-looping", crash_looping_since_ns=now), None, None, now)
    assert stale["summary"] == "not running (no gateway)"


def test_a_drain_whose_gateway_is_gone_writes_its_log_to_the_cache_directory(tmp_path):
    """Its stderr was the pipe the gateway read: the rest goes to CACHE/gateway.log instead."""
    code = ("import sys; from ckptfs.drain.process import log_to_cache_dir_if_stderr_is_a_pipe as f; "
            f"f({str(tmp_path)!r}); print('after the gateway', file=sys.stderr)")
    through_a_pipe = subprocess.run([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, timeout=60)
    assert through_a_pipe.returncode == 0 and through_a_pipe.stderr == ""
    assert (tmp_path / "gateway.log").read_text() == "after the gateway\n"
    (tmp_path / "gateway.log").unlink()
    with open(tmp_path / "own.log", "w") as own:  # a drain run by hand keeps its own stderr
        subprocess.run([sys.executable, "-c", code], stderr=own, timeout=60, check=True)
    assert (tmp_path / "own.log").read_text() == "after the gateway\n"
    assert not (tmp_path / "gateway.log").exists()

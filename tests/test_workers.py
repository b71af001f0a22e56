"""The FUSE handlers' worker threads (gateway/workers.py): what trio.to_thread gave them."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from ckptfs.gateway.workers import Workers


def test_a_job_returns_its_value_or_raises_its_exception_in_the_caller():
    async def main():
        workers = Workers()
        assert await workers.run(divmod, 7, 2) == (3, 1)
        with pytest.raises(ZeroDivisionError):
            await workers.run(divmod, 1, 0)
        assert await workers.run(threading.get_ident) != threading.get_ident()  # not the loop's thread

    trio.run(main)


def test_jobs_run_side_by_side_up_to_the_thread_limit_and_the_rest_wait():
    """A job that blocks (a fetch, backpressure) must not hold back the others, as long as
    threads are left; past the limit, jobs wait for a thread instead of failing."""
    running = 0
    peak = 0
    lock = threading.Lock()
    release = threading.Event()

    def job():
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(10)
        with lock:
            running -= 1
        return True

    async def main():
        workers = Workers(max_threads=3)
        results = []

        async def one():
            results.append(await workers.run(job))

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(one)
            while peak < 3:
                await trio.sleep(0.01)
            await trio.sleep(0.05)
            assert peak == 3  # three threads at most; two jobs queued
            release.set()
        assert results == [True] * 5

    trio.run(main)


def test_a_cancelled_caller_still_waits_for_its_job():
    """A core call runs to its end before its handler goes away (as with trio.to_thread's
    default), so nothing is half done behind a reply."""
    done = []

    def slow():
        time.sleep(0.2)
        done.append(True)

    async def main():
        workers = Workers()
        with trio.move_on_after(0.01):
            await workers.run(slow)
        assert done == [True]

    trio.run(main)

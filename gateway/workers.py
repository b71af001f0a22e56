"""Worker threads for the FUSE handlers: the core is synchronous and may block (LMDB, disk).

``trio.to_thread.run_sync`` costs about twice the CPU of the hand-off itself per call: a
capacity-limiter turn, a cancel scope, and two ``prctl`` calls naming the thread after each
job (docs/DESIGN.md, "Metadata operation performance"). Every namespace request takes this
hop, so :class:`Workers` does only the hand-off: a queue read by long-lived threads, and the
result delivered to the waiting task through the trio token.

Semantics are those of ``run_sync`` with ``abandon_on_cancel=False``: a job, once queued,
runs to its end, and the task waits for it even if cancelled (a core call is never left
half done behind a reply). At most ``max_threads`` jobs run at once (trio's default
limiter allows 40 too); more wait in the queue, in order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")

log = logging.getLogger("ckptfs.fuse")

MAX_THREADS = 40  # as trio.to_thread's default capacity limiter


class Workers:
    def __init__(self, max_threads: int = MAX_THREADS, name: str = "ckptfs-worker"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._max = max_threads
        self._name = name
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a job (or about to)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` in a worker thread; its result or exception."""
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome) -> None:
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:
                pass  # the loop is gone (unmount): nobody waits for this result

        self._submit(fn, args, deliver)
        # reschedule() hands the task the outcome, unwrapped: a value or a raised exception
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def _submit(self, fn, args, deliver) -> None:
        with self._lock:
            start = self._idle <= 0 and self._threads < self._max
            if start:
                self._threads += 1
                self._idle += 1
            self._idle -= 1  # this job takes an idle thread (or waits for one)
        # The thread starts before the job is queued: a start can fail ("can't start new
        # thread": a pids limit), and a job the caller was told failed must never run later.
        if start and not self._start_thread():
            raise RuntimeError("no worker thread: none could be started")
        self._jobs.put((fn, args, deliver))

    def _start_thread(self) -> bool:
        """Start the thread counted for a job; if that fails, un-count it. False: no thread
        at all will take the job (else one running now will, as past the limit)."""
        try:
            threading.Thread(target=self._work, name=self._name, daemon=True).start()
            return True
        except RuntimeError:
            log.warning("cannot start a worker thread; %d running", self._threads - 1, exc_info=True)
            with self._lock:
                self._threads -= 1
                self._idle -= 1  # the idle turn counted for the thread that did not start
                if self._threads > 0:
                    return True
                self._idle += 1  # the job is not queued: it takes no turn
                return False

    def _work(self) -> None:
        while True:
            fn, args, deliver = self._jobs.get()
            deliver(outcome.capture(fn, *args))
            # An idle thread must not keep its last job alive (a WRITE's buffer, the task)
            fn = args = deliver = None
            with self._lock:
                self._idle += 1

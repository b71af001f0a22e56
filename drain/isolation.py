"""Failures stay with the item they belong to.

An exception nobody foresaw while the drain works on one file, directory or key (a defect, a
record it cannot read, an error of a library) must not end the drain process: the supervisor
would restart it, it would meet the same item first again, and every other file on the node
would stop draining. The drain catches it around that one item, shows it (log with the
traceback, ``ckptfs status``, the error counters, ``user.ckptfs.state`` of a file), and tries
the item again with back-off while every other item goes on.
"""

from __future__ import annotations

import logging
import time

from .upload import Backoff

log = logging.getLogger("ckptfs.drain")

UNEXPECTED_PREFIX = "Unexpected"
ONE_BY_ONE_ROUND = 256  # keys tried alone per round after a batch failed: bounds the burst of requests


def unexpected_code(exc: BaseException) -> str:
    """The error code shown for an unforeseen exception: ``Unexpected`` + its type's name
    (``UnexpectedKeyError``), so an operator can tell a defect from an error of the bucket;
    or the code an exception class declares (``error_code``: fsmeta's ``UnreadableRecord``)."""
    return getattr(type(exc), "error_code", None) or UNEXPECTED_PREFIX + type(exc).__name__


class KeyQuarantine:
    """Keys (of tombstones) whose last attempt failed, each waiting out its own back-off.

    While a batch of several keys fails, the drain cannot tell which one is at fault: it
    tries each key of the next batches alone (``one_by_one``) until each has been tried
    once; a key that fails alone waits, and the others go on.
    """

    def __init__(self, backoff: Backoff, *, clock=time.monotonic):
        self.backoff = backoff
        self.clock = clock
        self.failures: dict[str, int] = {}
        self.retry_after: dict[str, float] = {}
        self.one_by_one = False

    def due(self, key: str) -> bool:
        return self.retry_after.get(key, 0.0) <= self.clock()

    def failed(self, keys: list[str]) -> None:
        """A batch of ``keys`` failed: one key waits; several are tried alone next time."""
        if len(keys) != 1:
            self.one_by_one = True
            return
        key = keys[0]
        n = self.failures[key] = self.failures.get(key, 0) + 1
        self.retry_after[key] = self.clock() + self.backoff.delay(n)

    def succeeded(self, keys: list[str]) -> None:
        for key in keys:
            self.failures.pop(key, None)
            self.retry_after.pop(key, None)

    def forget_except(self, live: set[str]) -> None:
        """Keys no longer tombstoned leave the quarantine."""
        for key in [k for k in self.failures if k not in live]:
            self.failures.pop(key, None)
            self.retry_after.pop(key, None)

    def batches(self, items: list[tuple[str, dict]]) -> list[list[tuple[str, dict]]]:
        """The due ``items``, as one batch, or one batch per item after a batch failed."""
        due = [(k, r) for k, r in items if self.due(k)]
        if not self.one_by_one:
            return [due] if due else []
        # A bounded round of single deletes: the keys past it are tried in the next round.
        if len(due) <= ONE_BY_ONE_ROUND:
            self.one_by_one = False
        return [[item] for item in due[:ONE_BY_ONE_ROUND]]

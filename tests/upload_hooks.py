"""An UploadJournal made of plain functions, for tests that watch one or two of its calls."""

from __future__ import annotations

from ckptfs.drain.upload import UploadJournal


class Hooks(UploadJournal):
    """Each keyword is a plain function for the journal method of that name
    (``retrying`` gets only the state); a missing one behaves like the base."""

    def __init__(self, *, created=None, part_done=None, may_complete=None, should_abort=None, retrying=None):
        self._created, self._part_done, self._retrying = created, part_done, retrying
        self._may_complete, self._should_abort = may_complete, should_abort

    async def created(self, record) -> None:
        if self._created is not None:
            self._created(record)

    async def part_done(self, part) -> None:
        if self._part_done is not None:
            self._part_done(part)

    async def may_complete(self) -> bool:
        return True if self._may_complete is None else self._may_complete()

    def should_abort(self) -> bool:
        return False if self._should_abort is None else self._should_abort()

    async def retrying(self, what, state) -> None:
        if self._retrying is not None:
            self._retrying(state)

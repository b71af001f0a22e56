"""The one error type of the filesystem core: an errno, and why."""

import errno


class FsError(Exception):
    def __init__(self, errno_: int, detail: str = ""):
        # (no strerror here: a lookup of a missing name raises one, and nobody reads it)
        super().__init__(errno_, detail)
        self.errno = errno_
        self.detail = detail

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno, str(self.errno))
        return f"{name}: {self.detail}" if self.detail else name

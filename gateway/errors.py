"""The one error type of the filesystem core: an errno, and why."""

import errno
import os


class FsError(Exception):
    def __init__(self, errno_: int, detail: str = ""):
        super().__init__(errno_, detail or os.strerror(errno_))
        self.errno = errno_
        self.detail = detail

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno, str(self.errno))
        return f"{name}: {self.detail}" if self.detail else name

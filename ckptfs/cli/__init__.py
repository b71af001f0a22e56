"""The ``ckptfs`` command: one parser, one module per command group.

=================  ===============================================
module             commands
=================  ===============================================
``cli.mount``      ``mount``, ``umount``
``cli.drain``      ``drain`` (also the mount's supervised drain process)
``cli.status``     ``status``, ``wait-durable``
``cli.lifecycle``  ``lifecycle plan|apply``, ``promote``
``cli.fsck``       ``fsck``
``cli.readpath``   ``prefetch``, ``verify``
=================  ===============================================

Exit codes: 0 success, 1 failure, 2 a bad setting or usage (the message names it).
"""

from __future__ import annotations

import argparse
import sys

from . import drain, fsck, lifecycle, mount, readpath, status
from .common import setup_logging

COMMAND_GROUPS = (mount, drain, status, lifecycle, fsck, readpath)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfs", description="POSIX caching gateway for ML checkpoints")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command != "mount":  # a mount logs to its own file (daemon) or stderr (-f)
        setup_logging(args.verbose)
    return args.func(args, argv) or 0

"""The ``ckptfs`` command: one parser, one module per command group.

=================  ===============================================
module             commands
=================  ===============================================
``cli.mount``      ``mount``, ``umount``
``cli.drain``      ``drain`` (also the mount's supervised drain process)
``cli.status``     ``status``, ``wait-durable``
``cli.lifecycle``  ``lifecycle plan|apply``, ``promote``
``cli.fsck``       ``fsck``
``cli.readpath``   ``prefetch``, ``evict``, ``verify``
=================  ===============================================

Exit codes: 0 success, 1 failure, 2 a bad setting or usage (the message names it).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .common import setup_logging

# Each command's group module, so that one command imports only its own module: the S3
# client, the FUSE front end and the lifecycle engine together cost about a second of start-up, paid
# by every `prefetch` before a resume and every one-shot `drain`. tests/test_cli_*.py check
# this table against what the groups register.
COMMAND_MODULES = {
    "mount": "mount", "umount": "mount",
    "drain": "drain",
    "status": "status", "wait-durable": "status",
    "lifecycle": "lifecycle", "promote": "lifecycle",
    "fsck": "fsck",
    "prefetch": "readpath", "evict": "readpath", "verify": "readpath",
}
GROUP_MODULES = ("mount", "drain", "status", "lifecycle", "fsck", "readpath")


def _group(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(groups=GROUP_MODULES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfs", description="POSIX caching gateway for ML checkpoints")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in groups:
        _group(name).add_commands(sub)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command word of ``argv`` (the first argument that is not a global option)."""
    for arg in argv:
        if arg in ("-v", "--verbose"):
            continue
        return arg
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    group = COMMAND_MODULES.get(_command_of(argv) or "")
    # An unknown command or a bare --help gets the whole parser, with every command listed.
    args = build_parser((group,) if group else GROUP_MODULES).parse_args(argv)
    if args.command != "mount":  # a mount logs to its own file (daemon) or stderr (-f)
        setup_logging(args.verbose)
    return args.func(args, argv) or 0

"""The ``ckptfs`` command loads only the module of the command it runs."""

from __future__ import annotations

import subprocess
import sys

from ckptfs import cli


def subcommands(parser) -> set[str]:
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return set(sub.choices)


def test_each_command_is_found_in_the_group_module_the_table_names():
    registered = {}
    for group in cli.GROUP_MODULES:
        for name in subcommands(cli.build_parser((group,))):
            registered[name] = group
    assert registered == cli.COMMAND_MODULES


def test_a_bare_help_lists_every_command():
    assert subcommands(cli.build_parser()) == set(cli.COMMAND_MODULES)


def test_prefetch_starts_without_the_s3_client_the_fuse_front_end_or_the_lifecycle_engine(tmp_path):
    # A prefetch runs right before a resume; the S3 client alone costs ~0.5 s of start-up.
    code = (
        "import sys\n"
        "from ckptfs.cli import main\n"
        f"rc = main(['prefetch', {str(tmp_path)!r}])\n"
        "heavy = sorted(m for m in ('aiobotocore', 'botocore', 'ckptfs_fuse', 'ckptfs.lifecycle.executor')"
        " if m in sys.modules)\n"
        "print(rc, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert "not on a ckptfs mount" in out.stderr

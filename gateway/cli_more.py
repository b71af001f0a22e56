"""ckptfs commands beyond mount/umount: drain, status, wait-durable, lifecycle, ..."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    pass

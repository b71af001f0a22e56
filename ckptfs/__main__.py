"""``python -m ckptfs``: the same as the ``ckptfs`` command (the daemon and the drain re-run it)."""

import sys

from ckptfs.cli import main

sys.exit(main())

"""The entry point of a rank script run on its own: ``run(group, argv)`` on the group of
the backend the test named (``HYBRIDREC_TEST_BACKEND``, set by tests/support/multiproc.py), the
group closed whatever happens. The battery (battery.py) calls the same ``run``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import comm


def run_main(run: Callable[[comm.ProcessGroup, list[str]], None]) -> None:
    group = comm.init(os.environ["HYBRIDREC_TEST_BACKEND"], timeout_s=60.0)
    try:
        run(group, sys.argv[1:])
    finally:
        group.close()

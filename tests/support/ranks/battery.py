"""Rank script: the checks of several rank scripts on one process group, in one launch.

Each argument is a JSON list ``[script, arg, ...]``: the name of a rank script (in the
``ranks/`` folder of its package's tests, ``tests/<package>/ranks/``) and the arguments
of its ``run(group, args)``. The checks run in the order given on one ``comm.init()``
group, each between a "battery start" and a "battery done" line (with its seconds), so a
test can tell its check's output from the others'. The first failure raises (non-zero
exit), as the script alone would: peers may be inside a collective that can no longer
complete, so no later check runs in this launch (tests/support/rank_battery.py starts
the checks after it in a new one).

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import comm


def _module(script: str) -> str:
    """``"dense_dp"`` -> ``"tests.dense.ranks.dense_dp"`` (the repository root is on the path)."""
    tests = Path(__file__).resolve().parents[2]
    (found,) = tests.glob(f"*/ranks/{script}.py")
    return f"tests.{found.parent.parent.name}.ranks.{script}"


def main() -> None:
    checks = [json.loads(arg) for arg in sys.argv[1:]]
    group = comm.init(os.environ["HYBRIDREC_TEST_BACKEND"], timeout_s=60.0)
    try:
        for script, *args in checks:
            what = " ".join([script, *args])
            print(f"rank {group.rank}/{group.size}: battery start {what}", flush=True)
            t0 = time.monotonic()
            importlib.import_module(_module(script)).run(group, args)
            took = time.monotonic() - t0
            print(f"rank {group.rank}/{group.size}: battery done {what} ({took:.1f} s)", flush=True)
    finally:
        group.close()


if __name__ == "__main__":
    main()

"""Rank script: the whole numpy-checked collective battery in one launch.

Run by ``tests/test_comm_collectives.py`` through ``tests.multiproc.run_ranks``;
the backend comes from ``HYBRIDREC_TEST_BACKEND`` (mpi or gloo). Usage::

    python comm_collectives.py [SEED] [SUITE ...]

Prints ``rank R: ok N cases`` on success; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

import comm
from comm_cases import run_battery


def main() -> None:
    backend = os.environ.get("HYBRIDREC_TEST_BACKEND", "auto")
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1234
    suites = sys.argv[2:]
    # A short group timeout: a desynchronised case fails in a minute instead of hanging.
    group = comm.init(backend, timeout_s=60.0)
    try:
        assert group.backend == backend, f"asked for {backend}, got {group.backend}"
        n = run_battery(group, seed, suites)
        group.barrier()
    finally:
        group.close()
    print(f"rank {group.rank}: ok {n} cases", flush=True)


if __name__ == "__main__":
    main()

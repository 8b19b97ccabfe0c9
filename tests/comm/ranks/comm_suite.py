"""Rank script: every multi-rank comm check in one launch per (backend, ranks).

Run by ``tests/comm/test_comm_collectives.py`` through ``tests.support.multiproc.run_ranks``;
``HYBRIDREC_TEST_BACKEND`` names the backend the launcher implies (mpi under
``mpirun``, gloo under the torchrun-style environment). Usage::

    python comm_suite.py NPROCS

In order, each rank prints one line per check that passed:

* ``rank R: ok auto B``: ``comm.init("auto")`` picked backend B from the launcher,
  with the right size and ranks;
* ``rank R: ok N cases``: the whole numpy-checked battery (``comm_cases.py``, seed
  1234, validation on then off);
* ``rank R: ok N seed-99 cases``: the seed-dependent suites again on another seed;
* ``rank R: ok N errors``: bad input raises on every rank (``comm_errors.py``);
* ``rank R: ok timeout S``: (2+ ranks) a silent peer is a CommTimeoutError in about
  1 s (``comm_timeout.py``); last, because a timed-out gloo group is dead.

Any failure raises (the abort hook ends the job at once with that rank's traceback).
"""

from __future__ import annotations

import os
import sys

import torch

import comm
from tests.comm.ranks.comm_cases import run_battery
from tests.comm.ranks.comm_errors import run_errors
from tests.comm.ranks.comm_timeout import check_silent_peer

LAUNCHERS = {"mpi": "mpirun", "gloo": "torchrun"}


def check_auto(group: comm.ProcessGroup, expected: str, nprocs: int) -> None:
    assert group.backend == expected, f"auto picked {group.backend!r}, expected {expected!r}"
    assert group.size == nprocs, f"size {group.size}, expected {nprocs}"
    ranks = group.allgather(torch.tensor(group.rank, dtype=torch.int64)).tolist()
    assert ranks == list(range(nprocs)), f"ranks {ranks}"
    assert comm.detect_launch().launcher == LAUNCHERS[expected], comm.detect_launch()


def main() -> None:
    expected, nprocs = os.environ["HYBRIDREC_TEST_BACKEND"], int(sys.argv[1])
    # A short group timeout: a desynchronised case fails in a minute instead of hanging.
    group = comm.init("auto", timeout_s=60.0)
    me = group.rank
    try:
        check_auto(group, expected, nprocs)
        print(f"rank {me}: ok auto {group.backend}", flush=True)
        n = run_battery(group, 1234, [])
        group.barrier()
        print(f"rank {me}: ok {n} cases", flush=True)
        n = run_battery(group, 99, ["alltoallv", "async", "split"])
        print(f"rank {me}: ok {n} seed-99 cases", flush=True)
        n = run_errors(group)
        print(f"rank {me}: ok {n} errors", flush=True)
        if group.size > 1:
            elapsed = check_silent_peer(group)
            print(f"rank {me}: ok timeout {elapsed:.3f}", flush=True)
    finally:
        group.close()


if __name__ == "__main__":
    main()

"""Rank script: a user error on one rank after communication started, inside
``hybridrec.cli.errors.reported_errors``, while the other ranks wait for it in a collective.

Usage: ``python user_error_one_rank.py FAILING_RANK``. The job must end (exit status 2)
with the failing rank's one line, not wait out the collective's timeout.
"""

from __future__ import annotations

import sys

import torch

import comm
from hybridrec.cli.errors import reported_errors


def main() -> None:
    failing = int(sys.argv[1])
    with reported_errors():
        world = comm.init("auto", timeout_s=120.0)
        if world.rank == failing:
            raise FileNotFoundError(f"train file of rank {failing} is missing")
        world.allreduce(torch.ones(1))  # waits for the failing rank, which never comes
        world.close()


if __name__ == "__main__":
    main()

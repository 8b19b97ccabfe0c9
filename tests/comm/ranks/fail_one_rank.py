"""Rank script: one rank fails while the others wait for it in a collective.

Usage: ``python fail_one_rank.py raise|kill|abort FAILING_RANK``; the backend comes
from ``HYBRIDREC_TEST_BACKEND`` (or ``comm.init("auto")``). Every rank joins the group
and checks one allreduce; then rank FAILING_RANK prints
``rank R: failing now (MODE) at <unix time>`` and raises ``RuntimeError`` (uncaught),
sends itself SIGKILL, or calls ``comm.abort(3)``, while every other rank prints
``rank R: waiting`` and
blocks in an allreduce that can only finish if the failing rank joins. The group
keeps its default 300 s timeout: the job must end because of the failure, not
because a wait ran out. A job that ends as it should never prints ``... done``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import comm


def main() -> None:
    mode, failing = sys.argv[1], int(sys.argv[2])
    if mode not in ("raise", "kill", "abort"):
        raise ValueError(f"mode must be 'raise', 'kill' or 'abort', got {mode!r}")
    group = comm.init(os.environ.get("HYBRIDREC_TEST_BACKEND", "auto"))
    try:
        ones = group.allreduce(torch.ones(3))
        assert ones.tolist() == [float(group.size)] * 3, ones
        group.barrier()
        if group.rank == failing:
            time.sleep(0.5)  # let the peers get into their allreduce
            print(f"rank {group.rank}: failing now ({mode}) at {time.time():.3f}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "abort":
                comm.abort(3)
            raise RuntimeError(f"injected failure on rank {group.rank}")
        print(f"rank {group.rank}: waiting", flush=True)
        group.allreduce(torch.ones(3))
        print(f"rank {group.rank}: done (the failing rank joined?)", flush=True)
    finally:
        group.close()


if __name__ == "__main__":
    main()

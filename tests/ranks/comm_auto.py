"""Rank script: ``comm.init("auto")`` picks the backend the launcher implies.

Usage: ``python comm_auto.py EXPECTED_BACKEND NPROCS``. Prints ``rank R: ok auto``.
"""

from __future__ import annotations

import sys

import torch

import comm


def main() -> None:
    expected, nprocs = sys.argv[1], int(sys.argv[2])
    group = comm.init("auto", timeout_s=60.0)
    try:
        assert group.backend == expected, f"auto picked {group.backend!r}, expected {expected!r}"
        assert group.size == nprocs, f"size {group.size}, expected {nprocs}"
        ranks = group.allgather(torch.tensor(group.rank, dtype=torch.int64)).tolist()
        assert ranks == list(range(nprocs)), f"ranks {ranks}"
        launcher = {"mpi": "mpirun", "gloo": "torchrun"}[expected]
        assert comm.detect_launch().launcher == launcher, comm.detect_launch()
    finally:
        group.close()
    print(f"rank {group.rank}: ok auto {group.backend}", flush=True)


if __name__ == "__main__":
    main()

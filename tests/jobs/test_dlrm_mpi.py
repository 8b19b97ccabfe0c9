"""The DLRM example on real processes (mpirun and gloo) equals one process.

The rank script (tests/jobs/ranks/dlrm_train.py) trains the example's model on its
slice of each global batch (dense part under ``dense.DataParallel``) and compares
dense weights and embedding rows with a single-process run on the whole global batch,
then runs the whole job (``train()``) and checks every rank reports the same metrics.
One rank runs the same checks in-process (no launcher to test there).
"""

from __future__ import annotations

import pytest
import torch
from ranks.dlrm_train import run_checks

import comm
from multiproc import run_ranks


@pytest.mark.timeout(120)
def test_one_rank_in_process() -> None:
    threads = torch.get_num_threads()
    try:
        run_checks(comm.LocalGroup())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "nprocs"), [("mpi", 2), ("gloo", 2), ("mpi", 4)])
def test_dlrm_data_parallel_matches_single_process(backend: str, nprocs: int) -> None:
    outs = run_ranks("dlrm_train.py", nprocs, backend, timeout=280)
    text = "\n".join(outs)
    for rank in range(nprocs):
        assert f"rank {rank}/{nprocs}: ok dlrm train" in text, text

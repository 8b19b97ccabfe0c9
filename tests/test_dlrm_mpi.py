"""The DLRM example on real processes (mpirun and gloo) equals one process.

The rank script (tests/ranks/dlrm_train.py) trains the example's model on its
slice of each global batch (dense part under ``dense.DataParallel``) and compares
dense weights and embedding rows with a single-process run on the whole global batch.
"""

from __future__ import annotations

import pytest

from multiproc import run_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("nprocs", [1, 2])
def test_dlrm_data_parallel_matches_single_process(backend: str, nprocs: int) -> None:
    outs = run_ranks("dlrm_train.py", nprocs, backend, timeout=220)
    text = "\n".join(outs)
    for rank in range(nprocs):
        assert f"rank {rank}/{nprocs}: ok dlrm train" in text, text

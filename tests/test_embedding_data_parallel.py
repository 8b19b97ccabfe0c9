"""Data-parallel EmbeddingCollection on real processes (mpirun and gloo).

The rank script (tests/ranks/embedding_dp.py) trains on its slice of a global
batch and checks its rows against one process trained on the whole batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multiproc import run_ranks


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_data_parallel_matches_single_process(backend: str, nprocs: int) -> None:
    outs = run_ranks("embedding_dp.py", nprocs, backend, timeout=180)
    text = "\n".join(outs)
    for rank in range(nprocs):
        assert f"rank {rank}/{nprocs}: ok embedding data parallel" in text, text


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_rank_without_a_placements_features(backend: str, nprocs: int, tmp_path: Path) -> None:
    """A rank whose batch lacks every local, hybrid or sharded feature still joins that
    placement's backward exchange (its peers would wait until the comm timeout). Then
    the collection's checkpoint (local + sharded tables) loads back on the same ranks
    and into one process with the sharded table local."""
    outs = run_ranks("embedding_dp_missing.py", nprocs, backend, args=[str(tmp_path)], timeout=180)
    text = "\n".join(outs)
    for rank in range(nprocs):
        assert f"rank {rank}/{nprocs}: ok missing placements" in text, text

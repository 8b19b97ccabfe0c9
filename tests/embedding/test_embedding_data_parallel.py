"""Data-parallel EmbeddingCollection on real processes (mpirun and gloo).

The rank scripts (tests/embedding/ranks/embedding_dp.py and embedding_dp_missing.py, launched
with the other embedding and dense rank checks by tests/support/rank_battery.py) train on their
slice of a global batch and check their rows against one process trained on the whole
batch.
"""

from __future__ import annotations

import pytest

from rank_battery import BATTERY_TIMEOUT_S, EMBEDDING_CASES, RankBattery

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), EMBEDDING_CASES)
def test_data_parallel_matches_single_process(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    lines = [f"rank {rank}/{nprocs}: ok embedding data parallel" for rank in range(nprocs)]
    rank_battery.expect(backend, nprocs, lines)


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), EMBEDDING_CASES)
def test_rank_without_a_placements_features(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    """A rank whose batch lacks every local, hybrid or sharded feature still joins that
    placement's backward exchange (its peers would wait until the comm timeout). Then
    the collection's checkpoint (local + sharded tables) loads back on the same ranks
    and into one process with the sharded table local."""
    lines = [f"rank {rank}/{nprocs}: ok missing placements" for rank in range(nprocs)]
    rank_battery.expect(backend, nprocs, lines)

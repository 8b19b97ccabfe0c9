"""DLRM on MovieLens-100k beats the popularity baseline on held-out ratings."""

from __future__ import annotations

import pytest

import comm
from hybridrec.dlrm.job import DLRMJobConfig, train


@pytest.mark.timeout(240)
def test_dlrm_beats_popularity_on_movielens() -> None:
    cfg = DLRMJobConfig(data="movielens", epochs=1, verbose=False)
    try:
        metrics = train(cfg, comm.LocalGroup())
    except FileNotFoundError as e:  # `make test` installs recbole: missing data is a failure
        pytest.fail(f"MovieLens-100k is missing: {e}")
    auc, pop = metrics["test_auc"], metrics["popularity_auc"]
    # Measured with the MovieLens defaults (DCN-v2, dim 32): DLRM 0.778 after one epoch,
    # popularity 0.699.
    assert auc > pop + 0.03, f"DLRM test AUC {auc:.4f} vs popularity {pop:.4f}"
    assert 0.6 < pop < 0.8, pop
    assert metrics["test_logloss"] < metrics["popularity_logloss"]
    assert metrics["epochs"][0]["steps"] == 80_000 // cfg.batch_size

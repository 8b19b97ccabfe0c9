"""A synthetic Criteo-shaped click data set, learnable and deterministic by seed.

* 13 dense features: log-normal "counts", stored as ``log1p`` and standardized
  with train-split statistics (the usual Criteo preprocessing).
* 26 sparse features, one id each, over ``num_rows`` rows per table. Ids follow a
  bounded Zipf law ``P(rank k) ~ k^-a`` (a = 1.05 by default, like real click
  logs: a few hot ids, a long tail); a seeded permutation per table scatters the
  hot ids over the id range, as hashing does.
* Labels from a hidden logistic model: a linear term in four dense features, a
  per-id effect for four sparse features and a dot product of hidden vectors
  between two features (an interaction only embeddings can learn); the bias puts
  the click rate near 25%.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridrec.datasets.ctr import CTRData, SparseFeature, split_indices
from hybridrec.datasets.encode import DenseEncoder, dense_matrix, fit_standardization

NUM_DENSE = 13
NUM_SPARSE = 26


def zipf_ids(rng: np.random.Generator, num_samples: int, num_rows: int, a: float) -> np.ndarray:
    """``num_samples`` ids in ``[0, num_rows)`` with ``P(rank k) ~ k^-a``; rank 1 = id 0."""
    ranks = np.arange(1, num_rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks**-a)  # [R]
    cdf /= cdf[-1]
    u = rng.random(num_samples)  # [N]
    return np.minimum(np.searchsorted(cdf, u, side="right"), num_rows - 1).astype(np.int64)


def make_synthetic(
    *,
    num_samples: int,
    num_rows: int,
    seed: int = 0,
    zipf_a: float = 1.05,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
) -> CTRData:
    """Generate the data set described in the module docstring (vectorized numpy)."""
    if num_samples < 10:
        raise ValueError(f"synthetic data: num_samples must be >= 10, got {num_samples}")
    if num_rows < 2:
        raise ValueError(f"synthetic data: num_rows must be >= 2, got {num_rows}")
    if zipf_a <= 0:
        raise ValueError(f"synthetic data: zipf_a must be > 0, got {zipf_a}")
    rng = np.random.default_rng(seed)

    raw_dense = rng.lognormal(mean=0.0, sigma=1.0, size=(num_samples, NUM_DENSE))  # [N, 13]
    dense_np = np.log1p(raw_dense)
    ids = np.empty((num_samples, NUM_SPARSE), dtype=np.int64)  # [N, 26]
    for f in range(NUM_SPARSE):
        scatter = rng.permutation(num_rows)  # rank -> id
        ids[:, f] = scatter[zipf_ids(rng, num_samples, num_rows, zipf_a)]

    # The hidden model: logit [N].
    centered = dense_np[:, :4] - dense_np[:, :4].mean(axis=0)
    logit = centered @ np.array([1.0, -0.8, 0.6, 0.4])
    for f in range(4):
        effect = rng.normal(0.0, 0.8, size=num_rows)  # [R] per-id effect
        logit += effect[ids[:, f]]
    u = rng.normal(0.0, 0.6, size=(num_rows, 4))  # hidden vectors of feature 4
    v = rng.normal(0.0, 0.6, size=(num_rows, 4))  # and of feature 5
    logit += np.einsum("nd,nd->n", u[ids[:, 4]], v[ids[:, 5]])
    logit -= 1.3
    labels = (rng.random(num_samples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)

    train_idx, val_idx, test_idx = split_indices(num_samples, fractions, seed)
    names = [f"int{i}" for i in range(NUM_DENSE)]
    columns = [dense_np[:, j] for j in range(NUM_DENSE)]  # [N] float64 each
    encoders = [DenseEncoder(name=name, standardize=True) for name in names]
    dense = dense_matrix(fit_standardization(encoders, columns, train_idx), columns, num_samples)
    sparse = [SparseFeature.single(f"cat{f}", ids[:, f], num_rows) for f in range(NUM_SPARSE)]
    return CTRData(
        dense=dense,
        dense_names=names,
        sparse=sparse,
        labels=torch.from_numpy(labels),
        train_idx=train_idx,
        val_idx=val_idx,
        test_idx=test_idx,
        item_feature="cat0",
    )

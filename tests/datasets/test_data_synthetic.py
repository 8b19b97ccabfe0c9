"""The synthetic Criteo-shaped generator and the vectorized batch gather."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrec.datasets import CTRData, SparseFeature, gather_batch, make_synthetic
from hybridrec.datasets.synthetic import zipf_ids


@pytest.fixture(scope="module")
def data() -> CTRData:
    return make_synthetic(num_samples=20_000, num_rows=2_000, seed=7)


def test_shapes_and_ranges(data: CTRData) -> None:
    assert data.dense.shape == (20_000, 13) and data.dense.dtype == torch.float32
    assert len(data.sparse) == 26
    for f in data.sparse:
        assert f.ids.shape == (20_000, 1) and f.num_rows == 2_000
        assert int(f.ids.min()) >= 0 and int(f.ids.max()) < 2_000
        assert bool((f.lengths == 1).all())
    assert set(data.labels.unique().tolist()) == {0.0, 1.0}
    assert 0.1 < float(data.labels.mean()) < 0.5
    n = len(data.train_idx) + len(data.val_idx) + len(data.test_idx)
    assert n == 20_000 and len(data.test_idx) == 2_000


def test_deterministic_by_seed(data: CTRData) -> None:
    again = make_synthetic(num_samples=20_000, num_rows=2_000, seed=7)
    other = make_synthetic(num_samples=20_000, num_rows=2_000, seed=8)
    assert torch.equal(again.dense, data.dense) and torch.equal(again.labels, data.labels)
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(again.sparse, data.sparse, strict=True))
    assert not torch.equal(other.sparse[0].ids, data.sparse[0].ids)
    assert not torch.equal(other.labels, data.labels)


def test_zipf_head_is_heavier_than_tail(data: CTRData) -> None:
    for f in data.sparse[:5]:
        counts = np.sort(np.bincount(f.ids[:, 0].numpy(), minlength=2_000))[::-1]
        top = counts[:20].sum()  # the hottest 1% of rows
        bottom = counts[1_000:].sum()  # the coldest half
        assert top > 2 * bottom, (f.name, top, bottom)
        # The hot ids are scattered over the id range, not all small.
        hot_ids = np.argsort(np.bincount(f.ids[:, 0].numpy(), minlength=2_000))[::-1][:20]
        assert hot_ids.max() > 200, hot_ids


def test_zipf_ids_follow_the_law() -> None:
    """Rank frequencies match k^-a / H(R, a) within sampling noise."""
    rows, a, n = 1_000, 1.05, 400_000
    ids = zipf_ids(np.random.default_rng(0), n, rows, a)
    freq = np.bincount(ids, minlength=rows) / n
    p = np.arange(1, rows + 1) ** -a
    p /= p.sum()
    for k in (0, 1, 4, 9, 99):
        sd = np.sqrt(p[k] * (1 - p[k]) / n)
        assert abs(freq[k] - p[k]) < 5 * sd, (k, freq[k], p[k])


def test_labels_depend_on_the_hidden_features(data: CTRData) -> None:
    """The click rate varies with feature cat0's id (its hidden per-id effect)."""
    ids = data.sparse[0].ids[:, 0].numpy()
    y = data.labels.numpy()
    hot = np.argsort(np.bincount(ids, minlength=2_000))[::-1][:10]
    rates = [y[ids == h].mean() for h in hot]
    assert max(rates) - min(rates) > 0.2, rates
    # ... and not with a feature outside the hidden model (cat20), beyond noise.
    ids20 = data.sparse[20].ids[:, 0].numpy()
    hot20 = np.argsort(np.bincount(ids20, minlength=2_000))[::-1][:3]
    rates20 = [y[ids20 == h].mean() for h in hot20]
    assert max(rates20) - min(rates20) < 0.1, rates20


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_rows must be >= 2, got 1"):
        make_synthetic(num_samples=100, num_rows=1)
    with pytest.raises(ValueError, match="num_samples must be >= 10, got 3"):
        make_synthetic(num_samples=3, num_rows=10)


def test_gather_batch_matches_a_per_sample_loop() -> None:
    """Key-major jagged layout, checked against building it sample by sample."""
    gen = torch.Generator().manual_seed(0)
    n = 50
    lengths = torch.randint(0, 4, (n,), generator=gen)
    ids = torch.randint(1, 30, (n, 3), generator=gen)
    single = torch.randint(0, 9, (n,), generator=gen)
    data = CTRData(
        dense=torch.randn(n, 2, generator=gen),
        dense_names=["a", "b"],
        sparse=[
            SparseFeature.single("one", single, 9),
            SparseFeature(name="multi", ids=ids, lengths=lengths, num_rows=30),
        ],
        labels=(torch.rand(n, generator=gen) > 0.5).float(),
        train_idx=torch.arange(40),
        val_idx=torch.arange(40, 45),
        test_idx=torch.arange(45, 50),
        item_feature="one",
    )
    idx = torch.tensor([7, 3, 3, 49, 0, 21])
    batch = gather_batch(data, idx)
    want_ids: list[int] = []
    want_lengths: list[int] = []
    for i in idx.tolist():  # feature "one", sample by sample
        want_ids.append(int(single[i]))
        want_lengths.append(1)
    for i in idx.tolist():  # then feature "multi"
        k = int(lengths[i])
        want_ids.extend(ids[i, :k].tolist())
        want_lengths.append(k)
    assert batch.sparse.keys == ["one", "multi"]
    assert batch.sparse.ids.tolist() == want_ids
    assert batch.sparse.lengths.tolist() == want_lengths
    assert torch.equal(batch.dense, data.dense[idx]) and torch.equal(batch.labels, data.labels[idx])


def test_sparse_feature_validation() -> None:
    with pytest.raises(ValueError, match=r"feature 'f': ids must lie in \[0, 5\), got \[0, 5\]"):
        SparseFeature.single("f", np.array([0, 5]), 5)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\], got \[0, 3\]"):
        SparseFeature(
            name="g", ids=torch.zeros(2, 2, dtype=torch.int64), lengths=torch.tensor([0, 3]),
            num_rows=3,
        )  # fmt: skip

"""What the readers hand the model: batches, and whole in-memory data sets with their splits.

A data set is ``N`` samples held as whole tensors:

* ``dense``  float32 ``[N, num_dense]``
* one :class:`SparseFeature` per sparse feature: ids padded to ``[N, L]`` plus
  ``lengths [N]`` (``L = 1`` for single-id features, the longest list otherwise)
* ``labels`` float32 ``[N]`` (0 or 1)
* the split: ``train_idx``, ``val_idx``, ``test_idx`` (int64 row indices)

:func:`gather_batch` turns a set of row indices into a :class:`Batch` whose sparse
part is an ``embedding.KeyedJaggedIds`` (key-major jagged), built without a Python
loop over samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embedding import KeyedJaggedIds


@dataclass(kw_only=True, slots=True)
class SparseFeature:
    """One sparse feature of every sample.

    ``ids`` is int64 ``[N, L]``; row ``i`` holds ``lengths[i]`` ids followed by
    padding (ignored). Ids lie in ``[0, num_rows)``.
    """

    name: str
    ids: torch.Tensor  # [N, L] int64
    lengths: torch.Tensor  # [N] int64
    num_rows: int

    def __post_init__(self) -> None:
        if self.ids.dim() != 2 or self.ids.dtype != torch.int64:
            raise ValueError(
                f"feature {self.name!r}: ids must be int64 [N, L], got {self.ids.dtype} "
                f"{tuple(self.ids.shape)}"
            )
        n, width = self.ids.shape
        if tuple(self.lengths.shape) != (n,):
            raise ValueError(
                f"feature {self.name!r}: lengths must be [{n}], got {tuple(self.lengths.shape)}"
            )
        if n and (int(self.lengths.min()) < 0 or int(self.lengths.max()) > width):
            raise ValueError(
                f"feature {self.name!r}: lengths must lie in [0, {width}], got "
                f"[{int(self.lengths.min())}, {int(self.lengths.max())}]"
            )
        if self.ids.numel() and (int(self.ids.min()) < 0 or int(self.ids.max()) >= self.num_rows):
            raise ValueError(
                f"feature {self.name!r}: ids must lie in [0, {self.num_rows}), got "
                f"[{int(self.ids.min())}, {int(self.ids.max())}]"
            )

    @classmethod
    def single(cls, name: str, ids: np.ndarray | torch.Tensor, num_rows: int) -> SparseFeature:
        """A feature with exactly one id per sample: ``ids`` is ``[N]``."""
        t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1, 1)  # [N, 1]
        return cls(
            name=name,
            ids=t,
            lengths=torch.ones(t.shape[0], dtype=torch.int64),
            num_rows=num_rows,
        )


@dataclass(kw_only=True, slots=True)
class CTRData:
    """A whole data set plus its train/val/test split (see the module docstring)."""

    dense: torch.Tensor  # [N, num_dense] float32
    dense_names: list[str]
    sparse: list[SparseFeature]
    labels: torch.Tensor  # [N] float32
    train_idx: torch.Tensor  # [N_train] int64
    val_idx: torch.Tensor  # [N_val] int64
    test_idx: torch.Tensor  # [N_test] int64
    item_feature: str  # the feature whose click rate is the popularity baseline

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if tuple(self.dense.shape) != (n, len(self.dense_names)):
            raise ValueError(
                f"dense must be [{n}, {len(self.dense_names)}], got {tuple(self.dense.shape)}"
            )
        for f in self.sparse:
            if f.ids.shape[0] != n:
                raise ValueError(f"feature {f.name!r} has {f.ids.shape[0]} samples, labels {n}")
        if self.item_feature not in self.feature_names:
            raise ValueError(
                f"item_feature {self.item_feature!r} is not one of {self.feature_names}"
            )

    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    def feature(self, name: str) -> SparseFeature:
        for f in self.sparse:
            if f.name == name:
                return f
        raise KeyError(f"no sparse feature {name!r}; have {self.feature_names}")


# Where a row is and its key columns: (file index, line in the file, the columns' texts).
KeyRow = tuple[int, int, list[str]]


@dataclass(kw_only=True, slots=True)
class Batch:
    """``B`` samples: dense features, sparse ids of every feature, labels.

    ``sparse.lengths`` is ``[K * B]`` (feature 0's ``B`` lengths, then feature 1's,
    ...), ``sparse.ids`` is ``[sum(lengths)]`` in the same order.
    """

    dense: torch.Tensor  # [B, num_dense]
    sparse: KeyedJaggedIds  # K = number of sparse features
    labels: torch.Tensor  # [B]

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


def gather_batch(data: CTRData, idx: torch.Tensor) -> Batch:
    """Rows ``idx`` (int64 ``[B]``) of ``data`` as one :class:`Batch` (vectorized)."""
    ids: list[torch.Tensor] = []
    lengths: list[torch.Tensor] = []
    for f in data.sparse:
        lens = f.lengths[idx]  # [B]
        rows = f.ids[idx]  # [B, L]
        if rows.shape[1] == 1:
            ids.append(rows.reshape(-1))  # every sample has exactly one id
        else:
            keep = torch.arange(rows.shape[1]) < lens.unsqueeze(1)  # [B, L]
            ids.append(rows[keep])  # row-major: sample by sample
        lengths.append(lens)
    return Batch(
        dense=data.dense[idx],
        sparse=KeyedJaggedIds(data.feature_names, torch.cat(ids), torch.cat(lengths)),
        labels=data.labels[idx],
    )


def split_indices(
    n: int, fractions: tuple[float, float, float], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A seeded random split of ``range(n)`` into train/val/test by ``fractions``."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(
            f"split fractions must be three numbers >= 0 adding up to 1, got {fractions}"
        )
    perm = np.random.default_rng(seed).permutation(n)
    n_train = int(round(fractions[0] * n))
    n_val = int(round(fractions[1] * n))
    parts = perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]
    return tuple(torch.from_numpy(np.sort(p)).to(torch.int64) for p in parts)  # type: ignore[return-value]

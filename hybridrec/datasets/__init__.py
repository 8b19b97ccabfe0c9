"""Data sets for the example jobs, held in memory as whole tensors.

* :func:`load_movielens`: MovieLens-100k (from the ``recbole`` package) as clicks.
* :func:`make_synthetic`: Criteo-shaped synthetic clicks (13 dense, 26 Zipf sparse).
* :func:`gather_batch`: sample indices -> a :class:`Batch` with key-major jagged ids.

Readers of the user's own data: :mod:`hybridrec.datasets.tabular` (CSV/TSV/Parquet
through a :mod:`hybridrec.datasets.schema`, streamed) and
:mod:`hybridrec.datasets.recbole` (RecBole atomic files, in memory); the Criteo
TSV reader is :mod:`hybridrec.datasets.criteo`.
"""

from hybridrec.datasets.ctr import Batch, CTRData, SparseFeature, gather_batch, split_indices
from hybridrec.datasets.movielens import load_movielens, movielens_dir
from hybridrec.datasets.synthetic import make_synthetic

__all__ = [
    "Batch",
    "CTRData",
    "SparseFeature",
    "gather_batch",
    "load_movielens",
    "make_synthetic",
    "movielens_dir",
    "split_indices",
]

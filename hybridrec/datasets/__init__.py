"""The data sets of the example jobs: readers of each format, one encoding step, batches.

The DLRM data path goes one way, each file calling only the ones below it:

* readers parse a format into columns: :mod:`~hybridrec.datasets.criteo` (Criteo TSV,
  streamed), :mod:`~hybridrec.datasets.tabular` (CSV/TSV/Parquet through a schema,
  streamed), :mod:`~hybridrec.datasets.recbole` (RecBole atomic files, in memory; and
  :mod:`~hybridrec.datasets.movielens`, MovieLens-100k through it),
  :mod:`~hybridrec.datasets.synthetic` (Criteo-shaped clicks, generated);
* :mod:`~hybridrec.datasets.schema`: what a user's columns mean;
* :mod:`~hybridrec.datasets.stream`: streamed files' records dealt to ranks, resumable;
* :mod:`~hybridrec.datasets.encode`: columns -> features (label rule, hash, vocabulary,
  buckets, log, standardize, multi-value), with state that round-trips through JSON;
* :mod:`~hybridrec.datasets.ctr`: batches and in-memory data sets.

The language-model example reads :mod:`~hybridrec.datasets.text` with the tokenizers of
:mod:`~hybridrec.datasets.bpe`.
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

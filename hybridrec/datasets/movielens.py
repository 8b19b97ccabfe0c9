"""MovieLens-100k as a click-through-rate data set.

The files come with the ``recbole`` package (``recbole/dataset_example/ml-100k``):
tab-separated, with typed headers such as ``user_id:token``:

* ``ml-100k.inter``: user_id, item_id, rating, timestamp (100,000 rows)
* ``ml-100k.user``:  user_id, age, gender, occupation, zip_code (943 users)
* ``ml-100k.item``:  item_id, movie_title, release_year, class (genres; 1,682 items)

The files are read by the RecBole atomic-file reader
(:mod:`hybridrec.datasets.recbole`); this module adds MovieLens's own features.
A sample is one rating; its label is ``rating >= 4`` (a "click").

Sparse features (id 0 = unknown, other ids contiguous from 1):
``user``, ``item``, ``gender``, ``age`` (7 buckets), ``occupation``, ``zip3``
(the zip code's first three characters) and ``genres`` (the item's genre list, a
multi-id feature).

Dense features, standardized with train-split statistics: ``age``,
``release_year``, ``num_genres``, and ``log1p`` of the user's and the item's number
of ratings *in the training split* (test and validation rows do not count, so
nothing leaks from them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from hybridrec.datasets.ctr import CTRData, SparseFeature, split_indices, standardize_
from hybridrec.datasets.recbole import read_atomic, token_vocab

INSTALL_HINT = "pip install --no-deps recbole==1.2.1"
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # the MovieLens-1M age groups: <18, 18-24, ..., 56+
DENSE_NAMES = ["age", "release_year", "num_genres", "user_log_count", "item_log_count"]


def movielens_dir() -> Path:
    """The ml-100k folder inside the installed ``recbole`` package."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "MovieLens-100k is read from the recbole package, which is not installed; "
            f"run `{INSTALL_HINT}` (or `make demo`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-100k"
    if not (path / "ml-100k.inter").exists():
        raise FileNotFoundError(
            f"recbole is installed but {path / 'ml-100k.inter'} is missing; "
            f"reinstall it with `{INSTALL_HINT}`"
        )
    return path


def _read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """Header field names and the rows as lists of strings (the RecBole atomic reader)."""
    table, _ = read_atomic(path)
    return table.names, [list(r) for r in zip(*table.columns.values(), strict=True)]


_vocab = token_vocab


def _lookup(vocab: dict[str, int], tokens: list[str]) -> np.ndarray:
    return np.fromiter((vocab.get(t, 0) for t in tokens), dtype=np.int64, count=len(tokens))


def load_movielens(
    *,
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    path: Path | None = None,
) -> CTRData:
    """Read MovieLens-100k, split it (seeded) and build features (see the module doc)."""
    root = movielens_dir() if path is None else Path(path)

    # Interactions: [N] arrays.
    inter, _ = read_atomic(root / "ml-100k.inter")
    raw_user = inter.columns["user_id"]
    raw_item = inter.columns["item_id"]
    ratings = np.array([float(r) for r in inter.columns["rating"]])  # [N]
    labels = torch.from_numpy((ratings >= 4).astype(np.float32))  # [N]
    n = len(raw_user)

    # Users: one row per user id.
    uh, users = _read_table(root / "ml-100k.user")
    ucol = {name: [r[uh.index(name)] for r in users] for name in uh}
    user_vocab = _vocab(ucol["user_id"])
    user_row = {u: i for i, u in enumerate(ucol["user_id"])}
    ages = np.array([float(a) for a in ucol["age"]])  # [U]
    age_bucket = np.searchsorted(np.array(AGE_BUCKETS), ages, side="right") + 1  # [U] in 1..7
    gender_vocab = _vocab(ucol["gender"])
    occ_vocab = _vocab(ucol["occupation"])
    zip3 = [z[:3] for z in ucol["zip_code"]]
    zip_vocab = _vocab(zip3)

    # Items: one row per item id; genres are space-separated.
    ih, items = _read_table(root / "ml-100k.item")
    icol = {name: [r[ih.index(name)] for r in items] for name in ih}
    item_vocab = _vocab(icol["item_id"])
    item_row = {it: i for i, it in enumerate(icol["item_id"])}
    years = np.array([float(y) if y.isdigit() else np.nan for y in icol["release_year"]])  # [I]
    years[np.isnan(years)] = np.nanmedian(years)  # a few items have no year
    genre_lists = [g.split() for g in icol["class"]]
    genre_vocab = _vocab([g for gs in genre_lists for g in gs])
    max_genres = max(len(gs) for gs in genre_lists)
    item_genres = np.zeros((len(items), max_genres), dtype=np.int64)  # [I, G], 0-padded
    item_num_genres = np.array([len(gs) for gs in genre_lists], dtype=np.int64)  # [I]
    for i, gs in enumerate(genre_lists):
        item_genres[i, : len(gs)] = [genre_vocab[g] for g in gs]

    # Per-sample row into the user and item tables: [N].
    urow = np.fromiter((user_row[u] for u in raw_user), dtype=np.int64, count=n)
    irow = np.fromiter((item_row[i] for i in raw_item), dtype=np.int64, count=n)

    train_idx, val_idx, test_idx = split_indices(n, fractions, seed)

    sparse = [
        SparseFeature.single("user", _lookup(user_vocab, raw_user), len(user_vocab) + 1),
        SparseFeature.single("item", _lookup(item_vocab, raw_item), len(item_vocab) + 1),
        SparseFeature.single(
            "gender", _lookup(gender_vocab, ucol["gender"])[urow], len(gender_vocab) + 1
        ),
        SparseFeature.single("age", age_bucket[urow], len(AGE_BUCKETS) + 2),
        SparseFeature.single(
            "occupation", _lookup(occ_vocab, ucol["occupation"])[urow], len(occ_vocab) + 1
        ),
        SparseFeature.single("zip3", _lookup(zip_vocab, zip3)[urow], len(zip_vocab) + 1),
        SparseFeature(
            name="genres",
            ids=torch.from_numpy(item_genres[irow]),
            lengths=torch.from_numpy(item_num_genres[irow]),
            num_rows=len(genre_vocab) + 1,
        ),
    ]

    # Count features from the training split only: [N] each.
    train_np = train_idx.numpy()
    user_counts = np.bincount(urow[train_np], minlength=len(users))  # [U]
    item_counts = np.bincount(irow[train_np], minlength=len(items))  # [I]
    dense_np = np.stack(
        [
            ages[urow],
            years[irow],
            item_num_genres[irow].astype(np.float64),
            np.log1p(user_counts[urow]),
            np.log1p(item_counts[irow]),
        ],
        axis=1,
    )  # [N, 5]
    dense = torch.from_numpy(dense_np.astype(np.float32))
    standardize_(dense, train_idx)

    return CTRData(
        dense=dense,
        dense_names=list(DENSE_NAMES),
        sparse=sparse,
        labels=labels,
        train_idx=train_idx,
        val_idx=val_idx,
        test_idx=test_idx,
        item_feature="item",
    )

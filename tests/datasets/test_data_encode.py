"""The encoders: state as plain JSON and back, and an encoder rebuilt from its state
encoding data the training run never saw exactly as the fitted one does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hybridrec.datasets.criteo import criteo_encoders
from hybridrec.datasets.ctr import Batch
from hybridrec.datasets.encode import (
    BucketEncoder,
    DenseEncoder,
    Encoders,
    HashEncoder,
    LabelEncoder,
    VocabEncoder,
    dense_matrix,
    sparse_feature,
    sparse_from_state,
)
from hybridrec.datasets.recbole import joined_fields, read_recbole
from hybridrec.datasets.schema import schema_from_dict
from hybridrec.datasets.tabular import TabularConfig, TabularReader, fit_tabular

SCHEMA: dict[str, Any] = {
    "label": {"column": "rating", "rule": ">= 4"},
    "dense": [
        {"column": "price", "log": True, "standardize": True},
        {"column": "age", "standardize": True},
        {"column": "n"},
    ],
    "sparse": [
        {"column": "user", "vocab": True},
        {"column": "tags", "separator": "|", "hash_rows": 50},
        {"column": "ad", "encoding": "hex", "hash_rows": 1000},
        {"column": "cats", "separator": ";", "vocab": True},
    ],
}
HEADER = ["rating", "price", "age", "n", "user", "tags", "ad", "cats"]


def _rows(n: int, seed: int, users: str) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out.append([
            str(rng.integers(1, 6)),
            "" if rng.random() < 0.1 else f"{rng.lognormal(2, 2):.17g}",
            "" if rng.random() < 0.1 else str(rng.integers(18, 80)),
            f"{rng.normal(0, 10):.17g}",
            str(rng.choice(list(users))),
            "|".join(rng.choice(list("abcdefgh"), size=rng.integers(0, 4))),
            "" if rng.random() < 0.1 else f"{rng.integers(0, 2**40):x}",
            ";".join(rng.choice(["x", "y", "10", "9", "w"], size=rng.integers(0, 3))),
        ])  # fmt: skip
    return out


def _write(path: Path, rows: list[list[str]]) -> None:
    path.write_text("\n".join(",".join(r) for r in [HEADER, *rows]) + "\n")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _assert_same_batches(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        # Bit for bit: the same encoders (one of them rebuilt) on the same rows.
        assert torch.equal(_bits(x.dense), _bits(y.dense)) and torch.equal(x.labels, y.labels)
        assert x.sparse.keys == y.sparse.keys
        assert torch.equal(x.sparse.ids, y.sparse.ids)
        assert torch.equal(x.sparse.lengths, y.sparse.lengths)


def _through_json(encoders: Encoders) -> Encoders:
    state = encoders.to_state()
    text = json.dumps(state, allow_nan=False)  # plain JSON: no pickle, no NaN
    rebuilt = Encoders.from_state(json.loads(text))
    assert rebuilt == encoders and rebuilt.to_state() == state
    return rebuilt


def test_streamed_encoders_rebuilt_from_state_encode_a_new_file_alike(tmp_path: Path) -> None:
    """Fit on one file, store the state as JSON, rebuild, read a file with users and tags
    the training file never had: the same batches as the fitted encoders give."""
    schema = schema_from_dict(SCHEMA)
    train, new = tmp_path / "train.csv", tmp_path / "new.csv"
    _write(train, _rows(400, seed=1, users="abcdef"))
    _write(new, _rows(300, seed=2, users="defghij"))
    fitted = fit_tabular([str(train)], schema).encoders
    rebuilt = _through_json(fitted)
    assert isinstance(rebuilt.sparse[0], VocabEncoder)
    assert rebuilt.sparse[0].vocab == list("abcdef")
    assert [e.standardize for e in rebuilt.dense] == [True, True, False]

    def read(enc: Encoders) -> list[Batch]:
        cfg = TabularConfig(paths=[str(new)], schema=schema, encoders=enc, batch_size=64)
        return list(TabularReader(cfg))

    got, want = read(rebuilt), read(fitted)
    _assert_same_batches(got, want)
    users = torch.cat([b.sparse["user"].ids for b in want])
    assert (users == 0).any() and (users > 0).any()  # unseen users: row 0


def test_criteo_encoders_round_trip() -> None:
    for rows in (1000, None):
        enc = criteo_encoders(rows)
        assert _through_json(enc).num_rows() == [rows] * 26


SHOP_INTER = [
    "uid:token\tiid:token\tlabel:float\tctx:token_seq\twatch:float",
    "u-a\tx/1\t1\tt1 t2\t3.5",
    "u-b\tx/2\t0\t\t",
    "u-a\tx/3\t1\tt2\t1",
    "u-c\tx/1\t0\tt3 t1 t2\t2",
    "u-b\tx/3\t1\tt1\t0.5",
    "u-c\tx/2\t0\tt2\t4",
    "u-a\tx/2\t1\t\t2",
    "u-z\tx/1\t0\tt1\t1",
    "u-b\tx/1\t1\tt3\t3",
    "u-c\tx/3\t0\tt1 t3\t5",
]
SHOP_USER = ["uid:token\tcity:token\tage:float", "u-a\tparis\t31", "u-b\tlyon\t17", "u-c\tparis\t"]


def test_in_memory_encoders_rebuilt_from_state_encode_columns_alike(tmp_path: Path) -> None:
    """RecBole encoders (vocabulary, prefix, hash, buckets, counts, fill, log, float32
    standardization) rebuilt from JSON re-encode the data set's own columns into its
    tensors exactly, and encode new values as the fitted ones do."""
    root = tmp_path / "shop"
    root.mkdir()
    (root / "shop.inter").write_text("\n".join(SHOP_INTER) + "\n")
    (root / "shop.user").write_text("\n".join(SHOP_USER) + "\n")
    schema = schema_from_dict(
        {
            "sparse": [
                {"column": "uid", "name": "u2", "prefix": 3, "vocab": True},
                {"column": "ctx", "hash_rows": 7},
                {"column": "age", "name": "age_b", "buckets": [18, 30]},
            ],
            "dense": [
                {"column": "watch", "log": True, "standardize": True},
                {"column": "age", "fill": "median", "standardize": True},
                {"column": "uid", "name": "uc", "of": "train_count", "log": True,
                 "standardize": True},
            ],
        }
    )  # fmt: skip
    data, fitted = read_recbole(root, schema, fractions=(0.6, 0.2, 0.2))
    rebuilt = _through_json(fitted)
    # The schema's features, then the fields it does not name (iid, city) by type.
    assert [(type(e), e.name) for e in rebuilt.sparse] == [
        (VocabEncoder, "u2"), (HashEncoder, "ctx"), (BucketEncoder, "age_b"),
        (VocabEncoder, "iid"), (VocabEncoder, "city"),
    ]  # fmt: skip
    fields = {f.name: f.values for f in joined_fields(root)[0]}

    def number(v: str) -> float:
        return float(v) if v else float("nan")

    numbers = [
        np.array([number(v) for v in fields["watch"]]),
        np.array([number(v) for v in fields["age"]]),
        rebuilt.dense[2].count(fields["uid"]),
    ]
    # Bit for bit: the same float64 numbers through the same fill, log and float32
    # standardization (the statistics come back from JSON exactly).
    assert torch.equal(_bits(dense_matrix(rebuilt.dense, numbers, data.num_samples)),
                       _bits(data.dense))  # fmt: skip
    columns = {"u2": "uid", "ctx": "ctx", "age_b": "age", "iid": "iid", "city": "city"}
    for enc in rebuilt.sparse:
        f = sparse_feature(enc, fields[columns.get(enc.name, enc.name)])
        want = data.feature(enc.name)
        assert torch.equal(f.ids, want.ids) and torch.equal(f.lengths, want.lengths)
        assert f.num_rows == want.num_rows
    new = ["u-a", "u-q", "", "u-c", "v-1"]
    for enc, fit_enc in zip(rebuilt.sparse, fitted.sparse, strict=True):
        if isinstance(enc, BucketEncoder):
            continue
        a, b = sparse_feature(enc, new), sparse_feature(fit_enc, new)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.lengths, b.lengths)
    assert sparse_feature(rebuilt.sparse[0], new).ids[:, 0].tolist() == [1, 0, 0, 3, 0]
    ages = np.array([5.0, float("nan"), 40.0])
    one = dense_matrix([rebuilt.dense[1]], [ages], 3)
    assert torch.equal(_bits(one), _bits(dense_matrix([fitted.dense[1]], [ages], 3)))
    # The median of the .user file's ages (17, 31) fills the missing one.
    assert rebuilt.dense[1].fill == 24.0


def test_each_encoder_state_is_plain_data() -> None:
    label = LabelEncoder(column="r", rule="> 2.5")
    assert LabelEncoder.from_state(json.loads(json.dumps(label.to_state()))).clicked("3") == 1.0
    dense = DenseEncoder(name="d", log=True, standardize=True, mean=0.1, std=3.0, fill=2.0,
                         counts={"a": 3})  # fmt: skip
    assert DenseEncoder.from_state(json.loads(json.dumps(dense.to_state()))) == dense
    for enc in (
        HashEncoder(name="h", salt=3, rows=None, encoding="hex", separator="|"),
        VocabEncoder(name="v", vocab=["b", "a"], prefix=2),
        BucketEncoder(name="b", edges=[3.0, 1.0]),
    ):
        state = json.loads(json.dumps(enc.to_state()))
        assert state["kind"] == enc.kind and sparse_from_state(state) == enc
    assert VocabEncoder(name="v", vocab=["b", "a"]).ids(["a", "b", "c"]).tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match=r"DenseEncoder state: unknown key\(s\) \['scale'\]"):
        DenseEncoder.from_state({"name": "d", "scale": 2.0})
    with pytest.raises(ValueError, match=r"kind must be one of \['hash', 'vocab', 'buckets'\]"):
        sparse_from_state({"kind": "embedding", "name": "x"})
    with pytest.raises(ValueError, match=r"label rule '=> 4': expected '0/1' or a comparison"):
        LabelEncoder.from_state({"column": "r", "rule": "=> 4"})

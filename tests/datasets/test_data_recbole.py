"""RecBole atomic data sets: typed headers, both line endings, string ids, joins, schemas.

The fixtures are written by hand; the expected features are worked out by hand
from them (vocabularies sorted, numbers numerically, 0 unknown).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import comm
from hybridrec.datasets import load_movielens, movielens_dir
from hybridrec.datasets.movielens import MOVIELENS_SCHEMA
from hybridrec.datasets.recbole import load_recbole, read_atomic
from hybridrec.datasets.schema import load_schema, schema_from_dict
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.data import InMemorySource
from hybridrec.dlrm.job import train
from multiproc import ROOT
from resume_runs import losses
from tolerance import assert_close, replay_tol, sum_tol, unit_roundoff

U32 = unit_roundoff(torch.float32)

INTER = [
    "uid:token\tiid:token\tlabel:float\tctx:token_seq\twatch:float",
    "u-a\tx/1\t1\tt1 t2\t3.5",
    "u-b\tx/2\t0\t\t",
    "u-a\tx/3\t1\tt2\t1",
    "u-c\tx/1\t0\tt3 t1 t2\t2",
    "u-b\tx/3\t1\tt1\t0.5",
    "u-c\tx/2\t0\tt2\t4",
    "u-a\tx/2\t1\t\t2",
    "u-z\tx/1\t0\tt1\t1",  # a user not in the .user file
    "u-b\tx/1\t1\tt3\t3",
    "u-c\tx/3\t0\tt1 t3\t5",
]
USER = ["uid:token\tcity:token\temb:float_seq", "u-a\tparis\t1 2", "u-b\tlyon\t3", "u-c\tparis\t"]
ITEM = ["iid:token\tprice:float", "x/1\t9.5", "x/2\t", "x/3\t3"]


def _folder(tmp: Path, inter_eol: str = "\r\n") -> Path:
    d = tmp / "shop"
    d.mkdir()
    (d / "shop.inter").write_bytes((inter_eol.join(INTER) + inter_eol).encode())
    (d / "shop.user").write_bytes(("\n".join(USER) + "\n").encode())
    (d / "shop.item").write_bytes(("\r\n".join(ITEM) + "\r\n").encode())
    return d


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_every_field_type_joined_and_mapped(tmp_path: Path, eol: str) -> None:
    data = load_recbole(_folder(tmp_path, eol), fractions=(0.6, 0.2, 0.2))
    assert data.feature_names == ["uid", "iid", "ctx", "city"]
    assert data.dense_names == ["watch", "emb_0", "emb_1", "price"]
    assert data.labels.tolist() == [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    # String ids: u-a u-b u-c u-z -> 1..4; x/1 x/2 x/3 -> 1..3.
    assert data.feature("uid").ids[:, 0].tolist() == [1, 2, 1, 3, 2, 3, 1, 4, 2, 3]
    assert data.feature("iid").ids[:, 0].tolist() == [1, 2, 3, 1, 3, 2, 2, 1, 1, 3]
    ctx = data.feature("ctx")  # token_seq: t1 t2 t3 -> 1 2 3
    assert ctx.lengths.tolist() == [2, 0, 1, 3, 1, 1, 0, 1, 1, 2]
    assert ctx.ids[3].tolist() == [3, 1, 2] and ctx.num_rows == 4
    # Joined from .user: lyon 1, paris 2; u-z has no user row: unknown (0).
    assert data.feature("city").ids[:, 0].tolist() == [2, 1, 2, 2, 1, 2, 2, 0, 1, 2]
    # Dense columns standardized with training statistics; a missing float is the
    # training mean (0 after standardizing). The reference: the same columns read without
    # standardizing (x, float32 of the reader's float64 values), standardized in float64.
    # The reader's y = fl32(fl32(x - m32) / s32) is within
    # (u |x| + dm) / s + (ds + 2 u) |y_64| of y_64 = (x - m) / s, with dm the error of a
    # float32 mean of n = 6 terms (Higham's bound, sum_tol of n + 1 roundings of mean |x|)
    # and ds the float32 std's relative error (measured against float64: replay_tol).
    plain = [{"column": c} for c in ("watch", "emb", "price")]
    (tmp_path / "plain").mkdir()
    x32 = load_recbole(_folder(tmp_path / "plain", eol), schema_from_dict({"dense": plain}),
                       fractions=(0.6, 0.2, 0.2)).dense  # fmt: skip
    train = data.train_idx
    x = x32.double()
    n = len(train)
    m, sd = x[train].mean(0), x[train].std(0)
    want64 = (x - m) / sd  # [10, 4]
    tols = []
    for j in range(4):
        dm = sum_tol(torch.float32, n + 1, float(x[train, j].abs().mean()))
        ds = replay_tol(x32[train, j].std(), sd[j]) / float(sd[j])
        tol = float(
            ((U32 * x[:, j].abs() + dm) / sd[j] + (ds + 2 * U32) * want64[:, j].abs()).max()
        )
        tol = tol * (1 + 4 * U32) + sum_tol(torch.float64, 4, float(want64[:, j].abs().max()))
        tols.append(tol)
        col = data.dense[:, j].double()
        why = "float32 rounding of the column and of its train statistics"
        assert_close(col, want64[:, j], atol=tol, what=data.dense_names[j], why=why)
        # Each element within tol: the train mean within tol of want64's, 0 in float64.
        mean_tol = tol + sum_tol(torch.float64, n + 1, float(want64[train, j].abs().mean()))
        assert_close(col[train].mean(), 0.0, atol=mean_tol, what="train mean", why=why)
    watch = [3.5, None, 1, 2, 0.5, 4, 2, 1, 3, 5]  # interaction 2 has no watch value
    seen = [watch[i] for i in train.tolist() if watch[i] is not None]
    mean = sum(seen) / len(seen)
    std = (sum((w - mean) ** 2 for w in seen) / (len(seen) - 1)) ** 0.5
    want = [0.0 if w is None else (w - mean) / std for w in watch]
    # The same bound, against the standardization worked out here by hand in float64.
    tol = tols[0] + sum_tol(torch.float64, 2 * n + 4, max(abs(w) for w in want))
    assert_close(data.dense[:, 0], torch.tensor(want, dtype=torch.float64), atol=tol,
                 what="watch", why="as above")  # fmt: skip
    raw_price = {1: 9.5, 3: 3.0}
    prices = [raw_price.get(i) for i in data.feature("iid").ids[:, 0].tolist()]
    known = [(p, float(data.dense[k, 3])) for k, p in enumerate(prices) if p is not None]
    (p0, d0), (p1, d1) = sorted(set(known))[:1] + sorted(set(known))[-1:]
    assert d0 < d1 and p0 < p1  # standardizing keeps the order


def test_schema_overrides_label_types_and_drops(tmp_path: Path) -> None:
    schema = schema_from_dict(
        {
            "label": {"column": "label", "rule": "< 1"},
            "drop": ["watch", "emb", "price"],
            "sparse": [{"column": "ctx", "hash_rows": 7, "separator": " "}],
        }
    )
    data = load_recbole(_folder(tmp_path), schema, fractions=(0.6, 0.2, 0.2))
    assert data.labels.tolist() == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]  # label < 1
    # The schema's columns first, then the other fields by type.
    assert data.feature_names == ["ctx", "uid", "iid", "city"] and data.dense_names == []
    assert data.feature("ctx").num_rows == 7


def test_bad_data_is_named(tmp_path: Path) -> None:
    d = _folder(tmp_path)
    inter = d / "shop.inter"
    lines = list(INTER)
    lines[4] = "u-c\tx/1\t0"
    inter.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"shop.inter:5: expected 5 tab-separated fields"):
        load_recbole(d)
    data = load_recbole(d, skip_bad_lines=True, fractions=(0.6, 0.2, 0.2))
    assert data.num_samples == 9
    lines[4] = "u-c\tx/1\t0\tt1\tmany"
    inter.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"shop.inter:5: field 'watch' \(float\) must be numbers"):
        load_recbole(d)
    inter.write_text("uid:token\tiid:text\n")
    with pytest.raises(
        ValueError, match=r"shop.inter:1: header field 'iid:text' must be NAME:TYPE"
    ):
        load_recbole(d)
    inter.write_text("\n".join(INTER) + "\n")
    bad = schema_from_dict({"drop": ["colour"]})
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['colour'\] .* the columns are \["):
        load_recbole(d, bad)
    with pytest.raises(ValueError, match=r"the validation split is empty \(10 interactions"):
        load_recbole(d, fractions=(1.0, 0.0, 0.0))
    (d / "more.inter").write_text("a:token\n")
    with pytest.raises(FileNotFoundError, match=r"exactly one .inter file"):
        load_recbole(d)


def test_movielens_reads_through_the_atomic_reader() -> None:
    """The MovieLens files parse with the generic reader (ids stay strings)."""
    table, skipped = read_atomic(movielens_dir() / "ml-100k.item")
    assert skipped == 0 and len(table) == 1682
    assert table.types == ["token", "token_seq", "token", "token_seq"]
    assert load_movielens().num_samples == 100_000


@pytest.mark.timeout(120)
def test_recbole_job_trains_and_ranks_agree(tmp_path: Path) -> None:
    """--data recbole runs the DLRM job; 2 ranks' slices make the 1-rank batches."""
    cfg = DLRMJobConfig(
        data="recbole", data_path=[str(_folder(tmp_path))], batch_size=4, epochs=1,
        dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], verbose=False, progress=False,
    )  # fmt: skip
    result = train(cfg, comm.LocalGroup())
    assert result["steps"] == 2  # 8 training interactions / 4
    data = load_recbole(cfg.data_path[0])
    whole = InMemorySource(data, cfg, comm.LocalGroup()).local_batches(0)
    # The dealing needs only the group's rank and size: rank r of 2 takes its slice.
    halves = [
        InMemorySource(data, cfg, SimpleNamespace(rank=r, size=2)).local_batches(0)  # type: ignore[arg-type]
        for r in range(2)
    ]
    assert len(whole) == 2
    for step, batch in enumerate(whole):
        # Bit for bit: both are gathers of the same rows, no arithmetic.
        assert torch.equal(torch.cat([halves[0][step], halves[1][step]]), batch)


def test_movielens_schema_file_is_the_one_movielens_uses() -> None:
    assert load_schema(ROOT / "docs" / "movielens_schema.toml") == schema_from_dict(
        MOVIELENS_SCHEMA
    )


@pytest.mark.timeout(120)
def test_recbole_with_the_movielens_schema_trains_as_movielens(tmp_path: Path) -> None:
    """--data recbole on the ml-100k folder with docs/movielens_schema.toml: the same
    losses, step by step, as --data movielens."""
    base = dict(epochs=1, max_steps=30, log_every=1, verbose=False, progress=False)
    runs = {}
    for name, extra in {
        "movielens": dict(data="movielens"),
        "recbole": dict(data="recbole", data_path=[str(movielens_dir())],
                        schema=str(ROOT / "docs" / "movielens_schema.toml")),
    }.items():  # fmt: skip
        out = tmp_path / f"{name}.jsonl"
        train(DLRMJobConfig(**base, **extra, metrics_out=str(out)), comm.LocalGroup())  # type: ignore[arg-type]
        runs[name] = losses(out)
    # Bit for bit: the same reader with the same schema builds the same tensors, and the
    # same job runs the same operations on them in the same order.
    assert len(runs["movielens"]) == 30 and runs["recbole"] == runs["movielens"]

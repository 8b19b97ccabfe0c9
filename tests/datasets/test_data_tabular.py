"""The schema-driven tabular reader: field types, line endings, ranks, resume, bad data.

Expected values come from an independent per-row decoding in plain Python
(``_expected``), never from the reader's own helpers (except the shared Criteo
hash, whose own tests pin it).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comm
from criteo_fixture import write_criteo_fixture
from hybridrec.datasets.criteo import (
    CAT_NAMES,
    INT_NAMES,
    NUM_CAT,
    NUM_INT,
    CriteoConfig,
    CriteoReader,
)
from hybridrec.datasets.schema import (
    DenseColumn,
    LabelColumn,
    Schema,
    SparseColumn,
    load_schema,
)
from hybridrec.datasets.stream import PARQUET_HINT
from hybridrec.datasets.tabular import TabularConfig, TabularReader, fit_tabular
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import train
from ps.routing import splitmix64
from resume_runs import DLRM, SMALLER, interrupted_equals_uninterrupted, losses
from tolerance import assert_close, assert_same, sum_tol, unit_roundoff

HEADER = ["click", "rating", "price", "age", "user", "tags", "ad"]
SCHEMA_TOML = """
[label]
column = "rating"
rule = ">= 4"

[[dense]]
column = "price"
log = true

[[dense]]
column = "age"
standardize = true

[[sparse]]
column = "user"
vocab = true

[[sparse]]
column = "tags"
separator = "|"
hash_rows = 50

[[sparse]]
column = "ad"
encoding = "hex"
hash_rows = 1000
"""
ROWS = [
    ["1", "5", "10", "30", "alice", "a|b", "ff"],
    ["0", "2", "", "40", "bob", "", "10"],
    ["1", "4", "-3", "", "carol", "c", ""],
    ["0", "1", "7.5", "20", "alice", "a|a|d", "abc"],
    ["1", "3", "0", "50", "dave", "b", "1"],
]


def _write(path: Path, header: list[str], rows: list[list[str]], sep: str, eol: str) -> None:
    text = eol.join(sep.join(r) for r in [header, *rows]) + eol
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(text.encode())
    else:
        path.write_bytes(text.encode())


def _hash(value: int, k: int, rows: int) -> int:
    return int(splitmix64(torch.tensor([value * 32 + k]))[0]) % rows


def _text_id(token: str) -> int:
    digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**58


def _expected(rows: list[list[str]], train: list[list[str]]) -> list[tuple[Any, ...]]:
    """Each row decoded by hand: (label, [price, age], user id, tag ids, ad ids)."""
    ages = [float(r[3]) if r[3] else 0.0 for r in train]
    mean = sum(ages) / len(ages)
    std = math.sqrt(sum((a - mean) ** 2 for a in ages) / (len(ages) - 1))
    users = {u: i + 1 for i, u in enumerate(sorted({r[4] for r in train}))}
    out = []
    for r in rows:
        price = math.log1p(max(float(r[2]), 0.0)) if r[2] else 0.0
        age = ((float(r[3]) if r[3] else 0.0) - mean) / std
        tags = [_hash(_text_id(t), 1, 50) for t in r[5].split("|") if t]
        ad = [_hash(int(r[6], 16), 2, 1000)] if r[6] else []
        out.append((float(float(r[1]) >= 4), [price, age], [users.get(r[4], 0)], tags, ad))
    return out


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return float(torch.tensor(x, dtype=torch.float64).float())


def _age_tol(train: list[list[str]]) -> Callable[[float], float]:
    """How far the reader's standardized age may be from ``_expected``'s, as a function of
    the expected value ``y``.

    The reader takes the train mean and the one-pass variance (sum x^2 - n mean^2) / (n - 1)
    in float64 and rounds (x - mean) / std to float32 once: ``u32 |y|``, plus the float64
    error of y. That is a few roundings of each sum (Higham: gamma_{n+4}), relative to the
    variance amplified by kappa = (sum x^2 + n mean^2) / ((n - 1) var), and carried into y
    through |y| + mean |x| / std."""
    ages = [float(r[3]) if r[3] else 0.0 for r in train]
    n = len(ages)
    mean = sum(ages) / n
    var = sum((a - mean) ** 2 for a in ages) / (n - 1)
    kappa = (sum(a * a for a in ages) + n * mean**2) / ((n - 1) * var)
    spread = sum(abs(a) for a in ages) / n / math.sqrt(var)
    u32 = unit_roundoff(torch.float32)
    return lambda y: u32 * abs(y) + sum_tol(torch.float64, n + 4, (kappa + 1) * (abs(y) + spread))


def _float32_rounding_is_unambiguous(values: list[float], ulps: int = 16) -> bool:
    """Every float64 within ``ulps`` float64 ulp of each value rounds to the same float32 as
    the value itself (so two float64 evaluations of a function accurate to that many ulp
    give the same float32)."""
    for v in values:
        lo, hi = v - ulps * math.ulp(v), v + ulps * math.ulp(v)
        if not _f32(lo) == _f32(v) == _f32(hi):
            return False
    return True


def _decoded(reader: TabularReader) -> list[tuple[Any, ...]]:
    out = []
    for b in reader:
        cols = {k: b.sparse[k].to_lists() for k in ("user", "tags", "ad")}
        for i in range(b.size):
            out.append(
                (
                    float(b.labels[i]),
                    b.dense[i].tolist(),
                    cols["user"][i],
                    cols["tags"][i],
                    cols["ad"][i],
                )
            )
    return out


@pytest.fixture
def schema(tmp_path: Path) -> Schema:
    p = tmp_path / "schema.toml"
    p.write_text(SCHEMA_TOML)
    return load_schema(p)


def _reader(paths: list[str], schema: Schema, train: list[str] | None = None, **kw: Any):
    fitted = fit_tabular(train or paths, schema, skip_bad_lines=kw.get("skip_bad_lines", False))
    return TabularReader(TabularConfig(paths=paths, schema=schema, encoders=fitted.encoders, **kw))


@pytest.mark.parametrize(
    "name,sep,eol",
    [("d.csv", ",", "\n"), ("d.tsv", "\t", "\r\n"), ("d.csv.gz", ",", "\r\n")],
)
def test_every_field_type_and_line_ending(
    schema: Schema, tmp_path: Path, name: str, sep: str, eol: str
) -> None:
    path = tmp_path / name
    _write(path, HEADER, ROWS, sep, eol)
    got = _decoded(_reader([str(path)], schema, batch_size=2))
    want = _expected(ROWS, ROWS)
    assert len(got) == len(want) == 5
    tol = _age_tol(ROWS)
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0] and g[2:] == w[2:]
        # price: the reader's float64 log1p (numpy's, SIMD on some CPUs; math.log1p here;
        # both within a few ulp, and every price of ROWS has a log1p far from a float32
        # rounding boundary) shifted by 0 and scaled by 1 (exact), rounded once to float32.
        assert _float32_rounding_is_unambiguous([w[1][0]])
        assert g[1][0] == _f32(w[1][0]), (g, w)
        assert_close(g[1][1], w[1][1], atol=tol(w[1][1]), what="standardized age",
                     why="one float32 rounding of float64 statistics")  # fmt: skip


def test_vocabulary_from_the_training_split_only(schema: Schema, tmp_path: Path) -> None:
    """A user only in the test file gets row 0 (out of vocabulary)."""
    train_p, test_p = tmp_path / "train.csv", tmp_path / "test.csv"
    _write(train_p, HEADER, ROWS[:3], ",", "\n")
    _write(test_p, HEADER, ROWS[3:], ",", "\n")
    got = _decoded(_reader([str(test_p)], schema, train=[str(train_p)], batch_size=8))
    want = _expected(ROWS[3:], ROWS[:3])
    assert [g[2] for g in got] == [w[2] for w in want] == [[1], [0]]  # alice seen, dave not
    assert fit_tabular([str(train_p)], schema).num_rows() == [4, 50, 1000]


def test_bad_data_is_named(schema: Schema, tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    rows = [*ROWS[:2], ["1", "x", "1", "1", "u", "", ""], ROWS[2], ["1", "5", "1"]]
    _write(path, HEADER, rows, ",", "\n")
    with pytest.raises(ValueError, match=r"bad.csv:4: label 'rating' must be a number, got 'x'"):
        list(_reader([str(path)], schema))
    good = tmp_path / "ok.csv"
    _write(good, HEADER, ROWS, ",", "\n")
    with pytest.raises(ValueError, match=r"bad.csv:4: label"):
        list(_reader([str(path)], schema, train=[str(good)], batch_size=2))
    reader = _reader([str(path)], schema, train=[str(good)], batch_size=2, skip_bad_lines=True)
    assert len(_decoded(reader)) == 3 and reader.skipped == 2
    _write(path, HEADER, [["1", "5", "1", "1", "u", "", "zz"]], ",", "\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: column 'ad' must be hex, got 'zz'"):
        list(_reader([str(path)], schema, train=[str(good)]))
    _write(path, ["click", "rating", "cost"], [["1", "5", "1"]], ",", "\n")
    unknown = r"unknown column\(s\) \['price', 'age', 'user', 'tags', 'ad'\] in the schema"
    with pytest.raises(
        ValueError, match=unknown + r"; the columns are \['click', 'rating', 'cost'"
    ):
        fit_tabular([str(path)], schema)
    _write(path, HEADER, [], ",", "\n")  # an empty split is refused
    with pytest.raises(ValueError, match=r"bad.csv is empty \(expected data rows\)"):
        fit_tabular([str(path)], schema)
    _write(path, HEADER, [["1", "x", "1", "1", "u", "", ""]], ",", "\n")
    with pytest.raises(ValueError, match=r"the training split .* has no data rows \(1 malformed"):
        fit_tabular([str(path)], schema, skip_bad_lines=True)
    with pytest.raises(ValueError, match=r"label rule '=> 4': expected '0/1' or a comparison"):
        LabelColumn(column="r", rule="=> 4")


def test_schema_and_data_errors_say_what_to_do(schema: Schema, tmp_path: Path) -> None:
    """Schema values are type-checked (file, entry, column, expected type), a rule's
    error names the file, a tab-separated file named .csv is recognised, and a number
    that is not one points at --skip-bad-lines."""
    bad = tmp_path / "bad.toml"
    cases = [
        ('[[sparse]]\ncolumn = "c"\nhash_rows = "1000"\n',
         'sparse #1 (column \'c\'): hash_rows = "1000" must be an integer'),
        ('[[sparse]]\ncolumn = "c"\nvocab = "yes"\n',
         'sparse #1 (column \'c\'): vocab = "yes" must be true or false'),
        ('[[dense]]\ncolumn = "d"\nlog = 1\n', "log = 1 must be true or false"),
        ('[[sparse]]\ncolumn = "c"\nbuckets = [1, "2"]\n',
         'buckets = [1, "2"] must be a list of numbers'),
        ('[label]\ncolumn = "r"\nrule = "=> 4"\n',
         "[label] (column 'r'): label rule '=> 4': expected '0/1' or a comparison"),
    ]  # fmt: skip
    for text, says in cases:
        bad.write_text(text)
        with pytest.raises(ValueError) as info:
            load_schema(bad)
        assert str(info.value).startswith(f"schema file {bad}: "), info.value
        assert says in str(info.value), info.value
    tsv = tmp_path / "tabs.csv"
    _write(tsv, HEADER, ROWS, "\t", "\n")
    with pytest.raises(ValueError, match=r"the header is one column, .* splits on '\\t' into"):
        fit_tabular([str(tsv)], schema)
    with pytest.raises(ValueError, match='give format = "tsv" in the schema'):
        fit_tabular([str(tsv)], schema)
    path = tmp_path / "nan.csv"
    good = tmp_path / "ok.csv"
    _write(good, HEADER, ROWS, ",", "\n")
    _write(path, HEADER, [["1", "5", "n/a", "1", "u", "", ""]], ",", "\n")
    with pytest.raises(ValueError, match=r"column 'price' must be a number, got 'n/a' .*"
                       r"--skip-bad-lines counts and skips"):  # fmt: skip
        list(_reader([str(path)], schema, train=[str(good)]))


def test_parquet_reads_as_the_csv_does(schema: Schema, tmp_path: Path) -> None:
    """The same rows as a Parquet file of typed columns (ints, floats with nulls for the
    empty fields, strings; row groups of 2): the same batches as the CSV's."""
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]

    csv_path, pq_path = tmp_path / "d.csv", tmp_path / "d.parquet"
    _write(csv_path, HEADER, ROWS, ",", "\n")
    col = {h: [r[j] for r in ROWS] for j, h in enumerate(HEADER)}

    def numbers(name: str) -> list[float | None]:
        return [None if v == "" else float(v) for v in col[name]]

    table = pa.table({
        "click": [int(v) for v in col["click"]], "rating": [int(v) for v in col["rating"]],
        "price": numbers("price"), "age": numbers("age"),
        "user": col["user"], "tags": col["tags"], "ad": col["ad"],
    })  # fmt: skip
    pq.write_table(table, pq_path, row_group_size=2)
    # Bit for bit: the same values reach the same encoders.
    got = _decoded(_reader([str(pq_path)], schema, batch_size=2))
    assert got == _decoded(_reader([str(csv_path)], schema, batch_size=2))
    assert len(got) == len(ROWS)


def test_parquet_without_pyarrow_names_the_extra(
    schema: Schema, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pyarrow is a test dependency; a user may lack it: imports of it fail here.
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pyarrow, which is not installed") as e:
        fit_tabular([str(path)], schema)
    assert PARQUET_HINT in str(e.value) and "hybridrec[parquet]" in PARQUET_HINT


def test_two_ranks_deal_rows_of_the_same_global_batches(schema: Schema, tmp_path: Path) -> None:
    """Row i goes to rank i mod 2: the ranks' halves interleave into the one-rank batches."""
    rng = random.Random(3)
    rows = [[str(rng.randint(0, 1)), str(rng.randint(1, 5)), str(rng.randint(0, 99)),
             str(rng.randint(18, 70)), rng.choice("abcdefg"), "|".join(rng.sample("xyzw", 2)),
             f"{rng.getrandbits(16):x}"] for _ in range(37)]  # fmt: skip
    path = tmp_path / "d.csv"
    _write(path, HEADER, rows, ",", "\n")
    one = _decoded(_reader([str(path)], schema, batch_size=6, drop_last=True))
    halves = [
        _decoded(_reader([str(path)], schema, batch_size=3, rank=r, world_size=2, drop_last=True))
        for r in range(2)
    ]
    merged = [halves[i % 2][i // 2] for i in range(len(one))]
    assert len(one) == 36 and merged == one


def _criteo_rows(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [
        [str(int(rng.random() < 0.3 + 0.4 * (i % 3 == 0)))]
        + ["" if rng.random() < 0.2 else str(rng.randint(-2, 300)) for _ in range(NUM_INT)]
        + ["" if rng.random() < 0.2 else f"{rng.getrandbits(5):08x}" for _ in range(NUM_CAT)]
        for i in range(n)
    ]


def criteo_schema(rows: int) -> dict[str, Any]:
    """The Criteo reader's decoding written as a schema (as docs/usage.md shows it)."""
    return {
        "label": {"column": "label"},
        "dense": [{"column": c, "log": True} for c in INT_NAMES],
        "sparse": [{"column": c, "encoding": "hex", "hash_rows": rows} for c in CAT_NAMES],
    }


@pytest.mark.timeout(120)
def test_a_criteo_csv_read_by_schema_matches_the_criteo_reader(tmp_path: Path) -> None:
    """Same rows as a Criteo TSV and as a CSV with a header: same batches, same losses."""
    rows = _criteo_rows(600, seed=5)
    write_criteo_fixture(tmp_path / "day.tsv", rows)
    _write(tmp_path / "day.csv", ["label", *INT_NAMES, *CAT_NAMES], rows, ",", "\r\n")
    (tmp_path / "criteo.json").write_text(json.dumps(criteo_schema(500)))
    schema = load_schema(tmp_path / "criteo.json")
    tab = list(_reader([str(tmp_path / "day.csv")], schema, batch_size=64))
    cri = list(CriteoReader(CriteoConfig(paths=[str(tmp_path / "day.tsv")], batch_size=64,
                                         num_rows=500)))  # fmt: skip
    assert len(tab) == len(cri) == 10
    # Bit for bit: both readers' columns go through the same encoders (numpy's log1p,
    # the same hash), so the same float64 values rounded once to float32.
    for a, b in zip(tab, cri, strict=True):
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        assert a.sparse.keys == b.sparse.keys
        assert torch.equal(a.sparse.ids, b.sparse.ids)
        assert torch.equal(a.sparse.lengths, b.sparse.lengths)
    base = dict(DLRM, batch_size=50, epochs=1, metrics_out="")
    runs = {}
    for name, extra in {
        "criteo": dict(data="criteo", criteo_path=[str(tmp_path / "day.tsv")], criteo_rows=500),
        "tabular": dict(data="tabular", data_path=[str(tmp_path / "day.csv")],
                        schema=str(tmp_path / "criteo.json")),
    }.items():  # fmt: skip
        out = tmp_path / f"{name}.jsonl"
        train(DLRMJobConfig(**{**base, **extra, "metrics_out": str(out)}), comm.LocalGroup())
        runs[name] = losses(out)
    # Bit for bit: the same batches through the same job, so the same operations in order.
    assert len(runs["criteo"]) == 12 and runs["tabular"] == runs["criteo"]


@pytest.mark.timeout(240)
def test_tabular_resumes_mid_file(tmp_path: Path) -> None:
    path = tmp_path / "day.csv"
    _write(path, ["label", *INT_NAMES, *CAT_NAMES], _criteo_rows(1_000, seed=7), ",", "\n")
    spec = criteo_schema(200)
    spec["dense"][0]["standardize"] = True
    spec["sparse"][0] = {"column": "C1", "vocab": True}
    (tmp_path / "s.toml").write_text(_toml(spec))
    base = {**DLRM, "data": "tabular", "data_path": [str(path)],
            "schema": str(tmp_path / "s.toml"), "batch_size": 40}  # fmt: skip

    def run(cfg: DLRMJobConfig) -> dict[str, Any]:
        return train(cfg, comm.LocalGroup())

    interrupted_equals_uninterrupted(run, DLRMJobConfig, base, tmp_path, dict(max_steps=9), SMALLER)


def _toml(spec: dict[str, Any]) -> str:
    """A schema dict as TOML (the tests also read schemas from TOML, not only JSON)."""

    def value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    lines = ["[label]", *(f"{k} = {value(v)}" for k, v in spec["label"].items())]
    for kind in ("dense", "sparse"):
        for col in spec.get(kind, []):
            lines += ["", f"[[{kind}]]", *(f"{k} = {value(v)}" for k, v in col.items())]
    return "\n".join(lines) + "\n"


# ---- hypothesis: random schemas over random data with corrupted lines

_COLUMNS = ["c0", "c1", "c2", "c3", "c4"]


@st.composite
def _case(draw: st.DrawFn) -> tuple[Schema, list[list[str]], set[int]]:
    kinds = draw(st.lists(st.sampled_from(["dense", "dense_log", "vocab", "hash", "multi"]),
                          min_size=len(_COLUMNS), max_size=len(_COLUMNS)))  # fmt: skip
    dense, sparse = [], []
    for c, k in zip(_COLUMNS, kinds, strict=True):
        if k.startswith("dense"):
            dense.append(DenseColumn(column=c, log=k == "dense_log"))
        else:
            sparse.append(SparseColumn(column=c, vocab=k == "vocab", hash_rows=97,
                                       separator=";" if k == "multi" else None))  # fmt: skip
    n = draw(st.integers(1, 25))
    rows, bad = [], set()
    for i in range(n):
        row = [draw(st.sampled_from(["0", "1"]))]
        for k in kinds:
            if k.startswith("dense"):
                row.append(draw(st.sampled_from(["", "0", "3", "-2", "1.5", "1e3"])))
            elif k == "multi":
                row.append(";".join(draw(st.lists(st.sampled_from("abcde"), max_size=3))))
            else:
                row.append(draw(st.sampled_from(["", "a", "bb", "7"])))
        corrupt = draw(st.sampled_from([None, None, None, "fields", "label"]))
        if corrupt == "fields":
            row = row[:-1]
        elif corrupt == "label":
            row[0] = "2"
        if corrupt:
            bad.add(i)
        rows.append(row)
    return Schema(label=LabelColumn(column="y"), dense=dense, sparse=sparse), rows, bad


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_case(), batch=st.integers(1, 7))
def test_random_schemas_and_corrupted_lines(
    tmp_path: Path, case: tuple[Schema, list[list[str]], set[int]], batch: int
) -> None:
    schema, rows, bad = case
    path = tmp_path / "h.csv"
    _write(path, ["y", *_COLUMNS], rows, ",", "\n")
    if not schema.sparse:
        with pytest.raises(ValueError, match=r"needs at least one \[\[sparse\]\] column"):
            fit_tabular([str(path)], schema)
        return
    good = [r for i, r in enumerate(rows) if i not in bad]
    if bad:
        first = min(bad) + 2  # the header is line 1
        with pytest.raises(ValueError, match=rf"h.csv:{first}: "):
            fit_tabular([str(path)], schema)
    if not good:
        with pytest.raises(ValueError, match="has no data rows"):
            fit_tabular([str(path)], schema, skip_bad_lines=True)
        return
    fitted = fit_tabular([str(path)], schema, skip_bad_lines=True)
    reader = TabularReader(TabularConfig(paths=[str(path)], schema=schema,
                                         encoders=fitted.encoders, batch_size=batch,
                                         skip_bad_lines=True))  # fmt: skip
    batches = list(reader)
    assert reader.skipped == len(bad) and sum(b.size for b in batches) == len(good)
    labels = torch.cat([b.labels for b in batches])
    assert labels.tolist() == [float(r[0]) for r in good]
    vocab_of = {c.column: sorted({t for r in good
                                  for t in _split(r[1 + _COLUMNS.index(c.column)], c)})
                for c in schema.sparse if c.vocab}  # fmt: skip
    for c in schema.sparse:
        got = [x for b in batches for x in b.sparse[c.column].to_lists()]
        j = 1 + _COLUMNS.index(c.column)
        if c.vocab:
            want = [[vocab_of[c.column].index(t) + 1 for t in _split(r[j], c)] for r in good]
        else:
            k = schema.sparse.index(c)
            want = [[_hash(_text_id(t), k, 97) for t in _split(r[j], c)] for r in good]
        assert got == want, c
    dense = torch.cat([b.dense for b in batches])
    for d, c in enumerate(schema.dense):
        j = 1 + _COLUMNS.index(c.column)
        xs = [float(r[j]) if r[j] else 0.0 for r in good]
        want_d = [math.log1p(max(x, 0.0)) if c.log else x for x in xs]
        # Bit for bit: unstandardized, the reader's value is a float64 log1p within a few
        # ulp of math.log1p's (numpy's, SIMD on some CPUs), each of these far from a float32
        # rounding boundary (or the number itself), shifted by 0 and scaled by 1 (exact),
        # rounded once to float32.
        assert _float32_rounding_is_unambiguous([v for v in want_d if v])
        want32 = torch.tensor(want_d, dtype=torch.float64).float()
        assert_same(dense[:, d], want32, what=f"dense column {c.column}",
                    why="one rounding of the same float64 value")  # fmt: skip


def _split(v: str, c: SparseColumn) -> list[str]:
    return [t for t in v.split(c.separator) if t] if c.separator else ([v] if v else [])


def test_job_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"data 'tabular' needs data_path FILE .* and schema FILE"):
        DLRMJobConfig(data="tabular", data_path=["a.csv"])
    with pytest.raises(ValueError, match=r"data 'recbole' needs data_path DIR \(one folder\)"):
        DLRMJobConfig(data="recbole", data_path=["a", "b"])
    with pytest.raises(ValueError, match=r"data_val_path is read with data 'tabular' only"):
        DLRMJobConfig(data="movielens", data_val_path=["v.csv"])

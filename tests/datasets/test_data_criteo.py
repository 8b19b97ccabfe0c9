"""The Criteo TSV reader: parsing, hashing, rank sharding, resume, bad lines."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from criteo_fixture import write_criteo_fixture
from hybridrec.datasets.criteo import CAT_NAMES, NUM_CAT, NUM_INT, CriteoConfig, CriteoReader
from hybridrec.datasets.encode import hash_categorical
from hybridrec.datasets.stream import ReaderPosition
from ps.routing import splitmix64


def _random_rows(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        row = [str(rng.randint(0, 1))]
        row += ["" if rng.random() < 0.2 else str(rng.randint(-2, 5000)) for _ in range(NUM_INT)]
        row += ["" if rng.random() < 0.2 else f"{rng.getrandbits(32):08x}" for _ in range(NUM_CAT)]
        rows.append(row)
    return rows


def _expected(row: list[str], num_rows: int | None) -> tuple[float, list[float], list[list[int]]]:
    """An independent per-line decoding in plain Python (one line at a time)."""
    dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in row[1 : 1 + NUM_INT]]
    cats: list[list[int]] = []
    for j, v in enumerate(row[1 + NUM_INT :]):
        if not v:
            cats.append([])
            continue
        mixed = int(splitmix64(torch.tensor([int(v, 16) * 32 + j]))[0])
        cats.append([mixed % num_rows if num_rows else mixed & (2**63 - 1)])
    return float(row[0]), dense, cats


def _collect(reader: CriteoReader) -> list[tuple[float, list[float], list[list[int]]]]:
    out = []
    for batch in reader:
        lists = {k: batch.sparse[k].to_lists() for k in CAT_NAMES}
        for i in range(batch.size):
            out.append(
                (
                    float(batch.labels[i]),
                    batch.dense[i].tolist(),
                    [lists[k][i] for k in CAT_NAMES],
                )
            )
    return out


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return float(torch.tensor(x, dtype=torch.float64).float())


# Every count these files hold (-2..5000, clipped at 0) has a log1p far from a float32
# rounding boundary: all float64 numbers within 16 ulp of it round to the same float32.
# So any float64 log1p accurate to a few ulp (numpy's, SIMD on some CPUs; math.log1p)
# rounds to the same float32, and the reader's float32 dense values can be compared bit
# for bit with the float32 rounding of math.log1p.
def _unambiguous(k: int) -> bool:
    v = math.log1p(k)
    return _f32(v - 16 * math.ulp(v)) == _f32(v) == _f32(v + 16 * math.ulp(v))


def test_every_count_rounds_unambiguously_to_float32() -> None:
    assert all(_unambiguous(k) for k in range(5001))


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for (gl, gd, gc), (wl, wd, wc) in zip(got, want, strict=True):
        assert gl == wl and gc == wc
        assert gd == [_f32(w) for w in wd], (gd, wd)  # bit for bit, see _unambiguous


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
@pytest.mark.parametrize("num_rows", [1000, None])
def test_reads_every_line_like_a_plain_parser(tmp_path: Path, suffix: str, num_rows) -> None:
    rows = _random_rows(37, seed=1)
    path = tmp_path / f"day_0{suffix}"
    write_criteo_fixture(path, rows)
    reader = CriteoReader(CriteoConfig(paths=[str(path)], batch_size=8, num_rows=num_rows))
    _assert_same(_collect(reader), [_expected(r, num_rows) for r in rows])
    assert reader.position.samples == 37 and reader.skipped == 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_split_lines_disjointly(tmp_path: Path, world_size: int) -> None:
    files = []
    for i in range(2):
        files.append(tmp_path / f"part{i}.tsv")
        write_criteo_fixture(files[-1], _random_rows(23 + i, seed=10 + i))
    seen: list[float] = []
    for rank in range(world_size):
        cfg = CriteoConfig(
            paths=[str(f) for f in files], batch_size=5, rank=rank, world_size=world_size
        )
        got = _collect(CriteoReader(cfg))
        seen += [sum(d) for _, d, _ in got]
    every = [sum(d) for _, d, _ in _collect(CriteoReader(CriteoConfig(paths=files, batch_size=7)))]
    # Bit for bit: the same float32 values of each line, summed in the same order.
    assert sorted(seen) == sorted(every)
    assert len(seen) == 23 + 24


def test_resume_continues_after_the_last_batch(tmp_path: Path) -> None:
    path = tmp_path / "d.tsv"
    rows = _random_rows(30, seed=3)
    write_criteo_fixture(path, rows)
    cfg = CriteoConfig(paths=[str(path)], batch_size=4)
    first = CriteoReader(cfg)
    it = iter(first)
    head = [next(it), next(it)]
    pos = ReaderPosition(**{k: getattr(first.position, k) for k in first.position.__slots__})
    rest = _collect(CriteoReader(cfg, start=pos))
    head_samples = sum(b.size for b in head)
    assert head_samples == 8
    _assert_same(rest, [_expected(r, 100_000) for r in rows[8:]])


def test_hashing_spreads_and_separates_features() -> None:
    values = torch.arange(10_000, dtype=torch.int64)
    a = hash_categorical(values, 0, 1000)
    b = hash_categorical(values, 1, 1000)
    assert int(a.min()) >= 0 and int(a.max()) < 1000
    assert torch.bincount(a, minlength=1000).max() < 40  # ~10 per row expected
    assert float((a == b).float().mean()) < 0.01
    raw = hash_categorical(values, 0, None)
    assert int(raw.min()) >= 0 and raw.unique().numel() == 10_000


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r[:-1], "expected 40 tab-separated fields"),
        (lambda r: ["2", *r[1:]], "label must be 0 or 1, got '2'"),
        (lambda r: [r[0], "x7", *r[2:]], "field I1 must be an integer, got 'x7'"),
        (lambda r: [*r[:-1], "zz"], "field C26 must be hex, got 'zz'"),
        (lambda r: [*r[:-1], "1ffffffff"], "field C26 must be a 32-bit hex value"),
    ],
)
def test_bad_line_names_file_and_line_or_is_skipped(tmp_path: Path, mutate, message) -> None:
    rows = _random_rows(6, seed=4)
    rows[3] = mutate(rows[3])
    path = tmp_path / "bad.tsv"
    write_criteo_fixture(path, rows)
    with pytest.raises(ValueError, match=f"bad.tsv:4: {message}"):
        _collect(CriteoReader(CriteoConfig(paths=[str(path)], batch_size=2)))
    reader = CriteoReader(CriteoConfig(paths=[str(path)], batch_size=2, skip_bad_lines=True))
    good = rows[:3] + rows[4:]
    _assert_same(_collect(reader), [_expected(r, 100_000) for r in good])
    assert reader.skipped == 1


def test_empty_or_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.tsv is empty"):
        _collect(CriteoReader(CriteoConfig(paths=[str(empty)])))
    with pytest.raises(FileNotFoundError, match="nope.tsv does not exist"):
        CriteoReader(CriteoConfig(paths=[str(tmp_path / "nope.tsv")]))


def test_config_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        CriteoConfig(paths=["x"], batch_size=0)
    with pytest.raises(ValueError, match="rank 2 of world_size 2"):
        CriteoConfig(paths=["x"], rank=2, world_size=2)
    with pytest.raises(ValueError, match="paths is empty"):
        CriteoConfig(paths=[])

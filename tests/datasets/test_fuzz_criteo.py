"""Random and corrupted Criteo TSV files (hypothesis) through ``hybridrec.datasets.criteo``.

Each example writes a small file (plain or gzip) of canonical lines, with some
lines corrupted: a field dropped or added, a bad label, a non-integer count, a
non-hex or too-wide categorical, junk text or an empty line. The reader must

* on a clean file, yield exactly what an independent decoder gives (plain-Python
  ``log1p`` and a pure-Python SplitMix64, one line at a time);
* on a corrupted file, raise ValueError naming the file and the line number of the
  first bad line (and yield nothing past it), or, with ``skip_bad_lines=True``,
  yield exactly the good lines and count the bad ones;
* for a missing file, raise FileNotFoundError naming it.

Count: 300 examples (asserted).
"""

from __future__ import annotations

import gzip
import math
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridrec.datasets.criteo import CAT_NAMES, NUM_CAT, NUM_INT, CriteoConfig, CriteoReader

pytestmark = pytest.mark.timeout(180)

EXAMPLES = 300
NUM_ROWS = 1000
MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function on the uint64 ``x`` (pure Python, independent of ps)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _decode(fields: list[str]) -> tuple[float, list[float], list[list[int]]]:
    label = float(fields[0])
    dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1 : 1 + NUM_INT]]
    cats: list[list[int]] = []
    for j, v in enumerate(fields[1 + NUM_INT :]):
        if not v:
            cats.append([])
            continue
        h = _splitmix64(int(v, 16) * 32 + j)
        signed = h - (1 << 64) if h >= 1 << 63 else h
        cats.append([signed % NUM_ROWS])
    return label, dense, cats


def good_line(rng: random.Random) -> list[str]:
    """A canonical line: counts may be missing or negative, categoricals missing or 8 hex."""
    ints = ["" if rng.random() < 0.2 else str(rng.randint(-5, 10**6)) for _ in range(NUM_INT)]
    cats = ["" if rng.random() < 0.2 else f"{rng.getrandbits(32):08x}" for _ in range(NUM_CAT)]
    return [rng.choice(["0", "1"]), *ints, *cats]


CORRUPTIONS = [
    "drop field",
    "extra field",
    "label",
    "int",
    "float int",
    "hex",
    "wide hex",
    "junk",
    "empty",
]


@st.composite
def files(draw: st.DrawFn) -> dict[str, Any]:
    # The clean lines come from a drawn seed (cheap); hypothesis draws the corruptions.
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    rows = [good_line(rng) for _ in range(draw(st.integers(1, 12)))]
    lines: list[bytes] = [("\t".join(r) + "\n").encode() for r in rows]
    bad: list[int] = []  # 0-based indices of corrupted lines
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(0, len(rows) - 1))
        kind = draw(st.sampled_from(CORRUPTIONS))
        r = list(rows[i])
        text: bytes
        if kind == "drop field":
            del r[draw(st.integers(0, len(r) - 1))]
        elif kind == "extra field":
            r.append(draw(st.sampled_from(["", "0", "ab"])))
        elif kind == "label":
            r[0] = draw(st.sampled_from(["2", "-1", "", "yes", "0.5", " 1"]))
        elif kind == "int":
            r[1 + draw(st.integers(0, NUM_INT - 1))] = draw(st.sampled_from(["x", "1e3", "--1"]))
        elif kind == "float int":
            r[1 + draw(st.integers(0, NUM_INT - 1))] = "1.5"
        elif kind == "hex":
            r[1 + NUM_INT + draw(st.integers(0, NUM_CAT - 1))] = draw(
                st.sampled_from(["zz", "g1", "0x", "-"])
            )
        elif kind == "wide hex":
            r[1 + NUM_INT + draw(st.integers(0, NUM_CAT - 1))] = "1" + "0" * 8
        if kind == "junk":
            text = (
                draw(
                    st.text(min_size=1, max_size=30).filter(
                        lambda s: "\n" not in s and "\r" not in s
                    )
                ).encode()
                + b"\n"
            )
            if text.count(b"\t") == 39:
                continue  # could be a valid line by chance; not a corruption
        elif kind == "empty":
            text = b"\n"
        else:
            text = ("\t".join(r) + "\n").encode()
        lines[i] = text
        bad.append(i)
    return {
        "rows": rows,
        "lines": lines,
        "bad": sorted(set(bad)),
        "gz": draw(st.booleans()),
        "batch_size": draw(st.integers(1, 5)),
    }


def _collect(reader: CriteoReader) -> list[tuple[float, list[float], list[list[int]]]]:
    out = []
    for batch in reader:
        lists = {k: batch.sparse[k].to_lists() for k in CAT_NAMES}
        for i in range(batch.size):
            cats = [lists[k][i] for k in CAT_NAMES]
            out.append((float(batch.labels[i]), batch.dense[i].tolist(), cats))
    return out


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return float(np.float32(x))


def test_every_count_rounds_unambiguously_to_float32() -> None:
    """Every count a good line holds (-5..10**6, clipped at 0) has a log1p far from a
    float32 rounding boundary: all float64 numbers within 16 ulp of it round to the same
    float32. So any float64 log1p accurate to a few ulp (the reader's numpy one, SIMD on
    some CPUs; math.log1p here) rounds to the same float32, and the reader's dense values
    are compared bit for bit with the float32 rounding of math.log1p."""
    v = np.log1p(np.arange(10**6 + 1, dtype=np.float64))
    step = 16 * np.spacing(v)
    assert np.array_equal((v - step).astype(np.float32), (v + step).astype(np.float32))


def _assert_same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for (gl, gd, gc), (wl, wd, wc) in zip(got, want, strict=True):
        assert gl == wl and gc == wc
        # Bit for bit, see test_every_count_rounds_unambiguously_to_float32.
        assert gd == [_f32(w) for w in wd], (gd, wd)


def test_random_and_corrupted_files() -> None:
    count = [0, 0]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(files())
    def run(f: dict[str, Any]) -> None:
        count[0] += 1
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / ("day.tsv.gz" if f["gz"] else "day.tsv")
            data = b"".join(f["lines"])
            path.write_bytes(gzip.compress(data) if f["gz"] else data)
            cfg = CriteoConfig(paths=[str(path)], batch_size=f["batch_size"], num_rows=NUM_ROWS)
            good = [_decode(r) for i, r in enumerate(f["rows"]) if i not in f["bad"]]
            if not f["bad"]:
                _assert_same(_collect(CriteoReader(cfg)), good)
                return
            count[1] += 1
            first = f["bad"][0] + 1
            with pytest.raises(ValueError) as info:
                _collect(CriteoReader(cfg))
            assert f"{path.name}:{first}" in str(info.value), str(info.value)
            cfg.skip_bad_lines = True
            reader = CriteoReader(cfg)
            _assert_same(_collect(reader), good)
            assert reader.skipped == len(f["bad"])
            with pytest.raises(FileNotFoundError, match="missing.tsv"):
                CriteoReader(CriteoConfig(paths=[str(Path(tmp) / "missing.tsv")]))

    run()
    assert count[0] >= EXAMPLES and count[1] >= EXAMPLES // 3, count


def test_bytes_that_are_not_utf8_name_the_line_and_can_be_skipped(tmp_path: Path) -> None:
    row = ["1", *["3"] * NUM_INT, *["0000abcd"] * NUM_CAT]
    good = ("\t".join(row) + "\n").encode()
    path = tmp_path / "day.tsv"
    path.write_bytes(good + good[:5] + b"\xff\xfe" + good[5:] + good)
    cfg = CriteoConfig(paths=[str(path)], batch_size=2, num_rows=NUM_ROWS)
    with pytest.raises(ValueError, match="day.tsv:2"):
        _collect(CriteoReader(cfg))
    cfg.skip_bad_lines = True
    reader = CriteoReader(cfg)
    _assert_same(_collect(reader), [_decode(row), _decode(row)])
    assert reader.skipped == 1

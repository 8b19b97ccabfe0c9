"""The DLRM job on Criteo TSV files: streamed, sharded by line, hashed or dynamic tables.

A fixture file with a learnable signal (the click depends on C1, C2 and I1; the other
fields are noise with missing values) is written by the test, never downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import comm
from criteo_fixture import write_criteo_fixture
from hybridrec.datasets.criteo import NUM_CAT, NUM_INT
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import train
from multiproc import ROOT, run_ranks

SCRIPT = ROOT / "examples" / "train_dlrm.py"
HOT = [f"{v:08x}" for v in (0x68FD1E64, 0x05DB9164, 0x8CF07265, 0xBE589B51, 0x5A9ED9B0)]


def _rows(n: int, seed: int) -> list[list[str]]:
    """Clicks from a hidden rule: any of C1 in the first two hot values, C2 = the third,
    I1 > 20 (plus noise); the other fields are noise with missing values."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        c1, c2, i1 = rng.choice(HOT), rng.choice(HOT), rng.randint(0, 40)
        score = (c1 in HOT[:2]) + (c2 == HOT[2]) + (i1 > 20) - 0.5 + rng.gauss(0, 0.3)
        row = ["1" if score > 0 else "0", str(i1)]
        row += ["" if rng.random() < 0.2 else str(rng.randint(-2, 500)) for _ in range(NUM_INT - 1)]
        row += [c1, c2]
        row += [
            "" if rng.random() < 0.3 else f"{rng.getrandbits(4):08x}" for _ in range(NUM_CAT - 2)
        ]
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("criteo")
    write_criteo_fixture(d / "train.tsv.gz", _rows(2400, seed=1))
    write_criteo_fixture(d / "val.tsv", _rows(600, seed=2))
    return {"train": str(d / "train.tsv.gz"), "val": str(d / "val.tsv")}


def _cfg(files: dict[str, str], **kw: object) -> DLRMJobConfig:
    base: dict[str, object] = dict(
        data="criteo", criteo_path=[files["train"]], criteo_val_path=[files["val"]],
        batch_size=64, epochs=2, dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], lr=0.01, emb_lr=0.1,
        verbose=False, progress=False, log_every=5, eval_batch_size=256,
    )  # fmt: skip
    base.update(kw)
    return DLRMJobConfig(**base)  # type: ignore[arg-type]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rows", [1000, 0])  # hashed into 1000 rows; raw ids, dynamic tables
def test_trains_on_a_criteo_file(files: dict[str, str], rows: int, tmp_path: Path) -> None:
    out = tmp_path / "m.jsonl"
    result = train(_cfg(files, criteo_rows=rows, metrics_out=str(out)), comm.LocalGroup())
    # 2400 lines / 64 = 37 full batches per epoch (the last 32 lines are dropped).
    assert result["steps"] == 2 * 37
    assert result["test_auc"] is None and "popularity_auc" not in result  # no test split
    assert result["val_auc"] > 0.85, result["epochs"]  # the hidden rule is learnable
    assert result["epochs"][1]["train_loss"] < result["epochs"][0]["train_loss"]
    assert result["config"]["criteo_rows"] == rows
    kinds = [json.loads(line)["kind"] for line in out.read_text().splitlines()]
    assert kinds.count("epoch") == 2 and kinds[-1] == "final"


@pytest.mark.timeout(240)
def test_two_ranks_read_disjoint_lines_of_the_same_global_batches(
    files: dict[str, str], tmp_path: Path
) -> None:
    """Line i goes to rank i mod 2: the two ranks' halves make the one-rank batches."""
    one = train(_cfg(files, epochs=1, log_every=1), comm.LocalGroup())
    out = tmp_path / "m.jsonl"
    args = [
        "--data", "criteo", "--criteo-path", files["train"], "--criteo-val-path", files["val"],
        "--batch-size", "64", "--epochs", "1", "--dim", "8", "--bottom-mlp", "16", "8",
        "--top-mlp", "16", "1", "--lr", "0.01", "--emb-lr", "0.1", "--log-every", "1",
        "--no-progress", "--eval-batch-size", "256", "--metrics-out", str(out),
    ]  # fmt: skip
    run_ranks(SCRIPT, 2, "mpi", args=args, timeout=220)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    two = rows[-1]
    assert two["world_size"] == 2 and two["steps"] == one["steps"] == 37
    # A gate, not a rounding bound (docs/numerics.md, "Whole jobs across worker counts").
    assert two["val_auc"] == pytest.approx(one["val_auc"], abs=1e-5)
    assert two["epochs"][0]["train_loss"] == pytest.approx(one["epochs"][0]["train_loss"], abs=1e-5)


def test_bad_line_names_file_and_line_or_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _rows(100, seed=3)
    rows[41] = rows[41][:20]  # a short line: line 42 of the file
    rows[70] = rows[70][:5]
    path = tmp_path / "bad.tsv"
    write_criteo_fixture(path, rows)
    cfg = dict(criteo_path=[str(path)], criteo_val_path=[], batch_size=32, epochs=1)
    with pytest.raises(ValueError, match=f"{path}:42: expected 40 tab-separated fields"):
        train(_cfg({"train": "", "val": ""}, **cfg), comm.LocalGroup())
    out = tmp_path / "m.jsonl"
    skip = dict(cfg, skip_bad_lines=True, verbose=True, metrics_out=str(out))
    result = train(_cfg({"train": "", "val": ""}, **skip), comm.LocalGroup())
    assert result["steps"] == 98 // 32
    assert "val_auc" not in result  # no validation files: training loss only
    # The count is reported on screen and in the metrics file's final line.
    assert "skipped malformed lines: 2 train, 0 validation" in capsys.readouterr().out
    final = json.loads(out.read_text().splitlines()[-1])
    assert (final["skipped_lines_train"], final["skipped_lines_val"]) == (2, 0)


def test_missing_file_is_named(tmp_path: Path) -> None:
    cfg = _cfg({"train": str(tmp_path / "nope.tsv"), "val": ""}, criteo_val_path=[])
    with pytest.raises(FileNotFoundError, match="nope.tsv does not exist"):
        train(cfg, comm.LocalGroup())

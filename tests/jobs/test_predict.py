"""``hybridrec predict``: every row of the input files scored exactly once, beside its key
columns, in file and line order, at 1, 2 and 4 ranks; the scores are the model's.

* One process: each row's score equals the one the saved model gives that row through
  ``hybridrec evaluate``'s path (the same batches through the same model: bit for bit
  against the evaluation's probabilities of the same file).
* Under ``mpirun -n 2`` and ``-n 4`` (each rank scores every n-th row): every key once, the
  scores equal the one-process ones within float32 rounding (batches of another size).
* A file without a label column scores; a bad row names its line or is skipped with
  ``--skip-bad-lines``; csv, jsonl and parquet hold the same; without pyarrow, parquet
  is a clear error before anything is scored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import comm
from hybridrec.cli.predict import main as predict_main
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import train
from multiproc import ROOT, mpirun_path, rank_env
from tabular_clicks import CLICKS_SCHEMA, read_scores, write_clicks
from tolerance import assert_close

SMALL = dict(
    batch_size=100, epochs=1, dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1],
    verbose=False, progress=False,
)  # fmt: skip
USERS = [f"u{i}" for i in range(30)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tabular run's checkpoint folder, and its files beside it."""
    tmp = tmp_path_factory.mktemp("predict")
    write_clicks(tmp / "train.csv", 1_000, 1, USERS)
    write_clicks(tmp / "score.csv", 257, 2, USERS + ["never-seen"])  # an odd count of rows
    (tmp / "schema.json").write_text(json.dumps(CLICKS_SCHEMA))
    cfg = DLRMJobConfig(
        data="tabular", data_path=[str(tmp / "train.csv")], schema=str(tmp / "schema.json"),
        checkpoint_dir=str(tmp / "ckpt"), keep_best=False, **SMALL,  # type: ignore[arg-type]
    )  # fmt: skip
    train(cfg, comm.LocalGroup())
    return tmp


@pytest.mark.timeout(240)
def test_every_row_scored_once_in_order_with_its_keys(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "scores.csv"
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
                  "--out", str(out), "--key", "user", "item", "--no-progress"])  # fmt: skip
    rows = read_scores(out)
    source = (trained / "score.csv").read_text().splitlines()[1:]
    assert len(rows) == len(source) == 257
    for got, line in zip(rows, source, strict=True):
        _, _, user, item = line.split(",")
        assert (got["user"], got["item"]) == (user, item)
        assert 0.0 < float(got["score"]) < 1.0
    # Without --key: rows named by file and line (data from line 2, after the header).
    out2 = tmp_path / "scores.jsonl"
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
                  "--out", str(out2), "--no-progress"])  # fmt: skip
    named = [json.loads(line) for line in out2.read_text().splitlines()]
    assert [r["line"] for r in named] == list(range(2, 259))
    assert [r["score"] for r in named] == [float(r["score"]) for r in rows]


@pytest.mark.timeout(240)
def test_scores_are_the_models(trained: Path, tmp_path: Path) -> None:
    """The same probabilities as the evaluation's path (predictions over the same file
    as a test split): the same encoder, batches and model."""
    from hybridrec.cli.evaluate import job_config, saved_run
    from hybridrec.dlrm.evaluate import predictions

    out = tmp_path / "s.csv"
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
                  "--out", str(out), "--no-progress"])  # fmt: skip
    got = torch.tensor([float(r["score"]) for r in read_scores(out)], dtype=torch.float64)
    run = saved_run(str(trained / "ckpt"), None, [])  # type: ignore[arg-type]
    cls, cfg = job_config(run, ["--data-test-path", str(trained / "score.csv")], "test")
    job = cls(cfg, comm.LocalGroup(), __import__("ps").InProcessStore(),
              saved_config=run.meta["config"])  # fmt: skip
    job.load_saved(run.model)
    probs, _, _ = predictions(job.model, job.source.eval_batches("test"), job.group, False,
                              job.feed)  # fmt: skip
    # Bit for bit: the same float32 probabilities, written with repr (round-trips).
    assert torch.equal(got, probs.double())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 4])
def test_under_mpirun_every_row_once(trained: Path, tmp_path: Path, ranks: int) -> None:
    one, many = tmp_path / "one.csv", tmp_path / "many.csv"
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
                  "--out", str(one), "--key", "user", "--no-progress"])  # fmt: skip
    cmd = [mpirun_path(), "-n", str(ranks), sys.executable, "-m", "hybridrec", "predict",
           "--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
           "--out", str(many), "--key", "user", "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=240,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = read_scores(one), read_scores(many)
    assert [r["user"] for r in b] == [r["user"] for r in a] and len(b) == 257
    # Each rank's batches hold other rows: float32 sums may round differently per batch.
    eps = float(np.finfo(np.float32).eps)
    assert_close(torch.tensor([float(r["score"]) for r in b]),
                 torch.tensor([float(r["score"]) for r in a]), atol=8 * eps,
                 what="scores", why="float32 logits from batches of other rows")  # fmt: skip


@pytest.mark.timeout(240)
def test_unlabelled_files_bad_rows_and_formats(trained: Path, tmp_path: Path) -> None:
    lines = (trained / "score.csv").read_text().splitlines()
    unlabelled = tmp_path / "u.csv"
    unlabelled.write_text("\n".join(",".join(l.split(",")[1:]) for l in lines) + "\n")  # noqa: E741
    out = tmp_path / "u.csv.out.jsonl"
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(unlabelled),
                  "--out", str(out), "--no-progress"])  # fmt: skip
    assert len(out.read_text().splitlines()) == 257
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([*lines[:5], "1,notanumber,u1,i1", *lines[5:10]]) + "\n")
    with pytest.raises(SystemExit) as info:
        predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(bad),
                      "--out", str(tmp_path / "b.csv"), "--no-progress"])  # fmt: skip
    assert info.value.code == 2
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(bad), "--out",
                  str(tmp_path / "b.csv"), "--skip-bad-lines", "--no-progress"])  # fmt: skip
    kept = read_scores(tmp_path / "b.csv")
    # the header, 4 rows (lines 2-5), the bad one (line 6), 5 more (lines 7-11)
    assert [r["line"] for r in kept] == ["2", "3", "4", "5", "7", "8", "9", "10", "11"]
    with pytest.raises(SystemExit):
        predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(bad),
                      "--out", str(tmp_path / "b.txt")])  # fmt: skip
    import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]

    pq_out = tmp_path / "s.parquet"
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
                  "--out", str(pq_out), "--key", "user", "item", "--no-progress"])  # fmt: skip
    csv_out = tmp_path / "s.csv"
    predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
                  "--out", str(csv_out), "--key", "user", "item", "--no-progress"])  # fmt: skip
    table = pq.read_table(pq_out).to_pydict()
    want = read_scores(csv_out)
    assert list(table) == ["user", "item", "score"] and len(table["score"]) == 257
    assert table["user"] == [r["user"] for r in want]
    assert table["score"] == [float(r["score"]) for r in want]  # float64 both, repr round-trips


@pytest.mark.timeout(120)
def test_parquet_without_pyarrow_is_refused_before_scoring(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("pyarrow", "pyarrow.parquet"):  # a user without the extra
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as info:
        predict_main(["--checkpoint", str(trained / "ckpt"), "--input", str(trained / "score.csv"),
                      "--out", str(tmp_path / "s.parquet")])  # fmt: skip
    assert info.value.code == 2
    assert not (tmp_path / "s.parquet").exists()


@pytest.mark.timeout(240)
def test_criteo_lines_scored_once_in_order(tmp_path: Path) -> None:
    """A Criteo run's scores for a new TSV file: each line once, named by file and line,
    the same probabilities as the evaluation's path gives its validation split."""
    import random

    from criteo_fixture import write_criteo_fixture
    from hybridrec.cli.evaluate import job_config, saved_run
    from hybridrec.datasets.criteo import NUM_CAT, NUM_INT
    from hybridrec.dlrm.evaluate import predictions
    from ps import InProcessStore

    rng = random.Random(3)

    def rows(n: int) -> list[list[str]]:
        def line() -> list[str]:
            ints = [str(rng.randint(0, 40)) for _ in range(NUM_INT)]
            return [
                str(rng.randint(0, 1)),
                *ints,
                *(f"{rng.getrandbits(6):08x}" for _ in range(NUM_CAT)),
            ]

        return [line() for _ in range(n)]

    write_criteo_fixture(tmp_path / "day0.tsv", rows(600))
    write_criteo_fixture(tmp_path / "day1.tsv", rows(133))
    cfg = DLRMJobConfig(data="criteo", criteo_path=[str(tmp_path / "day0.tsv")], criteo_rows=300,
                        checkpoint_dir=str(tmp_path / "ckpt"), keep_best=False, **SMALL)  # type: ignore[arg-type]  # fmt: skip
    train(cfg, comm.LocalGroup())
    out = tmp_path / "s.jsonl"
    predict_main(["--checkpoint", str(tmp_path / "ckpt"), "--input", str(tmp_path / "day1.tsv"),
                  "--out", str(out), "--no-progress"])  # fmt: skip
    got = [json.loads(s) for s in out.read_text().splitlines()]
    assert [r["line"] for r in got] == list(range(1, 134))
    run = saved_run(str(tmp_path / "ckpt"), None, [])  # type: ignore[arg-type]
    cls, job_cfg = job_config(run, ["--criteo-val-path", str(tmp_path / "day1.tsv")], "test")
    job = cls(job_cfg, comm.LocalGroup(), InProcessStore(), saved_config=run.meta["config"])
    job.load_saved(run.model)
    probs, _, _ = predictions(job.model, job.source.eval_batches("val"), job.group, False,
                              job.feed)  # fmt: skip
    assert torch.equal(torch.tensor([r["score"] for r in got], dtype=torch.float64), probs.double())
    with pytest.raises(SystemExit):
        predict_main(["--checkpoint", str(tmp_path / "ckpt"), "--input", str(tmp_path / "day1.tsv"),
                      "--out", str(out), "--key", "C1"])  # fmt: skip

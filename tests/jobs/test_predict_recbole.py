"""``hybridrec predict`` of a RecBole-format run: a folder of atomic files (``.inter``,
joined with ``.user`` and ``.item``) scored with the vocabularies, counts and statistics
the run saved, every interaction once, at 1, 2 and 4 ranks.

* The run's own folder: each score equals the saved model's probability of that row
  built from the run's own in-memory data (the same rows in the same batches through the
  same model: bit for bit).
* A new folder (other interactions, a user and an item the run never saw, no rating
  field): the rows it shares with the run's folder score as they did there (within
  float32 rounding: batches of other rows), which needs the saved encoders (refitted on
  the new folder, the vocabularies would number users differently).
* Under ``mpirun -n 2`` and ``-n 4``: every interaction once, in line order (the run
  trained with batch 50, which 4 ranks do not split: scoring reads no training batch).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import comm
from hybridrec.cli.predict import main as predict_main
from hybridrec.datasets.ctr import gather_batch
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import train
from multiproc import ROOT, mpirun_path, rank_env
from tabular_clicks import read_scores
from tolerance import assert_close

USERS = [f"u{i}" for i in range(25)]
ITEMS = [f"m{i}" for i in range(40)]
EPS32 = float(np.finfo(np.float32).eps)


def _folder(root: Path, interactions: list[tuple[str, str, int | None]]) -> Path:
    """A RecBole folder ``root`` named ``shop``: the interactions (a rating, or none),
    each user's city and age, each item's price and genres."""
    root.mkdir()
    rated = interactions[0][2] is not None
    head = "uid:token\tiid:token" + ("\trating:float" if rated else "")
    lines = [head] + [f"{u}\t{i}" + (f"\t{r}" if rated else "") for u, i, r in interactions]
    (root / "shop.inter").write_text("\n".join(lines) + "\n")
    users = sorted({u for u, _, _ in interactions})
    (root / "shop.user").write_text(
        "uid:token\tcity:token\tage:float\n"
        + "".join(f"{u}\tc{int(u[1:]) % 4}\t{20 + int(u[1:])}\n" for u in users)
    )
    items = sorted({i for _, i, _ in interactions})
    (root / "shop.item").write_text(
        "iid:token\tprice:float\tgenres:token_seq\n"
        + "".join(f"{i}\t{int(i[1:]) * 0.5}\tg{int(i[1:]) % 3} g{int(i[1:]) % 5}\n" for i in items)
    )
    return root


def _interactions(n: int, seed: int) -> list[tuple[str, str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u, i = rng.choice(USERS), rng.choice(ITEMS)
        likes = (int(u[1:]) + int(i[1:])) % 3 == 0
        out.append((u, i, 5 if likes and rng.random() < 0.8 else rng.randint(1, 5)))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("predict_recbole")
    _folder(tmp / "train", _interactions(600, 1))
    cfg = DLRMJobConfig(
        data="recbole", data_path=[str(tmp / "train")], checkpoint_dir=str(tmp / "ckpt"),
        keep_best=False, batch_size=50, epochs=1, dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1],
        eval_batch_size=64, verbose=False, progress=False,
    )  # fmt: skip
    train(cfg, comm.LocalGroup())
    return tmp


def _predict(trained: Path, folder: Path, out: Path, *keys: str) -> list[dict[str, str]]:
    argv = ["--checkpoint", str(trained / "ckpt"), "--input", str(folder), "--out", str(out)]
    predict_main([*argv, *(["--key", *keys] if keys else []), "--no-progress"])
    return read_scores(out)


@pytest.mark.timeout(240)
def test_the_runs_folder_scores_as_the_saved_model(trained: Path, tmp_path: Path) -> None:
    from hybridrec.cli.evaluate import job_config, saved_run
    from ps import InProcessStore

    rows = _predict(trained, trained / "train", tmp_path / "s.csv")
    inter = trained / "train" / "shop.inter"
    assert [r["file"] for r in rows] == [str(inter)] * 600
    assert [int(r["line"]) for r in rows] == list(range(2, 602))
    run = saved_run(str(trained / "ckpt"), None, [])  # type: ignore[arg-type]
    cls, cfg = job_config(run, [], "test")
    job = cls(cfg, comm.LocalGroup(), InProcessStore(), saved_config=run.meta["config"])
    job.load_saved(run.model)
    job.model.eval()
    want = []
    with torch.no_grad():
        for idx in torch.arange(600).split(cfg.eval_batch_size):
            want.append(torch.sigmoid(job.model(gather_batch(job.source.data, idx)).float()))
    # Bit for bit: the saved encoders give the run's own tensors for its own folder, and
    # the same batches run through the same model.
    got = torch.tensor([float(r["score"]) for r in rows], dtype=torch.float64)
    assert torch.equal(got, torch.cat(want).double())


@pytest.mark.timeout(240)
def test_a_new_folder_encodes_as_the_run_did(trained: Path, tmp_path: Path) -> None:
    whole = _predict(trained, trained / "train", tmp_path / "whole.csv", "uid", "iid")
    seen = [(u, i, None) for u, i, _ in _interactions(600, 1)[::7]]  # every 7th row
    new = _folder(tmp_path / "new", [("u99", "m0", None), *seen, ("u1", "m41", None)])
    rows = _predict(trained, new, tmp_path / "new.csv", "uid", "iid")
    wanted = [("u99", "m0"), *((u, i) for u, i, _ in seen), ("u1", "m41")]
    assert [(r["uid"], r["iid"]) for r in rows] == wanted
    assert all(0.0 < float(r["score"]) < 1.0 for r in rows)
    # The shared rows' features are the run's (saved vocabularies, train counts and
    # statistics), so their scores are: float32 logits of batches of other rows.
    assert_close(torch.tensor([float(r["score"]) for r in rows[1:-1]]),
                 torch.tensor([float(r["score"]) for r in whole[::7]]), atol=8 * EPS32,
                 what="scores", why="float32 logits from batches of other rows")  # fmt: skip
    with pytest.raises(SystemExit):
        _predict(trained, new, tmp_path / "bad.csv", "city_of_birth")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 4])
def test_under_mpirun_every_interaction_once(trained: Path, tmp_path: Path, ranks: int) -> None:
    one = _predict(trained, trained / "train", tmp_path / "one.csv", "uid", "iid")
    many = tmp_path / "many.csv"
    cmd = [mpirun_path(), "-n", str(ranks), sys.executable, "-m", "hybridrec", "predict",
           "--checkpoint", str(trained / "ckpt"), "--input", str(trained / "train"),
           "--out", str(many), "--key", "uid", "iid", "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=240,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    b = read_scores(many)
    assert [(r["uid"], r["iid"]) for r in b] == [(r["uid"], r["iid"]) for r in one]
    assert_close(torch.tensor([float(r["score"]) for r in b]),
                 torch.tensor([float(r["score"]) for r in one]), atol=8 * EPS32,
                 what="scores", why="float32 logits from batches of other rows")  # fmt: skip

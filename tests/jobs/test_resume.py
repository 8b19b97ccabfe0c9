"""--resume continues a run exactly: the loss after resuming equals the loss of an
uninterrupted run at the same step bit for bit (at the saving worker count every rank loads
exactly the state it saved, docs/numerics.md), for DLRM (1 rank with every placement, Criteo
mid-file, and under mpirun -n 2) and the language model; plus the checkpoint format.

"Interrupted" runs stop at a shorter ``max_steps`` and write
their checkpoint; the resumed run reads the newest checkpoint and goes on to the end.
The step-loss lines of the metrics file (``--log-every 1``) are compared step by step.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import comm
from criteo_fixture import write_criteo_fixture
from hybridrec.checkpoint.run_checkpoint import (
    flatten,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    save_checkpoint,
    unflatten,
    write_state,
)
from hybridrec.datasets.criteo import NUM_CAT, NUM_INT
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import main as dlrm_main
from hybridrec.dlrm.job import train
from hybridrec.lm.config import LMConfig
from hybridrec.lm.job import train as train_lm
from multiproc import ROOT, run_ranks
from resume_runs import DLRM, SMALLER, interrupted_equals_uninterrupted, losses
from tolerance import assert_same


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "extra",
    [
        dict(),  # local tables, DataParallel + Adam
        # hybrid tables behind a cache (bounds 0), one table sharded, ZeRO stage 2 + Adagrad
        dict(cache_rows=64, placement_of=["cat2=sharded"], zero_stage=2, dense_optimizer="adagrad"),
    ],
)
def test_dlrm_resume_one_rank(extra: dict[str, Any], tmp_path: Path) -> None:
    def run(cfg: DLRMJobConfig) -> dict[str, Any]:
        return train(cfg, comm.LocalGroup())

    interrupted_equals_uninterrupted(run, DLRMJobConfig, {**DLRM, **extra}, tmp_path,
                                     dict(max_steps=11), SMALLER)  # fmt: skip


def _criteo_rows(n: int) -> list[list[str]]:
    rng = random.Random(0)
    return [
        [str(rng.randint(0, 1))]
        + [str(rng.randint(0, 50)) for _ in range(NUM_INT)]
        + [f"{rng.getrandbits(6):08x}" for _ in range(NUM_CAT)]
        for _ in range(n)
    ]


@pytest.mark.timeout(240)
def test_criteo_resumes_mid_file(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    write_criteo_fixture(path, _criteo_rows(1_000))
    base = {**DLRM, "data": "criteo", "criteo_path": [str(path)], "criteo_rows": 0,
            "batch_size": 40}  # fmt: skip

    def run(cfg: DLRMJobConfig) -> dict[str, Any]:
        return train(cfg, comm.LocalGroup())

    interrupted_equals_uninterrupted(run, DLRMJobConfig, base, tmp_path, dict(max_steps=9), SMALLER)


@pytest.mark.timeout(300)
def test_dlrm_resume_under_mpirun(tmp_path: Path) -> None:
    script = ROOT / "examples" / "train_dlrm.py"
    names = ("data", "synthetic_samples", "synthetic_rows", "batch_size", "epochs", "dim")
    args = [f"--{k.replace('_', '-')}={DLRM[k]}" for k in names]
    args += ["--bottom-mlp", "16", "8", "--top-mlp", "16", "1", "--log-every", "1", "--no-progress"]
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    ck = f"--checkpoint-dir={tmp_path / 'ck'}"
    run_ranks(script, 2, "mpi", [*args, f"--metrics-out={full}"], timeout=200)
    run_ranks(script, 2, "mpi", [*args, f"--metrics-out={part}", ck, "--max-steps=13"], 200)
    shutil.copytree(tmp_path / "ck", tmp_path / "ck1")
    run_ranks(script, 2, "mpi", [*args, f"--metrics-out={part}", ck, "--resume"], timeout=200)
    want, got = losses(full), losses(part)
    assert sorted(got) == sorted(want) == list(range(1, 33))
    for step in want:  # bit for bit: resumed at the saving worker count
        assert got[step] == want[step], (step, got[step], want[step])
    final = json.loads(part.read_text().splitlines()[-1])
    assert final["world_size"] == 2 and final["steps"] == 32
    # The 2-worker checkpoint resumed by one worker: the model reshards, the global batches
    # are the same, so the losses follow the 2-worker run (up to the reduction order).
    one = tmp_path / "one.jsonl"
    ck1 = f"--checkpoint-dir={tmp_path / 'ck1'}"
    dlrm_main([*args, f"--metrics-out={one}", ck1, "--resume", "--backend=local"])
    got1 = losses(one)
    assert sorted(got1) == list(range(14, 33)), sorted(got1)
    # A gate, not a rounding bound (docs/numerics.md, "Whole jobs across worker counts").
    for step in got1:
        assert got1[step] == pytest.approx(want[step], abs=1e-4), step
    final = json.loads(one.read_text().splitlines()[-1])
    assert final["world_size"] == 1 and final["steps"] == 32


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ngram", [{}, dict(ngram=3, ngram_rows=2048, ngram_splits=2)])
def test_lm_resume_one_rank(tmp_path: Path, ngram: dict[str, int]) -> None:
    """Also with hashed n-gram tables: their rows and optimizer state are in the
    checkpoint, and a resume with another n-gram shape is refused like any shape change."""
    base = dict(
        max_bytes=200_000, block_size=32, batch_size=8, n_layer=1, n_head=2, d_model=32,
        max_steps=24, eval_every=10, eval_batches=2, dropout=0.1,  # dropout: the RNG is restored
        verbose=False, progress=False, log_every=1, **ngram,
    )  # fmt: skip

    def run(cfg: LMConfig) -> dict[str, Any]:
        return train_lm(cfg, comm.LocalGroup())

    interrupted_equals_uninterrupted(run, LMConfig, base, tmp_path, dict(max_steps=9),
                                     dict(d_model=16, n_layer=2))  # fmt: skip


# ---------------------------------------------------------------- the checkpoint format


def test_nested_state_round_trips_without_pickle(tmp_path: Path) -> None:
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1, betas=(0.8, 0.9))
    net(torch.ones(4, 3)).sum().backward()
    opt.step()
    state = {"opt": opt.state_dict(), "net": net.state_dict(), "n": [1, (2.5, None)], "s": "x"}
    write_state(tmp_path / "s", state)
    back = read_state(tmp_path / "s")
    assert back["n"] == [1, (2.5, None)] and back["s"] == "x"
    assert back["opt"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert set(back["opt"]["state"]) == {0, 1}  # int keys stay ints
    for key, t in opt.state_dict()["state"][0].items():
        assert_same(back["opt"]["state"][0][key], t, what=f"optimizer state {key}",
                    why="a .npy file stores the tensor's bits")  # fmt: skip
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    fresh.load_state_dict(back["opt"])  # torch accepts it as is
    for file in (tmp_path / "s").glob("*.npy"):
        np.load(file, allow_pickle=False)  # plain arrays only
    with pytest.raises(TypeError, match="cannot store a object"):
        flatten(object(), {})
    assert unflatten(flatten({3: torch.ones(2)}, t := {}), t)[3].tolist() == [1.0, 1.0]


def _modules() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    from embedding import EmbeddingCollection, TableConfig

    net = torch.nn.Linear(2, 2)
    ec = EmbeddingCollection([TableConfig(name="t", num_rows=5, dim=2, feature_names=["f"])])
    return net, torch.optim.SGD(net.parameters(), lr=0.1), ec


def test_saves_are_atomic_pruned_and_checked(tmp_path: Path) -> None:
    g = comm.LocalGroup()
    net, opt, ec = _modules()
    kw = dict(group=g, dense=net, optimizer=opt, embeddings=ec, meta={"epoch": 0}, keep=2)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, **kw)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002",
                                                          "step-00000003"]  # fmt: skip
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
    bad = dict(kw, meta={"x": object()})  # not JSON: the save fails, nothing changes
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 4, **bad)  # type: ignore[arg-type]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    meta_file = tmp_path / "step-00000003" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(ValueError, match="written by 2 worker ranks; this job has 1"):
        load_checkpoint(tmp_path / "step-00000003", group=g, dense=net, optimizer=opt,
                        embeddings=ec)  # fmt: skip

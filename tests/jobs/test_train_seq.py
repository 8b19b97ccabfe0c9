"""The sequential-recommender job: options, learning, N ranks = one process, placements.

Every rank count trains on the same global batches of users (each rank takes its
share), the item rows are kept equal by the embedding collection and the encoder's
gradients are averaged; each rank scales its summed loss by ``size / global
targets``, so 2 and 4 ranks reproduce one process on the global batch up to float
summation order. Bounds (0, 0) through the cache are the uncached store bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import comm
from hybridrec.datasets.sequences import LeaveOneOut, SequenceBatches
from hybridrec.datasets.synthetic_sequences import synthetic_sequences
from hybridrec.seq.config import SeqConfig
from hybridrec.seq.job import SeqJob, parse_args, popularity_ranks, summary_line, train
from hybridrec.seq.softmax import sampled_softmax_loss
from multiproc import free_port, rank_env, run_ranks
from ps import InProcessStore

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_seq.py"
# Small and quick: synthetic histories the encoder can learn (each item's usual
# successor), full softmax over 300 items; a few seconds per run. Batches of users
# without context windows: 6 steps an epoch (the default windows have their own tests).
SMALL: dict[str, Any] = dict(
    data="synthetic", synthetic_items=300, synthetic_users=96, synthetic_length=14,
    synthetic_zipf=0.6, max_seq_len=12, dim=16, n_layer=1, n_head=2, batch_size=16, epochs=3,
    patience=0, batch_unit="users", train_context=0,
    lr=1e-2, emb_lr=1e-2, eval_batch_size=40, dropout=0.0,
)  # fmt: skip


def _argv(cfg: dict[str, Any]) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]


def _run(**over: Any) -> dict[str, Any]:
    cfg = SeqConfig(**(SMALL | {"verbose": False, "progress": False} | over))  # type: ignore[arg-type]
    return train(cfg, comm.LocalGroup())


def _losses(result: dict[str, Any]) -> list[float]:
    return [e["train_loss"] for e in result["epochs"]]


def test_defaults_and_errors() -> None:
    assert parse_args([]) == SeqConfig()
    cfg = parse_args(["--model", "hstu", "--loss", "sampled", "--negatives", "64"])
    assert (cfg.model, cfg.loss, cfg.negatives, cfg.model_dropout) == ("hstu", "sampled", 64, 0.2)
    assert SeqConfig().model_dropout == 0.5
    assert (SeqConfig().batch_unit, SeqConfig().batch_size) == ("windows", 64)
    assert SeqConfig().window_context == 45 and SeqConfig(max_seq_len=20).window_context == 18
    assert SeqConfig(train_windows="last").window_context == 0
    assert SeqConfig(train_context=3).window_context == 3
    with pytest.raises(ValueError, match=r"train_context must be in \[0, max_seq_len = 50\), got"):
        SeqConfig(train_context=50)
    with pytest.raises(ValueError, match="dim 30 must be a multiple of n_head 4"):
        SeqConfig(dim=30, n_head=4)
    with pytest.raises(ValueError, match="data 'recbole' needs data_path DIR"):
        SeqConfig(data="recbole")
    with pytest.raises(ValueError, match="negatives must be >= 0, got -1"):
        SeqConfig(negatives=-1)
    assert SeqConfig(cache_fraction=0.1).table_placement == "hybrid"
    assert SeqConfig().table_placement == "local"


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return _run()


@pytest.mark.timeout(120)
def test_learns_and_beats_popularity(one_process: dict[str, Any]) -> None:
    """The synthetic histories follow each item's successor half the time: the encoder
    learns it (loss falls, test HR@10 well above the popularity baseline's)."""
    r = one_process
    losses = _losses(r)
    assert losses[-1] < losses[0] - 0.3, losses
    assert r["test_hr@10"] >= 2 * r["popularity_hr@10"], r
    assert 0 <= r["test_ndcg@10"] <= r["test_hr@10"] <= r["test_hr@50"] <= r["test_hr@200"] <= 1
    assert r["loss"] == "full" and r["items"] == 300
    assert r["samples_per_s"] > 0
    line = summary_line(r)
    assert line.startswith("test HR@10 ") and "NDCG@10" in line and "popularity HR@10" in line


def test_popularity_ranks_against_a_loop() -> None:
    """The baseline's ranks: items counted more often than the target in training, the
    user's earlier items left out with exclusion (a plain loop as the reference)."""
    data = synthetic_sequences(items=50, users=30, length=8, zipf=1.1, seed=3)
    split = LeaveOneOut.of(data)
    batches = SequenceBatches(
        split, max_seq_len=5, batch_size=4, rank=0, size=1, seed=0
    ).eval_batches("test", 7)
    counts = split.item_train_counts()
    for exclude in (False, True):
        got = popularity_ranks(split, batches, exclude).tolist()
        want = []
        for b in batches:
            for i, t in enumerate(b.targets.tolist()):
                seen = set(b.seen_items[b.seen_offsets[i] : b.seen_offsets[i + 1]].tolist())
                want.append(sum(
                    1 for j in range(50)
                    if j != t and counts[j] > counts[t] and not (exclude and j in seen)
                ))  # fmt: skip
        assert got == want


@pytest.mark.timeout(120)
def test_hstu_and_sampled_softmax_learn() -> None:
    hstu = _run(model="hstu", epochs=8)
    assert _losses(hstu)[-1] < _losses(hstu)[0] - 0.3
    assert hstu["test_hr@10"] >= 2 * hstu["popularity_hr@10"], hstu
    sampled = _run(loss="sampled", negatives=32, epochs=6)
    assert sampled["loss"] == "sampled"
    assert sampled["test_hr@10"] >= 2 * sampled["popularity_hr@10"], sampled


@pytest.mark.timeout(120)
def test_placements_equal_and_bounds_zero_through_the_cache_bit_for_bit(
    one_process: dict[str, Any],
) -> None:
    """The item table's rows are the same numbers in every placement: hybrid over the
    in-process store runs the same optimizer on the same rows as the local table, and
    bounds (0, 0) through the cache read and push exactly what the store would."""
    hybrid = _run(placement="hybrid", sparse_pipeline="off")
    cached = _run(placement="hybrid", cache_fraction=0.25, read_bound=0, write_bound=0)
    # the next batch's rows pulled ahead on the sparse pipeline's thread: the same pulls
    # and pushes in the same order, so the same numbers
    pipelined = _run(placement="hybrid", sparse_pipeline="on")
    sampled = [_run(placement="hybrid", loss="sampled", negatives=16, sparse_pipeline=on)
               for on in ("off", "on")]  # fmt: skip
    for other in (cached, pipelined):
        assert _losses(other) == _losses(hybrid)
        for k in ("test_hr@10", "test_ndcg@10", "test_mrr", "val_ndcg@10"):
            assert other[k] == hybrid[k], k
    assert _losses(sampled[0]) == _losses(sampled[1])
    assert sampled[0]["test_ndcg@10"] == sampled[1]["test_ndcg@10"]
    # local vs hybrid: the same rows and updates (Adam in the store vs in the fused local
    # table), within float32 rounding of a few steps
    assert _losses(hybrid) == pytest.approx(_losses(one_process), rel=1e-4)


@pytest.mark.timeout(120)
def test_a_cache_under_bounds_learns_as_the_store() -> None:
    """Bounds (4, 4): the copies lag the store by at most 4 updates; the run still
    learns the successor structure (the next batch's rows ride on this batch's pull)."""
    plain = _run(placement="hybrid", epochs=6)
    stale = _run(placement="hybrid", epochs=6, cache_fraction=0.25, read_bound=4, write_bound=4)
    assert stale["cache_hit_rate"] > 0.1  # flat Zipf 0.6 ids: about the cache's share
    assert stale["test_hr@10"] >= 2 * stale["popularity_hr@10"], stale
    assert _losses(stale)[-1] == pytest.approx(_losses(plain)[-1], rel=0.05)


@pytest.mark.timeout(120)
@pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY
@pytest.mark.parametrize("loss", ["full", "sampled"])
def test_context_positions_are_read_not_predicted(loss: str) -> None:
    """With ``--train-context`` a step's loss is the mean cross entropy of the scored
    positions only (the model still reads every input): the reference scores the whole
    batch with the same weights and keeps the scored rows (float32, summation order)."""
    cfg = SeqConfig(**(SMALL | dict(verbose=False, progress=False, train_context=5, loss=loss,
                                    negatives=16)))  # type: ignore[arg-type]  # fmt: skip
    job = SeqJob(cfg, comm.LocalGroup(), InProcessStore())
    batch, _ = next(job.source.train_batches(0))
    assert batch.scored is not None and 0 < batch.num_targets < len(batch.items)
    picked = job.candidates_of(batch)
    ids = torch.arange(job.num_items) if picked is None else picked.ids
    with torch.no_grad():
        hidden, rows = job.model(batch, ids)
    kept = hidden[batch.scored]  # [T, D]
    if picked is None:
        want = torch.nn.functional.cross_entropy(kept @ rows.T, batch.targets)
    else:
        want = sampled_softmax_loss(kept, rows, picked) / batch.num_targets
    got = job.step(batch)
    job.trainer.close()
    # T positive float32 terms summed in another order: each side's error is at most
    # T * 2^-24 of the sum, so the two differ by at most twice that.
    assert float(got) == pytest.approx(float(want), rel=2 * batch.num_targets * 2.0**-24)


@pytest.mark.timeout(120)
def test_default_windows_learn_and_beat_popularity() -> None:
    """The default batches: windows shuffled across users, each predicting its last
    targets after 9/10 of ``max_seq_len`` inputs (here 10 of 12); the run learns the
    successors as the user batches do."""
    cfg = SeqConfig(**(SMALL | dict(batch_unit="windows", train_context=None)))  # type: ignore[arg-type]
    assert cfg.window_context == 10
    r = _run(batch_unit="windows", train_context=None)
    # ~11 targets per user, 2 per window: > 4 windows a user, > 24 steps of 16 an epoch
    assert r["steps"] > 3 * 24, r["steps"]
    assert _losses(r)[-1] < _losses(r)[0]
    assert r["test_hr@10"] >= 2 * r["popularity_hr@10"], r


@pytest.mark.timeout(120)
def test_exclude_seen_only_lowers_ranks() -> None:
    """Leaving the user's earlier items out of the ranking can only move targets up."""
    plain = _run(epochs=1)
    excl = _run(epochs=1, exclude_seen=True)
    assert _losses(plain) == _losses(excl)  # training is the same
    assert excl["test_hr@10"] >= plain["test_hr@10"]
    assert excl["test_mrr"] >= plain["test_mrr"]


def _assert_matches(final: dict[str, Any], reference: dict[str, Any], nprocs: int) -> None:
    """A run's final metrics line equals the one-process ``reference``: the per-epoch
    training loss within float32 summation noise, and the ranking metrics (integer ranks
    of 96 users) within one user's share where a near-tie may flip."""
    assert final["kind"] == "final" and final["world_size"] == nprocs
    assert _losses(final) == pytest.approx(_losses(reference), rel=2e-4)
    for k in ("test_hr@10", "test_ndcg@10", "val_hr@10"):
        assert final[k] == pytest.approx(reference[k], abs=1.5 / 96), k


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("backend", "nprocs", "placement", "over", "extra"),
    [
        ("mpi", 1, "local", {}, []),
        ("mpi", 2, "local", {}, []),
        ("mpi", 4, "hybrid", {}, ["--zero-stage=1"]),
        ("gloo", 2, "sharded", {}, []),
        ("mpi", 2, "local", {"loss": "sampled", "negatives": 32}, []),
        ("mpi", 2, "local", {"train_context": 5}, []),
        ("mpi", 4, "local", {"batch_unit": "windows", "train_context": 5}, []),
        ("gloo", 2, "local", {"batch_unit": "windows"}, []),
    ],
)
def test_ranks_match_one_process(
    backend: str,
    nprocs: int,
    placement: str,
    over: dict[str, Any],
    extra: list[str],
    tmp_path: Path,
    one_process: dict[str, Any],
) -> None:
    """The script under mpirun / gloo equals the one-process run on the global batch
    (``over``: options of both runs; ``extra``: of the ranks' run only)."""
    out = tmp_path / "m.jsonl"
    args = [*_argv(SMALL | over), f"--backend={backend}", f"--placement={placement}",
            f"--metrics-out={out}", *extra]  # fmt: skip
    text = "\n".join(run_ranks(SCRIPT, nprocs, backend, args=args, timeout=220))
    assert "test HR@10" in text, text
    final = json.loads(out.read_text().splitlines()[-1])
    _assert_matches(final, _run(**over) if over else one_process, nprocs)


@pytest.mark.timeout(300)
@pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY
def test_torchrun_equals_one_process(tmp_path: Path, one_process: dict[str, Any]) -> None:
    """``torchrun --nproc_per_node 2`` (its own rendezvous, gloo chosen from its
    environment) trains as the one-process run does."""
    out = tmp_path / "t.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # need not sit beside python
    cmd = [*torchrun, "--nproc_per_node", "2", "--master-port", str(free_port()), str(SCRIPT),
           *_argv(SMALL), f"--metrics-out={out}"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "test HR@10" in run.stdout, run.stdout
    _assert_matches(json.loads(out.read_text().splitlines()[-1]), one_process, 2)


@pytest.mark.timeout(180)
def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """A run stopped after epoch 1 and resumed ends where the uninterrupted run does."""
    whole = _run(epochs=2)
    ckpt = tmp_path / "ckpt"
    _run(epochs=1, checkpoint_dir=str(ckpt))
    resumed = _run(epochs=2, checkpoint_dir=str(ckpt), resume=True)
    assert resumed["test_hr@10"] == whole["test_hr@10"]
    assert resumed["test_ndcg@10"] == whole["test_ndcg@10"]
    assert resumed["epochs"][-1]["train_loss"] == whole["epochs"][-1]["train_loss"]


@pytest.mark.timeout(180)
def test_evaluate_command_equals_the_runs_test_metrics(tmp_path: Path) -> None:
    from hybridrec.cli import evaluate

    ckpt = tmp_path / "ckpt"
    run = _run(epochs=2, checkpoint_dir=str(ckpt))
    out = tmp_path / "eval.json"
    evaluate.main(["--checkpoint", str(ckpt), "--split", "all", "--out", str(out)])
    got = json.loads(out.read_text())
    for k in ("hr@10", "ndcg@10", "mrr"):
        assert got[f"test_{k}"] == run[f"test_{k}"], k
        assert got[f"val_{k}"] == run[f"val_{k}"], k


@pytest.mark.timeout(120)
def test_movielens_history_job_runs_one_step() -> None:
    """The default data: MovieLens-100k's 943 users and 1682 items, full softmax."""
    cfg = SeqConfig(max_steps=2, epochs=1, verbose=False, progress=False, eval_batch_size=512)
    job = SeqJob(cfg, comm.LocalGroup(), InProcessStore())
    assert job.num_items == 1682 and job.data.num_users == 943 and job.full_softmax
    result = job.close(job.trainer.fit())
    assert result["steps"] == 2 and np.isfinite(result["test_ndcg@10"])
    assert torch.isfinite(torch.tensor(result["epochs"][-1]["train_loss"]))

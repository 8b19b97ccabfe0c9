"""Train DLRM on MovieLens-100k (or synthetic Criteo-shaped data), on 1 or N ranks.

    python examples/train_dlrm.py                      # MovieLens, one process
    mpirun -n 2 python examples/train_dlrm.py          # the same job on two ranks
    python examples/train_dlrm.py --data synthetic --synthetic-rows 100000

Every rank reads the whole data set and trains on its slice of each global batch:
dense weights start equal (broadcast from rank 0) and their gradients are averaged
every step; the embedding collection combines row gradients across ranks itself.
Rank 0 prints the training loss and validation AUC per epoch, then the held-out
test AUC and log loss next to a popularity baseline (each item's training click
rate).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

if __package__ in (None, ""):  # run as a file: make the `examples` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

import comm
from comm import ProcessGroup
from dense import allreduce_gradients, broadcast_parameters
from examples.data import CTRData, gather_batch, load_movielens, make_synthetic
from examples.dlrm_model import DLRM, build_dlrm
from examples.metrics import log_loss, popularity_scores, roc_auc


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    data: Literal["movielens", "synthetic"] = "movielens"
    # None: 3 for MovieLens; 1 for synthetic, as usual for Criteo-like click logs,
    # whose long tail of rare ids a second epoch mostly memorizes.
    epochs: int | None = None
    batch_size: int = 256  # global: split evenly over the ranks
    lr: float = 1e-3  # dense optimizer
    dense_optimizer: Literal["adam", "adagrad"] = "adam"
    emb_lr: float = 0.05  # row-wise Adagrad on the embedding rows
    dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [64])  # + a layer of width dim
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])  # + a layer of width 1
    seed: int = 0
    synthetic_rows: int = 10_000
    synthetic_samples: int = 200_000
    max_steps: int = 0  # stop after this many steps in total; 0 = run every epoch fully
    eval_batch_size: int = 4096
    backend: str = "auto"
    validate_comm: bool = False  # cross-rank argument checks on every collective (slower)
    # torch threads per rank while training; 0 = torch's default. The model is small:
    # more threads mostly add synchronization, and on a busy or shared machine
    # busy-waiting OpenMP threads slow a step down by 10x and more.
    threads: int = 1
    metrics_out: str | None = None  # JSON lines, one per epoch plus a final one
    verbose: bool = True

    def __post_init__(self) -> None:
        if self.data not in ("movielens", "synthetic"):
            raise ValueError(f"data must be 'movielens' or 'synthetic', got {self.data!r}")
        if self.epochs is None:
            self.epochs = 3 if self.data == "movielens" else 1
        if self.dense_optimizer not in ("adam", "adagrad"):
            raise ValueError(
                f"dense_optimizer must be 'adam' or 'adagrad', got {self.dense_optimizer!r}"
            )
        for name in ("epochs", "batch_size", "dim", "synthetic_rows", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "emb_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.synthetic_samples < 10:
            raise ValueError(f"synthetic_samples must be >= 10, got {self.synthetic_samples}")


def load_data(cfg: TrainConfig) -> CTRData:
    if cfg.data == "movielens":
        return load_movielens(seed=cfg.seed)
    return make_synthetic(
        num_samples=cfg.synthetic_samples, num_rows=cfg.synthetic_rows, seed=cfg.seed
    )


def make_optimizer(cfg: TrainConfig, model: DLRM) -> torch.optim.Optimizer:
    """The dense optimizer; embedding rows are updated inside backward."""
    params = list(model.dense.parameters())
    if cfg.dense_optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.Adagrad(params, lr=cfg.lr)


def local_batches(
    data: CTRData, cfg: TrainConfig, group: ProcessGroup, epoch: int
) -> list[torch.Tensor]:
    """This rank's sample indices for each full global batch of ``epoch``.

    The shuffle is the same on every rank (seeded by seed and epoch); rank ``r``
    takes rows ``[r*b, (r+1)*b)`` of each global batch, ``b = batch_size / size``.
    """
    if cfg.batch_size % group.size != 0:
        raise ValueError(
            f"batch_size {cfg.batch_size} must be a multiple of the number of ranks "
            f"{group.size} (each rank takes an equal slice of a global batch)"
        )
    per_rank = cfg.batch_size // group.size
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    order = data.train_idx[torch.randperm(len(data.train_idx), generator=gen)]
    steps = len(order) // cfg.batch_size  # the last partial global batch is dropped
    start = group.rank * per_rank
    return [
        order[s * cfg.batch_size + start : s * cfg.batch_size + start + per_rank]
        for s in range(steps)
    ]


def train_step(
    model: DLRM, opt: torch.optim.Optimizer, data: CTRData, idx: torch.Tensor, group: ProcessGroup
) -> float:
    """One synchronous step on this rank's samples ``idx``; returns the local mean loss."""
    batch = gather_batch(data, idx)
    logits = model(batch)  # [b]
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # embedding rows are updated here (synchronized across ranks)
    allreduce_gradients(model.dense, group)
    opt.step()
    return float(loss.detach())


@torch.no_grad()
def predict(
    model: DLRM, data: CTRData, idx: torch.Tensor, group: ProcessGroup, batch_size: int
) -> np.ndarray:
    """Click probabilities for samples ``idx`` (``[n]``), scored in shards over ranks."""
    shard = torch.tensor_split(idx, group.size)[group.rank]
    model.eval()
    parts = [
        torch.sigmoid(model(gather_batch(data, shard[i : i + batch_size])))
        for i in range(0, len(shard), batch_size)
    ]
    model.train()
    mine = torch.cat(parts) if parts else torch.empty(0)
    return group.allgatherv(mine.contiguous()).double().numpy()  # [n] in idx order


def evaluate(
    model: DLRM, data: CTRData, idx: torch.Tensor, cfg: TrainConfig, group: ProcessGroup
) -> tuple[float, float]:
    """AUC and log loss of the model on samples ``idx``."""
    probs = predict(model, data, idx, group, cfg.eval_batch_size)
    labels = data.labels[idx].numpy()
    return roc_auc(labels, probs), log_loss(labels, probs)


def popularity_baseline(data: CTRData) -> tuple[float, float]:
    """AUC and log loss on the test split of each item's smoothed training click rate."""
    items = data.feature(data.item_feature).ids[:, 0]  # [N]
    scores = popularity_scores(
        items[data.train_idx], data.labels[data.train_idx], items[data.test_idx]
    )
    labels = data.labels[data.test_idx].numpy()
    return roc_auc(labels, scores), log_loss(labels, scores)


def train(cfg: TrainConfig, group: ProcessGroup) -> dict[str, Any]:
    """Train and evaluate; returns the metrics (the same on every rank but for timings)."""
    before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, group)
    finally:
        torch.set_num_threads(before)


def _train(cfg: TrainConfig, group: ProcessGroup) -> dict[str, Any]:
    say = print if (cfg.verbose and group.rank == 0) else (lambda *a, **k: None)
    record = cfg.metrics_out if group.rank == 0 else None
    if record:
        Path(record).write_text("")
    data = load_data(cfg)
    model = build_dlrm(
        data,
        dim=cfg.dim,
        emb_lr=cfg.emb_lr,
        bottom_mlp=cfg.bottom_mlp,
        top_mlp=cfg.top_mlp,
        seed=cfg.seed,
        group=group,
    )
    broadcast_parameters(model.dense, group)
    opt = make_optimizer(cfg, model)
    say(
        f"DLRM on {cfg.data}: {data.num_samples} samples ({len(data.train_idx)} train), "
        f"{len(data.sparse)} sparse + {len(data.dense_names)} dense features, "
        f"{group.size} rank(s) ({group.backend})"
    )

    epochs: list[dict[str, Any]] = []
    steps, train_seconds = 0, 0.0
    assert cfg.epochs is not None  # resolved in TrainConfig.__post_init__
    for epoch in range(cfg.epochs):
        t0 = time.perf_counter()
        loss_sum = torch.zeros(2, dtype=torch.float64)  # [sum of local mean losses, steps]
        for idx in local_batches(data, cfg, group, epoch):
            if cfg.max_steps and steps >= cfg.max_steps:
                break
            loss_sum += torch.tensor([train_step(model, opt, data, idx, group), 1.0])
            steps += 1
        train_seconds += time.perf_counter() - t0
        group.allreduce(loss_sum, op="sum")
        val_auc, val_logloss = evaluate(model, data, data.val_idx, cfg, group)
        row = {
            "kind": "epoch",
            "epoch": epoch + 1,
            "steps": steps,
            "train_loss": float(loss_sum[0] / loss_sum[1].clamp_min(1)),
            "val_auc": val_auc,
            "val_logloss": val_logloss,
        }
        epochs.append(row)
        say(
            f"epoch {epoch + 1}: train loss {row['train_loss']:.4f}  "
            f"val AUC {val_auc:.4f}  val logloss {val_logloss:.4f}"
        )
        _append_json(record, row)
        if cfg.max_steps and steps >= cfg.max_steps:
            break

    test_auc, test_logloss = evaluate(model, data, data.test_idx, cfg, group)
    pop_auc, pop_logloss = popularity_baseline(data)
    result: dict[str, Any] = {
        "kind": "final",
        "config": asdict(cfg),
        "epochs": epochs,
        "steps": steps,
        "world_size": group.size,
        "test_auc": test_auc,
        "test_logloss": test_logloss,
        "popularity_auc": pop_auc,
        "popularity_logloss": pop_logloss,
        "train_seconds": train_seconds,
        "samples_per_s": steps * cfg.batch_size / max(train_seconds, 1e-9),
    }
    say(
        f"test AUC {test_auc:.4f}  logloss {test_logloss:.4f} | popularity AUC {pop_auc:.4f}  "
        f"logloss {pop_logloss:.4f} | {result['samples_per_s']:.0f} samples/s "
        f"({steps} steps, {train_seconds:.1f} s)"
    )
    _append_json(record, result)
    return result


def _append_json(path: str | None, row: dict[str, Any]) -> None:
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", choices=["movielens", "synthetic"], default=d.data)
    p.add_argument("--epochs", type=int, default=None, help="default: 3 MovieLens, 1 synthetic")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size")
    p.add_argument("--lr", type=float, default=d.lr, help="dense learning rate")
    p.add_argument("--dense-optimizer", choices=["adam", "adagrad"], default=d.dense_optimizer)
    p.add_argument("--emb-lr", type=float, default=d.emb_lr, help="row-wise Adagrad lr")
    p.add_argument("--dim", type=int, default=d.dim, help="embedding dimension")
    p.add_argument("--bottom-mlp", type=int, nargs="+", default=d.bottom_mlp)
    p.add_argument("--top-mlp", type=int, nargs="+", default=d.top_mlp)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--synthetic-rows", type=int, default=d.synthetic_rows)
    p.add_argument("--synthetic-samples", type=int, default=d.synthetic_samples)
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="0 = no limit")
    p.add_argument("--backend", default=d.backend, help="auto, local, mpi, gloo or nccl")
    p.add_argument(
        "--validate-comm", action="store_true", help="check collective arguments across ranks"
    )
    p.add_argument(
        "--threads", type=int, default=d.threads, help="torch threads per rank; 0 = default"
    )
    p.add_argument("--metrics-out", default=None, help="write JSON lines here (rank 0)")
    # Every option's dest is a TrainConfig field of the same name.
    return TrainConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    group = comm.init(cfg.backend, validate=cfg.validate_comm)
    try:
        train(cfg, group)
    finally:
        group.close()


if __name__ == "__main__":
    main()

"""Train DLRM on MovieLens-100k, synthetic or Criteo data, on 1 or N ranks.

    python examples/train_dlrm.py                                # MovieLens, one process
    mpirun -n 2 python examples/train_dlrm.py                    # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_dlrm.py      # ... under torchrun
    mpirun -n 3 python examples/train_dlrm.py --ps mpi           # 2 workers + 1 PS rank
    python examples/train_dlrm.py --data criteo --criteo-path day_0.gz --criteo-rows 0
    python examples/train_dlrm.py --config run.toml --checkpoint-dir ckpt --resume

Config -> build -> train -> close. Every worker trains on its slice of each global
batch: dense weights start equal (broadcast from rank 0) and their gradients are
averaged every step (``dense.DataParallel``, optionally compressed, or
``dense.ZeroOptimizer``); the embedding collection keeps its tables consistent
itself (replicated local tables, a parameter-server store behind an optional cache,
or tables sharded over the ranks). Rank 0 prints the validation AUC per epoch, the
test AUC and log loss next to a popularity baseline, and writes the metrics file
and its plot. ``--help`` lists every option.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

import comm
from cache import CachedStore
from comm import ProcessGroup, Topology
from dense import DataParallel, ZeroOptimizer
from hybridrec.checkpoint import DenseOptimizer, latest_checkpoint, load_checkpoint, save_checkpoint
from hybridrec.config import parse_config
from hybridrec.datasets.ctr import Batch
from hybridrec.dlrm.config import TrainConfig
from hybridrec.dlrm.data import CriteoSource, Feature, Source, auc_logloss, open_source
from hybridrec.dlrm.model import DLRM, build_dlrm, dlrm_tables
from hybridrec.launch import (
    PSRole,
    create_shared_tables,
    open_ps,
    topology_for,
    with_cache,
)
from hybridrec.metrics_log import MetricsLog, cache_metrics, store_metrics
from hybridrec.step_log import StepLog, due
from ps import InProcessStore, Store

T = TypeVar("T")

__all__ = ["TrainConfig", "main", "parse_args", "train", "train_step"]


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    return parse_config(TrainConfig, argv, __doc__.split("\n")[0])


# ---------------------------------------------------------------- build


def resolve_placements(cfg: TrainConfig, features: list[Feature]) -> dict[str, str]:
    """``{table: placement}`` from ``--placement`` and ``--placement-of``."""
    default: str = cfg.placement
    if default == "auto":
        dynamic = any(f.num_rows is None for f in features)
        default = "hybrid" if (cfg.cache_on or cfg.ps != "local" or dynamic) else "local"
    out: dict[str, str] = {f.name: default for f in features}
    for table, where in cfg.placement_overrides().items():
        if table not in out:
            raise ValueError(f"placement_of: no table {table!r}; the tables are {list(out)}")
        out[table] = where
    return out


def make_optimizer(cfg: TrainConfig, model: DLRM, group: ProcessGroup) -> DenseOptimizer:
    """The dense optimizer; wraps ``model.dense`` in ``DataParallel`` at ZeRO stage 0.

    Embedding rows are updated inside backward by their tables' optimizers."""
    cls = torch.optim.Adam if cfg.dense_optimizer == "adam" else torch.optim.Adagrad
    params = list(model.dense.parameters())
    if cfg.zero_stage:  # averages the gradients itself; broadcasts rank 0's weights
        return ZeroOptimizer(cls, params, group, stage=cfg.zero_stage, lr=cfg.lr)
    model.dense = DataParallel(
        model.dense, group, bucket_mb=cfg.bucket_mb, compression=cfg.compression
    )
    return cls(params, lr=cfg.lr)


def build(
    cfg: TrainConfig, source: Source, group: ProcessGroup, store: Store
) -> tuple[DLRM, DenseOptimizer, CachedStore | None]:
    placements = resolve_placements(cfg, source.features)
    cached = with_cache(cfg, store, group)
    if cached is not None and "hybrid" not in placements.values():
        raise ValueError(f"the cache serves hybrid tables, but the placements are {placements}")
    tables = dlrm_tables(source.features, dim=cfg.dim, emb_lr=cfg.emb_lr, placements=placements)
    create_shared_tables(store, [t.to_spec() for t in tables if t.placement == "hybrid"], group)
    model = build_dlrm(
        source.features,
        source.num_dense,
        dim=cfg.dim,
        emb_lr=cfg.emb_lr,
        bottom_mlp=cfg.bottom_mlp,
        top_mlp=cfg.top_mlp,
        seed=cfg.seed,
        group=group,
        placements=placements,
        store=cached if cached is not None else store,
    )
    return model, make_optimizer(cfg, model, group), cached


def dense_module(model: DLRM) -> torch.nn.Module:
    """The plain dense part (inside DataParallel, if wrapped): what a checkpoint holds."""
    return model.dense.module if isinstance(model.dense, DataParallel) else model.dense


# ---------------------------------------------------------------- steps


def train_step(
    model: DLRM, opt: DenseOptimizer, batch: Batch, next_batch: Batch | None = None
) -> float:
    """One synchronous step on this rank's ``batch``; returns its local mean loss.

    With ``next_batch``, its ids go to the embedding cache after the forward, so
    their rows are fetched while this batch runs backward."""
    logits = model(batch)  # [b]
    if next_batch is not None:
        model.embeddings.prefetch(next_batch.sparse)
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # rows updated here; DataParallel buckets allreduced meanwhile
    if isinstance(model.dense, DataParallel):
        model.dense.finish()
    opt.step()  # ZeroOptimizer: averages the gradients first
    return float(loss.detach())


def agreed(items: Iterable[T], group: ProcessGroup, check: bool) -> Iterator[T]:
    """``items`` while every rank still has one (``check``: one tiny allreduce per item;
    for streams, whose ranks may hold one batch more or less)."""
    it = iter(items)
    while True:
        item = next(it, None)
        if check:
            missing = torch.tensor([1 if item is None else 0], dtype=torch.int64)
            if int(group.allreduce(missing, op="max")):  # some rank ran out
                return
        if item is None:
            return
        yield item


def with_next(items: Iterator[T], lookahead: bool) -> Iterator[tuple[T, T | None]]:
    """``(item, next item or None)``; without ``lookahead`` next is always None."""
    cur = next(items, None)
    while cur is not None:
        nxt = next(items, None)
        yield cur, (nxt if lookahead else None)
        cur = nxt


@torch.no_grad()
def evaluate(
    model: DLRM, batches: Iterable[Batch], group: ProcessGroup, lockstep: bool
) -> tuple[float, float]:
    """AUC and log loss over every rank's ``batches`` (collective)."""
    model.eval()
    probs, labels = [torch.empty(0)], [torch.empty(0)]
    for b in agreed(batches, group, lockstep):
        probs.append(torch.sigmoid(model(b)).float())
        labels.append(b.labels.float())
    model.train()
    p = group.allgatherv(torch.cat(probs).contiguous())  # [n] over all ranks
    y = group.allgatherv(torch.cat(labels).contiguous())
    return auc_logloss(y, p)


# ---------------------------------------------------------------- train


def train(cfg: TrainConfig, group: ProcessGroup, store: Store | None = None) -> dict[str, Any]:
    """Train and evaluate on the workers ``group``; ``store`` holds the hybrid tables
    (default: a fresh in-process store). Returns the metrics (equal on every rank
    but for timings)."""
    before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, group, InProcessStore() if store is None else store)
    finally:
        torch.set_num_threads(before)


def _train(cfg: TrainConfig, group: ProcessGroup, store: Store) -> dict[str, Any]:
    say = print if (cfg.verbose and group.rank == 0) else (lambda *a, **k: None)
    source = open_source(cfg, group)
    model, opt, cached = build(cfg, source, group, store)
    stream = isinstance(source, CriteoSource)
    lockstep = model.embeddings.sharded is not None
    say(f"DLRM on {source.describe()}; {group.size} worker rank(s) ({group.backend})")

    epoch, skip, step, start_pos = 0, 0, 0, None
    resume_from = (
        latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir and cfg.resume else None
    )
    if resume_from is not None:
        meta, start_pos = load_checkpoint(
            resume_from, group=group, dense=dense_module(model), optimizer=opt,
            embeddings=model.embeddings,
        )  # fmt: skip
        epoch, skip, step = meta["epoch"], meta["step_in_epoch"], meta["step"]
        say(f"resumed from {resume_from} at step {step} (epoch {epoch + 1})")
    elif cfg.resume:
        say(f"no checkpoint in {cfg.checkpoint_dir}: starting from scratch")

    assert cfg.epochs is not None  # resolved in TrainConfig.__post_init__
    spe = source.steps_per_epoch
    total = spe * cfg.epochs if spe is not None else None
    if cfg.max_steps:
        total = min(total, cfg.max_steps) if total is not None else cfg.max_steps
    log = MetricsLog(cfg.metrics_out if group.rank == 0 else None, append=resume_from is not None)

    def extras() -> dict[str, float]:
        if cached is not None:
            return cache_metrics(cached.cache_stats())
        if model.embeddings.hybrid is not None:
            return store_metrics(model.embeddings.store.stats())
        return {}

    steps = StepLog(
        group=group, log=log, log_every=cfg.log_every, samples_per_step=cfg.batch_size,
        total_steps=total, start_step=step, progress=cfg.progress, extras=extras,
    )  # fmt: skip

    def checkpoint(at_epoch: int, in_epoch: int, pos: torch.Tensor | None) -> None:
        assert cfg.checkpoint_dir is not None
        save_checkpoint(
            cfg.checkpoint_dir, step, group=group, dense=dense_module(model), optimizer=opt,
            embeddings=model.embeddings, rank_state=pos, keep=cfg.checkpoint_keep,
            meta={"epoch": at_epoch, "step_in_epoch": in_epoch, "config": asdict(cfg)},
        )  # fmt: skip

    def validate(kind: str, **fields: Any) -> dict[str, Any] | None:
        if not source.has_split("val"):
            return None
        auc, logloss = evaluate(model, source.eval_batches("val"), group, lockstep)
        row = {"kind": kind, "step": step, **fields, "val_auc": auc, "val_logloss": logloss}
        if cached is not None:
            row["cache_hit_rate"] = cache_metrics(cached.cache_stats())["cache_hit_rate"]
        log.write(row)
        return row

    epochs: list[dict[str, Any]] = []
    train_seconds, stopped = 0.0, False
    for e in range(epoch, cfg.epochs):
        t0 = time.perf_counter()
        loss_sum = torch.zeros(2, dtype=torch.float64)  # [sum of local mean losses, steps]
        in_epoch = skip if e == epoch else 0
        batches = source.train_batches(e, in_epoch, start_pos if e == epoch else None)
        pos = None
        for (batch, pos), nxt in with_next(agreed(batches, group, stream), cached is not None):
            loss = train_step(model, opt, batch, None if nxt is None else nxt[0])
            loss_sum += torch.tensor([loss, 1.0], dtype=torch.float64)
            step += 1
            in_epoch += 1
            steps.step(step, loss)
            if cfg.checkpoint_dir and due(step, cfg.checkpoint_every):
                checkpoint(e, in_epoch, pos)
            if due(step, cfg.eval_every):
                validate("eval")
            if cfg.max_steps and step >= cfg.max_steps:
                stopped = True
                break
        train_seconds += time.perf_counter() - t0
        steps.flush(step)
        group.allreduce(loss_sum, op="sum")
        train_loss = float(loss_sum[0] / loss_sum[1].clamp_min(1))
        row = validate("epoch", epoch=e + 1, steps=step, train_loss=train_loss) or {
            "kind": "epoch", "epoch": e + 1, "steps": step, "train_loss": train_loss,
        }  # fmt: skip
        epochs.append(row)
        say(
            f"epoch {e + 1}: train loss {train_loss:.4f}"
            + (f"  val AUC {row['val_auc']:.4f}  val logloss {row['val_logloss']:.4f}"
               if "val_auc" in row else "")
        )  # fmt: skip
        if stopped:
            end_epoch, end_in_epoch, end_pos = e, in_epoch, pos
            break
    else:
        end_epoch, end_in_epoch, end_pos = cfg.epochs, 0, None
    steps.close()

    if cached is not None:
        cached.flush()  # every pending row update reaches the store
    if cfg.checkpoint_dir:
        checkpoint(end_epoch, end_in_epoch, end_pos if stream and stopped else None)
    result = finish(cfg, group, model, source, lockstep, epochs, step, train_seconds)
    if cached is not None:
        result["cache"] = cached.cache_stats()
        result.update(cache_metrics(result["cache"]))
    if isinstance(model.dense, DataParallel) and model.dense.codec is not None:
        result["codec_stats"] = dict(model.dense.codec.stats)
    test = (
        f"test AUC {result['test_auc']:.4f}  logloss {result['test_logloss']:.4f}"
        if result.get("test_auc") is not None
        else "no test split"
    )
    pop = (
        f" | popularity AUC {result['popularity_auc']:.4f}  "
        f"logloss {result['popularity_logloss']:.4f}"
        if "popularity_auc" in result
        else ""
    )
    say(
        f"{test}{pop} | {result['samples_per_s']:.0f} samples/s ({step} steps, "
        f"{train_seconds:.1f} s)"
    )
    log.write(result)
    png = log.close()
    if png is not None:
        say(f"metrics: {cfg.metrics_out}, plot: {png}")
    return result


def finish(
    cfg: TrainConfig,
    group: ProcessGroup,
    model: DLRM,
    source: Source,
    lockstep: bool,
    epochs: list[dict[str, Any]],
    steps: int,
    train_seconds: float,
) -> dict[str, Any]:
    """The final summary: test metrics, the popularity baseline, throughput."""
    result: dict[str, Any] = {
        "kind": "final",
        "config": asdict(cfg),
        "epochs": epochs,
        "steps": steps,
        "world_size": group.size,
        "train_seconds": train_seconds,
        "samples_per_s": steps * cfg.batch_size / max(train_seconds, 1e-9),
        "test_auc": None,
        "test_logloss": None,
    }
    if epochs and "val_auc" in epochs[-1]:
        result["val_auc"], result["val_logloss"] = epochs[-1]["val_auc"], epochs[-1]["val_logloss"]
    if source.has_split("test"):
        auc, logloss = evaluate(model, source.eval_batches("test"), group, lockstep)
        result["test_auc"], result["test_logloss"] = auc, logloss
    baseline = source.baseline()
    if baseline is not None:
        result["popularity_auc"], result["popularity_logloss"] = baseline
    return result


# ---------------------------------------------------------------- main


def check_roles(cfg: TrainConfig, world: ProcessGroup) -> Topology:
    """The job's roles, checked against the config on every rank before anything starts."""
    topo = topology_for(cfg.ps, world)
    if cfg.batch_size % topo.num_workers:
        raise ValueError(
            f"batch_size {cfg.batch_size} must be a multiple of the {topo.num_workers} worker "
            f"rank(s) ({topo.world_size} ranks, {topo.num_servers} of them parameter servers)"
        )
    return topo


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    world = comm.init(cfg.backend, validate=cfg.validate_comm)
    role: PSRole | None = None
    try:
        check_roles(cfg, world)
        role = open_ps(cfg.ps, world)  # a server rank serves here until the workers close
        if role.store is not None:
            train(cfg, role.group, role.store)
    finally:
        if role is not None and role.store is not None:
            role.store.close()
        world.close()

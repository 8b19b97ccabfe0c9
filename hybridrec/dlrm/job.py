"""Train DLRM on MovieLens-100k, synthetic, Criteo, tabular or RecBole data, on 1 or N ranks.

    python examples/train_dlrm.py                                # MovieLens, one process
    mpirun -n 2 python examples/train_dlrm.py                    # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_dlrm.py      # ... under torchrun
    mpirun -n 3 python examples/train_dlrm.py --ps mpi           # 2 workers + 1 PS rank
    python examples/train_dlrm.py --data criteo --criteo-path day_0.gz --criteo-rows 0
    python examples/train_dlrm.py --config run.toml --checkpoint-dir ckpt --resume

Config -> build -> train -> close, on :class:`hybridrec.train.loop.Trainer` and
:class:`hybridrec.launch.roles.Launch`. Every worker trains on its slice of each global
batch: dense weights start equal (broadcast from rank 0) and their gradients are
averaged every step (``dense.DataParallel``, optionally compressed, or
``dense.ZeroOptimizer``); the embedding collection keeps its tables consistent
itself (replicated local tables, a parameter-server store behind an optional cache,
or tables sharded over the ranks). Rank 0 prints the validation AUC per epoch, the
test AUC and log loss next to a popularity baseline, and writes the metrics file
and its plot. ``--help`` lists every option.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from cache import CachedStore
from comm import ProcessGroup, Topology, worker_device
from dense import DataParallel, DLRMConfig, DLRMDense, ZeroOptimizer
from hybridrec.checkpoint.row_dtypes import ROW_DTYPES_KEY, converted_rows
from hybridrec.checkpoint.run_checkpoint import DenseOptimizer
from hybridrec.cli.options import config_dict
from hybridrec.cli.run_job import parse_job_args, run_job, train_in_group
from hybridrec.datasets.ctr import Batch
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.data import Feature, Source, StreamSource, open_source
from hybridrec.dlrm.evaluate import evaluate_saved, predictions
from hybridrec.dlrm.model import DLRM, build_dlrm, dlrm_tables
from hybridrec.launch.existing_tables import prepare_tables
from hybridrec.launch.job_cache import (
    init_rows_on,
    job_memory_plan,
    wants_sparse_pipeline,
    with_cache,
)
from hybridrec.launch.memory_plan import MemoryPlan, dense_bytes
from hybridrec.launch.roles import (
    check_batch_size,
    describe_device,
    describe_roles,
)
from hybridrec.train.click_metrics import CLICK_METRICS, click_report, metric_values
from hybridrec.train.device_batches import DeviceBatches, DeviceEpochData
from hybridrec.train.loop import Trainer, TrainerConfig, TrainResult
from hybridrec.train.metric_window import ClickWindow
from hybridrec.train.metrics_file import cache_metrics, store_metrics
from hybridrec.train.precision import autocast
from ps import Store

__all__ = ["DLRMJob", "DLRMJobConfig", "main", "parse_args", "train", "train_step"]

# Options that change the shapes a checkpoint holds: a resume names those that differ.
SHAPE_OPTIONS = (
    "data", "dim", "bottom_mlp", "top_mlp", "placements", "criteo_rows", "synthetic_rows",
    "dense_optimizer", "zero_stage", "interaction", "dcn_layers", "dcn_rank",
)  # fmt: skip

DESCRIPTION = __doc__.split("\n")[0]


def parse_args(argv: list[str] | None = None) -> DLRMJobConfig:
    return parse_job_args(DLRMJob, argv)


# ---------------------------------------------------------------- build


def resolve_placements(cfg: DLRMJobConfig, features: list[Feature]) -> dict[str, str]:
    """``{table: placement}`` from ``--placement`` and ``--placement-of``."""
    default: str = cfg.placement
    if default == "auto":
        dynamic = any(f.num_rows is None for f in features)
        default = "hybrid" if (cfg.wants_cache or cfg.ps != "local" or dynamic) else "local"
    out: dict[str, str] = {f.name: default for f in features}
    for table, where in cfg.placement_overrides().items():
        if table not in out:
            raise ValueError(f"placement_of: no table {table!r}; the tables are {list(out)}")
        out[table] = where
    return out


def resolve_dtypes(cfg: DLRMJobConfig, features: list[Feature]) -> dict[str, str]:
    """``{table: row dtype}`` from ``--emb-dtype`` and ``--emb-dtype-of``."""
    return dict(cfg.table_dtypes([f.name for f in features]))


def make_optimizer(cfg: DLRMJobConfig, model: DLRM, group: ProcessGroup) -> DenseOptimizer:
    """The dense optimizer; wraps ``model.dense`` in ``DataParallel`` at ZeRO stage 0.

    Embedding rows are updated inside backward by their tables' optimizers."""
    cls = torch.optim.Adam if cfg.dense_optimizer == "adam" else torch.optim.Adagrad
    params = list(model.dense.parameters())
    if cfg.zero_stage:  # averages the gradients itself; broadcasts rank 0's weights
        return ZeroOptimizer(
            cls, params, group, stage=cfg.zero_stage, lr=cfg.lr, weight_decay=cfg.weight_decay
        )
    model.dense = DataParallel(
        model.dense, group, bucket_mb=cfg.bucket_mb, compression=cfg.compression
    )
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build(
    cfg: DLRMJobConfig,
    source: Source,
    group: ProcessGroup,
    store: Store,
    placements: dict[str, str] | None = None,
    device: torch.device | None = None,
) -> tuple[DLRM, DenseOptimizer, CachedStore | None]:
    """The model on ``device`` (default: ``--device``), its dense optimizer and the cache
    (if any: its rows on a GPU worker's GPU unless ``--cache-on host``, else in host
    memory; :func:`hybridrec.launch.job_cache.with_cache`). Hybrid tables the store
    already holds are handled by ``--existing-tables`` (:func:`prepare_tables`)."""
    device = device if device is not None else worker_device(cfg.device, group)
    placements = placements or resolve_placements(cfg, source.features)
    assert cfg.dim is not None and cfg.top_mlp is not None and cfg.interaction is not None
    check_cache_serves(cfg, placements)
    dtypes = resolve_dtypes(cfg, source.features)
    tables = dlrm_tables(
        source.features, dim=cfg.dim, emb_lr=cfg.emb_lr, placements=placements, dtypes=dtypes
    )
    hybrid = [t.to_spec() for t in tables if t.placement == "hybrid"]
    cached = with_cache(cfg, store, group, device, specs=hybrid)
    init_rows_on(store, device)
    prepare_tables(store, hybrid, group, cfg.tables_policy)
    model = build_dlrm(
        source.features,
        source.num_dense,
        dim=cfg.dim,
        emb_lr=cfg.emb_lr,
        bottom_mlp=cfg.bottom_mlp,
        top_mlp=cfg.top_mlp,
        interaction=cfg.interaction,
        dcn_layers=cfg.dcn_layers,
        dcn_rank=cfg.dcn_rank,
        seed=cfg.seed,
        group=group,
        placements=placements,
        store=cached if cached is not None else store,
        device=device,
        dtypes=dtypes,
    )
    return model, make_optimizer(cfg, model, group), cached


def check_cache_serves(cfg: DLRMJobConfig, placements: dict[str, str]) -> None:
    if cfg.wants_cache and "hybrid" not in placements.values():
        raise ValueError(f"the cache serves hybrid tables, but the placements are {placements}")


def dense_model(cfg: DLRMJobConfig, num_dense: int, num_sparse: int) -> DLRMDense:
    """The dense part :func:`build_dlrm` builds, on the meta device (shapes, no memory)."""
    assert cfg.dim is not None and cfg.top_mlp is not None and cfg.interaction is not None
    config = DLRMConfig(
        num_dense=num_dense, num_sparse=num_sparse, embedding_dim=cfg.dim,
        bottom_mlp=[64, cfg.dim] if cfg.bottom_mlp is None else list(cfg.bottom_mlp),
        top_mlp=list(cfg.top_mlp), interaction=cfg.interaction, dcn_layers=cfg.dcn_layers,
        dcn_rank=cfg.dcn_rank,
    )  # fmt: skip
    with torch.device("meta"):
        return DLRMDense(config)


def memory_plan(
    cfg: DLRMJobConfig,
    source: Source,
    placements: dict[str, str],
    group: ProcessGroup,
    device: torch.device,
) -> MemoryPlan:
    """Where this worker's run keeps its memory (:mod:`hybridrec.launch.memory_plan`), before
    anything is allocated: the tables by placement, the cache, the dense part."""
    assert cfg.dim is not None
    check_cache_serves(cfg, placements)
    tables = dlrm_tables(
        source.features, dim=cfg.dim, emb_lr=cfg.emb_lr, placements=placements,
        dtypes=resolve_dtypes(cfg, source.features),
    )  # fmt: skip
    state = 2 if cfg.dense_optimizer == "adam" else 1  # Adam: two moments; Adagrad: a sum
    dense = dense_bytes(
        dense_model(cfg, source.num_dense, len(tables)),
        state,
        group.size if cfg.zero_stage else 1,
    )
    return job_memory_plan(
        cfg, cfg.ps, tables, device, workers=group.size, rank=group.rank, world_size=group.size,
        dense=dense,
        dense_note=f"weights, gradients, {cfg.dense_optimizer} state"
        + (f" over {group.size} ranks" if cfg.zero_stage and group.size > 1 else ""),
    )  # fmt: skip


# ---------------------------------------------------------------- steps


def train_step(
    model: DLRM,
    opt: DenseOptimizer,
    batch: Batch,
    next_batch: Batch | None = None,
    precision: str = "fp32",
    window: ClickWindow | None = None,
) -> torch.Tensor:
    """One synchronous step on this rank's ``batch``; returns its local mean loss (a 0-d
    tensor on the model's device, read by the trainer only when it reports). ``window``
    keeps the step's predictions for the windowed training metrics.

    With ``next_batch``, its ids go to the embedding cache first: they ride on this
    batch's pull (one request per server for both), so its missing rows are in the
    cache when the next step starts. ``precision`` "bf16": the forward under autocast."""
    if next_batch is not None:
        model.embeddings.prefetch(next_batch.sparse)
    with autocast(batch.labels.device, precision):
        logits = model(batch)  # [b]
    loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    if window is not None:
        window.add(logits, batch.labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # rows updated here; DataParallel buckets allreduced meanwhile
    if isinstance(model.dense, DataParallel):
        model.dense.finish()
    opt.step()  # ZeroOptimizer: averages the gradients first
    return loss.detach()


def evaluate(
    model: DLRM,
    batches: Iterable[Batch],
    group: ProcessGroup,
    lockstep: bool,
    feed: DeviceBatches | None = None,
    precision: str = "fp32",
) -> dict[str, float]:
    """:data:`CLICK_METRICS` over every rank's ``batches`` (collective; NaN where one
    has no value: AUC and NE of a one-class set)."""
    probs, labels, _ = predictions(model, batches, group, lockstep, feed, precision)
    return metric_values(click_report(labels, probs))


# ---------------------------------------------------------------- train


def train(
    cfg: DLRMJobConfig,
    group: ProcessGroup,
    store: Store | None = None,
    *,
    roles: Topology | None = None,
) -> dict[str, Any]:
    """Train and evaluate on the workers ``group``; the metrics, equal on every rank but
    for timings (:func:`hybridrec.cli.run_job.train_in_group`)."""
    return cast(dict[str, Any], train_in_group(DLRMJob, cfg, group, store, roles=roles))


def trainer_config(
    cfg: DLRMJobConfig, lookahead: bool, lockstep: bool, select_best: bool = False
) -> TrainerConfig:
    """``select_best``: keep the epoch of the best validation AUC (and stop early)."""
    assert cfg.epochs is not None and cfg.patience is not None  # resolved in __post_init__
    return TrainerConfig(
        epochs=cfg.epochs, max_steps=cfg.max_steps, samples_per_step=cfg.batch_size,
        log_every=cfg.log_every, eval_every=cfg.eval_every, checkpoint_dir=cfg.checkpoint_dir,
        checkpoint_every=cfg.checkpoint_every, checkpoint_keep=cfg.checkpoint_keep,
        resume=cfg.resume, overwrite_checkpoints=cfg.overwrite_checkpoints,
        metrics_out=cfg.metrics_out, progress=cfg.progress,
        verbose=cfg.verbose, lookahead=lookahead, lockstep=lockstep,
        best_metric="val_auc" if select_best else None, patience=cfg.patience,
    )  # fmt: skip


class DLRMJob:
    """A built DLRM run on the workers ``group``: data, model, optimizer, cache and its
    :class:`Trainer`. ``result = job.close(job.trainer.fit())``."""

    config_class = DLRMJobConfig
    description = DESCRIPTION

    def __init__(
        self,
        cfg: DLRMJobConfig,
        group: ProcessGroup,
        store: Store,
        *,
        roles: Topology | None = None,
        saved_config: dict[str, Any] | None = None,
    ) -> None:
        """``saved_config``: the run configuration of a checkpoint this job evaluates (its
        data encoders encode this job's files; rows saved in another type than this
        job's tables convert as they load, said in one line)."""
        check_batch_size(cfg.batch_size, Topology.of(group))
        self.cfg, self.group = cfg, group
        encoders = (saved_config or {}).get("data_encoders")
        self.source = open_source(cfg, group, encoders)
        placements = resolve_placements(cfg, self.source.features)
        dtypes = resolve_dtypes(cfg, self.source.features)
        self.device = worker_device(cfg.device, group)
        # Where the memory goes, checked against the GPU before a table is allocated.
        self.memory = memory_plan(cfg, self.source, placements, group, self.device)
        self.memory.check()
        self.model, self.optimizer, self.cached = build(
            cfg, self.source, group, store, placements, self.device
        )
        # The next batch's sparse step beside this batch's dense step, where it can pay.
        embeddings = self.model.embeddings
        embeddings.set_sparse_pipeline(wants_sparse_pipeline(cfg, embeddings, self.device))
        # Hybrid tables dedup and pull their ids on the host: those stay there (pinned).
        self.feed = DeviceBatches(self.device, sparse_on_host="hybrid" in placements.values())
        self.lockstep = self.model.embeddings.sharded is not None  # every rank in each forward
        self.say(f"DLRM on {self.source.describe()}; "
                 f"{describe_roles(roles or Topology.of(group), group.backend)}; "
                 f"{describe_device(self.device, cfg.precision)}")  # fmt: skip
        self.say(self.memory.describe())
        converted = converted_rows(saved_config, dtypes)
        if converted is not None:  # evaluate / predict / export of rows of another type
            self.say(converted)
        stream = isinstance(self.source, StreamSource)  # ranks may hold one batch more or less
        model, opt = self.model, self.optimizer
        # the last --metrics-window steps' predictions, scored at every step line
        window = ClickWindow(cfg.metrics_window) if cfg.metrics_window else None
        select_best = cfg.keep_best and self.source.has_split("val")
        if cfg.patience and not select_best:
            raise ValueError(
                f"--patience {cfg.patience} needs a validation split (it watches the "
                f"validation AUC); {self.source.describe()} has none"
            )
        self.trainer = Trainer(
            trainer_config(
                cfg, self.cached is not None or embeddings.sparse_pipelined, stream, select_best
            ),
            group=group, optimizer=opt, data=DeviceEpochData(self.source, self.feed),
            step=lambda batch, nxt: train_step(model, opt, batch, nxt, cfg.precision, window),
            dense=model.dense, embeddings=model.embeddings, evaluate=self.validate,
            extras=self.extras, on_row=self.show,
            collective_extras=None if window is None else lambda: window.report(group),
            run_config={
                "job": "dlrm", **config_dict(cfg), "placements": placements,
                ROW_DTYPES_KEY: dtypes, "data_encoders": self.source.encoder_state(),
            },
            shape_options=SHAPE_OPTIONS,
        )  # fmt: skip

    def say(self, text: str) -> None:
        if self.cfg.verbose and self.group.rank == 0:
            print(text, flush=True)

    def evaluate_saved(self, evaluation: Any) -> dict[str, Any]:
        """Collective: a saved model's metrics on the splits ``evaluation`` names
        (``hybridrec evaluate``, :mod:`hybridrec.dlrm.evaluate`)."""
        return evaluate_saved(self, evaluation, features=[f.name for f in self.source.features])

    def load_saved(self, folder: str | Path) -> None:
        """Collective: a saved model (a checkpoint's ``model/`` or a run's ``best/``) in
        place of this job's, its tables settled for scoring (:meth:`settle`)."""
        self.settle()  # nothing in flight while the rows are replaced
        self.trainer.load_saved_model(folder)
        self.settle()  # the restored cache's copies dropped too: the store's rows are scored

    def settle(self) -> dict[str, dict[str, Any]] | None:
        """The tables final before scoring held-out data: the sparse pipeline's pushes
        applied and its thread gone, the cache's pending updates in the store and its
        copies dropped, so the scores are those of the rows the store holds (the same
        after a checkpoint is loaded, whatever the cache held). Returns the cache's
        statistics up to here (None without a cache): its counters start again empty."""
        self.model.embeddings.set_sparse_pipeline(False)
        if self.cached is None:
            return None
        self.cached.flush()
        stats = self.cached.cache_stats()
        self.cached.clear()
        return stats

    def validate(self) -> dict[str, Any] | None:
        """Validation AUC and log loss (collective); None without a validation split."""
        if not self.source.has_split("val"):
            return None
        val = self.source.eval_batches("val")
        scores = evaluate(self.model, val, self.group, self.lockstep, self.feed, self.cfg.precision)
        row: dict[str, Any] = {f"val_{k}": v for k, v in scores.items()}
        self.model.embeddings.drain()  # the pipeline's pushes are in the counters
        if self.cached is not None:
            row["cache_hit_rate"] = cache_metrics(self.cached.cache_stats())["cache_hit_rate"]
        return row

    def extras(self) -> dict[str, float]:
        """Counters for the metrics file's step lines: cache or store traffic."""
        self.model.embeddings.drain()  # no store call in flight while they are read
        if self.cached is not None:
            return cache_metrics(self.cached.cache_stats())
        if self.model.embeddings.hybrid is not None:
            return store_metrics(self.model.embeddings.store.stats())
        return {}

    def show(self, row: dict[str, Any]) -> None:
        if row["kind"] != "epoch":
            return
        loss = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        val = (f"  val AUC {row['val_auc']:.4f}  val logloss {row['val_logloss']:.4f}"
               if "val_auc" in row else "")  # fmt: skip
        hits = f"  cache hit rate {row['cache_hit_rate']:.1%}" if "cache_hit_rate" in row else ""
        self.say(f"epoch {row['epoch']}: train loss {loss}{val}{hits}")

    def close(self, run: TrainResult) -> dict[str, Any]:
        """Collective: test metrics and the summary, written to the metrics file; returns it."""
        cache_stats = self.settle()  # the training's traffic, before the test pass
        model = self.model
        result = finish(self.cfg, self.group, model, self.source, self.lockstep, run, self.feed)
        result["memory"] = self.memory.to_json()
        if cache_stats is not None:
            result["cache"] = cache_stats
            result.update(cache_metrics(cache_stats))
        if isinstance(model.dense, DataParallel) and model.dense.codec is not None:
            result["codec_stats"] = dict(model.dense.codec.stats)
        self.say(summary_line(result))
        self.trainer.write(result)
        self.trainer.close()
        return result


def finish(
    cfg: DLRMJobConfig,
    group: ProcessGroup,
    model: DLRM,
    source: Source,
    lockstep: bool,
    run: TrainResult,
    feed: DeviceBatches | None = None,
) -> dict[str, Any]:
    """The final summary: test metrics, the popularity baseline, throughput (this run's)."""
    result: dict[str, Any] = {
        "kind": "final",
        "config": config_dict(cfg),
        "epochs": run.epochs,
        "steps": run.step,
        "steps_run": run.steps_run,
        "already_finished": run.already_finished,
        "world_size": group.size,
        "device": str(feed.device if feed is not None else "cpu"),
        "train_seconds": run.train_seconds,
        "samples_per_s": run.samples_per_s,
        **{f"test_{k}": None for k in CLICK_METRICS},
    }
    # The model evaluated on the test split is the best validation epoch's when the
    # trainer kept one (it restored it at the end of fit), else the last.
    chosen = run.best if run.best is not None else (run.epochs[-1] if run.epochs else None)
    if chosen is not None and "val_auc" in chosen:
        result.update({f"val_{k}": chosen.get(f"val_{k}") for k in CLICK_METRICS})
        result["chosen_epoch"] = chosen["epoch"]
    # the step of the model the test split sees (the plot marks the test result there)
    result["tested_step"] = int(chosen["step"]) if chosen is not None else run.step
    result["best_epoch"] = None if run.best is None else run.best["epoch"]
    result["stopped_early"] = run.stopped_early
    if source.has_split("test"):
        test = source.eval_batches("test")
        scores = evaluate(model, test, group, lockstep, feed, cfg.precision)
        result.update({f"test_{k}": v for k, v in scores.items()})
    baseline = source.baseline()
    if baseline is not None:
        result["popularity_auc"], result["popularity_logloss"] = baseline
    if isinstance(source, StreamSource) and cfg.skip_bad_lines:
        counts = group.allreduce(torch.tensor(source.skipped_lines(), dtype=torch.int64))
        result["skipped_lines_train"], result["skipped_lines_val"] = (int(c) for c in counts)
    return result


def summary_line(result: dict[str, Any]) -> str:
    test = (
        f"test AUC {result['test_auc']:.4f}  logloss {result['test_logloss']:.4f}"
        f"  NE {result['test_ne']:.4f}  calibration {result['test_calibration']:.3f}"
        if result.get("test_auc") is not None
        else "no test split"
    )
    pop = (
        f" | popularity AUC {result['popularity_auc']:.4f}  "
        f"logloss {result['popularity_logloss']:.4f}"
        if "popularity_auc" in result
        else ""
    )
    if result.get("best_epoch") is not None:
        early = ", stopped early" if result.get("stopped_early") else ""
        test += (
            f" (epoch {result['best_epoch']}, best validation AUC {result['val_auc']:.4f}{early})"
        )
    line = (
        f"{test}{pop} | {result['samples_per_s']:.0f} samples/s ({result['steps_run']} steps, "
        f"{result['train_seconds']:.1f} s)"
    )
    if "skipped_lines_train" in result:
        line += (
            f" | skipped malformed lines: {result['skipped_lines_train']} train, "
            f"{result['skipped_lines_val']} validation"
        )
    return line


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """The job from the command line (:func:`hybridrec.cli.run_job.run_job`)."""
    run_job(DLRMJob, argv)

"""Train a next-item recommender (SASRec or HSTU) on user histories, on 1 or N ranks.

    python examples/train_seq.py                              # SASRec on MovieLens-100k
    python examples/train_seq.py --model hstu
    mpirun -n 2 python examples/train_seq.py                  # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_seq.py
    python examples/train_seq.py --data recbole --data-path DIR --loss sampled --negatives 512
    python examples/train_seq.py --placement hybrid --cache-fraction 0.1 --read-bound 4 \
        --write-bound 4                                       # the item table in the PS, cached

Config -> build -> train -> close, on :class:`hybridrec.train.loop.Trainer` and
:class:`hybridrec.launch.roles.Launch`. Each user's history is sorted by time and split
leave-one-out (:mod:`hybridrec.datasets.sequences`); every step's global batch of users
is dealt to the ranks, each rank predicts the next item at every position of its
users' training sequences (:mod:`hybridrec.seq.model`), and the loss is the global
batch's mean: full softmax over every item, or a sampled softmax over the global
batch's items and shared sampled negatives (:mod:`hybridrec.seq.softmax`), so N ranks
train as one process on the global batch. Validation after every epoch ranks every
item for each user (:mod:`hybridrec.seq.ranking`); the best epoch is kept and tested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from comm import ProcessGroup, Topology, worker_device
from dense import DataParallel, ZeroOptimizer
from embedding import EmbeddingCollection
from hybridrec.checkpoint.row_dtypes import ROW_DTYPES_KEY, converted_rows
from hybridrec.checkpoint.run_checkpoint import DenseOptimizer
from hybridrec.cli.options import config_dict
from hybridrec.cli.run_job import parse_job_args, run_job, train_in_group
from hybridrec.datasets.movielens import movielens_dir
from hybridrec.datasets.sequences import (
    LeaveOneOut,
    SeqBatch,
    SequenceBatches,
    SequenceData,
    Split,
    read_recbole_sequences,
    read_tabular_sequences,
)
from hybridrec.datasets.synthetic_sequences import synthetic_sequences
from hybridrec.launch.existing_tables import prepare_tables
from hybridrec.launch.job_cache import (
    init_rows_on,
    job_memory_plan,
    wants_sparse_pipeline,
    with_cache,
    with_row_dtypes,
)
from hybridrec.launch.memory_plan import MemoryPlan, dense_bytes
from hybridrec.launch.roles import check_batch_size, describe_device, describe_roles
from hybridrec.seq.config import SeqConfig
from hybridrec.seq.model import SeqModel, build_encoder, item_table, lookup_batch
from hybridrec.seq.ranking import metrics_from_sums, ranking_sums, target_ranks
from hybridrec.seq.softmax import (
    Candidates,
    NegativeSampler,
    candidates,
    full_softmax_loss,
    sampled_softmax_loss,
)
from hybridrec.train.device_batches import DeviceBatches, DeviceEpochData
from hybridrec.train.loop import Trainer, TrainerConfig, TrainResult
from hybridrec.train.metrics_file import cache_metrics, store_metrics
from hybridrec.train.precision import autocast
from ps import Store

__all__ = ["SeqJob", "main", "parse_args", "train"]

DESCRIPTION = __doc__.split("\n")[0]
# Options that change the shapes a checkpoint holds: a resume names those that differ.
SHAPE_OPTIONS = (
    "data", "data_path", "synthetic_items", "synthetic_users", "model", "dim", "n_layer",
    "n_head", "max_seq_len", "placement", "emb_optimizer", "zero_stage",
)  # fmt: skip
BEST_METRIC = "ndcg@10"  # the validation metric the best epoch and early stopping watch
# What the summary line prints, in order.
SHOWN = ("hr@10", "ndcg@10", "hr@50", "hr@200", "ndcg@200", "mrr")


def parse_args(argv: list[str] | None = None) -> SeqConfig:
    return parse_job_args(SeqJob, argv)


def train(
    cfg: SeqConfig,
    group: ProcessGroup,
    store: Store | None = None,
    *,
    roles: Topology | None = None,
) -> dict[str, Any]:
    """Train and evaluate on the workers ``group``; the metrics, equal on every rank but
    for timings (:func:`hybridrec.cli.run_job.train_in_group`)."""
    return cast(dict[str, Any], train_in_group(SeqJob, cfg, group, store, roles=roles))


def load_sequences(cfg: SeqConfig) -> SequenceData:
    """The interactions ``--data`` names, as time-sorted histories."""
    fields = dict(user_field=cfg.user_field, item_field=cfg.item_field, time_field=cfg.time_field)
    if cfg.data == "movielens":
        return read_recbole_sequences(movielens_dir(), **fields)
    if cfg.data == "recbole":
        return read_recbole_sequences(Path(cfg.data_path[0]), **fields)
    if cfg.data == "tabular":
        return read_tabular_sequences(
            [Path(p) for p in cfg.data_path], user_column=cfg.user_field,
            item_column=cfg.item_field, time_column=cfg.time_field,
        )  # fmt: skip
    return synthetic_sequences(
        items=cfg.synthetic_items, users=cfg.synthetic_users, length=cfg.synthetic_length,
        zipf=cfg.synthetic_zipf, seed=cfg.seed,
    )  # fmt: skip


def negatives_generator(seed: int, epoch: int, step: int) -> torch.Generator:
    """The generator of one step's negatives: a function of the run's seed and the step's
    place in its epoch only, so every rank (and a resumed run) draws the same ones."""
    state = np.random.SeedSequence([seed, epoch, step]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


def popularity_ranks(
    split: LeaveOneOut, batches: list[SeqBatch], exclude_seen: bool
) -> torch.Tensor:
    """The popularity baseline's rank of each sample's target (items scored by their
    training count; ties in the target's favour, as :func:`target_ranks` counts them)."""
    counts = split.item_train_counts()
    ranked = np.sort(counts)
    out = []
    for b in batches:
        target = b.targets.cpu().numpy()
        c = counts[target]
        higher = len(ranked) - np.searchsorted(ranked, c, side="right")  # items counted more
        if exclude_seen:
            seen = b.seen_items.cpu().numpy()
            owner = np.repeat(np.arange(len(target)), np.diff(b.seen_offsets.cpu().numpy()))
            unique = np.unique(np.stack([owner, seen]), axis=1)  # each (sample, item) once
            keep = unique[1] != target[unique[0]]
            owner, seen = unique[0][keep], unique[1][keep]
            above = counts[seen] > c[owner]  # the excluded items the target was ranked below
            higher -= np.bincount(owner[above], minlength=len(target))
        out.append(torch.from_numpy(higher.astype(np.int64)))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


class SeqJob:
    """A built sequential-recommender run on the workers ``group``: histories, item table,
    encoder, optimizer, cache and its :class:`Trainer`. ``job.close(job.trainer.fit())``."""

    config_class = SeqConfig
    description = DESCRIPTION

    def __init__(
        self,
        cfg: SeqConfig,
        group: ProcessGroup,
        store: Store,
        *,
        roles: Topology | None = None,
        saved_config: dict[str, Any] | None = None,
    ) -> None:
        """``saved_config``: the run configuration of a checkpoint this job evaluates (the
        histories come from the options alone; rows saved in another type than the item
        table's convert as they load, said in one line)."""
        check_batch_size(cfg.batch_size, Topology.of(group))
        self.cfg, self.group = cfg, group
        self.data = load_sequences(cfg)
        self.split = LeaveOneOut.of(self.data)
        self.source = SequenceBatches(
            self.split, max_seq_len=cfg.max_seq_len, batch_size=cfg.batch_size,
            rank=group.rank, size=group.size, seed=cfg.seed, windows=cfg.train_windows,
            context=cfg.window_context, unit=cfg.batch_unit,
        )  # fmt: skip
        self.num_items = items = self.data.num_items
        self.full_softmax = cfg.uses_full_softmax(items)
        self.sampler = (
            None
            if self.full_softmax or cfg.negatives == 0
            else NegativeSampler(
                num_items=items,
                negatives=cfg.negatives,
                kind=cfg.negative_sampler,
                counts=(
                    torch.from_numpy(self.split.item_train_counts())
                    if cfg.negative_sampler == "popularity"
                    else None
                ),
            )  # fmt: skip
        )
        self.device = device = worker_device(cfg.device, group)
        table = with_row_dtypes(cfg, [item_table(cfg, items)])[0]  # --emb-dtype(-of)
        torch.manual_seed(cfg.seed)  # the same encoder init everywhere (rank 0's is broadcast)
        encoder = build_encoder(cfg)
        self.encoder_parameters = sum(p.numel() for p in encoder.parameters())
        encoder = encoder.to(device)
        self.memory = self.memory_plan(table, encoder)
        self.memory.check()
        hybrid = [table.to_spec()] if table.placement == "hybrid" else []
        self.cached = with_cache(cfg, store, group, device, specs=hybrid)
        if hybrid:
            init_rows_on(store, device)
            prepare_tables(store, hybrid, group, cfg.tables_policy)
        embeddings = EmbeddingCollection(
            [table], store=self.cached if self.cached is not None else store, group=group,
            device=device,
        )  # fmt: skip
        self.optimizer = self.make_optimizer(encoder)
        trained = self.encoder
        self.model = SeqModel(embeddings, trained)
        # The next batch's sparse step beside this one's dense step, where it can pay.
        pipelined = wants_sparse_pipeline(cfg, embeddings, device)
        embeddings.set_sparse_pipeline(pipelined)
        self._ahead: dict[tuple[int, int], Candidates | None] = {}  # the next batch's
        self.feed = DeviceBatches(device)
        self.trained_targets = 0  # training targets of every rank, this run's steps
        loss = "full softmax" if self.full_softmax else (
            f"sampled softmax ({cfg.negatives} {cfg.negative_sampler} negatives + the "
            "batch's items, logQ-corrected)"
        )  # fmt: skip
        self.say(f"{cfg.model} on {self.data.source}; {loss}")
        rows = "" if table.dtype == "fp32" else f", {table.dtype} rows"
        self.say(
            f"{cfg.model} {cfg.n_layer}x{cfg.dim} ({self.encoder_parameters} dense parameters) "
            f"+ item table {items}x{cfg.dim} ({table.placement}, {cfg.emb_optimizer}{rows}); "
            f"{describe_roles(roles or Topology.of(group), group.backend)}, zero stage "
            f"{cfg.zero_stage}; {describe_device(device, cfg.precision)}"
        )
        self.say(self.memory.describe())
        converted = converted_rows(saved_config, {table.name: table.dtype})
        if converted is not None:  # evaluate of rows of another type
            self.say(converted)
        self.trainer = Trainer(
            TrainerConfig(
                epochs=cfg.epochs, max_steps=cfg.max_steps, samples_per_step=cfg.batch_size,
                log_every=cfg.log_every, eval_every=cfg.eval_every,
                checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every,
                checkpoint_keep=cfg.checkpoint_keep, resume=cfg.resume,
                overwrite_checkpoints=cfg.overwrite_checkpoints, metrics_out=cfg.metrics_out,
                progress=cfg.progress, verbose=cfg.verbose,
                best_metric=f"val_{BEST_METRIC}" if cfg.keep_best else None,
                patience=cfg.patience, lookahead=self.cached is not None or pipelined,
            ),
            group=group, optimizer=self.optimizer,
            data=DeviceEpochData(self.source, self.feed), step=self.step,
            dense=trained, embeddings=embeddings, evaluate=self.validate,
            extras=self.extras, on_row=self.show,
            run_config={
                "job": "seq", **config_dict(cfg), "num_items": items,
                ROW_DTYPES_KEY: {table.name: table.dtype},
            },
            shape_options=SHAPE_OPTIONS,
        )  # fmt: skip

    # ------------------------------------------------------------ build

    def make_optimizer(self, encoder: torch.nn.Module) -> DenseOptimizer:
        """Adam on the encoder; wraps it in ``DataParallel`` at ZeRO stage 0 (kept as
        ``self.encoder``). The item rows are updated in backward by their table."""
        cfg = self.cfg
        params = list(encoder.parameters())
        if cfg.zero_stage:  # averages the gradients itself; broadcasts rank 0's weights
            self.encoder = encoder
            return ZeroOptimizer(
                torch.optim.Adam, params, self.group, stage=cfg.zero_stage, lr=cfg.lr,
                weight_decay=cfg.weight_decay,
            )  # fmt: skip
        self.encoder = DataParallel(
            encoder, self.group, bucket_mb=cfg.bucket_mb, compression=cfg.compression
        )
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def memory_plan(self, table: Any, encoder: torch.nn.Module) -> MemoryPlan:
        cfg, group = self.cfg, self.group
        shards = group.size if cfg.zero_stage else 1
        return job_memory_plan(
            cfg, cfg.ps, [table], self.device, workers=group.size, rank=group.rank,
            world_size=group.size, dense=dense_bytes(encoder, 2, shards),
            dense_note="weights, gradients, Adam state" + (
                f" over {shards} ranks" if shards > 1 else ""
            ),
        )  # fmt: skip

    def say(self, text: str) -> None:
        if self.cfg.verbose and self.group.rank == 0:
            print(text, flush=True)

    # ------------------------------------------------------------ train

    def step(self, batch: SeqBatch, next_batch: SeqBatch | None = None) -> torch.Tensor:
        """One synchronous step on this rank's users; returns this rank's share of the
        global batch's mean loss times the rank count (so the ranks' mean is the global
        mean, and averaged gradients are the global batch's)."""
        cfg, group = self.cfg, self.group
        targets = batch.targets
        picked = self._ahead.pop((batch.epoch, batch.step), None) or self.candidates_of(batch)
        cand_ids = torch.arange(self.num_items) if picked is None else picked.ids
        if next_batch is not None:
            # The next batch's rows are pulled ahead (riding on this batch's pull into
            # the cache, or on the sparse pipeline's thread): the very lookup its step
            # makes, its candidates drawn now (the same draw: a function of its step).
            ahead = self.candidates_of(next_batch)
            self._ahead[(next_batch.epoch, next_batch.step)] = ahead
            ids = torch.arange(self.num_items) if ahead is None else ahead.ids
            self.model.embeddings.prefetch(lookup_batch(next_batch.items, ids))
        with autocast(self.device, cfg.precision):
            hidden, rows = self.model(batch, cand_ids)
        hidden, rows = hidden.float(), rows.float()
        if batch.scored is not None:  # context positions are read, not predicted
            hidden = hidden[batch.scored.to(hidden.device)]  # [N, D] -> [T, D]
        if picked is None:
            loss_sum = full_softmax_loss(hidden, rows, targets.to(hidden.device))
        else:
            loss_sum = sampled_softmax_loss(hidden, rows, picked)
        loss = loss_sum * (group.size / max(batch.global_targets, 1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # item rows updated here; DataParallel buckets allreduced meanwhile
        if isinstance(self.encoder, DataParallel):
            self.encoder.finish()
        self.optimizer.step()  # ZeroOptimizer: averages the gradients first
        self.trained_targets += batch.global_targets
        return loss.detach()

    def candidates_of(self, batch: SeqBatch) -> Candidates | None:
        """The sampled softmax's candidates of ``batch`` (None: the full softmax). The
        global batch's targets are every rank's in-batch negatives, gathered, and the
        negatives are drawn from the step's own generator: the same candidates on every
        rank, as one process would draw them (a collective with several ranks)."""
        if self.full_softmax:
            return None
        targets = batch.targets.cpu().contiguous()
        group = self.group
        everyone = group.allgatherv(targets) if group.size > 1 else targets
        gen = negatives_generator(self.cfg.seed, batch.epoch, batch.step)
        return candidates(targets, self.sampler, gen, in_batch=everyone)

    # ------------------------------------------------------------ evaluate

    def ranks(self, split: Split) -> tuple[torch.Tensor, list[SeqBatch]]:
        """Collective: the rank of each of this rank's ``split`` targets among every item
        (with ``--exclude-seen``: among the items the user has not had), and the batches."""
        batches = self.source.eval_batches(split, self.cfg.eval_batch_size)
        model = self.model
        model.eval()
        out = []
        for b in self.feed.batches(batches):
            exclude = (b.seen_items, b.seen_offsets) if self.cfg.exclude_seen else None
            with autocast(self.device, self.cfg.precision):
                queries = model.queries(b).float()
            out.append(
                target_ranks(
                    queries,
                    b.targets,
                    lambda ids: model.rows_of(ids).float(),
                    self.num_items,
                    self.group,
                    exclude=exclude,
                )  # fmt: skip
            )
        model.train()
        ranks = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)
        return ranks.cpu(), batches

    def split_metrics(self, split: Split) -> dict[str, float]:
        """Collective: HR@K, NDCG@K and MRR of ``split`` over every rank's users."""
        ranks, _ = self.ranks(split)
        return metrics_from_sums(self.group.allreduce(ranking_sums(ranks)))

    def validate(self) -> dict[str, Any]:
        """Validation metrics (collective), keyed ``val_hr@10`` ..."""
        self.model.embeddings.drain()
        row: dict[str, Any] = {f"val_{k}": v for k, v in self.split_metrics("val").items()}
        if self.cached is not None:
            row["cache_hit_rate"] = cache_metrics(self.cached.cache_stats())["cache_hit_rate"]
        return row

    def popularity(self, split: Split) -> dict[str, float]:
        """The popularity baseline's metrics on ``split`` (collective)."""
        batches = self.source.eval_batches(split, self.cfg.eval_batch_size)
        ranks = popularity_ranks(self.split, batches, self.cfg.exclude_seen)
        return metrics_from_sums(self.group.allreduce(ranking_sums(ranks)))

    def extras(self) -> dict[str, float]:
        """Counters for the metrics file's step lines: cache or store traffic."""
        self.model.embeddings.drain()
        if self.cached is not None:
            return cache_metrics(self.cached.cache_stats())
        if self.model.embeddings.hybrid is not None:
            return store_metrics(self.model.embeddings.store.stats())
        return {}

    def show(self, row: dict[str, Any]) -> None:
        if row["kind"] != "epoch":
            return
        loss = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        val = (
            f"  val HR@10 {row['val_hr@10']:.4f}  NDCG@10 {row['val_ndcg@10']:.4f}"
            if "val_hr@10" in row
            else ""
        )
        hits = f"  cache hit rate {row['cache_hit_rate']:.1%}" if "cache_hit_rate" in row else ""
        self.say(f"epoch {row['epoch']}: train loss {loss}{val}{hits}")

    # ------------------------------------------------------------ saved models

    def settle(self) -> dict[str, dict[str, Any]] | None:
        """Every push applied and the cache's copies dropped, so held-out data is scored
        with the rows the store holds; returns the cache's statistics (None: no cache)."""
        self.model.embeddings.set_sparse_pipeline(False)
        if self.cached is None:
            return None
        self.cached.flush()
        stats = self.cached.cache_stats()
        self.cached.clear()
        return stats

    def load_saved(self, folder: str | Path) -> None:
        """Collective: a saved model (a checkpoint's ``model/``) in place of this job's."""
        self.settle()
        self.trainer.load_saved_model(folder)
        self.settle()

    def evaluate_saved(self, evaluation: Any) -> dict[str, Any]:
        """Collective: a saved model's ranking metrics on the splits ``evaluation`` names
        (``hybridrec evaluate``; default the test split)."""
        if evaluation.slice_by is not None:
            raise ValueError("--slice-by: the sequential recommender has no features to slice by")
        self.load_saved(evaluation.model)
        self.say(f"evaluating {evaluation.model} (step {evaluation.meta.get('step')})")
        result: dict[str, Any] = {
            "kind": "evaluate", "checkpoint": str(evaluation.checkpoint),
            "model": str(evaluation.model), "step": evaluation.meta.get("step"),
        }  # fmt: skip
        for split in evaluation.splits or ("test",):
            if split not in ("val", "test"):
                raise ValueError(f"--split {split}: the sequential recommender has val and test")
            scores = self.split_metrics(cast(Split, split))
            result.update({f"{split}_{k}": v for k, v in scores.items()})
            self.say(f"{split} " + metric_text(scores))
        return result

    # ------------------------------------------------------------ close

    def close(self, run: TrainResult) -> dict[str, Any]:
        """Collective: test metrics and the summary, written to the metrics file; returns it."""
        cache_stats = self.settle()
        cfg = self.cfg
        chosen = run.best if run.best is not None else (run.epochs[-1] if run.epochs else None)
        result: dict[str, Any] = {
            "kind": "final",
            "config": config_dict(cfg),
            "model": cfg.model,
            "data": self.data.source,
            "users": self.data.num_users,
            "items": self.num_items,
            "loss": "full" if self.full_softmax else "sampled",
            "epochs": run.epochs,
            "steps": run.step,
            "steps_run": run.steps_run,
            "already_finished": run.already_finished,
            "world_size": self.group.size,
            "device": str(self.device),
            "train_seconds": run.train_seconds,
            f"{cfg.batch_unit}_per_s": run.samples_per_s,  # what --batch-size counts
            # a training sample is one predicted position (one next item), as in RecBole,
            # whose samples are every prefix of a user's training sequence
            "samples_per_s": self.trained_targets / run.train_seconds if run.train_seconds else 0.0,
            "encoder_parameters": self.encoder_parameters,
            "parameters": self.encoder_parameters + self.num_items * cfg.dim,
            "best_epoch": None if run.best is None else run.best["epoch"],
            "stopped_early": run.stopped_early,
            "tested_step": int(chosen["step"]) if chosen is not None else run.step,
            "memory": self.memory.to_json(),
        }
        if chosen is not None and f"val_{BEST_METRIC}" in chosen:
            result.update({k: v for k, v in chosen.items() if k.startswith("val_")})
        result.update({f"test_{k}": v for k, v in self.split_metrics("test").items()})
        result.update({f"popularity_{k}": v for k, v in self.popularity("test").items()})
        if cache_stats is not None:
            result["cache"] = cache_stats
            result.update(cache_metrics(cache_stats))
        self.say(summary_line(result))
        self.trainer.write(result)
        self.trainer.close()
        return result


def metric_text(scores: dict[str, float], prefix: str = "") -> str:
    """``HR@10 0.1234  NDCG@10 0.0567 ...`` of the metrics in :data:`SHOWN`."""
    return "  ".join(f"{k.upper()} {scores[prefix + k]:.4f}" for k in SHOWN if prefix + k in scores)


def summary_line(result: dict[str, Any]) -> str:
    line = "test " + metric_text(result, "test_")
    if result.get("best_epoch") is not None:
        early = ", stopped early" if result.get("stopped_early") else ""
        line += (
            f" (epoch {result['best_epoch']}, best validation NDCG@10 "
            f"{result[f'val_{BEST_METRIC}']:.4f}{early})"
        )
    line += (
        f" | popularity HR@10 {result['popularity_hr@10']:.4f}  "
        f"NDCG@10 {result['popularity_ndcg@10']:.4f}"
    )
    return (
        f"{line} | {result['samples_per_s']:.0f} samples/s ({result['steps_run']} steps, "
        f"{result['train_seconds']:.1f} s)"
    )


def main(argv: list[str] | None = None) -> None:
    """The job from the command line (:func:`hybridrec.cli.run_job.run_job`)."""
    run_job(SeqJob, argv)

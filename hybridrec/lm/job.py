"""Train a GPT language model with a sparse token embedding, on 1 or N ranks.

    python examples/train_lm.py                         # Shakespeare (or stdlib source), bytes
    mpirun -n 2 python examples/train_lm.py             # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --zero-stage 1
    python examples/train_lm.py --tokenizer gpt2 --d-model 128 --max-steps 1000
    python examples/train_lm.py --checkpoint-dir ckpt --checkpoint-every 100 --resume

Config -> build -> train -> close, on :class:`hybridrec.train.loop.Trainer` and
:class:`hybridrec.launch.roles.Launch`. The model (``hybridrec/lm/model.py``) is a token
table in an ``embedding.EmbeddingCollection`` (hybrid: rows in the ``--ps`` store,
only a batch's rows move; sharded; or local) feeding ``dense.GPT`` under
``dense.DataParallel`` (optionally compressed) or ``dense.ZeroOptimizer``.

Every rank reads the corpus and trains on its slice of each global batch of random
windows (the same global batch for any rank count). Rank 0 prints the validation
loss (nats per token), perplexity and, for bytes, bits per byte, and writes the
metrics file and its plot. ``--help`` lists every option.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from comm import ProcessGroup, Topology, worker_device
from dense import apply_tensor_parallel
from dense.gpt import GPT, GPTConfig, gpt_loss
from embedding import EmbeddingCollection, TableConfig
from embedding.hybrid import store_is_replicated
from hybridrec.checkpoint.row_dtypes import ROW_DTYPES_KEY, converted_rows
from hybridrec.cli.options import build_parser as build_config_parser
from hybridrec.cli.options import config_dict
from hybridrec.cli.run_job import parse_job_args, run_job, train_in_group
from hybridrec.datasets.text import (
    eval_batches,
    get_batch,
    load_corpus,
    make_tokenizer,
    split_tokens,
    tokenize,
)
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
from hybridrec.lm.config import LMConfig
from hybridrec.lm.model import (
    LanguageModel,
    embed_tokens,
    input_tables,
    ngram_config,
    optimizer_state_bytes,
)
from hybridrec.lm.parallel import build_dense, model_parallel, pipeline_loss, pipeline_step
from hybridrec.train.device_batches import DeviceBatches, DeviceEpochData
from hybridrec.train.loop import (
    Trainer,
    TrainerConfig,
    TrainResult,
    plain_step,
)
from hybridrec.train.metrics_file import cache_metrics, store_metrics
from hybridrec.train.precision import autocast
from ps import Store

__all__ = ["LMConfig", "LMJob", "build_parser", "embed_tokens", "main", "parse_args", "train"]

DESCRIPTION = __doc__.split("\n")[0]
# Options that change the shapes a checkpoint holds: a resume names those that differ.
SHAPE_OPTIONS = (
    "tokenizer", "vocab_size", "d_model", "n_layer", "n_head", "block_size", "placement",
    "emb_optimizer", "ngram", "ngram_rows", "ngram_splits", "ngram_placement", "tp", "pp",
)  # fmt: skip


def build_parser() -> Any:
    return build_config_parser(LMConfig, DESCRIPTION)


def parse_args(argv: list[str] | None = None) -> LMConfig:
    return parse_job_args(LMJob, argv)


@torch.no_grad()
def evaluate(
    model: LanguageModel,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    group: ProcessGroup,
    batch_loss: Callable[[torch.Tensor, torch.Tensor], float] | None = None,
    feed: DeviceBatches | None = None,
) -> float:
    """Mean next-token loss over the validation windows of every rank (nats per token).
    ``batch_loss(x, y)``: one batch's mean loss (default ``gpt_loss(model(x), y)``);
    ``feed`` moves the windows to the model's device.
    Ranks of one model replica see the same windows: the ratio of the sums is unchanged."""
    if batch_loss is None:
        batch_loss = lambda x, y: float(gpt_loss(model(x), y))  # noqa: E731
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)  # [sum of token losses, tokens]
    for x, y in batches if feed is None else feed.batches(batches):
        total[0] += batch_loss(x, y) * y.numel()
        total[1] += y.numel()
    model.train()
    group.allreduce(total, op="sum")
    return float(total[0] / total[1])


class Windows:
    """This rank's slice of the global batch of random windows of each step: ``(x, y)``,
    ``[b, T]`` token ids and their next tokens. Step ``s``'s windows depend only on
    ``(seed, s)``, so a resumed run continues with the same ones. ``group`` is the
    data-parallel group: the ranks of one model replica take the same slice."""

    def __init__(self, tokens: torch.Tensor, cfg: LMConfig, group: ProcessGroup) -> None:
        self.tokens, self.cfg, self.group = tokens, cfg, group

    steps_per_epoch = None  # no epochs: the run ends at --max-steps

    def train_batches(
        self, epoch: int, skip: int = 0, start: torch.Tensor | None = None
    ) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], None]]:
        del epoch, start  # the step number locates the windows
        cfg, g = self.cfg, self.group
        for step in itertools.count(skip):
            yield get_batch(
                self.tokens, step=step, seed=cfg.seed, global_batch=cfg.batch_size,
                block_size=cfg.block_size, rank=g.rank, size=g.size,
            ), None  # fmt: skip


def train(
    cfg: LMConfig,
    group: ProcessGroup,
    store: Store | None = None,
    *,
    roles: Topology | None = None,
) -> dict[str, Any]:
    """Train and evaluate on the workers ``group``; the metrics, equal on every rank but
    for timings (:func:`hybridrec.cli.run_job.train_in_group`)."""
    return cast(dict[str, Any], train_in_group(LMJob, cfg, group, store, roles=roles))


def describe_mesh(shape: dict[str, int]) -> str:
    """``", mesh dp 2 x pp 1 x tp 2"`` when the model is split; empty for data parallel."""
    if shape["pp"] == 1 and shape["tp"] == 1:
        return ""
    return ", mesh " + " x ".join(f"{name} {size}" for name, size in shape.items())


def describe_dtype(dtype: str) -> str:
    """``", bf16 rows"`` for a narrow table; empty for fp32."""
    return "" if dtype == "fp32" else f", {dtype} rows"


def check_replica_store(cfg: LMConfig, replica_ranks: int, store: Store) -> None:
    """The ranks of one model replica (``pp * tp`` > 1) apply the same row updates to
    their own copies of the sparse tables; a store shared by all ranks would get every
    update ``pp * tp`` times, so it is refused, as are checkpoints of split models."""
    if replica_ranks == 1:
        return
    if "hybrid" in cfg.placements() and not store_is_replicated(store):
        raise ValueError(
            f"--tp {cfg.tp} x --pp {cfg.pp}: every rank of a model replica updates its own copy "
            "of the hybrid tables, so they need --ps local (an in-process store per rank) or "
            "--placement/--ngram-placement sharded, not a store shared by all ranks"
        )
    if cfg.checkpoint_dir:
        raise ValueError(
            f"--checkpoint-dir with --tp {cfg.tp} x --pp {cfg.pp}: checkpoints of a model split "
            "over ranks are not written by this job yet (train with --tp 1 --pp 1 to checkpoint)"
        )


class LMJob:
    """A built language-model run on the workers ``group``: corpus, tokenizer, model,
    optimizer and its :class:`Trainer`. ``result = job.close(job.trainer.fit())``."""

    config_class = LMConfig
    description = DESCRIPTION

    def __init__(
        self,
        cfg: LMConfig,
        group: ProcessGroup,
        store: Store,
        *,
        roles: Topology | None = None,
        saved_config: dict[str, Any] | None = None,
    ) -> None:
        """``saved_config``: the run configuration of a checkpoint this job evaluates (the
        corpus and tokenizer come from the options alone; rows saved in another type than
        this job's tables convert as they load, said in one line)."""
        check_batch_size(cfg.batch_size, Topology.of(group), cfg.ranks_per_replica)
        self.cfg, self.group = cfg, group
        self.corpus = load_corpus(cfg.text_dir, max_bytes=cfg.max_bytes)
        self.tokenizer = make_tokenizer(cfg.tokenizer, cfg.bpe_file)
        par = self.par = model_parallel(cfg, group, self.tokenizer.vocab_size)
        check_replica_store(cfg, par.mesh.size("pp") * par.mesh.size("tp"), store)
        stream = tokenize(self.corpus.text, self.tokenizer)
        splits = split_tokens(stream)
        self.bytes_per_token = len(self.corpus.text.encode()) / max(len(stream), 1)
        vocab = self.vocab = self.tokenizer.vocab_size
        self.say(f"corpus {self.corpus.description}")
        self.say(
            f"tokenizer {self.tokenizer.name} (vocab {vocab}): {len(splits.train)} train / "
            f"{len(splits.val)} validation tokens"
        )
        self.device = device = worker_device(cfg.device, group)
        torch.manual_seed(cfg.seed)  # the same GPT init everywhere (rank 0's is broadcast)
        gpt = GPT(
            GPTConfig(
                vocab_size=vocab,
                block_size=cfg.block_size,
                n_layer=cfg.n_layer,
                n_head=cfg.n_head,
                d_model=cfg.d_model,
                dropout=cfg.dropout,
            )
        )
        gpt = gpt.to(device)  # built on the host: the same initial weights on any device
        dense_parameters = gpt.num_parameters()
        if cfg.tp > 1:  # every rank built the full GPT from the same seed: keep its slice
            apply_tensor_parallel(gpt, par.tp)
        self.dense = build_dense(cfg, gpt, par)
        trained, self.optimizer = self.dense.trained, self.dense.optimizer
        assert par.tables is not None
        self.ngrams = ngram_config(cfg)
        tables = input_tables(cfg, vocab, self.ngrams)
        self.ngram_tables = {t.name for t in tables[1:]}
        hybrid = [t.to_spec() for t in tables if t.placement == "hybrid"]
        # Where the memory goes, checked against the GPU before a table is allocated.
        self.memory = self.memory_plan(tables if par.looks_up else [], trained)
        self.memory.check()
        self.cached = (
            with_cache(cfg, store, par.tables, device, specs=hybrid) if par.looks_up else None
        )
        self.store = self.cached if self.cached is not None else store
        self.eval_traffic = 0  # n-gram rows moved by validation passes
        embeddings = None
        if par.looks_up:  # the ranks running a first stage hold the sparse tables
            if hybrid:
                init_rows_on(store, device)
                prepare_tables(store, hybrid, par.tables, cfg.tables_policy)
            embeddings = EmbeddingCollection(
                tables, store=self.store, group=par.tables, device=device
            )
        self.model = LanguageModel(embeddings, trained, self.ngrams)
        # The next batch's sparse step beside this one's dense step, where it can pay (not
        # under --pp: the stages' micro-batches look their rows up inside the schedule).
        pipelined = (
            embeddings is not None
            and self.dense.pipeline is None
            and wants_sparse_pipeline(cfg, embeddings, device)
        )
        if embeddings is not None:
            embeddings.set_sparse_pipeline(pipelined)
        self.say(
            f"GPT {cfg.n_layer}x{cfg.d_model} ({dense_parameters} dense parameters) + token "
            f"table {vocab}x{cfg.d_model} ({cfg.placement}, {cfg.emb_optimizer}"
            f"{describe_dtype(tables[0].dtype)})"
            f"{self.describe_ngrams()}; "
            f"{describe_roles(roles or Topology.of(group), group.backend)}, "
            f"zero stage {cfg.zero_stage}{describe_mesh(par.mesh.shape)}; "
            f"{describe_device(device, cfg.precision)}"
        )
        self.say(self.memory.describe())
        dtypes = {t.name: t.dtype for t in tables}
        converted = converted_rows(saved_config, dtypes)
        if converted is not None:  # evaluate / export of rows of another type
            self.say(converted)
        self.feed = DeviceBatches(device)
        forward = functools.partial(autocast, device, cfg.precision)
        self.val = eval_batches(
            splits.val,
            num_batches=cfg.eval_batches,
            global_batch=cfg.batch_size,
            block_size=cfg.block_size,
            rank=par.dp.rank,
            size=par.dp.size,
        )
        # An evaluation first, every eval_every steps and after the last step.
        self.trainer = Trainer(
            TrainerConfig(
                max_steps=cfg.max_steps, samples_per_step=cfg.batch_size, log_every=cfg.log_every,
                eval_every=cfg.eval_every, eval_at_start=True, eval_at_end=True,
                epoch_rows=False, checkpoint_dir=cfg.checkpoint_dir,
                checkpoint_every=cfg.checkpoint_every, checkpoint_keep=cfg.checkpoint_keep,
                resume=cfg.resume, overwrite_checkpoints=cfg.overwrite_checkpoints,
        metrics_out=cfg.metrics_out, progress=cfg.progress,
                verbose=cfg.verbose, lookahead=pipelined,
            ),
            group=group, optimizer=self.optimizer,
            data=DeviceEpochData(Windows(splits.train, cfg, par.dp), self.feed),
            step=(
                plain_step(
                    self.model, par.loss, self.optimizer,
                    prefetch=(lambda nxt: self.model.prefetch(nxt[0])) if pipelined else None,
                    forward_context=forward,
                )  # fmt: skip
                if self.dense.pipeline is None
                else pipeline_step(self.model, self.dense, par, cfg.zero_stage)
            ),
            dense=trained,
            embeddings=embeddings, evaluate=self.validate, on_row=self.show, extras=self.extras,
            run_config={
                "job": "lm", **config_dict(cfg), "vocab_size": vocab, ROW_DTYPES_KEY: dtypes
            },
            shape_options=SHAPE_OPTIONS,
        )  # fmt: skip

    def say(self, text: str) -> None:
        if self.cfg.verbose and self.group.rank == 0:
            print(text, flush=True)

    def memory_plan(self, tables: list[TableConfig], trained: nn.Module) -> MemoryPlan:
        """Where this rank's run keeps its memory (:mod:`hybridrec.launch.memory_plan`): the
        tables it holds (none on a rank that runs no first pipeline stage), the cache,
        its part of the GPT (AdamW: two moments per weight, sharded over dp with ZeRO)."""
        cfg, par, device = self.cfg, self.par, self.device
        assert par.tables is not None
        shards = par.dp.size if cfg.zero_stage else 1
        return job_memory_plan(
            cfg, cfg.ps, tables, device, workers=self.group.size, rank=par.tables.rank,
            world_size=par.tables.size, dense=dense_bytes(trained, 2, shards),
            dense_note="weights, gradients, AdamW state" + (
                f" over {shards} ranks" if shards > 1 else ""
            ),
        )  # fmt: skip

    def describe_ngrams(self) -> str:
        ng = self.ngrams
        if ng is None:
            return ""
        rows = f"{ng.rows} rows" if ng.rows else "dynamic (rows for the n-grams seen)"
        split = f", {ng.splits} sub-tables of {ng.dim // ng.splits} per n" if ng.splits > 1 else ""
        return (
            f" + n-gram tables n = 2..{ng.max_n}: {rows} x {ng.dim} each{split} "
            f"({ng.placement}, zero-started)"
        )

    def extras(self) -> dict[str, float]:
        """Counters for the metrics file's step lines: n-gram rows of the last batch
        (this rank), and the cache's or the store's traffic."""
        row: dict[str, float] = {}
        if self.model.embeddings is not None:
            self.model.embeddings.drain()  # no store call in flight while they are read
        if self.ngrams is not None:
            row["ngram_rows"] = float(self.model.ngram_rows)
        if self.cached is not None:
            row.update(cache_metrics(self.cached.cache_stats()))
        elif "hybrid" in self.cfg.placements():
            row.update(store_metrics(self.store.stats()))
        return row

    def ngram_traffic(self) -> int | None:
        """Rows of the n-gram tables pulled + pushed so far, counted by the store (what
        reached it through the cache, if any: a cache shared by several tables counts
        them together); None when they have no store (sharded, local)."""
        if self.ngrams is None or self.ngrams.placement != "hybrid":
            return None
        stats = (self.cached if self.cached is not None else self.store).stats()
        names = self.ngram_tables
        return int(sum(s["rows_pulled"] + s["rows_pushed"] for n, s in stats.items() if n in names))

    def load_saved(self, folder: str | Path) -> None:
        """Collective: a saved model (a checkpoint's ``model/``) in place of this job's,
        its token tables settled for scoring: nothing in flight, no cached copies (the
        store's rows are scored)."""
        if self.model.embeddings is not None:
            self.model.embeddings.set_sparse_pipeline(False)
        if self.cached is not None:
            self.cached.flush()
        self.trainer.load_saved_model(folder)
        if self.cached is not None:
            self.cached.clear()

    def evaluate_saved(self, evaluation: Any) -> dict[str, Any]:
        """Collective: a saved model's validation loss, perplexity and bits per byte
        (``hybridrec evaluate``; the GPT's corpus has a validation split only)."""
        for split in evaluation.splits:
            if split != "val":
                raise ValueError(
                    f"--split {split}: the language model's corpus has a val split only"
                )
        if evaluation.slice_by is not None:
            raise ValueError("--slice-by: the language model has no features to slice by")
        self.load_saved(evaluation.model)
        self.say(f"evaluating {evaluation.model} (step {evaluation.meta.get('step')})")
        row = self.validate()
        loss = row["val_loss"]
        result = {
            "kind": "evaluate", "checkpoint": str(evaluation.checkpoint),
            "model": str(evaluation.model), "step": evaluation.meta.get("step"), **row,
            "val_nats_per_byte": loss / self.bytes_per_token,
            "val_bits_per_byte": loss / self.bytes_per_token / math.log(2),
        }  # fmt: skip
        self.say(
            f"val loss {loss:.4f}  ppl {row['val_ppl']:.2f}  "
            f"{result['val_bits_per_byte']:.3f} bits/byte"
        )
        return result

    def validate(self) -> dict[str, Any]:
        """Validation loss (nats per token) and perplexity (collective)."""
        if self.model.embeddings is not None:
            self.model.embeddings.drain()
        before = self.ngram_traffic()
        model, par = self.model, self.par
        if self.dense.pipeline is None:

            def batch_loss(x: torch.Tensor, y: torch.Tensor) -> float:
                with autocast(self.device, self.cfg.precision):
                    return float(par.loss(model(x), y))

            loss = evaluate(model, self.val, self.group, batch_loss, self.feed)
        else:
            loss = evaluate(
                model,
                self.val,
                self.group,
                lambda x, y: pipeline_loss(model, self.dense, par, x, y),
                self.feed,
            )
        if before is not None:  # rows read for validation are not a training step's traffic
            self.eval_traffic += (self.ngram_traffic() or 0) - before
        return {"val_loss": loss, "val_ppl": math.exp(loss)}

    def show(self, row: dict[str, Any]) -> None:
        loss = row["val_loss"]
        bits = f"  {loss / math.log(2):.3f} bits/byte" if self.tokenizer.name == "byte" else ""
        train_part = "" if row["train_loss"] is None else f"train loss {row['train_loss']:.4f}  "
        ppl = f"ppl {row['val_ppl']:.2f}"
        hits = ""
        if self.cached is not None:  # what the cache saved so far (hit rate over every lookup)
            if self.model.embeddings is not None:
                self.model.embeddings.drain()  # no push in flight while the counters are read
            rate = cache_metrics(self.cached.cache_stats())["cache_hit_rate"]
            hits = f"  cache hit rate {rate:.1%}"
        self.say(f"step {row['step']:5d}: {train_part}val loss {loss:.4f}  {ppl}{bits}{hits}")

    def close(self, run: TrainResult) -> dict[str, Any]:
        """The summary (this run's rates), written to the metrics file; returns it."""
        cfg, evals = self.cfg, run.evals
        if self.model.embeddings is not None:
            self.model.embeddings.set_sparse_pipeline(False)  # every push applied, thread gone
        if self.cached is not None:
            self.cached.flush()
        tokens_per_s = run.samples_per_s * cfg.block_size  # this run's steps only
        result: dict[str, Any] = {
            "kind": "final",
            "config": config_dict(cfg),
            "corpus": self.corpus.name,
            "tokenizer": self.tokenizer.name,
            "vocab_size": self.vocab,
            "world_size": self.group.size,
            "device": str(self.device),
            "steps": run.step,
            "steps_run": run.steps_run,
            "already_finished": run.already_finished,
            "evals": evals,
            "val_loss": evals[-1]["val_loss"],
            "val_ppl": evals[-1]["val_ppl"],
            "train_seconds": run.train_seconds,
            "tokens_per_s": tokens_per_s,
            "dense_optimizer_state_bytes": optimizer_state_bytes(self.optimizer),  # rank 0's
            # validation loss per byte of text: nats per token over the corpus's bytes per token
            "val_nats_per_byte": evals[-1]["val_loss"] / self.bytes_per_token,
            "step_seconds": run.train_seconds / max(run.steps_run, 1),
            "memory": self.memory.to_json(),
        }
        if self.ngrams is not None:
            steps = max(run.steps_run, 1)
            result["ngram_rows_per_step"] = self.model.ngram_rows_total / steps  # this rank's
            moved = self.ngram_traffic()
            if moved is not None:  # training steps only
                result["ngram_rows_moved_per_step"] = (moved - self.eval_traffic) / steps
        if self.cached is not None:
            result["cache"] = self.cached.cache_stats()
            result.update(cache_metrics(result["cache"]))
        self.say(
            f"final val loss {result['val_loss']:.4f} (ppl {result['val_ppl']:.2f}), from "
            f"{evals[0]['val_loss']:.4f} | {tokens_per_s:.0f} tokens/s ({run.steps_run} steps, "
            f"{run.train_seconds:.1f} s) | dense optimizer state "
            f"{result['dense_optimizer_state_bytes'] / 1024:.0f} KiB per rank"
        )
        self.trainer.write(result)
        self.trainer.close()
        return result


def main(argv: list[str] | None = None) -> None:
    """The job from the command line (:func:`hybridrec.cli.run_job.run_job`)."""
    run_job(LMJob, argv)

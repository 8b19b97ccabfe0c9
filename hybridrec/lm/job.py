"""Train a GPT language model with a sparse token embedding, on 1 or N ranks.

    python examples/train_lm.py                         # Shakespeare (or stdlib source), bytes
    mpirun -n 2 python examples/train_lm.py             # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --zero-stage 1
    python examples/train_lm.py --tokenizer gpt2 --d-model 128 --steps 1000
    python examples/train_lm.py --checkpoint-dir ckpt --checkpoint-every 100 --resume

Config -> build -> train -> close, on :class:`hybridrec.trainer.Trainer` and
:class:`hybridrec.launch.Launch`. The model (``hybridrec/lm/model.py``) is a token
table in an ``embedding.EmbeddingCollection`` (hybrid: rows in the ``--ps`` store,
only a batch's rows move; sharded; or local) feeding ``dense.GPT`` under
``dense.DataParallel`` (optionally compressed) or ``dense.ZeroOptimizer``.

Every rank reads the corpus and trains on its slice of each global batch of random
windows (the same global batch for any rank count). Rank 0 prints the validation
loss (nats per token), perplexity and, for bytes, bits per byte, and writes the
metrics file and its plot. ``--help`` lists every option.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from comm import ProcessGroup, Topology
from dense.gpt import GPT, GPTConfig, gpt_loss
from embedding import EmbeddingCollection
from hybridrec.config import build_parser as build_config_parser
from hybridrec.config import parse_config
from hybridrec.datasets.text import (
    eval_batches,
    get_batch,
    load_corpus,
    make_tokenizer,
    split_tokens,
    tokenize,
)
from hybridrec.launch import Launch, check_batch_size, describe_roles, prepare_tables, with_cache
from hybridrec.lm.config import LMConfig
from hybridrec.lm.model import (
    LanguageModel,
    embed_tokens,
    make_dense_optimizer,
    optimizer_state_bytes,
    token_table,
)
from hybridrec.metrics_log import cache_metrics
from hybridrec.trainer import Trainer, TrainerConfig, plain_step
from ps import InProcessStore, Store

__all__ = ["LMConfig", "build_parser", "embed_tokens", "main", "parse_args", "train"]

DESCRIPTION = __doc__.split("\n")[0]
# Options that change the shapes a checkpoint holds: a resume names those that differ.
SHAPE_OPTIONS = (
    "tokenizer", "vocab_size", "d_model", "n_layer", "n_head", "block_size", "placement",
    "emb_optimizer", "zero_stage",
)  # fmt: skip


def build_parser() -> Any:
    return build_config_parser(LMConfig, DESCRIPTION)


def parse_args(argv: list[str] | None = None) -> LMConfig:
    return parse_config(LMConfig, argv, DESCRIPTION)


@torch.no_grad()
def evaluate(
    model: LanguageModel, batches: list[tuple[torch.Tensor, torch.Tensor]], group: ProcessGroup
) -> float:
    """Mean next-token loss over the validation windows of every rank (nats per token)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)  # [sum of token losses, tokens]
    for x, y in batches:
        total[0] += float(gpt_loss(model(x), y)) * y.numel()
        total[1] += y.numel()
    model.train()
    group.allreduce(total, op="sum")
    return float(total[0] / total[1])


class Windows:
    """This rank's slice of the global batch of random windows of each step: ``(x, y)``,
    ``[b, T]`` token ids and their next tokens. Step ``s``'s windows depend only on
    ``(seed, s)``, so a resumed run continues with the same ones."""

    def __init__(self, tokens: torch.Tensor, cfg: LMConfig, group: ProcessGroup) -> None:
        self.tokens, self.cfg, self.group = tokens, cfg, group

    steps_per_epoch = None  # no epochs: the run ends at --steps (the trainer's max_steps)

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
    """Train and evaluate on the workers ``group``; ``store`` holds a hybrid token table
    (default: a fresh in-process store); ``roles``, the whole job's (for the header;
    default: ``group`` alone). Returns the metrics (equal on every rank but for timings)."""
    before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        store = InProcessStore() if store is None else store
        return _train(cfg, group, store, roles or Topology.of(group))
    finally:
        torch.set_num_threads(before)


def _train(cfg: LMConfig, group: ProcessGroup, store: Store, roles: Topology) -> dict[str, Any]:
    say = print if (cfg.verbose and group.rank == 0) else (lambda *a, **k: None)
    check_batch_size(cfg.batch_size, Topology.of(group))
    corpus = load_corpus(cfg.text_dir, max_bytes=cfg.max_bytes)
    tokenizer = make_tokenizer(cfg.tokenizer, cfg.bpe_file)
    splits = split_tokens(tokenize(corpus.text, tokenizer))
    vocab = tokenizer.vocab_size
    say(f"corpus {corpus.description}")
    say(
        f"tokenizer {tokenizer.name} (vocab {vocab}): {len(splits.train)} train / "
        f"{len(splits.val)} validation tokens"
    )

    # ---- build
    torch.manual_seed(cfg.seed)  # the same GPT init everywhere (rank 0's is broadcast anyway)
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
    trained, opt = make_dense_optimizer(cfg, gpt, group)
    cached = with_cache(cfg, store, group)
    table = token_table(cfg, vocab)
    if table.placement == "hybrid":
        prepare_tables(store, [table.to_spec()], group, cfg.tables_policy)
    tokens = EmbeddingCollection(
        [table], store=cached if cached is not None else store, group=group
    )
    model = LanguageModel(tokens, trained)
    say(
        f"GPT {cfg.n_layer}x{cfg.d_model} ({gpt.num_parameters()} dense parameters) + token "
        f"table {vocab}x{cfg.d_model} ({cfg.placement}, {cfg.emb_optimizer}); "
        f"{describe_roles(roles, group.backend)}, zero stage {cfg.zero_stage}"
    )
    val = eval_batches(
        splits.val,
        num_batches=cfg.eval_batches,
        global_batch=cfg.batch_size,
        block_size=cfg.block_size,
        rank=group.rank,
        size=group.size,
    )

    def validate() -> dict[str, Any]:
        loss = evaluate(model, val, group)
        return {"val_loss": loss, "val_ppl": math.exp(loss)}

    def show(row: dict[str, Any]) -> None:
        loss = row["val_loss"]
        bits = f"  {loss / math.log(2):.3f} bits/byte" if tokenizer.name == "byte" else ""
        train_part = "" if row["train_loss"] is None else f"train loss {row['train_loss']:.4f}  "
        ppl = f"ppl {row['val_ppl']:.2f}"
        say(f"step {row['step']:5d}: {train_part}val loss {loss:.4f}  {ppl}{bits}")

    # ---- train: an evaluation first, every eval_every steps and after the last step
    trainer = Trainer(
        TrainerConfig(
            max_steps=cfg.steps, samples_per_step=cfg.batch_size, log_every=cfg.log_every,
            eval_every=cfg.eval_every, eval_at_start=True, eval_at_end=True, epoch_rows=False,
            checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every,
            checkpoint_keep=cfg.checkpoint_keep, resume=cfg.resume, metrics_out=cfg.metrics_out,
            progress=cfg.progress, verbose=cfg.verbose,
        ),
        group=group, optimizer=opt, data=Windows(splits.train, cfg, group),
        step=plain_step(model, gpt_loss, opt), dense=gpt, embeddings=tokens,
        evaluate=validate, on_row=show,
        extras=(lambda: cache_metrics(cached.cache_stats())) if cached is not None else None,
        run_config={**asdict(cfg), "vocab_size": vocab}, shape_options=SHAPE_OPTIONS,
    )  # fmt: skip
    run = trainer.fit()
    if cached is not None:
        cached.flush()

    # ---- close
    evals = run.evals
    tokens_per_s = run.samples_per_s * cfg.block_size  # this run's steps only
    result: dict[str, Any] = {
        "kind": "final",
        "config": asdict(cfg),
        "corpus": corpus.name,
        "tokenizer": tokenizer.name,
        "vocab_size": vocab,
        "world_size": group.size,
        "steps": run.step,
        "steps_run": run.steps_run,
        "already_finished": run.already_finished,
        "evals": evals,
        "val_loss": evals[-1]["val_loss"],
        "val_ppl": evals[-1]["val_ppl"],
        "train_seconds": run.train_seconds,
        "tokens_per_s": tokens_per_s,
        "dense_optimizer_state_bytes": optimizer_state_bytes(opt),  # this rank's (rank 0)
    }
    if cached is not None:
        result["cache"] = cached.cache_stats()
        result.update(cache_metrics(result["cache"]))
    say(
        f"final val loss {result['val_loss']:.4f} (ppl {result['val_ppl']:.2f}), from "
        f"{evals[0]['val_loss']:.4f} | {tokens_per_s:.0f} tokens/s ({run.steps_run} steps, "
        f"{run.train_seconds:.1f} s) | dense optimizer state "
        f"{result['dense_optimizer_state_bytes'] / 1024:.0f} KiB per rank"
    )
    trainer.write(result)
    trainer.close()
    return result


def main(argv: list[str] | None = None) -> None:
    """Config -> launch (roles, store) -> train -> close."""
    cfg = parse_args(argv)
    with Launch(cfg.backend, ps=cfg.ps, batch_size=cfg.batch_size,
                validate=cfg.validate_comm) as job:  # fmt: skip
        if job.is_worker:  # a PS server rank has served inside Launch and skips this
            train(cfg, job.group, job.store, roles=job.topology)

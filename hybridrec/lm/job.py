"""Train a GPT language model with a sparse token embedding, on 1 or N ranks.

    python examples/train_lm.py                         # Shakespeare (or stdlib source), bytes
    mpirun -n 2 python examples/train_lm.py             # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --zero-stage 1
    python examples/train_lm.py --tokenizer gpt2 --d-model 128 --steps 1000
    python examples/train_lm.py --checkpoint-dir ckpt --checkpoint-every 100 --resume

Config -> build -> train -> close. The model (``hybridrec/lm/model.py``) is a token
table in an ``embedding.EmbeddingCollection`` (hybrid: rows in the ``--ps`` store,
only a batch's rows move; sharded; or local) feeding ``dense.GPT`` under
``dense.DataParallel`` (optionally compressed) or ``dense.ZeroOptimizer``.

Every rank reads the corpus and trains on its slice of each global batch of random
windows (the same global batch for any rank count). Rank 0 prints the validation
loss (nats per token), perplexity and, for bytes, bits per byte, and writes the
metrics file and its plot. ``--help`` lists every option.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

import torch

import comm
from comm import ProcessGroup
from dense import DataParallel
from dense.gpt import GPT, GPTConfig, gpt_loss
from embedding import EmbeddingCollection
from hybridrec.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
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
from hybridrec.launch import (
    PSRole,
    create_shared_tables,
    open_ps,
    topology_for,
    with_cache,
)
from hybridrec.lm.config import LMConfig
from hybridrec.lm.model import (
    LanguageModel,
    embed_tokens,
    make_dense_optimizer,
    optimizer_state_bytes,
    token_table,
)
from hybridrec.metrics_log import MetricsLog, cache_metrics
from hybridrec.step_log import StepLog, due
from ps import InProcessStore, Store

__all__ = ["LMConfig", "build_parser", "embed_tokens", "main", "parse_args", "train"]

DESCRIPTION = __doc__.split("\n")[0]


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


def train(cfg: LMConfig, group: ProcessGroup, store: Store | None = None) -> dict[str, Any]:
    """Train and evaluate on the workers ``group``; ``store`` holds a hybrid token table
    (default: a fresh in-process store). Returns the metrics (equal on every rank but
    for timings)."""
    before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, group, InProcessStore() if store is None else store)
    finally:
        torch.set_num_threads(before)


def _train(cfg: LMConfig, group: ProcessGroup, store: Store) -> dict[str, Any]:
    say = print if (cfg.verbose and group.rank == 0) else (lambda *a, **k: None)
    if cfg.batch_size % group.size:
        raise ValueError(
            f"batch_size {cfg.batch_size} must be a multiple of the {group.size} worker ranks"
        )
    corpus = load_corpus(cfg.text_dir, max_bytes=cfg.max_bytes)
    tokenizer = make_tokenizer(cfg.tokenizer, cfg.bpe_file)
    splits = split_tokens(tokenize(corpus.text, tokenizer))
    vocab = tokenizer.vocab_size
    say(f"corpus {corpus.description}")
    say(
        f"tokenizer {tokenizer.name} (vocab {vocab}): {len(splits.train)} train / "
        f"{len(splits.val)} validation tokens"
    )

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
        create_shared_tables(store, [table.to_spec()], group)
    tokens = EmbeddingCollection(
        [table], store=cached if cached is not None else store, group=group
    )
    model = LanguageModel(tokens, trained)
    say(
        f"GPT {cfg.n_layer}x{cfg.d_model} ({gpt.num_parameters()} dense parameters) + token "
        f"table {vocab}x{cfg.d_model} ({cfg.placement}, {cfg.emb_optimizer}); {group.size} rank(s) "
        f"({group.backend}), zero stage {cfg.zero_stage}"
    )
    val = eval_batches(
        splits.val,
        num_batches=cfg.eval_batches,
        global_batch=cfg.batch_size,
        block_size=cfg.block_size,
        rank=group.rank,
        size=group.size,
    )

    start = 0
    resume_from = (
        latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir and cfg.resume else None
    )
    if resume_from is not None:
        meta, _ = load_checkpoint(
            resume_from, group=group, dense=gpt, optimizer=opt, embeddings=tokens
        )
        start = meta["step"]
        say(f"resumed from {resume_from} at step {start}")
    log = MetricsLog(cfg.metrics_out if group.rank == 0 else None, append=resume_from is not None)
    steps = StepLog(
        group=group, log=log, log_every=cfg.log_every, samples_per_step=cfg.batch_size,
        total_steps=cfg.steps, start_step=start, progress=cfg.progress,
        extras=(lambda: cache_metrics(cached.cache_stats())) if cached is not None else None,
    )  # fmt: skip

    evals: list[dict[str, Any]] = []
    loss_sum = torch.zeros(2, dtype=torch.float64)  # [sum of local mean losses, steps]
    train_seconds = 0.0

    def log_eval(step: int) -> None:
        nonlocal loss_sum
        group.allreduce(loss_sum, op="sum")
        val_loss = evaluate(model, val, group)
        trained_steps = float(loss_sum[1])
        row = {
            "kind": "eval",
            "step": step,
            "train_loss": float(loss_sum[0] / loss_sum[1]) if trained_steps else None,
            "val_loss": val_loss,
            "val_ppl": math.exp(val_loss),
        }
        loss_sum = torch.zeros(2, dtype=torch.float64)
        evals.append(row)
        bits = f"  {val_loss / math.log(2):.3f} bits/byte" if tokenizer.name == "byte" else ""
        train_part = f"train loss {row['train_loss']:.4f}  " if trained_steps else ""
        say(f"step {step:5d}: {train_part}val loss {val_loss:.4f}  ppl {row['val_ppl']:.2f}{bits}")
        log.write(row)

    def checkpoint(step: int) -> None:
        assert cfg.checkpoint_dir is not None
        save_checkpoint(
            cfg.checkpoint_dir, step, group=group, dense=gpt, optimizer=opt, embeddings=tokens,
            meta={"config": asdict(cfg)}, keep=cfg.checkpoint_keep,
        )  # fmt: skip

    if start == 0:
        log_eval(0)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        x, y = get_batch(
            splits.train,
            step=step,
            seed=cfg.seed,
            global_batch=cfg.batch_size,
            block_size=cfg.block_size,
            rank=group.rank,
            size=group.size,
        )
        loss = gpt_loss(model(x), y)  # local mean over this rank's b * T tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()  # token rows pushed here; dense buckets allreduced meanwhile
        if isinstance(trained, DataParallel):
            trained.finish()
        opt.step()
        train_seconds += time.perf_counter() - t0
        loss_sum += torch.tensor([float(loss.detach()), 1.0], dtype=torch.float64)
        steps.step(step + 1, float(loss.detach()))
        if due(step + 1, cfg.eval_every) or step + 1 == cfg.steps:
            log_eval(step + 1)
        if cfg.checkpoint_dir and due(step + 1, cfg.checkpoint_every):
            checkpoint(step + 1)
    steps.flush(cfg.steps)
    steps.close()
    if not evals:  # resumed at the end: nothing trained, one evaluation for the summary
        log_eval(cfg.steps)
    if cached is not None:
        cached.flush()
    if cfg.checkpoint_dir:
        checkpoint(cfg.steps)

    done = cfg.steps - start
    tokens_per_s = done * cfg.batch_size * cfg.block_size / max(train_seconds, 1e-9)
    result: dict[str, Any] = {
        "kind": "final",
        "config": asdict(cfg),
        "corpus": corpus.name,
        "tokenizer": tokenizer.name,
        "vocab_size": vocab,
        "world_size": group.size,
        "evals": evals,
        "val_loss": evals[-1]["val_loss"],
        "val_ppl": evals[-1]["val_ppl"],
        "train_seconds": train_seconds,
        "tokens_per_s": tokens_per_s,
        "dense_optimizer_state_bytes": optimizer_state_bytes(opt),  # this rank's (rank 0)
    }
    if cached is not None:
        result["cache"] = cached.cache_stats()
        result.update(cache_metrics(result["cache"]))
    say(
        f"final val loss {result['val_loss']:.4f} (ppl {result['val_ppl']:.2f}), from "
        f"{evals[0]['val_loss']:.4f} | {tokens_per_s:.0f} tokens/s ({train_seconds:.1f} s) | "
        f"dense optimizer state {result['dense_optimizer_state_bytes'] / 1024:.0f} KiB per rank"
    )
    log.write(result)
    png = log.close()
    if png is not None:
        say(f"metrics: {cfg.metrics_out}, plot: {png}")
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    world = comm.init(cfg.backend, validate=cfg.validate_comm)
    role: PSRole | None = None
    try:
        topo = topology_for(cfg.ps, world)
        if cfg.batch_size % topo.num_workers:
            raise ValueError(
                f"batch_size {cfg.batch_size} must be a multiple of the {topo.num_workers} "
                f"worker rank(s) ({topo.world_size} ranks, {topo.num_servers} of them servers)"
            )
        role = open_ps(cfg.ps, world)  # a server rank serves here until the workers close
        if role.store is not None:
            train(cfg, role.group, role.store)
    finally:
        if role is not None and role.store is not None:
            role.store.close()
        world.close()

"""The language model of ``examples/train_lm.py``: a sparse token table + ``dense.GPT``.

The two parts are composed here (``dense`` never imports ``embedding``):

* the token embedding: an ``embedding.EmbeddingCollection`` with one table of
  ``vocab_size`` rows, unpooled (``pooling="none"``: ``[B, T, D]``). Hybrid placement:
  rows live in a parameter-server store; only the rows of the tokens in a batch are
  pulled and only their gradients pushed, and the store's optimizer (lazy Adam by
  default) updates them during backward. Sharded: rows split over the ranks, ids and
  rows travel by alltoallv. Local: a replicated in-process table.
* ``dense.GPT``: position embedding, decoder blocks, head; under ``dense.DataParallel``
  with AdamW, or with ZeRO stage 1/2 under ``dense.ZeroOptimizer``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ps
from comm import ProcessGroup
from dense import DataParallel, ZeroOptimizer
from dense.gpt import GPT
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from hybridrec.lm.config import LMConfig

TOKENS = "tokens"  # the one sparse feature: the token ids of a window


class LanguageModel(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, V]``: sparse token table, then the dense GPT."""

    def __init__(self, tokens: EmbeddingCollection, gpt: nn.Module) -> None:
        super().__init__()
        self.tokens = tokens
        self.gpt = gpt  # GPT, or DataParallel(GPT)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(embed_tokens(self.tokens, idx))  # [B, T, V]


def embed_tokens(tokens: EmbeddingCollection, idx: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token ids -> ``[B, T, D]`` rows of the token table: every window is one
    sample with exactly ``T`` ids, returned unpooled (``pooling="none"``)."""
    b, t = idx.shape
    lengths = torch.full((b,), t, dtype=torch.int64)  # [B]: T ids per sample
    return tokens(KeyedJaggedIds([TOKENS], idx.reshape(-1), lengths))[TOKENS]  # [B, T, D]


def token_table(cfg: LMConfig, vocab_size: int) -> TableConfig:
    opt: ps.Optimizer
    if cfg.emb_optimizer == "adam":
        opt = ps.Adam(lr=cfg.emb_lr)
    elif cfg.emb_optimizer == "adagrad":
        opt = ps.RowWiseAdagrad(lr=cfg.emb_lr)
    else:
        opt = ps.SGD(lr=cfg.emb_lr)
    return TableConfig(
        name="token_embedding",
        num_rows=vocab_size,
        dim=cfg.d_model,
        feature_names=[TOKENS],
        pooling="none",  # one vector per token: [B, T, D]
        placement=cfg.placement,
        optimizer=opt,
        init=ps.UniformInit(low=-0.035, high=0.035, seed=cfg.seed),  # std 0.02, as GPT-2
    )


def make_dense_optimizer(
    cfg: LMConfig, gpt: GPT, group: ProcessGroup
) -> tuple[nn.Module, torch.optim.Optimizer | ZeroOptimizer]:
    """The GPT as trained (wrapped in DataParallel or not) and its optimizer.

    Weight decay applies to every dense parameter (one parameter group), as
    ``ZeroOptimizer`` takes a plain parameter list; so every zero stage runs the
    same optimizer and the runs are comparable.
    """
    kw: dict[str, Any] = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if cfg.zero_stage == 0:  # DataParallel broadcasts rank 0's init
        trained = DataParallel(gpt, group, bucket_mb=cfg.bucket_mb, compression=cfg.compression)
        return trained, torch.optim.AdamW(gpt.parameters(), **kw)
    # ZeroOptimizer averages the gradients itself in step() (allreduce at stage 1,
    # reduce-scatter into the owner's shard at stage 2): no DataParallel around the GPT.
    opt = ZeroOptimizer(torch.optim.AdamW, gpt.parameters(), group, stage=cfg.zero_stage, **kw)
    return gpt, opt


def optimizer_state_bytes(opt: torch.optim.Optimizer | ZeroOptimizer) -> int:
    """Bytes of dense optimizer state on this rank (AdamW: two moments per element)."""
    if isinstance(opt, ZeroOptimizer):
        return opt.state_bytes()
    return sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )

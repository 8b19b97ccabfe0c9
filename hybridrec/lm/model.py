"""The language model of ``examples/train_lm.py``: sparse input tables + ``dense.GPT``.

The two parts are composed here (``dense`` never imports ``embedding``):

* the input embedding: an ``embedding.EmbeddingCollection`` with the token table of
  ``vocab_size`` rows, unpooled (``pooling="none"``: ``[B, T, D]``), and with
  ``--ngram N > 1`` the hashed n-gram tables of :mod:`embedding.ngram` (n = 2..N,
  zero-started), whose rows are added to the token rows. Hybrid placement: rows live
  in a parameter-server store; only the rows of a batch's tokens and n-grams are
  pulled and only their gradients pushed, and the store's optimizer (lazy Adam by
  default) updates them during backward. Sharded: rows split over the ranks, ids and
  rows travel by alltoallv. Local: a replicated in-process table. The token table and
  the n-gram tables choose their placements separately; the type their rows are stored
  in (``--emb-dtype``, per table ``--emb-dtype-of``) is every table's own.
* ``dense.GPT``: position embedding, decoder blocks, head; under ``dense.DataParallel``
  with AdamW, with ZeRO stage 1/2 under ``dense.ZeroOptimizer``, or stage 3 under
  ``dense.Zero3`` (split by tp and pp in :mod:`hybridrec.lm.parallel`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ps
from comm import ProcessGroup
from dense import DataParallel, Zero3, ZeroOptimizer
from dense.gpt import GPT
from embedding import EmbeddingCollection, KeyedJaggedIds, NGramConfig, TableConfig
from hybridrec.checkpoint.run_checkpoint import DenseOptimizer
from hybridrec.launch.job_cache import row_optimizer, with_row_dtypes
from hybridrec.lm.config import LMConfig

TOKENS = "tokens"  # the token ids of a window; the n-gram features are named by NGramConfig
TOKEN_TABLE = "token_embedding"


class LanguageModel(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, V]``: sparse input tables, then the dense GPT.

    ``embeddings`` holds the token table and, when ``ngrams`` is given, its tables.
    ``ngram_rows`` is the number of distinct n-gram rows the last training batch of
    this rank touched (0 without n-gram tables), ``ngram_rows_total`` their sum over
    the training batches so far.
    """

    def __init__(
        self,
        embeddings: EmbeddingCollection | None,
        gpt: nn.Module,
        ngrams: NGramConfig | None = None,
    ) -> None:
        super().__init__()
        self.embeddings = embeddings  # None on pipeline stages that look nothing up
        self.gpt = gpt  # GPT, or DataParallel(GPT); this rank's stages under a pipeline
        self.ngrams = ngrams
        # Counts kept where the ids are (0-dim int64): read only when reported, so a GPU
        # step does not wait for them.
        self._rows: torch.Tensor | int = 0
        self._rows_total: torch.Tensor | int = 0

    @property
    def ngram_rows(self) -> int:
        return int(self._rows)

    @property
    def ngram_rows_total(self) -> int:
        return int(self._rows_total)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(self.embed(idx))  # [B, T, V] (or the tp rank's [B, T, V / tp])

    def prefetch(self, idx: torch.Tensor) -> None:
        """Announce the next batch's token ids ``[B, T]`` to the input tables (a cache or
        the sparse pipeline pulls their rows ahead)."""
        if self.embeddings is not None:
            self.embeddings.prefetch(input_batch(input_ids(idx, self.ngrams)))

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The input vectors ``[B, T, D]`` of token ids ``[B, T]`` (counting the distinct
        n-gram rows of a training batch)."""
        assert self.embeddings is not None, "this pipeline stage holds no input tables"
        features = input_ids(idx, self.ngrams)
        if self.training and self.ngrams is not None:  # one sort of B*T ids per n-gram table
            self._rows = sum(
                (distinct_count(ids) for f, ids in features.items() if f != TOKENS),
                torch.zeros((), dtype=torch.int64, device=idx.device),
            )
            self._rows_total = self._rows_total + self._rows
        return embed_ids(self.embeddings, features, self.ngrams)


def distinct_count(ids: torch.Tensor) -> torch.Tensor:
    """The number of distinct values of ``ids`` as a 0-dim int64 tensor on their device
    (a sort and a compare of neighbours: no read back, unlike ``torch.unique``)."""
    flat = ids.reshape(-1).sort().values  # [N]
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=ids.device)
    return (flat[1:] != flat[:-1]).sum() + 1


def input_ids(idx: torch.Tensor, ngrams: NGramConfig | None = None) -> dict[str, torch.Tensor]:
    """``{feature: [B, T] int64}``: the token ids ``idx`` and, with ``ngrams``, the ids of
    the n-grams ending at each position."""
    return {TOKENS: idx} | (ngrams.ids(idx) if ngrams is not None else {})


def embed_ids(
    tables: EmbeddingCollection, features: dict[str, torch.Tensor], ngrams: NGramConfig | None
) -> torch.Tensor:
    """The input vectors ``[B, T, D]``: token rows plus the n-gram rows. Every window is
    one sample with exactly ``T`` ids per feature, returned unpooled (``pooling="none"``);
    all features go through the collection in one batch (one dedup, one pull per store)."""
    out = tables(input_batch(features))  # {feature: [B, T, width]}
    return out[TOKENS] if ngrams is None else out[TOKENS] + ngrams.combine(out)


def input_batch(features: dict[str, torch.Tensor]) -> KeyedJaggedIds:
    """The collection's batch of ``{feature: [B, T]}`` ids: every window one sample with
    exactly ``T`` ids per feature, feature-major."""
    b, t = features[TOKENS].shape
    lengths = torch.full((b * len(features),), t, dtype=torch.int64)  # [F * B]: T ids each
    ids = torch.cat([v.reshape(-1) for v in features.values()])  # [F * B * T]
    return KeyedJaggedIds(list(features), ids, lengths)


def embed_tokens(
    tables: EmbeddingCollection, idx: torch.Tensor, ngrams: NGramConfig | None = None
) -> torch.Tensor:
    """``[B, T]`` token ids -> ``[B, T, D]`` input vectors (see :func:`embed_ids`)."""
    return embed_ids(tables, input_ids(idx, ngrams), ngrams)


def input_tables(cfg: LMConfig, vocab_size: int, ngrams: NGramConfig | None) -> list[TableConfig]:
    """The token table and the n-gram tables of ``ngrams``, each with the row type
    ``--emb-dtype`` / ``--emb-dtype-of`` give it (an override of a table the job does
    not have is a ValueError naming it and the tables)."""
    tables = [token_table(cfg, vocab_size), *(ngrams.tables() if ngrams else [])]
    return with_row_dtypes(cfg, tables)


def token_table(cfg: LMConfig, vocab_size: int) -> TableConfig:
    """The token table, fp32 (:func:`input_tables` gives it the job's row type)."""
    return TableConfig(
        name=TOKEN_TABLE,
        num_rows=vocab_size,
        dim=cfg.d_model,
        feature_names=[TOKENS],
        pooling="none",  # one vector per token: [B, T, D]
        placement=cfg.placement,
        optimizer=row_optimizer(cfg.emb_optimizer, cfg.emb_lr),
        init=ps.UniformInit(low=-0.035, high=0.035, seed=cfg.seed),  # std 0.02, as GPT-2
    )


def ngram_config(cfg: LMConfig) -> NGramConfig | None:
    """The n-gram tables ``--ngram`` asks for (None for ``--ngram 1``). Their hash seed is
    fixed, not ``--seed``: a run's n-gram ids must not depend on its initialisation."""
    if cfg.ngram < 2:
        return None
    return NGramConfig(
        max_n=cfg.ngram,
        rows=cfg.ngram_rows or None,
        dim=cfg.d_model,
        splits=cfg.ngram_splits,
        placement=cfg.ngram_placement,
        optimizer=row_optimizer(cfg.emb_optimizer, cfg.emb_lr),
        capacity=cfg.ngram_capacity or None,
        max_age_steps=cfg.ngram_max_age or None,
    )


def adamw_options(cfg: LMConfig) -> dict[str, Any]:
    return dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def make_dense_optimizer(
    cfg: LMConfig, gpt: GPT, group: ProcessGroup
) -> tuple[nn.Module, DenseOptimizer]:
    """The GPT as trained (wrapped in DataParallel or not) and its optimizer.

    Weight decay applies to every dense parameter (one parameter group), as
    ``ZeroOptimizer`` takes a plain parameter list; so every zero stage runs the
    same optimizer and the runs are comparable.
    """
    kw = adamw_options(cfg)
    if cfg.zero_stage == 0:  # DataParallel broadcasts rank 0's init
        trained = DataParallel(gpt, group, bucket_mb=cfg.bucket_mb, compression=cfg.compression)
        return trained, torch.optim.AdamW(gpt.parameters(), **kw)
    if cfg.zero_stage == 3:  # parameters sharded too: gathered block by block by hooks
        return gpt, Zero3(gpt, group, torch.optim.AdamW, **kw)
    # ZeroOptimizer averages the gradients itself in step() (allreduce at stage 1,
    # reduce-scatter into the owner's shard at stage 2): no DataParallel around the GPT.
    opt = ZeroOptimizer(torch.optim.AdamW, gpt.parameters(), group, stage=cfg.zero_stage, **kw)
    return gpt, opt


def optimizer_state_bytes(opt: DenseOptimizer) -> int:
    """Bytes of dense optimizer state on this rank (AdamW: two moments per element)."""
    if isinstance(opt, ZeroOptimizer):
        return opt.state_bytes()
    if isinstance(opt, Zero3):
        opt = opt.optimizer  # the inner optimizer of the shards
    return sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )

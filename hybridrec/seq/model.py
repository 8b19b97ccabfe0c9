"""The next-item recommender of ``examples/train_seq.py``: one item table + an encoder.

The two parts are composed here (``dense`` never imports ``embedding``):

* the item table: one ``embedding.EmbeddingCollection`` table of ``V`` rows (local,
  sharded, or hybrid in any ``--ps`` store behind the cache) read twice per step, as
  two features of one lookup (one dedup, one pull per store): ``history``, the rows of
  the batch's input items, and ``candidates``, the rows the softmax scores the hidden
  states against (every item, or the batch's items and the sampled negatives). The
  table is tied: input and output are the same rows, so a row's gradient is the sum of
  both uses, applied by the table's optimizer in backward.
* the encoder, ``dense.SASRec`` or ``dense.HSTU``: jagged input vectors ``[N, D]`` ->
  one hidden state per position ``[N, D]``, under ``dense.DataParallel`` with Adam or
  ``dense.ZeroOptimizer``.

Each input item is its own one-id lookup (``pooling="none"``, one sample per feature
whose length is the batch's item count), so jagged histories need no padding here.
"""

from __future__ import annotations

import torch
from torch import nn

import ps
from dense import HSTU, HSTUConfig, SASRec, SASRecConfig
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from hybridrec.datasets.sequences import SeqBatch
from hybridrec.launch.job_cache import row_optimizer
from hybridrec.seq.config import SeqConfig

HISTORY, CANDIDATES = "history", "candidates"  # the item table's two features
ITEM_TABLE = "items"


def item_table(cfg: SeqConfig, num_items: int) -> TableConfig:
    """The tied item table: ``num_items`` rows of ``--dim``, N(0, 0.02)-sized uniform init
    (std 0.02, as RecBole's SASRec initialises its item embedding)."""
    return TableConfig(
        name=ITEM_TABLE,
        num_rows=num_items,
        dim=cfg.dim,
        feature_names=[HISTORY, CANDIDATES],
        pooling="none",
        placement=cfg.table_placement,  # type: ignore[arg-type]  # resolved from auto
        optimizer=row_optimizer(cfg.emb_optimizer, cfg.emb_lr),
        init=ps.UniformInit(low=-0.0346, high=0.0346, seed=cfg.seed),  # std 0.02
    )


def build_encoder(cfg: SeqConfig) -> nn.Module:
    """``dense.SASRec`` or ``dense.HSTU`` of the job's shape (built from the current seed)."""
    if cfg.model == "sasrec":
        return SASRec(
            SASRecConfig(
                dim=cfg.dim, max_seq_len=cfg.max_seq_len, n_layer=cfg.n_layer,
                n_head=cfg.n_head, dropout=cfg.model_dropout, attn_dropout=cfg.model_dropout,
                positions=cfg.positions,
            )
        )  # fmt: skip
    return HSTU(
        HSTUConfig(
            dim=cfg.dim, max_seq_len=cfg.max_seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
            dropout=cfg.model_dropout, positions=cfg.positions,
        )
    )  # fmt: skip


def lookup_batch(items: torch.Tensor, candidates: torch.Tensor) -> KeyedJaggedIds:
    """The collection's batch: one sample per feature holding the input items ``[N]``
    and the candidate items ``[C]`` (either may be empty)."""
    lengths = torch.tensor([items.numel(), candidates.numel()], dtype=torch.int64)
    ids = torch.cat([items.reshape(-1).cpu(), candidates.reshape(-1).cpu()])
    return KeyedJaggedIds([HISTORY, CANDIDATES], ids, lengths)


class SeqModel(nn.Module):
    """A batch of jagged histories -> hidden states, and the item rows to score them by.

    ``embeddings`` holds the item table; ``encoder`` is SASRec or HSTU (or either under
    ``DataParallel``)."""

    def __init__(self, embeddings: EmbeddingCollection, encoder: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.encoder = encoder

    def forward(
        self, batch: SeqBatch, candidates: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [N, D], candidate rows [C, D])``: the state after every input position
        of ``batch`` and the rows of ``candidates`` ``[C]``, from one table lookup."""
        out = self.embeddings(lookup_batch(batch.items, candidates))
        vecs = out[HISTORY].reshape(-1, out[HISTORY].shape[-1])  # [1, N, D] -> [N, D]
        rows = out[CANDIDATES].reshape(-1, out[CANDIDATES].shape[-1])  # [C, D]
        return self.encoder(vecs, batch.offsets, batch.times), rows

    @torch.no_grad()
    def queries(self, batch: SeqBatch) -> torch.Tensor:
        """The state after each sample's last input ``[B, D]`` (what scores its next item)."""
        empty = torch.zeros(0, dtype=torch.int64)
        hidden, _ = self(batch, empty)
        last = batch.offsets[1:] - 1  # [B]; every evaluation sample has an input
        return hidden[last.to(hidden.device)]

    @torch.no_grad()
    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, D]`` of items ``ids`` ``[n]`` (a collective on a sharded table: every
        rank calls it alike, :mod:`hybridrec.seq.ranking`)."""
        empty = torch.zeros(0, dtype=torch.int64)
        out = self.embeddings(lookup_batch(empty, ids))
        return out[CANDIDATES].reshape(-1, out[CANDIDATES].shape[-1])

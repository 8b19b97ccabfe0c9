"""A small model on hybrid tables and its batches, for tests that train it two ways and
compare (through a cache or not, pipelined or not)."""

from __future__ import annotations

import torch
from torch import nn

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig


class TinyHybrid(nn.Module):
    """Two hybrid tables (``user``: one feature; ``item``: the features ``item`` and
    ``hist``), pooled, concatenated, one linear layer: a DLRM-ish loss."""

    def __init__(
        self, store: ps.Store, opt: ps.Optimizer, *, dim: int = 8, device: str | None = None
    ) -> None:
        super().__init__()
        tables = [
            TableConfig(name="user", num_rows=300, dim=dim, feature_names=["user"],
                        optimizer=opt, placement="hybrid"),
            TableConfig(name="item", num_rows=500, dim=dim, feature_names=["item", "hist"],
                        optimizer=opt, placement="hybrid"),
        ]  # fmt: skip
        self.emb = EmbeddingCollection(tables, store=store, device=device)
        torch.manual_seed(0)
        self.top = nn.Linear(3 * dim, 1, device=device)

    def forward(self, kjt: KeyedJaggedIds) -> torch.Tensor:
        pooled = self.emb(kjt)  # {feature: [B, dim]}
        return self.top(torch.cat([pooled[k] for k in kjt.keys], dim=1)).squeeze(1)  # [B]


def tiny_batch(g: torch.Generator, b: int = 32) -> tuple[KeyedJaggedIds, torch.Tensor]:
    """``b`` samples of skewed ``user``/``item`` ids and 0-3 ``hist`` ids; 0/1 labels."""
    user = (torch.randint(1, 60, (b,), generator=g) ** 1.5).long() % 300
    item = (torch.randint(1, 80, (b,), generator=g) ** 1.4).long() % 500
    hist_len = torch.randint(0, 4, (b,), generator=g)
    hist = (torch.randint(1, 80, (int(hist_len.sum()),), generator=g) ** 1.4).long() % 500
    ids = torch.cat([user, item, hist])
    ones = torch.ones(b, dtype=torch.int64)
    kjt = KeyedJaggedIds(["user", "item", "hist"], ids, torch.cat([ones, ones, hist_len]))
    return kjt, torch.randint(0, 2, (b,), generator=g).float()

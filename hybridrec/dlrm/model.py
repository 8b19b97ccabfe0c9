"""DLRM = sparse embeddings (``embedding.EmbeddingCollection``) + dense part
(``dense.DLRMDense``), composed for the example jobs.

One table per sparse feature, pooled with ``sum`` (``mean`` for multi-id features
such as genre lists, so the pooled vector's scale does not grow with the list).
Each table's placement (local, hybrid, sharded) and row type (fp32, fp16, bf16) is
chosen per table; embedding rows are trained by the table's row-wise Adagrad inside
``backward()``; only the dense part has ``nn.Parameter``s and a torch optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from comm import ProcessGroup, default_device
from dense import DLRMConfig, DLRMDense
from embedding import EmbeddingCollection, RowWiseAdagrad, TableConfig
from hybridrec.datasets.ctr import Batch, CTRData
from ps import Store

if TYPE_CHECKING:
    from hybridrec.dlrm.data import Feature


class DLRM(nn.Module):
    """``forward(batch) -> logits [B]`` for a :class:`Batch`."""

    def __init__(self, embeddings: EmbeddingCollection, dense: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.dense = dense  # DLRMDense, or DataParallel(DLRMDense)

    def forward(self, batch: Batch) -> torch.Tensor:
        def pooled() -> list[torch.Tensor]:  # [B, D] per feature
            out = self.embeddings(batch.sparse)
            return [out[k] for k in batch.sparse.keys]

        # The embeddings are looked up after the bottom MLP (``DLRMDense`` calls them),
        # so their backward runs before its backward and the sparse step overlaps it.
        return self.dense(batch.dense, pooled)  # [B]


def features_of(data: CTRData) -> list[Feature]:
    from hybridrec.dlrm.data import Feature

    return [Feature(f.name, f.num_rows, multi=f.ids.shape[1] > 1) for f in data.sparse]


def build_dlrm(
    features: Sequence[Feature] | CTRData,
    num_dense: int | None = None,
    *,
    dim: int,
    emb_lr: float,
    bottom_mlp: list[int] | None,
    top_mlp: list[int],
    seed: int,
    group: ProcessGroup,
    placements: Mapping[str, str] | None = None,
    store: Store | None = None,
    interaction: str = "dot",
    dcn_layers: int = 3,
    dcn_rank: int = 64,
    device: torch.device | None = None,
    dtypes: Mapping[str, str] | None = None,
) -> DLRM:
    """A DLRM for ``features``; the same ``seed`` gives the same model on every rank.

    ``features`` may be a :class:`CTRData` (its sparse features and dense width).
    ``placements`` maps table names to "local" (default), "hybrid" (rows in ``store``)
    or "sharded". ``bottom_mlp`` and ``top_mlp`` list the output width of every layer,
    as :class:`dense.DLRMConfig` does: the bottom MLP ends in ``dim`` (None: ``[64, dim]``),
    the top in 1. ``interaction``, ``dcn_layers`` and ``dcn_rank``: as in
    :class:`dense.DLRMConfig` (dot products, or a DCN-v2 cross network). ``device``:
    where the local and sharded tables and the dense part live (None: the group's
    default, :func:`comm.default_device`); hybrid tables stay in ``store``. ``dtypes``
    maps table names to the type their rows are stored in ("fp32" default, "fp16",
    "bf16": :class:`embedding.TableConfig` ``dtype``).
    """
    if isinstance(features, CTRData):
        num_dense = len(features.dense_names)
        features = features_of(features)
    if num_dense is None:
        raise ValueError("build_dlrm: num_dense is needed with a list of features")
    tables = dlrm_tables(features, dim=dim, emb_lr=emb_lr, placements=placements, dtypes=dtypes)
    embeddings = EmbeddingCollection(tables, group=group, store=store, device=device)
    config = DLRMConfig(
        num_dense=num_dense,
        num_sparse=len(tables),
        embedding_dim=dim,
        bottom_mlp=[64, dim] if bottom_mlp is None else list(bottom_mlp),
        top_mlp=list(top_mlp),
        interaction=interaction,
        dcn_layers=dcn_layers,
        dcn_rank=dcn_rank,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dense = DLRMDense(config)  # built on the host: the same initial weights on any device
    return DLRM(embeddings, dense.to(device or default_device(group)))


def dlrm_tables(
    features: Sequence[Feature],
    *,
    dim: int,
    emb_lr: float,
    placements: Mapping[str, str] | None = None,
    dtypes: Mapping[str, str] | None = None,
) -> list[TableConfig]:
    """One table per feature, named after it, with row-wise Adagrad; ``placements`` and
    ``dtypes`` by table name (default: local, fp32)."""
    where, dtype = dict(placements or {}), dict(dtypes or {})
    return [
        TableConfig(
            name=f.name,
            num_rows=f.num_rows,
            dim=dim,
            feature_names=[f.name],
            pooling="mean" if f.multi else "sum",
            placement=where.get(f.name, "local"),  # type: ignore[arg-type]
            optimizer=RowWiseAdagrad(lr=emb_lr),
            dtype=dtype.get(f.name, "fp32"),  # type: ignore[arg-type]
        )
        for f in features
    ]

"""DLRM = sparse embeddings (``embedding.EmbeddingCollection``) + dense part
(``dense.DLRMDense``), composed for the example jobs.

One table per sparse feature, pooled with ``sum`` (``mean`` for multi-id features
such as genre lists, so the pooled vector's scale does not grow with the list).
Embedding rows are trained by the collection's fused row-wise Adagrad inside
``backward()``; only the dense part has ``nn.Parameter``s and a torch optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from comm import ProcessGroup
from dense import DLRMConfig, DLRMDense
from embedding import EmbeddingCollection, RowWiseAdagrad, TableConfig
from examples.data.ctr import Batch, CTRData


class DLRM(nn.Module):
    """``forward(batch) -> logits [B]`` for a :class:`Batch` of a :class:`CTRData`."""

    def __init__(self, embeddings: EmbeddingCollection, dense: DLRMDense) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.dense = dense

    def forward(self, batch: Batch) -> torch.Tensor:
        pooled = self.embeddings(batch.sparse)  # {feature: [B, D]}
        return self.dense(batch.dense, [pooled[k] for k in batch.sparse.keys])  # [B]


def build_dlrm(
    data: CTRData,
    *,
    dim: int,
    emb_lr: float,
    bottom_mlp: list[int],
    top_mlp: list[int],
    seed: int,
    group: ProcessGroup,
) -> DLRM:
    """A DLRM sized for ``data``; the same ``seed`` gives the same model on every rank.

    ``bottom_mlp`` lists the hidden widths; its last layer (width ``dim``) is added.
    ``top_mlp`` likewise gets its final width-1 layer appended.
    """
    tables = [
        TableConfig(
            name=f.name,
            num_rows=f.num_rows,
            dim=dim,
            feature_names=[f.name],
            pooling="sum" if f.ids.shape[1] == 1 else "mean",
            optimizer=RowWiseAdagrad(lr=emb_lr),
        )
        for f in data.sparse
    ]
    embeddings = EmbeddingCollection(tables, group=group)
    config = DLRMConfig(
        num_dense=len(data.dense_names),
        num_sparse=len(data.sparse),
        embedding_dim=dim,
        bottom_mlp=[*bottom_mlp, dim],
        top_mlp=[*top_mlp, 1],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dense = DLRMDense(config)
    return DLRM(embeddings, dense)
